import numpy as np
import pytest
import torch

from rnnt.config import FeaturesConfig, SpecAugmentConfig
from rnnt.data.synthetic import (
    LengthsTableError,
    SyntheticFeatureSource,
    read_lengths_table,
    tokenizer_for_lengths_table,
)
from rnnt.data.tokenizer import Tokenizer, train_tokenizer

TRAIN_TSV = "librispeech_train-clean-5_lengths.tsv"
DEV_TSV = "librispeech_dev-clean_lengths.tsv"
WORDS = "the quick brown fox jumps over a lazy dog while zebras quietly vex jack's sphinx".split()


def _features(n_mels: int) -> FeaturesConfig:
    """A few mel bins keep the noise small (the shapes are what is tested); no frequency masks
    fit in them."""
    return FeaturesConfig(n_mels=n_mels, spec_augment=SpecAugmentConfig(freq_masks=0))


def _write_tsv(path, rows, header="# utterance_id\tduration_s\ttranscript"):
    path.write_text(header + "\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))
    return path


def _small_table(tmp_path, n=10):
    rng = np.random.default_rng(0)
    rows = [
        (
            f"1-2-{i:04d}",
            round(float(rng.uniform(1, 20)), 3),
            " ".join(rng.choice(WORDS, 6)).upper(),
        )
        for i in range(n)
    ]
    return _write_tsv(tmp_path / "small.tsv", rows), rows


@pytest.fixture
def small_tokenizer(tmp_path):
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    return Tokenizer(train_tokenizer(texts, tmp_path / "tok", 40))


@pytest.fixture
def real_tokenizer(lengths_dir, tmp_path_factory):
    # one training per test session: later calls find the cached model
    cache = tmp_path_factory.getbasetemp() / "synthetic_tokenizer"
    return tokenizer_for_lengths_table(lengths_dir / TRAIN_TSV, 1023, cache)


def test_read_table_skips_comments_and_normalizes(tmp_path):
    path = _write_tsv(
        tmp_path / "t.tsv", [("a-1", "1.5", "HELLO  WORLD"), ("a-2", "0.25", "IT'S ME")]
    )
    path.write_text(path.read_text() + "\n# trailing comment\n")
    table = read_lengths_table(path)
    assert table.utt_ids == ["a-1", "a-2"]
    assert table.durations.tolist() == [1.5, 0.25]
    assert table.transcripts == ["hello world", "it's me"]


@pytest.mark.parametrize(
    "row,match",
    [
        (("a-9", "1.0"), "t.tsv:3: expected 3 tab-separated fields"),
        (("a-9", "1,5", "HI"), "t.tsv:3: duration '1,5' is not a number"),
        (("a-9", "-2", "HI"), "t.tsv:3: duration -2 must be > 0"),
        (("a-1", "2", "HI"), "t.tsv:3: utterance a-1 already appears on line 2"),
        (("a-9", "2", "  "), "t.tsv:3: utterance a-9 has an empty transcript"),
        (("a-9", "2", "NO. 5"), r"t.tsv:3: transcript of a-9 has characters .*'\.5'"),
    ],
)
def test_read_table_errors_name_file_and_line(tmp_path, row, match):
    path = _write_tsv(tmp_path / "t.tsv", [("a-1", "1.0", "FINE"), row])
    with pytest.raises(LengthsTableError, match=match):
        read_lengths_table(path)


def test_read_table_empty_or_missing(tmp_path):
    with pytest.raises(LengthsTableError, match="no utterances"):
        read_lengths_table(_write_tsv(tmp_path / "e.tsv", []))
    with pytest.raises(LengthsTableError, match="not found"):
        read_lengths_table(tmp_path / "missing.tsv")


def test_real_tables_have_the_documented_statistics(lengths_dir):
    train = read_lengths_table(lengths_dir / TRAIN_TSV)
    dev = read_lengths_table(lengths_dir / DEV_TSV)
    assert len(train) == 1519 and len(dev) == 2703
    assert train.durations.mean() == pytest.approx(12.6, abs=0.05)
    assert (train.durations <= 16.7).mean() == pytest.approx(0.994, abs=0.001)
    assert dev.durations.max() == pytest.approx(32.7, abs=0.1)


def test_tokenizer_for_table_is_cached_and_covers_dev(lengths_dir, real_tokenizer, tmp_path):
    assert real_tokenizer.vocab_size == 1023
    again = tokenizer_for_lengths_table(lengths_dir / TRAIN_TSV, 1023, real_tokenizer.path.parent)
    assert again.path == real_tokenizer.path
    assert [p.name for p in real_tokenizer.path.parent.iterdir()] == [real_tokenizer.path.name]
    # an edited table is a different cache entry
    edited = tmp_path / TRAIN_TSV
    edited.write_text((lengths_dir / TRAIN_TSV).read_text() + "x-1\t1.0\tONE MORE LINE\n")
    other = tokenizer_for_lengths_table(edited, 1023, real_tokenizer.path.parent)
    assert other.path != real_tokenizer.path
    other.path.unlink()
    # the training-set tokenizer encodes every dev-clean transcript (no <unk>)
    dev = read_lengths_table(lengths_dir / DEV_TSV)
    lens = [len(real_tokenizer.encode(t, u)) for t, u in zip(dev.transcripts, dev.utt_ids)]
    assert min(lens) >= 1


def _stft_frames(duration: float, speed: float = 1.0) -> int:
    """Outside oracle: frames torch.stft (centered, hop 160) gives for a clip of that length."""
    samples = round(round(duration * 16000) / speed)
    return torch.stft(
        torch.zeros(samples),
        512,
        hop_length=160,
        win_length=320,
        window=torch.hann_window(320),
        return_complex=True,
    ).shape[-1]


def test_train_batches_have_real_shapes(lengths_dir, real_tokenizer):
    table = read_lengths_table(lengths_dir / TRAIN_TSV)
    duration = dict(zip(table.utt_ids, table.durations.tolist()))
    source = SyntheticFeatureSource(
        lengths_dir / TRAIN_TSV,
        6,
        real_tokenizer,
        FeaturesConfig(),
        train=True,
        num_batches=3,
        seed=1,
    )
    assert len(source) == 3 and len(source.utt_ids) == 1510  # 9 longer than 16.7 s dropped
    batches = list(source)
    assert len(batches) == 3
    ratios = []
    for batch in batches:
        assert batch.feats.shape == (6, 80, int(batch.feat_lens.max()))
        assert batch.feats.dtype == torch.float32 and batch.feat_lens.dtype == torch.int64
        for u, utt in enumerate(batch.utt_ids):
            d, n = duration[utt], int(batch.feat_lens[u])
            assert d <= 16.7
            # speed perturbation within [0.85, 1.15]: frames between the two extremes
            assert _stft_frames(d, 1.15) <= n <= _stft_frames(d, 0.85)
            ratios.append(d * 100 / (n - 1))
            assert (batch.feats[u, :, n:] == 0).all()
            assert batch.feats[u, :, :n].std() == pytest.approx(1.0, abs=0.05)
            want = real_tokenizer.encode(batch.transcripts[u])
            assert batch.tokens[u, : len(want)].tolist() == want
            assert batch.token_lens[u] == len(want) and (batch.tokens[u, len(want) :] == 0).all()
            assert batch.transcripts[u] == table.transcripts[table.utt_ids.index(utt)]
    assert np.std(ratios) > 0.03  # the rates really vary


def test_eval_pass_covers_dev_clean_once_with_exact_frames(lengths_dir, real_tokenizer):
    table = read_lengths_table(lengths_dir / DEV_TSV)
    features = _features(1)
    source = SyntheticFeatureSource(
        lengths_dir / DEV_TSV, 512, real_tokenizer, features, train=False
    )
    seen = {}
    for batch in source:
        for utt, n in zip(batch.utt_ids, batch.feat_lens.tolist()):
            seen[utt] = n
    assert sorted(seen) == sorted(table.utt_ids)
    longest = table.utt_ids[int(table.durations.argmax())]
    assert seen[longest] == _stft_frames(32.645) == 3265
    for utt, d in list(zip(table.utt_ids, table.durations.tolist()))[::97]:
        assert seen[utt] == _stft_frames(d)


def test_determinism_epochs_and_ranks(tmp_path, small_tokenizer):
    path, _ = _small_table(tmp_path, n=12)
    cfg = _features(4)

    def ids_and_feats(seed, epoch, rank=0, world=1):
        src = SyntheticFeatureSource(
            path,
            2,
            small_tokenizer,
            cfg,
            train=True,
            max_duration=30,
            rank=rank,
            world_size=world,
            seed=seed,
        )
        out = list(src.epoch_batches(epoch, 0))
        for b in out:  # the host copy of the lengths is the one the fused loss packs by
            assert torch.equal(b.host_lens[0], b.feat_lens.cpu())
            assert torch.equal(b.host_lens[1], b.token_lens.cpu())
        return [b.utt_ids for b in out], [b.feats for b in out]

    ids, feats = ids_and_feats(3, 1)
    ids2, feats2 = ids_and_feats(3, 1)
    assert ids == ids2 and all(torch.equal(a, b) for a, b in zip(feats, feats2))
    assert ids != ids_and_feats(3, 2)[0] and ids != ids_and_feats(4, 1)[0]
    r0, r1 = ids_and_feats(3, 1, 0, 2)[0], ids_and_feats(3, 1, 1, 2)[0]
    assert len(r0) == len(r1) == 3
    for a, b in zip(r0, r1):
        assert not set(a) & set(b)
    assert sorted(u for b in r0 + r1 for u in b) == sorted(u for b in ids for u in b)


def test_num_batches_cycles_through_epochs(tmp_path, small_tokenizer):
    path, rows = _small_table(tmp_path, n=10)
    kept = [r for r in rows if r[1] <= 16.7]
    src = SyntheticFeatureSource(
        path, 2, small_tokenizer, _features(2), train=True, num_batches=7, seed=0
    )
    per_epoch = len(kept) // 2
    got = [b.utt_ids for b in src]
    assert len(got) == 7
    for start in range(0, 7, per_epoch):
        epoch_ids = [u for b in got[start : start + per_epoch] for u in b]
        assert len(epoch_ids) == len(set(epoch_ids))
    assert {u for b in got for u in b} <= {r[0] for r in kept}
    assert [b.utt_ids for b in src] == got  # iterating again repeats the same batches


def test_an_epoch_resumes_at_any_batch_exactly(tmp_path, small_tokenizer):
    """Batch k of an epoch is the same whether the epoch starts at 0 or at k (a resumed run),
    including past the first pass over the table (num_batches beyond one sampler epoch)."""
    path, _ = _small_table(tmp_path, n=10)
    src = SyntheticFeatureSource(
        path, 2, small_tokenizer, _features(2), train=True, num_batches=7, seed=5
    )
    full = list(src.epoch_batches(3, 0))
    for k in range(len(full) + 1):
        rest = list(src.epoch_batches(3, k))
        assert [b.utt_ids for b in rest] == [b.utt_ids for b in full[k:]]
        assert all(torch.equal(a.feats, b.feats) for a, b in zip(rest, full[k:]))
        assert all(torch.equal(a.feat_lens, b.feat_lens) for a, b in zip(rest, full[k:]))


def test_other_vocab_size_gives_random_ids_of_real_lengths(tmp_path, small_tokenizer):
    path, _ = _small_table(tmp_path)
    kwargs = dict(train=False, seed=0)
    real = SyntheticFeatureSource(path, 10, small_tokenizer, _features(2), **kwargs)
    rand = SyntheticFeatureSource(path, 10, small_tokenizer, _features(2), vocab_size=7, **kwargs)
    (a,), (b,) = list(real), list(rand)
    assert torch.equal(a.token_lens, b.token_lens)
    valid = torch.arange(b.tokens.shape[1]) < b.token_lens[:, None]
    assert ((b.tokens >= 1) & (b.tokens < 7))[valid].all() and (b.tokens[~valid] == 0).all()
    assert len(torch.unique(b.tokens[valid])) == 6


def test_source_errors(tmp_path, small_tokenizer):
    path = _write_tsv(tmp_path / "long.tsv", [("l-1", "20.0", "A LAZY DOG")])
    with pytest.raises(LengthsTableError, match="long.tsv: no utterance is at most"):
        SyntheticFeatureSource(path, 1, small_tokenizer, FeaturesConfig(), train=True)
    path = _write_tsv(tmp_path / "few.tsv", [("f-1", "2.0", "A LAZY DOG")])
    with pytest.raises(ValueError, match="fewer than one global batch of 4"):
        SyntheticFeatureSource(path, 2, small_tokenizer, FeaturesConfig(), train=True, world_size=2)
