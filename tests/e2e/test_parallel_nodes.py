"""Multi-node training under torchrun, on this CPU machine: two "nodes" on localhost, each a
real torchrun agent (c10d rendezvous, node 0 hosting the store) with one worker process, gloo
between them; tiny models from tests/tiny.py built identically in every process
(tests/torchrun_train.py). Single-process references run in this process.

Bit-for-bit comparisons rely on both sides adding gradients in the same order: a node's replica
sums accumulate its micro-batches, the in-node sum adds replicas in order, and a 2-rank gloo
all-reduce adds the two node sums once ((g0+g1)+(g2+g3) on both sides). The comparisons keep the
intra-op thread count equal too (same number of workers per process: cpu_threads_per_worker).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import pattern_samples, tiny_train_config
from torchrun_train import build_targets, fingerprint

from dflash_train.config import ConfigError
from dflash_train.parallel.gradients import FlatGradients
from dflash_train.parallel.launch import Launch, detect_launch, place_devices
from dflash_train.train.batches import BatchPlanner, stream_identity
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.trainer import train

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
SCRIPT = TESTS / "torchrun_train.py"
BASE = dict(num_anchors=8, lr=5e-3, log_every=50, save_every=100)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(tmp_path: Path, spec: dict | None = None, *, args: list[str] | None = None, nodes: int = 2,
                 timeout: float = 120.0) -> list[dict]:
    """Start `nodes` torchrun agents (one per "node", one worker each) on localhost; returns, per
    node, its exit code, its output and (for the test script) the worker's result."""
    port = free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    if spec is not None:
        spec = {"results": str(tmp_path / "results"), **spec}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        program = [str(SCRIPT), str(tmp_path / "spec.json")]
    else:
        program = args
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    procs, logs = [], []
    for node in range(nodes):
        log = open(tmp_path / f"node{node}.log", "w")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--max-restarts", "0", *program]
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                      start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        raise AssertionError(f"torchrun did not finish within {timeout:.0f} s:\n" + _tails(tmp_path, nodes))
    finally:
        for log in logs:
            log.close()
    outcomes = []
    for node, proc in enumerate(procs):
        result_file = tmp_path / "results" / f"{node}.json"
        outcomes.append({
            "code": proc.returncode, "output": (tmp_path / f"node{node}.log").read_text(),
            "result": json.loads(result_file.read_text()) if result_file.is_file() else None,
        })
    return outcomes


def _tails(tmp_path: Path, nodes: int) -> str:
    return "\n".join(f"--- node {n}\n" + (tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(nodes))


def _single(out: Path, *, targets: int = 1, **values):
    """The same run in this process (one node); fingerprints of every replica after every step."""
    prints: dict = {}
    lock = threading.Lock()

    def hook(worker, step):
        with lock:
            prints.setdefault(str(step), {})[str(worker.replica.rank)] = fingerprint(worker.replica.drafter)

    built = build_targets(targets)
    stop_at = values.pop("stop_at", None)
    count = values.pop("_samples", 32)
    summary = train(tiny_train_config(out, **{**BASE, **values}), samples=pattern_samples(count),
                    target=built if targets > 1 else built[0], log=open(os.devnull, "w"), step_hook=hook,
                    stop_at=stop_at)
    return summary, prints


def _weights(run_dir: Path) -> dict:
    return load_file(str(latest_checkpoint(run_dir) / "drafter.safetensors"))


# --- two nodes --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """2 nodes x 2 drafter replicas, 6 steps; rank 1 gets its own --out, which must stay empty."""
    tmp = tmp_path_factory.mktemp("two_by_two")
    spec = {"out": str(tmp / "out{rank}"), "config": {**BASE, "steps": 6, "save_every": 3, "log_every": 2,
                                                      "drafter_devices": ["cpu", "cpu"]}}
    return tmp, launch_nodes(tmp, spec)


def test_two_nodes_keep_every_replica_equal_after_every_step(two_by_two):
    tmp, outcomes = two_by_two
    assert [o["code"] for o in outcomes] == [0, 0], _tails(tmp, 2)
    prints = [o["result"]["fingerprints"] for o in outcomes]
    assert sorted(prints[0], key=int) == [str(s) for s in range(6)]
    for step in prints[0]:
        replicas = [*prints[0][step].values(), *prints[1][step].values()]
        assert len(replicas) == 4 and len(set(replicas)) == 1, step  # 2 ranks x 2 local replicas
    assert prints[0]["0"]["0"] != prints[0]["5"]["0"]  # and they trained
    assert "nodes: rank 1 of 2" in outcomes[1]["output"] and "gradients over gloo" in outcomes[1]["output"]


def test_only_rank_0_writes(two_by_two):
    tmp, outcomes = two_by_two
    out0 = tmp / "out0"
    assert {p.name for p in out0.iterdir()} >= {"run.json", "metrics.jsonl", "pipeline.jsonl", "summary.json", "export",
                                               "checkpoints"}
    assert not (tmp / "out1").exists()  # rank 1 wrote nothing: no folder, no checkpoint, no export
    records = [json.loads(line) for line in (out0 / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(r["samples"] == 16 for r in records)  # every node's batches: 2 nodes x 2 replicas x 4 rows
    step_lines = [line for line in outcomes[1]["output"].splitlines() if line.startswith("step ")]
    assert step_lines == [] and any(line.startswith("step ") for line in outcomes[0]["output"].splitlines())


def test_two_nodes_by_two_replicas_equal_one_process(two_by_two, tmp_path):
    """2 nodes x 2 replicas == 1 process x 2 replicas x grad_accum 2, bit for bit after every step
    (the same 4 micro-batches per step, the same global normaliser, the same order of sums), and
    == 1 process with grad_accum 4 up to float rounding (it adds g0+g1+g2+g3 left to right)."""
    tmp, outcomes = two_by_two
    multi = outcomes[0]["result"]["fingerprints"]
    _, same_tree = _single(tmp_path / "same_tree", steps=6, save_every=3, drafter_devices=["cpu", "cpu"], grad_accum=2)
    assert {s: p["0"] for s, p in same_tree.items()} == {s: p["0"] for s, p in multi.items()}
    _single(tmp_path / "accum4", steps=6, save_every=3, grad_accum=4)
    multi_weights, accum4 = _weights(tmp / "out0"), _weights(tmp_path / "accum4")
    for name in multi_weights:
        torch.testing.assert_close(multi_weights[name], accum4[name], rtol=1e-5, atol=1e-6)
    losses = [json.loads(line)["loss"] for line in (tmp / "out0" / "metrics.jsonl").read_text().splitlines()]
    single = [json.loads(line)["loss"] for line in (tmp_path / "accum4" / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(single, rel=1e-5)  # rank 0 logs the loss of every node's batches


def test_a_failure_on_rank_1_stops_rank_0_after_the_same_step(tmp_path):
    spec = {"out": str(tmp_path / "out"), "fail": {"rank": 1, "step": 3},
            "config": {**BASE, "steps": 300, "dist_timeout": 20}}
    started = time.monotonic()
    outcomes = launch_nodes(tmp_path, spec)
    assert time.monotonic() - started < 90
    assert [o["code"] != 0 for o in outcomes] == [True, True], _tails(tmp_path, 2)
    zero, one = (o["result"] for o in outcomes)
    assert "boom from the test on rank 1" in one["error"]
    assert "rank 1 failed (drafter-0 failed: RuntimeError: boom from the test on rank 1)" in zero["error"]
    assert "every node stopped after step 4" in zero["error"]
    assert max(map(int, zero["fingerprints"])) == max(map(int, one["fingerprints"])) == 3  # both finished step 4
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps_done"]["drafter"] == 4 and summary["drafters"]["drafter"]["checkpoint"].endswith("step-00000004")
    assert summary["stop_reason"].startswith("rank 1 failed")


@pytest.mark.parametrize("name,repeat", [("SIGTERM", 1), ("SIGINT", 2)])
def test_a_signal_on_one_node_stops_every_node_after_the_same_step(tmp_path, name, repeat):
    """SIGTERM, and Ctrl-C as torchrun delivers it: the terminal's SIGINT and the agent's
    forwarded copy a moment later, which must not count as the second Ctrl-C that aborts."""
    spec = {"out": str(tmp_path / "out"), "signal": {"rank": 1, "step": 3, "name": name, "repeat": repeat},
            "config": {**BASE, "steps": 300, "dist_timeout": 20}}
    outcomes = launch_nodes(tmp_path, spec)
    assert [o["code"] for o in outcomes] == [0, 0], _tails(tmp_path, 2)
    zero, one = (o["result"] for o in outcomes)
    assert zero["summary"]["stop_reason"] == one["summary"]["stop_reason"] == f"interrupted by {name} on rank 1"
    done = zero["summary"]["steps_done"]["drafter"]
    assert done == one["summary"]["steps_done"]["drafter"] and 4 <= done < 300
    assert latest_checkpoint(tmp_path / "out").name == f"step-{done:08d}"
    assert "export" not in zero["summary"]["drafters"]["drafter"]  # an unfinished run is not exported


def test_a_node_that_dies_is_named_and_the_others_exit(tmp_path):
    spec = {"out": str(tmp_path / "out"), "die": {"rank": 1, "step": 3},
            "config": {**BASE, "steps": 300, "dist_timeout": 10}}
    started = time.monotonic()
    outcomes = launch_nodes(tmp_path, spec)
    assert time.monotonic() - started < 90
    assert outcomes[1]["result"] is None and outcomes[1]["code"] != 0  # it died without a word
    zero = outcomes[0]["result"]
    assert outcomes[0]["code"] != 0 and "NodeLost" in zero["error"]
    assert "rank 1: no heartbeat" in zero["error"]
    # its last complete step is saved: every replica had reduced it with rank 1 before it died
    assert latest_checkpoint(tmp_path / "out").name == "step-00000004"
    # ... and logged, with this node's sums: the vote that adds the nodes' never came (before: no
    # line, and a resume from that checkpoint left the step out of the log for good)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1].get("this_node_only") is True, records
    assert not any(r.get("this_node_only") for r in records[:-1])


def test_nodes_with_other_data_refuse_to_start(tmp_path):
    spec = {"out": str(tmp_path / "out"), "samples_by_rank": {"1": 31}, "config": {**BASE, "steps": 4}}
    outcomes = launch_nodes(tmp_path, spec)
    for outcome in outcomes:
        assert outcome["code"] != 0 and outcome["result"]["error"].startswith("ConfigError: the nodes disagree"), outcome
        assert "rank 1 has the data stream" in outcome["result"]["error"]
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("announce", [True, False])
def test_rank_0_busy_longer_than_the_timeout(tmp_path, announce):
    """Rank 0 spends 3 x the timeout after a step (as its checkpoint or in-training eval does).
    Announced in its vote (what the pipeline does for checkpoints and evals), rank 1 waits for it
    through the store; unannounced, rank 1's next collective times out: the control shows the
    timeout is real."""
    spec = {"protocol": {"timeout": 2.0, "busy_seconds": 6.0, "announce": announce}}
    outcomes = launch_nodes(tmp_path, spec)
    zero, one = (o["result"] for o in outcomes)
    if announce:
        assert zero["ok"] and one["ok"], _tails(tmp_path, 2)
        assert zero["total"] == one["total"] == 12.0  # (1 + 2) summed over both ranks three times
        assert one["seconds"] > 6.0
    else:
        assert not one["ok"] and "NodeLost" in one["error"], one


RESUME = dict(steps=8, save_every=2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 8 steps in one process with 2 drafter replicas."""
    out = tmp_path_factory.mktemp("straight")
    _single(out, drafter_devices=["cpu", "cpu"], **RESUME)
    return _weights(out)


def _assert_same_weights(run_dir: Path, reference: dict) -> None:
    assert latest_checkpoint(run_dir).name == "step-00000008"
    resumed = _weights(run_dir)
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name


def test_two_nodes_stopped_then_resumed_on_one_process_is_bit_identical(tmp_path, uninterrupted):
    """Stopped at step 4 on 2 nodes (1 replica each), resumed to step 8 in 1 process with 2
    replicas: the weights of the uninterrupted run, bit for bit."""
    spec = {"out": str(tmp_path / "run"), "stop_at": 4, "targets": 2,
            "config": {**BASE, **RESUME, "target_devices": ["cpu", "cpu"]}}
    assert [o["code"] for o in launch_nodes(tmp_path / "nodes", spec)] == [0, 0]
    assert latest_checkpoint(tmp_path / "run").name == "step-00000004"
    _single(tmp_path / "run", drafter_devices=["cpu", "cpu"], resume=True, **RESUME)
    _assert_same_weights(tmp_path / "run", uninterrupted)


def test_one_process_stopped_then_resumed_on_two_nodes_is_bit_identical(tmp_path, uninterrupted):
    _single(tmp_path / "run", drafter_devices=["cpu", "cpu"], stop_at=4, **RESUME)
    spec = {"out": str(tmp_path / "run"), "targets": 2,
            "config": {**BASE, **RESUME, "target_devices": ["cpu", "cpu"], "resume": True}}
    outcomes = launch_nodes(tmp_path / "nodes", spec)
    assert [o["code"] for o in outcomes] == [0, 0], _tails(tmp_path / "nodes", 2)
    assert "resuming from step 4" in outcomes[1]["output"]  # every node reads the checkpoint
    _assert_same_weights(tmp_path / "run", uninterrupted)


ENTRY_POINT = Path(sys.executable).with_name("dflash-train")


@pytest.mark.parametrize("program", [
    pytest.param(["-m", "dflash_train.cli"], id="module"),
    pytest.param(["--no-python", str(ENTRY_POINT)], id="entry-point",
                 marks=pytest.mark.skipif(not ENTRY_POINT.is_file(), reason="dflash-train is not installed next to python")),
])
def test_cli_under_torchrun_trains_on_two_nodes_with_rank_0_evaluating(tmp_path, program):
    """`torchrun ... -m dflash_train.cli train ...` and `torchrun --no-python dflash-train train ...`:
    the real command, a tiny target folder with a tokenizer, conversations rendered by its
    template, in-training eval on rank 0 only."""
    from test_decode_loop import char_tokenizer
    from tiny import tiny_hf_model

    target = tmp_path / "target"
    tiny_hf_model("llama", vocab=104).save_pretrained(target)
    char_tokenizer().save_pretrained(target)
    rows = [{"messages": [{"role": "user", "content": f"count from {i}"},
                          {"role": "assistant", "content": " ".join(str(i + k) for k in range(12))}]} for i in range(24)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = [*program, "train", "--target", str(target), "--data", str(data), "--out", str(out),
            "--steps", "4", "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8",
            "--block-size", "4", "--device", "cpu", "--log-every", "2", "--eval-every", "2",
            "--eval-bench", str(TESTS / "data" / "eval_prompts.jsonl"), "--eval-limit", "2",
            "--eval-max-new-tokens", "8", "--dist-timeout", "30"]
    outcomes = launch_nodes(tmp_path, args=args)
    assert [o["code"] for o in outcomes] == [0, 0], _tails(tmp_path, 2)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [("tau_real" in r) for r in records] == [False, True, False, True]
    assert all(r["samples"] == 4 for r in records)  # 2 nodes x batch 2
    assert (out / "export" / "model.safetensors").is_file()
    assert "eval at step" in outcomes[0]["output"] and "eval at step" not in outcomes[1]["output"]


@pytest.mark.gpu
def test_torchrun_one_node_with_nccl_on_one_gpu(tmp_path):
    """The multi-node code path on CUDA: torchrun with one node and one process, the gradient
    all-reduce over NCCL on the GPU (votes over gloo), target and drafter on cuda:0."""
    spec = {"out": str(tmp_path / "out"), "target_device": "cuda",
            "config": {**BASE, "steps": 6, "save_every": 3, "device": "cuda"}}
    (outcome,) = launch_nodes(tmp_path, spec, nodes=1, timeout=300)
    assert outcome["code"] == 0, _tails(tmp_path, 1)
    assert "gradients over nccl" in outcome["output"]
    summary = outcome["result"]["summary"]
    assert summary["steps_done"]["drafter"] == 6 and summary["nodes"] == 1
    assert summary["cross_node_all_reduce_ms_per_step"] is not None
    assert latest_checkpoint(tmp_path / "out").name == "step-00000006"


# --- in one process ---------------------------------------------------------------------------

def test_launch_is_read_from_torchruns_environment():
    assert detect_launch({}) is None
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "node0",
           "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert detect_launch(env) == Launch(1, 2, 0, 1, "node0", 29500, True, 2)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match="RANK 2 is outside WORLD_SIZE 2"):
        detect_launch({**env, "RANK": "2"})


def test_processes_sharing_a_host_take_disjoint_gpus():
    launch = Launch(3, 4, 1, 2, "h", 1, True, 0)  # the second of two processes on this host
    cuda = [torch.device("cuda", 0)], [torch.device("cuda", 1)]
    assert place_devices(cuda, launch, visible=4) == [[torch.device("cuda", 2)], [torch.device("cuda", 3)]]
    assert place_devices(cuda, launch, visible=2) == [list(d) for d in cuda]  # each process sees only its own
    with pytest.raises(ConfigError, match="needs 4; this process sees 3"):
        place_devices(cuda, launch, visible=3)
    cpu = [[torch.device("cpu")], [torch.device("cpu")]]
    assert place_devices(cpu, launch, visible=0) == cpu


def test_node_shares_cover_the_step_with_the_global_normaliser():
    from dflash_train.core.objective import ObjectiveConfig

    samples = pattern_samples(64)
    objectives = {"d": ObjectiveConfig(block_size=4, num_anchors=4)}
    whole = BatchPlanner(samples, batch_size=4, batches_per_step=4, buckets=[100], seed=0, objectives=objectives)
    shares = [BatchPlanner(samples, batch_size=4, batches_per_step=4, buckets=[100], seed=0, objectives=objectives,
                           share=range(2 * r, 2 * r + 2)) for r in range(2)]
    for step in (0, 5, 13):
        expected = whole.step_batches(step)
        got = [b for planner in shares for b in planner.step_batches(step)]
        assert [b.sample_ids for b in got] == [b.sample_ids for b in expected]
        assert [b.normalizers["d"] for b in got] == [b.normalizers["d"] for b in expected]
        assert [b.index for b in got] == [0, 1, 0, 1]


def test_flat_gradients_round_trip_into_one_persistent_buffer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    flat = FlatGradients(list(model.parameters()))
    (buffer,) = flat.buffers
    flat.load()
    assert torch.equal(buffer, torch.cat([g.flatten() for g in expected]))
    buffer.mul_(2)
    storage = buffer.data_ptr()
    flat.store()
    for param, grad in zip(model.parameters(), expected):
        assert torch.equal(param.grad, 2 * grad)
    model.zero_grad(set_to_none=True)
    flat.load()  # the same buffer again: nothing allocated per step
    assert buffer.data_ptr() == storage and not buffer.any()


def test_resume_refuses_another_data_stream(tmp_path):
    _single(tmp_path, steps=4, save_every=2, stop_at=2)
    for change, match in ((dict(seed=1), "--seed: 0 in the checkpoint, 1 now"),
                          (dict(grad_accum=2), r"micro-batches per step .*: 1 in the checkpoint, 2 now"),
                          (dict(batch_size=2), "--batch-size: 4 in the checkpoint, 2 now"),
                          (dict(max_seq_len=100), "--max-seq-len: 128 in the checkpoint, 100 now"),
                          (dict(_samples=31), "training rows: 32 in the checkpoint, 31 now")):
        with pytest.raises(ConfigError, match=match):
            _single(tmp_path, steps=4, save_every=2, resume=True, **change)


def test_stream_identity_changes_with_the_data():
    samples = pattern_samples(8)
    same = stream_identity(pattern_samples(8), seed=0, batch_size=4, batches_per_step=2, max_seq_len=128)
    assert stream_identity(samples, seed=0, batch_size=4, batches_per_step=2, max_seq_len=128) == same
    samples[3].input_ids[5] += 1  # one token of one row
    assert stream_identity(samples, seed=0, batch_size=4, batches_per_step=2, max_seq_len=128) != same


# --- ranks launched by environment variables (rank 0 hosts the store) ---------------------------

def _cli_target_and_data(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny target folder with a tokenizer, and conversations its template renders."""
    from test_decode_loop import char_tokenizer
    from tiny import tiny_hf_model

    target = tmp_path / "target"
    if not target.exists():
        tiny_hf_model("llama", vocab=104).save_pretrained(target)
        char_tokenizer().save_pretrained(target)
    rows = [{"messages": [{"role": "user", "content": f"count from {i}"},
                          {"role": "assistant", "content": " ".join(str(i + k) for k in range(12))}]} for i in range(16)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target, data


def _noisy_copy(target: Path, to: Path) -> Path:
    """The same model shape with other weights (a fine-tune, as far as a drafter can tell)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(target, to)
    weights = load_file(str(to / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    save_file({k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in weights.items()},
              str(to / "model.safetensors"), metadata={"format": "pt"})
    return to


def _train_args(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "2",
            "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8",
            "--block-size", "4", "--device", "cpu", "--log-every", "1", "--dist-timeout", "30", *extra]


def launch_by_environment(tmp_path: Path, args_by_rank: list[list[str]], timeout: float = 120.0,
                          program: tuple[str, ...] = ("-m", "dflash_train.cli")) -> list[dict]:
    """Each rank a plain `python -m dflash_train.cli` (or `program`) with RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT set by hand (no torchrun agent: rank 0 hosts the store); its exit
    code and output."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    procs = []
    for rank, args in enumerate(args_by_rank):
        env = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(len(args_by_rank)),
               "LOCAL_WORLD_SIZE": str(len(args_by_rank)), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, *program, *args], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
    outcomes = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            out, err = proc.communicate()
        outcomes.append({"code": proc.returncode, "out": out, "err": err})
    return outcomes


def test_a_finished_run_launched_by_environment_variables_exits_0_on_every_rank(tmp_path):
    """Rank 0 hosts the store and must not take it away while rank 1 still finishes (D5)."""
    target, data = _cli_target_and_data(tmp_path)
    out = tmp_path / "run"
    outcomes = launch_by_environment(tmp_path, [_train_args(target, data, out)] * 2)
    assert [o["code"] for o in outcomes] == [0, 0], outcomes
    assert not any("Traceback" in o["err"] or "NodeLost" in o["err"] for o in outcomes), outcomes
    assert (out / "export" / "model.safetensors").is_file()


def test_a_rank_whose_peer_never_joins_says_so_in_one_line(tmp_path):
    """WORLD_SIZE=2 and only rank 0 started: exit 1 with one line naming rank 1 (before: a bare
    traceback ending in NodeLost, and the same for a peer lost mid-run)."""
    target, data = _cli_target_and_data(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")},
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    done = subprocess.run([sys.executable, "-m", "dflash_train.cli", *_train_args(target, data, tmp_path / "run"),
                           "--dist-timeout", "3"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 1: never joined within 3 s" in lines[0], done.stderr


def test_a_master_port_in_use_is_one_line(tmp_path):
    """Rank 0 hosts the store on MASTER_PORT: a port another process listens on was a traceback
    ending in DistNetworkError (EADDRINUSE)."""
    target, data = _cli_target_and_data(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")},
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
        done = subprocess.run([sys.executable, "-m", "dflash_train.cli", *_train_args(target, data, tmp_path / "run")],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"dflash-train train: MASTER_PORT {port}: another process already listens on it at 127.0.0.1; choose a free port"]


def test_ranks_with_other_settings_or_another_target_stop_at_start(tmp_path):
    """A setting typed differently on one node (--lr, --block-size, --steps) or another model
    behind --target: every rank stops before anything loads or is written, with one line naming
    the settings and the ranks (D4; before, --lr trained diverging replicas and exited 0, and
    --block-size aborted rank 0 inside gloo)."""
    target, data = _cli_target_and_data(tmp_path)
    other = _noisy_copy(target, tmp_path / "other")
    out = tmp_path / "run"
    outcomes = launch_by_environment(tmp_path, [
        _train_args(target, data, out),
        _train_args(other, data, out, "--lr", "3", "--block-size", "8", "--steps", "3"),
    ])
    for outcome in outcomes:
        assert outcome["code"] == 2, outcome
        lines = outcome["err"].strip().splitlines()
        assert len(lines) == 1 and "the nodes disagree on the settings" in lines[0], outcome["err"]
        for named in ("rank 1 has --lr = 3.0 where rank 0 has 0.0006", "--block-size = 8", "--steps = 3",
                      "rank 1 has the target"):
            assert named in lines[0], lines[0]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_a_run_folder_rank_0_refuses_stops_every_rank_at_once_with_its_reason(tmp_path):
    """Only rank 0 checks (and owns) the run folder. A folder it refuses (here it holds your
    notes and no run) stops it with one line, exit 2, and every other rank with one line giving
    rank 0's reason, exit 1, before it loads anything (before: the others loaded their target
    and data, then said only that the node hosting the store was down)."""
    target, data = _cli_target_and_data(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    outcomes = launch_by_environment(tmp_path, [_train_args(target, data, out), _train_args(target, data, out)])
    zero, one = outcomes
    assert zero["code"] == 2 and len(zero["err"].strip().splitlines()) == 1, zero
    reason = zero["err"].strip().removeprefix("dflash-train train: ")
    assert reason.startswith("--out ") and "holds no training run (notes.txt)" in reason, zero["err"]
    lines = one["err"].strip().splitlines()
    assert one["code"] == 1 and len(lines) == 1, one
    assert "waiting for rank 0 to check the run folder: rank 0: it left with ConfigError" in lines[0], lines[0]
    assert reason[:60] in lines[0], (reason, lines[0])
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]


LEAVE_AFTER = """
import os, sys
import torch.distributed as dist
from dflash_train.errors import ConfigError
from dflash_train.parallel.launch import detect_launch
from dflash_train.parallel.nodes import NodeGroup, NodeLost

try:
    with NodeGroup(detect_launch(), timeout=3) as nodes:
        if sys.argv[1] == "a lost rank" and nodes.rank == 1:
            os._exit(3)
        nodes.agree({"value": nodes.rank}, "the test value")
except (ConfigError, NodeLost) as error:
    print(type(error).__name__, "left initialized" if dist.is_initialized() else "destroyed", flush=True)
    sys.exit(2)
"""


@pytest.mark.parametrize("case", ["disagreement", "a lost rank"])
def test_a_rank_that_leaves_with_an_error_destroys_its_gloo_groups(tmp_path, case):
    """Gloo groups left to process exit abort it now and then ("terminate called without an
    active exception", exit -6 where 2 was due: seen in CI on the disagreement test above). Every
    rank that leaves with an error and no collective under way destroys them first: after the
    disagreement every rank; after a lost rank, the rank that noticed."""
    outcomes = launch_by_environment(tmp_path, [[case]] * 2, timeout=60, program=("-c", LEAVE_AFTER))
    expected = {"disagreement": [(2, "ConfigError destroyed")] * 2,
                "a lost rank": [(2, "NodeLost destroyed"), (3, "")]}[case]
    assert [(o["code"], o["out"].strip()) for o in outcomes] == expected, outcomes


def test_resume_against_another_target_is_refused(tmp_path, capsys):
    """The checkpoint records the target's identity (`target_identity`, as `eval --json` does):
    `--resume --target` another model of the same shape is one line, exit 2, the run untouched (D6)."""
    from dflash_train.cli import main

    target, data = _cli_target_and_data(tmp_path)
    other = _noisy_copy(target, tmp_path / "other")
    out = tmp_path / "run"
    assert main(_train_args(target, data, out, "--save-every", "1", "--export-dtype", "")) == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert main(_train_args(other, data, out, "--resume", "--steps", "4")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train")]
    assert len(errors) == 1 and "is not the target its checkpoint step-00000002 was trained against" in errors[0], errors
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert main(_train_args(target, data, out, "--resume", "--steps", "3", "--export-dtype", "")) == 0  # the same target resumes
