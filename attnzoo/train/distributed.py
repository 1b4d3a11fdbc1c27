"""torchrun / DDP plumbing: the same script runs single-process or under torchrun."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(spec: str, local_rank: int = 0) -> torch.device:
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={spec!r} but CUDA is not available; use 'auto' or 'cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def setup(device_spec: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE > 1), else run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_spec, local_rank)
    if world <= 1:
        return DistInfo(device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device)


def all_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum a few numbers over the processes (float64 so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64)
    if info.world > 1:
        if info.device.type == "cuda":
            t = t.to(info.device)
        dist.all_reduce(t)
    return t.cpu().tolist()


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
