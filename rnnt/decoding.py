"""Greedy RNN-T decoding (docs/SPEC.md "Evaluation"): a per-utterance reference and batched
decoders.

Semantics, identical in every mode: for each encoder frame t < f_len, evaluate the joint on
(f_t, g) where g is the prediction network's output for the last emitted label (blank = start of
sequence); k = argmax (ties -> lowest index). If k is blank, go to the next frame; otherwise emit
k, advance the prediction state, and evaluate the same frame again. After
`max_symbols_per_step` emissions at one frame the decoder moves on; an utterance that has
emitted `max_symbols_per_utterance` symbols stops.

Modes of `GreedyDecoder`:
    no_cg               whole batch at once with masks, eager; the CPU checks completion after
                        every step.
    cg                  one masked step captured in a CUDA graph; the CPU replays it and reads
                        the completion flag after every replay.
    cg_unroll_pipeline  `unroll_factor` steps per graph; the completion flag is copied to pinned
                        host memory on a side stream, and the CPU looks at the flag of the
                        previous replay while the next one is already queued, so the GPU never
                        waits for the CPU. Label bookkeeping runs on a side stream, overlapping
                        the prediction LSTM (measured on an H200 with the 49M model: the side
                        stream makes dev-clean decoding ~25% faster; unroll factors 1 to 8
                        differ by under 5%).
All modes run the same step function (`GreedyDecoder._step`), plain tensor code that is also run
eagerly: on CPU the cg modes execute their graph body eagerly, which is how the CPU tests check
the static-buffer, padding, unrolling and lagged-completion logic.

Graphed modes and weights: a CUDA graph reads parameters by address. To evaluate new weights
(e.g. the EMA), copy them into the existing parameter tensors in place (`param.copy_(...)`,
`model.load_state_dict(...)`); never rebind `param.data` or move/cast the model after the
first decode, or the graph keeps reading the old storage.

Graphed modes and shapes: the batch size is fixed at `batch_size` (smaller batches are padded
with zero-length rows, which are complete from the start; larger ones are an error). The frame
capacity is taken from the first batch (or `max_frames`), rounded up to a multiple of
`FRAME_ROUNDING`; a later batch with more encoder frames triggers one re-capture at the larger
size, so a full pass over an evaluation set captures at most a handful of times.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rnnt.config import EvalMode
from rnnt.model import RNNT

MODES = typing.get_args(EvalMode)
FRAME_ROUNDING = 64  # encoder frames (~3.8 s of audio) per capacity step of a graphed decoder


class _Detokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


def hypotheses_to_text(hyps: Sequence[Sequence[int]], tokenizer: _Detokenizer) -> list[str]:
    """Token ids per utterance -> text, with e.g. `rnnt.data.tokenizer.Tokenizer`."""
    return [tokenizer.decode(ids) for ids in hyps]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off while decoding; the caller's train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _designed_sync() -> Iterator[None]:
    """Marks the host synchronisations that are part of the design (completion checks, the
    final read-back, capture), so a caller running under `torch.cuda.set_sync_debug_mode
    ("error")` only trips on accidental ones."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _check_limits(max_symbols_per_step: int, max_symbols_per_utterance: int) -> None:
    # the eval config is checked at load (rnnt.config); these guard direct callers
    if max_symbols_per_step < 1:
        raise ValueError(f"max_symbols_per_step must be >= 1, got {max_symbols_per_step}")
    if max_symbols_per_utterance < 1:
        raise ValueError(f"max_symbols_per_utterance must be >= 1, got {max_symbols_per_utterance}")


def _check_encoder_output(f: torch.Tensor, f_lens: torch.Tensor) -> None:
    if f.dim() != 3:
        raise ValueError(f"decode: f must be (B, T, H), got shape {tuple(f.shape)}")
    if f_lens.shape != (f.shape[0],):
        raise ValueError(
            f"decode: f_lens must be ({f.shape[0]},) for f of shape {tuple(f.shape)}, "
            f"got {tuple(f_lens.shape)}"
        )


@torch.no_grad()
def decode_reference(
    model: RNNT,
    f: torch.Tensor,
    f_lens: torch.Tensor,
    blank_idx: int,
    max_symbols_per_step: int,
    max_symbols_per_utterance: int,
) -> list[list[int]]:
    """The oracle: one utterance at a time, one frame at a time, with Python control flow.

    f (B, T, H) encoder output (joint_enc applied), f_lens (B,) -> B token id lists.
    """
    _check_encoder_output(f, f_lens)
    _check_limits(max_symbols_per_step, max_symbols_per_utterance)
    hyps = []
    with _eval_mode(model):
        for b, length in enumerate(f_lens.tolist()):
            if length > f.shape[1]:
                raise ValueError(f"decode: f_lens[{b}] = {length} exceeds T = {f.shape[1]}")
            hyp: list[int] = []
            start = torch.full((1,), blank_idx, dtype=torch.long, device=f.device)
            g, state = model.prediction.step(start, None)
            for t in range(length):
                if len(hyp) == max_symbols_per_utterance:
                    break
                for _ in range(max_symbols_per_step):
                    k = int(model.joint.step(f[b, t : t + 1], g).argmax(-1))
                    if k == blank_idx:
                        break
                    hyp.append(k)
                    if len(hyp) == max_symbols_per_utterance:
                        break
                    label = torch.full((1,), k, dtype=torch.long, device=f.device)
                    g, state = model.prediction.step(label, state)
            hyps.append(hyp)
    return hyps


@dataclass
class _LoopState:
    """Decoder state for a batch of B rows; graphed modes keep one instance as static buffers.

    f (B, T, H) encoder output; f_lens (B,); time_idx (B,) current frame; sym_at_frame (B,)
    emissions at the current frame; num_emitted (B,); labels (B, max_utt + 1), whose last column
    is a write-off slot for rows that emit nothing in a step; g (B, H_joint) prediction output
    for the last emitted label; h, c (L, B, H_pred) its LSTM state; done (B,); all_done ().
    """

    f: torch.Tensor
    f_lens: torch.Tensor
    time_idx: torch.Tensor
    sym_at_frame: torch.Tensor
    num_emitted: torch.Tensor
    labels: torch.Tensor
    g: torch.Tensor
    h: torch.Tensor
    c: torch.Tensor
    done: torch.Tensor
    all_done: torch.Tensor


class GreedyDecoder:
    """Batched greedy decoding of `model` in one of `MODES` (see the module docstring).

    batch_size, max_frames: shape of the static buffers of the graphed modes (max_frames = 0:
    sized from the first batch); ignored by `no_cg`. unroll_factor: steps per graph replay of
    `cg_unroll_pipeline`.
    """

    def __init__(
        self,
        model: RNNT,
        blank_idx: int,
        max_symbols_per_step: int = 30,
        max_symbols_per_utterance: int = 300,
        mode: str = "no_cg",
        batch_size: int = 0,
        unroll_factor: int = 4,
        max_frames: int = 0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got '{mode}'")
        _check_limits(max_symbols_per_step, max_symbols_per_utterance)
        if mode != "no_cg" and batch_size < 1:
            raise ValueError(f"mode {mode} needs a batch_size >= 1, got {batch_size}")
        if mode == "cg_unroll_pipeline" and unroll_factor < 1:
            raise ValueError(f"unroll_factor must be >= 1, got {unroll_factor}")
        self.model = model
        self.blank_idx = blank_idx
        self.max_symbols_per_step = max_symbols_per_step
        self.max_symbols_per_utterance = max_symbols_per_utterance
        self.mode = mode
        self.batch_size = batch_size
        self.unroll_factor = unroll_factor if mode == "cg_unroll_pipeline" else 1
        self.max_frames = max_frames
        self._static: _LoopState | None = None
        self._replay: Callable[[], None] | None = None
        self._graph = None  # torch.cuda.CUDAGraph of the graphed modes on CUDA
        self._side_stream = None  # label bookkeeping (cg_unroll_pipeline on CUDA)
        self._copy_stream = None  # completion flag -> host (cg_unroll_pipeline on CUDA)
        self._copy_event = None
        self._flag_host: torch.Tensor | None = None

    # ---------------------------------------------------------------------------------------
    # Public interface

    def __call__(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> list[list[int]]:
        """feats (T, B, in_feats), feat_lens (B,) -> B token id lists (encoder + decoding)."""
        with torch.no_grad(), _eval_mode(self.model):
            f, f_lens = self.model.encode(feats, feat_lens)
        return self.decode(f, f_lens)

    @torch.no_grad()
    def decode(self, f: torch.Tensor, f_lens: torch.Tensor) -> list[list[int]]:
        """f (B, T, H) encoder output, f_lens (B,) -> B token id lists."""
        _check_encoder_output(f, f_lens)
        f_lens = f_lens.to(device=f.device, dtype=torch.long, non_blocking=True)
        with _eval_mode(self.model):
            if self.mode == "no_cg":
                st = self._init_state(f, f_lens.clone())
                self._reset(st)
                self._run_eager(st)
            else:
                st = self._load_static(f, f_lens)
                if self.mode == "cg":
                    self._run_checked(st)
                else:
                    self._run_pipelined(st)
            return self._read_back(st, f.shape[0], f.shape[1])

    # ---------------------------------------------------------------------------------------
    # The step every mode runs (captured as-is by the graphed modes)

    def _step(self, st: _LoopState, side_stream=None) -> None:
        """One masked greedy step for every row, in place on `st`; no host synchronisation.

        Rows that are done change nothing: they never emit and never advance, so a step (or a
        whole graph replay) after completion is a no-op.
        """
        batch, frames, hid = st.f.shape
        t = st.time_idx.clamp(max=frames - 1)  # done rows may sit at t = f_len = T
        f_t = st.f.gather(1, t.view(batch, 1, 1).expand(batch, 1, hid)).squeeze(1)
        k = self.model.joint.step(f_t, st.g).argmax(-1)
        emit = (k != self.blank_idx) & ~st.done

        main_stream = torch.cuda.current_stream() if side_stream is not None else None
        if side_stream is not None:
            side_stream.wait_stream(main_stream)
        with (
            torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext()
        ):
            # Bookkeeping only needs k and emit, so it overlaps the prediction LSTM below.
            slot = torch.where(emit, st.num_emitted, self.max_symbols_per_utterance)
            st.labels.scatter_(1, slot.unsqueeze(1), k.unsqueeze(1))
            st.num_emitted.add_(emit)
            sym = st.sym_at_frame + emit
            advance = ~st.done & (~emit | (sym >= self.max_symbols_per_step))
            st.time_idx.add_(advance)
            st.sym_at_frame.copy_(sym.masked_fill(advance, 0))
            torch.logical_or(
                st.time_idx >= st.f_lens,
                st.num_emitted >= self.max_symbols_per_utterance,
                out=st.done,
            )
            st.all_done.copy_(st.done.all())

        # The prediction network runs for every row (blank embeds to zeros); only rows that
        # emitted keep the result: the state advances on non-blank only.
        g, (h, c) = self.model.prediction.step(k, (st.h, st.c))
        st.g.copy_(torch.where(emit.unsqueeze(1), g, st.g))
        keep = emit.view(1, batch, 1)
        st.h.copy_(torch.where(keep, h, st.h))
        st.c.copy_(torch.where(keep, c, st.c))
        if side_stream is not None:
            # k and emit are freed after this join, so the side stream's reads of them are
            # ordered before any reuse of their memory.
            main_stream.wait_stream(side_stream)

    # ---------------------------------------------------------------------------------------
    # State set-up and read-back

    def _init_state(self, f: torch.Tensor, f_lens: torch.Tensor) -> _LoopState:
        batch = f.shape[0]
        start = torch.full((batch,), self.blank_idx, dtype=torch.long, device=f.device)
        g, (h, c) = self.model.prediction.step(start, None)

        def zeros(*shape: int, dtype=torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=f.device)

        return _LoopState(
            f=f,
            f_lens=f_lens,
            time_idx=zeros(batch),
            sym_at_frame=zeros(batch),
            num_emitted=zeros(batch),
            labels=zeros(batch, self.max_symbols_per_utterance + 1),
            g=torch.zeros_like(g),
            h=torch.zeros_like(h),
            c=torch.zeros_like(c),
            done=zeros(batch, dtype=torch.bool),
            all_done=zeros(dtype=torch.bool),
        )

    def _reset(self, st: _LoopState) -> None:
        """Start of a batch: frame 0, nothing emitted, prediction output of the blank start."""
        st.time_idx.zero_()
        st.sym_at_frame.zero_()
        st.num_emitted.zero_()
        start = torch.full_like(st.time_idx, self.blank_idx)
        g, (h, c) = self.model.prediction.step(start, None)
        st.g.copy_(g)
        st.h.copy_(h)
        st.c.copy_(c)
        torch.le(st.f_lens, 0, out=st.done)
        st.all_done.copy_(st.done.all())

    def _read_back(self, st: _LoopState, batch: int, frames: int) -> list[list[int]]:
        n = self.max_symbols_per_utterance
        packed = torch.cat(
            [st.num_emitted[:batch, None], st.f_lens[:batch, None], st.labels[:batch, :n]], 1
        )
        with _designed_sync():
            packed = packed.cpu()
        counts, lens = packed[:, 0].tolist(), packed[:, 1]
        if batch and int(lens.max()) > frames:
            b = int(lens.argmax())
            raise ValueError(f"decode: f_lens[{b}] = {int(lens[b])} exceeds T = {frames}")
        rows = packed[:, 2:].tolist()
        return [row[:count] for row, count in zip(rows, counts)]

    # ---------------------------------------------------------------------------------------
    # Loops

    def _run_eager(self, st: _LoopState) -> None:
        while True:
            with _designed_sync():
                if st.all_done.item():
                    return
            self._step(st)

    def _run_checked(self, st: _LoopState) -> None:
        while True:
            self._replay()
            with _designed_sync():
                if st.all_done.item():
                    return

    def _run_pipelined(self, st: _LoopState) -> None:
        """Replay N is queued before the CPU waits for the flag of replay N-1.

        The flag copy may also observe a later replay's value; that is harmless because
        completion is monotonic. The replay queued after completion is a no-op.
        """
        self._replay()
        while True:
            self._copy_flag(st)
            self._replay()
            with _designed_sync():
                if self._copy_event is not None:
                    self._copy_event.synchronize()
                if self._flag_host.item():
                    return

    def _copy_flag(self, st: _LoopState) -> None:
        if self._copy_stream is None:
            self._flag_host.copy_(st.all_done)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._copy_stream):
            self._flag_host.copy_(st.all_done, non_blocking=True)
            self._copy_event.record(self._copy_stream)

    # ---------------------------------------------------------------------------------------
    # Static buffers and capture (graphed modes)

    def _load_static(self, f: torch.Tensor, f_lens: torch.Tensor) -> _LoopState:
        batch, frames, _ = f.shape
        if batch > self.batch_size:
            raise ValueError(
                f"decode: batch of {batch} utterances exceeds eval.batch_size = "
                f"{self.batch_size}, the batch size of the {self.mode} decoder's static buffers"
            )
        if (
            self._static is None
            or frames > self._static.f.shape[1]
            or f.dtype != self._static.f.dtype
        ):
            self._build(f, max(frames, self.max_frames))
        st = self._static
        st.f[:batch, :frames].copy_(f)
        st.f_lens.zero_()  # padded rows have length 0: complete from the start
        st.f_lens[:batch].copy_(f_lens)
        self._reset(st)
        return st

    def _build(self, f: torch.Tensor, frames: int) -> None:
        """(Re)allocate the static buffers for `frames` frames and capture the graph body."""
        frames = max(-(-frames // FRAME_ROUNDING), 1) * FRAME_ROUNDING
        self._graph = self._replay = self._static = None
        device = f.device
        buf = torch.zeros((self.batch_size, frames, f.shape[2]), dtype=f.dtype, device=device)
        st = self._init_state(buf, torch.zeros(self.batch_size, dtype=torch.long, device=device))
        self._static = st
        use_cuda = device.type == "cuda"
        pipelined = self.mode == "cg_unroll_pipeline"
        if pipelined:
            self._flag_host = torch.zeros((), dtype=torch.bool, pin_memory=use_cuda)
        if use_cuda and pipelined:
            self._side_stream = torch.cuda.Stream(device)
            self._copy_stream = torch.cuda.Stream(device)
            self._copy_event = torch.cuda.Event()

        def body() -> None:
            for _ in range(self.unroll_factor):
                self._step(st, self._side_stream)

        if not use_cuda:
            self._replay = body  # no graphs on CPU: the same body, run eagerly
            return
        self._graph = self._capture(st, body, device)
        self._replay = self._graph.replay

    def _capture(self, st: _LoopState, body: Callable[[], None], device: torch.device):
        """Warm up on the capture stream (so the allocator pool is populated there), then
        capture `body` with every row complete, so the buffers are left as they were."""
        with _designed_sync():
            capture_stream = torch.cuda.Stream(device)
            capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(capture_stream):
                for _ in range(2):
                    self._reset(st)
                    body()
            torch.cuda.current_stream().wait_stream(capture_stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the loaders' threads keep pinning host memory during a capture
            # (read-ahead crosses into evaluation), and under the default global mode any
            # thread's cudaHostAlloc invalidates the capture of this thread
            with torch.cuda.graph(graph, stream=capture_stream, capture_error_mode="thread_local"):
                body()
            torch.cuda.synchronize(device)
        return graph
