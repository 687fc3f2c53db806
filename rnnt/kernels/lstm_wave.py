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
`TorchKernels` elsewhere.

Dropout: a counter-based hash of (seed, layer, step, batch row, unit) decides each keep
(`keep_mask`), so the backward recomputes the mask instead of storing it, and a padded batch
leaves the real rows' masks unchanged. The seed is a one-element int32 tensor on the device,
drawn from torch's generator on every call, so CUDA-graph replays draw fresh masks.

Padding steps: given the batch's lengths, the steps past the longest are padding (a CUDA-graph
bucket is longer than most batches run through it). The kernels skip them on the device, and
their outputs there are zero; everything before them is what the stack of the shorter length
computes.

Stacked frames: with `stack_pairs` the last layer writes its output the way the encoder's
stacking of two frames (model.StackTime) reads it, frames 2u and 2u + 1 side by side and each
row's padding frames zero, and its backward reads the gradient in that layout: nothing copies the
sequence between the encoder's two stacks.
"""

from __future__ import annotations

import ctypes
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
# launch, 2 as 1 with L2 eviction priorities on the TMA copies); bench/encoder_lstm.py times them
# all, and checks that they give the same bits
FORWARD_VARIANT = 2
BACKWARD_VARIANT = 2
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
    seed: torch.Tensor, layer: int, steps: int, batch: int, hidden: int, p: float
) -> torch.Tensor:
    """Which elements of layer `layer`'s output survive dropout: bool (steps, batch, hidden).

    One 32-bit hash per (step, pair of batch rows, unit), 16 bits per row: the keys do not
    depend on `batch`, so the first rows of a larger batch get the same mask. `seed` is a
    one-element integer tensor; the result is on its device, computed without a host sync.
    """
    device = seed.device
    s = seed.reshape(()).to(torch.int64) & _M32
    layer_seed = mix32((s + 0x9E3779B9 * (layer + 1)) & _M32)
    t = torch.arange(steps, dtype=torch.int64, device=device)
    step_seed = mix32((layer_seed + 0x85EBCA6B * (t + 1)) & _M32).view(steps, 1, 1)
    b = torch.arange(batch, dtype=torch.int64, device=device).view(1, batch, 1)
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


def _out_step(seq: torch.Tensor, t: int, steps: int, batch: int, pairs: bool) -> torch.Tensor:
    """Step t's (B, H) rows of a layer's output sequence: [T B, H], or in frame pairs
    [ceil(T / 2) B, 2H] (steps 2u and 2u + 1 side by side in row u B + b)."""
    if not pairs:
        return seq.view(steps, batch, -1)[t]
    return seq.view(-(-steps // 2), batch, 2, -1)[t // 2, :, t % 2]


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
        stacked=None,
    ) -> None:
        """x_gates: None, or the first layer's x W_ih^T [T*B, 4H] (permuted columns) from one
        GEMM before the waves; then x is not read and w[0] is W_hh alone [4H, H]. active: None,
        or a one-element int32 tensor n: steps t >= n are padding (h and yseq zero there, their
        factors not written, cstate c(n - 1)). factors: None when no backward follows.
        stacked: None, or (B,) int32 lengths: the last layer's yseq is [ceil(T / 2) B, 2H],
        steps 2u and 2u + 1 of row b side by side in row u B + b (`_out_step`), and zero at
        t >= stacked[b]."""
        hidden = hseq[0].shape[1]
        batch = cstate[0].shape[0]
        steps = hseq[0].shape[0] // batch - 1
        n_active = self._active(active, steps)
        last = len(w) - 1
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
            keep = keep_mask(seed, layer, steps, batch, hidden, p) if p > 0 else None
            c = cstate[layer].to(acc)
            out_pairs = stacked is not None and layer == last
            for t in range(steps):
                if t >= n_active:
                    hs[t + 1] = 0
                    _out_step(yseq[layer], t, steps, batch, out_pairs).zero_()
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
                if out_pairs:
                    y = torch.where((t < stacked)[:, None], y, 0.0)
                _out_step(yseq[layer], t, steps, batch, out_pairs).copy_(y)
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
        self, kin, wt, dz, fac, dc, dbias, dy_top, p, seed, active=None, stacked=None
    ) -> None:
        """active: the forward's; dz and the partial sums are zero at the padding steps, and
        dy_top is not read there. stacked: the forward's (dy_top then in that yseq's layout,
        taken as zero where that yseq is)."""
        layers = len(wt)
        batch, hidden = dc[0].shape
        steps = fac[0].shape[1] // batch
        n_active = self._active(active, steps)
        acc = self._acc(wt[0].dtype)
        perm = gate_permutation(hidden, wt[0].device)
        scale = _dropout_scale(p)
        for layer in reversed(range(layers)):
            w_hh = wt[layer][kin[layer] :].to(acc)  # (H, 4H): W_hh^T, permuted gate columns
            above = None if layer == layers - 1 else wt[layer + 1][: kin[layer + 1]].to(acc)
            keep = keep_mask(seed, layer, steps, batch, hidden, p) if p > 0 else None
            planes = fac[layer].view(N_FACTORS, steps, batch, hidden).to(acc)
            gates = dz[layer].view(steps, batch, 4 * hidden)
            tiles = dbias[layer].view(steps, batch // BATCH_TILE, 4 * hidden)
            gates[n_active:] = 0
            tiles[n_active:] = 0
            dc_next = None
            for t in reversed(range(n_active)):
                if above is None:
                    dy = _out_step(dy_top, t, steps, batch, stacked is not None).to(acc)
                    if stacked is not None:
                        dy = torch.where((t < stacked)[:, None], dy, 0.0)
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
        stacked=None,
    ) -> None:
        layers = len(w)
        batch = cstate[0].shape[0]
        steps = hseq[0].shape[0] // batch - 1
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
            self._ptr(stacked),
            int(stacked is not None),
            self.forward_variant,
            ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream),
        )
        self._check(rc, "forward")

    def backward(
        self, kin, wt, dz, fac, dc, dbias, dy_top, p, seed, active=None, stacked=None
    ) -> None:
        layers = len(wt)
        batch = dc[0].shape[0]
        steps = fac[0].shape[1] // batch
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
            self._ptr(stacked),
            int(stacked is not None),
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
            + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
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


class _WaveStack(torch.autograd.Function):
    """y = stack(x) through a kernels object (TorchKernels or CudaKernels). x (T, B, K) with B a
    multiple of BATCH_MULTIPLE and K of INPUT_MULTIPLE; weights in x's dtype; `active` None or
    the steps before the padding (a one-element int32 tensor on x's device). Without
    `keep_factors` (scoring: no backward follows) the forward writes no factor planes, six
    values a cell only the backward reads. `stacked` (None or (B,) int32 lengths on x's device):
    y comes as (ceil(T / 2), B, 2H), steps 2u and 2u + 1 side by side, zero at each row's steps
    t >= stacked[b] and for the missing step of an odd T."""

    @staticmethod
    def forward(
        ctx,
        kernels,
        p: float,
        keep_factors: bool,
        seed: torch.Tensor,
        active: torch.Tensor | None,
        stacked: torch.Tensor | None,
        x: torch.Tensor,
        *flat: torch.Tensor,
    ):
        steps, batch, k_in = x.shape
        n_layers, hidden = len(flat) // 4, flat[1].shape[1]
        acc = TorchKernels._acc(x.dtype)
        # recomputed per call (a few tiny kernels), not cached: a device tensor first made
        # inside a CUDA-graph capture would hold nothing until the graph's first replay
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
        pair_steps = -(-steps // 2)
        if stacked is not None:
            yseq[-1] = x.new_empty(pair_steps * batch * 2, hidden)
            if steps % 2:  # no step writes the odd half of the last pair
                yseq[-1].view(pair_steps, batch, 2, hidden)[-1, :, 1].zero_()
        cstate = [x.new_zeros(batch, hidden, dtype=acc) for _ in range(n_layers)]
        factors = (
            [x.new_empty(N_FACTORS, rows, hidden) for _ in range(n_layers)]
            if keep_factors
            else None
        )
        x_gates, w_run = None, w
        if k_in > hidden:
            # The first layer's cells would take the longest K of the stack and set the pace of
            # every launch they share; its input part is one GEMM before the waves instead (as
            # cuDNN does it), and its cells run W_hh alone.
            x_gates = x_rows @ w[0][:, :k_in].T
            w_run = [w[0][:, k_in:].contiguous(), *w[1:]]
        kernels.forward(
            x_rows,
            hseq,
            yseq,
            cstate,
            factors,
            bias,
            w_run,
            p,
            seed,
            x_gates,
            active,
            stacked,
        )
        ctx.active, ctx.stacked = active, stacked  # not saved with the tensors: None is valid
        ctx.save_for_backward(seed, x_rows, *w, *hseq, *yseq[:-1], *(factors or []))
        ctx.meta = (kernels, p, steps, batch, k_in, n_layers, hidden)
        if stacked is not None:
            return yseq[-1].view(pair_steps, batch, 2 * hidden)
        return yseq[-1].view(steps, batch, hidden)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        kernels, p, steps, batch, k_in, n_layers, hidden = ctx.meta
        seed, x_rows, *rest = ctx.saved_tensors
        w = rest[:n_layers]
        hseq = rest[n_layers : 2 * n_layers]
        yseq = rest[2 * n_layers : 3 * n_layers - 1]
        factors = rest[3 * n_layers - 1 :]
        rows, dtype = steps * batch, x_rows.dtype
        acc = TorchKernels._acc(dtype)
        kin = [k_in] + [hidden] * (n_layers - 1)
        wt = [weight.t().contiguous() for weight in w]
        dz = [x_rows.new_empty(rows, 4 * hidden) for _ in range(n_layers)]
        dc = [x_rows.new_empty(batch, hidden, dtype=acc) for _ in range(n_layers)]
        # the bias gradient in partial sums per (step, batch tile), from the kernels' epilogue: a
        # separate reduction would read all of dz again
        dbias = [x_rows.new_empty(rows // BATCH_TILE, 4 * hidden, dtype=acc) for _ in w]
        dy = grad_y.to(dtype).contiguous().view(-1, hidden)
        kernels.backward(kin, wt, dz, factors, dc, dbias, dy, p, seed, ctx.active, ctx.stacked)
        # dz's columns are in the permuted gate order, so the weight gradients' rows are too
        inverse = torch.argsort(gate_permutation(hidden, x_rows.device))
        grads = []
        for layer in range(n_layers):
            inp = x_rows if layer == 0 else yseq[layer - 1]
            d_gates_t = dz[layer].t()
            grad_bias = dbias[layer].sum(0)[inverse].to(dtype)
            grads += [
                (d_gates_t @ inp)[inverse],
                (d_gates_t @ hseq[layer][:rows])[inverse],
                grad_bias,
                grad_bias,
            ]
        grad_x = None
        if ctx.needs_input_grad[6]:
            grad_x = (dz[0] @ w[0][:, :k_in]).view(steps, batch, k_in)
        return (None,) * 6 + (grad_x, *grads)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def lstm_stack(
    x: torch.Tensor,
    layers: Sequence[LayerWeights],
    p: float,
    seed: torch.Tensor | None = None,
    kernels: CudaKernels | TorchKernels | None = None,
    lengths: torch.Tensor | None = None,
    stack_pairs: bool = False,
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

    `stack_pairs` (needs `lengths`): the output as the encoder's stacking of two frames
    (`model.StackTime(2)`) makes it, written so by the kernels: (ceil(T / 2), B, 2H), frames 2u
    and 2u + 1 side by side, each row's frames at and past its length zero."""
    if seed is None and p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=x.device)
    elif seed is None:
        seed = torch.zeros(1, dtype=torch.int32, device=x.device)  # no mask reads it
    if kernels is None and x.is_cuda:
        reason = unsupported(x.device, layers[0][1].shape[1], len(layers))
        if reason is not None:
            raise RuntimeError(f"model.encoder_lstm: the wave kernels cannot run: {reason}")
        kernels = _cuda_kernels()
    elif kernels is None:
        kernels = TorchKernels()
    dtype = torch.float16 if isinstance(kernels, CudaKernels) else x.dtype
    steps, batch, k_in = x.shape
    pad_b = _round_up(batch, BATCH_MULTIPLE) - batch
    pad_k = _round_up(k_in, INPUT_MULTIPLE) - k_in
    x = x.to(dtype)
    if pad_k or pad_b:  # F.pad copies even when it pads nothing
        x = F.pad(x, (0, pad_k, 0, pad_b))
    x = x.contiguous()
    flat = []
    for index, weights in enumerate(layers):
        w_ih, w_hh, b_ih, b_hh = (t.to(dtype) for t in weights)
        if index == 0 and pad_k:
            w_ih = F.pad(w_ih, (0, pad_k))
        flat += [w_ih, w_hh, b_ih, b_hh]
    if stack_pairs and lengths is None:
        raise ValueError("lstm_stack: stack_pairs zeroes each row's padding and needs lengths")
    active = stacked = None
    if lengths is not None:
        if lengths.shape != (batch,):
            raise ValueError(
                f"lstm_stack: lengths must be one per batch row, shape ({batch},), not "
                f"{tuple(lengths.shape)}"
            )
        active = lengths.to(x.device).amax().clamp(0, steps).to(torch.int32).reshape(1)
        if stack_pairs:
            stacked = F.pad(lengths.to(x.device, torch.int32), (0, pad_b))
    # a graph that nothing will differentiate (scoring, no_grad) needs no factor planes
    keep_factors = torch.is_grad_enabled() and (
        x.requires_grad or any(t.requires_grad for t in flat)
    )
    y = _WaveStack.apply(kernels, p, keep_factors, seed, active, stacked, x, *flat)
    return y[:, :batch] if pad_b else y
