"""The static decoder: preallocated caches, fixed step shapes, CUDA graphs (decode/static.py).

On CPU the static functions run eagerly, so these tests check everything but capture/replay
against the Hugging Face forward and the drafter's own `draft`; the GPU tests check that the
captured graphs give the same tokens.
"""

from __future__ import annotations

import inspect
import threading
import warnings

import pytest
import torch
import transformers
from dflash_train.target.model import Target
from test_decode_loop import random_drafter
from threads import run_in_threads
from tiny import random_dflash2, tiny_target

from dflash_train.capture import GraphPool, capture
from dflash_train.config import UserError
from dflash_train.core.drafter import DFlashDrafter, DrafterCache, embed_block_tokens
from dflash_train.decode.loop import describe_decoder, generate, make_decoder
from dflash_train.decode.static import PREFILL_STEP, StaticDrafter, prefill_width, static_state
from dflash_train.target.probe import static_unsupported
from dflash_train.target.static_cache import StaticTarget, attention_bias, fused_norm, matmul_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def test_norms_are_fused_only_where_the_module_computes_weight_times_rms_norm():
    """Llama's RMSNorm becomes weight · F.rms_norm (the same bits, in float32 and bf16); Gemma's
    `(1 + weight)` norm and a LayerNorm stay the model's own modules."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama, gemma, layer_norm = LlamaRMSNorm(64, eps=1e-5), Gemma3RMSNorm(64, eps=1e-6), torch.nn.LayerNorm(64)
    with torch.no_grad():
        llama.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    weight = llama.weight
    fused = fused_norm(llama)
    assert fused is not llama and llama.weight is weight  # the probe ran on a copy
    with torch.no_grad():
        assert torch.equal(fused(x), llama(x))
        assert torch.equal(fused_norm(llama.to(torch.bfloat16))(x.bfloat16()), llama(x.bfloat16()))
    assert fused_norm(gemma) is gemma and fused_norm(layer_norm) is layer_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_attention_masks_and_scales_in_one_kernel(dtype):
    """The scale-and-mask add and the softmax in the input's dtype give the form they replaced
    (scale, upcast, add the mask, float32 softmax, round): the same bits in float32, at most a
    last-bit difference in bf16."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 1, 16, generator=generator).to(dtype)
    keys, values = (torch.randn(3, 2, 40, 16, generator=generator).to(dtype) for _ in range(2))
    visible = torch.arange(40)[None, None, :] <= torch.tensor([5, 20, 39])[:, None, None]
    bias = attention_bias(visible, 2, dtype)
    folded = query.reshape(3, 2, 2, 16)
    scores = torch.matmul(folded, keys.transpose(-1, -2)) * 0.25
    probs = torch.softmax(scores.float() + bias, dim=-1).to(dtype)
    expected = torch.matmul(probs, values).reshape(3, 4, 1, 16).transpose(1, 2).reshape(3, 1, 64)
    got = matmul_attention(query, keys, values, bias, 0.25)
    if dtype == torch.float32:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_static_target_gives_the_hugging_face_logits_and_hidden_states(family):
    target = tiny_target(family, head_scale=8)
    layers = target.spec.num_hidden_layers
    ids = torch.randint(0, 90, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = target.model(ids, output_hidden_states=True)
        expected_states = torch.cat([reference.hidden_states[k + 1] for k in range(layers)], dim=-1)
        static = StaticTarget(target, 32, list(range(layers)))
        # A rejected block first: its keys land at positions 11..15 and must stay invisible.
        static.single(torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor(11))
        position = 0
        for length in (7, 1, 1, 5, 1, 5):  # prefill, single steps, verify blocks
            logits, states = static.single(ids[:, position : position + length], torch.tensor(position))
            torch.testing.assert_close(logits, reference.logits[0, position : position + length], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(states, expected_states[:, position : position + length], atol=2e-5, rtol=1e-4)
            position += length
        last, none = static.single(ids[:, :3], torch.tensor(0), last_only=True, features=False)
        assert none is None and last.shape == (1, target.spec.vocab_size)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_static_target_rows_start_and_step_at_their_own_positions(family):
    """The batched generator's use of StaticTarget: prompts of other lengths started together in
    any cache rows (right-padded, over a row's stale keys), then steps at per-row positions
    attending a prefix of the cache: every row gives Hugging Face's logits for its sequence."""
    target = tiny_target(family, head_scale=8)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 90, (n,), generator=generator) for n in (12, 6, 9)]
    with torch.no_grad():
        reference = [target.model(seq[None]).logits[0] for seq in sequences]
        static = StaticTarget(target, 64, batch=3)
        static.forward(torch.randint(0, 90, (3, 20), generator=generator), torch.tensor([0, 30, 7]))  # stale keys everywhere
        lengths = [8, 3, 6]  # prompt tokens; the rest of each sequence is decoded below
        rows = [2, 0, 1]  # sequence i lives in cache row rows[i]
        width = max(lengths)
        padded = torch.stack([torch.cat([seq[:n], torch.full((width - n,), 5)]) for seq, n in zip(sequences, lengths)])
        first = static.prefill_rows(padded, torch.tensor(lengths), torch.tensor(rows))
        for i, n in enumerate(lengths):
            torch.testing.assert_close(first[i], reference[i][n - 1], atol=2e-5, rtol=1e-4)
        position = {rows[i]: n for i, n in enumerate(lengths)}
        for step in range(3):  # one token per row and step, in cache-row order
            order = {row: i for i, row in enumerate(rows)}
            ids = torch.stack([sequences[order[row]][position[row]: position[row] + 1] for row in range(3)])
            logits, _ = static.forward(ids, torch.tensor([position[row] for row in range(3)]), features=False, attend=16)
            for row in range(3):
                torch.testing.assert_close(logits[row, 0], reference[order[row]][position[row]], atol=2e-5, rtol=1e-4)
                position[row] += 1
    assert StaticTarget.bytes_per_position(target) == static.keys[:, 0, :, 0].numel() * 2 * 4


def test_static_drafter_step_gives_the_drafters_own_draft_logits():
    target = tiny_target("qwen3", head_scale=8)
    drafter = random_drafter(target, block_size=4)
    features = target.features(torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(1)),
                               drafter.config.target_layer_ids)
    # 24 slots: the last block ends at slot 22, so padding rows of the last steps are clamped to
    # the last slot (23), which no query sees.
    static = StaticDrafter(drafter, target, 24)
    cache = DrafterCache(len(drafter.layers))
    garbage = torch.randn(1, 4, features.shape[-1])
    context = 0
    # (new verified rows, block length): the prompt (more rows than a block), padded rows, a full
    # block of rows, a short last block.
    for rows, length in ((9, 4), (1, 4), (3, 4), (4, 4), (2, 4), (1, 3)):
        start = context + rows
        new = features[:, context:start]
        block_ids = torch.tensor([[int(start * 13 % 90)] + [95] * (length - 1)])
        with torch.no_grad():
            hidden = drafter.draft(cache, new, torch.arange(context, start)[None],
                                   embed_block_tokens(block_ids, target.embed_weight),
                                   torch.arange(start, start + length)[None])
            expected = (hidden[0, 1:] @ target.head_weight.t()).float()
            padded = torch.cat([new, garbage[:, : max(0, 4 - rows)]], dim=1)  # padding past count
            got = static.step(padded, torch.tensor(rows), torch.tensor(start), block_ids)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        context = start


def test_static_and_hugging_face_decoders_give_the_same_tokens_and_steps():
    target = tiny_target("llama", head_scale=8)
    drafter = random_drafter(target, block_size=5)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        prompt = torch.randint(0, 90, (int(torch.randint(1, 14, (1,), generator=generator)),), generator=generator).tolist()
        for max_new in (1, 4, 17):
            static = generate(target, drafter, prompt, max_new, decoder="static")
            hf = generate(target, drafter, prompt, max_new, decoder="hf")
            assert (static.decoder, hf.decoder) == ("static", "hf")
            assert static.tokens == hf.tokens and static.acceptance_lengths == hf.acceptance_lengths
            assert generate(target, None, prompt, max_new, decoder="static").tokens == hf.tokens


def test_padded_prefill_fills_the_drafter_context_and_decodes_prompts_across_its_widths():
    """Prompts are prefilled right-padded to a multiple of PREFILL_STEP, with the drafter's
    context keys written there; the first step then has no new context rows. Lengths on both
    sides of a width boundary give Hugging Face's tokens and steps, and the context cache holds
    exactly the keys the drafter computes from the target's own hidden states."""
    target = tiny_target("qwen3", head_scale=8)
    drafter = random_drafter(target, block_size=5)
    generator = torch.Generator().manual_seed(11)
    for length in (PREFILL_STEP - 1, PREFILL_STEP, PREFILL_STEP + 1, 2 * PREFILL_STEP + 3):
        prompt = torch.randint(0, 90, (length,), generator=generator).tolist()
        static = generate(target, drafter, prompt, 12, decoder="static")
        hf = generate(target, drafter, prompt, 12, decoder="hf")
        assert static.tokens == hf.tokens and static.acceptance_lengths == hf.acceptance_lengths, length
        assert generate(target, None, prompt, 12, decoder="static").tokens == hf.tokens

        runner = make_decoder(target, drafter, length + 12, "static")
        state = runner.state
        with torch.no_grad():
            logits, features = runner.prefill(torch.tensor([prompt]))
            reference = target.model(torch.tensor([prompt]), output_hidden_states=True)
            torch.testing.assert_close(logits, reference.logits[0, -1], atol=2e-5, rtol=1e-4)
            assert features.shape[1] == 0  # no new context rows: the first step is a whole-step one
            hidden = torch.cat([reference.hidden_states[k + 1] for k in drafter.config.target_layer_ids], dim=-1)
            expected = StaticDrafter(drafter, target, state.capacity)
            expected.add_context(hidden, torch.arange(length))
        torch.testing.assert_close(state.drafter.keys[:, :, :, :length], expected.keys[:, :, :, :length], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(state.drafter.values[:, :, :, :length], expected.values[:, :, :, :length], atol=2e-5, rtol=1e-4)
        assert prefill_width(length, state.capacity) in state.prefill_steps


def test_prepare_builds_every_step_shape_and_leaves_nothing_behind():
    target = tiny_target("qwen3", head_scale=8)
    drafter = random_drafter(target, block_size=5)
    prompt = [7, 1, 3]  # shorter than a block: decoding reuses the slots prepare() wrote
    expected = generate(target, drafter, prompt, 30, decoder="hf")
    runner = make_decoder(target, drafter, len(prompt) + 30, "static")
    runner.prepare()
    assert sorted(runner.state.greedy_steps) == [2, 3, 4, 5]
    assert not runner.state.prefill_steps  # on CPU a prefill is eager at any width: prepare() runs none of them
    result = generate(target, drafter, prompt, 30, decoder="static")
    assert (result.tokens, result.acceptance_lengths) == (expected.tokens, expected.acceptance_lengths)
    make_decoder(target, None, len(prompt) + 30, "static").prepare()
    assert generate(target, None, prompt, 30, decoder="static").tokens == expected.tokens


class ScaledLogitsLlama(transformers.LlamaForCausalLM):
    """A model whose forward does more than its modules say (as custom remote code can)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_targets_the_static_forward_does_not_reproduce_decode_through_hugging_face():
    gemma = tiny_target("gemma3_text", head_scale=8)
    assert "sliding window" in static_unsupported(gemma, 512)
    prompt = [4, 8, 15, 16, 23]
    assert generate(gemma, None, prompt, 6).decoder == "hf"  # auto falls back
    with pytest.raises(UserError, match="sliding window.*--decoder hf"):
        generate(gemma, None, prompt, 6, decoder="static")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    custom = Target(ScaledLogitsLlama(config).float())
    assert "logits differ from the Hugging Face forward" in static_unsupported(custom, 512)
    result = generate(custom, None, prompt, 6)
    assert result.decoder == "hf"
    with torch.no_grad():  # still the custom model's own greedy output
        assert result.tokens[0] == int(custom.model(torch.tensor([prompt])).logits[0, -1].argmax())

    # A drafter that overrides draft() (the oracle tests use one) is run by Hugging Face's loop.
    target = tiny_target("llama", head_scale=8)
    drafter = random_drafter(target)
    drafter.__class__ = type("CustomDraft", (DFlashDrafter,), {"draft": lambda self, *a: DFlashDrafter.draft(self, *a)})
    assert generate(target, drafter, prompt, 6).decoder == "hf"


def test_states_are_shared_per_capacity_and_never_between_threads():
    target = tiny_target("llama", head_scale=8)
    drafter = random_drafter(target, block_size=4)
    assert make_decoder(target, drafter, 30).state is make_decoder(target, drafter, 200).state  # one 512 cache
    assert make_decoder(target, drafter, 600).state is not make_decoder(target, drafter, 30).state
    assert make_decoder(target, None, 30).state is not make_decoder(target, drafter, 30).state

    # Weights updated in place are read by the same state; replaced weights get a new one.
    state = make_decoder(target, drafter, 30).state
    with torch.no_grad():
        drafter.fc.weight.mul_(1.0)
    assert make_decoder(target, drafter, 30).state is state
    drafter.fc.weight.data = drafter.fc.weight.data.clone()
    assert make_decoder(target, drafter, 30).state is not state

    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8], [6, 6, 6]]
    expected = {i: generate(target, drafter, p, 20, decoder="hf").tokens for i, p in enumerate(prompts)}
    results: dict[tuple[int, int], list[int]] = {}
    states = set()
    problems: list[str] = []

    def worker(index: int) -> None:
        states.add(id(static_state(target, drafter, 512)))
        for round_ in range(3):
            for i, prompt in enumerate(prompts):
                out = generate(target, drafter, prompt, 20, decoder="static")
                if out.tokens != expected[i]:
                    problems.append(f"thread {index} prompt {i} round {round_}")
                results[(index, i)] = out.tokens

    problems += [repr(error) for error in run_in_threads(worker, range(2), timeout=120)]
    assert not problems, problems[:3]
    assert len(states) == 2 and len(results) == 6


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_compiled_draft_decodes_the_uncompiled_tokens_and_steps(arch):
    """`compile_draft`: the full block's drafter forward runs compiled (inductor, on the CPU here),
    shorter blocks eagerly; greedy output and every step's acceptance are the uncompiled run's.
    Two threads then compile their own states at once; each must decode the same tokens. That part
    proves the compiles cannot break each other's results here, not that a race would show."""
    target = tiny_target("qwen3", head_scale=8)
    drafter = random_drafter(target, block_size=5) if arch == "dflash" else random_dflash2(target, block_size=5)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
    expected = [generate(target, drafter, p, 23, decoder="static") for p in prompts]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = [generate(target, drafter, p, 23, decoder="static", compile_draft=True) for p in prompts]
    assert not [w for w in caught if "uncompiled" in str(w.message)], [str(w.message) for w in caught]
    state = make_decoder(target, drafter, 30, "static", compile_draft=True).state
    assert state.drafter.compile_done and state is not make_decoder(target, drafter, 30, "static").state
    assert describe_decoder(target, drafter, 30, "static", compile_draft=True).endswith("block forward compiled first)")
    assert "compiled" not in describe_decoder(target, drafter, 30, "static")
    for got, want, prompt in zip(compiled, expected, prompts):
        assert got.tokens == want.tokens == generate(target, None, prompt, 23, decoder="static").tokens
        assert got.acceptance_lengths == want.acceptance_lengths

    results: dict[int, list[list[int]]] = {}

    def worker(index: int) -> None:
        results[index] = [generate(target, drafter, p, 23, decoder="static", compile_draft=True).tokens for p in prompts]
        assert static_state(target, drafter, 512, compile_draft=True).drafter.compile_done

    assert not run_in_threads(worker, range(2), timeout=300)
    assert results[0] == results[1] == [e.tokens for e in expected]


def test_a_compiled_draft_prepared_with_gradients_on_still_compiles():
    """`prepare()` and the draft step turn gradients off themselves: a caller that leaves them on
    (the GPU test did) made the compile trace a backward too, which failed on the CPU and left
    the drafter uncompiled with a warning."""
    target = tiny_target("qwen3", head_scale=8)
    drafter = random_drafter(target, block_size=4, seed=3)
    assert torch.is_grad_enabled() and any(p.requires_grad for p in drafter.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = make_decoder(target, drafter, 37, "static", compile_draft=True)
        runner.prepare()
    assert not [w for w in caught if "uncompiled" in str(w.message)], [str(w.message) for w in caught]
    assert runner.state.drafter.compile_done


# --------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_steps_give_the_eager_tokens_on_the_gpu(dtype):
    target = tiny_target("qwen3", head_scale=8)
    target.model.to("cuda", dtype)
    drafter = random_drafter(target, block_size=4).to("cuda")
    for param in drafter.parameters():
        param.data = param.data.to(dtype)
    prompt = [5, 17, 3, 60, 2, 9, 41, 8, 8, 1]
    for extra in ([], [7], [7, 7, 3]):
        # The eager run of the very same static functions is the reference for the graphs.
        runner = make_decoder(target, drafter, len(prompt) + len(extra) + 40)
        if extra == [7]:  # once with every graph captured up front, as `eval` does
            runner.prepare()
            assert all(step.graph is not None for step in runner.state.greedy_steps.values())
            assert sorted(runner.state.prefill_steps) == list(range(PREFILL_STEP, runner.state.capacity + 1, PREFILL_STEP))
            assert all(step.graph is not None for step in runner.state.prefill_steps.values())
        static = generate(target, drafter, prompt + extra, 40, decoder="static")
        state = runner.state
        steps = list(state.greedy_steps.values()) + list(state.prefill_steps.values())
        assert state.greedy(4).graph is not None and state.prefill(PREFILL_STEP).graph is not None
        assert len(state.greedy_steps) >= 2  # full blocks and the shorter ones before max_new_tokens
        for step in steps:
            step.graph, step.eager = None, True
        eager = generate(target, drafter, prompt + extra, 40, decoder="static")
        for step in steps:
            step.eager = False
        assert static.tokens == eager.tokens and static.acceptance_lengths == eager.acceptance_lengths
        base = generate(target, None, prompt + extra, 40, decoder="static")
        assert make_decoder(target, None, len(prompt) + len(extra) + 40).state.next_greedy.graph is not None
        if dtype == torch.float32:
            assert static.tokens == base.tokens == generate(target, None, prompt + extra, 40, decoder="hf").tokens


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_compiled_draft_is_captured_and_decodes_the_target_only_tokens_on_the_gpu(arch):
    """`eval --compile-draft` on CUDA: the compiled full-block forward inside the captured greedy
    step (float32: greedy output must equal target-only decoding exactly)."""
    target = tiny_target("qwen3", head_scale=8)
    target.model.to("cuda")
    drafter = (random_drafter(target, block_size=4) if arch == "dflash" else random_dflash2(target, block_size=4)).to("cuda")
    prompt = [5, 17, 3, 60, 2, 9, 41, 8, 8, 1]
    runner = make_decoder(target, drafter, len(prompt) + 40, "static", compile_draft=True)
    runner.prepare()
    assert runner.state.drafter.compile_done and runner.state.greedy(4).graph is not None
    spec = generate(target, drafter, prompt, 40, decoder="static", compile_draft=True)
    assert spec.tokens == generate(target, None, prompt, 40, decoder="static").tokens
    assert spec.tokens == generate(target, drafter, prompt, 40, decoder="static").tokens


@pytest.mark.gpu
def test_a_graph_pool_is_fresh_once_all_its_graphs_are_gone():
    """Graphs of one GraphPool share its id while one of them lives; once the last is dropped the
    next capture gets a new id and succeeds. Into the old id it fails an allocator assert on
    torch 2.11 (seen: every prefill width of a decoder whose graphs a test had dropped ran eagerly)."""
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    x = torch.arange(8.0, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        (x * 2).sum()  # the warm-up a capture needs
    pool = GraphPool()
    first, _ = capture(lambda: x * 2, device, stream, pool)
    handle = pool.handle()
    second, _ = capture(lambda: x * 3, device, stream, pool)
    assert pool.handle() == handle  # shared while a graph lives
    del first, second
    assert pool.handle() != handle
    for factor in (4.0, 5.0):  # two captures into the fresh id, one after the other is dropped
        graph, out = capture(lambda: x * factor, device, stream, pool)
        graph.replay()
        assert torch.equal(out, x * factor)
        del graph


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_graphs_of_a_model_on_a_device_that_is_not_the_current_one_are_right():
    """Graphs on cuda:0 first, then a model on cuda:1 in a process whose current device stays
    cuda:0 (`eval --device cuda:1`, or in-training eval on the target's GPU from a drafter
    thread). torch.cuda.graph's default capture stream is made once, on the device current at
    the first capture: cuda:1's graphs captured there recorded nothing and every replay repeated
    stale outputs (seen: tau 1.0 and runaway outputs on every eval shard of the second GPU)."""
    torch.cuda.set_device(0)
    prompt = [5, 17, 3, 60, 2, 9, 41, 8, 8, 1]
    for device in ("cuda:0", "cuda:1"):
        target = tiny_target("qwen3", head_scale=8)
        target.model.to(device)
        drafter = random_drafter(target, block_size=4).to(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            captured = generate(target, drafter, prompt, 40, decoder="static")
        assert captured.decoder == "static"
        assert not [w for w in caught if "empty" in str(w.message) or "eagerly" in str(w.message)], [str(w.message) for w in caught]
        assert torch.cuda.current_device() == 0
        reference = generate(target, drafter, prompt, 40, decoder="hf")
        assert captured.tokens == reference.tokens and captured.acceptance_lengths == reference.acceptance_lengths
        base = generate(target, None, prompt, 40, decoder="static")
        assert base.tokens == generate(target, None, prompt, 40, decoder="hf").tokens


@pytest.mark.gpu
def test_capture_while_another_thread_allocates_and_computes():
    target = tiny_target("llama", head_scale=8)
    target.model.to("cuda")
    drafter = random_drafter(target, block_size=4).to("cuda")
    prompt = [9, 8, 7, 6, 5]
    expected = generate(target, drafter, prompt, 48, decoder="hf").tokens
    stop = threading.Event()
    problems: list[str] = []

    def busy() -> None:  # allocates and computes like a training thread (which draws no CUDA random numbers)
        try:
            while not stop.is_set():
                x = torch.ones(512, 512, device="cuda") / 512
                (x @ x).sum().item()
        except BaseException as error:  # noqa: BLE001
            problems.append(repr(error))

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        for capacity_tokens in (48, 700, 1200):  # new capacities: new captures while `busy` runs
            out = generate(target, drafter, prompt, capacity_tokens, decoder="static")
            assert out.tokens[:48] == expected
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not problems


def test_the_cache_argument_is_named_by_the_first_forward_that_names_one():
    """A forward of *args, **kwargs over a Hugging Face model's (ScaledLogitsLlama) gets the
    name its base's forward uses, not the old `past_key_values` (a FutureWarning, and an error
    once transformers removes it)."""
    from dflash_train.target.model import cache_argument

    base = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    expected = "cache" if "cache" in base else "past_key_values"
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    assert cache_argument(ScaledLogitsLlama(config)) == expected
    assert cache_argument(transformers.LlamaForCausalLM(config)) == expected
