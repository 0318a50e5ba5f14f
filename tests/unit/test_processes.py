"""map_in_processes / map_anywhere: results in the items' order from real worker processes, and the
same list from this process when the workers cannot start."""

import operator

import pytest

from dflash_train.processes import WorkerError, map_anywhere, map_in_processes


def test_items_spread_over_workers_come_back_in_order():
    items = list(range(11))  # not a multiple of the worker count: shares of 4, 4 and 3
    assert map_in_processes(operator.mul, items, 3, fixed=(3,)) == [3 * item for item in items]
    assert map_in_processes(operator.neg, [5], 4) == [-5]  # more workers than items


def test_workers_that_cannot_start_are_an_error_and_map_anywhere_does_the_work_here(monkeypatch):
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    with pytest.raises(WorkerError, match=r"worker \d: FileNotFoundError"):
        map_in_processes(operator.neg, [1, 2], 2)
    with pytest.warns(UserWarning, match=r"negating in worker processes failed \(worker \d: FileNotFoundError.*\); "
                                         "doing it in this process"):
        assert map_anywhere(operator.neg, [1, 2, 3], 2, what="negating") == [-1, -2, -3]
