import numpy as np
import pytest
import torch

from rnnt.data.sampler import BucketingSampler, SamplerStateError, SequentialBatches


def _durations(n: int, seed: int = 0) -> list[float]:
    # distinct values, so the duration ranges of the buckets cannot overlap
    return np.random.default_rng(seed).uniform(1.0, 17.0, size=n).tolist()


def _epoch(durations, gbs, buckets, world, seed=7, epoch=1) -> list[list[list[int]]]:
    """For each global batch of the epoch, the list of the ranks' local batches."""
    per_rank = []
    for rank in range(world):
        s = BucketingSampler(durations, gbs, buckets, rank, world, seed)
        per_rank.append(list(s.batches(epoch)))
    return [list(locals_) for locals_ in zip(*per_rank, strict=True)]


def _bucket_of(durations, num_buckets) -> np.ndarray:
    """Bucket b = sorted positions [b*N//k, (b+1)*N//k) (the rule documented in the module)."""
    n = len(durations)
    rank_in_sorted = np.empty(n, dtype=np.int64)
    rank_in_sorted[np.argsort(durations)] = np.arange(n)
    return np.array(
        [
            next(b for b in range(num_buckets) if r < (b + 1) * n // num_buckets)
            for r in rank_in_sorted
        ]
    )


@pytest.mark.parametrize(
    "n,gbs,buckets,world",
    [(103, 8, 1, 1), (103, 8, 1, 4), (250, 12, 3, 2), (1000, 16, 6, 8), (64, 16, 4, 2)],
)
def test_epoch_invariants(n, gbs, buckets, world):
    durations = _durations(n)
    batches = _epoch(durations, gbs, buckets, world)
    flat = [i for gb in batches for local in gb for i in local]
    # at most once per epoch, all valid indices
    assert len(flat) == len(set(flat))
    assert all(0 <= i < n for i in flat)
    # a multiple of the global batch; each bucket drops less than one global batch
    assert len(flat) % gbs == 0
    bucket = _bucket_of(durations, buckets)
    for b in range(buckets):
        size = int((bucket == b).sum())
        used = sum(1 for i in flat if bucket[i] == b)
        assert used == size // gbs * gbs
    for gb in batches:
        # every rank gets an equal share; the shares are disjoint
        assert all(len(local) == gbs // world for local in gb)
        members = [i for local in gb for i in local]
        assert len(set(members)) == gbs
        # bucket purity
        assert len({bucket[i] for i in members}) == 1
    assert len(batches) == len(BucketingSampler(durations, gbs, buckets, 0, world, 7))


def test_single_bucket_is_random_batching():
    durations = _durations(4000)
    batches = _epoch(durations, 64, 1, 1)
    d = np.asarray(durations)
    # random batches span most of the duration range and their means do not follow the
    # batch order (a duration-sorted plan would give a strictly increasing sequence)
    spans = [d[gb[0]].max() - d[gb[0]].min() for gb in batches]
    assert min(spans) > 10.0
    means = [d[gb[0]].mean() for gb in batches]
    assert abs(np.corrcoef(means, np.arange(len(means)))[0, 1]) < 0.5


def test_buckets_group_similar_durations():
    durations = _durations(1200)
    d = np.asarray(durations)
    batches = _epoch(durations, 20, 10, 1)
    # 10 buckets over U(1, 17): each global batch lies within ~1/10 of the range
    assert max(d[gb[0]].max() - d[gb[0]].min() for gb in batches) < 2.5
    # ... and the batch order is shuffled across buckets
    first_buckets = [_bucket_of(durations, 10)[gb[0][0]] for gb in batches[:10]]
    assert first_buckets != sorted(first_buckets)


def test_determinism_and_epoch_dependence():
    durations = _durations(300)
    a = _epoch(durations, 10, 2, 2, seed=3, epoch=4)
    assert a == _epoch(durations, 10, 2, 2, seed=3, epoch=4)
    assert a != _epoch(durations, 10, 2, 2, seed=4, epoch=4)
    assert a != _epoch(durations, 10, 2, 2, seed=3, epoch=5)
    # the drop set changes with the epoch too
    used = [{i for gb in _epoch(durations, 16, 1, 1, epoch=e) for i in gb[0]} for e in (1, 2)]
    assert used[0] != used[1]


@pytest.mark.parametrize("world", [1, 2])
def test_an_epoch_continues_from_any_start(world):
    durations = _durations(90)
    for rank in range(world):
        s = BucketingSampler(durations, 6, 3, rank, world, seed=11)
        full = list(s.batches(3))
        assert full == [b.tolist() for b in s.rank_batches(3)] and len(full) == len(s)
        for k in range(len(full) + 1):
            fresh = BucketingSampler(durations, 6, 3, rank, world, seed=11)
            assert list(fresh.batches(3, start=k)) == full[k:]
        assert list(s.batches(4)) != full
    with pytest.raises(ValueError, match=r"start 16 is not in \[0, 15\]"):
        next(s.batches(3, start=16))


def test_a_start_on_another_world_size_continues_the_global_sequence():
    durations = _durations(120)
    full = list(BucketingSampler(durations, 8, 1, 0, 1, seed=5).batches(1))
    rest = [list(BucketingSampler(durations, 8, 1, r, 2, seed=5).batches(1, 4)) for r in (0, 1)]
    assert [sorted(a + b) for a, b in zip(*rest)] == [sorted(g) for g in full[4:]]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_get_shares_of_equal_lengths(world):
    """Each global batch is dealt longest first in snake order: rank r holds the r-th longest
    utterance, and the ranks' total durations stay within one utterance of each other."""
    durations = np.asarray(_durations(4000))
    gbs = 48 * world
    samplers = [BucketingSampler(durations, gbs, 1, r, world, seed=3) for r in range(world)]
    reference = BucketingSampler(durations, gbs, 1, 0, 1, seed=3)
    for shares, whole in zip(zip(*(s.batches(2) for s in samplers)), reference.batches(2)):
        assert sorted(sum(shares, [])) == sorted(whole)  # the same global batch
        longest = sorted(durations[whole], reverse=True)
        for rank, share in enumerate(shares):
            assert durations[share[0]] == longest[rank] == max(durations[share])
            assert list(durations[share]) == sorted(durations[share], reverse=True)
        totals = [durations[share].sum() for share in shares]
        assert max(totals) - min(totals) <= max(longest)


def test_identity_roundtrips_through_weights_only_load(tmp_path):
    s = BucketingSampler(_durations(40), 4, 2, 0, 1, 1)
    torch.save(s.identity(), tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == s.identity()


def test_a_saved_order_fits_only_its_dataset_and_batching():
    durations = _durations(40)
    state = BucketingSampler(durations, 4, 1, 0, 1, 1).identity()
    other = durations[:-1] + [durations[-1] + 0.01]
    with pytest.raises(ValueError, match="durations_sha256"):
        BucketingSampler(other, 4, 1, 0, 1, 1).adopt(state)
    with pytest.raises(ValueError, match="num_utterances"):
        BucketingSampler(durations[:-1], 4, 1, 0, 1, 1).adopt(state)
    with pytest.raises(ValueError, match="global_batch_size"):
        BucketingSampler(durations, 8, 1, 0, 1, 1).adopt(state)
    with pytest.raises(SamplerStateError, match="lacks keys"):  # a user error: one line
        BucketingSampler(durations, 4, 1, 0, 1, 1).adopt({"epoch": 1})
    # the saved seed orders the epochs: a resume keeps the run's order
    adopted = BucketingSampler(durations, 4, 1, 0, 1, seed=9)
    adopted.adopt(state)
    assert list(adopted.batches(2)) == list(BucketingSampler(durations, 4, 1, 0, 1, 1).batches(2))


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(global_batch_size=6, world_size=4), "multiple of world_size"),
        (dict(rank=2, world_size=2), "rank 2"),
        (dict(num_buckets=0), "num_buckets"),
        (dict(num_buckets=6), "use fewer buckets"),
        (dict(durations=[1.0, float("nan")] * 20), r"durations\[1\]"),
        (dict(durations=[]), "non-empty"),
    ],
)
def test_bad_arguments(args, match):
    kwargs = dict(
        durations=_durations(40), global_batch_size=8, num_buckets=1, rank=0, world_size=1, seed=0
    )
    kwargs.update(args)
    with pytest.raises(ValueError, match=match):
        BucketingSampler(**kwargs)


@pytest.mark.parametrize("n,bs,world", [(1, 4, 1), (23, 5, 1), (23, 5, 3), (40, 8, 4), (3, 2, 4)])
def test_sequential_batches(n, bs, world):
    durations = _durations(n, seed=1)
    shards = [list(SequentialBatches(durations, bs, r, world).batches()) for r in range(world)]
    flat = [i for shard in shards for b in shard for i in b]
    assert sorted(flat) == list(range(n))
    for shard in shards:
        assert all(len(b) == bs for b in shard[:-1])
        assert all(1 <= len(b) <= bs for b in shard)
        order = [i for b in shard for i in b]
        assert [durations[i] for i in order] == sorted((durations[i] for i in order), reverse=True)
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
