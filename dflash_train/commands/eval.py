"""`dflash-train eval`: speculative decoding with an exported drafter: τ, its histogram,
tokens/s and the speed-up over target-only decoding, on benchmarks or a prompts file."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from ..config import DECODERS, DTYPE_NAMES, ON_OFF, THINKING, ConfigError, Section, SectionedConfig, UserError, on_here, option
from ..eval.benchmarks import BENCHMARKS, available_benchmarks, bench_label, load_benchmark
from ..files import NewFileOutput, check_new_output


@dataclasses.dataclass(frozen=True)
class ModelsSettings(Section):
    """The target and the drafter, and how they are run."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file")
    drafter: str = option("", "an exported drafter folder (dflash-train export)")
    device: str = option("auto", "auto (cuda if present, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = option("auto", "auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16 or float32")
    decoder: str = option("auto", "auto (static where the target passes its probe, else hf), static (preallocated caches, CUDA graphs on GPU) or hf (Hugging Face, eager)")
    compile_draft: str = option("auto", "torch.compile the static decoder's drafter block forward before its graphs are captured: auto (on CUDA), on, off", choices=ON_OFF)


@dataclasses.dataclass(frozen=True)
class PromptsSettings(Section):
    """What is decoded: benchmarks or prompt files, a slice of each, and how they are rendered."""

    bench: list[str] = option(["mtbench"], f"benchmarks, comma-separated: {', '.join(BENCHMARKS)} or a prompts file (.jsonl, .json, .parquet, .txt)")
    offset: int = option(0, "skip the first N prompts of each benchmark before --limit applies (shards a run over processes)", at_least=0)
    limit: int = option(0, "the first N prompts of each benchmark (after --offset); 0 = all", at_least=0)
    thinking: str = option("auto", "thinking templates (Qwen3): auto (template default), on or off; as the drafter was trained")


@dataclasses.dataclass(frozen=True)
class DecodingSettings(Section):
    """How each prompt is decoded, and whether target-only decoding is timed beside it."""

    max_new_tokens: int = option(256, "new tokens per prompt at most", at_least=1)
    temperature: float = option(0.0, "0 = greedy (output must equal target-only decoding); > 0 = exact rejection sampling", at_least=0)
    seed: int = option(0, "sampling seed (T > 0)", at_least=0)
    stop_token_ids: list[int] = option([], "stop tokens; empty = the target's EOS ids", at_least=0)
    baseline: bool = option(True, "also decode target-only through the same loop, for the speed-up")


@dataclasses.dataclass(frozen=True)
class OutputSettings(Section):
    """Where the numbers and per-prompt records are written."""

    json: str = option("", "also write the numbers and per-prompt records to this JSON file")


@dataclasses.dataclass(frozen=True, init=False)
class EvalConfig(SectionedConfig):
    """Speculative decoding with an exported drafter, in sections ([models], [prompts],
    [decoding], [output]); flat keys and keywords work too (`EvalConfig(target=..., limit=8)`).
    `validate()` (run by the CLI and by `checked`) checks the rules across them."""

    models: ModelsSettings
    prompts: PromptsSettings
    decoding: DecodingSettings
    output: OutputSettings

    def validate(self) -> None:
        if self.models.decoder not in DECODERS:
            raise ConfigError(f"decoder {self.models.decoder!r}: use {', '.join(DECODERS)}")
        if self.models.compile_draft == "on" and self.models.decoder == "hf":
            raise ConfigError("--compile-draft on compiles the static decoder's drafter; --decoder hf has none (use auto or static)")
        if not self.models.target or not self.models.drafter:
            raise ConfigError("eval needs --target DIR and --drafter DIR")
        if not self.prompts.bench:
            raise ConfigError(f"--bench is empty: give one or more of {available_benchmarks()}")
        if self.models.dtype not in ("auto", *DTYPE_NAMES):
            raise ConfigError(f"dtype {self.models.dtype!r}: use auto, {', '.join(DTYPE_NAMES)}")
        if self.prompts.thinking not in THINKING:
            raise ConfigError(f"thinking {self.prompts.thinking!r}: use {', '.join(THINKING)}")
        from ..export.hf import read_export_config
        from ..target.model import check_target_path, check_tokenizer_beside, declared_size

        check_target_path(self.models.target, "--target")
        check_tokenizer_beside(self.models.target, "--target", "render the prompts")
        read_export_config(Path(self.models.drafter), "--drafter")
        vocab = declared_size(self.models.target, "vocab_size")
        beyond = [t for t in self.decoding.stop_token_ids if vocab and t >= vocab]
        if beyond:  # a token no model can emit: it would never stop anything
            raise ConfigError(f"--stop-token-ids {beyond[0]}: past the target's vocabulary (ids 0..{vocab - 1})")
        if self.output.json:
            inputs = [self.models.target, self.models.drafter, *(b for b in self.prompts.bench if Path(b).exists())]
            check_new_output(self.output.json, "--json", inputs)



def run_eval(config: EvalConfig) -> int:
    # A second eval writing the same --json would run in full only to land beside the first's.
    with NewFileOutput(config.output.json, "--json") if config.output.json else contextlib.nullcontext() as output:
        return _run_eval(config, output)


def _run_eval(config: EvalConfig, output: NewFileOutput | None) -> int:
    import torch

    from ..data.render import render_prompt, stop_token_ids
    from ..decode.loop import check_static_before_loading, describe_decoder, generate, make_decoder
    from ..eval.run import load_pair, pair_identity, run_benchmark
    from ..export.hf import read_drafter_config
    from ..eval.merge import prompt_list_record
    from ..eval.stats import format_benchmark, format_summary, summarize
    from ..target.model import dtype_from_name, resolve_device

    device = resolve_device(config.models.device)
    dtype = dtype_from_name(config.models.dtype, device)
    compile_draft = on_here(config.models.compile_draft, device.type)
    thinking = THINKING[config.prompts.thinking]
    # Resolve every benchmark before loading models: a typo should fail in a second, not a minute.
    benches = {}
    prompt_lists = {}  # each benchmark's whole list, for eval-merge to tell shards of an edited file apart
    for name in config.prompts.bench:
        prompts = load_benchmark(name)
        benches[bench_label(name)] = prompts[config.prompts.offset :][: config.prompts.limit or None]
        prompt_lists[bench_label(name)] = prompt_list_record(prompts)
    if not any(benches.values()):
        raise UserError(f"no prompts left after --offset {config.prompts.offset} in {', '.join(config.prompts.bench)}")
    if config.models.decoder == "static":
        # A prompt is at least one token: the shortest length this run decodes.
        block_size = read_drafter_config(config.models.drafter, "--drafter").block_size
        check_static_before_loading(config.models.target, 1 + config.decoding.max_new_tokens, block_size)
    target, drafter = load_pair(config.models.target, config.models.drafter, device, dtype)
    # What was loaded, for eval-merge to compare shards (hashing the drafter costs a read of it).
    pair = pair_identity(config.models.target, config.models.drafter) if output is not None else None
    stops = list(config.decoding.stop_token_ids) or stop_token_ids(target.model, target.tokenizer)
    block_size = drafter.config.block_size
    print(
        f"target {config.models.target} ({target.spec.model_type}, {target.spec.num_hidden_layers} layers) | "
        f"drafter {config.models.drafter} "
        f"(block {block_size}, {drafter.config.num_hidden_layers} layers) | {device} {str(dtype).removeprefix('torch.')} | "
        f"T={config.decoding.temperature} | max {config.decoding.max_new_tokens} new tokens | stop ids {stops}",
        flush=True,
    )
    # Warm-up (kernels, allocator, lazy hooks) so the first prompt's timing is not an outlier.
    # A shard may hold no prompt of a shorter benchmark; it is reported with 0 prompts.
    # One cache size for the whole run (the longest prompt + new tokens): the static decoder
    # captures its graphs here, once, instead of inside the first timed prompt of each size.
    first = next(prompts for prompts in benches.values() if prompts)[0]
    warm_ids = render_prompt(target.tokenizer, first.messages, thinking)
    longest = max(len(render_prompt(target.tokenizer, p.messages, thinking)) for prompts in benches.values() for p in prompts)
    cache_tokens = longest + config.decoding.max_new_tokens
    # Said before the warm-up, which captures the graphs and compiles the drafter's forward.
    print(describe_decoder(target, drafter, cache_tokens, config.models.decoder, compile_draft), flush=True)
    for warm_drafter in (drafter, None) if config.decoding.baseline else (drafter,):
        generate(target, warm_drafter, warm_ids, min(16, config.decoding.max_new_tokens), stops,
                 decoder=config.models.decoder, cache_tokens=cache_tokens, compile_draft=compile_draft)
        with torch.no_grad():
            make_decoder(target, warm_drafter, 0, config.models.decoder, cache_tokens, compile_draft).prepare()

    summaries: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    for name, prompts in benches.items():
        results = run_benchmark(
            target, drafter, prompts, max_new_tokens=config.decoding.max_new_tokens,
            temperature=config.decoding.temperature, baseline=config.decoding.baseline, stop_token_ids=stops,
            seed=config.decoding.seed, label=name, decoder=config.models.decoder, cache_tokens=cache_tokens,
            enable_thinking=thinking, compile_draft=compile_draft,
        )
        summaries[name] = summarize(results, block_size)
        records[name] = [dataclasses.asdict(r) for r in results]
        print("\n".join(format_benchmark(name, summaries[name])), flush=True)

    print()
    print("\n".join(format_summary(summaries)))
    if output is not None:
        payload = {
            "config": config.flat_values(),
            "block_size": block_size,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "stop_token_ids": stops,
            "pair": pair,
            "benchmarks": {name: {"summary": summaries[name], "prompt_list": prompt_lists[name], "prompts": records[name]}
                           for name in summaries},
        }
        out = output.write((json.dumps(payload, indent=1) + "\n").encode())
        print(f"wrote {out}" + ("" if out == Path(config.output.json) else f" ({config.output.json} appeared during the run)"))
    failed = sum(s["errors"] for s in summaries.values())
    if failed:
        print(f"{failed} prompt(s) failed; see the first traceback above", file=sys.stderr)
    return 1 if failed else 0


