"""Process-group setup and the few collectives outside the optimizer.

One process per GPU, started by `torchrun` (its RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR
variables) or by `srun` with one task per GPU (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the
rendezvous address is the job's first node unless MASTER_ADDR is set). NCCL on GPUs, gloo on CPU.
Every collective has a timeout, and NCCL's asynchronous error handling tears a process down when
a peer dies, so a lost rank ends the job instead of hanging it.

Every tensor handed to a collective lives on the rank's device: NCCL has no CPU backend, and
gloo, which CI runs, would accept a CPU tensor that NCCL refuses.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rnnt.errors import UserError
from rnnt.seeds import draw_seed


class DeviceError(UserError, RuntimeError):
    """The device asked for is not on this machine."""


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


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM node list such as 'dgx[03-05,09],login1'."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None or not head.group(1):
        raise ValueError(f"cannot read a host name from the SLURM node list {nodelist!r}")
    prefix, ranges = head.group(1), head.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _launcher_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's or SLURM's environment; sets the
    rendezvous variables env:// reads when SLURM started the processes."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        env.setdefault("MASTER_ADDR", first_slurm_host(nodelist) if nodelist else "127.0.0.1")
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
    return 0, 1, 0


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the process group that torchrun or srun describe (or run alone).

    device: "auto" (CUDA when available), "cuda" or "cpu". timeout_s bounds every collective:
    past it, a rank waiting for a dead peer raises instead of hanging.
    """
    rank, world_size, local_rank = _launcher_env()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise DeviceError("--device cuda: this machine has no CUDA device (use --device cpu)")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        # a failed or timed-out NCCL collective aborts the communicator and ends the process
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            store=_attempt_store(world_size, timeout_s),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if use_cuda else None,
        )
    return DistContext(rank, world_size, local_rank, dev)


def _attempt_store(world_size: int, timeout_s: float) -> dist.Store | None:
    """The rendezvous store, with keys of their own for each restart of a torchrun job.

    torchrun (--max-restarts) keeps one store for every attempt. Without a prefix, a restarted
    rank can read what the previous attempt's rank 0 wrote there (NCCL's unique id, gloo's
    addresses), connect to a process that is gone, and fail the restart. None: env:// (a
    store of its own per launch) does.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"rnnt/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity: a SLURM step or taskset may give it
    fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_threads(cores: int, local_ranks: int, data_threads: int, setting: int) -> int:
    """torch's intra-op threads for one rank: `setting` when positive, else the rank's share of
    the cores less the data pipeline's threads, at least 1. Left at torch's default (all
    cores per process), several ranks and the loader's threads oversubscribe the cores, which
    slowed a 2-core CPU run about 50x."""
    if setting > 0:
        return setting
    return max(1, cores // max(local_ranks, 1) - data_threads)


NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees


def visible_gpu_share(env: dict[str, str], proc_gpus: Path | None = None) -> tuple[int, int]:
    """(GPUs this job may use, GPUs of the node) where CUDA_VISIBLE_DEVICES names fewer than
    the node has, else (1, 1). Jobs that split a node's GPUs between them (a sweep of
    one-GPU runs) share its cores too, though each one's CPU affinity names all of them."""
    names = [n for n in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if n.strip()]
    try:
        on_node = sum(1 for _ in (proc_gpus or NVIDIA_PROC_GPUS).iterdir())
    except OSError:
        return 1, 1
    if "CUDA_VISIBLE_DEVICES" not in env or not 0 < len(names) < on_node:
        return 1, 1
    return len(names), on_node


def ranks_sharing_cores(env: dict[str, str], narrowed: bool) -> int:
    """How many of this node's ranks run on this process's CPU affinity. torchrun's children
    inherit its affinity, so they share it (LOCAL_WORLD_SIZE). Ranks that srun started as
    tasks of their own (scripts/slurm/run.sub) share the node's cores while nothing narrowed
    their affinity (SLURM_NTASKS_PER_NODE), and each has its own cores once srun bound them
    (`narrowed`: the affinity holds fewer cores than the machine): dividing those again by the
    tasks per node left a 14-core task 1 intra-op thread."""
    if "LOCAL_WORLD_SIZE" in env:
        return max(1, int(env["LOCAL_WORLD_SIZE"]))
    if narrowed:
        return 1
    per_node = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]  # "8", or "8(x2)"
    return max(1, int(per_node)) if per_node.isdigit() else 1


def set_torch_threads(data_threads: int, setting: int) -> str:
    """Apply `torch_threads` to this process; returns the one line that says what it chose."""
    cores = available_cores()
    narrowed = cores < (os.cpu_count() or cores)
    local_ranks = ranks_sharing_cores(dict(os.environ), narrowed)
    visible, on_node = visible_gpu_share(dict(os.environ))
    if narrowed:
        visible = on_node = 1  # the affinity (a SLURM step, taskset) made the split already
    job_cores = max(1, cores * visible // on_node)
    threads = torch_threads(job_cores, local_ranks, data_threads, setting)
    torch.set_num_threads(threads)
    share = f" x {visible}/{on_node} of the node's GPUs" if on_node > visible else ""
    why = (
        "training.torch_threads"
        if setting > 0
        else (
            f"{cores} cores{share} / {local_ranks} rank(s) on this node - {data_threads} "
            "data.num_threads"
        )
    )
    return f"torch intra-op threads: {threads} ({why})"


def all_reduce_max_(value: torch.Tensor, ctx: DistContext) -> None:
    """Replace `value` (on the rank's device) by its maximum over ranks, in place."""
    if ctx.enabled:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The sum over ranks of `values`, which must live on the rank's device."""
    if values.device != ctx.device:
        raise ValueError(
            f"all_reduce_sum: a tensor on {values.device}, the rank's device is {ctx.device}"
        )
    if ctx.enabled:
        values = values.clone()
        dist.all_reduce(values)
    return values


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when `flag` is true on any (a host sync)."""
    if not ctx.enabled:
        return flag
    value = torch.tensor([float(flag)], device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def same_on_every_rank(value: int, ctx: DistContext) -> bool:
    """True on every rank when `value` (a 63-bit int) is the same on all of them."""
    if not ctx.enabled:
        return True
    both = torch.tensor([value, -value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, negated_low = both.tolist()
    return high == -negated_low


def _from_rank0(value: int | None, draw, ctx: DistContext) -> int:
    """`value`, or the int `draw()` gives on rank 0, the same on every rank."""
    if value is not None:
        return value
    drawn = torch.tensor([draw() if ctx.is_main else 0], dtype=torch.int64, device=ctx.device)
    if ctx.enabled:
        dist.broadcast(drawn, src=0)
    return int(drawn.item())


def agree_on_seed(seed: int | None, ctx: DistContext) -> int:
    """The run's seed: `seed`, or one rank 0 draws from os.urandom, the same on every rank."""
    return _from_rank0(seed, draw_seed, ctx)


def agree_on_run_id(run_id: str | None, ctx: DistContext) -> str:
    """The run's id: `run_id` (a resumed run's), or 12 hex digits rank 0 draws from
    os.urandom, the same on every rank."""
    if run_id is not None:
        return run_id
    return f"{_from_rank0(None, lambda: int.from_bytes(os.urandom(6), 'little'), ctx):012x}"


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier(device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
