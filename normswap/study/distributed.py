"""The study under torchrun: the process group, and process 0's decisions sent to every process
(as tensors: nothing pickled)."""

from __future__ import annotations

import os

import torch

from normswap.study.training import norm_impl
from normswap.study.training.interleaved import Dist


def init_dist(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
        rank = dist.get_rank()
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
            torch.cuda.set_device(torch.device(device))
        return Dist(torch.device(device), rank, dist.get_world_size())
    return Dist(torch.device(device))


def agree(dist: Dist, flags: list[bool]) -> list[bool]:
    """Process 0's decisions, sent as a tensor (nothing pickled)."""
    if dist.world == 1 or not flags:
        return flags
    import torch.distributed as tdist

    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64, device=dist.device)
    tdist.broadcast(t, 0)
    return [bool(v) for v in t.tolist()]


def agree_choice(dist: Dist, choice: str) -> str:
    """Process 0's kernel choice for every process (timings differ between processes)."""
    names = list(norm_impl.RMS_IMPLS)
    return names[_agree_index(dist, names.index(choice))] if choice in names else choice


def _agree_index(dist: Dist, i: int) -> int:
    if dist.world == 1:
        return i
    import torch.distributed as tdist

    t = torch.tensor([i], dtype=torch.int64, device=dist.device)
    tdist.broadcast(t, 0)
    return int(t.item())
