"""The batch contract between the input pipelines and the model.

Every loader backend (DALI, torch-native, synthetic) yields `FeatureBatch`es; the GPU-side
transforms in `rnnt.data.augment` turn one into a `ModelBatch`, the model's input layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FeatureBatch:
    """Normalized log-mel features as the pipeline produces them, before SpecAugment/splicing.

    feats:      (B, n_mels, T) float32, per-feature normalized; frames past feat_lens are 0.
    feat_lens:  (B,) int64, valid frames per utterance (10 ms hop), every one >= 1.
    tokens:     (B, U) int64 token ids in [0, vocab_size), padded with 0 past token_lens.
    token_lens: (B,) int64, every one >= 1 for training batches.
    utt_ids:    B utterance ids (manifest order key), for evaluation output and debugging.
    transcripts: B normalized reference transcripts (evaluation computes WER against these).
    host_lens:  (feat_lens, token_lens) as CPU tensors: every loader sets them (the fused loss
                sizes its packed lattice from them without reading the device; without them
                it computes the padded box).
    """

    feats: torch.Tensor
    feat_lens: torch.Tensor
    tokens: torch.Tensor
    token_lens: torch.Tensor
    utt_ids: list[str] = field(default_factory=list)
    transcripts: list[str] = field(default_factory=list)
    host_lens: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device | str, non_blocking: bool = True) -> FeatureBatch:
        """The batch on `device`. Copies to a GPU are asynchronous (non_blocking); copies to
        the host are not: a non-blocking device-to-host copy returns before the data has
        arrived, and whoever reads it next would read whatever the memory held."""
        non_blocking = non_blocking and torch.device(device).type != "cpu"
        return FeatureBatch(
            self.feats.to(device, non_blocking=non_blocking),
            self.feat_lens.to(device, non_blocking=non_blocking),
            self.tokens.to(device, non_blocking=non_blocking),
            self.token_lens.to(device, non_blocking=non_blocking),
            self.utt_ids,
            self.transcripts,
            self.host_lens,
        )

    def __len__(self) -> int:
        return self.feats.shape[0]


@dataclass
class ModelBatch:
    """What `RNNT.forward` and the loss consume.

    feats:      (T, B, in_feats) in the model's dtype: spliced frames (stack 3, subsample 3),
                zero past feat_lens and in the feature padding (240 -> 256).
    feat_lens:  (B,) int64, spliced frames per utterance = ceil(raw_frames / subsample).
    tokens, token_lens, utt_ids, transcripts: as in FeatureBatch.
    host_lens:  (feat_lens, token_lens) on the CPU, when FeatureBatch.host_lens was known.
    """

    feats: torch.Tensor
    feat_lens: torch.Tensor
    tokens: torch.Tensor
    token_lens: torch.Tensor
    utt_ids: list[str] = field(default_factory=list)
    transcripts: list[str] = field(default_factory=list)
    host_lens: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.feats.shape[1]
