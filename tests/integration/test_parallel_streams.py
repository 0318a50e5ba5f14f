"""Worker streams off CUDA (parallel/streams.py): nothing changes on the CPU, and the gradient sum
of replicas keeps each replica's gradient reads and writes in that replica's own thread (on CUDA,
its own stream; tests/gpu/test_parallel_streams_gpu.py checks the GPU order)."""

import threading

import torch
from threads import run_in_threads

from dflash_train.parallel.gradients import GradientReducer
from dflash_train.parallel.streams import WorkerStream, mark, receive, wait_for
from dflash_train.parallel.threads import PipelineStopped, StopSignal

CPU = torch.device("cpu")


def test_off_cuda_a_worker_has_no_stream_and_its_loop_runs_unchanged():
    worker_stream = WorkerStream(CPU)
    assert worker_stream.stream is None
    ran = []
    with worker_stream.running():
        ran.append(threading.current_thread().name)
    assert ran == [threading.current_thread().name]
    error = RuntimeError("the worker's own error")
    try:
        with worker_stream.running():
            raise error
    except RuntimeError as raised:
        assert raised is error
    else:
        raise AssertionError("the error did not leave the worker's loop")


def test_on_the_cpu_a_handed_over_tensor_is_the_producers_own_with_nothing_to_wait_for():
    features = torch.arange(12.0).view(1, 3, 4)
    ready = mark(CPU)
    assert ready is None
    received, wait = receive(features, ready, CPU, side_streams={})
    assert received is features and wait is None
    wait_for(wait, CPU)  # a no-op off CUDA
    assert torch.equal(received, torch.arange(12.0).view(1, 3, 4))


def test_each_replica_loads_and_stores_its_own_gradients_in_its_own_thread():
    """Two replicas in two real threads: every replica's flat buffer is filled from its gradients
    and written back into them by that replica's thread (on CUDA: on that replica's stream, which
    the sum then waits for), and both end with the sum of the two gradients."""
    torch.manual_seed(0)
    replicas = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    for model in replicas[1:]:
        model.load_state_dict(replicas[0].state_dict())
    grads = [[torch.randn_like(p) for p in model.parameters()] for model in replicas]
    reducer = GradientReducer(replicas, StopSignal())
    touched: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def watched(rank: int, what: str, method):
        def run():
            with lock:
                touched.append((what, rank, threading.current_thread().name))
            method()
        return run

    for rank, flat in enumerate(reducer.flats):
        flat.load = watched(rank, "load", flat.load)
        flat.store = watched(rank, "store", flat.store)

    def replica(rank: int) -> None:
        threading.current_thread().name = f"replica-{rank}"
        for param, grad in zip(replicas[rank].parameters(), grads[rank]):
            param.grad = grad.clone()
        reducer.sync(rank)

    errors = run_in_threads(replica, (0, 1), timeout=30, on_error=lambda _: reducer.abort())
    assert not errors, errors
    assert sorted(touched) == [("load", 0, "replica-0"), ("load", 1, "replica-1"),
                               ("store", 0, "replica-0"), ("store", 1, "replica-1")]
    for model in replicas:
        for param, a, b in zip(model.parameters(), grads[0], grads[1]):
            torch.testing.assert_close(param.grad, a + b)


def test_a_stop_vote_between_arrive_and_reduce_lets_every_replica_leave_the_step_unsummed():
    """What the drafter loop does when the vote (replica 0, after every replica arrived) stops
    every node: replica 0 cancels, the other replica leaves its `reduce` with PipelineStopped
    instead of waiting for a sum that never comes, and no replica's gradients change."""
    torch.manual_seed(0)
    replicas = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    grads = [[torch.randn_like(p) for p in model.parameters()] for model in replicas]
    for model, own in zip(replicas, grads):
        for param, grad in zip(model.parameters(), own):
            param.grad = grad.clone()
    reducer = GradientReducer(replicas, StopSignal())
    left: list[int] = []

    def replica(rank: int) -> None:
        reducer.arrive(rank)
        if rank == 0:  # the vote said stop
            reducer.cancel()
            left.append(rank)
            return
        try:
            reducer.reduce(rank, step=0)
        except PipelineStopped:
            left.append(rank)

    errors = run_in_threads(replica, (0, 1), timeout=10)
    reducer.abort()  # frees a replica still waiting, had the cancel not reached it
    assert not errors, errors
    assert sorted(left) == [0, 1]
    for model, own in zip(replicas, grads):
        assert all(torch.equal(param.grad, grad) for param, grad in zip(model.parameters(), own))
