"""A function mapped over many items in worker processes, results in the items' order.

For Python work of a minute or more that one GIL would serialise: rendering a long conversation
file (~1–2 ms a row through a chat template and a tokenizer; data/samples.py), and building the
default prompt set (judging ~250k registry rows, parsing ~8,000 Python files; data/prompts/).
Each worker is `python -m dflash_train.processes`, handed (function, fixed arguments, its share
of the items) pickled over stdin, answering with the results, in order, over stdout. Item i
goes to worker i mod n, so a run of slow items is spread over all of them.

Why not `multiprocessing`: its spawned children re-import the parent's main module (a script
read from stdin cannot be re-imported, and a pool whose children die while starting hangs), and
a fork copies a process that may hold CUDA and threads. A child started with `-m` imports only
what unpickling its job needs.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # the folder holding dflash_train


MAX_WORKERS = 16


class WorkerError(RuntimeError):
    """A worker could not start or failed; the caller does the work in its own process instead."""


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers() -> int:
    return min(available_cores(), MAX_WORKERS)


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a child started as `python -m dflash_train...`: the folder
    holding this package first on its PYTHONPATH (so it imports this same dflash_train), plus `extra`."""
    path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")]))
    return dict(os.environ, **extra, PYTHONPATH=path)


def map_anywhere(function: Callable[..., Any], items: Sequence[Any], workers: int | None = None, *,
                 fixed: tuple = (), what: str = "the work") -> list[Any]:
    """`map_in_processes` on `workers` processes (None: `default_workers()`), or here with one
    worker, or here after a warning naming `what` if the workers failed: the same list each way."""
    workers = default_workers() if workers is None else workers
    if workers > 1 and len(items) > 1:
        try:
            return map_in_processes(function, items, workers, fixed=fixed)
        except WorkerError as error:
            warnings.warn(f"{what} in worker processes failed ({error}); doing it in this process", stacklevel=2)
    return [function(*fixed, item) for item in items]


def map_in_processes(function: Callable[..., Any], items: Sequence[Any], workers: int, *,
                     fixed: tuple = ()) -> list[Any]:
    """[function(*fixed, item) for item in items], computed by up to `workers` processes.
    `function` (and `fixed`) must be picklable by reference: a module-level function, or a bound
    method of a picklable object."""
    workers = max(1, min(workers, len(items)))
    shares = [list(items[index::workers]) for index in range(workers)]
    environment = child_environment(TOKENIZERS_PARALLELISM="false")
    results: list[list[Any] | None] = [None] * workers
    errors: list[str] = []

    def run(index: int) -> None:
        try:
            job = pickle.dumps((function, fixed, shares[index]), protocol=pickle.HIGHEST_PROTOCOL)
            process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, env=environment)
            out, err = process.communicate(job)
            if process.returncode != 0:
                last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                errors.append(f"worker {index} exited with {process.returncode}: {last[0]}")
                return
            results[index] = pickle.loads(out)
        except Exception as error:  # noqa: BLE001 - reported to the caller, which does the work itself
            errors.append(f"worker {index}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}", daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise WorkerError(errors[0])
    if [len(result or []) for result in results] != [len(share) for share in shares]:
        raise WorkerError(f"the workers returned {sum(len(r or []) for r in results)} results for {len(items)} items")
    return [results[index % workers][index // workers] for index in range(len(items))]


def _work() -> int:
    function, fixed, items = pickle.load(sys.stdin.buffer)
    results = [function(*fixed, item) for item in items]
    pickle.dump(results, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_work())
