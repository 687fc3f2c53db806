"""Model FLOPs of a training step (rnnt/flops.py) against torch's FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rnnt.flops import peak_flops, step_flops
from rnnt.model import RNNT
from tests.helpers import tiny_cfg

CFG = tiny_cfg()


def counted_flops(model: RNNT, frames: int, tokens: int, batch: int) -> int:
    """FlopCounterMode's count of one forward + backward on a (frames, tokens) batch. oneDNN's
    fused CPU LSTM is invisible to the counter, so it is switched off."""
    x = torch.randn(frames, batch, CFG.in_feats, requires_grad=True)
    y = torch.randint(0, CFG.n_classes - 1, (batch, tokens))
    with torch.backends.mkldnn.flags(enabled=False), FlopCounterMode(display=False) as counter:
        f, _, g = model(x, torch.full((batch,), frames), y)
        model.joint(f, g).sum().backward()
    return counter.get_total_flops()


def no_initial_state_grad(batch: int) -> int:
    """The counter sees one GEMM fewer per LSTM layer than 3x the forward: no gradient flows
    into the zero initial state h_{-1}, which saves 2*B*4H*H FLOPs per layer."""
    layers = [
        (CFG.enc_n_hid, CFG.enc_pre_rnn_layers + CFG.enc_post_rnn_layers),
        (CFG.pred_n_hid, CFG.pred_rnn_layers),
    ]
    return sum(n * 2 * batch * 4 * h * h for h, n in layers)


def test_step_flops_match_torch_flop_counter():
    model = RNNT(CFG)
    b, t, u = 3, 9, 4
    assert counted_flops(model, t, u, b) == step_flops(CFG, [t] * b, [u] * b) - (
        no_initial_state_grad(b)
    )


def test_a_ragged_batch_counts_each_utterance_at_its_own_lengths():
    model = RNNT(CFG)
    shapes = [(9, 4), (5, 1), (2, 3)]  # odd and even frames: stack-time rounds up
    counted = sum(counted_flops(model, t, u, 1) + no_initial_state_grad(1) for t, u in shapes)
    frames, tokens = zip(*shapes)
    assert step_flops(CFG, frames, tokens) == counted
    assert step_flops(CFG, frames, tokens) < step_flops(CFG, [9] * 3, [4] * 3)  # padding
    with pytest.raises(ValueError, match="3 frame counts but 2 token counts"):
        step_flops(CFG, frames, tokens[:2])


def test_the_peak_comes_from_the_override_or_is_absent_on_the_cpu():
    assert peak_flops(torch.device("cpu"), 123.5) == (123.5e12, "training.peak_tflops")
    peak, why = peak_flops(torch.device("cpu"))
    assert peak is None and "CPU" in why
