import io

import pytest
import torch
from torch import nn

from rnnt.optim.ema import EMA


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def test_update_matches_closed_form():
    model = tiny_model()
    start = [p.detach().clone() for p in model.parameters()]
    ema = EMA(model, decay=0.9)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        seen.append([p.detach().clone() for p in model.parameters()])
        ema.update(model)
    for i, e in enumerate(ema.weights):
        # ema_3 = d^3 e_0 + (1 - d) (d^2 w_1 + d w_2 + w_3)
        expected = 0.9**3 * start[i] + 0.1 * (0.81 * seen[0][i] + 0.9 * seen[1][i] + seen[2][i])
        torch.testing.assert_close(e, expected, atol=1e-6, rtol=0)


def test_low_precision_model_keeps_fp32_average():
    model = tiny_model().half()
    ema = EMA(model, decay=0.5)
    assert all(w.dtype == torch.float32 for w in ema.weights)
    before = [w.clone() for w in ema.weights]
    masters = [torch.full(w.shape, 1.0 / 3.0) for w in ema.weights]  # fp32 masters
    ema.update(masters)
    for b, w in zip(before, ema.weights):
        torch.testing.assert_close(w, 0.5 * b + 0.5 / 3.0, atol=1e-7, rtol=0)
    ema.update(model)  # fp16 parameters are accepted and averaged in fp32
    for b, w, p in zip(before, ema.weights, model.parameters()):
        torch.testing.assert_close(w, 0.25 * b + 0.25 / 3.0 + 0.5 * p.float(), atol=1e-7, rtol=0)


def test_copy_to_writes_in_place_with_cast():
    source = tiny_model()
    ema = EMA(source, decay=0.99)
    target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).half()
    pointers = [p.data_ptr() for p in target.parameters()]
    ema.copy_to(target)
    assert [p.data_ptr() for p in target.parameters()] == pointers
    for p, w in zip(target.parameters(), ema.weights):
        assert p.dtype == torch.float16
        assert torch.equal(p, w.half())


def test_state_dict_round_trip():
    model = tiny_model()
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    buf = io.BytesIO()
    torch.save(ema.state_dict(), buf)
    buf.seek(0)
    restored = EMA(tiny_model(), decay=0.5)
    addresses = [w.data_ptr() for w in restored.weights]
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.decay == 0.9
    assert [w.data_ptr() for w in restored.weights] == addresses
    for a, b in zip(ema.weights, restored.weights):
        assert torch.equal(a, b)


def test_mismatched_model_is_rejected():
    ema = EMA(tiny_model(), decay=0.9)
    with pytest.raises(ValueError, match=r"tensor 0 has shape \(4, 5\), the EMA \(4, 3\)"):
        ema.copy_to(nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="got 2 tensors, the EMA holds 4"):
        ema.update(list(nn.Linear(3, 4).parameters()))
    with pytest.raises(ValueError, match="decay"):
        EMA(tiny_model(), decay=1.0)
