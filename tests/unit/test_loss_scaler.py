"""DynamicLossScaler (rnnt/optim/loss_scaler.py) against torch.amp.GradScaler."""

import io
import math

import pytest
import torch

from rnnt.optim.loss_scaler import DynamicLossScaler


def gradscaler_history(pattern: list[bool], **kw) -> list[tuple[float, bool]]:
    """(scale after the step, whether SGD moved the weight) of a GradScaler fed a gradient
    that is inf on the steps `pattern` marks."""
    w = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **kw)
    history = []
    for overflow in pattern:
        before = w.detach().clone()
        loss = scaler.scale(w.sum())
        loss.backward()
        if overflow:
            w.grad[1] = math.inf
        scaler.step(sgd)
        scaler.update()
        sgd.zero_grad(set_to_none=True)
        history.append((scaler.get_scale(), not torch.equal(before, w.detach())))
    return history


@pytest.mark.parametrize("interval", [1, 3])
def test_the_scale_follows_gradscaler(interval):
    pattern = [False, False, True, False, False, False, True, True, False, False, False, False]
    kw = dict(init_scale=512.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval)
    expected = gradscaler_history(pattern, **kw)
    scaler = DynamicLossScaler("cpu", **kw)
    for (scale, stepped), overflow in zip(expected, pattern):
        assert stepped == (not overflow)
        scaler.update(torch.tensor(float(overflow)))
        assert scaler.get_scale() == scale


def test_state_dict_is_gradscalers_and_round_trips_through_torch_save():
    scaler = DynamicLossScaler("cpu", init_scale=512.0, growth_interval=3)
    for found in (0.0, 0.0, 1.0, 0.0):
        scaler.update(torch.tensor(found))
    state = scaler.state_dict()
    reference = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    reference.scale(torch.ones(()))  # GradScaler makes its tensors lazily
    assert set(state) == set(reference.state_dict())
    assert state["scale"] == 256.0 and state["_growth_tracker"] == 1
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    other = DynamicLossScaler("cpu", init_scale=2.0**16)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.state_dict() == state
    reference.load_state_dict(state)  # and GradScaler reads ours
    assert reference.get_scale() == 256.0


def test_disabled_scaler_is_the_identity():
    scaler = DynamicLossScaler("cpu", init_scale=512.0, enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss) is loss and scaler.grad_scale is None
    scaler.update(torch.tensor(1.0))
    assert scaler.get_scale() == 1.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScaler("cpu", growth_interval=0)
    with pytest.raises(ValueError, match="backoff"):
        DynamicLossScaler("cpu", backoff_factor=1.5)
