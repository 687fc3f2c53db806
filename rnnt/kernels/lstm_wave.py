"""The encoder's LSTM stacks as waves of Hopper kernels: `model.encoder_lstm: wave`.

cuDNN runs an LSTM stack as one GEMM and one cell kernel per layer and time step, about 3,400
dependent launches per training step at batch 192, each too small to fill an H200.
`csrc/lstm_wave_sm90.cu` runs the (layer, step) cells of a stack several per launch (each
launch packs the cells whose inputs are ready, as many as fill the SMs), with the cell fused into
the GEMM's epilogue, and a matching backward; the design and its
measurements are in docs/PERFORMANCE.md.

Three implementations of one contract, so that each is checked against the next:
- `stack_reference`: the maths in plain PyTorch with autograd (the oracle; it is itself checked
  against nn.LSTM);
- `TorchKernels`: the two kernels' buffer contract (permuted weights, six factor planes, gate
  gradients in the permuted order) in plain PyTorch; the CPU path of `encoder_lstm: wave`, and
  the reference the CUDA kernels are compared with buffer by buffer;
- `CudaKernels`: the sm_90a kernels.
`lstm_stack` runs a stack through `_WaveStack` (autograd) with the CUDA kernels on a GPU and
`TorchKernels` elsewhere. `lstm_stack_pair` runs the encoder's two stacks and the stack-time
between them as one node, so that its backward can run the second stack's weight gradients on
a side stream beside the first stack's backward waves (`BESIDE`, not yet the default).

Dropout: a counter-based hash of (seed, layer, step, row key, unit) decides each keep
(`keep_mask`), so the backward recomputes the mask instead of storing it. A row's key is its
place in the batch as the caller gave it, so a padded batch leaves the real rows' masks
unchanged, and rows reordered by length (`model.encoder_gemms: packed`) keep their masks. The
seed is a one-element int32 tensor on the device, drawn from torch's generator on every call,
so CUDA-graph replays draw fresh masks.

Padding steps: given the batch's lengths, the steps past the longest are padding (a CUDA-graph
bucket is longer than most batches run through it). The kernels skip them on the device, and
their outputs there are zero; everything before them is what the stack of the shorter length
computes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from rnnt.kernels.cuda_build import SM90A_FLAGS, BuildError, hopper_missing, load

# one layer's nn.LSTM parameters: w_ih (4H, K), w_hh (4H, H), b_ih (4H,), b_hh (4H,); gates
# (i, f, g, o) as nn.LSTM orders them
LayerWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

SOURCE = Path(__file__).parent / "csrc" / "lstm_wave_sm90.cu"
HIDDEN = 1024  # the kernels' hidden size
MAX_LAYERS = 3
BATCH_MULTIPLE = 192  # the backward's clusters pair two 96-row batch tiles
BATCH_TILE = 96
INPUT_MULTIPLE = 64  # one K stage of the kernels
# launch variants (csrc: kFwdVariants, kBwdVariants: 0 without, 1 with programmatic dependent
# launch, 2 as 1 with L2 eviction priorities on the TMA copies, 3 as 2 with every MMA split in
# two accumulation chains); bench/encoder_lstm.py times them all, and checks that they give the
# same bits
FORWARD_VARIANT = 2
BACKWARD_VARIANT = 2
# The encoder's post-RNN weight gradients beside its pre-RNN backward waves (lstm_stack_pair),
# on a grid of this many programs (0: one per work item), where both stacks run packed GEMMs;
# None: after them, as two stacks. bench/train_step.py --beside times it in the Trainer.
BESIDE: int | None = None
N_FACTORS = 6

_M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------
# dropout


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors of uint32 values, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' 32-bit mixer (lowbias32) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def drop_threshold(p: float) -> int:
    """A row is dropped when its 16 key bits are below this; p is rounded as the kernels' fp32."""
    p32 = struct.unpack("f", struct.pack("f", p))[0]
    return int(p32 * 65536.0 + 0.5)


def keep_mask(
    seed: torch.Tensor,
    layer: int,
    steps: int,
    batch: int,
    hidden: int,
    p: float,
    row_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which elements of layer `layer`'s output survive dropout: bool (steps, batch, hidden).

    One 32-bit hash per (step, pair of row keys, unit), 16 bits per key: a row's key is its
    place in the batch (`row_keys` (batch,), default 0, 1, ...), so the first rows of a larger
    batch get the same mask, and rows that run in another order keep theirs when `row_keys`
    says where each came from. `seed` is a one-element integer tensor; the result is on its
    device, computed without a host sync.
    """
    device = seed.device
    s = seed.reshape(()).to(torch.int64) & _M32
    layer_seed = mix32((s + 0x9E3779B9 * (layer + 1)) & _M32)
    t = torch.arange(steps, dtype=torch.int64, device=device)
    step_seed = mix32((layer_seed + 0x85EBCA6B * (t + 1)) & _M32).view(steps, 1, 1)
    if row_keys is None:
        b = torch.arange(batch, dtype=torch.int64, device=device).view(1, batch, 1)
    else:
        b = row_keys.to(device, torch.int64).view(1, batch, 1)
    unit = torch.arange(hidden, dtype=torch.int64, device=device).view(1, 1, hidden)
    key = mix32(step_seed ^ (((b >> 1) * hidden + unit) & _M32))
    bits = torch.where(b % 2 == 1, key >> 16, key & 0xFFFF)
    return bits >= drop_threshold(p)


def _dropout_scale(p: float) -> float:
    return 1.0 / (1.0 - p)


# ----------------------------------------------------------------------------------------------
# the oracle


def stack_reference(
    x: torch.Tensor, layers: Sequence[LayerWeights], p: float, seed: torch.Tensor
) -> torch.Tensor:
    """An LSTM stack with `keep_mask` dropout after every layer, in plain PyTorch (autograd).

    x (T, B, K) -> (T, B, H), zero initial state, in x's dtype.
    """
    steps, batch, _ = x.shape
    for index, (w_ih, w_hh, b_ih, b_hh) in enumerate(layers):
        hidden = w_hh.shape[1]
        pre = x @ w_ih.T + (b_ih + b_hh)
        h = x.new_zeros(batch, hidden)
        c = x.new_zeros(batch, hidden)
        out = []
        for t in range(steps):
            i, f, g, o = (pre[t] + h @ w_hh.T).chunk(4, 1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            out.append(h)
        x = torch.stack(out)
        if p > 0:
            x = x * keep_mask(seed, index, steps, batch, hidden, p) * _dropout_scale(p)
    return x


# ----------------------------------------------------------------------------------------------
# the kernels' contract


def gate_permutation(hidden: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The kernels' row order of [W_ih | W_hh] and of the gate gradients: row j is nn.LSTM's
    row perm[j]. In tile n of 128 rows, row 64 half + 16 warp + 8 i + r is gate 2 half + i of
    unit 32 n + 8 warp + r, so that wgmma's accumulator layout gives each thread all four gates
    of one unit."""
    if hidden % 32:
        raise ValueError(
            f"the wave kernels' gate order needs a hidden size divisible by 32, not {hidden}"
        )
    j = torch.arange(4 * hidden, device=device)
    n, m = j // 128, j % 128
    half, warp, i, r = m // 64, (m % 64) // 16, (m % 16) // 8, m % 8
    return (2 * half + i) * hidden + 32 * n + 8 * warp + r


class TorchKernels:
    """The two kernels' contract in plain PyTorch: the same buffers, filled with the same maths
    (csrc/lstm_wave_sm90.cu documents each buffer). Arithmetic in fp32 for fp16 buffers, in the
    buffers' dtype otherwise."""

    @staticmethod
    def _acc(dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    @staticmethod
    def _active(active: torch.Tensor | None, steps: int) -> int:
        return steps if active is None else max(0, min(steps, int(active.item())))

    def forward(
        self,
        x,
        hseq,
        yseq,
        cstate,
        factors,
        bias,
        w,
        p,
        seed,
        x_gates=None,
        active=None,
        row_keys=None,
    ) -> None:
        """x_gates: None, or the first layer's x W_ih^T [T*B, 4H] (permuted columns) from one
        GEMM before the waves; then x is not read and w[0] is W_hh alone [4H, H]. active: None,
        or a one-element int32 tensor n: steps t >= n are padding (h and yseq zero there, their
        factors not written, cstate c(n - 1)). factors: None when no backward follows.
        row_keys: None, or the rows' dropout keys, int32 (B,) (see keep_mask)."""
        hidden = hseq[0].shape[1]
        batch = cstate[0].shape[0]
        steps = yseq[0].shape[0] // batch
        n_active = self._active(active, steps)
        acc = self._acc(w[0].dtype)
        perm = gate_permutation(hidden, w[0].device)
        scale = _dropout_scale(p)
        for layer in range(len(w)):
            hoisted = layer == 0 and x_gates is not None
            if hoisted:
                inp = x_gates.view(steps, batch, -1)
            else:
                inp = (x if layer == 0 else yseq[layer - 1]).view(steps, batch, -1)
            hs = hseq[layer].view(steps + 1, batch, hidden)
            weight = w[layer].to(acc)
            keep = keep_mask(seed, layer, steps, batch, hidden, p, row_keys) if p > 0 else None
            c = cstate[layer].to(acc)
            for t in range(steps):
                if t >= n_active:
                    hs[t + 1] = 0
                    yseq[layer].view(steps, batch, hidden)[t] = 0
                    continue
                if hoisted:
                    z_perm = hs[t].to(acc) @ weight.T + bias[layer].to(acc) + inp[t].to(acc)
                else:
                    z_perm = torch.cat([inp[t], hs[t]], 1).to(acc) @ weight.T + bias[layer].to(acc)
                z = torch.empty_like(z_perm)
                z[:, perm] = z_perm
                i, f, g, o = z.chunk(4, 1)
                i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
                c_prev = c
                c = f * c_prev + i * g
                tc = c.tanh()
                hs[t + 1] = o * tc
                h = hs[t + 1].to(acc)  # the kernels drop out the rounded h
                y = h if keep is None else torch.where(keep[t], h * scale, 0.0)
                yseq[layer].view(steps, batch, hidden)[t] = y
                if factors is None:
                    continue
                plane = factors[layer].view(N_FACTORS, steps, batch, hidden)[:, t]
                plane[0] = o * (1 - tc * tc)
                plane[1] = g * i * (1 - i)
                plane[2] = c_prev * f * (1 - f)
                plane[3] = i * (1 - g * g)
                plane[4] = tc * o * (1 - o)
                plane[5] = f
            cstate[layer].copy_(c)

    def backward(
        self, kin, wt, dz, fac, dc, dbias, dy_top, p, seed, active=None, row_keys=None
    ) -> None:
        """active and row_keys: the forward's; dz and the partial sums are zero at the padding
        steps, and dy_top is not read there."""
        layers = len(wt)
        batch, hidden = dc[0].shape
        steps = dy_top.shape[0] // batch
        n_active = self._active(active, steps)
        acc = self._acc(wt[0].dtype)
        perm = gate_permutation(hidden, wt[0].device)
        scale = _dropout_scale(p)
        for layer in reversed(range(layers)):
            w_hh = wt[layer][kin[layer] :].to(acc)  # (H, 4H): W_hh^T, permuted gate columns
            above = None if layer == layers - 1 else wt[layer + 1][: kin[layer + 1]].to(acc)
            keep = keep_mask(seed, layer, steps, batch, hidden, p, row_keys) if p > 0 else None
            planes = fac[layer].view(N_FACTORS, steps, batch, hidden).to(acc)
            gates = dz[layer].view(steps, batch, 4 * hidden)
            tiles = dbias[layer].view(steps, batch // BATCH_TILE, 4 * hidden)
            gates[n_active:] = 0
            tiles[n_active:] = 0
            dc_next = None
            for t in reversed(range(n_active)):
                if above is None:
                    dy = dy_top.view(steps, batch, hidden)[t].to(acc)
                else:
                    dy = dz[layer + 1].view(steps, batch, 4 * hidden)[t].to(acc) @ above.T
                if keep is not None:
                    dy = torch.where(keep[t], dy * scale, 0.0)
                dh = dy if t == n_active - 1 else dy + gates[t + 1].to(acc) @ w_hh.T
                a1, a2, a3, a4, a5, _ = planes[:, t]
                d_cell = dh * a1
                if dc_next is not None:
                    d_cell = d_cell + planes[5, t + 1] * dc_next
                dc_next = d_cell
                dz_gates = torch.cat([d_cell * a2, d_cell * a3, d_cell * a4, dh * a5], 1)
                gates[t] = dz_gates[:, perm]
                tiles[t] = gates[t].to(acc).view(batch // BATCH_TILE, BATCH_TILE, -1).sum(1)
            if dc_next is not None:
                dc[layer].copy_(dc_next)


class CudaKernels:
    """The sm_90a kernels (csrc/lstm_wave_sm90.cu), queued on the current stream."""

    def __init__(
        self, forward_variant: int = FORWARD_VARIANT, backward_variant: int = BACKWARD_VARIANT
    ):
        self.forward_variant = forward_variant
        self.backward_variant = backward_variant
        self.lib = library()

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(
                f"LSTM wave kernels, {what}: {self.lib.wave_lstm_error(rc).decode()}"
            )

    @staticmethod
    def _ptrs(tensors: Sequence[torch.Tensor]):
        return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])

    @staticmethod
    def _ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p:
        return ctypes.c_void_p(None if tensor is None else tensor.data_ptr())

    def forward(
        self,
        x,
        hseq,
        yseq,
        cstate,
        factors,
        bias,
        w,
        p,
        seed,
        x_gates=None,
        active=None,
        row_keys=None,
    ) -> None:
        layers = len(w)
        batch = cstate[0].shape[0]
        steps = yseq[0].shape[0] // batch
        device = w[0].device
        kin = [0 if x_gates is not None else x.shape[1]] + [HIDDEN] * (layers - 1)
        inputs = [x, *yseq[:-1]]  # x is not read where x_gates stands in for it
        xw = (ctypes.c_void_p * layers)(None if x_gates is None else x_gates.data_ptr())
        rc = self.lib.wave_lstm_forward(
            device.index,
            layers,
            steps,
            batch,
            (ctypes.c_int * layers)(*kin),
            self._ptrs(inputs),
            xw,
            self._ptrs(hseq),
            self._ptrs(yseq),
            self._ptrs(cstate),
            None if factors is None else self._ptrs(factors),
            self._ptrs(bias),
            self._ptrs(w),
            ctypes.c_float(p),
            self._ptr(seed),
            self._ptr(active),
            self._ptr(row_keys),
            self.forward_variant,
            ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream),
        )
        self._check(rc, "forward")

    def backward(
        self, kin, wt, dz, fac, dc, dbias, dy_top, p, seed, active=None, row_keys=None
    ) -> None:
        layers = len(wt)
        batch = dc[0].shape[0]
        steps = dy_top.shape[0] // batch
        device = wt[0].device
        rc = self.lib.wave_lstm_backward(
            device.index,
            layers,
            steps,
            batch,
            (ctypes.c_int * layers)(*kin),
            self._ptrs(wt),
            self._ptrs(dz),
            self._ptrs(fac),
            self._ptrs(dc),
            self._ptrs(dbias),
            ctypes.c_void_p(dy_top.data_ptr()),
            ctypes.c_float(p),
            self._ptr(seed),
            self._ptr(active),
            self._ptr(row_keys),
            self.backward_variant,
            ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream),
        )
        self._check(rc, "backward")


def library() -> ctypes.CDLL:
    """The built kernel library (compiled on first use; raises BuildError)."""
    lib = load(SOURCE, SM90A_FLAGS)
    if not getattr(lib, "_typed", False):
        ptrs = ctypes.POINTER(ctypes.c_void_p)
        lib.wave_lstm_forward.argtypes = (
            [ctypes.c_int] * 4
            + [ctypes.POINTER(ctypes.c_int)]
            + [ptrs] * 8
            + [ctypes.c_float]
            + [ctypes.c_void_p] * 3
            + [ctypes.c_int, ctypes.c_void_p]
        )
        lib.wave_lstm_forward.restype = ctypes.c_int
        lib.wave_lstm_backward.argtypes = (
            [ctypes.c_int] * 4
            + [ctypes.POINTER(ctypes.c_int)]
            + [ptrs] * 5
            + [
                ctypes.c_void_p,
                ctypes.c_float,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
        )
        lib.wave_lstm_backward.restype = ctypes.c_int
        lib.wave_lstm_error.argtypes = [ctypes.c_int]
        lib.wave_lstm_error.restype = ctypes.c_char_p
        lib.wave_lstm_variants.argtypes = [ctypes.c_int]
        lib.wave_lstm_variants.restype = ctypes.c_int
        lib.wave_lstm_kept.argtypes = [ctypes.c_uint32] + [ctypes.c_int] * 4 + [ctypes.c_float]
        lib.wave_lstm_kept.restype = ctypes.c_int
        ints = ctypes.POINTER(ctypes.c_int)
        lib.wave_lstm_schedule.argtypes = [ctypes.c_int] * 5 + [ints] * 3 + [ctypes.c_int]
        lib.wave_lstm_schedule.restype = ctypes.c_int
        lib._typed = True
    return lib


def launch_schedule(
    backward: bool, n_layers: int, steps: int, batch: int, n_sms: int
) -> list[list[tuple[int, int]]]:
    """The (layer, t) cells of each launch that the kernels' host code queues for a stack on a
    GPU of `n_sms` SMs, in launch order (csrc: wave_schedule)."""
    lib = library()
    cap = n_layers * steps
    layer, t, count = (
        (ctypes.c_int * (3 * cap))(),
        (ctypes.c_int * (3 * cap))(),
        (ctypes.c_int * cap)(),
    )
    n = lib.wave_lstm_schedule(int(backward), n_layers, steps, batch, n_sms, layer, t, count, cap)
    if n < 0:
        raise ValueError(f"no schedule for {n_layers} layers x {steps} steps")
    return [[(layer[3 * i + j], t[3 * i + j]) for j in range(count[i])] for i in range(n)]


def unsupported(device: torch.device, hidden: int, n_layers: int) -> str | None:
    """Why the CUDA kernels cannot run a stack of `n_layers` of `hidden` units here, or None."""
    missing = hopper_missing(device)
    if missing is not None:
        return f"they need {missing}"
    if hidden != HIDDEN or not 1 <= n_layers <= MAX_LAYERS:
        return (
            f"they run stacks of 1 to {MAX_LAYERS} layers of hidden size {HIDDEN} (this one: "
            f"{n_layers} layers of {hidden})"
        )
    try:
        library()
    except BuildError as err:
        return str(err)
    return None


_default_kernels: list[CudaKernels] = []  # the one lstm_stack runs when given none


def _cuda_kernels() -> CudaKernels:
    if not _default_kernels:
        _default_kernels.append(CudaKernels())
    return _default_kernels[0]


def use_variants(forward: int, backward: int) -> None:
    """Makes lstm_stack run launch variants `forward` and `backward` (see FORWARD_VARIANT)
    wherever no `kernels` is passed: how bench/train_step.py times them in the real Trainer."""
    lib = library()
    for name, variant, count in (
        ("forward", forward, lib.wave_lstm_variants(0)),
        ("backward", backward, lib.wave_lstm_variants(1)),
    ):
        if not 0 <= variant < count:
            raise ValueError(f"no {name} wave variant {variant}: the kernels have 0 to {count - 1}")
    _default_kernels[:] = [CudaKernels(forward, backward)]


# ----------------------------------------------------------------------------------------------
# autograd


class DenseGemms:
    """The stack's GEMMs outside the waves over every row, padding included: torch's matmul
    (cuBLAS on a GPU), and the reference of rnnt.kernels.packed_gemm.PackedGemms."""

    @staticmethod
    def rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    @staticmethod
    def weight_grad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.t() @ b


@dataclasses.dataclass
class _StackRun:
    """What one stack's forward leaves for its backward: its settings, and the tensors its
    backward reads (kept as the autograd Function's saved tensors in between)."""

    kernels: object
    gemms: object
    p: float
    steps: int
    batch: int
    k_in: int
    n_layers: int
    hidden: int
    active: torch.Tensor | None  # None is a valid value: not saved with the tensors
    row_keys: torch.Tensor | None  # the same
    seed: torch.Tensor | None = None
    x_rows: torch.Tensor | None = None
    w: Sequence[torch.Tensor] = ()
    hseq: Sequence[torch.Tensor] = ()
    yseq: Sequence[torch.Tensor] = ()  # every layer's but the last (the stack's output)
    factors: Sequence[torch.Tensor] = ()

    def tensors(self) -> list[torch.Tensor]:
        return [self.seed, self.x_rows, *self.w, *self.hseq, *self.yseq, *self.factors]

    def settings(self) -> _StackRun:
        return dataclasses.replace(self, seed=None, x_rows=None, w=(), hseq=(), yseq=(), factors=())

    def with_tensors(self, saved: Sequence[torch.Tensor]) -> _StackRun:
        n = self.n_layers
        seed, x_rows, *rest = saved
        return dataclasses.replace(
            self,
            seed=seed,
            x_rows=x_rows,
            w=rest[:n],
            hseq=rest[n : 2 * n],
            yseq=rest[2 * n : 3 * n - 1],
            factors=rest[3 * n - 1 :],
        )


def _stack_forward(
    kernels, gemms, p, keep_factors, seed, active, row_keys, x, flat
) -> tuple[torch.Tensor, _StackRun]:
    """One stack's forward (see _WaveStack): its output (T, B, H) and what its backward needs."""
    steps, batch, k_in = x.shape
    n_layers, hidden = len(flat) // 4, flat[1].shape[1]
    acc = TorchKernels._acc(x.dtype)
    # recomputed per call (a few tiny kernels), not cached: a device tensor first made inside a
    # CUDA-graph capture would hold nothing until the graph's first replay
    perm = gate_permutation(hidden, x.device)
    w = [torch.cat(flat[4 * l : 4 * l + 2], 1)[perm].contiguous() for l in range(n_layers)]
    bias = [
        (flat[4 * l + 2].to(acc) + flat[4 * l + 3].to(acc))[perm].contiguous()
        for l in range(n_layers)
    ]
    rows = steps * batch
    x_rows = x.reshape(rows, k_in)
    hseq = [x.new_empty((rows + batch), hidden) for _ in range(n_layers)]
    for h in hseq:
        h[:batch].zero_()
    yseq = [x.new_empty(rows, hidden) for _ in range(n_layers)]
    cstate = [x.new_zeros(batch, hidden, dtype=acc) for _ in range(n_layers)]
    factors = (
        [x.new_empty(N_FACTORS, rows, hidden) for _ in range(n_layers)] if keep_factors else None
    )
    x_gates, w_run = None, w
    if k_in > hidden:
        # The first layer's cells would take the longest K of the stack and set the pace of
        # every launch they share; its input part is one GEMM before the waves instead (as
        # cuDNN does it), and its cells run W_hh alone.
        x_gates = gemms.rows(x_rows, w[0][:, :k_in].T)
        w_run = [w[0][:, k_in:].contiguous(), *w[1:]]
    kernels.forward(
        x_rows, hseq, yseq, cstate, factors, bias, w_run, p, seed, x_gates, active, row_keys
    )
    run = _StackRun(
        kernels,
        gemms,
        p,
        steps,
        batch,
        k_in,
        n_layers,
        hidden,
        active,
        row_keys,
        seed,
        x_rows,
        w,
        hseq,
        yseq[:-1],
        factors or [],
    )
    return yseq[-1].view(steps, batch, hidden), run


def _stack_waves_backward(run: _StackRun, grad_y: torch.Tensor):
    """The backward waves: the gate gradients dz per layer, and their partial sums per (step,
    batch tile) from the kernels' epilogue (a separate reduction would read dz again)."""
    rows, dtype = run.steps * run.batch, run.x_rows.dtype
    acc = TorchKernels._acc(dtype)
    kin = [run.k_in] + [run.hidden] * (run.n_layers - 1)
    wt = [weight.t().contiguous() for weight in run.w]
    dz = [run.x_rows.new_empty(rows, 4 * run.hidden) for _ in range(run.n_layers)]
    dc = [run.x_rows.new_empty(run.batch, run.hidden, dtype=acc) for _ in range(run.n_layers)]
    dbias = [run.x_rows.new_empty(rows // BATCH_TILE, 4 * run.hidden, dtype=acc) for _ in run.w]
    dy = grad_y.to(dtype).contiguous().view(rows, run.hidden)
    run.kernels.backward(
        kin, wt, dz, run.factors, dc, dbias, dy, run.p, run.seed, run.active, run.row_keys
    )
    return dz, dbias


def _stack_weight_grads(run: _StackRun, dz, dbias, programs: int | None = None) -> list:
    """(w_ih, w_hh, b_ih, b_hh) gradients per layer, in nn.LSTM's order. `programs`: the
    packed weight gradients on a grid of that many programs (PackedGemms.weight_grad)."""
    # dz's columns are in the permuted gate order, so the weight gradients' rows are too
    inverse = torch.argsort(gate_permutation(run.hidden, run.x_rows.device))
    rows, dtype = run.steps * run.batch, run.x_rows.dtype
    capped = {} if programs is None else {"programs": programs}
    grads = []
    for layer in range(run.n_layers):
        inp = run.x_rows if layer == 0 else run.yseq[layer - 1]
        grad_bias = dbias[layer].sum(0)[inverse].to(dtype)
        grads += [
            run.gemms.weight_grad(dz[layer], inp, **capped)[inverse],
            run.gemms.weight_grad(dz[layer], run.hseq[layer][:rows], **capped)[inverse],
            grad_bias,
            grad_bias,
        ]
    return grads


def _stack_input_grad(run: _StackRun, dz) -> torch.Tensor:
    return run.gemms.rows(dz[0], run.w[0][:, : run.k_in]).view(run.steps, run.batch, run.k_in)


class _WaveStack(torch.autograd.Function):
    """y = stack(x) through a kernels object (TorchKernels or CudaKernels) and a GEMMs object
    (DenseGemms or PackedGemms). x (T, B, K) with B a multiple of BATCH_MULTIPLE and K of
    INPUT_MULTIPLE; weights in x's dtype; `active` None or the steps before the padding (a
    one-element int32 tensor on x's device); `row_keys` None or the rows' dropout keys (int32
    (B,) on x's device, see keep_mask). Without `keep_factors` (scoring: no backward
    follows) the forward writes no factor planes, six values a cell only the backward reads."""

    @staticmethod
    def forward(
        ctx,
        kernels,
        gemms,
        p: float,
        keep_factors: bool,
        seed: torch.Tensor,
        active: torch.Tensor | None,
        row_keys: torch.Tensor | None,
        x: torch.Tensor,
        *flat: torch.Tensor,
    ):
        y, run = _stack_forward(kernels, gemms, p, keep_factors, seed, active, row_keys, x, flat)
        ctx.run = run.settings()
        ctx.save_for_backward(*run.tensors())
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        run = ctx.run.with_tensors(ctx.saved_tensors)
        dz, dbias = _stack_waves_backward(run, grad_y)
        grads = _stack_weight_grads(run, dz, dbias)
        grad_x = _stack_input_grad(run, dz) if ctx.needs_input_grad[7] else None
        return (None, None, None, None, None, None, None, grad_x, *grads)


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device)
    return _side_streams[index]


class _WaveStackPair(torch.autograd.Function):
    """y = second(between(first(x))) as one autograd node, so that its backward can run the
    second stack's weight gradients on a side stream beside the first stack's backward waves,
    which leave about a quarter of an H100's or H200's SMs idle: on a grid of `beside`
    programs (PackedGemms.weight_grad's cap), joined before the node returns. `first` and
    `second`: (kernels, gemms, p, keep_factors, seed, active, row_keys) of each stack;
    `between` a differentiable function of the first stack's output that gives the second's
    input, of `second_shape` (the encoder's stack-time)."""

    @staticmethod
    def forward(ctx, first, second, between, second_shape, beside, x, n_first, *flat):
        y1, run1 = _stack_forward(*first, x, flat[: 4 * n_first])
        with torch.enable_grad():
            mid_in = y1.detach().requires_grad_()
            mid = between(mid_in)
        if tuple(mid.shape) != tuple(second_shape):
            raise ValueError(
                f"lstm_stack_pair: between gives {tuple(mid.shape)}, the second stack takes "
                f"{tuple(second_shape)}"
            )
        x2 = mid.detach().contiguous()
        y2, run2 = _stack_forward(*second, x2, flat[4 * n_first :])
        ctx.runs = (run1.settings(), run2.settings())
        ctx.between = (mid_in, mid)
        ctx.beside = beside
        t1 = run1.tensors()
        ctx.n_saved = len(t1)
        ctx.save_for_backward(*t1, *run2.tensors())
        return y2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        saved = ctx.saved_tensors
        run1 = ctx.runs[0].with_tensors(saved[: ctx.n_saved])
        run2 = ctx.runs[1].with_tensors(saved[ctx.n_saved :])
        dz2, dbias2 = _stack_waves_backward(run2, grad_y)
        grad_x2 = _stack_input_grad(run2, dz2)
        side = _side_stream(grad_y.device) if grad_y.is_cuda and ctx.beside is not None else None
        if side is None:
            grads2 = _stack_weight_grads(run2, dz2, dbias2)
        else:
            # everything it reads is referenced until the join below, so no other stream can
            # be handed its memory before the side stream is done with it
            main = torch.cuda.current_stream(grad_y.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                grads2 = _stack_weight_grads(run2, dz2, dbias2, programs=ctx.beside or None)
        mid_in, mid = ctx.between
        (grad_y1,) = torch.autograd.grad(mid, mid_in, grad_x2)
        dz1, dbias1 = _stack_waves_backward(run1, grad_y1)
        grads1 = _stack_weight_grads(run1, dz1, dbias1)
        grad_x = _stack_input_grad(run1, dz1) if ctx.needs_input_grad[5] else None
        if side is not None:
            main.wait_stream(side)
        return (None, None, None, None, None, grad_x, None, *grads1, *grads2)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class _Prepared:
    """A stack's call as _WaveStack takes it, for an input of `shape` (T, B, K)."""

    kernels: object
    dtype: torch.dtype
    pad_b: int
    pad_k: int
    flat: list[torch.Tensor]
    seed: torch.Tensor
    active: torch.Tensor | None
    row_keys: torch.Tensor | None
    gemms: object

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.pad_k or self.pad_b:  # F.pad copies even when it pads nothing
            x = F.pad(x, (0, self.pad_k, 0, self.pad_b))
        return x.contiguous()

    def call(self, p: float, keep_factors: bool) -> tuple:
        """What _stack_forward takes before the input and the weights."""
        return (self.kernels, self.gemms, p, keep_factors, self.seed, self.active, self.row_keys)


def _prepare(
    what: str,
    shape: tuple[int, int, int],
    device: torch.device,
    x_dtype: torch.dtype,
    layers: Sequence[LayerWeights],
    p: float,
    seed: torch.Tensor | None,
    kernels,
    lengths: torch.Tensor | None,
    gemms: str,
    row_keys: torch.Tensor | None,
) -> _Prepared:
    steps, batch, k_in = shape
    if seed is None and p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=device)
    elif seed is None:
        seed = torch.zeros(1, dtype=torch.int32, device=device)  # no mask reads it
    if kernels is None and device.type == "cuda":
        reason = unsupported(device, layers[0][1].shape[1], len(layers))
        if reason is not None:
            raise RuntimeError(f"model.encoder_lstm: the wave kernels cannot run: {reason}")
        kernels = _cuda_kernels()
    elif kernels is None:
        kernels = TorchKernels()
    dtype = torch.float16 if isinstance(kernels, CudaKernels) else x_dtype
    pad_b = _round_up(batch, BATCH_MULTIPLE) - batch
    pad_k = _round_up(k_in, INPUT_MULTIPLE) - k_in
    flat = []
    for index, weights in enumerate(layers):
        w_ih, w_hh, b_ih, b_hh = (t.to(dtype) for t in weights)
        if index == 0 and pad_k:
            w_ih = F.pad(w_ih, (0, pad_k))
        flat += [w_ih, w_hh, b_ih, b_hh]
    if row_keys is not None and row_keys.shape != (batch,):
        raise ValueError(
            f"{what}: row_keys must be one per batch row, shape ({batch},), not "
            f"{tuple(row_keys.shape)}"
        )
    if p == 0:
        row_keys = None  # no mask to key: the kernels without key loads run
    if row_keys is not None:
        # the batch's padding rows take keys after the real rows' (their outputs are cut off)
        pad_keys = torch.arange(batch, batch + pad_b, device=device)
        row_keys = torch.cat([row_keys.to(device), pad_keys]).to(torch.int32).contiguous()
    active = None
    if lengths is not None:
        if lengths.shape != (batch,):
            raise ValueError(
                f"{what}: lengths must be one per batch row, shape ({batch},), not "
                f"{tuple(lengths.shape)}"
            )
        lengths = lengths.to(device)
        active = lengths.amax().clamp(0, steps).to(torch.int32).reshape(1)
    if gemms == "dense":
        stack_gemms = DenseGemms()
    elif gemms == "packed":
        if lengths is None:
            raise ValueError(f"{what}: gemms='packed' needs the lengths")
        from rnnt.kernels.packed_gemm import PackedGemms  # Triton: only where it runs

        # the batch's padding rows have no frame at all
        stack_gemms = PackedGemms(F.pad(lengths, (0, pad_b)), steps)
    else:
        raise ValueError(f"{what}: gemms must be 'dense' or 'packed', not {gemms!r}")
    return _Prepared(kernels, dtype, pad_b, pad_k, flat, seed, active, row_keys, stack_gemms)


def _keeps_factors(x: torch.Tensor, flat: Sequence[torch.Tensor]) -> bool:
    """Whether a backward may follow: a graph that nothing will differentiate (scoring,
    no_grad) needs no factor planes."""
    return torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in flat))


def lstm_stack(
    x: torch.Tensor,
    layers: Sequence[LayerWeights],
    p: float,
    seed: torch.Tensor | None = None,
    kernels: CudaKernels | TorchKernels | None = None,
    lengths: torch.Tensor | None = None,
    gemms: str = "dense",
    row_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """An LSTM stack with dropout p after every layer, zero initial state: x (T, B, K) ->
    (T, B, H). By default the CUDA kernels on a GPU (fp16; an error says why where they cannot
    run) and TorchKernels elsewhere; `kernels` picks others (a launch variant, say). `seed` (a
    one-element int32 tensor on x's device) is drawn from torch's generator when not given and
    p > 0; without dropout nothing is drawn, so that scoring with these kernels between
    training steps leaves training's random streams where they were. The batch is padded to a
    multiple of 192 and the first layer's input to a multiple of 64 features, invisibly to the
    caller. `lengths` (B,): where given, the steps at and past the longest are padding:
    skipped, with zero outputs (no host sync: the count stays on the device).

    `gemms`: "dense" runs the GEMMs outside the waves (the first layer's input where it is
    hoisted, the weight and input gradients) over every row with torch's matmul; "packed" skips
    each row's padding past its own length in them (rnnt.kernels.packed_gemm: needs `lengths`,
    and pays when the rows are ordered by length). Packed assumes what the model gives: an
    output gradient that is zero at every row's padding, so the gate gradients are zero there
    too. The outputs at real frames and the gradients are then the same either way, to
    rounding; at the padding, dense computes whatever the padding gives and packed may give
    zeros.

    `row_keys` (B,) integers: each row's dropout key (keep_mask), by default its index. A
    caller that reorders the batch's rows passes each row's index before the reordering, so
    that an utterance draws the same mask wherever it runs."""
    prep = _prepare(
        "lstm_stack", x.shape, x.device, x.dtype, layers, p, seed, kernels, lengths, gemms, row_keys
    )
    batch = x.shape[1]
    x = prep.pad(x)
    call = prep.call(p, _keeps_factors(x, prep.flat))
    y = _WaveStack.apply(*call, x, *prep.flat)
    return y[:, :batch] if prep.pad_b else y


def lstm_stack_pair(
    x: torch.Tensor,
    first_layers: Sequence[LayerWeights],
    second_layers: Sequence[LayerWeights],
    p: float,
    between,
    second_shape: tuple[int, int, int],
    lengths: torch.Tensor,
    second_lengths: torch.Tensor,
    row_keys: torch.Tensor | None = None,
    beside: int | None = None,
    kernels: CudaKernels | TorchKernels | None = None,
) -> torch.Tensor:
    """second(between(first(x))) for two stacks with packed GEMMs, as lstm_stack gives it
    (dropout p after every layer of each, their seeds drawn in the same order), in one autograd
    node: its backward runs the second stack's weight gradients on a side stream beside the
    first stack's backward waves, on a grid of `beside` programs (0: one per work item; None:
    after them on the current stream, as two lstm_stack calls do). x (T, B, K) and the second
    stack's input `second_shape` (T2, B, K2) need no padding: B a multiple of 192, K and K2 of
    64. `lengths` and `second_lengths` (B,): each stack's; `row_keys` as lstm_stack's."""
    first = _prepare(
        "lstm_stack_pair",
        x.shape,
        x.device,
        x.dtype,
        first_layers,
        p,
        None,
        kernels,
        lengths,
        "packed",
        row_keys,
    )
    second = _prepare(
        "lstm_stack_pair",
        second_shape,
        x.device,
        first.dtype,
        second_layers,
        p,
        None,
        first.kernels,
        second_lengths,
        "packed",
        row_keys,
    )
    if first.pad_b or first.pad_k or second.pad_k:
        raise ValueError(
            f"lstm_stack_pair: the batch must be a multiple of {BATCH_MULTIPLE} rows and each "
            f"stack's input of {INPUT_MULTIPLE} features, not {tuple(x.shape)} and "
            f"{tuple(second_shape)}"
        )
    x = first.pad(x)
    keep_factors = _keeps_factors(x, first.flat + second.flat)
    return _WaveStackPair.apply(
        first.call(p, keep_factors),
        second.call(p, keep_factors),
        between,
        tuple(second_shape),
        beside,
        x,
        len(first_layers),
        *first.flat,
        *second.flat,
    )
