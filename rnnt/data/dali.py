"""DALI input pipeline: the front end of `rnnt.data.features` built from DALI operators.

The batch composition comes from Python: an `external_source` is fed, per iteration, the
paths of the files the sampler chose (each opened first, so that a missing file is named
before DALI sees it) and, where DALI resamples, their speed factors; DALI reads the files on
its own threads (`fn.io.file.read`). Where the features are computed
depends on data.device, as in the torch backend:

* cpu: everything runs inside DALI's CPU operators: decode (mono, resampled to
  sample_rate / speed), `nonsilent_region` + `slice`, dither, pre-emphasis, spectrogram, mel
  filter bank, log, per-bin normalization and padding. The operator settings realize exactly
  the definitions in the docstring of `rnnt.data.features`.
* gpu: DALI decodes on its CPU threads (int16 PCM at sample_rate; float32 resampled to
  sample_rate / speed when data.resampling_device is cpu), pads the batch and copies it to the
  device, and the device feature stage that the torch backend ends in computes the features
  (`rnnt.data.device_stage`). DALI's own GPU operators ran beside the training step on DALI's
  stream and needed the trim's region back on the host between two of them, and the training
  step lost more of its time to them than to the stage (docs/PERFORMANCE.md, "DALI decodes,
  the stage computes").

Randomness: speeds come from torch generators seeded by (seed, rank, epoch, batch position),
so a resumed run perturbs its batches as the original did. On the CPU the dither comes from
DALI's generator, seeded per rank, whose state training checkpoints hold (DALI's
`enable_checkpointing`), so a resumed run dithers as the original did too. DALI's generators
cannot be rewound, so an evaluation pipeline is built afresh for every pass (it builds in 3-7
ms): each evaluation dithers exactly as the previous one and as eval.py does (digital
silence, as in synthesized speech, is nothing but dither, enough to flip a word), and a pass
left early leaves nothing that DALI read ahead to the next one. On the GPU the stage's dither
is seeded by the batch's seed, like its speeds.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from rnnt.config import FeaturesConfig
from rnnt.data.batch import FeatureBatch
from rnnt.data.device_stage import DeviceFeatureStage, QueuedFeatures
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
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

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
    """A built DALI pipeline. device cpu: its outputs are (padded feats (B, F, T), feature
    shapes (B, 2)). device gpu: (padded audio (B, S), int16 PCM or float32 where DALI
    resampled, audio shapes (B, 1)), the feature stage's input, on GPU `device_id` (on the
    host where that is None: a stage on the CPU, as tests run it).

    `source` is an external_source iterable yielding [file paths as uint8 arrays] per batch, with
    [speeds] beside them where DALI resamples (`feeds_speeds`), and raising StopIteration at
    the end of an epoch (cycle="raise"). `prefetch`: the batches DALI computes ahead of the one
    taken (data.device_prefetch; its queue holds one more). `checkpoint`: what
    `pipeline.checkpoint()` returned, to continue its random generators from there.
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
    with_speeds = feeds_speeds(train, device, resampling_device)

    @pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=1 + prefetch,
        exec_dynamic=True,
        # the CPU features' dither generator goes into the training checkpoints: an exact
        # resume (the decoding for the device stage draws nothing)
        enable_checkpointing=device == "cpu",
    )
    def pipe():
        if with_speeds:
            paths, speed = fn.external_source(
                source=source, num_outputs=2, batch=True, cycle="raise",
                dtype=[types.UINT8, types.FLOAT],
            )  # fmt: skip
            target_rate = cfg.sample_rate / speed
        else:
            paths = fn.external_source(source=source, batch=True, cycle="raise", dtype=types.UINT8)
            target_rate = float(cfg.sample_rate)
        encoded = fn.io.file.read(paths)
        if device == "gpu":
            # int16 where the stage resamples: half the bytes of float32 to copy, and the
            # stage's resampler reads PCM as it is
            dtype = types.INT16 if resampling_device == "gpu" else types.FLOAT
            audio, _ = fn.decoders.audio(
                encoded, downmix=True, dtype=dtype, sample_rate=target_rate
            )
            # copied to the GPU by DALI's threads, so that the training loop's thread never
            # copies a batch; padded there
            on_device = audio.gpu() if device_id is not None else audio
            return fn.pad(on_device, axes=[0], fill_value=0), audio.shape(device="cpu")
        audio, _ = fn.decoders.audio(
            encoded, downmix=True, dtype=types.FLOAT, sample_rate=target_rate
        )
        begin, length = fn.nonsilent_region(
            audio,
            cutoff_db=cfg.silence_threshold_db,
            window_length=TRIM_WINDOW,
            reset_interval=TRIM_RESET_INTERVAL,
        )
        audio = fn.slice(audio, begin, length, axes=[0])
        if cfg.dither > 0:
            audio = audio + cfg.dither * fn.random.normal(audio)
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


def feeds_speeds(train: bool, device: str, resampling_device: str) -> bool:
    """Whether the pipeline takes the speeds: DALI resamples for speed perturbation unless the
    device's stage does (data.resampling_device gpu)."""
    return train and not (device == "gpu" and resampling_device == "gpu")


def _lengths(shapes, axis: int) -> torch.Tensor:
    """Each sample's extent along `axis`, from DALI's shapes output, as host int64."""
    return torch.from_numpy(np.array(shapes.as_tensor())[:, axis].astype(np.int64))


def _host_tensor(tensor_list) -> torch.Tensor:
    """A uniform CPU TensorList as a torch tensor (copied: DALI reuses its buffers)."""
    return torch.from_numpy(np.array(tensor_list.as_tensor()))


class DaliFeatureIterator:
    """FeatureBatches of an epoch of `plan` (a sampler: `batches(epoch, start)` yields lists
    of dataset indices), from a start position.

    `read_batch(indices, epoch, batch_no)` returns (the indices it could read, their paths as
    uint8 arrays, their speeds, the batch's seed); `finish(indices, feats, lens[, host lens])`
    builds the FeatureBatch; `diagnose(indices)` names a bad file in a batch DALI failed on;
    `unreadable` counts the utterances read_batch left out. All four come from
    `rnnt.data.loader`, which owns file and token access. `stage`: the device feature stage
    (data.device gpu), None where DALI computes the features.
    """

    def __init__(
        self,
        cfg: FeaturesConfig,
        train: bool,
        plan,
        read_batch: Callable[[Sequence[int], int, int], tuple[list[int], list, list, int]],
        finish: Callable[..., FeatureBatch],
        diagnose: Callable[[Sequence[int], Exception], Exception],
        unreadable,
        max_batch_size: int,
        num_threads: int,
        seed: int,
        device: str,
        resampling_device: str,
        torch_device: torch.device,
        prefetch: int = 1,
        stage: DeviceFeatureStage | None = None,
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
        # (indices, speeds, seed) of the batches DALI has been fed, in order
        self._pending: deque[tuple[Sequence[int], list[float], int]] = deque()
        self.stage = stage
        self.time = stage.spent if stage is not None else None
        self.prefetch = prefetch if stage is not None else 0
        self._feeds_speeds = feeds_speeds(train, device, resampling_device)
        device_id = None
        if device == "gpu" and torch_device.type == "cuda":
            device_id = torch_device.index
            if device_id is None:
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
            start position. DALI asks for a batch on the thread that runs the pipeline, which
            opens the batch's files and hands over their paths: DALI's threads read them."""

            def __iter__(self) -> Iterator:
                epoch, start = owner.epoch, owner.start
                for no, indices in enumerate(owner.plan.batches(epoch, start), start=start):
                    kept, paths, speeds, seed = owner._read_batch(indices, epoch, no)
                    owner._pending.append((kept, speeds, seed))
                    if owner._feeds_speeds:
                        yield paths, [np.float32(s) for s in speeds]
                    else:
                        yield paths

        return _Epoch()

    def __len__(self) -> int:
        return len(self.plan)

    @property
    def dropped_utterances(self) -> int:
        return self.unreadable.dropped

    def generator_state(self) -> dict:
        """The pipeline's random generators (dither, on the CPU) as of the last batch handed
        out, as a uint8 tensor (checkpoints hold tensors). DALI's checkpoint accounts for the
        batches it has prefetched beyond that one. Nothing with the stage, whose draws are a
        function of each batch's seed."""
        if self.stage is not None:
            return {}
        blob = self.pipeline.checkpoint()
        return {"dali": torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()}

    def load_generator_state(self, state: dict) -> None:
        """Continue the generators from `generator_state()`'s result (before iterating)."""
        if self.stage is None and "dali" in state:
            blob = bytes(state["dali"].cpu().numpy().tobytes())
            self.pipeline = build_pipeline(*self._build_args, checkpoint=blob)

    def warm_up(self) -> None:
        """The device stage's kernel builds and first allocations (DeviceFeatureStage.warm_up);
        DALI's own pipeline was built with the loader."""
        if self.stage is not None:
            self.stage.warm_up()

    def __iter__(self) -> Iterator[FeatureBatch]:
        return self.epoch_batches(0, 0)

    def epoch_batches(self, epoch: int, start: int) -> Iterator[FeatureBatch]:
        """The batches of `epoch` from its `start`-th on. With the device stage, the stage of
        the next `prefetch` batches is queued before a batch is handed out."""
        self.epoch, self.start = epoch, start
        self._pending.clear()
        if not self._train and self._passes:
            # dither from its seed again, and nothing that DALI read ahead for a pass left early
            self.pipeline = build_pipeline(*self._build_args)
        self._passes += 1
        if self.stage is None:
            for (indices, _, _), (feats, shapes) in self._runs():
                yield self._finish(indices, _host_tensor(feats), _lengths(shapes, axis=1))
            return
        queued: deque[tuple[Sequence[int], QueuedFeatures]] = deque()
        for (indices, speeds, seed), (audio, shapes) in self._runs():
            queued.append((indices, self._launch(audio, shapes, speeds, seed)))
            if len(queued) > self.prefetch:
                yield self._hand_over(*queued.popleft())
        while queued:
            yield self._hand_over(*queued.popleft())

    def _runs(self) -> Iterator[tuple[tuple[Sequence[int], list[float], int], tuple]]:
        """(what the batch was fed from, DALI's outputs) for each batch until the epoch ends."""
        while True:
            asked = time.perf_counter()
            try:
                outputs = self.pipeline.run()
            except StopIteration:
                self._pending.clear()
                self.pipeline.reset()
                return
            except AudioFileError:
                raise
            except RuntimeError as err:
                suspects = [i for batch, _, _ in self._pending for i in batch]
                raise self._diagnose(suspects, err) from err
            if self.time is not None:
                self.time.workers += time.perf_counter() - asked
            yield self._pending.popleft(), outputs

    def _launch(self, audio, shapes, speeds: list[float], seed: int) -> QueuedFeatures:
        """Queue the device stage of DALI's padded audio: copied into a tensor of the stage's
        stream (DALI reuses its buffers), the copy and the stage behind DALI's work."""
        queueing = time.perf_counter()
        lens = _lengths(shapes, axis=0)
        source = audio
        if self.stage.stream is None:  # the stage on the host, where DALI left the batch
            padded = _host_tensor(audio)
        else:
            dense = audio.as_tensor()
            with self.stage.upload_context():
                padded = torch.empty(
                    dense.shape(), dtype=to_torch_type[dense.dtype], device=self.stage.device
                )
                feed_ndarray(dense, padded, cuda_stream=self.stage.stream)
            source = (audio, dense)
        drawn = None
        if self.stage.extractor.speed_perturb:
            drawn = torch.tensor(speeds, dtype=torch.float64)
        queued = self.stage.launch(padded, lens, seed, drawn, source=source)
        self.time.queueing += time.perf_counter() - queueing
        return queued

    def _hand_over(self, indices: Sequence[int], queued: QueuedFeatures) -> FeatureBatch:
        return self._finish(indices, *self.stage.finish(queued))
