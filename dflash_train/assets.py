"""Files shipped inside installed PyPI packages (models, prompts, benchmarks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
