"""What the launcher says about this process, and where its devices and gradients go.

    Launch             torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...)
    check_launch       which modes run under several processes (replicas only)
    place_devices      disjoint GPUs for processes sharing a host
    gradient_backend   NCCL on GPUs, gloo on CPU, for the cross-node gradient all-reduce
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Launch:
    """This process's place in a multi-process launch (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); else rank 0 does
    attempt: int  # torchrun's restart count: store keys are per attempt


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch torchrun describes in the environment, or None for a plain one-process run."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ConfigError(f"RANK/WORLD_SIZE are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "not: start multi-node runs with torchrun (README, 'Several nodes (torchrun)')")

    def integer(name: str, default: int | None = None) -> int:
        text = env.get(name)
        if text is None and default is not None:
            return default
        try:
            return int(text)
        except (TypeError, ValueError):
            raise ConfigError(f"environment variable {name}={text!r} is not an integer") from None

    rank, world = integer("RANK"), integer("WORLD_SIZE")
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is outside WORLD_SIZE {world}")
    local_rank, local_world = integer("LOCAL_RANK", 0), integer("LOCAL_WORLD_SIZE", 1)
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ConfigError(f"LOCAL_RANK {local_rank} is outside LOCAL_WORLD_SIZE {local_world}")
    return Launch(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        master_addr=env["MASTER_ADDR"], master_port=integer("MASTER_PORT"),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        attempt=integer("TORCHELASTIC_RESTART_COUNT", 0),
    )


def check_launch(mode: str, launch: Launch | None) -> None:
    if launch is not None and launch.world_size > 1 and mode != "replicas":
        raise ConfigError(f"mode {mode!r} trains in one process; under torchrun with WORLD_SIZE "
                          f"{launch.world_size} use mode replicas (one drafter, data-parallel over every node)")


def place_devices(device_lists: Sequence[list[torch.device]], launch: Launch | None,
                  visible: int | None = None) -> list[list[torch.device]]:
    """Device indices are per process. Several processes on one host (--nproc-per-node > 1) that
    all see the host's GPUs use disjoint ones: process LOCAL_RANK r takes GPUs r·G ... r·G + G − 1,
    G being the GPUs one process's layout names. Where each process sees only G GPUs (a launcher
    set CUDA_VISIBLE_DEVICES per process) the indices are used as given. `visible`: the GPUs this
    process sees (default: torch.cuda.device_count())."""
    lists = [list(devices) for devices in device_lists]
    if launch is None or launch.local_world_size == 1:
        return lists
    used = {d.index or 0 for devices in lists for d in devices if d.type == "cuda"}
    if not used:
        return lists
    span = max(used) + 1
    visible = torch.cuda.device_count() if visible is None else visible
    if visible == span:
        return lists
    if visible < span * launch.local_world_size:
        raise ConfigError(
            f"{launch.local_world_size} processes on this host each use {span} GPU(s) (cuda:0..{span - 1} per "
            f"process), which needs {span * launch.local_world_size}; this process sees {visible}"
        )
    offset = launch.local_rank * span

    def shift(d: torch.device) -> torch.device:
        return torch.device("cuda", (d.index or 0) + offset) if d.type == "cuda" else d

    return [[shift(d) for d in devices] for devices in lists]


def gradient_backend(choice: str, drafter_devices: Sequence[torch.device]) -> str:
    """auto: NCCL when every drafter device is a GPU (and this torch has NCCL), else gloo."""
    import torch.distributed as dist

    if choice == "auto":
        on_gpus = all(d.type == "cuda" for d in drafter_devices)
        return "nccl" if on_gpus and dist.is_nccl_available() else "gloo"
    if choice == "nccl" and not dist.is_nccl_available():
        raise ConfigError("dist_backend nccl: this torch build has no NCCL; use gloo")
    return choice
