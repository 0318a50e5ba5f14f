"""A real `dflash-train` process stopped at a named point of a write (`files._pause_for_tests`), for
tests that kill it there (-9), or change the disk under it and let it go on (SIGUSR1)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def paused_cli(args: list[str], point: str, *, preexec_fn: Callable[[], Any] | None = None,
               timeout: float = 300) -> Iterator[subprocess.Popen]:
    """`dflash-train ARGS` in its own process, yielded once it is paused at `point` (its stderr
    stays open for the rest); killed at the end if still running."""
    environment = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DFLASH_TEST_PAUSE_AT=f"{point}:300")
    process = subprocess.Popen([sys.executable, "-m", "dflash_train.cli", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=environment, preexec_fn=preexec_fn)
    try:
        deadline, line = time.monotonic() + timeout, ""
        while f"paused at {point}" not in line:
            line = process.stderr.readline()
            assert (line or process.poll() is None) and time.monotonic() < deadline, process.communicate()
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stderr.close()


def hidden_copies(folder: Path, name: str) -> list[str]:
    """The hidden temporary copies of the output `name` a killed write left in `folder`."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}.") and p.name.endswith(".tmp"))
