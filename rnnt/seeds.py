"""The run's seed and everything derived from it, in one place.

A run has one seed: `training.seed`, or, when the config leaves it out (as MLPerf wants), one
drawn from the operating system's entropy by rank 0 and sent to every rank. It is logged, written
to the MLPerf log and stored in checkpoints. Every random stream of a rank (torch's default
generator for dropout, SpecAugment's generator, the data pipelines) is derived from it here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

SEED_BITS = 31  # MLPerf logs the seed as a plain int; numpy's SeedSequence wants >= 0


def draw_seed() -> int:
    """A fresh seed from os.urandom."""
    return int.from_bytes(os.urandom(4), "little") >> (32 - SEED_BITS)


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (numpy SeedSequence: independent streams per key)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


@dataclass(frozen=True)
class RankSeeds:
    """The seeds of one rank's random streams."""

    torch: int  # torch's default generators (dropout, weight init on rank 0)
    augment: int  # SpecAugment's device generator
    loader: int  # the data pipeline's private generators


def rank_seeds(seed: int, rank: int) -> RankSeeds:
    return RankSeeds(torch=seed + rank, augment=seed * 1000 + rank, loader=derive_seed(seed, rank))
