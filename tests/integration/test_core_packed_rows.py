"""`step.pack_rows`: a micro-batch's rows end to end with only their valid anchors gives the padded
layout's hidden states, loss, metrics and gradients (real planned micro-batches of a tiny target,
DFlash and DFlash2, both losses), so packing changes the drafter's work and nothing it learns."""

import pytest
import torch
from test_train_step_graphs import LAYERS, _frozen, _steps
from tiny import DFLASH2, tiny_target

from dflash_train.core.drafter import DrafterConfig
from dflash_train.core.objective import ObjectiveConfig
from dflash_train.core.step import block_predictions, drafter_loss, pack_rows
from dflash_train.train.replicas import init_drafter

ANCHORS = 64  # above many rows' valid positions (rows of 30-110 tokens): from none to most slots padded


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models: spinning OpenMP threads on shared cores cost seconds per test."""


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6, head_scale=20)


def _drafter(target, arch):
    extra = {**DFLASH2, "selector_top_k": 3} if arch == "dflash2" else {}
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=4, mask_token_id=95,
                                       target_layer_ids=LAYERS, **extra)
    return init_drafter(config, 0)


def _micro_batches(target, objective):
    return [batch for step in _steps(target, objective, steps=2, batches_per_step=2) for batch in step]


def test_packing_keeps_every_valid_anchor_in_order_and_pads_the_rest(target):
    batch = _micro_batches(target, ObjectiveConfig(block_size=4, num_anchors=ANCHORS))[-1]
    b, length = batch.input_ids.shape
    count = int(batch.anchor_valid.sum())
    assert count < b * ANCHORS / 2  # the case packing is for
    packed = pack_rows(batch, count + 5)
    rows, slots = torch.nonzero(batch.anchor_valid, as_tuple=True)
    assert packed.anchors[0, :count].tolist() == (batch.anchors[rows, slots] + rows * length).tolist()
    assert packed.anchor_valid[0].tolist() == [True] * count + [False] * 5
    assert packed.anchors[0, count:].tolist() == [0] * 5
    assert packed.row_length == length and packed.input_ids.shape == (1, b * length)
    assert packed.target_features.shape == (1, b * length, batch.target_features.shape[-1])
    assert (packed.scored_rows, packed.loss_normalizer) == (batch.scored_rows, batch.loss_normalizer)


@pytest.mark.parametrize("arch,loss", [("dflash", "decay"), ("dflash", "dpace"), ("dflash2", "decay")])
def test_a_packed_micro_batch_gives_the_padded_hidden_states_loss_metrics_and_gradients(target, arch, loss):
    objective = ObjectiveConfig(block_size=4, num_anchors=ANCHORS, loss=loss, loss_chunk_rows=16,
                                selector_miss="insert")
    drafter, frozen = _drafter(target, arch), _frozen(target)
    for batch in _micro_batches(target, objective):
        count = int(batch.anchor_valid.sum())
        for capacity in (count, count + 3):
            packed = pack_rows(batch, capacity)
            with torch.no_grad():
                padded_hidden, _, padded_valid = block_predictions(drafter, frozen, batch, "sdpa")
                packed_hidden, _, packed_valid = block_predictions(drafter, frozen, packed, "sdpa")
            # Block by block: the valid anchors' blocks, in order, then the packed padding.
            blocks = padded_hidden.view(*batch.anchors.shape, 4, -1)[batch.anchor_valid]
            torch.testing.assert_close(packed_hidden.view(capacity, 4, -1)[:count], blocks, rtol=1e-5, atol=1e-5)
            assert torch.equal(packed_valid[0, :count], padded_valid[batch.anchor_valid])
            assert int(packed_valid.sum()) == int(padded_valid.sum()) == batch.scored_rows

            results = []
            for layout in (batch, packed):
                drafter.zero_grad(set_to_none=True)
                value, metrics = drafter_loss(drafter, frozen, layout, objective, "sdpa")
                value.backward()
                results.append((value.detach(), metrics, [p.grad.clone() for p in drafter.parameters()]))
            (padded_loss, padded_metrics, padded_grads), (packed_loss, packed_metrics, packed_grads) = results
            torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=0)
            assert all(torch.equal(packed_metrics[k], padded_metrics[k]) for k in padded_metrics)
            for got, want in zip(packed_grads, padded_grads):  # float32 sums in another order
                assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_a_packed_block_never_scores_a_label_of_the_next_row():
    """Rows supervised to their last token and the next from its first (no prompt between them):
    the slots of a block past its row's end stay unscored, as in the padded layout."""
    from dflash_train.core.objective import block_labels
    from dflash_train.core.step import DrafterBatch

    ids = torch.arange(2 * 10).view(2, 10)
    loss_mask = torch.ones(2, 10, dtype=torch.bool)
    anchors, valid = torch.tensor([[3, 7], [0, 8]]), torch.ones(2, 2, dtype=torch.bool)
    padded_labels, padded_valid = block_labels(ids, loss_mask, anchors, valid, 4)
    packed = pack_rows(DrafterBatch(torch.zeros(2, 10, 1), ids, loss_mask, anchors, valid, 1.0), 4)
    labels, label_valid = block_labels(packed.input_ids, packed.loss_mask, packed.anchors, packed.anchor_valid, 4,
                                       packed.row_length)
    assert label_valid[0].tolist() == padded_valid.flatten(0, 1).tolist()
    assert label_valid[0, 1].tolist() == [False, True, True, False]  # anchor 7 of 10: slot 3 would be row 1's token 0
    assert torch.equal(labels[0][label_valid[0]], padded_labels[padded_valid])


def test_the_graphed_step_with_packed_anchors_follows_the_padded_classic_step(target, monkeypatch):
    """`--pack-anchors on` as train runs it under CUDA graphs, on the CPU (the captured functions
    run eagerly): the warm-up prepares one shape per whole rows' worth of anchor slots in each
    length bucket, with captures checked against eager micro-batches on packed synthetic data;
    every planned micro-batch packs into a prepared shape and rows bucket; 10 steps of 2
    micro-batches follow the padded classic step (losses, metrics, weights, moments)."""
    import copy
    import dataclasses
    import warnings

    from test_train_step_graphs import BUCKETS, _drafter, _eager, _EagerGraph, _graphed, _relative, _trainer, _warm_up_on_cpu

    from dflash_train.core.step import InputShape, anchor_capacity

    objective = ObjectiveConfig(block_size=4, num_anchors=ANCHORS, loss_chunk_rows=16)
    packing = dataclasses.replace(objective, pack_anchors=True)
    steps = _steps(target, objective, steps=10, batches_per_step=2)
    classic_drafter = _drafter(target)
    packed_drafter = copy.deepcopy(classic_drafter)
    classic_opt, classic_sched = _trainer(target, objective, classic_drafter)
    packed_opt, packed_sched = _trainer(target, packing, packed_drafter)
    graphed = _graphed(target, packing, packed_drafter, packed_opt, packed_sched)
    rows = 4  # _graphed's batch size
    assert {(s.row_length, s.num_anchors) for s in graphed.shapes.inputs} == {
        (length, capacity) for length in BUCKETS
        for capacity in range(ANCHORS, anchor_capacity(rows * min(ANCHORS, length - 1), ANCHORS) + 1, ANCHORS)}
    _warm_up_on_cpu(graphed, monkeypatch, lambda fn, device, stream, pool=None: (_EagerGraph(fn), None))
    assert not graphed.eager_reasons and len(graphed.graphs) == sum(len(r) for r in graphed.shapes.rows.values())
    capacities = set()
    for micro in steps:
        for batch in micro:
            shape = InputShape.of(graphed.step.layout(batch))
            capacities.add(shape.num_anchors)
            assert shape in graphed.inputs and graphed.shapes.rows_for(shape, batch.scored_rows) in graphed.shapes.rows[shape]
    assert len(capacities) >= 2  # micro-batches of different fill
    classic_step = _eager(target, objective, classic_drafter, classic_opt, classic_sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a micro-batch no shape was prepared for would warn
        results = [(classic_step.run(micro), graphed.run(micro)) for micro in steps]
    for step, (classic, packed) in enumerate(results):
        assert packed.loss == pytest.approx(classic.loss, rel=1e-5), step
        assert packed.grad_norm == pytest.approx(classic.grad_norm, rel=1e-5), step
        assert all(torch.equal(packed.metric_sums[k], classic.metric_sums[k]) for k in classic.metric_sums), step
    # AdamW divides by the root of the second moment: where a gradient is near zero, last-bit
    # differences in it move the weight by up to lr, so weights are compared at the largest's scale.
    for (name, got), want in zip(packed_drafter.named_parameters(), classic_drafter.parameters()):
        assert _relative(got, want) < 1e-5, name
        assert _relative(packed_opt.state[got]["exp_avg_sq"], classic_opt.state[want]["exp_avg_sq"]) < 1e-5, name


@pytest.mark.parametrize("parallel", [{}, {"drafter_devices": ["cpu", "cpu"], "grad_accum": 2}],
                         ids=["one-replica", "two-replicas-two-micro-batches"])
def test_train_with_packed_anchors_follows_the_padded_run(tmp_path, target, parallel):
    """`train --pack-anchors on` (the planner's host counts through the drafter worker into the
    step's layout; with replicas and accumulation, each replica's micro-batches): 30 steps log the
    padded run's losses and accuracies."""
    import io
    import json

    from tiny import pattern_samples, tiny_train_config

    from dflash_train.train.trainer import train

    samples = pattern_samples(32, min_len=20, max_len=110)
    history, logs = {}, {}
    for pack in ("off", "on"):
        out, logs[pack] = tmp_path / pack, io.StringIO()
        config = tiny_train_config(out, steps=30, num_anchors=ANCHORS, lr=3e-3, log_every=1, save_every=30,
                                   pack_anchors=pack, **parallel)
        train(config, samples=samples, target=target, log=logs[pack])
        history[pack] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "anchors packed" in logs["on"].getvalue() and "anchors packed" not in logs["off"].getvalue()
    assert len(history["on"]) == len(history["off"]) == 30
    # Another summation order, so not bit for bit: the packed run did run packed.
    assert any(packed["loss"] != padded["loss"] for packed, padded in zip(history["on"], history["off"]))
    for step, (packed, padded) in enumerate(zip(history["on"], history["off"])):
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-4), step
        assert packed["accuracy"] == pytest.approx(padded["accuracy"], abs=1e-6), step
