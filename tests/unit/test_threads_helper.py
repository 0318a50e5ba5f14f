"""The tests' thread runner (tests/threads.py) reports what its threads raised and any thread
still running, so a failure in a worker thread can never pass as a success."""

import threading

from threads import run_in_threads


def test_errors_of_worker_threads_reach_the_test_and_its_callback():
    seen, released = [], []

    def work(index: int) -> None:
        seen.append(index)
        if index == 1:
            raise ValueError("replica 1 broke")

    errors = run_in_threads(work, range(3), timeout=10, on_error=released.append)
    assert sorted(seen) == [0, 1, 2]
    assert [str(e) for e in errors] == ["replica 1 broke"] and released == errors


def test_a_thread_still_running_at_the_timeout_is_an_error():
    stop = threading.Event()
    errors = run_in_threads(lambda _: stop.wait(5), [0], timeout=0.2)
    stop.set()
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
