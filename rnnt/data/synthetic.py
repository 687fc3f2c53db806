"""SYNTHETIC feature batches with real LibriSpeech shapes, for benchmarks and GPU tests.

The features are noise (standard normal, like per-feature normalized log-mels); only the
shapes are real. Utterances come from a lengths table of real LibriSpeech utterances
(`rnnt/data/lengths/librispeech_<split>_lengths.tsv`: id, duration in seconds, transcript):

- frames: a clip of d seconds has n = round(d * sample_rate) samples; training speed
  perturbation by rate s (uniform in [speed_perturbation_min, max] per utterance) resamples
  it to round(n / s) samples; the STFT (centered, hop = window_stride * sample_rate = 160)
  gives samples // hop + 1 frames. Silence trimming is not modelled (no audio).
- tokens: the real transcript, normalized, encoded with the project's tokenizer, so token
  counts are real. A model with another vocabulary size gets random ids of the same counts.
- batches: training samples random batches (BucketingSampler with one bucket, as in the
  published runs) over the utterances no longer than max_duration, so padding waste is
  realistic; evaluation walks every utterance once in SequentialBatches order.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rnnt.config import FeaturesConfig
from rnnt.data.batch import FeatureBatch
from rnnt.data.sampler import BucketingSampler, SequentialBatches
from rnnt.data.text import invalid_characters, normalize_transcript
from rnnt.data.tokenizer import Tokenizer, train_tokenizer
from rnnt.errors import UserError


class LengthsTableError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class LengthsTable:
    """Utterances of a lengths table; transcripts are normalized (lower case)."""

    path: Path
    utt_ids: list[str]
    durations: np.ndarray  # (N,) float64 seconds
    transcripts: list[str]

    def __len__(self) -> int:
        return len(self.utt_ids)


def read_lengths_table(path: str | Path) -> LengthsTable:
    """Parse `id<TAB>duration_s<TAB>transcript` lines; '#' lines and blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise LengthsTableError(f"lengths table not found: {path}")
    utt_ids: list[str] = []
    durations: list[float] = []
    transcripts: list[str] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            line = line.rstrip("\r\n")
            if not line.strip() or line.startswith("#"):
                continue
            where = f"{path}:{lineno}"
            fields = line.split("\t")
            if len(fields) != 3:
                raise LengthsTableError(
                    f"{where}: expected 3 tab-separated fields (id, duration_s, transcript), "
                    f"got {len(fields)}"
                )
            utt_id, duration_text, transcript = (f.strip() for f in fields)
            try:
                duration = float(duration_text)
            except ValueError:
                raise LengthsTableError(
                    f"{where}: duration {duration_text!r} is not a number"
                ) from None
            if not math.isfinite(duration) or duration <= 0:
                raise LengthsTableError(f"{where}: duration {duration_text} must be > 0")
            if not utt_id:
                raise LengthsTableError(f"{where}: empty utterance id")
            if utt_id in seen:
                raise LengthsTableError(
                    f"{where}: utterance {utt_id} already appears on line {seen[utt_id]}"
                )
            text = normalize_transcript(transcript)
            if not text:
                raise LengthsTableError(f"{where}: utterance {utt_id} has an empty transcript")
            bad = invalid_characters(text)
            if bad:
                raise LengthsTableError(
                    f"{where}: transcript of {utt_id} has characters outside the alphabet: {bad!r}"
                )
            seen[utt_id] = lineno
            utt_ids.append(utt_id)
            durations.append(duration)
            transcripts.append(text)
    if not utt_ids:
        raise LengthsTableError(f"{path}: no utterances")
    return LengthsTable(path, utt_ids, np.asarray(durations, dtype=np.float64), transcripts)


def tokenizer_for_lengths_table(
    lengths_tsv: str | Path, vocab_size: int, cache_dir: str | Path
) -> Tokenizer:
    """A `vocab_size`-piece tokenizer trained on the table's transcripts, cached in cache_dir.

    The cache name carries a hash of the table, so an edited table trains a new model; the
    model is written under a temporary name and renamed, so concurrent ranks never read a
    half-written file.
    """
    path = Path(lengths_tsv)
    table = read_lengths_table(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    model = cache_dir / f"{path.stem}.{vocab_size}.{digest}.model"
    if not model.is_file():
        # no dots: train_tokenizer names its output prefix.with_suffix(".model")
        tmp_prefix = cache_dir / f"tmp-{vocab_size}-{digest}-{os.getpid()}"
        trained = train_tokenizer(table.transcripts, tmp_prefix, vocab_size)
        trained.with_suffix(".vocab").unlink(missing_ok=True)
        os.replace(trained, model)
    return Tokenizer(model)


def perturbed_frames(
    durations: np.ndarray, speeds: np.ndarray, features: FeaturesConfig
) -> np.ndarray:
    """Raw STFT frames of clips of `durations` seconds resampled for speed rates `speeds`."""
    hop = round(features.window_stride * features.sample_rate)
    samples = np.rint(durations * features.sample_rate)
    return (np.rint(samples / speeds).astype(np.int64) // hop) + 1


def _derived_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(parts).generate_state(1, dtype=np.uint64)[0] >> 1)


class SyntheticFeatureSource:
    """Noise features and real token ids at real LibriSpeech lengths: a loader backend
    (`epoch_batches(epoch, start)`; iterating it is one pass of epoch 0, for evaluation).

    batch_size is per rank. num_batches: batches per epoch; None is one pass (training:
    one sampler epoch; evaluation: every utterance once). Training cycles through sampler
    epochs when num_batches is larger. Batch k of an epoch is a function of (seed, epoch, rank,
    k) alone, so an epoch resumes at any batch exactly.
    """

    def __init__(
        self,
        lengths_tsv: str | Path,
        batch_size: int,
        tokenizer: Tokenizer,
        features: FeaturesConfig,
        *,
        train: bool,
        max_duration: float = 16.7,
        vocab_size: int | None = None,
        num_batches: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        table = read_lengths_table(lengths_tsv)
        keep = np.flatnonzero(table.durations <= max_duration) if train else np.arange(len(table))
        if keep.size == 0:
            raise LengthsTableError(
                f"{table.path}: no utterance is at most max_duration = {max_duration} s"
            )
        self.utt_ids = [table.utt_ids[i] for i in keep]
        self.transcripts = [table.transcripts[i] for i in keep]
        self.durations = table.durations[keep]
        self.tokens = [tokenizer.encode(t, u) for t, u in zip(self.transcripts, self.utt_ids)]
        if vocab_size is not None and vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (id 0 is <unk>), got {vocab_size}")
        self.random_ids_below = (
            vocab_size if vocab_size is not None and vocab_size != tokenizer.vocab_size else None
        )
        if features.speed_perturbation_min <= 0 or (
            features.speed_perturbation_min > features.speed_perturbation_max
        ):
            raise ValueError(
                f"features.speed_perturbation_min/max = {features.speed_perturbation_min}/"
                f"{features.speed_perturbation_max}: need 0 < min <= max"
            )
        self.features = features
        self.train = train
        self.seed = seed
        self.rank = rank
        self.device = torch.device(device)
        if train:
            self.plan: BucketingSampler | SequentialBatches = BucketingSampler(
                self.durations, batch_size * world_size, 1, rank, world_size, seed
            )
        else:
            self.plan = SequentialBatches(self.durations, batch_size, rank, world_size)
        self.num_batches = len(self.plan) if num_batches is None else num_batches
        self.dropped_utterances = 0  # no audio, nothing unreadable

    def __len__(self) -> int:
        return self.num_batches

    def generator_state(self) -> dict:
        """Nothing: every batch is a function of (seed, epoch, rank, position)."""
        return {}

    def load_generator_state(self, state: dict) -> None:
        pass

    def frames(self, durations: np.ndarray, speeds: np.ndarray) -> np.ndarray:
        """Raw 10 ms frames of clips of `durations` seconds played at rates `speeds`."""
        return perturbed_frames(durations, speeds, self.features)

    def _index_batches(self, epoch: int, start: int) -> Iterator[list[int]]:
        # an epoch longer than one pass takes sampler epochs of its own, never its neighbour's
        per_pass = len(self.plan)
        plan_epoch = epoch * -(-self.num_batches // per_pass) + start // per_pass
        skip = start % per_pass
        while True:
            yield from self.plan.batches(plan_epoch, skip)
            plan_epoch, skip = plan_epoch + 1, 0

    def __iter__(self) -> Iterator[FeatureBatch]:
        return self.epoch_batches(0, 0)

    def epoch_batches(self, epoch: int, start: int) -> Iterator[FeatureBatch]:
        """The batches of `epoch` from its `start`-th on."""
        cfg = self.features
        index_batches = self._index_batches(epoch, start)
        gen = torch.Generator(device=self.device)
        for batch_no in range(start, self.num_batches):
            rng = np.random.Generator(
                np.random.PCG64(np.random.SeedSequence([self.seed, epoch, self.rank, batch_no]))
            )
            gen.manual_seed(_derived_seed(self.seed, epoch, self.rank, batch_no, 1))
            idx = np.asarray(next(index_batches))
            if self.train:
                speeds = rng.uniform(
                    cfg.speed_perturbation_min, cfg.speed_perturbation_max, size=idx.size
                )
            else:
                speeds = np.ones(idx.size)
            yield self._batch(idx, self.frames(self.durations[idx], speeds), rng, gen)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the source's device. From pinned memory, so that the copy does not
        wait for the GPU to finish the queued training steps: a loader that did would look
        like a slow one (the trainer logs the time spent waiting for data)."""
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _batch(
        self, idx: np.ndarray, frames: np.ndarray, rng: np.random.Generator, gen: torch.Generator
    ) -> FeatureBatch:
        b = idx.size
        token_lens = np.array([len(self.tokens[i]) for i in idx])
        tokens = np.zeros((b, token_lens.max()), dtype=np.int64)
        for row, i in enumerate(idx):
            tokens[row, : token_lens[row]] = self.tokens[i]
        if self.random_ids_below is not None:
            random_ids = rng.integers(1, self.random_ids_below, size=tokens.shape)
            tokens = np.where(np.arange(tokens.shape[1]) < token_lens[:, None], random_ids, 0)
        dev = self.device
        feat_lens = self._to_device(frames)
        feats = torch.randn((b, self.features.n_mels, int(frames.max())), generator=gen, device=dev)
        feats.masked_fill_(torch.arange(feats.shape[2], device=dev) >= feat_lens[:, None, None], 0)
        return FeatureBatch(
            feats=feats,
            feat_lens=feat_lens,
            tokens=self._to_device(tokens),
            token_lens=self._to_device(token_lens),
            utt_ids=[self.utt_ids[i] for i in idx],
            transcripts=[self.transcripts[i] for i in idx],
            host_lens=(torch.from_numpy(frames), torch.from_numpy(token_lens)),
        )
