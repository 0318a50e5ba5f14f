"""Anchors, labels, weights, D-PACE, chunked frozen-head CE, metrics."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.core.head_kernel import BLOCK as HEAD_KERNEL_BLOCK
from dflash_train.core.objective import (
    TOP_K_ONE_PASS,
    ObjectiveConfig,
    block_labels,
    block_metrics,
    block_token_ids,
    candidate_segment,
    decay_weights,
    default_gamma,
    dpace_weights,
    draw_anchors,
    frozen_head_cross_entropy,
    frozen_head_cross_entropy_and_candidates,
    fused_head_segment,
    fused_head_unsupported,
    row_top_k,
    summarize_metrics,
    valid_anchor_positions,
    weighted_loss,
)


def test_valid_anchor_needs_p_and_p_plus_one_supervised():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
    assert valid_anchor_positions(mask).tolist() == [1, 2, 7]  # 8 has no p + 1; 5 is followed by 0


def test_anchors_deterministic_sorted_padded_and_independent_of_batching():
    mask = torch.zeros(50, dtype=torch.bool)
    mask[10:40] = True
    a1, v1 = draw_anchors(mask, 8, seed=3, sample_id=17, epoch=2)
    a2, v2 = draw_anchors(mask.clone(), 8, seed=3, sample_id=17, epoch=2)
    assert torch.equal(a1, a2) and v1.all()
    assert torch.equal(a1, torch.sort(a1)[0])
    assert all(mask[p] and mask[p + 1] for p in a1.tolist())
    a3, _ = draw_anchors(mask, 8, seed=3, sample_id=17, epoch=3)
    assert not torch.equal(a1, a3), "a new epoch redraws"
    short = torch.zeros(50, dtype=torch.bool)
    short[5:9] = True  # valid anchors: 5, 6, 7
    a4, v4 = draw_anchors(short, 8, seed=0, sample_id=1, epoch=0)
    assert a4[:3].tolist() == [5, 6, 7] and v4.tolist() == [True] * 3 + [False] * 5 and a4[3:].eq(0).all()


def test_labels_are_same_position_and_slot_zero_is_never_scored():
    ids = torch.arange(100, 120)[None]
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[0, 15] = False
    labels, valid = block_labels(ids, mask, torch.tensor([[3, 13]]), torch.tensor([[True, True]]), 4)
    assert labels[0, 0].tolist() == [103, 104, 105, 106]  # slot k of anchor a -> token a + k (not a + k + 1)
    assert valid[0, 0].tolist() == [False, True, True, True]
    assert valid[0, 1].tolist() == [False, True, False, True]  # 15 unsupervised
    labels, valid = block_labels(ids, mask, torch.tensor([[18]]), torch.tensor([[True]]), 4)
    assert valid[0, 0].tolist() == [False, True, False, False]  # 20, 21 are past the end


def test_block_inputs_anchor_then_mask():
    ids = torch.arange(10)[None] + 50
    assert block_token_ids(ids, torch.tensor([[2, 6]]), 3, 9).tolist() == [[[52, 9, 9], [56, 9, 9]]]


def test_decay_weights_and_paper_gammas():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[8]), math.exp(-1), rel_tol=1e-6)
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def test_loss_normalised_over_the_global_batch():
    """Two micro-batches each normalised by the global Σw add up to the loss of the joint batch."""
    torch.manual_seed(0)
    ce = torch.rand(4, 3, 5)
    valid = torch.rand(4, 3, 5) > 0.3
    valid[..., 0] = False
    objective = ObjectiveConfig(block_size=5, num_anchors=3)
    total = objective.normalizer(valid)
    whole = weighted_loss(ce, valid, objective, total)
    parts = weighted_loss(ce[:2], valid[:2], objective, total) + weighted_loss(ce[2:], valid[2:], objective, total)
    torch.testing.assert_close(parts, whole)
    w = decay_weights(5, objective.gamma) * valid
    torch.testing.assert_close(whole, (w * ce).sum() / w.sum())
    # per-micro-batch normalisation would differ: the test can tell the two apart
    local = weighted_loss(ce[:2], valid[:2], objective, objective.normalizer(valid[:2]))
    local = local + weighted_loss(ce[2:], valid[2:], objective, objective.normalizer(valid[2:]))
    assert not torch.allclose(local, whole)


def test_dpace_weights_match_the_definition():
    torch.manual_seed(1)
    q = torch.rand(2, 3, 6, dtype=torch.float64)
    valid = torch.rand(2, 3, 6) > 0.2
    valid[..., 0] = False
    alpha = 0.4
    got = dpace_weights(q, valid, alpha)
    for b in range(2):
        for n in range(3):
            prefix, p = [], 1.0
            for k in range(6):
                p *= (1 - alpha) * float(q[b, n, k]) + alpha if valid[b, n, k] else 1.0
                prefix.append(p)
            for k in range(6):
                want = sum(prefix[m] for m in range(k, 6) if valid[b, n, m]) if valid[b, n, k] else 0.0
                assert math.isclose(float(got[b, n, k]), want, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_chunked_frozen_head_ce_matches_full_ce_and_its_gradient(softcap):
    torch.manual_seed(2)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,))
    row_weights = torch.rand(37, dtype=torch.float64)
    ce, correct = frozen_head_cross_entropy(hidden, head, labels, chunk_rows=5, softcap=softcap)
    (grad,) = torch.autograd.grad((ce * row_weights).sum(), hidden)
    logits = hidden @ head.t()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    reference = F.cross_entropy(logits, labels, reduction="none")
    (reference_grad,) = torch.autograd.grad((reference * row_weights).sum(), hidden)
    torch.testing.assert_close(ce.double(), reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-4, atol=1e-6)  # logits are float32
    assert torch.equal(correct, logits.argmax(-1) == labels)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_head_ce_and_candidates_come_from_the_same_logits(compiled, softcap):
    """DFlash2's candidates made in the CE's chunk loop (37 rows in chunks padded to 64 when
    compiled): the CE and its gradient are the plain CE's, and each row's candidates are its k
    largest (softcapped) logits, their ids and the label's logit."""
    torch.manual_seed(3)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.randn(600, 16)
    labels = torch.randint(0, 600, (37,))
    kwargs = dict(chunk_rows=64 if compiled else 5, softcap=softcap, compiled=compiled)
    ce, correct, candidates = frozen_head_cross_entropy_and_candidates(hidden, head, labels, 6, **kwargs)
    (grad,) = torch.autograd.grad(ce.sum(), hidden)
    plain_ce, plain_correct = frozen_head_cross_entropy(hidden, head, labels, **kwargs)
    (plain_grad,) = torch.autograd.grad(plain_ce.sum(), hidden)
    assert torch.equal(ce, plain_ce) and torch.equal(correct, plain_correct) and torch.equal(grad, plain_grad)
    logits = (hidden @ head.t()).detach()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    torch.testing.assert_close(candidates.values, torch.topk(logits, 6).values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.gather(1, candidates.ids), candidates.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(candidates.label_logits, logits.gather(1, labels[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    assert candidates.values.shape == candidates.ids.shape == (37, 6) and not candidates.values.requires_grad
    _, _, none = frozen_head_cross_entropy_and_candidates(hidden, head, labels, 0, **kwargs)
    assert none.values.shape == (37, 0) and none.label_logits.numel() == 0


def test_the_fused_head_kernel_is_refused_off_cuda_and_the_cpu_keeps_the_reference():
    """The fused softmax kernel is Triton on CUDA only: a CPU device gets the reason, so `train`
    keeps the eager or compiled chunk there (its equality with the reference is a GPU test:
    tests/gpu/test_core_head_kernel_gpu.py)."""
    assert fused_head_unsupported(torch.device("cpu")) == "not a CUDA device (cpu)"
    assert fused_head_unsupported("cpu", 30.0) == "not a CUDA device (cpu)"


def test_compiled_head_chunk_matches_eager_and_compiles_once_for_any_row_count():
    """The compiled chunk pads the last chunk to a fixed shape: same CE, correctness and
    gradient as the eager reference, and one graph for every row count."""
    from torch._dynamo.utils import counters

    torch.manual_seed(3)
    head = torch.randn(300, 24)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for rows in (37, 70, 5):
        hidden = torch.randn(rows, 24, requires_grad=True)
        labels = torch.randint(0, 300, (rows,))
        row_weights = torch.rand(rows)
        results = {}
        for compiled in (False, True):
            ce, correct = frozen_head_cross_entropy(hidden, head, labels, chunk_rows=16, softcap=6.0, compiled=compiled)
            (grad,) = torch.autograd.grad((ce * row_weights).sum(), hidden)
            results[compiled] = ce, correct, grad
        torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(results[True][1], results[False][1])
        torch.testing.assert_close(results[True][2], results[False][2], rtol=1e-4, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs == [graphs[0]] * 3, graphs


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("vocab", [4096, 4096 + 37, 8 * 64, 300, 49152])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [8, 16])  # the decode bench's top-k and the default
def test_row_top_k_finds_torch_topk_values_with_ties_and_a_ragged_tail(vocab, dtype, k):
    """The selector's candidates: the values torch.topk finds, sorted, ids pointing at them.
    Rows hold bf16-rounded values (many ties), a row's top values packed into one slice, a row
    whose best entries sit in the ragged tail, and a constant row."""
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(64, vocab, generator=generator) * 3).to(dtype)
    logits[1, 128:136] = 50.0 + torch.arange(8, dtype=dtype)  # eight of the best in one slice
    logits[2, -5:] = 60.0  # the best in the tail (when there is one), tied
    logits[3] = 1.0  # every entry tied
    want_values, _ = torch.topk(logits, k, dim=-1)
    # The slice maxima found here, or given as the fused head kernel writes them (float32).
    segment = candidate_segment(vocab)
    slices = vocab // segment
    given = logits[:, :slices * segment].float().view(64, slices, segment).amax(dim=-1)
    for values, ids in (row_top_k(logits, k), row_top_k(logits, k, segment, given)):
        assert torch.equal(values, want_values)
        assert torch.equal(logits.gather(1, ids), values)
        assert all(len(set(row)) == k for row in ids.tolist())  # k distinct entries per row


def test_row_top_k_ranks_slices_by_the_maxima_it_is_given():
    """Given maxima decide which slices are ranked: maxima that name the wrong slices give wrong
    values (so a test with right ones proves they are used), and a shape that does not match the
    logits' slices is refused."""
    logits = torch.zeros(2, 4096)
    logits[:, 1000] = 5.0  # slice 15 of 64-wide slices
    maxima = logits.view(2, 64, 64).amax(dim=-1)
    assert row_top_k(logits, 1, 64, maxima)[0].flatten().tolist() == [5.0, 5.0]
    wrong = maxima.clone()
    wrong[:, 15], wrong[:, 3] = 0.0, 9.0
    assert row_top_k(logits, 1, 64, wrong)[0].flatten().tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="slice maxima"):
        row_top_k(logits, 1, 128, maxima)


def test_candidate_segment_keeps_the_slice_ranking_to_one_pass():
    assert candidate_segment(49152) == 128  # SmolLM2: 384 slices
    assert candidate_segment(151936) == 512  # Qwen3: 296 slices
    assert candidate_segment(300) == 64
    for vocab in (4096, 49152 + 13, 151936, 262144, 10 ** 7):
        segment = candidate_segment(vocab)
        assert segment & (segment - 1) == 0 and HEAD_KERNEL_BLOCK % segment == 0
        assert vocab // segment <= TOP_K_ONE_PASS or segment == HEAD_KERNEL_BLOCK
    # the width train probes the fused kernel with: DFlash2's, none for DFlash
    assert fused_head_segment("dflash2", 49152) == 128 and fused_head_segment("dflash", 49152) == 0


def test_chunked_ce_peak_tensor_does_not_grow_with_rows_times_vocab():
    vocab, hidden_size, chunk = 4000, 32, 64
    head = torch.randn(vocab, hidden_size)
    sizes = {}
    for rows in (256, 2048):
        hidden = torch.randn(rows, hidden_size, requires_grad=True)
        labels = torch.randint(0, vocab, (rows,))
        with _LargestTensor() as probe:
            ce, _ = frozen_head_cross_entropy(hidden, head, labels, chunk_rows=chunk)
            ce.sum().backward()
        sizes[rows] = probe.largest
    assert sizes[256] == sizes[2048] == chunk * vocab  # one chunk of logits, whatever the row count
    assert sizes[2048] < 2048 * vocab / 8


def test_metrics_per_position_accuracy_and_simulated_tau():
    valid = torch.ones(1, 2, 5, dtype=torch.bool)
    valid[..., 0] = False
    correct = torch.tensor([[[0, 1, 1, 0, 1], [0, 1, 1, 1, 1]]], dtype=torch.bool)
    sums = block_metrics(correct, valid, torch.tensor([[True, True]]))
    summary = summarize_metrics(sums)
    assert summary["position_accuracy"] == [1.0, 1.0, 0.5, 1.0]
    assert summary["tau_sim"] == 1 + (2 + 4) / 2  # leading correct runs: 2 and 4


def test_objective_config_errors():
    with pytest.raises(ValueError, match="loss"):
        ObjectiveConfig(block_size=4, num_anchors=2, loss="mse")
    with pytest.raises(ValueError, match="dpace_alpha"):
        ObjectiveConfig(block_size=4, num_anchors=2, dpace_alpha=1.5)
