"""DALI input pipeline: the front end of `rnnt.data.features` built from DALI operators.

The batch composition comes from Python: an `external_source` is fed, per iteration, the
encoded bytes of the files the sampler chose (read here, so a missing file is named before
DALI sees it) and their speed factors. Everything else runs inside DALI: decode (mono, and
resampled to sample_rate / speed in the decoder, or later by `audio_resample` on the GPU when
data.resampling_device is gpu), `nonsilent_region` + `slice`, dither, pre-emphasis,
spectrogram, mel filter bank, log, per-bin normalization and padding. The operator settings
realize exactly the definitions in the docstring of `rnnt.data.features`.

Randomness: speeds come from numpy seeded by (seed, rank, epoch, batch position), so a resumed
run perturbs its batches as the original did; dither comes from DALI's generator, seeded per
rank, whose state training checkpoints hold (DALI's `enable_checkpointing`), so a resumed run
dithers as the original did too. DALI's generators cannot be rewound, so an evaluation pipeline
is built afresh for every pass (the CPU pipeline builds in 3-7 ms): each evaluation dithers
exactly as the previous one and as eval.py does (digital silence, as in synthesized speech, is
nothing but dither, enough to flip a word).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from rnnt.config import FeaturesConfig
from rnnt.data.batch import FeatureBatch
from rnnt.data.features import (
    NORM_EPSILON,
    TRIM_WINDOW,
    AudioFileError,
    hann_window,
    window_samples,
)

# DALI keeps a float32 running sum of squares over the trim window and recomputes it every
# reset_interval samples (a multiple of the window). With its default (8192) the rounding
# error of a loud passage lingers: quiet windows after it read about -65 dB instead of less,
# and the kept region ran up to 8192 samples past what exact sums give. The smallest allowed
# interval (one window, one extra add per sample) bounds that to 2048 samples.
TRIM_RESET_INTERVAL = TRIM_WINDOW

try:
    from nvidia.dali import fn, pipeline_def, types

    DALI_AVAILABLE = True
except ImportError:  # the torch backend serves machines without DALI
    DALI_AVAILABLE = False


def build_pipeline(
    cfg: FeaturesConfig,
    train: bool,
    source: Callable,
    batch_size: int,
    num_threads: int,
    seed: int,
    device: str = "cpu",
    resampling_device: str = "cpu",
    device_id: int | None = None,
    prefetch: int = 1,
    checkpoint: bytes | None = None,
):
    """A built DALI pipeline whose outputs are (padded feats (B, F, T), feature shapes (B, 2)).

    `source` is an external_source iterable yielding ([encoded uint8 arrays], [speeds]) per
    batch and raising StopIteration at the end of an epoch (cycle="raise"). `prefetch`: the
    batches DALI computes ahead of the one taken (data.device_prefetch; its queue holds one
    more). `checkpoint`: what `pipeline.checkpoint()` returned, to continue its random
    generators from there.
    """
    if device not in ("cpu", "gpu") or resampling_device not in ("cpu", "gpu"):
        raise ValueError(
            f"data.device = {device!r}, data.resampling_device = {resampling_device!r}: "
            "each must be cpu or gpu"
        )
    if resampling_device == "gpu" and device == "cpu":
        raise ValueError(
            "data.resampling_device = gpu needs data.device = gpu (the feature stage cannot "
            "move back to the CPU)"
        )
    win_length, hop = window_samples(cfg)
    window = hann_window(win_length).tolist()
    ln10 = math.log(10.0)

    @pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id if device == "gpu" else None,
        seed=seed,
        prefetch_queue_depth=1 + prefetch,
        exec_dynamic=True,  # allows the GPU -> CPU copy of the trim region for slice
        # the dither generator's state goes into the training checkpoints: an exact resume
        enable_checkpointing=True,
    )
    def pipe():
        encoded, speed = fn.external_source(
            source=source,
            num_outputs=2,
            batch=True,
            cycle="raise",
            dtype=[types.UINT8, types.FLOAT],
        )
        target_rate = cfg.sample_rate / speed  # evaluation feeds speed 1
        # slice takes its region as CPU inputs. With the audio resampled on the GPU, the
        # region is found there (DALI's GPU nonsilent_region gives the CPU one's regions) and
        # only its two numbers per utterance come back to the host, not the resampled audio,
        # whose copy and CPU scan had bound the pipeline (docs/PERFORMANCE.md)
        if resampling_device == "gpu":
            audio, in_rate = fn.decoders.audio(encoded, downmix=True, dtype=types.FLOAT)
            audio = fn.audio_resample(audio.gpu(), in_rate=in_rate, out_rate=target_rate)
            scan_audio = audio
        else:
            audio, _ = fn.decoders.audio(
                encoded, downmix=True, dtype=types.FLOAT, sample_rate=target_rate
            )
            scan_audio = audio
            if device == "gpu":
                audio = audio.gpu()
        begin, length = fn.nonsilent_region(
            scan_audio,
            cutoff_db=cfg.silence_threshold_db,
            window_length=TRIM_WINDOW,
            reset_interval=TRIM_RESET_INTERVAL,
        )
        if resampling_device == "gpu":
            begin, length = begin.cpu(), length.cpu()
        audio = fn.slice(audio, begin, length, axes=[0])
        if cfg.dither > 0:
            audio = audio + cfg.dither * fn.random.normal(audio, device=device)
        audio = fn.preemphasis_filter(audio, preemph_coeff=cfg.preemph, border="zero")
        spec = fn.spectrogram(
            audio,
            nfft=cfg.n_fft,
            window_length=win_length,
            window_step=hop,
            window_fn=window,
            center_windows=True,
            reflect_padding=True,
            power=2,
        )
        mel = fn.mel_filter_bank(
            spec,
            sample_rate=cfg.sample_rate,
            nfilter=cfg.n_mels,
            normalize=True,
            mel_formula="slaney",
            freq_low=0.0,
            freq_high=cfg.sample_rate / 2,
        )
        # ln(x) = ln(10) * log10(x); the floor 1e-20 is a ratio of 10^(cutoff_db / multiplier)
        logmel = fn.to_decibels(
            mel, multiplier=ln10, reference=1.0, cutoff_db=ln10 * math.log10(cfg.log_floor)
        )
        feats = fn.normalize(logmel, axes=[1], epsilon=NORM_EPSILON, ddof=0)
        return fn.pad(feats, axes=[1], fill_value=0.0), feats.shape(device="cpu")

    with warnings.catch_warnings():
        # DALI warns that it cannot capture an iterable source's position; the source starts
        # at the sampler's position itself (DaliFeatureIterator._source)
        warnings.filterwarnings("ignore", message="Checkpointing enabled in a pipeline")
        pipeline = pipe(checkpoint=checkpoint) if checkpoint is not None else pipe()
        pipeline.build()
    return pipeline


def _to_torch(tensor_list, device: torch.device) -> torch.Tensor:
    """A uniform DALI TensorList as a torch tensor on `device` (copied: DALI reuses buffers)."""
    dense = tensor_list.as_tensor()
    if device.type == "cpu":
        return torch.from_numpy(np.array(dense))
    from nvidia.dali.plugin.pytorch import feed_ndarray

    out = torch.empty(dense.shape(), dtype=torch.float32, device=device)
    feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
    return out


class DaliFeatureIterator:
    """FeatureBatches of an epoch of `plan` (a sampler: `batches(epoch, start)` yields lists
    of dataset indices), from a start position.

    `read_batch(indices, epoch, batch_no)` returns (the indices it could read, their encoded
    arrays, their speeds); `finish(indices, feats, lens)` builds the FeatureBatch;
    `diagnose(indices)` names a bad file in a batch DALI failed on; `unreadable` counts the
    utterances read_batch left out. All four come from `rnnt.data.loader`, which owns file
    and token access.
    """

    def __init__(
        self,
        cfg: FeaturesConfig,
        train: bool,
        plan,
        read_batch: Callable[[Sequence[int], int, int], tuple[list[int], list, list]],
        finish: Callable[[Sequence[int], torch.Tensor, torch.Tensor], FeatureBatch],
        diagnose: Callable[[Sequence[int], Exception], Exception],
        unreadable,
        max_batch_size: int,
        num_threads: int,
        seed: int,
        device: str,
        resampling_device: str,
        torch_device: torch.device,
        prefetch: int = 1,
    ) -> None:
        if not DALI_AVAILABLE:
            raise RuntimeError("data.backend = dali but nvidia.dali is not importable")
        self.plan = plan
        self.unreadable = unreadable
        self.epoch = 0
        self.start = 0
        self._read_batch = read_batch
        self._finish = finish
        self._diagnose = diagnose
        self._pending: deque[Sequence[int]] = deque()  # batches DALI has been fed, in order
        self._torch_device = torch_device
        device_id = torch_device.index if torch_device.type == "cuda" else None
        if device == "gpu" and device_id is None:
            device_id = torch.cuda.current_device()
        self._train = train
        self._build_args = (
            cfg,
            train,
            self._source(),
            max_batch_size,
            num_threads,
            seed,
            device,
            resampling_device,
            device_id,
            prefetch,
        )
        self.pipeline = build_pipeline(*self._build_args)
        self._passes = 0

    def _source(self):
        owner = self

        class _Epoch:
            """Iterable for external_source: each iter() is the loader's current epoch from its
            start position. DALI asks for a batch on the thread that runs the pipeline; the
            next batch's files are already being read on another thread by then."""

            def __iter__(self) -> Iterator[tuple[list, list]]:
                epoch, start = owner.epoch, owner.start
                batches = enumerate(owner.plan.batches(epoch, start), start=start)
                with ThreadPoolExecutor(1, thread_name_prefix="dali-ahead") as ahead:
                    reads = (ahead.submit(owner._read_batch, ix, epoch, no) for no, ix in batches)
                    upcoming = next(reads, None)
                    while upcoming is not None:
                        current, upcoming = upcoming, next(reads, None)
                        kept, encoded, speeds = current.result()
                        owner._pending.append(kept)
                        yield encoded, [np.float32(s) for s in speeds]

        return _Epoch()

    def __len__(self) -> int:
        return len(self.plan)

    @property
    def dropped_utterances(self) -> int:
        return self.unreadable.dropped

    def generator_state(self) -> dict:
        """The pipeline's random generators (dither) as of the last batch handed out, as a
        uint8 tensor (checkpoints hold tensors). DALI's checkpoint accounts for the batches
        it has prefetched beyond that one."""
        blob = self.pipeline.checkpoint()
        return {"dali": torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()}

    def load_generator_state(self, state: dict) -> None:
        """Continue the generators from `generator_state()`'s result (before iterating)."""
        blob = bytes(state["dali"].cpu().numpy().tobytes())
        self.pipeline = build_pipeline(*self._build_args, checkpoint=blob)

    def __iter__(self) -> Iterator[FeatureBatch]:
        return self.epoch_batches(0, 0)

    def epoch_batches(self, epoch: int, start: int) -> Iterator[FeatureBatch]:
        """The batches of `epoch` from its `start`-th on."""
        self.epoch, self.start = epoch, start
        self._pending.clear()
        if not self._train and self._passes:
            self.pipeline = build_pipeline(*self._build_args)  # dither from its seed again
        self._passes += 1
        while True:
            try:
                feats, shapes = self.pipeline.run()
            except StopIteration:
                self._pending.clear()
                self.pipeline.reset()
                return
            except AudioFileError:
                raise
            except RuntimeError as err:
                suspects = [i for batch in self._pending for i in batch]
                raise self._diagnose(suspects, err) from err
            indices = self._pending.popleft()
            lens = torch.from_numpy(np.array(shapes.as_tensor())[:, 1].astype(np.int64))
            yield self._finish(indices, _to_torch(feats, self._torch_device), lens)
