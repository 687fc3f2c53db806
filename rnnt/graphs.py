"""Per-bucket CUDA graphs of the encoder and the prediction network for training (`--num_cg N`).

The encoder (+ joint_enc) and the prediction network (+ joint_pred) are each captured forward
and backward with `torch.cuda.make_graphed_callables` at the training batch size and at N
maximum lengths L, L - L//N, L - 2*(L//N), ... . A batch is padded up to the smallest bucket that
holds it (an O(1) list lookup on the padded length, a host-side shape: no device read), the
graph is replayed, and the outputs are sliced back to the batch's own lengths. The prediction
graph replays on a side stream, so that its backward runs beside the encoder's. The joint, the
loss, the scaler, the optimizer and the EMA stay eager.

Why padding is exact: every RNN here is unidirectional, so frames appended at the end never
change earlier outputs. The one place where the tail reaches back is stack-time with an odd
length, and it completes the last pair with a zero frame past each utterance's own length
(`rnnt.model.StackTime`), bucket padding or not. Padded positions
get zero output gradient, so they add nothing to the weight gradients; the padding itself is
zeros (labels: blank), so no 0 * garbage can turn into NaN.

Decisions (documented contract):
* Batches longer than the largest bucket raise `SequenceTooLongError`: the buckets are sized
  from `data.max_duration` and the speed-perturbation minimum, so a longer batch means the data
  does not match the config, and a silent eager fallback would hide it (and a memory cliff).
* Batches with fewer rows than the captured batch size are padded with empty rows. The training
  sampler drops remainders, so in training every batch is full; the padding only keeps odd
  callers (tests, a short final micro-batch) correct.
* Lengths are graph inputs (`x_lens` is copied into a static buffer), never baked in.
* Outputs alias the graphs' static buffers: they are valid until the same bucket is replayed
  again, which in a training step happens only after their backward has run.
* With the model in eval mode or with autograd disabled the eager modules run: the graphs hold
  the training-mode forward (dropout on) and a backward.

Speed: at batch 192 the time outside joint + loss is almost all the encoder's LSTMs (cuDNN's
per-time-step kernels, or the wave kernels of `model.encoder_lstm: wave | auto`);
docs/PERFORMANCE.md gives the breakdown and the alternatives measured and not kept
(more buckets, stream-split batches, Triton and CUDA C++ LSTMs). The side stream of the
prediction graph gained nothing beside cuDNN's encoder, which fills the GPU; beside the wave
kernels, which leave SMs free, it hides the prediction network's backward.

Memory: the encoder buckets share one graph memory pool and the prediction buckets another.
Buckets of one network never run interleaved (one encoder bucket per step, forward then
backward), so they may reuse each other's scratch and saved activations; the two networks' saved
activations are alive at the same time (both forwards run before either backward), so they must
not share a pool. Buckets are captured largest first so the smaller ones fit in its memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from rnnt.config import Config, ConfigError, FeaturesConfig
from rnnt.model import RNNT


class SequenceTooLongError(ValueError):
    """A batch is longer than the largest captured graph."""


def bucket_lengths(max_len: int, num_cg: int) -> list[int]:
    """The N capture lengths L, L - L//N, L - 2*(L//N), ... (descending, distinct, >= 1)."""
    if max_len < 1:
        raise ValueError(f"maximum length must be at least 1, got {max_len}")
    if num_cg < 1:
        raise ValueError(f"num_cg must be at least 1 for graphs, got {num_cg}")
    step = max_len // num_cg
    lengths = [max_len - i * step for i in range(num_cg)]
    return sorted({n for n in lengths if n >= 1}, reverse=True)


class BucketTable:
    """O(1) map from a padded length to the smallest bucket length that holds it."""

    def __init__(self, lengths: Sequence[int], what: str) -> None:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"{what}: bucket lengths must be positive, got {list(lengths)}")
        self.what = what
        self.lengths = sorted(set(lengths))
        self.max_len = self.lengths[-1]
        # _index[n] = position in self.lengths of the smallest bucket >= n
        self._index: list[int] = []
        for pos, length in enumerate(self.lengths):
            self._index += [pos] * (length + 1 - len(self._index))

    def __call__(self, length: int) -> int:
        """Position (in ascending `lengths`) of the bucket for a batch padded to `length`."""
        if length < 1:
            raise ValueError(f"{self.what}: a batch of length {length} is empty")
        if length > self.max_len:
            raise SequenceTooLongError(
                f"{self.what}: a batch of length {length} is longer than the largest CUDA graph "
                f"({self.max_len}); the graphs are sized from data.max_duration, the minimum speed "
                "perturbation and the longest training transcript, so this batch does not match "
                "the config (drop such utterances, or run with training.num_cg=0)"
            )
        return self._index[length]


def max_spliced_frames(max_duration: float, features: FeaturesConfig) -> int:
    """Spliced frames of the longest training utterance after the slowest speed perturbation.

    A rate r < 1 resamples audio to 1/r of its length (0.85 makes 16.7 s last 19.65 s). One hop of
    extra samples covers the resampler's rounding and durations rounded in the manifest; a
    centered STFT gives samples // hop + 1 frames; splicing keeps ceil(frames / subsample).
    """
    speed_min = features.speed_perturbation_min
    hop = round(features.window_stride * features.sample_rate)
    samples = math.ceil(max_duration * features.sample_rate / min(speed_min, 1.0)) + hop
    frames = samples // hop + 1
    return math.ceil(frames / features.frame_subsample)


def longest_transcript(utts: Sequence, tokenizer=None) -> int:
    """Tokens in the longest transcript of `utts` (manifest tokens, else `tokenizer.encode`)."""
    longest = 0
    for utt in utts:
        tokens = utt.tokens
        if tokens is None:
            if tokenizer is None:
                raise ConfigError(
                    f"utterance {utt.utt_id} has no tokens in its manifest and no data.tokenizer "
                    "is set: cannot size the prediction-network CUDA graphs"
                )
            tokens = tokenizer.encode(utt.transcript, utt.utt_id)
        longest = max(longest, len(tokens))
    if longest < 1:
        raise ConfigError("no training transcript has any token: cannot size the CUDA graphs")
    return longest


def pad_into(static: torch.Tensor, x: torch.Tensor, fill: float | int) -> None:
    """Copy `x` into the leading corner of `static` and set the rest of `static` to `fill`.

    `static` and `x` have the same rank; every dimension of `x` is at most that of `static`.
    """
    if x.dim() != static.dim() or any(a > b for a, b in zip(x.shape, static.shape)):
        raise ValueError(f"cannot pad a {tuple(x.shape)} tensor into {tuple(static.shape)}")
    static[tuple(slice(0, n) for n in x.shape)].copy_(x)
    # fill the complement as a union of slabs: along dim d, rows >= x.shape[d] with every
    # earlier dim restricted to x's extent (each padded element is written exactly once)
    for d, n in enumerate(x.shape):
        if n < static.shape[d]:
            index = tuple(slice(0, x.shape[i]) for i in range(d)) + (slice(n, None),)
            static[index].fill_(fill)


class _EncodeSegment(nn.Module):
    """The graphed unit of the encoder: x (L, B, F), lens (B,) -> f (B, ceil(L / stack), H),
    f_lens (B,), by `Encoder.forward` (stack-time zeroes every frame past each utterance's
    length, the bucket's padding included). A fresh wrapper per bucket, because
    make_graphed_callables replaces the `forward` of the module it is given.
    """

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(x, lens)


class _PredictSegment(nn.Module):
    """The graphed unit of the prediction network: y (B, U) -> g (B, U+1, H) (no LSTM state)."""

    def __init__(self, prediction: nn.Module) -> None:
        super().__init__()
        self.prediction = prediction

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.prediction(y)[0]


class EncoderBucket:
    """One encoder length bucket: static inputs x (L, B_cap, F), lens (B_cap,), and `fn`, the
    callable run on them: the graphed `_EncodeSegment` (or the plain segment)."""

    def __init__(
        self,
        length: int,
        batch_size: int,
        in_feats: int,
        stack_factor: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.static_x = torch.zeros(length, batch_size, in_feats, dtype=dtype, device=device)
        self.static_lens = torch.full((batch_size,), length, dtype=torch.int64, device=device)
        self.stack_factor = stack_factor
        self.fn = None

    @property
    def static_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.static_x, self.static_lens

    def __call__(self, x: torch.Tensor, x_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, B, F), x_lens (B,) -> f (B, ceil(T / stack), H), f_lens (B,)."""
        self.load(x, x_lens)
        return self.run(x.shape[0], x.shape[1])

    def load(self, x: torch.Tensor, x_lens: torch.Tensor) -> None:
        """Copy a batch into the static inputs, padded."""
        if x.shape[2] != self.static_x.shape[2]:
            raise ValueError(
                f"{x.shape[2]} features per frame; the graphs take {self.static_x.shape[2]}"
            )
        pad_into(self.static_x, x, 0)
        pad_into(self.static_lens, x_lens, 0)

    def run(self, t: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph on the loaded batch of `b` rows and `t` frames: f, f_lens cut to it."""
        f, f_lens = self.fn(*self.static_inputs)
        return f[:b, : -(-t // self.stack_factor)], f_lens[:b]


class PredictionBucket:
    """One prediction-network length bucket: a static label buffer (B_cap, U_L) and `fn`, the
    callable run on it: the graphed `_PredictSegment` (or the plain segment)."""

    def __init__(
        self, length: int, batch_size: int, blank_idx: int, device: torch.device | str
    ) -> None:
        self.static_y = torch.full(
            (batch_size, length), blank_idx, dtype=torch.int64, device=device
        )
        self.blank_idx = blank_idx
        self.fn = None

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """y (B, U) -> g (B, U+1, H)."""
        self.load(y)
        return self.run(*y.shape)

    def load(self, y: torch.Tensor) -> None:
        pad_into(self.static_y, y, self.blank_idx)  # blank embeds to zeros

    def run(self, b: int, u: int) -> torch.Tensor:
        """The graph on the loaded labels of `b` rows and `u` tokens: g cut to them."""
        return self.fn(self.static_y)[:b, : u + 1]


class TrainingGraphs:
    """Bucketed CUDA graphs standing in for `RNNT.encode` and `RNNT.predict` during training.

    `encode(x (T, B, F), x_lens (B,)) -> f (B, T', H), f_lens (B,)` and
    `predict(y (B, U)) -> g (B, U+1, H)` return what the eager model returns, differentiably.
    The model must not be moved, re-cast or have its parameters replaced after capture (the
    optimizer must update parameters in place, as `rnnt.optim.lamb.Lamb` does).
    """

    def __init__(
        self,
        model: RNNT,
        batch_size: int,
        max_feat_len: int,
        max_token_len: int,
        num_cg: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError("training.num_cg > 0 needs a CUDA device (use num_cg 0 on CPU)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not model.training:
            raise ValueError("capture the training graphs with the model in training mode")
        self.model = model
        self.batch_size = batch_size
        self.feat_table = BucketTable(bucket_lengths(max_feat_len, num_cg), "encoder")
        self.token_table = BucketTable(bucket_lengths(max_token_len, num_cg), "prediction")
        stack_factor = model.encoder.stack_time.factor
        blank = model.blank_idx

        _quiet_accumulate_grad_stream_warning()
        enc_pool = torch.cuda.graph_pool_handle()
        pred_pool = torch.cuda.graph_pool_handle()
        self._enc: list[EncoderBucket] = []  # ascending, like the tables' lengths
        self._pred: list[PredictionBucket] = []
        in_feats = model.cfg.in_feats
        for length in reversed(self.feat_table.lengths):
            enc = EncoderBucket(length, batch_size, in_feats, stack_factor, dtype, device)
            enc.fn = torch.cuda.make_graphed_callables(
                _EncodeSegment(model.encoder), enc.static_inputs, pool=enc_pool
            )
            self._enc.insert(0, enc)
        # captured on a stream of their own: cuBLAS's workspace is per stream, and a graph
        # keeps the one it was captured with, so the two networks' backwards, which run at
        # once, must not share one (split-K partial sums and stream-K flags live in it)
        with _capture_stream(torch.cuda.Stream(device)):
            for length in reversed(self.token_table.lengths):
                pred = PredictionBucket(length, batch_size, blank, device)
                pred.fn = torch.cuda.make_graphed_callables(
                    _PredictSegment(model.prediction), (pred.static_y,), pool=pred_pool
                )
                self._pred.insert(0, pred)
        self._side = torch.cuda.Stream(device)
        self._own_first_grads()

    @classmethod
    def for_config(cls, model: RNNT, cfg: Config, train_utts: Sequence, tokenizer=None):
        """Graphs sized for a training run: the configured batch size, the longest utterance
        (capped by data.max_duration) at the slowest speed, the longest training transcript."""
        if not train_utts:
            raise ConfigError("no training utterances: cannot size the CUDA graphs")
        longest = min(cfg.data.max_duration, max(u.duration for u in train_utts))
        param = next(model.parameters())
        return cls(
            model,
            batch_size=cfg.training.batch_size,
            max_feat_len=max_spliced_frames(longest, cfg.features),
            max_token_len=longest_transcript(train_utts, tokenizer),
            num_cg=cfg.training.num_cg,
            dtype=param.dtype,
            device=param.device,
        )

    @property
    def feat_buckets(self) -> list[int]:
        return list(self.feat_table.lengths)

    @property
    def token_buckets(self) -> list[int]:
        return list(self.token_table.lengths)

    def _graphs_apply(self) -> bool:
        return self.model.training and torch.is_grad_enabled()

    def _check_rows(self, rows: int) -> None:
        if rows > self.batch_size:
            raise ValueError(
                f"a batch of {rows} utterances is larger than the {self.batch_size} the CUDA "
                "graphs were captured for (training.batch_size)"
            )

    def __call__(
        self, x: torch.Tensor, x_lens: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`RNNT.forward`: f (B, T', H), f_lens (B,), g (B, U+1, H), with the two networks'
        backwards side by side.

        The prediction graph replays on a side stream, after the encoder's, and autograd runs
        each graph's backward on the stream of its forward: the prediction network's backward
        (cuDNN's small, latency-bound steps) runs beside the encoder's, on the SMs the wave
        kernels leave free (the waves launch at the device's highest priority), instead of
        adding its latency to the step. The forwards stay in series: every graph replay sets
        the default generator's offset for the dropout inside it, in one device tensor that
        all graphs read, so two forward graphs at once could read each other's offset.
        """
        if not self._graphs_apply():
            return self.model(x, x_lens, y)
        self._check_rows(x.shape[1])
        self._check_rows(y.shape[0])
        enc = self._enc[self.feat_table(x.shape[0])]
        pred = self._pred[self.token_table(y.shape[1])]
        enc.load(x, x_lens)
        pred.load(y)  # on the current stream: the side stream touches static buffers only
        f, f_lens = enc.run(x.shape[0], x.shape[1])
        current = torch.cuda.current_stream()
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            g = pred.run(*y.shape)
        current.wait_stream(self._side)
        return f, f_lens, g

    def encode(self, x: torch.Tensor, x_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, B, in_feats), x_lens (B,) -> f (B, T', H), f_lens (B,), T' = ceil(T / stack)."""
        if not self._graphs_apply():
            return self.model.encode(x, x_lens)
        self._check_rows(x.shape[1])
        return self._enc[self.feat_table(x.shape[0])](x, x_lens)

    def predict(self, y: torch.Tensor) -> torch.Tensor:
        """y (B, U) -> g (B, U+1, H)."""
        if not self._graphs_apply():
            return self.model.predict(y)
        self._check_rows(y.shape[0])
        return self._pred[self.token_table(y.shape[1])](y)

    def _own_first_grads(self) -> None:
        """Make `.grad` of the graphed parameters independent of the graphs' static buffers.

        A graphed backward returns views of static gradient buffers, and autograd adopts such a
        tensor as `.grad` when `.grad` is None. The next replay of that bucket would then write
        into `.grad` and accumulate it onto itself (gradient accumulation over micro-batches,
        or `zero_grad(set_to_none=False)`). Cloning the first gradient of each step breaks the
        alias; later gradients are added in place. Registered after capture, so the captured
        backward graphs do not contain the copies.
        """
        graphed = list(self.model.encoder.parameters()) + list(self.model.prediction.parameters())
        for param in graphed:
            param.register_hook(_first_grad_owner(param))


def _quiet_accumulate_grad_stream_warning() -> None:
    """Gradients reach accumulators made on another stream by design, in the captures'
    warm-ups and in every backward of the prediction graph (its side stream); autograd makes
    the accumulating stream wait for them, so the warning that newer torch versions give about
    it would be noise. Older versions neither warn nor have the switch."""
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet is not None:
        quiet(False)


@contextmanager
def _capture_stream(stream: torch.cuda.Stream):
    """`torch.cuda.graph`'s default capture stream, which make_graphed_callables captures on,
    set to `stream` inside the block."""
    if not hasattr(torch.cuda.graph, "default_capture_stream"):
        # setting a new attribute would change nothing: both networks would share a workspace
        raise RuntimeError(
            f"torch {torch.__version__}: torch.cuda.graph has no default_capture_stream, so the "
            "prediction graphs cannot get a capture stream of their own (run training.num_cg=0)"
        )
    saved = torch.cuda.graph.default_capture_stream
    torch.cuda.graph.default_capture_stream = stream
    try:
        yield
    finally:
        torch.cuda.graph.default_capture_stream = saved


def _first_grad_owner(param: torch.Tensor):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad.clone() if param.grad is None else grad

    return hook
