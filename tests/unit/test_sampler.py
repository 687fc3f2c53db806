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
        s.set_epoch(epoch)
        per_rank.append(list(s))
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


def test_set_epoch_moves_only_to_another_epoch():
    s = BucketingSampler(_durations(50), 5, 1, 0, 1, 0)
    s.set_epoch(2)
    first = list(s)
    assert len(first) == 10 and list(s) == []
    s.set_epoch(2)  # the epoch it is in: the position stays (exhausted)
    assert list(s) == []
    s.set_epoch(3)
    third = list(s)
    assert len(third) == 10 and third != first
    assert [b.tolist() for b in s.rank_batches(2)] == first


def test_state_dict_for_a_prefetching_consumer():
    durations = _durations(60)
    s = BucketingSampler(durations, 6, 1, 0, 1, 2)
    s.set_epoch(1)
    full = list(s)
    s = BucketingSampler(durations, 6, 1, 0, 1, 2)
    s.set_epoch(1)
    it = iter(s)
    for _ in range(5):  # a loader prefetched 5 batches; training finished 3
        next(it)
    state = s.state_dict(batches_done=3)
    assert state["batches_done"] == 3
    resumed = BucketingSampler(durations, 6, 1, 0, 1, 2)
    resumed.load_state_dict(state)
    assert list(resumed) == full[3:]
    with pytest.raises(ValueError, match="batches_done 6 is not in"):
        s.state_dict(batches_done=6)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_at_every_batch(world):
    durations = _durations(90)
    for rank in range(world):
        ref = BucketingSampler(durations, 6, 3, rank, world, seed=11)
        ref.set_epoch(3)
        full = list(ref)
        ref.set_epoch(4)
        next_epoch = list(ref)
        for k in range(len(full) + 1):
            s = BucketingSampler(durations, 6, 3, rank, world, seed=11)
            s.set_epoch(3)
            it = iter(s)
            head = [next(it) for _ in range(k)]
            state = s.state_dict()
            assert state["batches_done"] == k and state["epoch"] == 3
            resumed = BucketingSampler(durations, 6, 3, rank, world, seed=11)
            resumed.load_state_dict(state)
            resumed.set_epoch(3)  # the training loop and the loader announce the epoch
            resumed.set_epoch(3)
            assert head + list(resumed) == full
            # the following epoch is unaffected by the resume
            resumed.set_epoch(4)
            assert list(resumed) == next_epoch


def test_resume_on_different_world_size_continues_the_global_sequence():
    durations = _durations(120)
    one = BucketingSampler(durations, 8, 1, 0, 1, seed=5)
    one.set_epoch(1)
    full = list(one)
    one = BucketingSampler(durations, 8, 1, 0, 1, seed=5)
    one.set_epoch(1)
    it = iter(one)
    for _ in range(4):
        next(it)
    state = one.state_dict()
    rest = []
    for rank in range(2):
        s = BucketingSampler(durations, 8, 1, rank, 2, seed=5)
        s.load_state_dict(state)
        rest.append(list(s))
    assert [sorted(a + b) for a, b in zip(*rest)] == [sorted(g) for g in full[4:]]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_get_shares_of_equal_lengths(world):
    """Each global batch is dealt longest first in snake order: rank r holds the r-th longest
    utterance, and the ranks' total durations stay within one utterance of each other."""
    durations = np.asarray(_durations(4000))
    gbs = 48 * world
    samplers = [BucketingSampler(durations, gbs, 1, r, world, seed=3) for r in range(world)]
    for s in samplers:
        s.set_epoch(2)
    reference = BucketingSampler(durations, gbs, 1, 0, 1, seed=3)
    reference.set_epoch(2)
    for shares, whole in zip(zip(*samplers), reference):
        assert sorted(sum(shares, [])) == sorted(whole)  # the same global batch
        longest = sorted(durations[whole], reverse=True)
        for rank, share in enumerate(shares):
            assert durations[share[0]] == longest[rank] == max(durations[share])
            assert list(durations[share]) == sorted(durations[share], reverse=True)
        totals = [durations[share].sum() for share in shares]
        assert max(totals) - min(totals) <= max(longest)


def test_state_dict_roundtrips_through_weights_only_load(tmp_path):
    s = BucketingSampler(_durations(40), 4, 2, 0, 1, 1)
    s.set_epoch(2)
    next(iter(s))
    torch.save(s.state_dict(), tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == s.state_dict()


def test_load_rejects_other_dataset_or_batching():
    durations = _durations(40)
    state = BucketingSampler(durations, 4, 1, 0, 1, 1).state_dict()
    other = durations[:-1] + [durations[-1] + 0.01]
    with pytest.raises(ValueError, match="durations_sha256"):
        BucketingSampler(other, 4, 1, 0, 1, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="num_utterances"):
        BucketingSampler(durations[:-1], 4, 1, 0, 1, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size"):
        BucketingSampler(durations, 8, 1, 0, 1, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="batches_done"):
        BucketingSampler(durations, 4, 1, 0, 1, 1).load_state_dict({**state, "batches_done": 11})
    with pytest.raises(SamplerStateError, match="lacks keys"):  # a user error: one line
        BucketingSampler(durations, 4, 1, 0, 1, 1).load_state_dict({"epoch": 1})


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
    shards = [list(SequentialBatches(durations, bs, r, world)) for r in range(world)]
    flat = [i for shard in shards for b in shard for i in b]
    assert sorted(flat) == list(range(n))
    for shard in shards:
        assert all(len(b) == bs for b in shard[:-1])
        assert all(1 <= len(b) <= bs for b in shard)
        order = [i for b in shard for i in b]
        assert [durations[i] for i in order] == sorted((durations[i] for i in order), reverse=True)
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
