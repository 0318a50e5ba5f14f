"""Sweep flex_attention kernel options on the DFlash mask at a drafter-step shape (issue #6).

The profile of config A puts flex attention at ~20 ms of a ~150 ms step, its backward at ~4x
its forward. This times the compiled flex forward and forward+backward for a few tile /
pipelining choices on exactly the attention the drafter runs (our closed-form BlockMask,
grouped-query heads, bf16), so the best one can become the default in `attention.attend`.

    python bench/flex_tuning.py --config A --json flex.json
    python bench/flex_tuning.py --device cpu --tiny         # script smoke test (forward only)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.drafter_step import QWEN3_8B, RECIPE_SHAPES, SMOLLM2, SPECFORGE  # noqa: E402
from dflash_train.core.attention import block_mask  # noqa: E402
from dflash_train.train.synthetic import TINY, drafter_config, make_batch  # noqa: E402

# (name, kernel_options); None = the torch release's own choice for this GPU.
CANDIDATES: list[tuple[str, dict | None]] = [
    ("default", None),
    ("bwd 64/64/64/64 s3 w4", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                               "bwd_num_stages": 3, "bwd_num_warps": 4}),
    ("bwd 32/128/128/32 s3 w4", {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                                 "bwd_num_stages": 3, "bwd_num_warps": 4}),
    ("bwd 64/128/128/64 s2 w8", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                                 "bwd_num_stages": 2, "bwd_num_warps": 8}),
    ("fwd 128/128 s2 w8", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8}),
    ("fwd 128/64 s3 w8", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8}),
    # FlashAttention-4's CuTe DSL kernels in place of Triton's (needs the `flash-attn-4` package).
    ("flash", {"BACKEND": "FLASH"}),
]
# Largest error against the default's output and input gradients, relative to their largest
# value, that a candidate may show and still be picked (bf16 reorderings give ~1e-2).
MAX_RELATIVE_ERROR = 2e-2


def attention_flops(anchors: torch.Tensor, valid: torch.Tensor, block: int, heads: int, head_dim: int) -> float:
    """Useful forward FLOPs: 4·heads·d per visible (query, key) pair."""
    pairs = float(((anchors.float() + block) * block * valid.float()).sum())
    return 4 * heads * head_dim * pairs


def time_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def pick_best(results: list[dict], margin: float = 0.97) -> dict:
    """The fastest forward-only and backward-only choices, each kept only when it beats the
    default by more than 3%; merged into one kernel_options dict ({} = keep the defaults).
    Another backend replaces both when its forward + backward beats the merged choice's."""
    ok = [r for r in results if "error" not in r and r.get("relative_error", 0.0) <= MAX_RELATIVE_ERROR]
    default = next((r for r in ok if r["name"] == "default"), None)
    if default is None:
        return {}
    best: dict = {}
    merged_ms = 0.0  # forward + backward of the merged Triton choice
    for prefix, key in (("fwd_", "forward_ms"), ("bwd_", "backward_ms")):
        candidates = [r for r in ok if r["options"] and all(k.startswith(prefix) for k in r["options"])]
        chosen = default
        if candidates:
            fastest = min(candidates, key=lambda r: r[key])
            if fastest[key] < margin * default[key]:
                best.update(fastest["options"])
                chosen = fastest
        merged_ms += chosen[key]
    backends = [r for r in ok if r["options"] and "BACKEND" in r["options"]]
    if backends:
        fastest = min(backends, key=lambda r: r["fwd_bwd_ms"])
        if fastest["fwd_bwd_ms"] < margin * merged_ms:
            return dict(fastest["options"])
    return best


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| over each pair, relative to the largest |want| of that pair."""
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp(min=1e-30))
               for g, w in zip(got, want))


def main() -> int:
    from torch.nn.attention.flex_attention import flex_attention

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="A", help="a shape of bench/drafter_step.py: A, B, D, or S (at --dims smollm2)")
    parser.add_argument("--dims", choices=["8b", "smollm2"], default="8b", help="the drafter's heads and head size")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default="")
    parser.add_argument("--only", default="", help="comma-separated candidate names (default first, always)")
    parser.add_argument("--pick", default="", help="print the best options of a --json result file and exit")
    args = parser.parse_args()
    if args.pick:
        best = pick_best(json.loads(Path(args.pick).read_text())["results"])
        print(json.dumps(best) if best else "")
        return 0
    faulthandler.dump_traceback_later(300, exit=True)
    device = torch.device(args.device)
    dims = TINY if args.tiny else {"8b": QWEN3_8B, "smollm2": SMOLLM2}[args.dims]
    config = drafter_config(dims, 16)
    shapes = {**SPECFORGE, **RECIPE_SHAPES}
    if args.config not in shapes:
        parser.error(f"--config {args.config!r}: choose from {', '.join(shapes)}")
    shape = {k: shapes[args.config][k] for k in ("batch", "seq", "anchors")}
    if args.tiny:
        shape = {"batch": shape["batch"], "seq": shape["seq"] // 16, "anchors": shape["anchors"] // 16}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch, _, anchor_valid = make_batch(config, shape["batch"], shape["seq"], shape["anchors"], device, dtype)
    b, S, B = shape["batch"], shape["seq"], config.block_size
    queries = shape["anchors"] * B
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(b, heads, queries, d, device=device, dtype=dtype, requires_grad=device.type == "cuda")
    k = torch.randn(b, kv_heads, S + queries, d, device=device, dtype=dtype, requires_grad=device.type == "cuda")
    v = torch.randn(b, kv_heads, S + queries, d, device=device, dtype=dtype, requires_grad=device.type == "cuda")
    grad_out = torch.randn(b, heads, queries, d, device=device, dtype=dtype)
    mask = block_mask(batch.anchors, S, B)
    flops = attention_flops(batch.anchors.cpu(), anchor_valid, B, heads, d)
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(flex_attention, dynamic=False)
    wanted = {"default", *filter(None, args.only.split(","))} if args.only else None
    unknown = sorted((wanted or set()) - {name for name, _ in CANDIDATES})
    if unknown:
        print(f"--only: unknown candidate {', '.join(unknown)} (known: {', '.join(n for n, _ in CANDIDATES)})")
        return 2
    inputs = (q, k, v) if device.type == "cuda" else ()
    results, reference = [], None
    for name, options in CANDIDATES:
        if wanted is not None and name not in wanted:
            continue
        kwargs = {"block_mask": mask, "scale": d**-0.5, "enable_gqa": True}
        if options:
            kwargs["kernel_options"] = options
        try:
            started = time.perf_counter()
            out = compiled(q, k, v, **kwargs)
            computed = [out.detach(), *torch.autograd.grad(out, inputs, grad_out)] if inputs else [out.detach()]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            compile_s = time.perf_counter() - started
            reference = computed if reference is None else reference
            with torch.no_grad():
                forward = time_ms(lambda: compiled(q, k, v, **kwargs), args.repeats, device)
            both = time_ms(lambda: compiled(q, k, v, **kwargs).backward(grad_out), args.repeats, device) \
                if device.type == "cuda" else float("nan")
            result = {"name": name, "options": options, "forward_ms": round(forward, 3),
                      "fwd_bwd_ms": round(both, 3), "backward_ms": round(both - forward, 3),
                      "fwd_tflops": round(flops / forward / 1e9, 1), "compile_s": round(compile_s, 1),
                      "relative_error": relative_error(computed, reference)}
        except Exception as error:  # noqa: BLE001 - a candidate the GPU cannot run: report, go on
            result = {"name": name, "options": options, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        results.append(result)
        print(json.dumps(result), flush=True)
    print(f"\nflex attention at config {args.config} ({heads}/{kv_heads} heads, d {d}, {queries} queries, "
          f"{S + queries} keys), useful fwd {flops / 1e12:.2f} TFLOP per layer call")
    for r in results:
        if "error" in r:
            print(f"  {r['name']:<26} error: {r['error'][:120]}")
        else:
            print(f"  {r['name']:<26} fwd {r['forward_ms']:7.2f} ms  bwd {r['backward_ms']:7.2f} ms  "
                  f"fwd+bwd {r['fwd_bwd_ms']:7.2f} ms  ({r['fwd_tflops']} TFLOP/s fwd, "
                  f"error {r['relative_error']:.1e} of the default's)")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "config": args.config, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
