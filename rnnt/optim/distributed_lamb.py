"""LAMB with sharded fp32 state and gradient communication overlapped with the backward.

The design of apex's `DistributedFusedLAMB`, which NVIDIA's MLPerf RNN-T runs use, for an
unwrapped model (no DistributedDataParallel):

- Gradients live in one flat buffer in the model's dtype, cut into buckets in the order the
  backward finishes them: the joint, then the prediction network, then the encoder. Every
  parameter's `.grad` is a view of it, so autograd accumulates into the buckets directly. Each
  bucket is padded to a multiple of `world_size * ALIGN` elements.
- When the last gradient of a bucket has been accumulated (a post-accumulate-grad hook counts
  them), the bucket is reduce-scattered asynchronously: NCCL runs it on its own stream while the
  backward goes on, and the step waits for it only in `step()`. A CUDA-graphed network finishes
  all of its gradients in one replay, so its bucket goes out right after that replay.
- Rank r keeps the fp32 master weights and both moments of its shard only: slice r of every
  bucket, concatenated (optimizer memory / world size). The elementwise maths is
  `rnnt.optim.lamb.moments_and_update`, the same as the one-process `Lamb`.
- The norms cross shard boundaries, so each rank sums squares over its pieces of every
  parameter, and all-reduces the partial sums. Clipping needs the global gradient norm before
  the moments move, and the update norms exist only after, so there are two small all-reduces:
  [squared gradient norm, found-inf, squared weight norm per parameter], then [squared update
  norm per parameter].
- The updated shard is cast to the model's dtype and all-gathered, bucket by bucket, into a
  flat copy of the weights, then copied into the parameters (which stay separate tensors, so
  cuDNN keeps its own weight layout and CUDA graphs keep their addresses).
- Loss scaling: found-inf covers this rank's shard and its loss, and the all-reduce makes every
  rank skip the same steps. A skipped step leaves weights, moments and the step count as they
  were, bit for bit.

With one process there is no communication: the shard is the whole flat buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rnnt.distributed import DistContext
from rnnt.optim.lamb import (
    moments_and_update,
    resolve_update,
    unscale_and_clip,
    update_function,
)

ALIGN = 64  # elements: every rank's chunk of a bucket starts 128-byte aligned in fp16


class FlatLayout:
    """Where every parameter lives in the flat buffers, and which part of them a rank owns.

    buckets: groups of parameters, in the order their gradients become final. The flat buffer
    is bucket 0, then bucket 1, ..., each padded to a multiple of world_size * ALIGN; a rank's
    shard is its 1/world_size chunk of every bucket, concatenated.
    """

    def __init__(self, buckets: Sequence[Sequence[torch.Tensor]], world_size: int) -> None:
        if not buckets or any(len(b) == 0 for b in buckets):
            raise ValueError("FlatLayout: every bucket needs at least one parameter")
        self.world_size = world_size
        self.params = [p for bucket in buckets for p in bucket]
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.bucket_of = [b for b, bucket in enumerate(buckets) for _ in bucket]
        self.bucket_sizes = [sum(p.numel() for p in bucket) for bucket in buckets]
        unit = ALIGN * world_size
        self.bucket_padded = [-(-n // unit) * unit for n in self.bucket_sizes]
        self.bucket_starts = [sum(self.bucket_padded[:b]) for b in range(len(buckets))]
        self.numel = sum(self.bucket_padded)
        self.chunks = [n // world_size for n in self.bucket_padded]
        self.shard_starts = [sum(self.chunks[:b]) for b in range(len(buckets))]
        self.shard_numel = sum(self.chunks)
        self.offsets = []
        for b, bucket in enumerate(buckets):
            offset = self.bucket_starts[b]
            for p in bucket:
                self.offsets.append(offset)
                offset += p.numel()

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (in their shapes) of a full (numel,) buffer."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def rank_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """(start, length) in the full buffer of `rank`'s chunk of `bucket`."""
        return self.bucket_starts[bucket] + rank * self.chunks[bucket], self.chunks[bucket]

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of `rank`'s shard of a full (numel,) buffer."""
        parts = []
        for b in range(self.num_buckets):
            start, length = self.rank_range(b, rank)
            parts.append(full[start : start + length])
        return torch.cat(parts)

    def pieces(self, rank: int) -> tuple[list[int], list[int]]:
        """The shard of `rank` cut where parameters start and end: (sizes, owners), owners[i]
        being the parameter index of piece i, or -1 for padding."""
        sizes: list[int] = []
        owners: list[int] = []
        for b in range(self.num_buckets):
            lo, length = self.rank_range(b, rank)
            hi = lo + length
            pos = lo
            for i, (offset, n) in enumerate(zip(self.offsets, self.sizes)):
                if self.bucket_of[i] != b:
                    continue
                start, end = max(offset, lo), min(offset + n, hi)
                if start >= end:
                    continue
                if start > pos:
                    sizes.append(start - pos)
                    owners.append(-1)
                sizes.append(end - start)
                owners.append(i)
                pos = end
            if pos < hi:
                sizes.append(hi - pos)
                owners.append(-1)
        return sizes, owners

    def describe(self) -> dict:
        """What a checkpointed shard needs to be cut anew for another world size."""
        return {
            "world_size": self.world_size,
            "align": ALIGN,
            "bucket_sizes": list(self.bucket_sizes),
            "sizes": list(self.sizes),
        }


def reshard(shards: list[torch.Tensor], saved: dict, layout: FlatLayout, rank: int) -> torch.Tensor:
    """This rank's shard under `layout`, from every rank's shard of a run with `saved`
    (`FlatLayout.describe()`) as its layout: possibly another world size."""
    if saved["sizes"] != layout.sizes or saved["bucket_sizes"] != layout.bucket_sizes:
        raise ValueError(
            "the checkpoint's optimizer state belongs to other parameters (sizes "
            f"{saved['bucket_sizes']} per bucket, here {layout.bucket_sizes})"
        )
    old_world = saved["world_size"]
    if len(shards) != old_world:
        raise ValueError(f"{len(shards)} optimizer shards for a world size of {old_world}")
    unit = saved["align"] * old_world
    old_padded = [-(-n // unit) * unit for n in saved["bucket_sizes"]]
    old_chunks = [n // old_world for n in old_padded]
    full = torch.zeros(layout.numel, dtype=shards[0].dtype, device=shards[0].device)
    shard_start = 0
    for b, n in enumerate(saved["bucket_sizes"]):
        chunk = old_chunks[b]
        bucket = torch.cat([s[shard_start : shard_start + chunk] for s in shards])[:n]
        full[layout.bucket_starts[b] : layout.bucket_starts[b] + n] = bucket
        shard_start += chunk
    return layout.shard_of(full, rank)


class DistributedLamb:
    """Sharded LAMB for one model (see the module docstring).

    Use: build it on the fp32 weights (they become the masters), cast the model, call
    `bind_grads()`; each step `arm()` before the backward that ends gradient accumulation, then
    `found_inf = step(lr, grad_scale, loss)`.
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[torch.nn.Parameter]],
        ctx: DistContext,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-9,
        weight_decay: float = 1e-3,
        max_grad_norm: float = 1.0,
        overlap: bool = True,
        fused: bool | None = None,
    ) -> None:
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"DistributedLamb: betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0 or max_grad_norm < 0:
            raise ValueError("DistributedLamb: eps, weight_decay and max_grad_norm must be >= 0")
        self.ctx = ctx
        self.world_size, self.rank = ctx.world_size, ctx.rank
        self.layout = FlatLayout(buckets, ctx.world_size)
        self.params = self.layout.params
        self.betas = (float(b1), float(b2))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.max_grad_norm = float(max_grad_norm)
        self.overlap = overlap
        device = ctx.device
        if any(p.device != device for p in self.params):
            raise ValueError(f"DistributedLamb: every parameter must be on {device}")
        with torch.no_grad():
            full = torch.zeros(self.layout.numel, dtype=torch.float32, device=device)
            torch._foreach_copy_(self.layout.views(full), [p.detach() for p in self.params])
            self.master = self.layout.shard_of(full, self.rank)
        del full
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self._g32 = torch.empty_like(self.master)
        self._steps = torch.zeros((), dtype=torch.float32, device=device)
        sizes, owners = self.layout.pieces(self.rank)
        self._piece_sizes = sizes
        n_params = len(self.params)
        # padding pieces are counted in an extra slot that nobody reads
        self._owners = torch.tensor(
            [o if o >= 0 else n_params for o in owners], dtype=torch.int64, device=device
        )
        self.backend = resolve_update(device, fused)  # (choice, reason)
        self._fused_update = update_function(self.backend[0])
        self.grad_flat: torch.Tensor | None = None
        self._grad_shard: torch.Tensor | None = None
        self._weights_flat: torch.Tensor | None = None
        self._works: list = [None] * self.layout.num_buckets
        self._left: list[int] = []
        self._armed = False
        # CUDA events around the waits for communication (bench/train_step.py sets it)
        self.parts = None

    # ------------------------------------------------------------------------------ setup
    def bind_grads(self) -> None:
        """Give every parameter a `.grad` that is a view of the flat gradient buffer, in the
        parameters' dtype; call after the model has its training dtype and before graphs are
        captured (a later `.to()` would replace the views)."""
        dtype = self.params[0].dtype
        if any(p.dtype != dtype for p in self.params):
            raise ValueError("DistributedLamb: every parameter must have one dtype")
        device = self.ctx.device
        self.grad_flat = torch.zeros(self.layout.numel, dtype=dtype, device=device)
        for p, view in zip(self.params, self.layout.views(self.grad_flat)):
            p.grad = view
        if self.world_size > 1:
            self._grad_shard = torch.empty(self.layout.shard_numel, dtype=dtype, device=device)
            self._weights_flat = torch.empty(self.layout.numel, dtype=dtype, device=device)
        bucket_of = {id(p): b for p, b in zip(self.params, self.layout.bucket_of)}

        def on_grad(param: torch.Tensor) -> None:
            if not self._armed:
                return
            b = bucket_of[id(param)]
            self._left[b] -= 1
            if self._left[b] == 0 and self.overlap:
                self._reduce(b)

        for p in self.params:
            p.register_post_accumulate_grad_hook(on_grad)

    def arm(self) -> None:
        """The next backward finishes this step's gradients: reduce each bucket once all its
        gradients have been accumulated (earlier micro-batches only accumulate)."""
        self._left = [0] * self.layout.num_buckets
        for b in self.layout.bucket_of:
            self._left[b] += 1
        self._armed = True

    # ------------------------------------------------------------------------------ communication
    def _reduce(self, bucket: int) -> None:
        """Start the reduce-scatter of one bucket (sums: the loss was divided by world size)."""
        if self.world_size == 1 or self._works[bucket] is not None:
            return
        start, padded = self.layout.bucket_starts[bucket], self.layout.bucket_padded[bucket]
        out_start = self.layout.shard_starts[bucket]
        out = self._grad_shard[out_start : out_start + self.layout.chunks[bucket]]
        self._works[bucket] = dist.reduce_scatter_tensor(
            out, self.grad_flat[start : start + padded], async_op=True
        )

    def _finish_reductions(self) -> torch.Tensor:
        """This rank's shard of the summed gradients (the current stream waits for NCCL)."""
        self._armed = False
        if self.world_size == 1:
            return self.grad_flat
        for b in range(self.layout.num_buckets):
            self._reduce(b)  # buckets a hook did not start (overlap off, unused parameters)
        for b, work in enumerate(self._works):
            work.wait()
            self._works[b] = None
        return self._grad_shard

    def _all_reduce(self, values: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(values)

    def gather(self, shard: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full (numel,) buffer whose rank shards are `shard` on each rank (collective)."""
        dtype = dtype or shard.dtype
        if self.world_size == 1:
            return shard.to(dtype)
        full = torch.empty(self.layout.numel, dtype=dtype, device=shard.device)
        self._place_and_gather(shard, full)
        return full

    def _place_and_gather(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        for b in range(self.layout.num_buckets):
            start, length = self.layout.rank_range(b, self.rank)
            mine = full[start : start + length]
            s0 = self.layout.shard_starts[b]
            mine.copy_(shard[s0 : s0 + length])
            first = self.layout.bucket_starts[b]
            dist.all_gather_into_tensor(full[first : first + self.layout.bucket_padded[b]], mine)

    # ------------------------------------------------------------------------------ stepping
    def _squared_norms(self, flat: torch.Tensor) -> torch.Tensor:
        """(n_params + 1,) sums of squares of `flat`'s pieces per parameter (last: padding)."""
        norms = torch.stack(torch._foreach_norm(flat.split(self._piece_sizes)))
        out = torch.zeros(len(self.params) + 1, dtype=torch.float32, device=flat.device)
        return out.index_add_(0, self._owners, norms.square())

    @torch.no_grad()
    def warm_up(self) -> None:
        """Run the elementwise update once on stand-in buffers, so that its Triton kernel
        compiles now (before the run's clock starts) rather than at the first step. The
        buffers' length has the shard's divisibility by 16, which is all Triton specializes
        the kernel's length on; the optimizer's own state is not touched."""
        if self._fused_update is None:
            return
        n = 16 * 64 + self._g32.numel() % 16
        g, m, v, w = (torch.zeros(n, device=self._g32.device) for _ in range(4))
        one = torch.ones((), device=g.device)
        moments_and_update(
            g,
            m,
            v,
            w,
            one,
            one == 0,
            one,
            one,
            self.betas,
            self.eps,
            self.weight_decay,
            self._fused_update,
        )

    @torch.no_grad()
    def step(self, lr: float, grad_scale: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
        """One LAMB step from the accumulated gradients; returns found-inf (a float32 device
        scalar, 1.0 when the loss or a gradient was inf or NaN on any rank: nothing changed)."""
        if self.grad_flat is None:
            raise RuntimeError("DistributedLamb.step before bind_grads()")
        n_params = len(self.params)
        g = self._g32
        if self.parts is not None:
            self.parts.mark("reduce_wait")
        g.copy_(self._finish_reductions())
        if self.parts is not None:
            self.parts.mark("reduced")
        found = (~torch.isfinite(loss)).to(torch.float32).reshape(1)
        torch._amp_foreach_non_finite_check_and_unscale_(
            [g], found, torch.ones((), device=g.device)
        )
        stats = torch.cat(
            [
                torch.linalg.vector_norm(g).square().reshape(1),
                found,
                self._squared_norms(self.master)[:n_params],
            ]
        )
        self._all_reduce(stats)
        found_inf = ((stats[1] > 0) | ~torch.isfinite(stats[0])).to(torch.float32)
        coef = unscale_and_clip(stats[0].sqrt(), grad_scale, self.max_grad_norm)
        skip = found_inf > 0
        keep = (~skip).to(torch.float32)
        self._steps.add_(keep)
        t = self._steps.clamp(min=1.0)  # a skipped first step must keep 1 - b^t away from 0
        update = moments_and_update(
            g,
            self.exp_avg,
            self.exp_avg_sq,
            self.master,
            coef,
            skip,
            keep,
            t,
            self.betas,
            self.eps,
            self.weight_decay,
            self._fused_update,
        )
        u_sq = self._squared_norms(update)
        self._all_reduce(u_sq)
        w_norm, u_norm = stats[2:].sqrt(), u_sq[:n_params].sqrt()
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
        scale = torch.cat([trust * (lr * keep), torch.zeros(1, device=g.device)])
        torch._foreach_mul_(update.split(self._piece_sizes), list(scale[self._owners].unbind()))
        self.master.sub_(update)
        if self.parts is not None:
            self.parts.mark("publish")
        self._publish()
        if self.parts is not None:
            self.parts.mark("published")
        self.grad_flat.zero_()
        return found_inf

    def _publish(self) -> None:
        """Write the updated masters into the model's parameters (all-gathered across ranks)."""
        if self.world_size == 1:
            torch._foreach_copy_(self.params, self.layout.views(self.master))
            return
        self._place_and_gather(self.master, self._weights_flat)
        torch._foreach_copy_(self.params, self.layout.views(self._weights_flat))

    @property
    def steps(self) -> torch.Tensor:
        """Applied (not skipped) steps, a 0-dim float32 device tensor."""
        return self._steps

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's shard: masters, moments, step count, and the layout that cut it."""
        return {
            "layout": self.layout.describe(),
            "rank": self.rank,
            "steps": self._steps,
            "master": self.master,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "hyperparameters": {
                "betas": list(self.betas),
                "eps": self.eps,
                "weight_decay": self.weight_decay,
                "max_grad_norm": self.max_grad_norm,
            },
        }

    @torch.no_grad()
    def load_state_dicts(self, states: list[dict]) -> None:
        """Restore from the shards of a checkpoint: this rank's own when the world size is the
        same, else every rank's, cut anew for this world size."""
        saved = states[0]["layout"]
        if saved["world_size"] == self.world_size and saved == self.layout.describe():
            (mine,) = [s for s in states if s["rank"] == self.rank] or [None]
            if mine is None:
                raise ValueError(f"no optimizer shard of rank {self.rank} in the checkpoint")
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(self, name).copy_(mine[name])
        else:
            ordered = sorted(states, key=lambda s: s["rank"])
            for name in ("master", "exp_avg", "exp_avg_sq"):
                shards = [s[name].to(self.master.device) for s in ordered]
                getattr(self, name).copy_(reshard(shards, saved, self.layout, self.rank))
        self._steps.copy_(states[0]["steps"])
        self._publish()
