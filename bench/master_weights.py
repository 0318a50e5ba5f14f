"""What bf16 parameters with float32 master weights save per step (issue #40): the parameter
update of a drafter timed two ways on the same parameters and gradients.

  today   what `train` runs under bf16 autocast: the bf16 weight gradients cast to float32 (the
          casts autograd adds, one kernel a weight), the global norm, torch's fused AdamW over the
          float32 parameters (clip and skip inside it: core/step.fused_clip_and_step), and the
          next forward's casts of every weight to bf16 (autocast's, once a step).
  master  `train --master-weights on` (core/master_weights.py): bf16 parameters, the global norm
          of the bf16 gradients, then one compiled update that reads each bf16 gradient with its
          float32 master weight and moments and writes the master, the moments and the bf16
          weight (clip and skip inside it too).

Both run the same clipped AdamW; after the timed steps the master weights are compared with
today's float32 parameters (they differ by rounding only: the largest difference is printed
against the update's own size).

    python3 bench/master_weights.py --json master_weights.json          # the Qwen3-8B-shaped drafter
    python3 bench/master_weights.py --device cpu --tiny --compile off    # smoke test of the script

Summary line:

    master weights 8b: today <a> ms, master <b> ms (<saved> ms saved a step), <n>M parameters
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.drafter_step import QWEN3_8B, SMALL, SMOLLM2  # noqa: E402
from bench.profiling import mean_ms  # noqa: E402
from dflash_train.core.drafter import DFlashDrafter  # noqa: E402
from dflash_train.core.master_weights import MasterWeightAdamW, updated_tensors  # noqa: E402
from dflash_train.core.step import fused_clip_and_step  # noqa: E402
from dflash_train.train.synthetic import TINY, drafter_config  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 6e-4, (0.9, 0.95), 1e-8, 0.01, 1.0


def drafter_parameters(dims: dict, device: torch.device) -> list[torch.Tensor]:
    """The trainable parameters of the drafter at `dims`, float32, random."""
    drafter = DFlashDrafter(drafter_config(dims, block_size=16)).to(device)
    generator = torch.Generator(device).manual_seed(0)
    params = [p.detach() for p in drafter.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.02, generator=generator) if p.dim() > 1 else p.fill_(1.0)
    return params


def master_optimizer(params: list[torch.Tensor], compiled: bool) -> MasterWeightAdamW:
    """train's master-weight AdamW (core/master_weights.py) over bf16 copies of `params`."""
    bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]
    return MasterWeightAdamW(bf16, [p.detach().clone() for p in params], lr=LR, betas=BETAS,
                             weight_decay=WEIGHT_DECAY, eps=EPS, compiled=compiled)


def master_step(optimizer: MasterWeightAdamW, grads: list[torch.Tensor]) -> None:
    """The master-weight update from the same bf16 gradients, clipped and skipped inside it."""
    for param, grad in zip(optimizer.params, grads):
        param.grad = grad
    fused_clip_and_step(optimizer, grads, CLIP)


def today_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> list:
    """Today's update from bf16 weight gradients, and the bf16 weights the next forward casts."""
    for p, g in zip(params, grads):
        p.grad = g.float()
    fused_clip_and_step(optimizer, [p.grad for p in params], CLIP)
    return [p.detach().to(torch.bfloat16) for p in params]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", choices=["8b", "small", "smollm2", "tiny"], default="8b")
    parser.add_argument("--tiny", action="store_true", help="same as --dims tiny (script smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", choices=["on", "off"], default="on", help="the master update compiled (on) or eager")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    dims_name = "tiny" if args.tiny else args.dims
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("master_weights.py: --device cuda but no CUDA GPU here; pass --device cpu", file=sys.stderr)
        return 2
    dims = {"8b": QWEN3_8B, "small": SMALL, "smollm2": SMOLLM2, "tiny": TINY}[dims_name]

    params = drafter_parameters(dims, device)
    count = sum(p.numel() for p in params)
    generator = torch.Generator(device).manual_seed(1)
    grads = [(torch.randn(p.shape, device=device, generator=generator) * 1e-3).to(torch.bfloat16) for p in params]
    master = master_optimizer(params, compiled=args.compile == "on")
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)  # train's, on CUDA
    steps = args.warmup + args.iters
    today_ms = mean_ms(lambda: today_step(params, optimizer, grads), device, args.warmup, args.iters)
    master_ms = mean_ms(lambda: master_step(master, grads), device, args.warmup, args.iters)

    # A step whose gradient is not finite changes nothing in either.
    masters = list(updated_tensors(master))
    before = [t.clone() for t in (*masters, *master.params, *params)]
    grads[0][0].fill_(float("inf"))
    today_step(params, optimizer, grads)
    master_step(master, grads)
    skipped = all(torch.equal(t, b) for t, b in zip((*masters, *master.params, *params), before))

    # Both took `steps` identical steps: their weights differ by rounding only.
    moved = max(float((m - m0).abs().max()) for m, m0 in zip(masters, drafter_parameters(dims, device)))
    difference = max(float((m - p.detach()).abs().max()) for m, p in zip(masters, params))
    result = {"dims": dims_name, "device": str(device), "parameters": count, "steps": steps, "compile": args.compile,
              "today_ms": today_ms, "master_ms": master_ms, "saved_ms": today_ms - master_ms,
              "largest_update": moved, "largest_difference": difference, "non_finite_step_skipped": skipped}
    print(json.dumps(result))
    print(f"master weights {dims_name}: today {today_ms:.2f} ms, master {master_ms:.2f} ms "
          f"({today_ms - master_ms:.2f} ms saved a step), {count / 1e6:.1f}M parameters")
    print(f"after {steps} steps: weights moved up to {moved:.3g}, the two updates differ by up to {difference:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if not difference <= 1e-2 * moved or not skipped:
        print(f"master_weights.py: the two updates disagree ({difference:.3g} against updates of {moved:.3g}; "
              f"a non-finite step {'skipped' if skipped else 'changed weights'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
