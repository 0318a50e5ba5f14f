"""One node's process of a tiny CPU training run, started by torchrun from tests/e2e/test_parallel_nodes.py.

    python -m torch.distributed.run ... tests/torchrun_train.py SPEC.json

SPEC (JSON): out (may contain {rank}), results (a folder: RANK.json is written there), config
(TrainConfig overrides of tiny_train_config), samples, stop_at, targets (target workers per
process), samples_by_rank ({"1": 31}: that rank trains other data), target_device, and at most one fault, acted on by the hook of the node's first replica after a step:
    fail   {"rank": R, "step": S}                  raise in the hook
    die    {"rank": R, "step": S}                  os._exit: the process dies without a word
    signal {"rank": R, "step": S, "name": "SIGTERM", "repeat": 1}  a real signal to this process
With "protocol": {...} it runs NodeGroup, StepVote and NodeReduce alone (no model), see `protocol`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import pattern_samples, tiny_target, tiny_train_config  # noqa: E402


def build_targets(count: int = 1, device: str = "cpu"):
    """Identical tiny targets (tiny_hf_model seeds its own init), one per target worker."""
    from dflash_train.target.model import Target

    return [Target(tiny_target("llama", layers=6, head_scale=20).model.to(device)) for _ in range(count)]


def fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train_node(spec: dict, rank: int) -> dict:
    from dflash_train.train.trainer import train

    config = tiny_train_config(spec["out"].format(rank=rank), **spec.get("config", {}))
    prints: dict[int, dict[int, str]] = {}
    lock = threading.Lock()

    def hook(worker, step):
        with lock:
            prints.setdefault(step, {})[worker.replica.rank] = fingerprint(worker.replica.drafter)
        if worker.replica.rank != 0:
            return
        for kind in ("fail", "die", "signal"):
            fault = spec.get(kind)
            if fault and fault["rank"] == rank and fault["step"] == step:
                if kind == "fail":
                    raise RuntimeError(f"boom from the test on rank {rank}")
                if kind == "die":
                    sys.stdout.flush()
                    os._exit(17)
                for i in range(fault.get("repeat", 1)):
                    if i:
                        time.sleep(0.5)  # after the main thread handled the previous one (same-kind signals coalesce)
                    os.kill(os.getpid(), getattr(signal, fault["name"]))

    targets = build_targets(spec.get("targets", 1), spec.get("target_device", "cpu"))
    result: dict = {"rank": rank}
    try:
        count = spec.get("samples_by_rank", {}).get(str(rank), spec.get("samples", 32))
        summary = train(config, samples=pattern_samples(count),
                        target=targets if len(targets) > 1 else targets[0],
                        step_hook=hook, stop_at=spec.get("stop_at"), log=sys.stdout)
        result.update(ok=True, summary=summary)
    except BaseException as error:  # noqa: BLE001 - reported to the test, then re-raised as exit 1
        result.update(ok=False, error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
    result["fingerprints"] = {str(k): v for k, v in sorted(prints.items())}
    return result


def protocol(spec: dict) -> dict:
    """Three steps of the vote and the gradient all-reduce with no model: rank 0 spends `busy_seconds` after step 1, as a
    checkpoint or an in-training eval would, announcing it in its vote only if `announce`."""
    from dflash_train.parallel.gradients import NodeReduce
    from dflash_train.parallel.launch import detect_launch
    from dflash_train.parallel.nodes import NodeGroup
    from dflash_train.parallel.vote import StepVote
    from dflash_train.parallel.threads import StopSignal

    settings = spec["protocol"]
    launch = detect_launch()
    stop = StopSignal()
    result: dict = {"rank": launch.rank}
    started = time.monotonic()
    try:
        with NodeGroup(launch, backend="gloo", timeout=settings["timeout"]) as nodes:
            busy = (lambda step: step == 1) if settings["announce"] and nodes.rank == 0 else None
            vote = StepVote(nodes, drafter="d", start=0, end=3, local_replicas=1, block_size=4, stop=stop,
                            busy_after=busy)
            across = NodeReduce(nodes)
            buffer = torch.full((8,), float(nodes.rank + 1))
            for step in range(3):
                assert not vote.cast().stops
                across.all_reduce(buffer, step)
                if step == 1 and nodes.rank == 0:
                    time.sleep(settings["busy_seconds"])
            vote.leave(3)
            nodes.finish()
        result.update(ok=True, total=float(buffer[0]))
    except BaseException as error:  # noqa: BLE001
        error = stop.error() or error
        result.update(ok=False, error=f"{type(error).__name__}: {error}")
    result["seconds"] = time.monotonic() - started
    return result


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    result = protocol(spec) if "protocol" in spec else train_node(spec, rank)
    results = Path(spec["results"])
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
