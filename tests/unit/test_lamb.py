import importlib
import io
import math

import pytest
import torch
from torch import nn

from rnnt.optim.lamb import Lamb

SHAPES = [(7, 5), (5,), (3, 4, 2), (6,)]


def reference_lamb(weights, grad_steps, lrs, betas, eps, wd, max_norm):
    """LAMB written plainly from the paper, per tensor, in float64: returns (w, m, v)."""
    b1, b2 = betas
    w = [x.double().clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, grads in enumerate(grad_steps, start=1):
        g = [x.double() for x in grads]
        total = math.sqrt(sum(float((x * x).sum()) for x in g))
        if max_norm > 0 and total > max_norm:
            g = [x * (max_norm / total) for x in g]
        for i in range(len(w)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2**t)
            update = m_hat / (v_hat.sqrt() + eps) + wd * w[i]
            w_norm, u_norm = float(w[i].norm()), float(update.norm())
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[i] = w[i] - lrs[i] * trust * update
    return w, m, v


def make_case(seed, steps, grad_scale=1.0, dtype=torch.float32):
    """Weights (the last one all zero: trust ratio 1) and per-step gradients, all exactly
    representable in fp16 so that low-precision runs see the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen).half().to(dtype) for s in SHAPES]
    weights[-1].zero_()
    grads = [
        [(torch.randn(s, generator=gen) * grad_scale).half().to(dtype) for s in SHAPES]
        for _ in range(steps)
    ]
    return weights, grads


def run_lamb(weights, grad_steps, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(params, **kw)
    for grads in grad_steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


def flat_state(opt, key):
    return torch.cat([g[key] for g in opt.state_dict()["groups"]])


@pytest.mark.parametrize(
    "grad_scale,max_norm,lr_tensor,clips",
    [
        (1.0, 1.0, False, True),
        (0.01, 1.0, True, False),
        (1.0, 0.0, False, False),  # clipping disabled
        (3.0, 2.0, True, True),
    ],
)
def test_matches_plain_reference(grad_scale, max_norm, lr_tensor, clips):
    weights, grad_steps = make_case(0, steps=5, grad_scale=grad_scale)
    total0 = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grad_steps[0]))
    assert (max_norm > 0 and total0 > max_norm) == clips
    betas, eps, wd, lr = (0.9, 0.999), 1e-9, 1e-3, 0.01
    lr_arg = torch.tensor(lr) if lr_tensor else lr
    params, opt = run_lamb(
        weights,
        grad_steps,
        lr=lr_arg,
        betas=betas,
        eps=eps,
        weight_decay=wd,
        max_grad_norm=max_norm,
    )
    ref_w, ref_m, ref_v = reference_lamb(
        weights, grad_steps, [lr] * len(SHAPES), betas, eps, wd, max_norm
    )
    for p, r in zip(params, ref_w):
        torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        flat_state(opt, "exp_avg").double(),
        torch.cat([m.reshape(-1) for m in ref_m]),
        atol=1e-6,
        rtol=0,
    )
    torch.testing.assert_close(
        flat_state(opt, "exp_avg_sq").double(),
        torch.cat([v.reshape(-1) for v in ref_v]),
        atol=1e-6,
        rtol=1e-5,
    )
    assert float(opt.steps) == 5
    assert opt.state_dict()["groups"][0]["master"] is None  # fp32 params: no copies


def test_param_groups_share_one_global_clip():
    weights, grad_steps = make_case(1, steps=3, grad_scale=2.0)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(
        [{"params": params[:2], "lr": 0.02}, {"params": params[2:], "weight_decay": 0.0}],
        lr=0.005,
        betas=(0.85, 0.98),
        max_grad_norm=1.0,
    )
    for grads in grad_steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    # weight decay differs per group: run the reference once per group with the global clip
    lrs = [0.02, 0.02, 0.005, 0.005]
    ref_all, _, _ = reference_lamb(weights, grad_steps, lrs, (0.85, 0.98), 1e-9, 1e-3, 1.0)
    ref_no_wd, _, _ = reference_lamb(weights, grad_steps, lrs, (0.85, 0.98), 1e-9, 0.0, 1.0)
    expected = ref_all[:2] + ref_no_wd[2:]
    for p, r in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_with_master_weights_track_fp32(dtype):
    weights, grad_steps = make_case(2, steps=4)
    low_w = [w.to(dtype) for w in weights]
    low_g = [[g.to(dtype) for g in step] for step in grad_steps]
    kw = dict(lr=0.01, betas=(0.9, 0.999), max_grad_norm=1.0)
    # the fp32 run sees exactly the values the low-precision run sees
    p32, _ = run_lamb([w.float() for w in low_w], [[g.float() for g in s] for s in low_g], **kw)
    plow, opt = run_lamb(low_w, low_g, **kw)
    masters = opt.master_params()
    assert all(m.dtype == torch.float32 for m in masters)
    for p, m, ref, w0 in zip(plow, masters, p32, low_w):
        assert p.dtype == dtype
        assert torch.equal(p.detach(), m.to(dtype))
        torch.testing.assert_close(m, ref.detach(), atol=1e-7, rtol=0)
        assert not torch.equal(p.detach(), w0)  # the cast-back weights moved


def test_built_before_the_cast_keeps_fp32_initial_masters():
    weights, grad_steps = make_case(6, steps=2)
    weights = [w + 1e-4 for w in weights]  # values fp16 cannot hold exactly
    model = nn.ParameterList([nn.Parameter(w.clone()) for w in weights])
    opt = Lamb(model.parameters(), lr=0.01, master_weights=True)
    model.to(torch.float16)  # same Parameter objects, new fp16 storage
    for grads in grad_steps:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.half()
        opt.step()
    ref, _ = run_lamb(weights, grad_steps, lr=0.01)
    for m, p, r in zip(opt.master_params(), model.parameters(), ref):
        torch.testing.assert_close(m, r.detach(), atol=1e-7, rtol=0)
        assert p.dtype == torch.float16 and torch.equal(p.detach(), m.half())

    auto = nn.ParameterList([nn.Parameter(w.clone()) for w in weights])
    opt = Lamb(auto.parameters(), lr=0.01)  # fp32 now: no masters
    auto.to(torch.float16)
    for p, g in zip(auto.parameters(), grad_steps[0]):
        p.grad = g.half()
    with pytest.raises(RuntimeError, match="master_weights=True"):
        opt.step()


def _scaled_grads(params, grads, scale):
    for p, g in zip(params, grads):
        p.grad = (g.float() * scale).to(p.dtype)


def test_grad_scaler_skips_inf_step_and_then_steps():
    weights, grad_steps = make_case(3, steps=2)
    params = [torch.nn.Parameter(w.half()) for w in weights]
    opt = Lamb(params, lr=0.01, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    scaler.scale(torch.ones(()))  # the scale tensor is created lazily by scale()
    before = [p.detach().clone() for p in params]
    masters_before = [m.clone() for m in opt.master_params()]

    _scaled_grads(params, grad_steps[0], 512.0)
    params[1].grad[2] = float("inf")
    params[2].grad[0, 0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 256.0
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    for m, b in zip(opt.master_params(), masters_before):
        assert torch.equal(m, b)
    assert float(opt.steps) == 0
    assert not flat_state(opt, "exp_avg").any() and not flat_state(opt, "exp_avg_sq").any()

    for grads in grad_steps:  # finite steps proceed, unscaled inside the optimizer
        _scaled_grads(params, grads, scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    assert float(opt.steps) == 2
    ref_w, _, _ = reference_lamb(
        weights, grad_steps, [0.01] * len(SHAPES), (0.9, 0.999), 1e-9, 1e-3, 1.0
    )
    for m, r in zip(opt.master_params(), ref_w):
        torch.testing.assert_close(m.double(), r, atol=1e-6, rtol=0)


def test_explicit_found_inf_and_grad_scale():
    weights, grad_steps = make_case(4, steps=1)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(params, lr=0.01)
    _scaled_grads(params, grad_steps[0], 4.0)
    opt.step(grad_scale=torch.tensor(4.0), found_inf=torch.ones(()))
    for p, w in zip(params, weights):
        assert torch.equal(p.detach(), w)
    assert float(opt.steps) == 0
    opt.step(grad_scale=torch.tensor(4.0), found_inf=torch.zeros(()))
    ref_w, _, _ = reference_lamb(
        weights, grad_steps, [0.01] * len(SHAPES), (0.9, 0.999), 1e-9, 1e-3, 1.0
    )
    for p, r in zip(params, ref_w):
        torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=0)


def test_state_dict_round_trip_with_masters():
    weights, grad_steps = make_case(5, steps=4)
    kw = dict(lr=0.01, betas=(0.9, 0.99), max_grad_norm=1.0)
    full, full_opt = run_lamb(
        [w.bfloat16() for w in weights], [[g.bfloat16() for g in s] for s in grad_steps], **kw
    )

    first, opt = run_lamb(
        [w.bfloat16() for w in weights], [[g.bfloat16() for g in s] for s in grad_steps[:2]], **kw
    )
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    # a fresh optimizer over fresh parameters (as after a restart), model weights restored
    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = Lamb(params, **kw)
    resumed.load_state_dict(state)
    assert float(resumed.steps) == 2
    for grads in grad_steps[2:]:
        for p, g in zip(params, grads):
            p.grad = g.bfloat16()
        resumed.step()
    for m, ref in zip(resumed.master_params(), full_opt.master_params()):
        assert torch.equal(m, ref)
    for p, ref in zip(params, full):
        assert torch.equal(p.detach(), ref.detach())


def test_load_state_dict_rejects_other_model():
    a = Lamb([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    b = Lamb([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    with pytest.raises(ValueError, match="group 0 holds 3 elements"):
        b.load_state_dict(a.state_dict())


def test_missing_gradient_is_named():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    opt = Lamb(params, lr=0.1)
    params[0].grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"parameter 1 of group 0 \(shape \(2, 2\)\)"):
        opt.step()


@pytest.mark.gpu
def test_step_is_sync_free_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).cuda().half()
    lr = torch.tensor(0.01, device="cuda")
    opt = Lamb(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cuda", init_scale=512.0)
    x = torch.randn(8, 16, device="cuda", dtype=torch.float16)
    loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaler.step(opt)
        lr.fill_(0.005)
        opt.step(found_inf=torch.zeros((), device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(opt.steps) == 2


@pytest.fixture
def lamb_kernel_device(monkeypatch):
    """Where the Triton LAMB kernel runs: compiled on CUDA, else under the interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    # the interpreter is chosen when the kernel is decorated: (re)import it under the flag
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import rnnt.kernels.lamb

    importlib.reload(rnnt.kernels.lamb)
    return "cpu"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf x 0
def test_fused_kernel_matches_the_pytorch_maths(lamb_kernel_device):
    # Two groups (one without weight decay), clipping, loss-scaled gradients and one
    # overflowed step that must leave everything unchanged.
    dev = lamb_kernel_device
    weights, grad_steps = make_case(2, steps=5, grad_scale=8.0)
    runs = []
    for fused in (False, True):
        params = [torch.nn.Parameter(w.clone().to(dev)) for w in weights]
        opt = Lamb(
            [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
            lr=torch.tensor(0.01, device=dev),
            max_grad_norm=1.0,
            fused=fused,
        )
        assert (opt._fused_update is not None) == fused
        for i, grads in enumerate(grad_steps):
            for p, g in zip(params, grads):
                p.grad = (g * 8.0).to(dev)
            if i == 2:
                params[1].grad.view(-1)[0] = float("inf")
            opt.grad_scale = torch.tensor(8.0, device=dev)
            opt.found_inf = torch.tensor(float(i == 2), device=dev)
            opt.step()
        runs.append((params, opt))
    (ref_params, ref_opt), (params, opt) = runs
    assert float(opt.steps) == float(ref_opt.steps) == 4
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            flat_state(opt, key), flat_state(ref_opt, key), rtol=1e-6, atol=1e-9
        )


def test_fused_kernel_rejects_mismatched_buffers(lamb_kernel_device):
    from rnnt.kernels.lamb import lamb_update_

    dev = lamb_kernel_device
    g, m, v = (torch.zeros(10, device=dev) for _ in range(3))
    one = torch.ones((), device=dev)
    with pytest.raises(ValueError, match="exp_avg_sq must be a contiguous fp32"):
        lamb_update_(g, m, v.double(), g, one, None, one, one, (0.9, 0.999), 1e-9, 0.0)
