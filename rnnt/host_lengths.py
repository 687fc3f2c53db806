"""Per-utterance lengths that the caller holds as host integers (the input pipeline knows them),
handed to a loss backend so it can size packed buffers without reading the device (a sync)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

HostLens = tuple[Sequence[int], Sequence[int]]  # (encoder frames T_b, target tokens U_b)


def check_host_lens(host_lens: HostLens, bsz: int, t_max: int, u_max: int) -> tuple[list, list]:
    """host_lens as two int lists, checked against the padded shapes: B of each, T_b in
    [1, t_max], U_b in [0, u_max]. Raises ValueError naming `host_lens` and the utterance."""
    t_lens, u_lens = (list(map(int, lens)) for lens in host_lens)
    if len(t_lens) != bsz or len(u_lens) != bsz:
        raise ValueError(
            f"host_lens: expected {bsz} frame and {bsz} label lengths, got {len(t_lens)} and "
            f"{len(u_lens)}"
        )
    # min / max check the common case fast (this runs before the loss's first launch); the
    # loop below finds the utterance to name
    t_ok = not t_lens or (min(t_lens) >= 1 and max(t_lens) <= t_max)
    if t_ok and (not u_lens or (min(u_lens) >= 0 and max(u_lens) <= u_max)):
        return t_lens, u_lens
    for b, (t, u) in enumerate(zip(t_lens, u_lens, strict=True)):
        if not (1 <= t <= t_max and 0 <= u <= u_max):
            raise ValueError(
                f"host_lens: utterance {b} has (T, U) = ({t}, {u}); the inputs allow T in "
                f"[1, {t_max}] and U in [0, {u_max}]"
            )
    return t_lens, u_lens


def to_device(
    values: Sequence[float] | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Host numbers (integers: lengths; the feature stage's speed ratios too) -> a device
    tensor of `dtype`, copied without blocking the host."""
    # One pinned buffer (so the copy does not block the host) per call: callers put all their
    # small host arrays in one list, as each pinning is a host allocation of its own
    # (docs/PERFORMANCE.md, "Numbers the code's comments used to quote").
    host = torch.empty(len(values), dtype=dtype, pin_memory=device.type == "cuda")
    host.numpy()[:] = values
    return host.to(device, non_blocking=True)
