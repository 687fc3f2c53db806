"""The MLPerf RNN Transducer: encoder, prediction network and joint network.

Shape letters used in the docstrings:
    B batch, T audio frames (after frame splicing), T' = ceil(T / stack_time_factor) encoder
    frames, U target tokens (without the start frame), H a hidden size, V = n_classes.

The encoder and the prediction network are separate callables (`RNNT.encode`, `RNNT.predict`),
each including its joint projection, so they can be captured as separate CUDA graphs with their
own length buckets. This module imports no logging, data, apex or MLPerf code.

Run `python -m rnnt.model CONFIG.yaml` to print the model and its parameter count.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rnnt.config import ConfigError, ModelConfig
from rnnt.kernels import lstm_wave

LSTMState = tuple[torch.Tensor, torch.Tensor]  # (h, c), each (layers, B, H)


def _init_lstm(lstm: nn.LSTM, forget_gate_bias: float, hh_bias_scale: float, scale: float) -> None:
    """MLPerf init: forget-gate bias_ih := forget_gate_bias, forget-gate bias_hh *= hh_bias_scale,
    then every LSTM weight and bias *= weights_init_scale. Gate order is (i, f, g, o)."""
    hidden = lstm.hidden_size
    with torch.no_grad():
        for name, param in lstm.named_parameters():
            if name.startswith("bias_ih"):
                param[hidden : 2 * hidden].fill_(forget_gate_bias)
            elif name.startswith("bias_hh"):
                param[hidden : 2 * hidden].mul_(hh_bias_scale)
        for param in lstm.parameters():
            param.mul_(scale)


@functools.cache
def _resolve_stack(
    choice: str, device: torch.device, batch: int, hidden: int, n_layers: int
) -> tuple[str, str]:
    """(LSTM, reason) that trains a stack of `n_layers` x `hidden` at `batch` rows on `device`
    under `model.encoder_lstm: choice`: "wave" or "cudnn" (nn.LSTM, on any device)."""
    if choice == "cudnn":
        return "cudnn", "model.encoder_lstm: cudnn"
    if device.type != "cuda":
        if choice == "wave":
            return "wave", f"the kernels' plain-PyTorch twin on {device.type} (slow, for tests)"
        return "cudnn", f"auto: the wave kernels run on a Hopper GPU, not on {device.type}"
    if choice == "wave":
        reason = lstm_wave.unsupported(device, hidden, n_layers)
        if reason is not None:
            raise ConfigError(f"model.encoder_lstm: wave cannot run here: {reason}")
        return "wave", "model.encoder_lstm: wave"
    # auto: where the kernels would only pad (a batch of 64 runs 192 rows) or cannot run,
    # nn.LSTM is the faster choice; the batch is checked first, so no kernel is built for it
    if batch % lstm_wave.BATCH_MULTIPLE:
        return "cudnn", (
            f"auto: a batch of {batch} is no multiple of the wave kernels' "
            f"{lstm_wave.BATCH_MULTIPLE} rows"
        )
    reason = lstm_wave.unsupported(device, hidden, n_layers)
    if reason is not None:
        return "cudnn", f"auto: the wave kernels cannot run here ({reason})"
    return "wave", f"auto: a Hopper GPU and a multiple of {lstm_wave.BATCH_MULTIPLE} rows"


def resolve_eval_encoder_lstm(
    choice: str, cfg: ModelConfig, device: torch.device
) -> tuple[str, str]:
    """(LSTM, reason) that runs the encoder's stacks when scoring under `eval.encoder_lstm:
    choice`. Raises ConfigError where `wave` is asked for and cannot run."""
    if choice == "cudnn":
        return "cudnn", "eval.encoder_lstm: cudnn"
    if device.type != "cuda":
        return "wave", f"the kernels' plain-PyTorch twin on {device.type} (slow, for tests)"
    for layers in (cfg.enc_pre_rnn_layers, cfg.enc_post_rnn_layers):
        reason = lstm_wave.unsupported(device, cfg.enc_n_hid, layers)
        if reason is not None:
            raise ConfigError(f"eval.encoder_lstm: wave cannot run here: {reason}")
    return "wave", "eval.encoder_lstm: wave"


def resolve_encoder_lstm(cfg: ModelConfig, device: torch.device, batch: int) -> tuple[str, str]:
    """(LSTM, reason) that trains the encoder's stacks at micro-batches of `batch` on `device`
    (evaluation: `resolve_eval_encoder_lstm`). Raises ConfigError where `wave` is asked for
    and cannot run."""
    pre, post = (
        _resolve_stack(cfg.encoder_lstm, device, batch, cfg.enc_n_hid, layers)
        for layers in (cfg.enc_pre_rnn_layers, cfg.enc_post_rnn_layers)
    )
    if pre == post:
        return pre
    return f"pre_rnn:{pre[0]}+post_rnn:{post[0]}", f"pre_rnn: {pre[1]}; post_rnn: {post[1]}"


def lstm_layer_weights(lstm: nn.LSTM) -> list[tuple[torch.Tensor, ...]]:
    """Per layer of `lstm`, its (w_ih, w_hh, b_ih, b_hh): the parameters themselves."""
    return [
        tuple(
            getattr(lstm, f"{kind}_l{i}")
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        )
        for i in range(lstm.num_layers)
    ]


class StackedLSTM(nn.Module):
    """`num_layers` LSTM layers with dropout between layers and on the output.

    Time-major: x (T, B, H_in) -> (T, B, H). With
    `lstm="wave"` training runs through rnnt.kernels.lstm_wave (from zero state; no state
    returned) on the same parameters; `lstm="auto"` does so where the wave kernels run and
    the batch is a multiple of their 192 rows (on a Hopper GPU), else nn.LSTM. In eval mode
    `eval_lstm` decides: "cudnn" (nn.LSTM) or "wave" (the kernels' forward, dropout off).

    `lengths` (B,), optional: the wave kernels skip the steps past the longest sequence (a
    CUDA-graph bucket pads most batches) and return zeros there; nn.LSTM runs every step. Either
    way the outputs before that step are the same.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int,
        dropout: float,
        cfg: ModelConfig,
        lstm: str = "cudnn",
        eval_lstm: str = "cudnn",
    ) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.dropout_p = dropout
        self.lstm = lstm
        self.eval_lstm = eval_lstm
        # a list of one: the parameter names that checkpoints hold (layers.0.weight_ih_l0, ...)
        self.layers = nn.ModuleList(
            [nn.LSTM(input_size, hidden_size, num_layers=num_layers, dropout=dropout)]
        )
        _init_lstm(
            self.layers[0],
            cfg.forget_gate_bias,
            cfg.hidden_hidden_bias_scale,
            cfg.weights_init_scale,
        )
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def runs_wave(self, x: torch.Tensor, state: LSTMState | None = None) -> bool:
        """Whether forward(x, state) runs the wave kernels in the current mode."""
        if not self.training:
            return self.eval_lstm == "wave"
        if self.lstm == "cudnn" or (self.lstm == "auto" and state is not None):
            return False
        key = (self.lstm, x.device, x.shape[1], self.hidden_size, self.num_layers)
        return _resolve_stack(*key)[0] == "wave"

    def layer_weights(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (w_ih, w_hh, b_ih, b_hh), the nn.LSTM parameters themselves."""
        return lstm_layer_weights(self.layers[0])

    def forward(
        self,
        x: torch.Tensor,
        state: LSTMState | None = None,
        lengths: torch.Tensor | None = None,
        stack_pairs: bool = False,
    ) -> tuple[torch.Tensor, LSTMState | None]:
        """stack_pairs (wave kernels only, with lengths): the output as StackTime(2) makes it,
        (ceil(T / 2), B, 2H) with each row's padding frames zero, written so by the kernels."""
        if self.runs_wave(x, state):
            if state is not None:
                raise ValueError("the wave LSTM runs from zero state only")
            p = self.dropout_p if self.training else 0.0
            y = lstm_wave.lstm_stack(
                x, self.layer_weights(), p, lengths=lengths, stack_pairs=stack_pairs
            )
            return (y if self.training else y.to(x.dtype)), None
        if stack_pairs:
            raise ValueError("stack_pairs: only the wave kernels write stacked frames")
        x, state = self.layers[0](x, state)
        return self.dropout(x), state


class StackTime(nn.Module):
    """Concatenate groups of `factor` consecutive frames.

    x (T, B, H) -> (ceil(T / factor), B, H * factor); lengths (B,) -> ceil(lengths / factor).
    Frames at or past an utterance's length are zeroed first, so the last group of an
    utterance whose length is not a multiple of `factor` is completed with zeros, whatever the
    batch's padding holds (the LSTM's output for padding frames is not zero). The output then
    depends on the utterance alone, not on how long the other utterances of its batch are:
    the same on one rank or split over eight, and the same in a CUDA-graph bucket.
    """

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, b, h = x.shape
        past_end = torch.arange(t, device=x.device)[:, None] >= lens.to(x.device)[None, :]
        x = x.masked_fill(past_end[:, :, None], 0.0)
        pad = (-t) % self.factor
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        x = x.transpose(0, 1).reshape(b, (t + pad) // self.factor, h * self.factor)
        return x.transpose(0, 1), self.output_lengths(lens)

    def output_lengths(self, lens: torch.Tensor) -> torch.Tensor:
        return torch.div(lens + self.factor - 1, self.factor, rounding_mode="floor")


class Encoder(nn.Module):
    """pre-RNN -> stack time -> post-RNN -> joint_enc projection.

    x (T, B, in_feats), lens (B,) -> f (B, T', joint_n_hid), f_lens (B,).
    """

    def __init__(self, cfg: ModelConfig, eval_lstm: str = "cudnn") -> None:
        super().__init__()
        hid = cfg.enc_n_hid
        self.pre_rnn = StackedLSTM(
            cfg.in_feats,
            hid,
            cfg.enc_pre_rnn_layers,
            cfg.enc_dropout,
            cfg,
            cfg.encoder_lstm,
            eval_lstm,
        )
        self.stack_time = StackTime(cfg.enc_stack_time_factor)
        self.post_rnn = StackedLSTM(
            hid * cfg.enc_stack_time_factor,
            hid,
            cfg.enc_post_rnn_layers,
            cfg.enc_dropout,
            cfg,
            cfg.encoder_lstm,
            eval_lstm,
        )
        self.joint_enc = nn.Linear(hid, cfg.joint_n_hid)

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stack_time.factor == 2 and self.pre_rnn.runs_wave(x):
            # the kernels write the stacked, masked frames themselves: no copies between stacks
            x, _ = self.pre_rnn(x, lengths=lens, stack_pairs=True)
            lens = self.stack_time.output_lengths(lens)
        else:
            x, _ = self.pre_rnn(x, lengths=lens)
            x, lens = self.stack_time(x, lens)
        x, _ = self.post_rnn(x, lengths=lens)
        # projected time-major, then viewed batch-major: the copy a transposed input would need
        # is of the narrower output
        return self.joint_enc(x).transpose(0, 1), lens


class Prediction(nn.Module):
    """Label embedding -> LSTMs -> joint_pred projection.

    Blank has no embedding: the index `blank_idx` (used both as the start-of-sequence symbol and
    as padding) embeds to a zero vector, which keeps masked decoding branch-free.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.blank_idx = cfg.blank_idx
        self.embed = nn.Embedding(cfg.n_classes - 1, cfg.pred_n_hid)
        self.dec_rnn = StackedLSTM(
            cfg.pred_n_hid, cfg.pred_n_hid, cfg.pred_rnn_layers, cfg.pred_dropout, cfg
        )
        self.joint_pred = nn.Linear(cfg.pred_n_hid, cfg.joint_n_hid)

    def embed_labels(self, y: torch.Tensor) -> torch.Tensor:
        """y (...) int labels in [0, V) -> (..., pred_n_hid); blank -> zeros."""
        is_label = y != self.blank_idx
        emb = self.embed(torch.where(is_label, y, torch.zeros_like(y)))
        return emb * is_label.unsqueeze(-1).to(emb.dtype)

    def forward(
        self, y: torch.Tensor, state: LSTMState | None = None
    ) -> tuple[torch.Tensor, LSTMState]:
        """Teacher forcing: y (B, U) labels -> g (B, U+1, joint_n_hid) with a zero start frame.

        Padding positions of y may hold any valid index; they only affect outputs past U_b.
        """
        emb = F.pad(self.embed_labels(y), (0, 0, 1, 0))  # prepend the blank start frame
        g, state = self.dec_rnn(emb.transpose(0, 1), state)
        return self.joint_pred(g.transpose(0, 1)), state

    def step(self, label: torch.Tensor, state: LSTMState | None) -> tuple[torch.Tensor, LSTMState]:
        """One decoding step: label (B,) (blank = start) -> g (B, joint_n_hid), new state."""
        emb = self.embed_labels(label).unsqueeze(0)  # (1, B, H)
        g, state = self.dec_rnn(emb, state)
        return self.joint_pred(g[0]), state


class JointOperands(NamedTuple):
    """What the joint computes its logits from, for a loss that computes them itself."""

    weight: torch.Tensor  # (V, H), the output layer's
    bias: torch.Tensor  # (V,)
    dropout_p: float  # the dropout in effect: 0 outside training


class Joint(nn.Module):
    """logits = fc(dropout(relu(f + g))), broadcast over (T, U+1).

    The projections joint_enc / joint_pred live in Encoder / Prediction; this module holds only
    the part that the fused loss kernel replaces, which reads it through `operands()`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dropout = nn.Dropout(cfg.joint_dropout) if cfg.joint_dropout > 0 else nn.Identity()
        self.fc = nn.Linear(cfg.joint_n_hid, cfg.n_classes)

    def operands(self) -> JointOperands:
        p = self.dropout.p if isinstance(self.dropout, nn.Dropout) and self.training else 0.0
        return JointOperands(self.fc.weight, self.fc.bias, p)

    def forward(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """f (B, T, H), g (B, U+1, H) -> logits (B, T, U+1, V)."""
        h = torch.relu(f.unsqueeze(2) + g.unsqueeze(1))
        return self.fc(self.dropout(h))

    def step(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """f (B, H), g (B, H) -> logits (B, V) (no broadcast; used by the decoders)."""
        return self.fc(self.dropout(torch.relu(f + g)))


class RNNT(nn.Module):
    """The transducer. `eval_encoder_lstm` ("cudnn" or "wave", a config's eval.encoder_lstm):
    what runs the encoder's LSTM stacks in eval mode."""

    def __init__(self, cfg: ModelConfig, eval_encoder_lstm: str = "cudnn") -> None:
        super().__init__()
        self.cfg = cfg
        self.blank_idx = cfg.blank_idx
        self.encoder = Encoder(cfg, eval_encoder_lstm)
        self.prediction = Prediction(cfg)
        self.joint = Joint(cfg)

    def encode(self, x: torch.Tensor, x_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, B, in_feats), x_lens (B,) -> f (B, T', joint_n_hid), f_lens (B,)."""
        return self.encoder(x, x_lens)

    def encoded_lengths(self, x_lens: torch.Tensor) -> torch.Tensor:
        """The f_lens of `encode` for these x_lens, on their device (e.g. host lengths)."""
        return self.encoder.stack_time.output_lengths(x_lens)

    def predict(self, y: torch.Tensor) -> torch.Tensor:
        """y (B, U) -> g (B, U+1, joint_n_hid)."""
        return self.prediction(y)[0]

    def forward(
        self, x: torch.Tensor, x_lens: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the joint inputs f (B, T', H), f_lens (B,) and g (B, U+1, H).

        The joint itself runs inside the loss (`rnnt.loss`), so a fused backend never has to
        materialise the (B, T', U+1, V) logits.
        """
        f, f_lens = self.encode(x, x_lens)
        return f, f_lens, self.predict(y)


def gradient_buckets(model: RNNT) -> list[list[nn.Parameter]]:
    """The parameters in the order a training backward finishes their gradients: the joint's
    output layer (first thing the loss's backward reaches), the prediction network (its
    forward ran after the encoder's, so autograd reaches it first), then the encoder."""
    buckets = [list(model.joint.parameters()), list(model.prediction.parameters())]
    buckets.append(list(model.encoder.parameters()))
    if sum(len(b) for b in buckets) != len(list(model.parameters())):
        raise ValueError("gradient_buckets: the RNNT has parameters outside its three parts")
    return buckets


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    from rnnt.config import add_config_args, load_config_or_exit

    parser = argparse.ArgumentParser(description="Build the model of a config and count it.")
    add_config_args(parser)
    args = parser.parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    model = RNNT(cfg.model)
    print(model)
    print(f"parameters: {count_parameters(model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
