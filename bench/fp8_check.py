"""FP8 numerics check (train --fp8): how far FP8 gradients are from exact ones, eager and
compiled, and how fast a drafter fits one batch in each mode.

    python3 bench/fp8_check.py --device cuda --json fp8_check.json
    python3 bench/fp8_check.py --device cpu --dims tiny          # smoke test of the script

For each mode (off, head, all) and each of eager / compiled: the cosine between the step's
gradient (bf16 autocast on CUDA) and a float32 eager reference with the same weights and batch,
then the loss over --fit-steps AdamW steps on that one batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from dflash_train.config import FP8_CHOICES  # noqa: E402
from dflash_train.core.step import FrozenTargetParts, drafter_loss, make_optimizer  # noqa: E402
from dflash_train.train.synthetic import TINY, drafter_config, make_batch, random_drafter  # noqa: E402

SMOLLM2 = dict(hidden=576, layers=5, heads=9, kv_heads=3, head_dim=64, mlp=1536, vocab=49152, target_layers=30,
               layer_ids=[1, 8, 14, 20, 27])


def build(dims, device, mode, compiled, seed=0):
    config = drafter_config(dims, 16)
    torch.manual_seed(seed)
    return config, random_drafter(config, device, compiled=compiled, fp8=mode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dims", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=768)
    parser.add_argument("--anchors", type=int, default=128)
    parser.add_argument("--fit-steps", type=int, default=60)
    parser.add_argument("--compiled", default="off,on")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    dims = SMOLLM2 if args.dims == "smollm2" else TINY
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(1)
    config = drafter_config(dims, 16)
    embed = (torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.02).to(device)
    head = (torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.02).to(device)
    batch, objective, _ = make_batch(config, args.batch, args.seq, args.anchors, device, torch.float32)
    backend = "flex" if cuda else "sdpa"

    def gradient(drafter, mode, compiled, autocast):
        objective.fp8_head, objective.compiled_head = mode != "off", compiled
        frozen = FrozenTargetParts(embed.to(torch.bfloat16) if autocast else embed, head.to(torch.bfloat16) if autocast else head)
        drafter.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, _ = drafter_loss(drafter, frozen, batch, objective, backend)
        loss.backward()
        return float(loss), torch.cat([p.grad.float().flatten() for p in drafter.parameters()]), frozen

    _, reference = build(dims, device, "off", False)
    ref_loss, ref_grad, _ = gradient(reference, "off", False, autocast=False)
    print(f"float32 reference: loss {ref_loss:.4f}", flush=True)
    results = []
    for compiled in [c == "on" for c in args.compiled.split(",")]:
        for mode in FP8_CHOICES:
            _, drafter = build(dims, device, mode, compiled)
            loss, grad, frozen = gradient(drafter, mode, compiled, autocast=cuda)
            cos = float(torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0))
            rel = float((grad - ref_grad).norm() / ref_grad.norm())
            optimizer = make_optimizer(drafter, 6e-4, 0.0, (0.9, 0.95))
            curve = []
            for _ in range(args.fit_steps):
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    step_loss, _ = drafter_loss(drafter, frozen, batch, objective, backend)
                step_loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
                optimizer.step()
                curve.append(round(float(step_loss), 4))
            result = {"mode": mode, "compiled": compiled, "loss": round(loss, 4), "grad_cos": round(cos, 5),
                      "grad_rel_error": round(rel, 4), "fit_curve": curve[:: max(1, args.fit_steps // 10)] + curve[-1:]}
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "reference_loss": ref_loss, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
