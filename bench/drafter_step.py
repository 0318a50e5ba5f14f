"""Benchmark our full drafter training step at the SpecForge comparison shapes (issue #6).

Qwen3-8B-shaped drafter (5 layers, hidden 4096, 32/8 heads, head_dim 128, MLP 12288,
vocab 151,936, 5 target layers, B = 16), random weights, random target features, a
realistic loss mask (first 20% of each sequence unsupervised). Median of >= 10 steps after
warm-up, timed with CUDA events, split into forward / backward / optimizer.

    python bench/drafter_step.py --configs A,B,D --json out.json
    python bench/drafter_step.py --configs A,D --fp8 off,all   # each config in each FP8 mode (train --fp8)
    python bench/drafter_step.py --configs A,D --cuda-graphs on,off   # the step captured in CUDA graphs, and eager
    python bench/drafter_step.py --device cpu --tiny          # smoke test of the script itself
    python bench/drafter_step.py --dims smollm2 --configs S --arch dflash,dflash2 --profile S
        # the smollm2-quality recipe's step (batch 8, 768 tokens, 256 anchors) for both drafters
    python bench/drafter_step.py --dims smollm2 --configs S --head fused --cuda-graphs on --valid-anchors 1583 \
        --pack-anchors off,on   # its rows' mean fill (1,583 of 2,048 slots valid): padded against packed (train --pack-anchors)

With `--cuda-graphs on` the step is `train.step_graphs.GraphedStep` (its warm-up compiles and
captures the shape first, reported as `prepare_s`); ms/step is then also measured back to back
(`pipelined_ms`: N steps, one synchronize at the end), which is how training runs them.

MFU follows the issue's formula (see `step_flops`), against 790 TFLOP/s. Each Qwen3-8B config
ends in the summary line of docs/PERF.md:

    drafter-step A (bf16): <ms> ms, MFU <x>%, <r>x SpecForge
    drafter-step D (--fp8 all): <ms> ms, MFU <x>%, <r>x SpecForge
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.target.model import default_dtype  # noqa: E402

from dflash_train.config import ARCHS, ATTENTION_BACKENDS, FP8_CHOICES  # noqa: E402
from dflash_train.core.attention import flash_kernels_missing, resolve_backend  # noqa: E402
from dflash_train.core.drafter import DrafterConfig  # noqa: E402
from dflash_train.core.objective import fused_head_segment, fused_head_unsupported  # noqa: E402
from dflash_train.core.step import (  # noqa: E402
    FrozenTargetParts,
    InputShape,
    Step,
    drafter_loss,
    make_optimizer,
    warmup_cosine,
)
from dflash_train.train.synthetic import TINY, drafter_config, make_batch, random_drafter  # noqa: E402

PEAK_TFLOPS = 790.0
SPECFORGE = {  # ms/step, samples/s, peak GB, MFU (issue #6, one H200, torch 2.11)
    "A": {"batch": 1, "seq": 3072, "anchors": 512, "ms": 196.3, "samples_s": 5.09, "peak_gb": 34.0, "mfu": 0.473},
    "B": {"batch": 2, "seq": 768, "anchors": 256, "ms": 186.0, "samples_s": 10.75, "peak_gb": 33.8, "mfu": 0.474},
    "D": {"batch": 4, "seq": 3072, "anchors": 512, "ms": 670.2, "samples_s": 5.97, "peak_gb": 84.2, "mfu": 0.554},
}
QWEN3_8B = dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, mlp=12288, vocab=151936, target_layers=36,
                layer_ids=[1, 9, 17, 25, 33])
# The smollm2-quality recipe's step shape (no SpecForge number: it is our own recipe).
RECIPE_SHAPES = {"S": {"batch": 8, "seq": 768, "anchors": 256}}
# The drafter the smollm2-quality recipe trains for SmolLM2-135M-Instruct (5 layers of the target's shape).
SMOLLM2 = dict(hidden=576, layers=5, heads=9, kv_heads=3, head_dim=64, mlp=1536, vocab=49152, target_layers=30,
               layer_ids=[1, 8, 14, 20, 27])
# A drafter for a Qwen3-0.6B-shaped target: small enough that the host, not the GPU, sets the pace.
SMALL = dict(hidden=1024, layers=5, heads=16, kv_heads=8, head_dim=128, mlp=3072, vocab=151936, target_layers=28,
             layer_ids=[1, 7, 13, 19, 25])
def step_flops(config: DrafterConfig, batch: int, seq: int, anchor_valid: torch.Tensor, anchors: torch.Tensor) -> float:
    """The issue's formula: 6·P_layers·Tq + 6·P_kv·b·S + 4·P_fc·b·S + 4·H·V·Tq + attention pairs."""
    H, B, d = config.hidden_size, config.block_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    attn = H * heads * d * 2 + H * kv * d * 2  # q, o + k, v
    mlp = 3 * H * config.intermediate_size
    p_layers = config.num_hidden_layers * (attn + mlp)
    p_kv = config.num_hidden_layers * H * kv * d * 2
    p_fc = len(config.target_layer_ids) * H * H
    tq = int(anchor_valid.sum()) * B
    pairs = float(((anchors.float() + B) * B * anchor_valid.float()).sum())
    return (6 * p_layers * tq + 6 * p_kv * batch * seq + 4 * p_fc * batch * seq + 4 * H * config.vocab_size * tq
            + 3 * 4 * heads * d * config.num_hidden_layers * pairs)


def comma_choices(parser: argparse.ArgumentParser, flag: str, value: str, choices: tuple[str, ...]) -> list[str]:
    """The items of a comma-separated flag, each one of `choices` (else the parser's error, exit 2)."""
    items = value.split(",")
    for item in items:
        if item not in choices:
            parser.error(f"{flag} {item!r}: choose from {', '.join(choices)}")
    return items


def flash_mark(result: dict) -> str:
    """What a summary line adds for a row on FlashAttention-4's kernels or with master weights
    (nothing for train's defaults)."""
    return ((", --attention flash" if result["attention"] == "flash" else "")
            + (", --master-weights on" if result.get("master_weights") == "on" else "")
            + (f", --pack-anchors on, {result['valid_anchors']} of {result['anchor_slots']} anchors"
               if result.get("pack_anchors") == "on" else ""))


def run_config(name, dims, shape, args, device, fp8="off", graphs="off", arch="dflash", gradients="handed-over",
               attention="auto", master_weights="off", pack="off"):
    config = drafter_config(dims, args.block_size, arch)
    dtype = default_dtype(device)
    drafter = random_drafter(config, device, compiled=args.compile == "on", fp8=fp8)
    embed = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=dtype) * 0.02
    head = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=dtype) * 0.02
    frozen = FrozenTargetParts(embed, head)
    batch, objective, anchor_valid = make_batch(config, shape["batch"], shape["seq"], shape["anchors"], device, dtype,
                                                host_count=args.host_count == "on",
                                                valid_anchors=args.valid_anchors or None)
    objective.pack_anchors = pack == "on"
    objective.loss_chunk_rows = args.loss_chunk_rows
    objective.compiled_head = args.compile == "on" and args.head in ("compiled", "fused")
    objective.fused_head = args.compile == "on" and args.head == "fused"
    refused = (fused_head_unsupported(device, segment=fused_head_segment(arch, config.vocab_size))
               if objective.fused_head else None)
    if refused:
        raise SystemExit(f"--head fused: {refused}")
    objective.fp8_head = fp8 != "off"
    optimizer = make_optimizer(drafter, 6e-4, 0.0, (0.9, 0.95), master_weights=master_weights == "on",
                               compiled=args.compile == "on")
    if graphs == "on" and not optimizer.defaults.get("fused"):  # the CPU smoke test: the static step needs fused
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
    scheduler = warmup_cosine(optimizer, 10_000, 0.0, 0.0)
    backend = resolve_backend(attention, device)
    autocast = torch.bfloat16 if device.type == "cuda" or master_weights == "on" else None  # bf16 weights need it
    flops = step_flops(config, shape["batch"], shape["seq"], anchor_valid, batch.anchors.cpu())

    def timed_parts():
        """Same work as the Step, with events between forward, backward and optimizer."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if device.type == "cuda" else None
        clock: list[float] = []
        mark = (lambda i: events[i].record()) if events else (lambda i: clock.append(time.perf_counter()))
        mark(0)
        optimizer.zero_grad(set_to_none=gradients == "handed-over")  # as the Step below does
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss, _ = drafter_loss(drafter, frozen, step.layout(batch), objective, backend)
        mark(1)
        loss.backward()
        mark(2)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        mark(3)
        if events:
            torch.cuda.synchronize()
            return [events[i].elapsed_time(events[i + 1]) for i in range(3)]
        return [(clock[i + 1] - clock[i]) * 1000 for i in range(3)]

    last: dict = {}
    step = Step(drafter, optimizer, scheduler, frozen, objective, attention_backend=backend, clip_grad=1.0,
                autocast_dtype=autocast)
    graphed, prepare_s, prepare_note = None, None, ""
    if graphs == "off" and gradients == "handed-over":
        step.hand_over_gradients()  # what train's eager step does
    if graphs == "on":
        from dflash_train.train.step_graphs import GraphedStep, StepShapes, step_shapes

        shapes = step_shapes([shape["seq"]], shape["batch"], objective, batch.target_features.shape[-1], dtype,
                             config.vocab_size)
        if objective.pack_anchors:  # only this batch's capacity: train prepares each one the same way
            ran = InputShape.of(step.layout(batch))
            shapes = StepShapes({ran: shapes.granules[ran]}, {ran: shapes.rows[ran]})
        graphed = GraphedStep(name=name, step=step, shapes=shapes)
        started = time.perf_counter()
        prepare_note = graphed.prepare(lambda line: print(f"  prepare {name}: {line}", flush=True))
        prepare_s = time.perf_counter() - started

    def one_step():
        return (graphed or step).run([batch])

    def full_step():
        start = time.perf_counter()
        last["step"] = one_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000

    def pipelined() -> float:
        """ms per step of `args.steps` steps enqueued back to back (one synchronize at the end)."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            last["step"] = one_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000 / args.steps

    warm_start = time.perf_counter()
    for _ in range(args.warmup):
        full_step()
    warm_s = time.perf_counter() - warm_start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    totals = [full_step() for _ in range(args.steps)]
    pipelined_ms = pipelined()
    parts = [timed_parts() for _ in range(args.steps)] if graphed is None else [[float("nan")] * 3]
    if name in args.profile.split(","):
        suffix = ("" if fp8 == "off" else "_fp8" + fp8) + ("" if arch == "dflash" else "_" + arch) + \
            ("_graphed" if graphs == "on" else "")
        profile(full_step, device, Path(args.profile_dir) / f"profile_{name}{suffix}.txt")
    ms = statistics.median(totals)
    split = [statistics.median(p[i] for p in parts) for i in range(3)]
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    result = {
        "config": name, "arch": arch, **shape, "ms_per_step": round(ms, 2),
        "forward_ms": round(split[0], 2), "backward_ms": round(split[1], 2), "optimizer_ms": round(split[2], 2),
        "samples_per_s": round(shape["batch"] / ms * 1000, 3),
        "anchors_per_s": round(int(anchor_valid.sum()) / ms * 1000, 1),
        "peak_gb": round(peak, 2), "tflop_per_step": round(flops / 1e12, 2),
        "mfu": round(flops / (ms / 1000) / (PEAK_TFLOPS * 1e12), 4), "warmup_s": round(warm_s, 1),
        "last_loss": round(last["step"].loss, 4), "last_grad_norm": round(last["step"].grad_norm, 4),
        "dims": args.dims, "host_count": args.host_count, "attention": backend, "flex_options": args.flex_options or None, "compile": args.compile, "head": args.head if args.compile == "on" else "eager", "fp8": fp8,
        "cuda_graphs": graphs, "gradients": gradients if graphs == "off" else "buffers", "pipelined_ms": round(pipelined_ms, 2),
        "prepare_s": round(prepare_s, 1) if prepare_s is not None else None, "prepare": prepare_note,
        "master_weights": master_weights, "pack_anchors": pack, "valid_anchors": int(anchor_valid.sum()),
        "anchor_slots": step.layout(batch).anchors.numel(),
    }
    if name in SPECFORGE and dims is QWEN3_8B and arch == "dflash":
        result["speedup_vs_specforge"] = round(SPECFORGE[name]["ms"] / ms, 3)
    return result


def profile(step, device: torch.device, out: Path, steps: int = 3) -> None:
    """Kernel-level table of `steps` steps (self device time, top 40) written to `out`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    averages = prof.key_averages()
    sort_key = "self_cpu_time_total"
    if device.type == "cuda":  # the column's name changed across torch releases
        sort_key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    table = averages.table(sort_by=sort_key, row_limit=40, max_name_column_width=90)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{steps} steps, sorted by {sort_key}\n{table}\n")
    print(f"profile ({steps} steps) -> {out}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="A,B,D")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="same as --dims tiny (script smoke test)")
    parser.add_argument("--dims", choices=["8b", "small", "smollm2", "tiny"], default="8b",
                        help="drafter shape: Qwen3-8B (the SpecForge comparison), Qwen3-0.6B, SmolLM2-135M's recipe, tiny")
    parser.add_argument("--arch", default="dflash", help="comma-separated: dflash, dflash2 (train --arch; defaults of train)")
    parser.add_argument("--host-count", choices=["on", "off"], default="on",
                        help="scored-slot count from the host (no mid-step sync) or counted on the device")
    parser.add_argument("--compile", choices=["on", "off"], default="on")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--loss-chunk-rows", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--head", choices=["compiled", "fused", "eager"], default="compiled",
                        help="frozen-head CE chunk compiled (default, with --compile on), through core/head_kernel.py's "
                             "fused softmax kernel (what train runs on CUDA), or eager")
    parser.add_argument("--fp8", default="off",
                        help=f"comma-separated FP8 modes to run each config in, of {FP8_CHOICES} (train --fp8)")
    parser.add_argument("--cuda-graphs", default="off",
                        help="comma-separated: on (the step captured in CUDA graphs, train --cuda-graphs), off (eager)")
    parser.add_argument("--gradients", default="handed-over",
                        help="comma-separated, eager steps: handed-over (the backward's own gradient tensors, dropped "
                             "by each update: what train runs without graphs), buffers (persistent, zeroed each step)")
    parser.add_argument("--attention", default="auto",
                        help="comma-separated train --attention backends: auto (flex on CUDA, sdpa on CPU), flex, "
                             "flash (FlashAttention-4's kernels), sdpa")
    parser.add_argument("--master-weights", default="off",
                        help="comma-separated train --master-weights: off (float32 parameters), on (bf16 parameters, "
                             "float32 master weights in one compiled update)")
    parser.add_argument("--pack-anchors", default="off",
                        help="comma-separated train --pack-anchors: off (padded anchor slots), on (each micro-batch's "
                             "valid anchors packed into whole rows' worth of slots)")
    parser.add_argument("--valid-anchors", type=int, default=0,
                        help="valid anchors in the batch, spread evenly over its rows (0: every slot a row can fill); "
                             "the smollm2-quality recipe's micro-batches hold 1,583 of 2,048 on average")
    parser.add_argument("--flex-options", default="", help="JSON kernel_options for flex (see bench/flex_tuning.py)")
    parser.add_argument("--profile", default="", help="comma-separated configs to profile after timing")
    parser.add_argument("--profile-dir", default=".")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(540, exit=True)
    device = torch.device(args.device)
    attentions = comma_choices(parser, "--attention", args.attention, ("auto", *ATTENTION_BACKENDS))
    if "flash" in attentions and (missing := flash_kernels_missing()):
        parser.error(f"--attention flash: {missing}")
    if args.flex_options:
        from dflash_train.core import attention

        attention.flex_kernel_options = json.loads(args.flex_options)
    args.dims = "tiny" if args.tiny else args.dims
    dims = {"8b": QWEN3_8B, "small": SMALL, "smollm2": SMOLLM2, "tiny": TINY}[args.dims]
    archs = comma_choices(parser, "--arch", args.arch, ARCHS)
    modes = comma_choices(parser, "--fp8", args.fp8, FP8_CHOICES)
    graph_modes = comma_choices(parser, "--cuda-graphs", args.cuda_graphs, ("on", "off"))
    gradient_modes = comma_choices(parser, "--gradients", args.gradients, ("handed-over", "buffers"))
    master_modes = comma_choices(parser, "--master-weights", args.master_weights, ("off", "on"))
    pack_modes = comma_choices(parser, "--pack-anchors", args.pack_anchors, ("off", "on"))
    if args.valid_anchors < 0:
        parser.error(f"--valid-anchors {args.valid_anchors}: must be 0 (all) or more")
    results = []
    for name in args.configs.split(","):
        if name not in SPECFORGE and name not in RECIPE_SHAPES:
            parser.error(f"--configs {name!r}: choose from {', '.join([*SPECFORGE, *RECIPE_SHAPES])}")
        shape = {k: {**SPECFORGE, **RECIPE_SHAPES}[name][k] for k in ("batch", "seq", "anchors")}
        if dims is TINY:
            shape = {"batch": shape["batch"], "seq": shape["seq"] // 16, "anchors": shape["anchors"] // 16}
        for arch in archs:
            for mode in modes:
                runs = [(a, g, m, w, p) for a in attentions for g in graph_modes for m in gradient_modes
                        for w in master_modes for p in pack_modes]
                for attention, graphs, gradients, master, pack in runs:
                    if graphs == "on" and gradients != gradient_modes[0]:
                        continue  # graphs always hold buffers: one run
                    try:
                        result = run_config(name, dims, shape, args, device, mode, graphs, arch, gradients, attention,
                                            master, pack)
                    except Exception as error:  # noqa: BLE001 - report and go on with the next config
                        result = {"config": name, "arch": arch, "fp8": mode, "cuda_graphs": graphs, "gradients": gradients,
                                  "attention": attention, "master_weights": master, "pack_anchors": pack,
                                  "error": f"{type(error).__name__}: {error}"}
                    results.append(result)
                    print(json.dumps(result), flush=True)
                    gc.collect()  # the drafter and its optimizer sit in reference cycles: else the next
                    if device.type == "cuda":  # config's peak memory counts them
                        torch.cuda.empty_cache()
    print(f"\n{'cfg':<4}{'arch':>8}{'fp8':>5}{'graph':>6}{'grads':>8}{'attn':>6}{'mw':>4}{'pack':>5}{'ms/step':>9}{'pipel.':>8}{'fwd':>8}{'bwd':>8}{'opt':>7}{'samp/s':>9}"
          f"{'peakGB':>8}{'TFLOP':>7}{'MFU':>7}{'vs SF':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['config']:<4}{r['arch']:>8}{r['fp8']:>5}{r['cuda_graphs']:>6}{r['gradients'][:7]:>8}{r['attention']:>6}"
                  f"{r['master_weights']:>4}{r['pack_anchors']:>5} error: {r['error']}")
            continue
        print(f"{r['config']:<4}{r['arch']:>8}{r['fp8']:>5}{r['cuda_graphs']:>6}{r['gradients'][:7]:>8}{r['attention']:>6}{r['master_weights']:>4}"
              f"{r['pack_anchors']:>5}{r['ms_per_step']:>9.1f}{r['pipelined_ms']:>8.1f}"
              f"{r['forward_ms']:>8.1f}{r['backward_ms']:>8.1f}"
              f"{r['optimizer_ms']:>7.1f}{r['samples_per_s']:>9.2f}{r['peak_gb']:>8.1f}{r['tflop_per_step']:>7.1f}"
              f"{r['mfu'] * 100:>6.1f}%{r.get('speedup_vs_specforge', float('nan')):>6.2f}x")
    for r in results:
        if "speedup_vs_specforge" in r:
            mode = "bf16" if r["fp8"] == "off" else f"--fp8 {r['fp8']}"
            graphs = (", --cuda-graphs on" if r["cuda_graphs"] == "on" else
                      ", gradient buffers" if r["gradients"] == "buffers" else "")
            print(f"drafter-step {r['config']} ({mode}{graphs}{flash_mark(r)}): {r['ms_per_step']:.1f} ms, MFU {r['mfu'] * 100:.1f}%, "
                  f"{r['speedup_vs_specforge']:.2f}x SpecForge")
    for r in results:
        if r["config"] in RECIPE_SHAPES and "error" not in r:
            mode = "" if r["fp8"] == "off" else f", --fp8 {r['fp8']}"
            graphs = ", graphed" if r["cuda_graphs"] == "on" else ""
            print(f"drafter-step {r['config']} {r['arch']} ({args.dims}{mode}{graphs}{flash_mark(r)}): {r['ms_per_step']:.1f} ms, "
                  f"{r['pipelined_ms']:.1f} ms back to back, {r['samples_per_s']:.1f} samples/s")
    by_key = {(r["config"], r["arch"], r["fp8"], r["attention"], r["master_weights"], r["pack_anchors"], r["cuda_graphs"]): r
              for r in results if "error" not in r}
    for (config_name, arch, fp8_mode, attention, master, pack, graphs), r in by_key.items():
        eager = by_key.get((config_name, arch, fp8_mode, attention, master, pack, "off"))
        named = config_name + ("" if arch == "dflash" else f" {arch}")
        if graphs == "on" and eager is not None:
            print(f"graphed drafter-step {named} ({args.dims}{'' if fp8_mode == 'off' else ', --fp8 ' + fp8_mode}{flash_mark(r)}): "
                  f"{r['pipelined_ms']:.1f} ms/step back to back (eager {eager['pipelined_ms']:.1f}); "
                  f"synchronised per step {r['ms_per_step']:.1f} (eager {eager['ms_per_step']:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
