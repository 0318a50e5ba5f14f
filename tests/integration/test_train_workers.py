"""The threaded pipeline on CPU with real threads: replicas, variants, several target
workers, faults and interruption."""

import json
import os
import threading
import time

import pytest
import torch
from tiny import pattern_samples, tiny_target, tiny_train_config

from dflash_train.config import ConfigError
from dflash_train.parallel.threads import PipelineError
from dflash_train.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second intra-op thread only spins


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6, head_scale=20)


def _config(out, **overrides):
    return tiny_train_config(out, **{**dict(steps=20, num_anchors=8, lr=5e-3, log_every=5, save_every=10), **overrides})


def _quiet():
    return open(os.devnull, "w")


def test_replicas_stay_identical_after_every_step(tmp_path, target):
    fingerprints = {}
    lock = threading.Lock()

    def record(worker, step):
        flat = torch.cat([p.detach().flatten() for p in worker.replica.drafter.parameters()])
        with lock:
            fingerprints.setdefault(step, {})[worker.replica.rank] = flat.clone()

    config = _config(tmp_path, drafter_devices=["cpu", "cpu", "cpu"], steps=12)
    summary = train(config, samples=pattern_samples(48), target=target, log=_quiet(), step_hook=record)
    assert sorted(fingerprints) == list(range(12))
    for step, by_rank in fingerprints.items():
        assert sorted(by_rank) == [0, 1, 2]
        assert torch.equal(by_rank[0], by_rank[1]) and torch.equal(by_rank[0], by_rank[2]), step
    assert not torch.equal(fingerprints[0][0], fingerprints[11][0])  # and they did train
    assert summary["workers"]["target-0"]["items"] == 36  # 3 replicas x 12 steps, one batch each


def test_replicas_match_one_drafter_on_the_joint_batch(tmp_path, target):
    """Gradients summed over 2 replicas of batch 4 == one drafter with grad_accum 2 of batch 4:
    the same 8 sequences per step, the same global normaliser."""
    samples = pattern_samples(32)
    train(_config(tmp_path / "replicas", drafter_devices=["cpu", "cpu"], steps=6), samples=samples, target=target, log=_quiet())
    train(_config(tmp_path / "accum", grad_accum=2, steps=6), samples=samples, target=target, log=_quiet())
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "replicas" / "checkpoints" / "step-00000006" / "drafter.safetensors"))
    b = load_file(str(tmp_path / "accum" / "checkpoints" / "step-00000006" / "drafter.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_variants_train_independent_drafters_from_one_stream(tmp_path, target):
    config = _config(
        tmp_path, mode="variants", drafter_devices=["cpu", "cpu"], steps=10,
        variants=[{"name": "b4", "block_size": 4}, {"name": "b6-dpace", "block_size": 6, "loss": "dpace", "num_layers": 2,
                                                    "target_layer_ids": [2, 4]}],
    )
    summary = train(config, samples=pattern_samples(32), target=target, log=_quiet())
    assert set(summary["drafters"]) == {"b4", "b6-dpace"}
    for name, block in (("b4", 4), ("b6-dpace", 6)):
        run = json.loads((tmp_path / name / "run.json").read_text())
        assert run["drafter_config"]["block_size"] == block
        assert (tmp_path / name / "export" / "config.json").is_file()
        assert len((tmp_path / name / "metrics.jsonl").read_text().splitlines()) == 10
    assert json.loads((tmp_path / "b6-dpace" / "run.json").read_text())["drafter_config"]["target_layer_ids"] == [2, 4]
    assert summary["workers"]["target-0"]["items"] == 10  # one target pass feeds both variants


def test_each_variant_ends_with_the_weights_of_its_own_run(tmp_path, target):
    """Variants mode shares the target's stream and nothing else: every drafter ends with the
    weights a plain run with that variant's settings gives (same rows, order, seed and steps)."""
    from safetensors.torch import load_file

    variants = [{"name": "base"}, {"name": "b6-decay", "block_size": 6, "loss": "decay", "lr": 2e-3}]
    samples = pattern_samples(16)
    together = tmp_path / "together"
    train(_config(together, mode="variants", variants=variants, steps=4, save_every=4, export_dtype=""),
          samples=samples, target=target, log=_quiet())
    for variant in variants:
        alone = tmp_path / "alone" / variant["name"]
        settings = {key: value for key, value in variant.items() if key != "name"}
        train(_config(alone, steps=4, save_every=4, export_dtype="", **settings), samples=samples, target=target, log=_quiet())
        got = load_file(str(together / variant["name"] / "checkpoints" / "step-00000004" / "drafter.safetensors"))
        expected = load_file(str(alone / "checkpoints" / "step-00000004" / "drafter.safetensors"))
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=f"{variant['name']} {key}")


def test_variant_with_unknown_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="block_sise.*block_size"):  # where the config is made, before training
        _config(tmp_path, mode="variants", variants=[{"name": "x", "block_sise": 8}])


def test_two_target_workers_feed_replicas(tmp_path, target):
    second = tiny_target("llama", layers=6, head_scale=20)
    second.model.load_state_dict(target.model.state_dict())
    config = _config(tmp_path, target_devices=["cpu", "cpu"], drafter_devices=["cpu", "cpu"], steps=8)
    summary = train(config, samples=pattern_samples(32), target=[target, second], log=_quiet())
    assert summary["workers"]["target-0"]["items"] == 8 and summary["workers"]["target-1"]["items"] == 8
    assert summary["steps_done"]["drafter"] == 8


def test_a_failing_drafter_stops_everything_quickly_and_names_itself(tmp_path, target):
    def explode(worker, step):
        if worker.name == "drafter-1" and step == 3:
            raise RuntimeError("boom from the test")

    started = time.monotonic()
    with pytest.raises(PipelineError) as failure:
        train(_config(tmp_path, drafter_devices=["cpu", "cpu"], steps=200), samples=pattern_samples(32),
              target=target, log=_quiet(), step_hook=explode)
    message = str(failure.value)
    assert message.startswith("worker drafter-1 failed") and "Traceback" in message and "boom from the test" in message
    assert time.monotonic() - started < 30
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"].startswith("drafter-1 failed")
    # replica 0 saved the last step both replicas completed
    assert summary["drafters"]["drafter"]["checkpoint"].endswith("step-00000004")
    assert not [t for t in threading.enumerate() if t.name.startswith(("drafter-", "target-"))]


def test_interrupt_stops_cleanly_with_a_checkpoint(tmp_path, target):
    import signal

    def interrupt(worker, step):
        if step == 2 and worker.replica.rank == 0:
            os.kill(os.getpid(), signal.SIGINT)

    summary = train(_config(tmp_path, steps=500), samples=pattern_samples(16), target=target, log=_quiet(),
                    step_hook=interrupt)
    assert summary["stop_reason"] == "interrupted by SIGINT"
    done = summary["steps_done"]["drafter"]
    assert 3 <= done < 500
    assert summary["drafters"]["drafter"]["checkpoint"].endswith(f"step-{done:08d}")
    assert "export" not in summary["drafters"]["drafter"]  # an unfinished run is not exported


def test_target_workers_share_each_planned_step():
    """Several target threads asking for the same steps get the same planned batches, and each
    step is planned once (its anchors and loss normaliser are drawn for the whole step)."""
    from dflash_train.core.objective import ObjectiveConfig
    from dflash_train.train.batches import BatchPlanner

    class CountingPlanner(BatchPlanner):
        planned: list[int] = []

        def _plan_step(self, step):
            self.planned.append(step)
            return super()._plan_step(step)

    planner = CountingPlanner(pattern_samples(64), batch_size=4, batches_per_step=4, buckets=[100], seed=0,
                              objectives={"d": ObjectiveConfig(block_size=4, num_anchors=4)})
    seen: dict[int, list] = {0: [], 1: [], 2: []}
    barrier = threading.Barrier(3)

    def worker(index):
        barrier.wait()
        for step in range(6):
            seen[index].append(planner.step_batches(step))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(planner.planned) == list(range(6))
    for step in range(6):
        assert seen[0][step] is seen[1][step] is seen[2][step]
    assert all(b.scored_rows["d"] > 0 for b in seen[0][0])


def test_a_stop_never_undoes_a_released_barrier_generation():
    """The last replica through the gradient barrier may stop the pipeline at once (its step hook
    raised); a peer released by that same generation must still see a normal return and apply
    its update. threading.Barrier.abort() broke such peers when they woke up late."""
    from dflash_train.parallel.threads import PipelineStopped, StopBarrier

    undone = 0
    for _ in range(200):
        barrier = StopBarrier(2)
        outcome = []

        def peer():
            try:
                barrier.wait()
                outcome.append("released")
            except PipelineStopped:
                outcome.append("stopped")

        thread = threading.Thread(target=peer)
        thread.start()
        while barrier._arrived == 0:  # the peer is waiting
            time.sleep(0)
        barrier.wait()
        barrier.abort()
        thread.join()
        undone += outcome == ["stopped"]
    assert undone == 0
    with pytest.raises(PipelineStopped):  # a thread arriving after the stop does not pass
        barrier.wait()


def test_a_drafter_reading_fewer_layers_takes_its_columns_in_its_order_with_one_index():
    """Feature batches hold the union of every variant's target layers; a variant reading a subset
    selects its own, in its own order. Its index tensor is made once per layer set: made per batch
    on CUDA it made the drafter thread wait for the target (see LayerColumns)."""
    from dflash_train.train.drafter_worker import LayerColumns, select_layers

    held, hidden = [1, 3, 5, 7], 4
    features = torch.stack([torch.full((2, 3, hidden), float(k)) for k in held], dim=2).flatten(2)  # [2, 3, 4 · 4]
    columns = LayerColumns([7, 3], torch.device("cpu"))
    index = columns.index(held)
    picked = select_layers(features, len(held), index)
    assert picked.shape == (2, 3, 2 * hidden)
    assert picked[..., :hidden].eq(7).all() and picked[..., hidden:].eq(3).all()
    assert columns.index(list(held)) is index  # made once
    assert columns.index([3, 7]).tolist() == [1, 0]  # another layer set: its own
    with pytest.raises(ValueError, match=r"holds target layers \[1, 3\], not \[7\] this drafter reads"):
        columns.index([1, 3])
