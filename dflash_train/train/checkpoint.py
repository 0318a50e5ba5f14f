"""Atomic, verified checkpoints: a checkpoint folder appears complete or not at all, and a damaged
one is recognised as damaged instead of being resumed from.

Layout of a drafter's run folder:
    run.json                       the run's config and the drafter config
    metrics.jsonl                  one JSON line per logged step
    checkpoints/step-00001000/     drafter.safetensors, trainer.pt, state.json
    checkpoints/latest             name of the newest complete checkpoint
    checkpoints/superseded/        checkpoints past the step a run of several drafters resumed from

Writing: each checkpoint is built in a hidden staging folder, fsynced file by file and renamed
into place by `files.write_dir_atomically`; only then is `latest` replaced (also fsynced), so a
crash at any moment leaves the previous checkpoint usable. A staging folder left by a kill
mid-save (`.step-*` next to the checkpoints) is removed at the next save; a checkpoint that was
renamed aside to be replaced is put back if its replacement never arrived. A failed write (a full
disk) raises CheckpointError naming the file and the OS's reason ("No space left on device").
What is written is a `CheckpointSnapshot` (the state copied to host memory), so the trainer
writes its periodic checkpoints from another thread while it goes on training (rank_zero.py).

Verifying: state.json records the size and CRC-32 of drafter.safetensors and trainer.pt. CRC-32
is the cheapest check that catches what a disk or a copy does to a file (truncation, flipped
bits: every burst of up to 32 bits, and all but 2^-32 of other damage), at several GB/s; it is no
defence against deliberate tampering, which is not the threat here. Loading checks the files it
reads; `resumable_checkpoint` checks whole checkpoints, newest first, and says which ones it
skipped and why. Checkpoints written before the checksums existed are checked by loading them.
"""

from __future__ import annotations

import copy
import errno
import json
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, TextIO

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from ..core.drafter import DFlashDrafter, DrafterConfig
from ..core.master_weights import trained_weights
from ..errors import UserError
from ..files import remove_leftover_staging, write_dir_atomically, write_text_atomic

STATE_FILE = "state.json"
WEIGHTS_FILE = "drafter.safetensors"
TRAINER_FILE = "trainer.pt"
_STEP_NAME = re.compile(r"step-\d+")
_CHUNK = 16 << 20


class CheckpointError(UserError):
    """A checkpoint that cannot be written or read back intact; the message names the file."""


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class _ChecksummedWriter:
    """A binary file that keeps the size and CRC-32 of what went through it, and the first OS
    error a write hit (torch.save reports it as "unexpected pos ..." after the fact)."""

    def __init__(self, handle: BinaryIO):
        self.handle, self.size, self.crc = handle, 0, 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return written

    def flush(self) -> None:
        self.handle.flush()


def _write_payload(path: Path, write: Callable[[_ChecksummedWriter], Any]) -> dict[str, int]:
    """Write one checkpoint file through `write`; its {"bytes", "crc32"} for state.json."""
    try:
        with open(path, "wb") as handle:
            out = _ChecksummedWriter(handle)
            try:
                write(out)
            except Exception as error:
                if out.error is not None and out.error is not error:
                    raise out.error from error
                raise
    except OSError as error:
        error.filename = error.filename or str(path)
        raise
    return {"bytes": out.size, "crc32": out.crc}


def _write_error(error: OSError, where: Path, final: Path, step: int, outcome: str) -> CheckpointError:
    """`error`, hit writing `where` (or a file inside it) for the checkpoint of `step`, as one
    line naming the file, the OS's reason and what is on disk now (`outcome`)."""
    if error.filename:
        where = Path(error.filename)
        if where.parent.name.startswith(f".{final.name}."):
            where = final / where.name  # the staging folder is gone: name the file as it would have been
    code = errno.errorcode.get(error.errno, "") if error.errno else ""
    reason = (error.strerror or str(error)) + (f" ({code})" if code else "")
    return CheckpointError(f"cannot write the checkpoint of step {step}: {where}: {reason}; {outcome}")


@dataclass(frozen=True)
class CheckpointSnapshot:
    """What a checkpoint holds, copied to host memory: the training may go on while it is written."""

    weights: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]  # the optimizer's and the scheduler's state dicts
    drafter_config: dict[str, Any]


def _to_host(value: Any) -> Any:
    """`value` with every tensor in it copied to the CPU (a copy even of a CPU tensor: the
    training updates its own in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(item) for item in value)
    return copy.deepcopy(value)


def checkpoint_snapshot(drafter: DFlashDrafter, optimizer: torch.optim.Optimizer | None,
                        scheduler: Any | None) -> CheckpointSnapshot:
    """The drafter's weights and the trainer's state as they are now, in host memory."""
    return CheckpointSnapshot(
        weights={k: v.contiguous() for k, v in _to_host(trained_weights(drafter, optimizer)).items()},
        trainer_state=_to_host({"optimizer": optimizer.state_dict() if optimizer is not None else None,
                                "scheduler": scheduler.state_dict() if scheduler is not None else None}),
        drafter_config=drafter.config.to_dict(),
    )


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write `checkpoints/step-<step>` atomically (fsynced before `latest` names it), then keep
    the `keep` newest complete checkpoints."""
    return write_checkpoint(run_dir, step, checkpoint_snapshot(drafter, optimizer, scheduler), state, keep)


def write_checkpoint(run_dir: str | Path, step: int, snapshot: CheckpointSnapshot, state: dict[str, Any],
                     keep: int = 2) -> Path:
    """`save_checkpoint` from a snapshot taken at `step` (any thread may write it)."""
    checkpoints = Path(run_dir) / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    remove_leftover_staging(checkpoints)  # what a save killed midway left (an aside checkpoint goes back)
    final = checkpoints / f"step-{step:08d}"

    def build(staging: Path) -> None:
        files = {WEIGHTS_FILE: _write_payload(staging / WEIGHTS_FILE,
                                              lambda out: out.write(save_safetensors(snapshot.weights)))}
        files[TRAINER_FILE] = _write_payload(staging / TRAINER_FILE, lambda out: torch.save(snapshot.trainer_state, out))
        full_state = {"step": step, "time": time.time(), "drafter_config": snapshot.drafter_config, **state,
                      "files": files}
        # state.json last: its presence inside the folder marks the payload as complete.
        _write_payload(staging / STATE_FILE, lambda out: out.write(json.dumps(full_state, indent=2).encode("utf-8")))

    try:
        # write_dir_atomically fsyncs every staged file and the folder before the rename.
        write_dir_atomically(final, build)
    except OSError as error:
        previous = latest_checkpoint(run_dir)
        kept = f"the newest complete checkpoint is still {previous}" if previous else "there is no earlier checkpoint"
        raise _write_error(error, final, final, step, f"nothing of it was kept and {kept}") from error
    try:
        write_text_atomic(checkpoints / "latest", final.name + "\n")
    except OSError as error:
        raise _write_error(error, checkpoints / "latest", final, step,
                           f"{final} itself is complete (--resume verifies and finds it)") from error
    _prune(checkpoints, keep, final)
    return final


def _complete_checkpoints(checkpoints: Path) -> list[Path]:
    return sorted(
        p for p in checkpoints.glob("step-*") if p.is_dir() and (p / STATE_FILE).is_file()
    )


def _prune(checkpoints: Path, keep: int, newest: Path) -> None:
    complete = _complete_checkpoints(checkpoints)
    for old in complete[: max(0, len(complete) - max(1, keep))]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Finding and verifying
# --------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names, else the highest complete step.
    Complete means renamed into place (state.json present), not verified: see
    `resumable_checkpoint`."""
    checkpoints = Path(run_dir) / "checkpoints"
    pointer = checkpoints / "latest"
    if pointer.is_file():
        name = pointer.read_bytes().decode("utf-8", "replace").strip()
        if _STEP_NAME.fullmatch(name) and (checkpoints / name / STATE_FILE).is_file():
            return checkpoints / name
    complete = _complete_checkpoints(checkpoints) if checkpoints.is_dir() else []
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder or a checkpoint folder -> the checkpoint folder."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint (expected {path}/checkpoints/step-*/{STATE_FILE})")
    return found


def read_state(checkpoint: str | Path) -> dict[str, Any]:
    """state.json of a checkpoint; CheckpointError if it is missing or damaged."""
    path = Path(checkpoint) / STATE_FILE
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint was never completed)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: damaged (not valid JSON: {error})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("drafter_config"), dict):
        raise CheckpointError(f"{path}: damaged (no integer 'step' and 'drafter_config' object)")
    folder = Path(checkpoint).name
    if _STEP_NAME.fullmatch(folder) and int(folder.removeprefix("step-")) != state["step"]:
        # The folder's name is written once by the trainer; a step that disagrees was edited.
        raise CheckpointError(f"{path}: damaged (step {state['step']} in state.json, but the folder is {folder}: "
                              "edited by hand?)")
    return state


def _crc32(path: Path) -> tuple[int, int]:
    size, crc = 0, 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while count := handle.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
            size += count
    return size, crc


def _verify_file(checkpoint: Path, state: dict[str, Any], name: str) -> bool:
    """Check `name` against the size and CRC-32 in state.json; False when none is recorded
    (a checkpoint from before checksums: the caller checks it by loading it)."""
    expected = (state.get("files") or {}).get(name)
    path = checkpoint / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    if expected is None:
        return False
    size, crc = _crc32(path)
    if size != expected.get("bytes"):
        raise CheckpointError(f"{path}: damaged ({size} bytes, {expected.get('bytes')} were written: truncated or overwritten)")
    if crc != expected.get("crc32"):
        raise CheckpointError(f"{path}: damaged (CRC-32 {crc:08x}, {expected.get('crc32', 0):08x} was written: flipped bytes)")
    return True


def _read_weights(checkpoint: Path, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    _verify_file(checkpoint, state, WEIGHTS_FILE)
    path = checkpoint / WEIGHTS_FILE
    try:
        return load_file(str(path))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{path}: damaged (cannot be read as safetensors: {error})") from None


def _read_trainer_state(checkpoint: Path, state: dict[str, Any]) -> dict[str, Any]:
    _verify_file(checkpoint, state, TRAINER_FILE)
    path = checkpoint / TRAINER_FILE
    try:
        trainer_state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - a damaged pickle/zip raises many types
        raise CheckpointError(f"{path}: damaged (cannot be loaded: {error})") from None
    if not isinstance(trainer_state, dict) or not {"optimizer", "scheduler"} <= trainer_state.keys():
        raise CheckpointError(f"{path}: damaged (no optimizer and scheduler state)")
    return trainer_state


def verify_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    """The state of a checkpoint whose every file is intact; CheckpointError naming the first
    damaged file otherwise."""
    checkpoint = Path(checkpoint)
    state = read_state(checkpoint)
    for name, read in ((WEIGHTS_FILE, _read_weights), (TRAINER_FILE, _read_trainer_state)):
        if not _verify_file(checkpoint, state, name):
            read(checkpoint, state)  # no checksum recorded: it is intact if it loads
    return state


def _verified_newest_first(run_dir: str | Path) -> Iterator[tuple[Path, dict[str, Any] | CheckpointError]]:
    """Each checkpoint folder of `run_dir`, newest first, with its state if it verifies, else why not."""
    checkpoints = Path(run_dir) / "checkpoints"
    candidates = sorted((p for p in checkpoints.glob("step-*") if p.is_dir()), reverse=True) if checkpoints.is_dir() else []
    for candidate in candidates:
        try:
            yield candidate, verify_checkpoint(candidate)
        except CheckpointError as error:
            yield candidate, error


def resumable_checkpoint(run_dir: str | Path, log: TextIO | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of `run_dir` that verifies, and one line for each newer one skipped
    (`<folder>: <why>`); those lines also go to `log` when given. (None, lines) when none does."""
    skipped: list[str] = []
    for candidate, outcome in _verified_newest_first(run_dir):
        if not isinstance(outcome, CheckpointError):
            return candidate, skipped
        line = f"skipping checkpoint {candidate.name}: {outcome}"
        skipped.append(line)
        if log is not None:
            print(f"--resume: {line}", file=log)
    return None, skipped


def verified_checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """Every checkpoint of `run_dir` that verifies, by step (damaged ones left out)."""
    return {outcome["step"]: candidate for candidate, outcome in _verified_newest_first(run_dir)
            if not isinstance(outcome, CheckpointError)}


SUPERSEDED = "superseded"


def set_aside_after(run_dir: str | Path, step: int) -> list[tuple[Path, Path]]:
    """Move every checkpoint of `run_dir` past `step` into `checkpoints/superseded/` (kept, never
    deleted) and point `latest` at step `step`: a run resumed from `step` writes those steps
    again, and until it does no resume or export may take the old ones for its newest.
    Returns (from, to) for each folder moved."""
    checkpoints = Path(run_dir) / "checkpoints"
    moved = []
    for candidate in sorted(checkpoints.glob("step-*")):
        if not (_STEP_NAME.fullmatch(candidate.name) and int(candidate.name[5:]) > step):
            continue
        aside = checkpoints / SUPERSEDED / candidate.name
        suffix = 1
        while aside.exists():
            aside, suffix = checkpoints / SUPERSEDED / f"{candidate.name}.{suffix}", suffix + 1
        aside.parent.mkdir(exist_ok=True)
        candidate.rename(aside)
        moved.append((candidate, aside))
    if moved:
        write_text_atomic(checkpoints / "latest", f"step-{step:08d}\n")
    return moved


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _with_intact_hint(error: CheckpointError, checkpoint: Path) -> CheckpointError:
    """`error`, plus the newest intact checkpoint of the same run (if any)."""
    if checkpoint.parent.name != "checkpoints":
        return error
    intact, _ = resumable_checkpoint(checkpoint.parent.parent)
    if intact is None:
        return CheckpointError(f"{error}; no intact checkpoint is left in {checkpoint.parent}")
    return CheckpointError(f"{error}; the newest intact checkpoint is {intact}: pass it instead")


def load_drafter(checkpoint: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """The drafter of a checkpoint (or of a run's latest one), its weights verified."""
    checkpoint = resolve_checkpoint(checkpoint)
    try:
        state = read_state(checkpoint)
        weights = _read_weights(checkpoint, state)
        try:
            config = DrafterConfig.from_dict(state["drafter_config"])
        except (TypeError, ValueError, KeyError) as error:
            raise CheckpointError(f"{checkpoint / STATE_FILE}: damaged drafter_config ({error})") from None
        drafter = DFlashDrafter(config)
        try:
            drafter.load_state_dict(weights)
        except RuntimeError as error:
            raise CheckpointError(f"{checkpoint / WEIGHTS_FILE}: does not match its drafter config ({error})") from None
    except CheckpointError as error:
        raise _with_intact_hint(error, checkpoint) from None
    return drafter.to(device)


# How an optimizer runs, not what it learned: a loaded state dict must not change them (torch's
# loading takes every group key from the file, so a checkpoint of a fused CUDA AdamW, or of
# master weights, would make a CPU AdamW fused).
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def restore_trainer(checkpoint: str | Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    checkpoint = Path(checkpoint)
    state = _read_trainer_state(checkpoint, read_state(checkpoint))
    if state["optimizer"] is not None:
        own = [{key: group.get(key) for key in IMPLEMENTATION_KEYS} for group in optimizer.param_groups]
        optimizer.load_state_dict(state["optimizer"])
        for group, keys in zip(optimizer.param_groups, own):
            group.update(keys)
    if state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
