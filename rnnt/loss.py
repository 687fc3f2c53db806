"""RNN-T loss: an exact plain-PyTorch reference and the backends behind `loss.backend`.

Shape letters: B batch, T encoder frames, U target tokens (the lattice has U+1 label states),
H joint hidden size, V classes (blank is the last class).

The loss of one utterance is -log P(y | x), the log-sum over all monotonic alignments of the
T_b x (U_b+1) lattice (Graves 2012). Each backend is called with the joint *inputs*
(`f`, `g`) and the `Joint` module, so a fused backend never materialises the (B, T, U+1, V)
logits. The backends are the classes of `BACKENDS`, one per `loss.backend`: reference,
torchaudio, fused (its logits GEMM is `loss.fused_gemm`: auto, a CUDA C++ kernel built with nvcc
on Hopper GPUs, else cuBLAS; cublas; or sm90, that kernel or an error) and apex.
"""

from __future__ import annotations

import copy
import importlib
import itertools
from typing import ClassVar

import torch
from torch.autograd.function import once_differentiable

from rnnt.config import ConfigError, LossConfig
from rnnt.host_lengths import HostLens, check_host_lens, to_device
from rnnt.model import Joint

# Stands in for log(0) on the lattice. It is finite so that logaddexp of two "impossible" terms
# has finite gradients (with -inf autograd gives NaN); exp(_NEG - x) underflows to exactly 0
# against any reachable log-probability, so it never changes a value or a gradient.
_NEG = -1e30


def lattice_log_likelihood(
    lp_blank: torch.Tensor,
    lp_label: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
) -> torch.Tensor:
    """log P(y | x) from the lattice's transition log-probabilities.

    lp_blank (B, T, U+1): log-prob of blank at (t, u) (moves to (t+1, u));
    lp_label (B, T, U+1): log-prob of target label u+1 at (t, u) (moves to (t, u+1)); column U
    is never read. Returns (B,) in the inputs' dtype, differentiable in lp_blank and lp_label
    (computed in float64 inside).

    The forward variable alpha is advanced one frame t at a time, vectorised over the batch
    and the labels. Within a frame only label moves happen, so with C[t, u] the sum of the
    frame's label log-probs before u, alpha[t, u] = C[t, u] + logcumsumexp_k<=u(alpha[t-1, k] +
    blank[t-1, k] - C[t, k]): three tensor ops per frame (four backward), against about seven
    per anti-diagonal (eight backward) when the walk went by diagonals. The gradient comes
    from the backward variable beta, walked the same way from each utterance's last frame with
    suffix sums (Graves 2012, eq. 16): the occupancy of a transition is exp(alpha + its
    log-prob + beta of where it leads - log P). Autograd through the walk would keep a graph
    node per frame, each of whose backward fills a tensor of the whole lattice. Cells outside
    each utterance's T_b x (U_b+1) lattice get exactly zero gradient, whatever the padding
    holds.
    """
    return _LatticeWalk.apply(lp_blank, lp_label, logit_lens, target_lens)


def _lattice_masks(
    b: int, t: int, u1: int, logit_lens: torch.Tensor, target_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, U+1) masks: blank moves inside each lattice (t < T_b, u <= U_b), label moves
    inside it (t < T_b, u < U_b), and each lattice's final blank (T_b - 1, U_b)."""
    device = logit_lens.device
    rows = torch.arange(t, device=device).view(1, t, 1)
    cols = torch.arange(u1, device=device).view(1, 1, u1)
    frames = logit_lens.view(b, 1, 1)
    labels = target_lens.view(b, 1, 1)
    in_rows = rows < frames
    blank_ok = in_rows & (cols <= labels)
    label_ok = in_rows & (cols < labels)
    final = (rows == frames - 1) & (cols == labels)
    return blank_ok, label_ok, final


class _LatticeWalk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp_blank, lp_label, logit_lens, target_lens):
        b, t, u1 = lp_blank.shape
        logit_lens = logit_lens.to(lp_blank.device).long()
        target_lens = target_lens.to(lp_blank.device).long()
        blank_ok, label_ok, final = _lattice_masks(b, t, u1, logit_lens, target_lens)
        # The walk runs in float64: alpha and beta each carry the rounding of hundreds of
        # log-sums, and an occupancy exp(alpha + beta - log P) of float32 ones was off by 3e-4
        # (autograd's chain of float32 softmax weights: 6e-5). Moves outside the lattices are
        # impossible (_NEG) for blanks and free (0) for labels: a label's log-prob only enters
        # through the running sums C, which must stay finite, and no path inside a lattice
        # reads a cell outside it in the forward direction.
        blank = torch.where(blank_ok, lp_blank.double(), _NEG)
        label = torch.where(label_ok, lp_label.double(), 0.0)
        sums = torch.nn.functional.pad(label.cumsum(2)[:, :, :-1], (1, 0))  # C: (B, T, U+1)
        # alpha[t] = C[t] + logcumsumexp(alpha[t-1] + (blank[t-1] - C[t])); the bracket, and
        # alpha's first frame (start at u = 0), for all frames at once
        step_in = torch.cat([torch.zeros_like(blank[:, :1]), blank[:, :-1]], 1) - sums
        start = torch.full((b, u1), _NEG, dtype=blank.dtype, device=blank.device)
        start[:, 0] = 0.0
        alpha = torch.empty_like(blank)
        previous = start
        for frame in range(t):
            scan = torch.logcumsumexp(previous + step_in[:, frame], dim=1)
            previous = torch.add(scan, sums[:, frame], out=alpha[:, frame])
        rows = torch.arange(b, device=blank.device)
        last = logit_lens - 1
        ll = alpha[rows, last, target_lens] + blank[rows, last, target_lens]
        ctx.save_for_backward(blank, label, sums, alpha, ll, blank_ok, label_ok, final)
        ctx.dtype = lp_blank.dtype
        return ll.to(lp_blank.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ll):
        blank, label, sums, alpha, ll, blank_ok, label_ok, final = ctx.saved_tensors
        b, t, u1 = blank.shape
        # beta[t, u] = -C[t, u] + log sum_{k >= u} exp(down[t, k] + C[t, k]), where down is
        # the blank out of (t, k) and then beta[t+1, k], or the final blank alone on each
        # lattice's last frame. The suffix sums run as prefix sums over reversed columns.
        flip = (2,)
        blank_r, sums_r, final_r = blank.flip(flip), sums.flip(flip), final.flip(flip)
        # down + C for the last frame of each lattice; other frames add beta[t+1] to blank + C
        last_r = torch.where(final_r, blank_r + sums_r, _NEG)
        on_last_row = final_r.any(2)  # (B, T)
        blank_sums_r = blank_r + sums_r
        beta_r = torch.empty_like(blank)
        following = torch.full((b, u1), _NEG, dtype=blank.dtype, device=blank.device)
        for frame in range(t - 1, -1, -1):
            down = torch.where(
                on_last_row[:, frame, None], last_r[:, frame], following + blank_sums_r[:, frame]
            )
            scan = torch.logcumsumexp(down, dim=1)
            following = torch.sub(scan, sums_r[:, frame], out=beta_r[:, frame])
        beta = beta_r.flip(flip)
        scale = grad_ll.double().view(b, 1, 1)
        base = alpha - ll.view(b, 1, 1)
        # the blank out of (t, u) leads to beta[t+1, u]; out of the final cell, to the end (0)
        below = torch.nn.functional.pad(beta[:, 1:], (0, 0, 0, 1), value=_NEG)
        below = torch.where(final, 0.0, below)
        grad_blank = torch.where(blank_ok, torch.exp(base + blank + below) * scale, 0.0)
        right = torch.nn.functional.pad(beta[:, :, 1:], (0, 1), value=_NEG)
        grad_label = torch.where(label_ok, torch.exp(base + label + right) * scale, 0.0)
        return grad_blank.to(ctx.dtype), grad_label.to(ctx.dtype), None, None


def rnnt_loss_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    blank: int,
) -> torch.Tensor:
    """Exact RNN-T negative log-likelihood per utterance. Gradients: autograd through the
    log-softmax, the lattice walk's own alpha-beta backward (`lattice_log_likelihood`).

    logits (B, T, U+1, V) (any float dtype; computed in float32, or float64 if given float64),
    targets (B, U) int labels in [0, V) (values past target_lens are ignored),
    logit_lens (B,) with 1 <= logit_lens <= T, target_lens (B,) with 0 <= target_lens <= U.
    Returns (B,) in float32 (float64 for float64 logits).
    """
    if logits.dim() != 4:
        raise ValueError(f"logits must be (B, T, U+1, V), got shape {tuple(logits.shape)}")
    b, t, u1, v = logits.shape
    if targets.shape != (b, u1 - 1):
        raise ValueError(
            f"targets must be (B, U) = ({b}, {u1 - 1}) for logits {tuple(logits.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    if not 0 <= blank < v:
        raise ValueError(f"blank index {blank} is outside [0, {v})")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lp = torch.log_softmax(logits.to(dtype), dim=-1)
    lp_blank = lp[..., blank]
    labels = targets.long().clamp(0, v - 1)  # padding may hold anything
    lp_label = torch.gather(
        lp[:, :, : u1 - 1, :], 3, labels.view(b, 1, u1 - 1, 1).expand(b, t, -1, 1)
    )
    lp_label = torch.nn.functional.pad(lp_label.squeeze(3), (0, 1), value=_NEG)
    return -lattice_log_likelihood(lp_blank, lp_label, logit_lens, target_lens)


# --------------------------------------------------------------------------------------------
# Backends


class LossBackend:
    """One way to compute the batch-mean loss from the joint inputs (see TransducerLoss)."""

    name: ClassVar[str]
    # the optional module it computes with, imported when the backend is built (None: torch)
    requires: ClassVar[str | None] = None

    def __init__(self, blank: int, fused_gemm: str) -> None:
        self.blank = blank
        self.fused_gemm = fused_gemm
        self.module = None
        if self.requires is not None:
            try:
                self.module = importlib.import_module(self.requires)
            except ImportError as err:
                raise ConfigError(
                    f"loss.backend: '{self.name}' needs {self.requires}, which cannot be "
                    f"imported here ({err}); choose another of {', '.join(BACKENDS)}"
                ) from None

    def prepare(self, joint: Joint) -> tuple[str, str]:
        """(choice, reason) for `joint`'s device and dtype, with any kernel built now."""
        return self.name, f"loss.backend: {self.name}"

    # whether it launches kernels that compile at first use for each shape class (Triton):
    # only then does TransducerLoss.warm_up run anything
    compiles_kernels: ClassVar[bool] = False

    def warm_up_label_states(self, longest_tokens: int) -> list[int]:
        """U + 1 of the stand-in batches that TransducerLoss.warm_up runs."""
        return []

    def __call__(self, joint: Joint, f, g, f_lens, targets, target_lens, host_lens):
        raise NotImplementedError


class ReferenceLoss(LossBackend):
    """Joint(f, g), then `rnnt_loss_reference` in float32 (float64 stays float64).

    With host lengths, the joint runs only near each utterance's own T_b x (U_b+1) lattice:
    the utterances are sorted by frames and taken in groups of `group_size`, each group
    padded to its own longest, and only the blank and next-label log-probabilities leave a
    group (`_TransitionLogProbs`). The padded box of a random batch of 192 at LibriSpeech
    lengths holds 2.2 to 2.6 times the rows of its lattices, and the (B, T, U+1, V) logits
    with their float32 log-softmax decide whether such a batch fits a GPU at all; groups, not
    single utterances, keep the launches per step (and their Python overhead) few. The loss is
    the padded computation's: padding cells never reach the lattice walk."""

    name = "reference"
    group_size = 16

    def __call__(self, joint, f, g, f_lens, targets, target_lens, host_lens):
        if host_lens is None:
            logits = joint(f, g)
            return rnnt_loss_reference(logits, targets, f_lens, target_lens, self.blank).mean()
        b, t_max, u1_max = f.shape[0], f.shape[1], g.shape[1]
        t_lens, u_lens = check_host_lens(host_lens, b, t_max, u1_max - 1)
        dtype = torch.float64 if f.dtype == torch.float64 else torch.float32
        order = sorted(range(b), key=lambda row: (t_lens[row], u_lens[row]))
        inverse = sorted(range(b), key=order.__getitem__)  # position of each row in order
        # the step must not wait for the host: both index lists go in one non-blocking copy
        order_d, inverse_d = to_device(order + inverse, f.device, torch.long).split(b)
        blanks, labels = [], []
        for start in range(0, b, self.group_size):
            rows = order[start : start + self.group_size]
            t = max(t_lens[row] for row in rows)
            u = max(u_lens[row] for row in rows)
            index = order_d[start : start + self.group_size]
            logits = joint(f[index, :t], g[index, : u + 1])  # (G, t, u+1, V)
            label_ids = targets[index, :u].long().clamp(0, logits.shape[-1] - 1)
            blank, label = _TransitionLogProbs.apply(logits, label_ids, self.blank, dtype)
            pad = (0, u1_max - u - 1, 0, t_max - t)
            blanks.append(torch.nn.functional.pad(blank, pad, value=_NEG))
            labels.append(torch.nn.functional.pad(label, (0, u1_max - u, 0, t_max - t), value=_NEG))
        lp_blank = torch.cat(blanks)[inverse_d]
        lp_label = torch.cat(labels)[inverse_d]
        nll = -lattice_log_likelihood(lp_blank, lp_label, f_lens, target_lens)
        return nll.mean()


class _TransitionLogProbs(torch.autograd.Function):
    """logits (G, t, u+1, V), label ids (G, u) -> the log-probabilities of blank (G, t, u+1)
    and of the next label (G, t, u) in `dtype`: log_softmax, then the two picks.

    The backward is log-softmax's own, d logits = onehot terms - softmax x (their sum), from
    the saved logits and log-normaliser: autograd's would keep the whole float32 log-softmax
    and fill two more lattice-sized tensors with zeros for the picks' gradients."""

    @staticmethod
    def forward(ctx, logits, label_ids, blank, dtype):
        x = logits.to(dtype)
        lse = torch.logsumexp(x, dim=-1)  # (G, t, u+1)
        g, t, u1, _ = x.shape
        picks = label_ids.view(g, 1, u1 - 1, 1).expand(g, t, u1 - 1, 1)
        lp_blank = x[..., blank] - lse
        lp_label = torch.gather(x[:, :, : u1 - 1], 3, picks).squeeze(3) - lse[:, :, : u1 - 1]
        ctx.save_for_backward(logits, lse, picks)
        ctx.blank, ctx.dtype = blank, dtype
        return lp_blank, lp_label

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_blank, grad_label):
        logits, lse, picks = ctx.saved_tensors
        u = picks.shape[2]
        out = grad_blank.clone()
        out[:, :, :u] += grad_label
        grad = torch.exp(logits.to(ctx.dtype) - lse.unsqueeze(-1)).mul_(-out.unsqueeze(-1))
        grad[..., ctx.blank] += grad_blank
        grad[:, :, :u].scatter_add_(3, picks, grad_label.unsqueeze(-1))
        return grad.to(logits.dtype), None, None, None


class TorchaudioLoss(LossBackend):
    """Joint(f, g), then torchaudio.functional.rnnt_loss. Its CUDA kernel returned 0 for
    utterances with T = 1 or U = 0 in our tests (torchaudio 2.11), where its CPU kernel and the
    reference agree: avoid it for such data."""

    name = "torchaudio"
    requires = "torchaudio.functional"

    def __call__(self, joint, f, g, f_lens, targets, target_lens, host_lens):
        # torchaudio insists that the padded sizes equal the longest lengths (one host sync).
        t_max = int(f_lens.max())
        u_max = int(target_lens.max())
        logits = joint(f[:, :t_max], g[:, : u_max + 1])
        if logits.dtype not in (torch.float16, torch.float32):
            logits = logits.float()  # bf16 / fp64 are not supported by torchaudio's kernel
        nll = self.module.rnnt_loss(
            logits,
            targets[:, :u_max].int(),
            f_lens.int(),
            target_lens.int(),
            blank=self.blank,
            reduction="none",
            clamp=-1,
            fused_log_softmax=True,
        )
        return nll.float().mean()


class FusedLoss(LossBackend):
    """The joint and the loss in one pass of rnnt.kernels.joint_loss, never materialising the
    (B, T, U+1, V) logits (needs CUDA and Triton); its logits GEMM is `loss.fused_gemm`."""

    name = "fused"
    requires = "rnnt.kernels.joint_loss"  # imports Triton

    def prepare(self, joint: Joint) -> tuple[str, str]:
        weight = joint.operands().weight
        vocab, hidden = weight.shape
        try:
            return self.module.resolve(self.fused_gemm, weight.device, weight.dtype, hidden, vocab)
        except RuntimeError as err:  # loss.fused_gemm: sm90 where it cannot run
            raise ConfigError(f"loss.fused_gemm: {err}") from None

    compiles_kernels = True

    def warm_up_label_states(self, longest_tokens: int) -> list[int]:
        return self.module.warm_up_label_states(longest_tokens)

    def __call__(self, joint, f, g, f_lens, targets, target_lens, host_lens):
        weight, bias, p = joint.operands()
        # One operand dtype for the kernels (fp32 weights under autocast meet fp16 activations).
        dt = f.dtype
        # reduction='mean' inside the kernel call: its gradients then come out of one pass
        return self.module.fused_joint_loss(
            f,
            g.to(dt),
            weight.to(dt),
            bias.to(dt),
            f_lens,
            targets,
            target_lens,
            blank=self.blank,
            dropout_p=p,
            host_lens=host_lens,
            reduction="mean",
            gemm=self.fused_gemm,
        )


class ApexLoss(LossBackend):
    """apex.contrib.transducer's TransducerJoint (packed, ReLU + dropout), the joint's output
    layer, and its TransducerLoss on the packed rows (needs apex built with its transducer
    extension)."""

    name = "apex"
    requires = "apex.contrib.transducer"

    def __init__(self, blank: int, fused_gemm: str) -> None:
        super().__init__(blank, fused_gemm)
        self._loss = self.module.TransducerLoss(
            fuse_softmax_backward=True, opt=1, packed_input=True
        )

    def __call__(self, joint, f, g, f_lens, targets, target_lens, host_lens):
        weight, bias, p = joint.operands()
        f_lens = f_lens.int()
        g_lens = target_lens.int() + 1
        if host_lens is None:
            batch_offset = torch.cumsum(f_lens * g_lens, dim=0)
            packed_rows = int(batch_offset[-1])  # packing sizes its output on the host: a sync
        else:
            t_lens, u_lens = check_host_lens(host_lens, f.shape[0], f.shape[1], g.shape[1] - 1)
            ends = list(itertools.accumulate(t * (u + 1) for t, u in zip(t_lens, u_lens)))
            batch_offset = to_device(ends, f.device, torch.int64)
            packed_rows = ends[-1]
        apex_joint = self.module.TransducerJoint(
            pack_output=True, relu=True, dropout=p > 0, dropout_prob=p, opt=1
        )
        apex_joint.train(joint.training)
        # apex refuses strided inputs, and the encoder's f is a batch-major view of time-major rows
        h = apex_joint(
            f.contiguous(),
            g.contiguous(),
            f_lens,
            g_lens,
            batch_offset=batch_offset,
            packed_batch=packed_rows,
        )  # (sum_b T_b (U_b+1), H)
        logits = torch.nn.functional.linear(h, weight, bias)
        nll = self._loss(
            logits,
            targets.int(),
            f_lens,
            target_lens.int(),
            self.blank,
            batch_offset=batch_offset,
            max_f_len=f.shape[1],
        )
        return nll.float().mean()


BACKENDS: dict[str, type[LossBackend]] = {
    backend.name: backend for backend in (ReferenceLoss, TorchaudioLoss, FusedLoss, ApexLoss)
}


class TransducerLoss:
    """Mean over the batch of the per-utterance RNN-T loss, computed from the joint inputs.

    `TransducerLoss(backend, blank_idx)(joint, f (B,T,H), g (B,U+1,H), f_lens (B,),
    targets (B,U), target_lens (B,)) -> scalar`; `joint` is the model's `rnnt.model.Joint`
    (a fused backend reads its `operands()` and never builds its (B,T,U+1,V) output).

    `host_lens=(f_lens, target_lens)` as host integers, when the caller has them: the fused
    and reference backends then compute only the sum_b T_b (U_b + 1) lattice rows instead of
    the padded B T (U+1) box, and apex sizes its packed joint from them instead of reading the
    device lengths (a host sync). torchaudio ignores them.

    `fused_gemm` picks the fused backend's logits GEMM (rnnt.kernels.logits_gemm.GEMMS).
    """

    def __init__(self, backend: str, blank_idx: int, fused_gemm: str = "auto") -> None:
        LossConfig(backend, fused_gemm)  # the config's rules for the two names
        self.backend = backend
        self.blank_idx = blank_idx
        self.fused_gemm = fused_gemm
        self._impl = BACKENDS[backend](blank_idx, fused_gemm)

    def prepare(self, joint: Joint) -> tuple[str, str]:
        """(choice, reason) of the backend for `joint`'s device and dtype, e.g. ("fused(gemm=
        sm90, walk=cuda)", ...); settles the fused backend's CUDA C++ kernels now, so that a
        trainer pays for their build before its clock starts."""
        return self._impl.prepare(joint)

    @property
    def compiles_kernels(self) -> bool:
        """Whether the backend has kernels for `warm_up` to compile."""
        return self._impl.compiles_kernels

    def warm_up(self, joint: Joint, longest_tokens: int) -> None:
        """Forward and backward on stand-in batches through a copy of `joint`, so that the
        backend's Triton kernels compile now rather than in the first steps: Triton compiles
        a kernel per specialization, and the stand-ins have those of batches whose longest
        transcript is near `longest_tokens` (`warm_up_label_states`). Neither `joint` nor
        its gradients change; the joint's dropout draws from the global generators, which
        the caller puts back."""
        stand_in = copy.deepcopy(joint)
        weight = stand_in.operands().weight
        vocab, hidden = weight.shape
        device = weight.device
        generator = torch.Generator(device).manual_seed(0)

        def joint_input(length: int) -> torch.Tensor:
            x = torch.randn(2, length, hidden, generator=generator, device=device)
            return x.to(weight.dtype).requires_grad_()

        label = (self.blank_idx + 1) % vocab
        for states in self._impl.warm_up_label_states(longest_tokens):
            frames, tokens = (8, 5), (states - 1, 2)
            targets = torch.full((2, states - 1), label, dtype=torch.int64, device=device)
            loss = self(
                stand_in,
                joint_input(max(frames)),
                joint_input(states),
                torch.tensor(frames, device=device),
                targets,
                torch.tensor(tokens, device=device),
                host_lens=(frames, tokens),
            )
            loss.backward()

    def __call__(
        self,
        joint: Joint,
        f: torch.Tensor,
        g: torch.Tensor,
        f_lens: torch.Tensor,
        targets: torch.Tensor,
        target_lens: torch.Tensor,
        host_lens: HostLens | None = None,
    ) -> torch.Tensor:
        if f.dim() != 3 or g.dim() != 3 or f.shape[0] != g.shape[0] or f.shape[2] != g.shape[2]:
            raise ValueError(
                f"joint inputs must be f (B, T, H) and g (B, U+1, H), got {tuple(f.shape)} "
                f"and {tuple(g.shape)}"
            )
        if targets.shape != (g.shape[0], g.shape[1] - 1):
            raise ValueError(
                f"targets must be (B, U) = ({g.shape[0]}, {g.shape[1] - 1}) for g "
                f"{tuple(g.shape)}, got {tuple(targets.shape)}"
            )
        return self._impl(joint, f, g, f_lens, targets, target_lens, host_lens)
