"""Rendering a long conversation file in worker processes, each given a contiguous share of its rows.

A chat template and a tokenizer cost ~1–2 ms a row in Python under one GIL: two minutes for
100k rows, paid again by every call that resumes a run. Each worker is
`python -m dflash_train.data.render_pool`, handed (render function, tokenizer, its rows)
pickled over stdin, answering with the outcomes, in order, over stdout.

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
from pathlib import Path
from typing import Any, Callable, Sequence

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding dflash_train


class RenderPoolError(RuntimeError):
    """A worker could not start or failed; the caller renders in its own process instead."""


def render_in_workers(render: Callable[[Any, Any], Any], tokenizer: Any, rows: Sequence[Any], workers: int) -> list[Any]:
    """[render(tokenizer, row) for row in rows], computed by `workers` processes. `render` must be
    picklable by reference (a module-level function, or a bound method of a picklable object)."""
    workers = max(1, min(workers, len(rows)))
    bounds = [len(rows) * i // workers for i in range(workers + 1)]
    shares = [list(rows[start:end]) for start, end in zip(bounds, bounds[1:])]
    environment = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")])))
    results: list[list[Any] | None] = [None] * len(shares)
    errors: list[str] = []

    def run(index: int) -> None:
        try:
            job = pickle.dumps((render, tokenizer, shares[index]), protocol=pickle.HIGHEST_PROTOCOL)
            process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, env=environment)
            out, err = process.communicate(job)
            if process.returncode != 0:
                last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                errors.append(f"worker {index} exited with {process.returncode}: {last[0]}")
                return
            results[index] = pickle.loads(out)
        except Exception as error:  # noqa: BLE001 - reported to the caller, which renders in its own process
            errors.append(f"worker {index}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=run, args=(i,), name=f"render-{i}", daemon=True) for i in range(len(shares))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RenderPoolError(errors[0])
    outcomes = [outcome for result in results for outcome in result or []]
    if len(outcomes) != len(rows):
        raise RenderPoolError(f"the workers returned {len(outcomes)} outcomes for {len(rows)} rows")
    return outcomes


def _work() -> int:
    render, tokenizer, rows = pickle.load(sys.stdin.buffer)
    outcomes = [render(tokenizer, row) for row in rows]
    pickle.dump(outcomes, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_work())
