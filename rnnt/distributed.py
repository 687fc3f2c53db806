"""Process-group setup and the few collectives the trainer needs.

There is no DistributedDataParallel: gradients are averaged explicitly before the optimizer
step (one flat all-reduce per dtype), which is what a distributed optimizer will take over.
Works with `python train.py` (one process) and under `torchrun` (env:// rendezvous).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistContext:
    """Join the process group torchrun describes in the environment (or run alone).

    device: "auto" (CUDA when available), "cuda" or "cpu".
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistContext(rank, world_size, local_rank, dev)


def all_reduce_mean_(tensors: list[torch.Tensor], ctx: DistContext) -> None:
    """Average `tensors` over ranks in place, one flat all-reduce per dtype."""
    if not ctx.enabled or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        flat.div_(ctx.world_size)
        offset = 0
        for t in group:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def all_reduce_max_(value: torch.Tensor, ctx: DistContext) -> None:
    """Replace `value` (on the rank's device) by its maximum over ranks, in place."""
    if ctx.enabled:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.enabled:
        values = values.clone()
        dist.all_reduce(values)
    return values


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
