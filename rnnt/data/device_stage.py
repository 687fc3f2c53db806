"""The feature stage on the device, which both loader backends end in under `data.device: gpu`.

A backend decodes on the host (the torch backend's worker processes, DALI's CPU operators)
and hands over a padded batch of PCM with its lengths. This stage resamples it at each
utterance's speed (`data.resampling_device: gpu`), trims the silence and computes the
normalized log-mels of the whole batch in one sync-free pass (`FeatureExtractor` and its
kernels), then copies the frame counts to the host once: the loss sizes its packed lattice
from them.

It runs on a side stream. Queued `data.device_prefetch` batches ahead of the one handed out,
nothing waits for it, so it takes the lowest priority (the default, the step's own) and runs
between and beside the step's kernels instead of ahead of them. Computed when asked for (no
prefetch), the host waits for its lengths before it can queue the next step, so it takes the
highest: at the default priority it ran after most of the step, and each step waited for the
previous one and the stage.

Randomness: the dither's noise comes from a device generator seeded by the batch's seed, and
the speeds from a host generator seeded by it (or are drawn by the caller), so a batch's
features are a function of its seed alone.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from rnnt.config import Config, FeaturesConfig
from rnnt.data.features import FeatureExtractor, draw_speeds

# CUDA maps a priority past the device's range to its highest one
HIGHEST_STREAM_PRIORITY = -100


@dataclasses.dataclass
class LoaderTime:
    """Host seconds a loader has spent, since it was built, on what the training loop's wait
    for a batch is made of: waiting for decoded audio (the torch backend's workers, DALI's
    pipeline), queueing a batch's device feature stage (its kernels' launches), and waiting
    for a queued stage to end (the lengths' copy). The trainer's log splits its data wait
    into these."""

    workers: float = 0.0
    queueing: float = 0.0
    stage: float = 0.0


@dataclasses.dataclass
class QueuedFeatures:
    """A batch whose stage is queued: its device tensors, the pinned host copy of its frame
    counts and the event after that copy (None where the stage ran on the current stream).
    `source`: what the upload reads from (DALI's output buffer), held until the stage is done
    so that its producer cannot reuse the memory under a copy not yet run."""

    feats: torch.Tensor
    lens: torch.Tensor
    host_lens: torch.Tensor
    done: torch.cuda.Event | None
    source: object = None


class DeviceFeatureStage:
    """Queue (`launch`) and collect (`finish`) the features of padded PCM batches on `device`.

    perturb: resample each utterance at its training speed here (train and
    data.resampling_device gpu); otherwise the audio arrives at its final rate.
    """

    def __init__(
        self,
        cfg: FeaturesConfig,
        train: bool,
        perturb: bool,
        device: torch.device,
        prefetch: int,
        spent: LoaderTime,
    ) -> None:
        self.device = device
        self.spent = spent
        self.extractor = FeatureExtractor(cfg, train, perturb).to(device)
        self.stream = None
        if device.type == "cuda":
            priority = 0 if prefetch else HIGHEST_STREAM_PRIORITY
            self.stream = torch.cuda.Stream(device, priority=priority)

    @classmethod
    def for_run(
        cls, cfg: Config, train: bool, device: torch.device, spent: LoaderTime
    ) -> DeviceFeatureStage:
        """The stage that `cfg` asks for (data.device gpu): it perturbs the speed where
        data.resampling_device is gpu, and is queued data.device_prefetch batches ahead."""
        perturb = train and cfg.data.resampling_device == "gpu"
        return cls(cfg.features, train, perturb, device, cfg.data.device_prefetch, spent)

    def upload_context(self):
        """Where a producer's own copy of a batch onto the device must run (DALI's): on the
        stage's stream, so that the stage reads it after the copy and the allocator ties the
        memory to that stream."""
        return torch.cuda.stream(self.stream)

    def launch(
        self,
        padded: torch.Tensor,
        lens: torch.Tensor,
        seed: int,
        speeds: torch.Tensor | None = None,
        source: object = None,
    ) -> QueuedFeatures:
        """Queue the stage of a batch: padded (B, S) int16 PCM or float32 samples (host or
        device), lens (B,) int64 on the host. speeds (B,) float64 on the host: each
        utterance's speed where the caller drew them; else drawn from `seed` (perturb)."""
        if self.stream is None:
            feats, dev_lens = self._extract(padded, lens, seed, speeds)
            return QueuedFeatures(feats, dev_lens, dev_lens.cpu(), None, source)
        # On a side stream: the training step queued before it keeps the GPU busy meanwhile,
        # and the lengths' host copy waits for this stream alone. On the default stream that
        # copy would wait for the whole previous step, and the GPU would idle while the host
        # queued the next one.
        with torch.cuda.stream(self.stream):
            feats, dev_lens = self._extract(padded, lens, seed, speeds)
            # one copy of the lengths per batch: it trims the silence off the batch and gives
            # the loss its host lengths
            host_lens = torch.empty(dev_lens.shape, dtype=dev_lens.dtype, pin_memory=True)
            host_lens.copy_(dev_lens, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return QueuedFeatures(feats, dev_lens, host_lens, done, source)

    def finish(self, queued: QueuedFeatures) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(feats (B, F, T) cut to the longest utterance, lens on the device, lens on the
        host), once the queued stage has ended."""
        if queued.done is not None:
            waited = time.perf_counter()
            queued.done.synchronize()  # the stage's whole stream up to the lengths' copy
            self.spent.stage += time.perf_counter() - waited
            # the consumer frees these tensors on its own stream, so the allocator must not
            # recycle them until that stream is done with them
            consumer = torch.cuda.current_stream(self.device)
            queued.feats.record_stream(consumer)
            queued.lens.record_stream(consumer)
        queued.source = None
        feats = queued.feats[:, :, : int(queued.host_lens.max())]
        return feats, queued.lens, queued.host_lens

    def features_now(
        self, padded: torch.Tensor, lens: torch.Tensor, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features of a padded batch with their host lengths, at once."""
        return self.finish(self.launch(padded, lens, seed))

    def warm_up(self) -> None:
        """The stage once on two stand-in rows of silence, so that its kernel builds (the
        Triton resampler) and first allocations happen now rather than at the first batch."""
        rows = torch.zeros(2, 4000, dtype=torch.int16)
        self.features_now(rows, torch.tensor([4000, 3000]), seed=0)

    def _extract(
        self,
        padded: torch.Tensor,
        lens: torch.Tensor,
        seed: int,
        speeds: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        padded = padded.to(self.device, non_blocking=True)
        # The lengths and the speeds stay on the host, where the extractor bounds each
        # utterance's frames with them; the dither's noise comes from the device's generator.
        if self.extractor.speed_perturb and speeds is None:
            speeds = draw_speeds(self.extractor.cfg, len(lens), torch.Generator().manual_seed(seed))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return self.extractor(padded, lens, generator, speeds)
