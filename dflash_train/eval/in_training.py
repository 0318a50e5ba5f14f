"""Real τ during training: greedy speculative decoding on a small fixed prompt set, from a
drafter worker thread, on a hook-free view of the target the training threads also run."""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import torch
from torch import nn

from ..core.drafter import unwrap_drafter
from ..data.render import render_prompt, stop_token_ids
from ..decode.loop import generate
from ..target.model import Target
from .benchmarks import load_benchmark
from .stats import tau_statistics

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
                                        stop_token_ids=stop_token_ids(target.model, target.tokenizer))
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
        cls, target: Target, bench: str = "mtbench", limit: int = 8, max_new_tokens: int = 64,
        enable_thinking: bool | None = None,
    ) -> "InTrainingEvaluator":
        """Prompts: the first `limit` prompts of a benchmark, rendered with the target's chat
        template (in the thinking mode the drafter is trained for)."""
        prompts = load_benchmark(bench)[:limit]
        ids = [render_prompt(target.tokenizer, p.messages, enable_thinking) for p in prompts]
        return cls(target, ids, max_new_tokens, stop_token_ids(target.model, target.tokenizer))

    def measure(self, drafter: nn.Module) -> dict[str, float | int | None]:
        module = unwrap_drafter(drafter)
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


