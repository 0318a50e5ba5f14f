"""Real threads for tests: one function run in several threads at once, and what they raised."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable


def run_in_threads(work: Callable[[Any], None], args: Iterable[Any], *, timeout: float,
                   on_error: Callable[[BaseException], None] | None = None) -> list[BaseException]:
    """`work(arg)` for each of `args`, each in its own thread, all started before any is joined.
    Returns what the threads raised (each also given to `on_error` at once, e.g. to release peers
    waiting in a barrier); a thread still running after `timeout` seconds is one more error."""
    errors: list[BaseException] = []

    def guarded(arg: Any) -> None:
        try:
            work(arg)
        except BaseException as error:  # noqa: BLE001 - reported to the test's thread
            errors.append(error)
            if on_error is not None:
                on_error(error)

    threads = [threading.Thread(target=guarded, args=(arg,)) for arg in args]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    errors += [TimeoutError(f"{thread.name} still running after {timeout:g} s") for thread in threads if thread.is_alive()]
    return errors
