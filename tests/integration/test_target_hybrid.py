"""Hybrid (Gated DeltaNet + full attention) and MoE targets: load, capture, decode losslessly,
regenerate exactly (float32, CPU, tiny random configs of each family).

Qwen3.5 (dense and MoE) and Qwen3-Next mix linear-attention layers, whose recurrent state
Hugging Face's `Cache.crop` does not roll back, with full attention; Qwen3-MoE and gpt-oss
(attention sinks, sliding windows, YaRN) put experts in every block.
"""

from __future__ import annotations

import io
import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from dflash_train.target.model import Target, load_target
from dflash_train.target.linear_attention import LinearStates
from dflash_train.target.probe import feature_forward_unsupported, float32_replica, static_unsupported
from dflash_train.target.walk import FeatureForward
from test_generate_engine import by_id, early_stop_token, hf_generate, make_jobs
from tiny import HYBRID_FAMILIES, NEW_FAMILIES, slow_decay, tiny_hf_model, tiny_target

from dflash_train.capture import CapturedStep
from dflash_train.config import UserError
from dflash_train.core.drafter import DFlashDrafter, DrafterConfig
from dflash_train.decode import hf as hf_decoder
from dflash_train.decode.families import describe_target
from dflash_train.decode.loop import describe_decoder, generate
from dflash_train.decode.recurrent import StateSnapshot
from dflash_train.eval.in_training import InTrainingEvaluator
from dflash_train.generate.engine import BatchState, EagerBatchEngine, StaticBatchEngine, generate_batch, local_engine
from dflash_train.generate.regenerate import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, MASK = 48, 47


def family_target(family: str, seed: int = 0) -> Target:
    return slow_decay(tiny_target(family, vocab=VOCAB, hidden=64, layers=4, head_scale=8, seed=seed), seed)


def naive_greedy(model, prompt: list[int], count: int, stops=()) -> list[int]:
    """Greedy decoding recomputing the whole sequence each step: no cache, nothing to roll back."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            if ids[-1] in stops:
                break
    return ids[len(prompt):]


class PlannedDrafter(DFlashDrafter):
    """A real drafter (its context cache runs) whose proposals are the target's greedy
    continuation right for a random number of tokens per block, 0..B−1, then wrong: every block
    position gets rejected in some step. Its rows r satisfy r @ head.T = 30·onehot(proposal)
    (the head has full row rank: vocab < hidden)."""

    def __init__(self, config, target, continuation: list[int], seed: int):
        super().__init__(config)
        self.continuation, self.rng = continuation, random.Random(seed)
        self.pinv = torch.linalg.pinv(target.head_weight)

    def draft(self, cache, new_features, new_positions, block_embeds, block_positions):
        hidden = super().draft(cache, new_features, new_positions, block_embeds, block_positions)
        anchor, length = int(block_positions[0, 0]), block_positions.shape[1]
        right = self.rng.randrange(length)
        proposal = [self.continuation[anchor + k] if k <= right else (self.continuation[anchor + k] + 1) % VOCAB
                    for k in range(1, length)]
        rows = 30.0 * F.one_hot(torch.tensor(proposal), VOCAB).float() @ self.pinv.t()
        return torch.cat([hidden[:, :1], rows[None]], dim=1)


# --- load and capture ----------------------------------------------------------------------------

@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_family_loads_from_a_folder_and_captures_the_chosen_layers(family, tmp_path):
    tiny_hf_model(family, vocab=VOCAB, layers=4).save_pretrained(tmp_path)
    target = load_target(tmp_path)
    assert target.spec.model_type == family
    # The drafter's rope: plain, whole-head, the target's theta (YaRN kept for gpt-oss).
    rope = target.spec.rope_parameters
    assert "partial_rotary_factor" not in rope and "mrope_section" not in rope
    assert rope["rope_theta"] == target.model.config.rope_parameters["rope_theta"]
    assert rope["rope_type"] == ("yarn" if family == "gpt_oss" else "default")
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = target.model(ids, output_hidden_states=True, use_cache=False).hidden_states
    ran = []
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: ran.append(k)) for k, layer in enumerate(target.layers)]
    try:
        for layer_ids in ([1], [0, 2], [3, 1]):  # layer k = hidden_states[k + 1]; the last one after the norm
            ran.clear()
            got = target.features(ids, layer_ids)
            assert torch.equal(got, torch.cat([expected[k + 1] for k in layer_ids], dim=-1)), layer_ids
            assert max(ran) == max(layer_ids)  # stopped at the last needed layer
    finally:
        for hook in hooks:
            hook.remove()
    # The graph-capturable forward where its probe passes (gpt-oss: sliding windows need the model's mask).
    reason = feature_forward_unsupported(target, 21)
    if family == "gpt_oss":
        assert "sliding window" in reason
    else:
        assert reason is None
        for layer_ids in ([1], [3, 0]):
            assert torch.equal(FeatureForward(target, layer_ids)(ids), target.features(ids, layer_ids))
    line = describe_target(target, 21)
    assert line.startswith(f"target: {family} (") and "capture:" in line and "regenerate:" in line
    if family in HYBRID_FAMILIES:
        assert "regenerate: static batched generator (linear-attention states per slot)" in line, line
        assert "decode: static decoder, linear-attention states advanced by the kept tokens" in line, line


def test_a_qwen3_5_image_text_folder_loads_as_its_language_model(tmp_path):
    """Qwen3.5 releases are image-text models (model_type qwen3_5, text_config inside): the
    target is their language model, with the wrapper's own logits."""
    import transformers
    from tiny import hybrid_layer_types

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, layer_types=hybrid_layer_types(4))
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(0)
    wrapper = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text, vision_config=vision))
    wrapper.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    assert target.spec.model_type == "qwen3_5_text" and len(target.layers) == 4
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, wrapper(input_ids=ids).logits)


def test_the_behaviour_probes_run_one_layer_of_each_kind():
    """A hybrid's 2-layer probe replica has a linear and a full attention layer: two linear ones
    would never run the attention the probes are about."""
    replica = float32_replica(family_target("qwen3_5_text").model, torch.device("cpu"))
    assert replica.config.layer_types == ["linear_attention", "full_attention"]
    assert len(replica.model.layers) == 2
    # An MoE replica keeps a few experts (routing is per token): Qwen3-Next's 512 would take ~13 GB.
    import transformers

    many = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=64,
        num_experts_per_tok=6, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    assert float32_replica(many, torch.device("cpu")).config.num_experts == 6


def test_the_static_probe_passes_hybrids_and_catches_states_not_rolled_back(monkeypatch):
    """The static forward's probe runs a verify step kept in part on a hybrid replica: with the
    commit doing nothing (states left where they were before the block), it refuses the target."""
    assert static_unsupported(family_target("qwen3_next"), 512) is None
    monkeypatch.setattr(LinearStates, "commit", lambda self, counts, length: None)
    reason = static_unsupported(family_target("qwen3_5_text", seed=4), 512)  # a new model: verdicts are cached per model
    assert reason is not None and "partly kept verify step" in reason, reason


# --- lossless speculative decoding ---------------------------------------------------------------

@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_greedy_speculative_equals_target_only_with_rejections_at_every_position(family):
    target = family_target(family)
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=MASK, target_layer_ids=[0, 3])
    prompt = [7, 3, 11, 30, 2, 9]
    greedy = naive_greedy(target.model, prompt, 40)
    assert generate(target, None, prompt, 40).tokens == greedy
    stop = greedy[17]
    seen = set()
    for seed, (max_new, stops) in enumerate([(40, ()), (29, [stop]), (5, ()), (1, ()), (4, [greedy[2]])]):
        drafter = PlannedDrafter(config, target, prompt + greedy, seed).eval()
        result = generate(target, drafter, prompt, max_new, stops, decoder="hf")
        assert result.tokens == naive_greedy(target.model, prompt, max_new, stops), (max_new, stops)
        assert result.decoder == "hf"
        assert 1 + sum(result.acceptance_lengths) == len(result.tokens)
        seen.update(result.acceptance_lengths)
    assert {1, 2, 3, 4} <= seen  # rejected at every block position, and full blocks


def test_crop_alone_is_lossy_on_a_hybrid_and_the_rollback_probe_says_so(monkeypatch):
    """The trap itself: cropping after a rejected block leaves the recurrent state advanced. With
    the rollback left out (the snapshot not restored; where transformers records the states a
    crop puts back, no state recorded), the rollback probe finds it and the decoder refuses."""
    target = family_target("qwen3_5_text", seed=2)
    assert hf_decoder.rollback_unsupported(target) is None
    if hf_decoder.RECORDS_RECURRENT_STATES:
        recording = hf_decoder.new_target_cache
        monkeypatch.setattr(hf_decoder, "new_target_cache", lambda model, rollback_tokens=1: recording(model, 0))
    else:
        monkeypatch.setattr(StateSnapshot, "restore", lambda self: None)
    lossy = family_target("qwen3_5_text", seed=3)  # a new model: verdicts are cached per model
    reason = hf_decoder.rollback_unsupported(lossy)
    assert reason is not None and ("differs from the target's own forward" in reason
                                   or "could not be rolled back" in reason), reason
    config = DrafterConfig.from_target(lossy.spec, num_layers=1, block_size=4, mask_token_id=MASK, target_layer_ids=[0, 3])
    with pytest.raises(UserError, match="cannot be lossless"):
        generate(lossy, DFlashDrafter(config).eval(), [1, 2, 3], 8, decoder="hf")


@pytest.mark.parametrize("family", ["qwen3_moe", *HYBRID_FAMILIES])
def test_the_static_decoder_equals_target_only_decoding(family):
    """The static decoder (what `eval` and the in-training evaluator pick on these targets): a
    hybrid's verify step leaves its linear-attention states pending and the kept tokens advance
    them, so greedy output is target-only decoding's. Drafters fitted a little (accepting often,
    not always) and a random one (rejecting mostly at once), full blocks, early stops, the cap."""
    from test_decode_loop import fit_drafter, random_drafter

    target = family_target(family)
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=MASK, target_layer_ids=[0, 3])
    torch.manual_seed(0)
    fitted = DFlashDrafter(config)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, MASK, (n,), generator=generator).tolist() for n in (6, 6, 6, 9, 3)]
    greedy = [naive_greedy(target.model, p, 30) for p in prompts]
    fit_drafter(target, fitted, [p + g for p, g in zip(prompts[:3], greedy[:3])], 6, steps=20)  # not the last two
    untrained = random_drafter(target, block_size=4, layer_ids=(0, 3), mask_token_id=MASK, std=0.2)
    assert describe_decoder(target, fitted, 64, "auto").startswith("decoder: static")
    lengths = []
    for prompt, expected in zip(prompts, greedy):
        assert generate(target, None, prompt, 30, decoder="static").tokens == expected
        for drafter in (fitted, untrained):
            for max_new, stop in ((30, None), (13, expected[9]), (2, None)):
                result = generate(target, drafter, prompt, max_new, [stop] if stop is not None else (), decoder="static")
                assert result.decoder == "static"
                want = expected[:max_new]
                assert result.tokens == (want[: want.index(stop) + 1] if stop in want else want), (max_new, stop)
                lengths += result.acceptance_lengths
    assert {1, 2, 3, 4} <= set(lengths)  # rejected at every block position, and full blocks


@pytest.mark.parametrize("decoder", ["hf", "static"])
def test_sampling_on_a_hybrid_is_exact_rejection_sampling(decoder):
    """T = 1 on a hybrid: each new position's token frequencies match the target's own marginals
    (enumerated), with a drafter far from the target so rejections and rollbacks are frequent
    (static: the kept tokens advance the pending linear-attention states through `keep`)."""
    from test_decode_loop import chi_square_p_value, exact_marginals, random_drafter

    vocab, count = 12, 3
    target = slow_decay(tiny_target("qwen3_5_text", vocab=vocab, hidden=32, layers=2, head_scale=10))
    drafter = random_drafter(target, block_size=3, layer_ids=(0, 1), mask_token_id=vocab - 1, std=1.0)
    prompt = [1, 5, 3, 7, 2]
    marginals = exact_marginals(target.model, prompt, count, vocab)
    assert marginals.max() > 0.15  # a peaked target: the test has power
    generator = torch.Generator().manual_seed(0)
    tokens, lengths = [], []
    for _ in range(300):
        result = generate(target, drafter, prompt, count, temperature=1.0, generator=generator, decoder=decoder)
        assert result.decoder == decoder
        tokens.append(result.tokens)
        lengths += result.acceptance_lengths
    tokens = torch.tensor(tokens)
    assert {1, 2} <= set(lengths)
    for i in range(count):
        assert chi_square_p_value(torch.bincount(tokens[:, i], minlength=vocab), marginals[i]) > 1e-3, i
    if decoder == "static":  # longer answers draw as the HF decoder's, seed for seed (the same draws)
        for seed in range(12):
            runs = [generate(target, drafter, prompt, 16, temperature=1.0, decoder=name,
                             generator=torch.Generator().manual_seed(seed)) for name in ("hf", "static")]
            assert runs[0].tokens == runs[1].tokens and runs[0].acceptance_lengths == runs[1].acceptance_lengths, seed


def test_in_training_evaluator_on_a_hybrid_picks_the_static_decoder_for_a_plain_drafter():
    target = family_target("qwen3_5_moe_text")
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=MASK, target_layer_ids=[1, 3])
    prompts = [[3, 9, 27], [40, 1, 5, 6]]
    greedy = [naive_greedy(target.model, p, 20) for p in prompts]
    drafter = PlannedDrafter(config, target, prompts[0] + greedy[0], seed=0).eval()
    metrics = InTrainingEvaluator(target, prompts[:1], max_new_tokens=20).measure(drafter)
    assert metrics["decoder"] == "hf" and metrics["tokens"] == 20 and metrics["tau"] > 1.5  # it overrides draft()
    assert generate(target, drafter, prompts[0], 20).tokens == greedy[0]
    # A plain drafter (what training measures) gets the static decoder, as `eval --decoder static` does.
    plain = DFlashDrafter(config).eval()
    metrics = InTrainingEvaluator(target, prompts, max_new_tokens=20).measure(plain)
    assert metrics["decoder"] == "static" and metrics["tokens"] == 40
    assert describe_decoder(target, plain, 64, "static").startswith("decoder: static")
    assert [generate(target, plain, p, 20, decoder="static").tokens for p in prompts] == greedy


# --- regenerate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_regenerated_rows_equal_hugging_face_generate_per_prompt(family):
    """Hybrids and Qwen3-MoE go to the static generator (slots refilled: a hybrid's linear-attention
    states start from zero in a refilled slot), gpt-oss (a 16-token sliding window) to the Hugging
    Face batches (left padding, rows leaving the batch as they stop). 9 prompts of 1..70 tokens
    (70: a prefill of two 64-token chunks) through 3 slots; rows stop early or hit the cap."""
    target = family_target(family)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, MASK, (n,), generator=generator).tolist() for n in (3, 11, 6, 1, 8, 70, 2, 15, 5)]
    max_new = 12
    free = [hf_generate(target, p, max_new, stop=MASK).tokens for p in prompts]
    stop = free[0][4]  # row 0 stops mid-answer; others may or may not
    settings = GenerationSettings(max_new_tokens=max_new)
    engine = local_engine(_with_tokenizer(target), settings, batch_size=3, max_prompt_tokens=70, log=io.StringIO())
    if family == "gpt_oss":
        assert isinstance(engine, EagerBatchEngine) and "sliding window" in engine.description
        # The static generator asked directly says the probe's reason before any forward runs.
        with pytest.raises(ValueError, match="static batched generator cannot run GptOssForCausalLM: its 16-token sliding"):
            next(iter(StaticBatchEngine(target, settings, [stop], slots=3).generated(make_jobs(prompts))))
        engine = EagerBatchEngine(target, settings, [stop], batch_size=4)
    else:
        assert isinstance(engine, StaticBatchEngine)
        assert ("linear-attention states per slot" in engine.description) == (family in HYBRID_FAMILIES)
        # bucketed prefills: padded to (power-of-two rows, multiple-of-64 width), the padding rows'
        # states written to a scratch row no step reads (what CUDA graphs replay), here eagerly.
        engine = StaticBatchEngine(target, settings, [stop], slots=3, bucket_prefills=family == "qwen3_5_moe_text")
    got = by_id(engine.generated(make_jobs(prompts)))
    expected = {f"row{i}": hf_generate(target, p, max_new, stop) for i, p in enumerate(prompts)}
    assert got == expected
    assert got["row0"].finish_reason == "stop" and any(g.finish_reason == "length" for g in got.values())
    if family == "gpt_oss":  # one batch, rows leaving it as they stop (the engine would retry a failed batch row by row)
        together = generate_batch(target.model, prompts, max_new_tokens=max_new, stop_ids=[stop], pad_id=0)
        assert {f"row{i}": g for i, g in enumerate(together)} == expected
    else:
        assert engine.stats.prefills >= 3  # slots were refilled
    if family in HYBRID_FAMILIES:  # sampled rows draw as the Hugging Face batches draw, seed for seed
        sampling = GenerationSettings(max_new_tokens=max_new, temperature=1.0, top_p=0.9)
        jobs = make_jobs(prompts, seed=3)
        sampled = by_id(StaticBatchEngine(target, sampling, [stop], slots=3).generated(jobs))
        assert sampled == by_id(EagerBatchEngine(target, sampling, [stop], batch_size=4).generated(jobs))


def test_a_hybrid_row_moved_to_another_slot_takes_its_states_along():
    """The tail of a run packs busy rows into the lowest slots (`BatchState.move`): a row moved
    mid-answer onto a slot another prompt used goes on from its own linear-attention states."""
    target = family_target("qwen3_5_text")
    generator = torch.Generator().manual_seed(5)
    mover, other = (torch.randint(0, MASK, (n,), generator=generator).tolist() for n in (9, 14))
    max_new, never = 20, VOCAB  # a stop token outside the vocabulary: both rows run to the cap
    state = BatchState(target, 4, 512, GenerationSettings(max_new_tokens=max_new), [never], graphs=False)
    state.admit([0, 3], [other, mover], [0, 1])
    for _ in range(6):
        state.step(256, 4)
    state.move([3], [0])  # over the other prompt's states
    state.finished[3] = True
    for _ in range(max_new):
        state.step(256, 1)
    emitted = int(state.emitted[0])
    assert emitted == max_new
    assert state.generated[0, :emitted].tolist() == hf_generate(target, mover, max_new, stop=never).tokens


def _with_tokenizer(target: Target) -> Target:
    """The target with a stand-in tokenizer: `local_engine` reads its stop tokens from one."""
    from types import SimpleNamespace

    return Target(target.model, SimpleNamespace(eos_token_id=MASK, pad_token_id=None))


# --- train --------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_moe", "gpt_oss"])
def test_the_threaded_pipeline_trains_on_hybrid_and_moe_targets(family, tmp_path):
    from tiny import pattern_samples, tiny_train_config

    from dflash_train.train.trainer import train

    target = tiny_target(family, layers=4, head_scale=20)
    log = io.StringIO()
    config = tiny_train_config(tmp_path, steps=40, num_anchors=16, lr=1e-2, log_every=5, save_every=40,
                               target_layer_ids=[0, 2, 3])
    summary = train(config, samples=pattern_samples(8, max_len=60), target=target, log=log)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert history[-1]["step"] == 40 and history[-1]["loss"] < history[0]["loss"] / 2
    kind = "moe" if family in ("qwen3_moe", "gpt_oss") else "hybrid"
    assert f"target: {family} ({kind}" in log.getvalue()  # said once, at start
    assert summary["drafters"]["drafter"]["export"]


def test_the_feature_cache_holds_a_hybrid_targets_features(tmp_path):
    from dflash_train.data.feature_cache import FeatureCache, write_feature_cache
    from dflash_train.data.readers import RowStats
    from dflash_train.data.samples import TrainingSample

    target = family_target("qwen3_next")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i, length in enumerate((9, 30, 17, 4, 22)):
        ids = torch.randint(0, MASK, (length,), generator=generator)
        rows.append(TrainingSample(i, ids, torch.ones(length, dtype=torch.bool), f"rows:{i + 1}"))
    stats = RowStats()
    write_feature_cache(target, rows, stats, tmp_path / "cache", layer_ids=[0, 3], dtype=torch.float32, batch_size=2,
                        log=io.StringIO(), progress_stream=io.StringIO())
    cache = FeatureCache(tmp_path / "cache")
    for row in rows:  # right-padded batches: padding never reaches a real token through the recurrence either
        torch.testing.assert_close(cache.features_of(row.sample_id), target.features(row.input_ids[None], [0, 3])[0],
                                   rtol=1e-5, atol=1e-5)


# --- the drafter's config ------------------------------------------------------------------------

def _export_for(family: str, out):
    from dflash_train.export.hf import export_model

    target = family_target(family)
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=MASK, target_layer_ids=[0, 3])
    export_model(DFlashDrafter(config), out, dtype=torch.float32)
    target.model.config.save_pretrained(out.parent / "target")  # config.json: what --check --target reads
    return target


def _verdicts(folder, target_dir) -> dict[str, str]:
    from dflash_train.export.rules import check_folder, target_shape_from_config

    shape = target_shape_from_config(json.loads((target_dir / "config.json").read_text()))
    return {v.rule.name: v.status for v in check_folder(folder, shape)}


def _edit(folder, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_exports_for_each_family_pass_every_rule_with_the_targets_rope(family, tmp_path):
    _export_for(family, tmp_path / "export")
    verdicts = _verdicts(tmp_path / "export", tmp_path / "target")
    assert "FAIL" not in verdicts.values(), verdicts
    assert {verdicts[rule] for rule in ("rope", "partial_rotary", "mrope", "target_rope", "target")} == {"ok"}, verdicts
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert "partial_rotary_factor" not in exported["rope_parameters"]
    if family == "gpt_oss":
        assert exported["rope_parameters"]["rope_type"] == "yarn" and exported["rope_parameters"]["factor"] == 4.0


@pytest.mark.parametrize("trap,change,rule", [
    ("a copied partial rotary factor", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.25), "partial_rotary"),
    ("a top-level partial rotary factor", lambda c: c.update(partial_rotary_factor=0.25), "partial_rotary"),
    ("copied mRoPE sections", lambda c: c["rope_parameters"].update(mrope_section=[2, 3, 3], mrope_interleaved=True), "mrope"),
    ("another theta", lambda c: (c["rope_parameters"].update(rope_theta=1e6), c.update(rope_theta=1e6)), "target_rope"),
])
def test_export_check_names_each_rope_trap_of_a_hybrid_drafter(trap, change, rule, tmp_path):
    _export_for("qwen3_5_text", tmp_path / "export")
    _edit(tmp_path / "export", change)
    verdicts = _verdicts(tmp_path / "export", tmp_path / "target")
    assert verdicts[rule] == "FAIL", (trap, verdicts)


def test_export_check_wants_yarn_for_gpt_oss(tmp_path):
    _export_for("gpt_oss", tmp_path / "export")

    def plain(config):
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        config["rope_scaling"] = None

    _edit(tmp_path / "export", plain)
    assert _verdicts(tmp_path / "export", tmp_path / "target")["target_rope"] == "FAIL"


# --- what a captured step may do ------------------------------------------------------------------

class HostWork(TorchDispatchMode):
    """Records the operations in a step that a CUDA graph cannot hold: a tensor made from Python
    data (`torch.tensor`: a copy from the host at every replay's capture), a value read on the
    host (`.item()`, `int(t)`, `.tolist()`), an output whose size depends on the data."""

    HOST = ("aten.lift_fresh", "aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique",
            "aten.unique", "aten.bincount", "aten.repeat_interleave.Tensor")

    def __init__(self, name: str, found: list[str]):
        super().__init__()
        self.name, self.found = name, found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.HOST):
            self.found.append(f"{self.name}: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_no_captured_step_of_a_hybrid_makes_tensors_from_the_host_or_reads_the_device(family, monkeypatch):
    """Every step the static decoder and the batched generator capture on CUDA (CapturedStep; on
    the CPU its function runs plainly) runs under a watch of the dispatcher and of `tolist`: none
    may make a tensor from Python data or read a value on the host. The CPU stands in for the
    device: copies between devices and what a kernel does inside itself are not seen."""
    found: list[str] = []
    ran: set[str] = set()
    original_init, original_tolist = CapturedStep.__init__, torch.Tensor.tolist

    def watched_init(self, fn, device, name, *args, **kwargs):
        def watched():
            ran.add(name.split(" (")[0])

            def tolist(tensor):
                found.append(f"{name}: tolist")
                return original_tolist(tensor)

            with HostWork(name, found), monkeypatch.context() as patch:
                patch.setattr(torch.Tensor, "tolist", tolist)
                return fn()

        original_init(self, watched, device, name, *args, **kwargs)

    monkeypatch.setattr(CapturedStep, "__init__", watched_init)
    target = family_target(family)
    if family == "qwen3_next":  # the MoE blocks in a form a graph holds (the eager loop syncs per expert)
        target.model.set_experts_implementation("batched_mm")
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=MASK, target_layer_ids=[0, 3])
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    prompt = [i * 7 % MASK for i in range(67)]  # a 64-token prefill chunk and a shorter one
    result = generate(target, drafter, prompt, 12, decoder="static")
    assert result.decoder == "static" and result.tokens == naive_greedy(target.model, prompt, 12)
    settings = GenerationSettings(max_new_tokens=6)
    engine = StaticBatchEngine(target, settings, [MASK], slots=2, bucket_prefills=True, log=io.StringIO())
    by_id(engine.generated(make_jobs([prompt, [5, 6, 7]])))
    assert found == []
    assert {"prefill", "batched decode", "greedy 4-token block"} <= ran and any(n.endswith("-token prefill") for n in ran)
    if family == "qwen3_next":  # the watch sees a step that syncs: Hugging Face's per-expert loop
        target.model.set_experts_implementation("eager")
        generate(target, drafter, prompt, 4, decoder="static")
        assert any("aten.nonzero" in line for line in found), found
