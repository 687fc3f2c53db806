"""Input pipeline entry point: `build_loader` picks the backend named by `data.backend`.

Backends: `dali` (rnnt.data.dali), `torch` (this module, front end of rnnt.data.features),
`auto` (dali when importable, else torch). Both yield `FeatureBatch`es of the same maths.

Batches: training follows the sampler (a BucketingSampler over this rank's share of each
global batch, built here unless one is given); evaluation takes every utterance once in
batches of eval.batch_size (the last one partial). A backend produces the batches of an epoch
from a given position (`epoch_batches(epoch, start)`); for training, `TrainLoader` wraps it
and alone owns the epoch and the position a checkpoint records.

Torch backend, where the work happens:
* data.device = cpu: `data.num_threads` worker processes each decode one utterance,
  perturb its speed (train), compute its features and pad the batch; the main process
  only assembles tokens. Workers start by forkserver (fork would copy DALI's and CUDA's
  threads half-way), so scripts that build a loader need the `if __name__ == "__main__"`
  guard; the server imports torch and this module once, and the workers fork from it with
  them loaded (see `worker_processes`).
* data.device = gpu: workers decode (and perturb the speed when data.resampling_device is
  cpu) and pad the batch's raw audio into shared buffers that they reuse (WorkerCollate);
  the main process copies it to pinned memory and computes the features of the whole batch
  in one sync-free pass on `device`. This is the choice for the GPU machine: the CPU path runs
  about 50 twelve-second utterances per second per core (bench/data_pipeline.py, AMD EPYC),
  so 16 cores give some 800 utterances/s, below the ~1,740/s one H100 trains on, while the
  batched STFT is a small fraction of a training step on the GPU.
  The stage (`rnnt.data.device_stage`, which the DALI backend ends in too) of the next
  `data.device_prefetch` batches is queued before a batch is handed over, with its lengths'
  host copy, so the trainer never waits for it: it runs on the SMs that the step's
  recurrences leave idle.
Resampling on the CPU (files not at features.sample_rate, and speed perturbation when
data.resampling_device is cpu) uses soxr's HQ resampler in the workers: it is about 500 times
faster than the torch windowed-sinc resampler of rnnt.data.features, which serves the
batched device path (data.resampling_device = gpu) where no CPU library can run.

The workers read on across an epoch's end (and from one evaluation pass into the next) while
the last steps and the evaluation run, so an epoch does not start with its loader cold.

Randomness is a pure function of (training.seed, rank, epoch, batch position, slot): speed
and dither do not depend on the number of workers, and a resumed run repeats them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import soxr
import torch
from torch.utils.data import DataLoader, Dataset

from rnnt.config import Config, ConfigError, FeaturesConfig
from rnnt.data.batch import FeatureBatch
from rnnt.data.device_stage import DeviceFeatureStage, LoaderTime
from rnnt.data.features import (
    AudioFileError,
    FeatureExtractor,
    draw_speeds,
    read_audio,
)
from rnnt.data.manifest import Utterance
from rnnt.data.sampler import BucketingSampler, SamplerStateError, SequentialBatches
from rnnt.seeds import derive_seed, rank_seeds

log = logging.getLogger(__name__)

EVAL_SEED = 0


def dali_available() -> bool:
    from rnnt.data import dali

    return dali.DALI_AVAILABLE


def resolve_backend(name: str) -> tuple[str, str]:
    """(backend, reason): what produces the batches under `data.backend: name`, one of dali,
    torch and synthetic. Raises ConfigError where dali is asked for and does not import."""
    if name == "auto":
        if dali_available():
            return "dali", "auto: nvidia.dali imports"
        return "torch", "auto: nvidia.dali does not import"
    if name == "dali" and not dali_available():
        raise ConfigError(
            "data.backend: dali, but nvidia.dali does not import here: install "
            "nvidia-dali-cuda120/130 or choose torch (or auto)"
        )
    return name, f"data.backend: {name}"


def audio_path(utt: Utterance, dataset_dir: str | Path | None) -> str:
    if os.path.isabs(utt.audio) or dataset_dir is None:
        return utt.audio
    return str(Path(dataset_dir) / utt.audio)


class BatchAssembler:
    """Tokens and metadata of a batch: turns per-utterance features into a FeatureBatch."""

    def __init__(self, utts: Sequence[Utterance], train: bool, tokenizer=None) -> None:
        self.utts = utts
        self.train = train
        self.tokenizer = tokenizer

    def tokens(self, utt: Utterance) -> list[int]:
        if utt.tokens is not None:
            return utt.tokens
        if not self.train:
            return []  # scoring reads the transcripts: no out-of-vocabulary stop mid-evaluation
        if self.tokenizer is not None:
            return self.tokenizer.encode(utt.transcript, utt.utt_id)
        raise ValueError(
            f"utterance {utt.utt_id}: the manifest has no 'tokens' and no tokenizer was "
            "given (build the manifest with --tokenizer or set data.tokenizer)"
        )

    def __call__(
        self,
        indices: Sequence[int],
        feats: torch.Tensor,
        feat_lens: torch.Tensor,
        host_feat_lens: torch.Tensor | None = None,
    ) -> FeatureBatch:
        """host_feat_lens: the frame counts on the host, when feat_lens lives on a GPU (the
        producer copies them once; without them the fused loss computes the padded box)."""
        if host_feat_lens is None:
            if feat_lens.device.type != "cpu":
                raise ValueError("BatchAssembler: lengths on a GPU need their host copy")
            host_feat_lens = feat_lens
        utts = [self.utts[i] for i in indices]
        ids = [self.tokens(u) for u in utts]
        token_lens = torch.tensor([len(t) for t in ids], dtype=torch.int64)
        width = max(1, int(token_lens.max()))
        tokens = torch.zeros(len(ids), width, dtype=torch.int64)
        # all rows in one masked copy (row-major, so each row's tokens land in order): a copy per
        # row took milliseconds of the training loop's thread at batch 192
        inside = torch.arange(width) < token_lens[:, None]
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(token_lens.sum()))
        tokens[inside] = torch.from_numpy(flat)
        return FeatureBatch(
            feats,
            feat_lens.to(torch.int64),
            tokens,
            token_lens,
            [u.utt_id for u in utts],
            [u.transcript for u in utts],
            host_lens=(host_feat_lens.to(torch.int64), token_lens),
        )


def padded_nbytes(rows: Sequence[torch.Tensor]) -> int:
    """The bytes of `rows` padded to their longest (pad_stack's result)."""
    longest = max(r.shape[-1] for r in rows)
    return len(rows) * math.prod(rows[0].shape[:-1]) * longest * rows[0].element_size()


def shared_storage(rows: Sequence[torch.Tensor]) -> torch.UntypedStorage:
    """A new shared-memory segment for `rows` padded, made as the DataLoader's own collate makes
    its batches: a private tensor sent from a worker is copied into a new segment on the way."""
    return torch.UntypedStorage._new_shared(padded_nbytes(rows))


def pad_stack(
    rows: Sequence[torch.Tensor], storage: torch.UntypedStorage | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad tensors of shape (..., L_i) with zeros to (N, ..., max L); returns lengths.
    storage: where the result lies (from its first byte on), else new memory."""
    lens = torch.tensor([r.shape[-1] for r in rows], dtype=torch.int64)
    shape = (len(rows), *rows[0].shape[:-1], int(lens.max()))
    if storage is None:
        out = rows[0].new_empty(shape)
    else:
        out = torch.empty(0, dtype=rows[0].dtype).set_(storage, 0, shape)
    for i, r in enumerate(rows):
        out[i, ..., : r.shape[-1]] = r
        out[i, ..., r.shape[-1] :] = 0
    return out, lens


class UnreadableAudio:
    """What a loader does with the utterances of a batch whose audio cannot be read: stop with
    the first one's one-line message, or (data.skip_bad) drop them from the batch, log each and
    count them. The batch shrinks on this rank alone: nothing collective depends on its size
    (the loss is this rank's batch mean, the optimizer reduces gradients of fixed shapes, the
    CUDA graphs pad short batches)."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.dropped = 0

    def handle(self, messages: Sequence[str], kept: int) -> None:
        """`messages`: one per unreadable utterance of a batch that keeps `kept` others."""
        if not messages:
            return
        more = f" (and {len(messages) - 1} more in its batch)" if len(messages) > 1 else ""
        if not self.skip:
            raise AudioFileError(messages[0] + more)
        if kept == 0:
            raise AudioFileError(
                f"every utterance of a batch is unreadable, so there is nothing to train on: "
                f"{messages[0]}{more}"
            )
        for message in messages:
            log.warning("%s; dropped from its batch (data.skip_bad)", message)
        self.dropped += len(messages)


# --------------------------------------------------------------------------------------------
# torch backend


class AudioDataset(Dataset):
    """Items are keyed (index, seed): decode, convert to sample_rate, perturb speed (when
    `perturb`), and compute features (when `extractor` is set) for one utterance."""

    def __init__(
        self,
        utts: Sequence[Utterance],
        dataset_dir: str | Path | None,
        cfg: FeaturesConfig,
        perturb: bool,
        extractor: FeatureExtractor | None,
    ) -> None:
        self.utts = utts
        self.dataset_dir = dataset_dir
        self.cfg = cfg
        self.perturb = perturb
        self.extractor = extractor

    def __len__(self) -> int:
        return len(self.utts)

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int, torch.Tensor | str]:
        """(index, seed, features (F, T) or 16 kHz waveform (S,)); for a file that cannot be
        read, its one-line message in place of the tensor (raised in a worker, it would reach
        the trainer wrapped in the worker's traceback)."""
        index, seed = key
        cfg = self.cfg
        # raw PCM when this worker only decodes: the GPU stage converts it
        raw = self.extractor is None and not self.perturb
        try:
            samples, rate = read_audio(audio_path(self.utts[index], self.dataset_dir), pcm16=raw)
        except AudioFileError as err:
            return index, seed, str(err)
        generator = torch.Generator().manual_seed(seed)
        speed = float(draw_speeds(cfg, 1, generator)[0]) if self.perturb else 1.0
        if rate != cfg.sample_rate or speed != 1.0:
            if samples.dtype == np.int16:
                samples = samples.astype(np.float32) / 32768
            # soxr, a polyphase resampler in C, rather than the float64 reference's sinc taps,
            # which a worker's one core could not keep up with (docs/PERFORMANCE.md)
            samples = soxr.resample(samples, rate, cfg.sample_rate / speed, quality="HQ")
        if samples.dtype != np.int16:
            samples = np.ascontiguousarray(samples, dtype=np.float32)
        wave = torch.from_numpy(samples)
        if self.extractor is None:
            return index, seed, wave
        feats, frames = self.extractor(wave[None], torch.tensor([wave.shape[0]]), generator)
        return index, seed, feats[0, :, : int(frames[0])]


class _KeyedBatches:
    """The index batches from a start position (epoch, batch) on, through that epoch and every
    later one without end, as (index, seed) keys for AudioDataset: the DataLoader's workers
    read on across an epoch's end, while the last steps and the evaluation run, instead of
    starting the next epoch cold. The consumer takes one epoch at a time (`len` is an
    epoch's batches). seeded_by_epoch=False (evaluation): every pass draws what the first did,
    so that eval.py scores a checkpoint as the trainer's evaluation did."""

    def __init__(self, plan, seed: int, rank: int, seeded_by_epoch: bool = True) -> None:
        self.plan = plan
        self.seed = seed
        self.rank = rank
        self.seeded_by_epoch = seeded_by_epoch
        self.epoch = 0
        self.start = 0

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, start = self.epoch, self.start
        while True:
            drawn = epoch if self.seeded_by_epoch else 0
            for batch_no, indices in enumerate(self.plan.batches(epoch, start), start=start):
                yield [
                    (i, derive_seed(self.seed, self.rank, drawn, batch_no, slot))
                    for slot, i in enumerate(indices)
                ]
            epoch, start = epoch + 1, 0


class TorchFeatureLoader:
    """The torch-native backend (see the module docstring for where the work runs)."""

    def __init__(
        self,
        cfg: Config,
        utts: Sequence[Utterance],
        dataset_dir: str | Path | None,
        train: bool,
        plan,
        rank: int,
        device: torch.device,
        assembler: BatchAssembler,
        seed: int,
        unreadable: UnreadableAudio,
    ) -> None:
        data = cfg.data
        self.device = device
        self.assembler = assembler
        self.time = LoaderTime()
        self.unreadable = unreadable
        perturb_on_device = train and data.resampling_device == "gpu"
        worker_extractor = None
        # batches whose device stage is queued ahead of the one handed out (data.device gpu):
        # the host then never waits for the stage, which runs beside the training step
        self.prefetch = data.device_prefetch if data.device == "gpu" else 0
        self.stage = None
        if data.device == "gpu":
            self.stage = DeviceFeatureStage.for_run(cfg, train, device, self.time)
        else:
            worker_extractor = FeatureExtractor(cfg.features, train, speed_perturb=False)
        dataset = AudioDataset(
            utts, dataset_dir, cfg.features, train and not perturb_on_device, worker_extractor
        )
        self.keyed = _KeyedBatches(plan, seed, rank, seeded_by_epoch=train)
        # the DataLoader's iterator over every epoch from `at` on, kept between epochs
        self.ahead: Iterator | None = None
        self.at: tuple[int, int] | None = None
        workers = data.num_threads
        pinned = device.type == "cuda"
        # batches copied to pinned memory before use can come in buffers that the workers reuse
        busy = WorkerCollate.buffer_flags(workers) if pinned and workers else None
        self.loader = DataLoader(
            dataset,
            batch_sampler=self.keyed,
            num_workers=workers,
            collate_fn=WorkerCollate(busy),
            pin_memory=pinned,
            worker_init_fn=_one_thread if workers else None,
            persistent_workers=workers > 0,
            multiprocessing_context=worker_processes() if workers else None,
            # Every DataLoader iterator draws a base seed; from a private generator, so starting
            # an epoch never advances the global RNG (dropout) and resumes stay exact.
            generator=torch.Generator().manual_seed(rank_seeds(seed, rank).loader),
        )

    @property
    def dropped_utterances(self) -> int:
        return self.unreadable.dropped

    def generator_state(self) -> dict:
        """Nothing: every random draw is a function of (seed, rank, epoch, batch, slot)."""
        return {}

    def load_generator_state(self, state: dict) -> None:
        pass

    def __len__(self) -> int:
        return len(self.keyed)

    def read_ahead(self) -> None:
        """Set the workers on the first pass now, so that its batches wait ready when the
        pass begins (the trainer calls this halfway through the first epoch, for the first
        evaluation); a loader already reading goes on as it is."""
        if self.ahead is None:
            self.keyed.epoch, self.keyed.start = 0, 0
            self.ahead, self.at = iter(self.loader), (0, 0)

    def __iter__(self) -> Iterator[FeatureBatch]:
        """One pass over the batches (evaluation): after a pass that ran to its end, the next
        one goes on with what the workers read ahead meanwhile."""
        after = self.at[0] if self.at is not None and self.at[1] == 0 else 0
        return self.epoch_batches(after, 0)

    def epoch_batches(self, epoch: int, start: int) -> Iterator[FeatureBatch]:
        """The batches of `epoch` from its `start`-th on. Where the previous call ended at
        that point, its iterator goes on with what the workers have read ahead; elsewhere (a
        resume, an epoch left early) a new one starts there."""
        if self.ahead is None or self.at != (epoch, start):
            self.keyed.epoch, self.keyed.start = epoch, start
            self.ahead, self.at = iter(self.loader), (epoch, start)
        queued: collections.deque[tuple] = collections.deque()
        read = start
        for _ in range(start, len(self.keyed)):
            # the batch to hand out, and the `prefetch` after it, are queued (GPU: launched)
            while read < len(self.keyed) and len(queued) <= self.prefetch:
                asked = time.perf_counter()
                raw = next(self.ahead)
                got = time.perf_counter()
                queued.append(self._queue(raw))
                self.time.workers += got - asked
                self.time.queueing += time.perf_counter() - got
                read += 1
                self.at = (epoch, read) if read < len(self.keyed) else (epoch + 1, 0)
            yield self._hand_over(queued.popleft())

    def _queue(self, raw: WorkerBatch) -> tuple:
        """A batch from the workers, with its device stage launched (data.device gpu)."""
        self.unreadable.handle(raw.unreadable, len(raw.indices))
        if self.stage is None:
            return raw.indices, (raw.padded, raw.lens)
        return raw.indices, self.stage.launch(raw.padded, raw.lens, raw.seed)

    def _hand_over(self, queued: tuple) -> FeatureBatch:
        indices, batch = queued
        if self.stage is None:
            return self.assembler(indices, *batch)
        return self.assembler(indices, *self.stage.finish(batch))

    def warm_up(self) -> None:
        """The device feature stage's kernel builds and first allocations, on stand-in rows
        (DeviceFeatureStage.warm_up); the workers are not started and no file is read."""
        if self.stage is not None:
            self.stage.warm_up()


@dataclasses.dataclass
class WorkerBatch:
    """A batch as a loader worker sends it: the indices of its readable utterances, the
    batch's seed (the whole batch's, dropped utterances or not), their rows padded (None when
    none could be read), their lengths, and the messages of the unreadable ones.

    busy and slot: the flags of the workers' reusable buffers and the (worker, buffer) that
    `padded` lies in (WorkerCollate), marked free once the DataLoader's pin-memory thread has
    copied the batch out of it."""

    indices: list[int]
    seed: int
    padded: torch.Tensor | None
    lens: torch.Tensor | None
    unreadable: list[str]
    busy: torch.Tensor | None = None
    slot: tuple[int, int] | None = None

    def pin_memory(self) -> WorkerBatch:
        """The DataLoader's pin-memory thread calls this: a copy in pinned memory, after which
        the worker may write its next batch over this one."""
        pinned = dataclasses.replace(
            self,
            padded=None if self.padded is None else self.padded.pin_memory(),
            lens=None if self.lens is None else self.lens.pin_memory(),
            busy=None,
            slot=None,
        )
        self.release()
        return pinned

    def release(self) -> None:
        """Let the worker reuse the buffer this batch lies in; the batch must not be read after."""
        if self.slot is not None:
            self.busy[self.slot] = 0
            self.slot = None


class WorkerCollate:
    """The loader's collate_fn, run in the worker processes: pads the rows of a batch into a
    WorkerBatch. Rows are int16 PCM or float32 (resampled, or averaged from several
    channels); a batch of both is float32.

    busy (shared (workers, slots) uint8, set where the batches are pinned before use): each
    worker pads its batches into `slots` shared-memory buffers of its own, reused from batch to
    batch. busy[worker, slot] is 1 from the batch's padding until the pin-memory thread has
    copied it out (WorkerBatch.pin_memory). Making and first touching a new shared segment a
    batch took about three quarters of a worker's CPU for a batch of PCM (94-105 against
    23-30 ms on a 2-core VM, docs/PERFORMANCE.md, "The worker's batch in reused shared
    memory"). Three buffers should suffice: the DataLoader asks at most two batches of a
    worker at a time (its prefetch_factor), and a batch is copied out before the training
    process takes it. A worker that finds none free (a batch the DataLoader dropped without
    pinning it, say) pads into a new segment.

    Without `busy` (batches used where they lie, as with features made on the CPU), every
    batch gets a new segment, and a worker keeps its last `keep` of them referenced after
    sending them. Whichever process drops a segment last frees its pages one by one, holding
    the interpreter's lock while it does: about 30 ms for a 100 MB batch
    (`bench/worker_handoff.py`). Done in the training process, that stalls the thread that
    queues the steps. Two suffice, for the same reason as above.

    Each worker process has its own copy (the DataLoader pickles this object to it); in the
    training process itself (no workers) nothing is kept or reused."""

    def __init__(self, busy: torch.Tensor | None = None, keep: int = 2) -> None:
        self.busy = busy
        self.buffers: list[torch.UntypedStorage | None] = (
            [] if busy is None else [None] * busy.shape[1]
        )
        self.sent: collections.deque[torch.Tensor] = collections.deque(maxlen=keep)

    @staticmethod
    def buffer_flags(workers: int, slots: int = 3) -> torch.Tensor:
        """The shared busy flags for `workers` workers of `slots` buffers each."""
        return torch.zeros(workers, slots, dtype=torch.uint8).share_memory_()

    def __call__(self, items: list[tuple[int, int, torch.Tensor | str]]) -> WorkerBatch:
        seed = derive_seed(*(s for _, s, _ in items))
        good = [(i, row) for i, _, row in items if isinstance(row, torch.Tensor)]
        unreadable = [row for _, _, row in items if isinstance(row, str)]
        if not good:
            return WorkerBatch([], seed, None, None, unreadable)
        rows = [row for _, row in good]
        if len({row.dtype for row in rows}) > 1:
            rows = [row.float() / 32768 if row.dtype == torch.int16 else row for row in rows]
        indices = [i for i, _ in good]
        worker = torch.utils.data.get_worker_info()
        if worker is None:
            padded, lens = pad_stack(rows)
            return WorkerBatch(indices, seed, padded, lens, unreadable)
        if self.busy is None:
            padded, lens = pad_stack(rows, shared_storage(rows))
            if self.sent.maxlen:
                self.sent.append(padded)
            return WorkerBatch(indices, seed, padded, lens, unreadable)
        flags = self.busy[worker.id]
        free = [s for s in range(len(self.buffers)) if not flags[s]]
        if not free:
            padded, lens = pad_stack(rows, shared_storage(rows))
            return WorkerBatch(indices, seed, padded, lens, unreadable)
        slot = free[0]
        needed = padded_nbytes(rows)
        if self.buffers[slot] is None or self.buffers[slot].nbytes() < needed:
            self.buffers[slot] = torch.UntypedStorage._new_shared(needed)
        flags[slot] = 1
        padded, lens = pad_stack(rows, self.buffers[slot])
        return WorkerBatch(indices, seed, padded, lens, unreadable, self.busy, (worker.id, slot))


def worker_processes() -> multiprocessing.context.BaseContext:
    """How the loader's worker processes start: forked from a server process that imported
    torch and this module before the first worker. With the server's default preload (the
    main script) every worker still imported torch on its own, which is seconds of CPU per
    worker before the first batch of the first epoch and again of the first evaluation, both
    inside MLPerf's timed region (docs/PERFORMANCE.md, "Loader start-up")."""
    context = multiprocessing.get_context("forkserver")
    # takes effect where the server has not started yet
    context.set_forkserver_preload(["torch", __name__])
    # The server does not inherit this process's sys.path (CPython's forkserver drops it):
    # it finds `rnnt` through PYTHONPATH and its working directory, which it puts first. With
    # another checkout installed, on PYTHONPATH or in the working directory, the workers would
    # run that checkout's loader beside this one's trainer, and from outside the repository
    # an uninstalled checkout's workers would find none. So the server starts with this
    # package's own root first on its path, and without its working directory
    # (PYTHONSAFEPATH, Python 3.11 and later).
    own_root = str(Path(__file__).resolve().parents[2])
    inherited = {key: os.environ.get(key) for key in ("PYTHONPATH", "PYTHONSAFEPATH")}
    path = inherited["PYTHONPATH"]
    os.environ["PYTHONPATH"] = os.pathsep.join([own_root, *([path] if path else [])])
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        # Started now, while the trainer builds its model and graphs: left to the first
        # loader's iteration, the server's imports fall inside the timed region. It touches
        # no data.
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in inherited.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    return context


def _one_thread(_worker_id: int) -> None:
    # per-utterance work is small: one intra-op thread per worker avoids oversubscription
    torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------
# DALI backend wiring: file access and diagnosis stay here, next to the torch backend's


def _why_unreadable(path: str) -> str | None:
    """None where the file opens for reading, else the one-line message of why it does not."""
    try:
        with open(path, "rb"):
            return None
    except FileNotFoundError:
        return f"{path}: audio file not found"
    except OSError as err:
        return f"{path}: cannot read audio file ({err.strerror or err})"


class DaliFileSource:
    """The paths and speeds of a batch for the DALI pipeline; names bad files.

    DALI reads the files itself (`fn.io.file.read`) on its own threads, which hold no Python
    lock. Read here, on Python threads of the training process, the files' bytes kept the
    interpreter's lock busy, and the training loop's thread waited for it between one
    launch and the next (docs/PERFORMANCE.md, "DALI reads its files itself"). Each file is
    only opened here, so that a missing one is named, or dropped under data.skip_bad, before
    DALI sees it."""

    def __init__(
        self,
        utts: Sequence[Utterance],
        dataset_dir: str | Path | None,
        cfg: FeaturesConfig,
        train: bool,
        seed: int,
        rank: int,
        unreadable: UnreadableAudio,
    ) -> None:
        self.utts = utts
        self.dataset_dir = dataset_dir
        self.cfg = cfg
        self.train = train
        self.seed = seed
        self.rank = rank
        self.unreadable = unreadable

    def read(
        self, indices: Sequence[int], epoch: int, batch_no: int
    ) -> tuple[list[int], list, list, int]:
        """(the indices whose files can be read, their paths as the OS's bytes, their speeds, the
        batch's seed). DALI decodes what it is fed: a file it cannot decode stops the run
        (diagnose) even under data.skip_bad, since a sample cannot be taken out of a batch
        DALI already holds. Evaluation's batches draw the same in every pass (their seeds
        ignore the epoch), so that eval.py scores a checkpoint as the trainer's evaluation
        did."""
        seed = derive_seed(self.seed, self.rank, epoch if self.train else 0, batch_no)
        if self.train:
            speeds = draw_speeds(self.cfg, len(indices), torch.Generator().manual_seed(seed))
            speeds = speeds.tolist()
        else:
            speeds = [1.0] * len(indices)
        kept, encoded, kept_speeds, unreadable = [], [], [], []
        for i, speed in zip(indices, speeds):
            path = audio_path(self.utts[i], self.dataset_dir)
            problem = _why_unreadable(path)
            if problem is not None:
                unreadable.append(problem)
                continue
            encoded.append(np.frombuffer(os.fsencode(path), dtype=np.uint8))
            kept.append(i)
            kept_speeds.append(speed)
        self.unreadable.handle(unreadable, len(kept))
        return kept, encoded, kept_speeds, seed

    def diagnose(self, indices: Sequence[int], err: Exception) -> Exception:
        """The first file among `indices` that does not decode, else DALI's error with the
        batch's files (DALI's own message names only the sample position)."""
        paths = [audio_path(self.utts[i], self.dataset_dir) for i in indices]
        for path in paths:
            try:
                read_audio(path)
            except AudioFileError as bad:
                return AudioFileError(f"{bad} (DALI: {str(err).splitlines()[0]})")
        shown = ", ".join(paths[:4]) + (" ..." if len(paths) > 4 else "")
        return AudioFileError(f"DALI failed on a batch of {len(paths)} files ({shown}): {err}")


def build_loader(
    cfg: Config,
    utts: Sequence[Utterance],
    dataset_dir: str | Path | None = None,
    train: bool = True,
    sampler=None,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
    tokenizer=None,
):
    """Training: a TrainLoader. Evaluation: the backend, an iterable of FeatureBatch that
    takes every utterance once per iteration.

    utts: manifest utterances (audio paths absolute, or relative to `dataset_dir`).
    sampler: training batches (lists of indices into utts); default: a BucketingSampler of
    global batch training.batch_size * grad_accumulation * world_size. Evaluation ignores it.
    device: where the device feature stage runs (data.device = gpu, either backend) and
    where DALI copies its decoded batches.
    """
    if not utts:
        raise ValueError("build_loader: no utterances (empty manifest?)")
    backend, _ = resolve_backend(cfg.data.backend)
    if backend == "synthetic":
        raise ValueError(
            "data.backend: synthetic has no manifest loader: build "
            "rnnt.data.synthetic.SyntheticFeatureSource from the lengths tables instead"
        )
    device = torch.device(device)
    durations = [u.duration for u in utts]
    # evaluation's one random draw (dither) is the same in every run, so that eval.py scores a
    # checkpoint exactly as the training run did
    seed = cfg.training.seed if train else EVAL_SEED
    if seed is None:
        raise ConfigError("training.seed is unset: the Trainer draws one before the loaders")
    if not train:
        plan = SequentialBatches(durations, cfg.eval.batch_size, rank, world_size)
        max_batch = cfg.eval.batch_size
    else:
        local_batch = cfg.training.batch_size * cfg.training.grad_accumulation
        if sampler is None:
            sampler = BucketingSampler(
                durations,
                local_batch * world_size,
                cfg.data.num_buckets,
                rank,
                world_size,
                seed,
            )
        plan = sampler
        # a rank's share of a global batch: the micro-batches of one step together
        max_batch = sampler.local_batch_size
    assembler = BatchAssembler(utts, train, tokenizer)
    unreadable = UnreadableAudio(cfg.data.skip_bad)
    if backend == "torch":
        loader = TorchFeatureLoader(
            cfg, utts, dataset_dir, train, plan, rank, device, assembler, seed, unreadable
        )
    else:
        from rnnt.data.dali import DaliFeatureIterator

        files = DaliFileSource(utts, dataset_dir, cfg.features, train, seed, rank, unreadable)
        stage = None
        if cfg.data.device == "gpu":
            stage = DeviceFeatureStage.for_run(cfg, train, device, LoaderTime())
        loader = DaliFeatureIterator(
            cfg.features,
            train,
            plan,
            files.read,
            assembler,
            files.diagnose,
            unreadable,
            max_batch,
            max(1, cfg.data.num_threads),
            rank_seeds(seed, rank).loader % (1 << 31),
            cfg.data.device,
            cfg.data.resampling_device,
            device,
            cfg.data.device_prefetch,
            stage,
        )
    return TrainLoader(loader, sampler) if train else loader


class TrainLoader:
    """This rank's training batches and the run's position in them: the one owner of the
    epoch and of the point a checkpoint resumes from.

    The position counts the batches handed to the training loop. A backend prefetches (the
    DataLoader's workers, DALI's queue), so what it has produced runs ahead of what was
    trained; counted here, a state_dict taken after a step resumes at the next batch.

    backend: produces the batches of an epoch from a position (`epoch_batches`); the torch
    and DALI loaders of this module and rnnt.data.synthetic's source. plan: the sampler whose
    order the backend follows; the position fits only its identity (training set, batching,
    seed).
    """

    def __init__(self, backend, plan) -> None:
        self.backend = backend
        self.plan = plan
        self.epoch = 0
        self.position = 0  # batches of `epoch` handed out

    def __len__(self) -> int:
        return len(self.backend)

    @property
    def dropped_utterances(self) -> int:
        """Utterances this rank's batches left out because their audio could not be read."""
        return self.backend.dropped_utterances

    def data_wait_parts(self) -> dict[str, float] | None:
        """The backend's LoaderTime so far (the torch backend's, DALI's with the device stage),
        as seconds by name; None for the others."""
        spent = getattr(self.backend, "time", None)
        return dataclasses.asdict(spent) if isinstance(spent, LoaderTime) else None

    def warm_up(self) -> None:
        """The backend's kernel builds and first allocations, on stand-in data (see
        TorchFeatureLoader.warm_up); a backend without any does nothing."""
        warm_up = getattr(self.backend, "warm_up", None)
        if warm_up is not None:
            warm_up()

    def set_epoch(self, epoch: int) -> None:
        """Move to the first batch of `epoch`; the epoch it is in keeps its position (a
        restored one included)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[FeatureBatch]:
        """The rest of the current epoch; an exhausted epoch yields nothing more."""
        for batch in self.backend.epoch_batches(self.epoch, self.position):
            # counted before the consumer has it: a checkpoint taken after its step then
            # resumes with the next batch
            self.position += 1
            yield batch

    def state_dict(self) -> dict:
        """The position, and what it fits: plain ints and strings (weights_only loads)."""
        return {"epoch": self.epoch, "batches_done": self.position, **self.plan.identity()}

    def load_state_dict(self, state: dict) -> None:
        missing = sorted({"epoch", "batches_done"} - set(state))
        if missing:
            raise SamplerStateError(f"sampler state lacks keys {missing}")
        self.plan.adopt(state)
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        if epoch < 0 or not 0 <= done <= len(self):
            raise SamplerStateError(
                f"sampler state (epoch {epoch}, batches_done {done}) is outside epochs >= 0 "
                f"and [0, {len(self)}] batches"
            )
        self.epoch, self.position = epoch, done

    def generator_state(self) -> dict:
        """This rank's pipeline generators that a resume needs beyond the position (DALI's
        dither; nothing for the torch backend)."""
        return self.backend.generator_state()

    def load_generator_state(self, state: dict) -> None:
        self.backend.load_generator_state(state)
