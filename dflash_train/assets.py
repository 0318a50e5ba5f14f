"""Files shipped inside installed PyPI packages (models, prompts, benchmarks) and atomic folders."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .config import UserError


class MissingAsset(UserError, FileNotFoundError):
    """An asset package (or a file in it) is not installed; the message says how to install it."""


def package_path(package: str, relative: str, install_hint: str, *, directory: bool = False) -> Path:
    """`relative` inside the installed `package`, found without importing it: the asset packages
    are installed --no-deps, so importing them may fail on their own missing dependencies."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(f"package {package!r} is not installed; install it with: {install_hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_dir() if directory else candidate.is_file():
            return candidate
    raise MissingAsset(f"package {package!r} has no {relative}; reinstall it with: {install_hint}")


def write_dir_atomically(final_dir: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(staging)` in a hidden sibling folder, then rename it onto `final_dir`
    (replacing an older one). A crash at any point leaves either the old folder or the new one,
    never a half-written folder under the final name."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    try:
        build(staging)
        if final_dir.exists():
            shutil.rmtree(final_dir)
        os.replace(staging, final_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final_dir
