"""Benchmark the threaded pipeline end to end (issue #6 item 4, issue #3 item 7).

A Qwen3-8B-shaped target (random weights, bf16) on the target device(s) feeds drafter
threads on the drafter devices through the real trainer. Reports the target's tokens/s
alone (features only, forward stopped after the deepest captured layer), the drafter's
samples/s alone (no target: features replayed from memory), and the pipeline's end-to-end
samples/s with every worker's busy fraction, queue depth and compile counts.

    python bench/pipeline.py --target-devices cuda:0 --drafter-devices cuda:1 --steps 60
    python bench/pipeline.py --dims small --device cuda:0 --cuda-graphs on,off   # both, one after the other
    python bench/pipeline.py --dims small --device cuda:0 --cuda-graphs on --starts 2   # warm-up: first vs second start
    python bench/pipeline.py --tiny --device cpu --steps 6            # smoke test of the script
    python bench/pipeline.py --tiny --device cuda:0 --steps 30 --slow-target-ms 40 --trace T   # the slowed-target case, traced

GPU busy comes twice: nvidia-smi's utilisation (coarse, any kernel of the process) and each worker's
own CUDA-event time (pipeline.jsonl, `gpu_busy`). `--starts N` runs the same run N times as
subprocesses sharing one run folder and fresh compile caches (cold for the first start).
`--slow-target-ms` adds a GPU spin kernel (no host work) before the target's first layer, so the
target's GPU is the limit by construction; `--trace T` writes each run's kernel timeline
(`T-<mode>.json.gz`, CUDA activity only) and its kernel time per stream.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.target.model import Target, default_dtype  # noqa: E402

from dflash_train.config import TrainConfig  # noqa: E402
from dflash_train.train.trainer import train  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
# A Qwen3-0.6B-shaped target: the pipeline-layout runs of issue #3, where 200+ steps must fit
# in minutes.
SMALL = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096)


@dataclass
class Sample:
    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def random_target(dims: dict, device: torch.device, dtype: torch.dtype | None = None, family: str = "qwen3") -> Target:
    """A random-init target of `dims`, built directly on `device` in `dtype` (default: bfloat16
    on CUDA, float32 elsewhere); `family` qwen3 or llama."""
    import transformers

    classes = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}
    config_class, model_class = classes[family]
    dtype = dtype or default_dtype(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config_class(**dims, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(previous)
    return Target(model)


def variable_length_samples(count: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        ids = torch.randint(0, vocab - 2, (length,), generator=generator)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[int(0.2 * length):] = True
        samples.append(Sample(i, ids, mask))
    return samples


class GpuUtilization:
    """Samples every GPU's utilisation (nvidia-smi, 4 Hz) in the background: the fraction of
    time a kernel was running, per GPU, over the second half of the run (after compiles)."""

    def __init__(self) -> None:
        import shutil
        import subprocess
        import threading

        self.samples: list[tuple[float, int, float]] = []
        self.process = None
        if shutil.which("nvidia-smi") is None:
            return
        self.process = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "250"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                index, utilization = (int(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), index, utilization / 100))

    def busy_fraction(self, since: float) -> dict[str, float]:
        if self.process is not None:
            self.process.terminate()
        end = self.samples[-1][0] if self.samples else since
        window = [(gpu, value) for t, gpu, value in self.samples if t >= since + (end - since) / 2]
        gpus = sorted({gpu for gpu, _ in window})
        return {f"cuda:{g}": round(sum(v for i, v in window if i == g) / sum(1 for i, _ in window if i == g), 3)
                for g in gpus}


def slow_down(target: Target, ms: float) -> None:
    """A spin kernel of `ms` on the target's GPU before its first decoder layer, in every forward
    (a pre-hook, so CUDA-graph captures of the feature forward record it too)."""
    device = target.device
    calibration = 50_000_000
    torch.cuda._sleep(calibration)  # the first launch loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))
    torch.cuda._sleep(calibration)
    end.record(torch.cuda.current_stream(device))
    end.synchronize()
    cycles = int(calibration * ms / start.elapsed_time(end))
    print(f"target slowed: {cycles:,} spin cycles per forward (~{ms} ms)", flush=True)
    target.model.model.layers[0].register_forward_pre_hook(lambda module, inputs: torch.cuda._sleep(cycles))


def time_target_alone(target: Target, layer_ids: list[int], batch: int, seq: int, repeats: int) -> float:
    ids = torch.randint(0, target.spec.vocab_size - 2, (batch, seq), device=target.device)
    target.features(ids, layer_ids)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.features(ids, layer_ids)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return batch * seq * repeats / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-devices", default="cuda:0")
    parser.add_argument("--drafter-devices", default="cuda:1")
    parser.add_argument("--device", default="", help="shortcut: put everything on this device")
    parser.add_argument("--tiny", action="store_true", help="same as --dims tiny")
    parser.add_argument("--dims", choices=["8b", "small", "tiny"], default="8b",
                        help="target shape: Qwen3-8B (issue #6), Qwen3-0.6B (layout runs), tiny (CPU smoke)")
    parser.add_argument("--mode", default="replicas")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=3072)
    parser.add_argument("--min-seq-len", type=int, default=0, help="0 = all rows at max length (config D)")
    parser.add_argument("--num-anchors", type=int, default=512)
    parser.add_argument("--buckets", default="", help="comma-separated padded lengths")
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--cuda-graphs", default="auto", help="comma-separated modes to run one after the other: auto, on, off")
    parser.add_argument("--starts", type=int, default=1, help="run N times as subprocesses (warm-up of a second start)")
    parser.add_argument("--out", default="", help="run folder (default: a new temporary one)")
    parser.add_argument("--compile-target", default="auto", choices=("auto", "on", "off"), help="train --compile-target")
    parser.add_argument("--slow-target-ms", type=float, default=0.0,
                        help="GPU spin before the target's first layer, per batch (CUDA only; needs --compile-target off: "
                             "inductor drops the spin from a compiled forward)")
    parser.add_argument("--trace", default="", help="write each run's CUDA kernel timeline to TRACE-<mode>.json.gz")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.starts > 1:
        return repeated_starts(args)
    faulthandler.dump_traceback_later(570, exit=True)
    dims = {"8b": QWEN3_8B, "small": SMALL, "tiny": TINY}["tiny" if args.tiny else args.dims]
    target_devices = [args.device] if args.device else args.target_devices.split(",")
    drafter_devices = [args.device] if args.device else args.drafter_devices.split(",")
    print(f"building random targets on {target_devices}", flush=True)
    targets = [random_target(dims, torch.device(d)) for d in target_devices]
    for other in targets[1:]:
        other.model.load_state_dict(targets[0].model.state_dict())
    if args.slow_target_ms:
        if args.compile_target != "off":
            parser.error("--slow-target-ms needs --compile-target off: inductor drops the spin from a compiled forward")
        for target in targets:
            slow_down(target, args.slow_target_ms)
    layer_ids = {id(QWEN3_8B): [1, 9, 17, 25, 33], id(SMALL): [1, 7, 13, 19, 25], id(TINY): [1, 3, 5]}[id(dims)]
    tokens_per_s = time_target_alone(targets[0], layer_ids, args.batch_size, args.max_seq_len, 3 if args.tiny else 5)
    print(f"target alone: {tokens_per_s:,.0f} tokens/s ({args.batch_size} x {args.max_seq_len})", flush=True)
    min_len = args.min_seq_len or args.max_seq_len
    samples = variable_length_samples(max(64, args.batch_size * 16), dims["vocab_size"], min_len, args.max_seq_len)
    results = []
    for mode in args.cuda_graphs.split(","):
        out = args.out or tempfile.mkdtemp(prefix="dflash-bench-")
        results.append(run_once(args, dims, targets, layer_ids, samples, tokens_per_s, min_len, target_devices,
                                drafter_devices, mode, out))
    by_mode = {r["cuda_graphs"]: r for r in results}
    if "on" in by_mode and "off" in by_mode:
        on, off = by_mode["on"], by_mode["off"]
        print(f"pipeline {args.dims} ({','.join(target_devices)} -> {','.join(drafter_devices)}): graphed "
              f"{on['steady_steps_per_s']} steps/s, {on['pipeline_samples_per_s_steady']} samples/s "
              f"(eager {off['steady_steps_per_s']} steps/s, {off['pipeline_samples_per_s_steady']} samples/s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results if len(results) > 1 else results[0], indent=2))
    return 0


def repeated_starts(args) -> int:
    """The same run started `args.starts` times in subprocesses, sharing the run folder and compile
    caches that are empty before the first start: the warm-up of each start."""
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="dflash-starts-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TRITON_CACHE_DIR": str(work / "triton")}
    argv = [a for a in sys.argv[1:]]
    for flag in ("--starts", "--json", "--out"):
        while flag in argv:
            index = argv.index(flag)
            del argv[index:index + 2]
    starts = []
    for start in range(args.starts):
        result = work / f"start{start + 1}.json"
        command = [sys.executable, __file__, *argv, "--out", str(work / "run"), "--json", str(result)]
        print(f"=== start {start + 1}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, env=env, check=False)
        numbers = json.loads(result.read_text()) if result.is_file() else {"error": "no result"}
        starts.append(numbers[0] if isinstance(numbers, list) else numbers)
    warmups = [s.get("summary", {}).get("startup", {}).get("warmup_s") for s in starts]
    firsts = [s.get("summary", {}).get("startup", {}).get("time_to_first_step_s") for s in starts]
    print(f"warm-up per start: {warmups} s; first step after {firsts} s")
    if len(warmups) > 1 and all(isinstance(w, (int, float)) and w for w in warmups[:2]):
        print(f"second start warm-up: {100 * warmups[1] / warmups[0]:.0f}% of the first")
    if args.json:
        Path(args.json).write_text(json.dumps({"starts": starts, "warmup_s": warmups}, indent=2))
    return 0


def run_once(args, dims, targets, layer_ids, samples, tokens_per_s, min_len, target_devices, drafter_devices, mode,
             out) -> dict:
    config = TrainConfig(
        out=out, steps=args.steps, cuda_graphs=mode, batch_size=args.batch_size, max_seq_len=args.max_seq_len, block_size=16,
        num_layers=2 if dims is TINY else 5, num_anchors=args.num_anchors, target_layer_ids=layer_ids,
        mask_token_id=dims["vocab_size"] - 1, target_devices=target_devices, drafter_devices=drafter_devices,
        mode=args.mode, save_every=10**9, log_every=10, export_dtype="", compile=args.compile,
        compile_target=args.compile_target,
        seq_buckets=[int(b) for b in args.buckets.split(",")] if args.buckets else [],
        variants=[{"name": f"v{i}"} for i in range(len(drafter_devices))] if args.mode == "variants" else [],
    )
    utilization = GpuUtilization()
    train_started = time.monotonic()
    activity = torch.profiler.ProfilerActivity
    profiler = (torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU])
                if args.trace else contextlib.nullcontext())
    with profiler as prof:
        summary = train(config, samples=samples, target=targets, log=sys.stdout, save_checkpoints=False)
    if args.trace:
        from profiling import kernels_by_stream

        trace = Path(f"{args.trace}-{mode}.json")
        prof.export_chrome_trace(str(trace))
        print(json.dumps({"kernel ms per step by stream": kernels_by_stream(trace, args.steps, top=4)}, indent=1))
        with open(trace, "rb") as plain, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(plain, packed)
        trace.unlink()
    gpu_busy = utilization.busy_fraction(train_started)
    warm = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl" if args.mode == "replicas" else "v0/metrics.jsonl"))]
    warm = warm[-summary["steps_done"][next(iter(summary["steps_done"]))]:]  # this start's records
    steady = warm[len(warm) // 3:]
    seconds = (steady[-1]["elapsed_s"] - steady[0]["elapsed_s"]) / max(1, len(steady) - 1)
    samples_per_step = args.batch_size * (len(drafter_devices) if args.mode == "replicas" else 1)
    pipeline_records = [json.loads(line) for line in open(os.path.join(out, "pipeline.jsonl"))]
    result = {
        "torch": torch.__version__, "target_devices": target_devices, "drafter_devices": drafter_devices,
        "cuda_graphs": mode, "startup": summary["startup"], "bottleneck": summary.get("bottleneck"),
        "worker_gpu_busy_events": {name: w.get("gpu_busy") for name, w in pipeline_records[-1]["workers"].items()},
        "worker_host_busy": {name: w.get("host_busy") for name, w in pipeline_records[-1]["workers"].items()},
        "mode": args.mode, "target_tokens_per_s_alone": round(tokens_per_s),
        "target_samples_per_s_alone": round(tokens_per_s / ((min_len + args.max_seq_len) / 2), 3),
        "pipeline_samples_per_s_steady": round(samples_per_step / seconds, 3) if seconds > 0 else None,
        "steady_steps": len(steady), "steady_steps_per_s": round(1 / seconds, 3) if seconds > 0 else None,
        "gpu_busy_fraction_second_half": gpu_busy, "compiles": summary["compiles"],
        "workers": summary["workers"], "summary": summary,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("summary", "workers")}, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(main())
