"""Training batch sampler (bucketing, rank dealing, exact resume) and evaluation batches.

Training epoch, as in docs/SPEC.md "Sampler", for N utterances, global batch G, k buckets and
W ranks:

1. Buckets: the utterance indices sorted by duration (stable, so ties keep manifest order);
   bucket b holds sorted positions [b*N//k, (b+1)*N//k). Buckets are fixed for the run.
2. Each epoch shuffles every bucket and drops each bucket's remainder (size mod G): the tail
   of its shuffle, so a random subset. Every global batch is therefore cut from ONE bucket
   (bucket purity) and the epoch is a multiple of G. With k = 1 (the published runs) this is
   plain random batching that drops N mod G utterances; with k > 1 it drops fewer than k*G.
3. The global batches of all buckets are shuffled together (batch order).
4. Global batch j is dealt to the ranks by length: its utterances sorted longest first are
   dealt in snake order (rank 0, 1, ..., W-1, W-1, ..., 0, 0, 1, ...), so every rank gets G/W
   utterances of about the same lengths. A step waits for its slowest rank; dealt in blocks of
   random positions, one rank's longest utterance sets everybody's step time. The global batch,
   and so the averaged gradient, is the same either way. A rank's share is ordered longest
   first.

The order is a pure function of (seed, epoch): one numpy PCG64 generator seeded with
SeedSequence([seed, epoch]) per epoch, no global RNG state. That makes resuming cheap: the
position is (epoch, batches done), kept by the loader, and the plan is recomputed. The
position counts global batches, so a run may resume on a different number of ranks as long as
G is unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from rnnt.config import ConfigError
from rnnt.errors import UserError


class SamplerStateError(UserError, ValueError):
    """A saved sampler position that does not fit this sampler (another training set or
    batching than the checkpoint's)."""


def durations_fingerprint(durations: np.ndarray) -> str:
    """SHA-256 of the float64 durations: detects resuming against a different dataset."""
    return hashlib.sha256(np.ascontiguousarray(durations, dtype=np.float64).tobytes()).hexdigest()


def _as_durations(durations: Sequence[float]) -> np.ndarray:
    arr = np.asarray(durations, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"durations must be a non-empty 1-D sequence, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        raise ValueError(
            f"durations[{bad[0]}] = {arr[bad[0]]!r}: durations must be finite and >= 0"
        )
    return arr


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")


class BucketingSampler:
    """This rank's share (G/W dataset indices) of each global batch of an epoch.

    A plan, not a cursor: `batches(epoch, start)` recomputes the epoch's order, so the position
    belongs to whoever consumes the batches (rnnt.data.loader.TrainLoader counts what it has
    handed to the training loop). `identity()` names what a saved position only fits: the
    training set, the batching and the seed.
    """

    def __init__(
        self,
        durations: Sequence[float],
        global_batch_size: int,
        num_buckets: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        self.durations = _as_durations(durations)
        n = self.durations.size
        _check_rank(rank, world_size)
        if global_batch_size < 1 or global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of "
                f"world_size {world_size}"
            )
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy SeedSequence), got {seed}")
        order = np.argsort(self.durations, kind="stable")
        self.buckets = [
            order[b * n // num_buckets : (b + 1) * n // num_buckets] for b in range(num_buckets)
        ]
        smallest = min(len(b) for b in self.buckets)
        if smallest < global_batch_size:
            # the training set's size decides it, so train.py names the keys (one line, not a
            # traceback)
            hint = ": use fewer buckets" if num_buckets > 1 else ""
            raise ConfigError(
                f"data.num_buckets {num_buckets}: {n} utterances leave a bucket of {smallest}, "
                f"fewer than one global batch of {global_batch_size} (training.batch_size x "
                f"grad_accumulation x ranks){hint}"
            )
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // world_size
        self.num_buckets = num_buckets
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.fingerprint = durations_fingerprint(self.durations)
        self.num_batches = sum(len(b) // global_batch_size for b in self.buckets)
        self._plan_key: tuple[int, int] | None = None
        self._plan = np.empty((0, global_batch_size), dtype=np.int64)

    def __len__(self) -> int:
        """Global batches (= this rank's batches) per epoch."""
        return self.num_batches

    @property
    def samples_per_epoch(self) -> int:
        return self.num_batches * self.global_batch_size

    def global_batches(self, epoch: int) -> np.ndarray:
        """(num_batches, G) int64: every global batch of `epoch`, in order."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._plan_key == (self.seed, epoch):
            return self._plan
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        g = self.global_batch_size
        per_bucket = []
        for bucket in self.buckets:
            keep = len(bucket) // g * g
            per_bucket.append(rng.permutation(bucket)[:keep].reshape(-1, g))
        plan = np.concatenate(per_bucket)
        plan = plan[rng.permutation(len(plan))]
        self._plan_key, self._plan = (self.seed, epoch), plan
        return plan

    def rank_batches(self, epoch: int) -> np.ndarray:
        """(num_batches, G/W) int64: this rank's share of every global batch of `epoch`."""
        plan = self.global_batches(epoch)
        # longest first; ties keep their shuffled order
        by_length = np.argsort(-self.durations[plan], axis=1, kind="stable")
        ordered = np.take_along_axis(plan, by_length, axis=1)
        return ordered[:, self._snake_positions]

    @property
    def _snake_positions(self) -> np.ndarray:
        """Positions of this rank in a global batch sorted longest first, dealt in snake order."""
        w, rounds = self.world_size, self.local_batch_size
        forward = np.arange(rounds) % 2 == 0
        seat = np.where(forward, self.rank, w - 1 - self.rank)
        return np.arange(rounds) * w + seat

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This rank's batches of `epoch` from its `start`-th on."""
        if not 0 <= start <= self.num_batches:
            raise ValueError(f"start {start} is not in [0, {self.num_batches}]")
        for row in self.rank_batches(epoch)[start:]:
            yield row.tolist()

    def identity(self) -> dict:
        """What a saved position fits: plain ints and strings (torch.load(weights_only=True))."""
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_buckets": self.num_buckets,
            "num_utterances": int(self.durations.size),
            "durations_sha256": self.fingerprint,
        }

    def adopt(self, state: dict) -> None:
        """Take the order of a saved position (its seed), after checking that it was saved
        with this training set and batching."""
        expected = self.identity()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise SamplerStateError(f"sampler state lacks keys {missing}")
        for key in ("num_utterances", "durations_sha256", "global_batch_size", "num_buckets"):
            if state[key] != expected[key]:
                raise SamplerStateError(
                    f"sampler state was saved with {key} = {state[key]!r} but this sampler has "
                    f"{expected[key]!r}: the training set or batching changed since the checkpoint"
                )
        if state["seed"] < 0:
            raise SamplerStateError(f"sampler state has a negative seed: {state['seed']}")
        self.seed = int(state["seed"])


class SequentialBatches:
    """Evaluation batches: every utterance exactly once, no shuffling, no dropping.

    Utterances are sorted by duration, longest first (least padding, and the largest batch
    comes first so an out-of-memory shows at once), then dealt round-robin to the ranks so
    each rank gets a similar amount of audio; each rank cuts its share into batches of
    `batch_size`, the last one partial. Ranks may differ by one batch.
    """

    def __init__(
        self,
        durations: Sequence[float],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        durations = _as_durations(durations)
        _check_rank(rank, world_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = np.argsort(-durations, kind="stable")[rank::world_size]
        self.plan = [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]

    def __len__(self) -> int:
        return len(self.plan)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[list[int]]:
        """The batches from the `start`-th on; the same in every epoch."""
        return iter(self.plan[start:])
