"""The update's processes (`runtime.update_processes`): torchrun's process group, each process's share of the
turns, and the sums across processes that make N processes train what one trains (docs/cluster.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipeline.model.policy import resolve_device


@dataclass(frozen=True)
class Processes:
    rank: int       # this process (0 writes the outputs)
    world: int      # how many
    device: str     # this process's device


def start_processes(device: str) -> Processes:
    """This process among torchrun's (WORLD_SIZE set), whose process group this starts (NCCL and a GPU per process
    on a GPU, gloo on the CPU), or the only one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Processes(0, 1, device)
    import torch.distributed as dist  # start-up cost: only a multi-process update needs it

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if resolve_device(device).type == "cuda":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return Processes(rank, world, device)


def share(items: list, rank: int, world: int) -> list:
    """Process `rank`'s contiguous share of `items` among `world` processes (sizes differ by at most one)."""
    n = len(items)
    return items[rank * n // world: (rank + 1) * n // world]


def gather_shares(mine: list, world: int) -> list:
    """Every process's `mine`, concatenated in rank order (the inverse of `share`)."""
    if world == 1:
        return mine
    import torch.distributed as dist  # start-up cost: torch

    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return [x for part in parts for x in part]


def all_reduce_grads(params: list[torch.Tensor]) -> None:
    """Sum every process's gradients (one flat buffer, one collective), as DDP's buckets do. Done by hand because a
    process may run more micro-batches than another in a minibatch, which DDP's per-backward hooks do not allow."""
    import torch.distributed as dist  # start-up cost: torch

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset: offset + n].view_as(g).clone()
        offset += n


def all_reduce_sums(sums: dict[str, float], device) -> dict[str, float]:
    """`sums` added up over the processes (float64)."""
    import torch.distributed as dist  # start-up cost: torch

    keys = list(sums)
    total = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return dict(zip(keys, total.tolist()))
