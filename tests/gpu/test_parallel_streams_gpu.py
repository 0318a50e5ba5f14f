"""Every worker thread on its own CUDA stream (parallel/streams.py), on one GPU: each worker's
kernels run on its stream; with the target's and one replica's GPU work deliberately delayed
(spin kernels, no host work), every hand-off between streams still waits for what it reads (the
features, the gradient sum of two replicas on the same GPU), so the weights equal one drafter's
with gradient accumulation; and a slowed drafter is named `drafter GPU` (the slowed target's twin
is tests/gpu/test_train_step_graphs_gpu.py)."""

import contextlib
import json
import os
import threading

import pytest
import torch
from dflash_train.target.model import Target
from safetensors.torch import load_file
from tiny import pattern_samples, tiny_hf_model, tiny_train_config

from dflash_train.core.drafter import DFlashDrafter
from dflash_train.train.trainer import train

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda:0")
CYCLES_PER_SECOND = 2.0e9  # torch.cuda._sleep spins clock cycles: about 2 GHz on an H200


def _spin(seconds: float) -> None:
    torch.cuda._sleep(int(seconds * CYCLES_PER_SECOND))


def _target(dtype: torch.dtype, slow_seconds: float = 0.0, streams: list | None = None) -> Target:
    """The tiny target (head_dim 64, as the flex shapes here need); `slow_seconds` spins its GPU
    before its first decoder layer on every forward; `streams` collects the stream each forward
    in a target worker thread ran on."""
    model = tiny_hf_model("llama", layers=6, hidden=256, seed=0).to(DEVICE, dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)

    def before_first_layer(module, args):
        if streams is not None and threading.current_thread().name.startswith("target"):
            streams.append(torch.cuda.current_stream(DEVICE).cuda_stream)
        if slow_seconds:
            _spin(slow_seconds)

    model.model.layers[0].register_forward_pre_hook(before_first_layer)
    return Target(model)


@contextlib.contextmanager
def _slow_drafter_forwards(seconds: float, thread_prefix: str):
    """Every drafter forward run by a thread whose name starts with `thread_prefix` spins the GPU
    `seconds` first. A global forward pre-hook, because the pipeline builds its drafters itself;
    it runs outside the compiled forward (which compiles `forward`, not the call), so a captured
    step records the spin."""
    def spin(module, args):
        if torch.compiler.is_compiling() or not isinstance(module, DFlashDrafter):
            return
        if threading.current_thread().name.startswith(thread_prefix):
            _spin(seconds)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(spin)
    try:
        yield
    finally:
        handle.remove()


def _config(out, graphs: str, **values):
    # Query and key rows in multiples of 128 (flex on torch 2.11 has no float32 kernel for 96 rows).
    eager = dict(compile="off", attention="sdpa") if graphs == "off" else {}
    defaults = dict(device="cuda", steps=12, num_anchors=32, max_seq_len=256, log_every=4, save_every=12,
                    export_dtype="", seq_buckets=[128, 256], cuda_graphs=graphs, **eager)
    return tiny_train_config(out, **{**defaults, **values})


def _final_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "drafter.safetensors"))


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_replicas_on_their_own_streams_with_slowed_producers_equal_one_drafter(tmp_path, graphs):
    """Two drafter replicas on cuda:0 and the target thread, each on its own stream (none the
    default one); the target's forward and replica 1's forward delayed ~30 ms on the GPU each: the
    replicas stay identical after every step and end with the weights of one drafter taking both
    micro-batches by gradient accumulation (fp32, 12 steps). Reading features before the target
    wrote them, summing before replica 1's gradients were in its buffer, or replica 1 reading the
    sum back before it was written would each break the equality (on one shared stream none of
    this needed an event)."""
    samples = pattern_samples(48, min_len=30, max_len=250)
    reference_dir, replicas_dir = tmp_path / "accum", tmp_path / "replicas"
    train(_config(reference_dir, graphs, precision="fp32", grad_accum=2), samples=samples,
          target=_target(torch.float32), log=open(os.devnull, "w"))

    target_streams: list[int] = []
    drafter_streams: dict[int, set[tuple[int, int]]] = {0: set(), 1: set()}
    fingerprints: dict[int, dict[int, torch.Tensor]] = {}
    lock = threading.Lock()

    def record(worker, step):
        flat = torch.cat([p.detach().flatten() for p in worker.replica.drafter.parameters()]).cpu()
        current = torch.cuda.current_stream(DEVICE).cuda_stream
        with lock:
            fingerprints.setdefault(step, {})[worker.replica.rank] = flat
            drafter_streams[worker.replica.rank].add((current, worker.stream.stream.cuda_stream))

    with _slow_drafter_forwards(0.03, "drafter-1"):
        summary = train(_config(replicas_dir, graphs, precision="fp32", drafter_devices=["cuda:0", "cuda:0"]),
                        samples=samples, target=_target(torch.float32, slow_seconds=0.03, streams=target_streams),
                        log=open(os.devnull, "w"), step_hook=record)
    if graphs == "on":
        notes = summary["startup"]["warmup_notes"]
        assert all("graphs captured" in notes[name] and "eager" not in notes[name]
                   for name in ("drafter-0", "drafter-1")), notes

    default = torch.cuda.default_stream(DEVICE).cuda_stream
    assert all(len(seen) == 1 for seen in drafter_streams.values()), drafter_streams  # one stream per thread
    (stream0,), (stream1,) = drafter_streams[0], drafter_streams[1]
    assert stream0[0] == stream0[1] and stream1[0] == stream1[1]  # each step ran on the worker's own stream
    mine = {stream0[0], stream1[0]}
    assert len(mine) == 2 and default not in mine
    if graphs == "off":  # graphed features replay without calling the forward
        assert len(set(target_streams)) == 1 and target_streams[0] not in mine | {default}

    assert sorted(fingerprints) == list(range(12))
    for step, by_rank in fingerprints.items():
        assert torch.equal(by_rank[0], by_rank[1]), step
    expected, got = _final_weights(reference_dir, 12), _final_weights(replicas_dir, 12)
    assert sorted(got) == sorted(expected)
    for name in expected:
        # Relative to the tensor's norm: a lone element where a non-deterministic kernel flipped
        # the sign of a near-zero gradient moves by up to 2 lr under Adam; a missed wait moves all.
        error = float(torch.linalg.vector_norm(got[name] - expected[name]))
        assert error <= 1e-4 * max(float(torch.linalg.vector_norm(expected[name])), 1e-12), (name, error)


def test_a_deliberately_slowed_drafter_gpu_is_named(tmp_path):
    """The drafter's GPU work made ~40 ms longer per step (host untouched; the spin is captured in
    its step graph), graphs on, bf16: the last pipeline.jsonl record names `drafter GPU`, with the
    drafter's GPU busy fraction high and above the target's (the target's kernels are on another
    stream, outside the drafter's spans)."""
    config = _config(tmp_path, "on", steps=30, log_every=10, save_every=30)
    with _slow_drafter_forwards(0.04, "drafter"):
        summary = train(config, samples=pattern_samples(64, min_len=30, max_len=250),
                        target=_target(torch.bfloat16), log=open(os.devnull, "w"))
    note = summary["startup"]["warmup_notes"]["drafter-0"]
    assert "graphs captured" in note and "eager" not in note, note  # the spin is in the graphs
    last = [json.loads(line) for line in (tmp_path / "pipeline.jsonl").read_text().splitlines()][-1]
    workers = last["workers"]
    assert last["bottleneck"] == "drafter GPU", last
    assert workers["drafter-0"]["gpu_busy"] >= 0.6 and workers["drafter-0"]["gpu_busy"] > workers["target-0"]["gpu_busy"], workers
