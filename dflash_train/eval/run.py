"""One evaluation run's work: load a (target, drafter) pair that fit, decode a benchmark's
prompts speculatively and target-only, one at a time, recording each prompt's result."""

from __future__ import annotations

import hashlib
import statistics
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import UserError
from ..core.drafter import DFlashDrafter
from ..data.render import render_prompt
from ..decode.loop import generate
from ..files import file_sha256
from ..target.model import Target, target_identity
from .benchmarks import BenchPrompt
from .stats import PromptResult, _fmt


def check_pair(target: Target, drafter: DFlashDrafter) -> None:
    """Refuse a drafter trained for another target before decoding nonsense with it."""
    cfg, spec = drafter.config, target.spec
    problems = []
    if cfg.hidden_size != spec.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} vs the target's {spec.hidden_size}")
    if cfg.vocab_size != spec.vocab_size:
        # The drafter's logits are the target's head over the drafter's states: a drafter trained
        # for another vocabulary proposes ids that mean other tokens here.
        problems.append(f"vocabulary of {cfg.vocab_size} tokens vs the target's {spec.vocab_size}")
    if cfg.num_target_layers != spec.num_hidden_layers:
        problems.append(f"trained on a {cfg.num_target_layers}-layer target, this one has {spec.num_hidden_layers}")
    if max(cfg.target_layer_ids) >= spec.num_hidden_layers:
        problems.append(f"target_layer_ids {cfg.target_layer_ids} exceed the target's layers")
    rows = target.embed_weight.shape[0]
    if not 0 <= cfg.mask_token_id < rows:
        problems.append(f"mask token {cfg.mask_token_id} is not a row of the target's embedding ({rows} rows)")
    if problems:
        raise UserError("the drafter does not fit this target: " + "; ".join(problems))



def pair_identity(target_path: str | Path, drafter_path: str | Path) -> dict[str, dict[str, str]]:
    """What says which target and drafter an eval measured, for `eval-merge` to compare: the
    drafter's config.json and weights (sha256 of each, whole), the target's config.json (sha256)
    and a sampled fingerprint of its weight files. Paths are recorded but not compared: shards
    may run on machines that mount the same model elsewhere."""
    drafter = Path(drafter_path).resolve()
    target = Path(target_path).resolve()
    weights = sorted(drafter.glob("*.safetensors"))
    return {
        "drafter": {
            "path": str(drafter),
            "config_sha256": file_sha256(drafter / "config.json"),
            "weights_sha256": hashlib.sha256("".join(file_sha256(w) for w in weights).encode()).hexdigest(),
        },
        "target": {"path": str(target), **target_identity(target)},
    }


def load_pair(target_path: str, drafter_path: str, device: torch.device, dtype: torch.dtype) -> tuple[Target, DFlashDrafter]:
    from ..export.hf import load_exported_drafter
    from ..target.model import load_target

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
    enable_thinking: bool | None = None,
    compile_draft: bool = False,
) -> list[PromptResult]:
    """Decode every prompt speculatively (and target-only when `baseline`), one at a time.
    A prompt that fails is recorded with its error and the run goes on."""
    from ..progress import Progress

    generator = torch.Generator(target.device).manual_seed(seed) if temperature > 0 else None
    progress = Progress(len(prompts), label, stream=stream)
    results = []
    shown_traceback = False
    for prompt in prompts:
        ids = render_prompt(target.tokenizer, prompt.messages, enable_thinking)
        result = PromptResult(prompt.id, len(ids))
        try:
            spec = generate(target, drafter, ids, max_new_tokens, stop_token_ids, temperature=temperature,
                            generator=generator, decoder=decoder, cache_tokens=cache_tokens, compile_draft=compile_draft)
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


