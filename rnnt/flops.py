"""Model FLOPs of a training step, and the dense matrix peak they are compared against (MFU).

Only the GEMMs count (LSTM gates, the joint's three linears); elementwise work, the loss's
lattice and the optimizer are left out, as MFU usually does. A training step is 3x the forward:
the forward GEMM, then the input and weight gradients. The counts use each utterance's own
lengths, so padding (a CUDA-graph bucket, a ragged batch) is not counted as useful work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rnnt.config import ModelConfig

# Dense fp16/bf16 tensor-core peaks from NVIDIA's datasheets (no sparsity), by the start of
# torch.cuda.get_device_name(). The SXM parts of H100 and H200 share a chip and clocks.
DATASHEET_PEAK_TFLOPS = {
    "NVIDIA H200": 989.4,
    "NVIDIA H100 80GB HBM3": 989.4,
    "NVIDIA H100 PCIe": 756.5,
    "NVIDIA H100 NVL": 835.5,
    "NVIDIA A100": 312.0,
}


def lstm_flops(in_size: int, hidden: int, steps: np.ndarray | int) -> np.ndarray | int:
    """Forward GEMM FLOPs of one LSTM layer per sequence of `steps`: 4H x (in + H) per step."""
    return 2 * steps * 4 * hidden * (in_size + hidden)


def step_flops(cfg: ModelConfig, frames: Sequence[int], tokens: Sequence[int]) -> int:
    """Model FLOPs of one training step (forward + backward) over utterances of `frames` model
    input frames (after splicing) and `tokens` labels each."""
    t = np.asarray(frames, dtype=np.int64)
    u1 = np.asarray(tokens, dtype=np.int64) + 1
    if t.shape != u1.shape:
        raise ValueError(f"step_flops: {t.size} frame counts but {u1.size} token counts")
    h, f = cfg.enc_n_hid, cfg.enc_stack_time_factor
    t2 = -(-t // f)
    fwd = np.zeros_like(t)
    for i in range(cfg.enc_pre_rnn_layers):
        fwd += lstm_flops(cfg.in_feats if i == 0 else h, h, t)
    for i in range(cfg.enc_post_rnn_layers):
        fwd += lstm_flops(h * f if i == 0 else h, h, t2)
    fwd += 2 * t2 * h * cfg.joint_n_hid  # joint_enc
    p = cfg.pred_n_hid
    fwd += cfg.pred_rnn_layers * lstm_flops(p, p, u1)
    fwd += 2 * u1 * p * cfg.joint_n_hid  # joint_pred
    fwd += 2 * t2 * u1 * cfg.joint_n_hid * cfg.n_classes  # joint fc over the (T, U+1) lattice
    return int(3 * fwd.sum())


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> tuple[float | None, str]:
    """(FLOP/s, where the number comes from) of the device's dense fp16 matrix peak.

    A positive override (training.peak_tflops) wins; a GPU missing from the table, and the CPU,
    give (None, reason): MFU is then not reported.
    """
    if override_tflops > 0:
        return override_tflops * 1e12, "training.peak_tflops"
    if device.type != "cuda":
        return None, "no peak for the CPU"
    name = torch.cuda.get_device_name(device)
    for prefix, tflops in DATASHEET_PEAK_TFLOPS.items():
        if name.startswith(prefix):
            return tflops * 1e12, f"{name}, dense fp16 datasheet"
    return None, f"{name} has no datasheet peak here (set training.peak_tflops)"
