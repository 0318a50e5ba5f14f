"""The run's compile cache: a second start of the same run skips inductor's and Triton's work.

Inductor keeps its FX graph cache, AOTAutograd cache and Triton kernels on disk on its own (under
TORCHINDUCTOR_CACHE_DIR, by default a folder in the temporary directory of this machine). On top,
where torch has them (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`, checked by
behaviour: present and returning artifacts), every artifact the warm-up compiled or loaded is saved
into the run folder, `compile_cache.bin`, and loaded back into the local caches when the run starts
again, also on another machine with the same torch (what `--resume` after a lost machine needs).
A file that does not load (another torch, damaged) is reported and ignored, never fatal.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from ..files import write_bytes_atomic

CACHE_FILE = "compile_cache.bin"


@dataclass
class CompileCacheReport:
    """What the run's compile cache did (summary.json's startup section)."""

    supported: bool
    loaded: dict[str, int] = field(default_factory=dict)  # artifact kind -> count
    saved: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def as_dict(self) -> dict:
        return {"supported": self.supported, "loaded": self.loaded, "saved": self.saved, "note": self.note}


def artifacts_supported() -> bool:
    compiler = getattr(torch, "compiler", None)
    return callable(getattr(compiler, "save_cache_artifacts", None)) and callable(
        getattr(compiler, "load_cache_artifacts", None))


def _counts(info) -> dict[str, int]:
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in dict(artifacts).items() if keys}


def load_compile_cache(run_dir: str | Path, log: TextIO) -> CompileCacheReport:
    """Load the run folder's saved artifacts into the local compile caches, if there are any."""
    if not artifacts_supported():
        return CompileCacheReport(False, note="this torch has no save/load_cache_artifacts; local caches only")
    path = Path(run_dir) / CACHE_FILE
    report = CompileCacheReport(True)
    if not path.is_file():
        report.note = "no saved artifacts yet"
        return report
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as error:  # noqa: BLE001 - a cache must never stop a run
        report.note = f"{path} did not load ({type(error).__name__}: {error}); compiling from scratch"
        warnings.warn(f"compile cache: {report.note}", stacklevel=2)
        return report
    if info is None:  # torch logs why (a checksum, another format) and returns nothing
        report.note = f"{path} did not load (torch could not read it); compiling from scratch"
        warnings.warn(f"compile cache: {report.note}", stacklevel=2)
        return report
    report.loaded = _counts(info)
    report.note = f"loaded {sum(report.loaded.values())} artifacts from {path}"
    print(f"compile cache: {report.note} ({', '.join(f'{k} {v}' for k, v in report.loaded.items()) or 'none usable'})",
          file=log, flush=True)
    return report


def save_compile_cache(run_dir: str | Path, report: CompileCacheReport, log: TextIO) -> None:
    """Save every artifact compiled or loaded so far into the run folder (atomically)."""
    if not report.supported:
        return
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception as error:  # noqa: BLE001
        report.note = f"saving failed ({type(error).__name__}: {error})"
        warnings.warn(f"compile cache: {report.note}", stacklevel=2)
        return
    if saved is None:
        return
    data, info = saved
    path = write_bytes_atomic(Path(run_dir) / CACHE_FILE, data)
    report.saved = _counts(info)
    print(f"compile cache: saved {sum(report.saved.values())} artifacts ({len(data) / 1e6:.1f} MB) to {path}",
          file=log, flush=True)
