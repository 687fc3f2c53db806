"""Device-side batch transforms: SpecAugment, frame splicing, padding to the model's layout.

Everything here runs on the batch's device with tensor ops only: no `.item()`, no data-
dependent shapes, no Python loop over the batch, so the transform never waits for the GPU
(checked with `torch.cuda.set_sync_debug_mode("error")` in the GPU test) and its random numbers
come from a caller-owned `torch.Generator` (reproducible, checkpointable).

Shapes: B batch, F = n_mels feature bins, T raw frames (10 ms hop),
T' = ceil(T / subsample) spliced frames.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rnnt.config import FeaturesConfig, SpecAugmentConfig
from rnnt.data.batch import FeatureBatch, ModelBatch


def _uniform_int(u: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Map uniform floats u in [0, 1) to integers uniform in [0, count); count >= 1."""
    # clamp: float32 rounding can give u * count == count for u just below 1
    return torch.minimum((u * count).long(), count - 1)


def _interval_mask(start: torch.Tensor, width: torch.Tensor, size: int) -> torch.Tensor:
    """(B, M) intervals [start, start + width) -> (B, size) bool: covered by any interval."""
    pos = torch.arange(size, device=start.device)
    covered = (pos >= start[..., None]) & (pos < (start + width)[..., None])
    return covered.any(dim=1)


class SpecAugment(nn.Module):
    """Frequency and adaptive time masks (docs/SPEC.md "SpecAugment": 2 x [0, 20] bins, 10 x up
    to 3% of length).

    Frequency mask widths are uniform integers in [min_freq, max_freq], time mask widths are
    uniform integers in [min_time, max(min_time, floor(max_time * len))] for each utterance
    (never more than len); starts are uniform over the positions where the whole mask fits
    (inside the F bins, inside the utterance's valid frames). Masks may overlap. Masked values
    become 0, the mean of the normalized features.
    """

    def __init__(self, cfg: SpecAugmentConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.generator = generator

    def _rand(self, *shape: int, device: torch.device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=device)

    def draw(
        self, lens: torch.Tensor, n_freq: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random masks for lens (B,): freq (start, width) each (B, freq_masks) and time
        (start, width) each (B, time_masks), int64 on lens.device."""
        cfg = self.cfg
        if cfg.freq_masks and cfg.max_freq > n_freq:
            raise ValueError(f"spec_augment.max_freq {cfg.max_freq} > {n_freq} feature bins")
        b, dev = lens.shape[0], lens.device
        # bounds stay Python ints: a tensor built from a host scalar would be a synchronizing
        # host-to-device copy
        f_width = torch.randint(
            cfg.min_freq,
            cfg.max_freq + 1,
            (b, cfg.freq_masks),
            generator=self.generator,
            device=dev,
        )
        f_start = _uniform_int(self._rand(b, cfg.freq_masks, device=dev), n_freq - f_width + 1)
        lens = lens[:, None]
        # float64: floor(max_time * len) as Python computes it, for any max_time and length
        t_max = torch.clamp((lens.double() * cfg.max_time).floor().long(), min=cfg.min_time)
        t_width = cfg.min_time + _uniform_int(
            self._rand(b, cfg.time_masks, device=dev), t_max - cfg.min_time + 1
        )
        t_width = torch.minimum(t_width, lens)
        t_start = _uniform_int(self._rand(b, cfg.time_masks, device=dev), lens - t_width + 1)
        return f_start, f_width, t_start, t_width

    def masks(
        self, lens: torch.Tensor, n_freq: int, n_frames: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bool masks for lens (B,): frequency (B, n_freq) and time (B, n_frames)."""
        f_start, f_width, t_start, t_width = self.draw(lens, n_freq)
        return _interval_mask(f_start, f_width, n_freq), _interval_mask(t_start, t_width, n_frames)

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """x (B, F, T), lens (B,) -> masked copy of x (B, F, T)."""
        freq, time = self.masks(lens, x.shape[1], x.shape[2])
        return x.masked_fill(freq[:, :, None] | time[:, None, :], 0.0)


def spliced_length(lens: torch.Tensor, subsample: int) -> torch.Tensor:
    """Spliced frames per utterance: ceil(lens / subsample)."""
    return torch.div(lens + subsample - 1, subsample, rounding_mode="floor")


class FrameSplicing(nn.Module):
    """Stack `stack` consecutive frames, keep every `subsample`-th: (B, F, T) -> (B, stack*F, T').

    Output frame i is the concatenation of input frames subsample*i + k, k = 0..stack-1
    (feature index k*F + f holds bin f of frame subsample*i + k); frames past the end of the
    tensor are zero. T' = ceil(T / subsample) and lengths become ceil(len / subsample): the last
    output frame of an utterance may reach past its length, where the input must be zero
    (FeatureBatch guarantees it; BatchTransform enforces it). With stack = subsample = 3
    (docs/SPEC.md "Features") this is NVIDIA's stack-then-subsample of 240 features.
    """

    def __init__(self, stack: int, subsample: int) -> None:
        super().__init__()
        if stack < 1 or subsample < 1:
            raise ValueError(f"frame_stack {stack} and frame_subsample {subsample} must be >= 1")
        self.stack = stack
        self.subsample = subsample

    def padded_frames(self, n_frames: int) -> int:
        """Input frames (with zero padding) that the T' windows of T = n_frames frames read."""
        t_out = -(-n_frames // self.subsample)
        return max(n_frames, (t_out - 1) * self.subsample + self.stack)

    def windows(self, padded: torch.Tensor) -> torch.Tensor:
        """padded (B, F, padded_frames(T)) -> strided view (B, F, T', stack)."""
        return padded.unfold(2, self.stack, self.subsample)

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, F, T), lens (B,) -> (B, stack*F, T'), (B,)."""
        win = self.windows(F.pad(x, (0, self.padded_frames(x.shape[2]) - x.shape[2])))
        b, f, t_out, k = win.shape
        spliced = win.permute(0, 3, 1, 2).reshape(b, k * f, t_out)
        return spliced, spliced_length(lens, self.subsample)


class BatchTransform(nn.Module):
    """FeatureBatch (B, n_mels, T) -> ModelBatch (T', B, pad_features_to) in `dtype`.

    Train: SpecAugment -> zero frames past each length -> splice -> pad features -> transpose
    and cast. Eval: the same without SpecAugment. Zeroing happens on the raw frames (in the
    same masked fill as SpecAugment), so spliced frames past ceil(len/subsample) are zero too,
    whatever the input held there. The splice, padding, transpose and cast are one copy into a
    zeroed output buffer.
    """

    def __init__(
        self,
        features_cfg: FeaturesConfig,
        train: bool,
        dtype: torch.dtype,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        cfg = features_cfg
        self.n_mels = cfg.n_mels
        self.splice = FrameSplicing(cfg.frame_stack, cfg.frame_subsample)
        self.out_feats = cfg.pad_features_to
        self.spec_augment = SpecAugment(cfg.spec_augment, generator) if train else None
        self.dtype = dtype

    def forward(self, batch: FeatureBatch) -> ModelBatch:
        feats, lens = batch.feats, batch.feat_lens
        if feats.dim() != 3 or feats.shape[1] != self.n_mels:
            raise ValueError(
                f"FeatureBatch.feats must be (B, n_mels={self.n_mels}, T), got {tuple(feats.shape)}"
            )
        b, n_freq, t = feats.shape
        t_pad = self.splice.padded_frames(t)
        mask = torch.arange(t_pad, device=feats.device) >= lens[:, None]  # (B, T_pad)
        if self.spec_augment is not None:
            freq, time = self.spec_augment.masks(lens, n_freq, t_pad)
            mask = (mask | time)[:, None, :] | freq[:, :, None]
        else:
            mask = mask[:, None, :]
        # out of place: F.pad may hand back its input, which belongs to the caller
        padded = F.pad(feats, (0, t_pad - t)).masked_fill(mask, 0.0)
        win = self.splice.windows(padded)
        t_out, stack = win.shape[2], win.shape[3]
        out = torch.zeros((t_out, b, self.out_feats), dtype=self.dtype, device=feats.device)
        out[:, :, : stack * n_freq].view(t_out, b, stack, n_freq).copy_(win.permute(2, 0, 3, 1))
        return ModelBatch(
            feats=out,
            feat_lens=spliced_length(lens, self.splice.subsample),
            tokens=batch.tokens,
            token_lens=batch.token_lens,
            utt_ids=batch.utt_ids,
            transcripts=batch.transcripts,
            host_lens=None
            if batch.host_lens is None
            else (spliced_length(batch.host_lens[0], self.splice.subsample), batch.host_lens[1]),
        )
