import inspect
import itertools
import math

import pytest
import torch

from rnnt.config import ConfigError, ModelConfig
from rnnt.loss import ReferenceLoss, TransducerLoss, rnnt_loss_reference
from rnnt.model import Joint


def brute_force_nll(logits: torch.Tensor, targets: list[int], blank: int) -> float:
    """-log of the sum over every alignment, enumerated one by one (T x U lattice paths)."""
    t_len, u1, _ = logits.shape
    u_len = u1 - 1
    lp = torch.log_softmax(logits.double(), dim=-1)
    path_logps = []
    # An alignment: where the U label emissions sit among the T-1+U moves before the final blank.
    for label_moves in itertools.combinations(range(t_len - 1 + u_len), u_len):
        t = u = 0
        logp = 0.0
        for step in range(t_len - 1 + u_len):
            if step in label_moves:
                logp += float(lp[t, u, targets[u]])
                u += 1
            else:
                logp += float(lp[t, u, blank])
                t += 1
        logp += float(lp[t_len - 1, u_len, blank])
        path_logps.append(logp)
    top = max(path_logps)
    return -(top + math.log(sum(math.exp(x - top) for x in path_logps)))


@pytest.mark.parametrize("vocab", [2, 5, 17])
def test_reference_equals_sum_over_all_alignments(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for t_len, u_len in itertools.product(range(1, 5), range(0, 5)):
        logits = torch.randn(1, t_len, u_len + 1, vocab, generator=gen, dtype=torch.float64) * 2
        targets = torch.randint(0, vocab - 1, (1, u_len), generator=gen)
        blank = vocab - 1
        got = rnnt_loss_reference(
            logits, targets, torch.tensor([t_len]), torch.tensor([u_len]), blank
        )
        want = brute_force_nll(logits[0], targets[0].tolist(), blank)
        assert got.dtype == torch.float64
        assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-5), (t_len, u_len)


def test_blank_need_not_be_last_class():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 3, 3, 6, generator=gen, dtype=torch.float64)
    targets = torch.tensor([[4, 1]])
    got = rnnt_loss_reference(logits, targets, torch.tensor([3]), torch.tensor([2]), blank=0)
    assert got.item() == pytest.approx(brute_force_nll(logits[0], [4, 1], 0), rel=1e-9)


def test_gradcheck():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 2], [1, 1]])
    logit_lens = torch.tensor([3, 2])
    target_lens = torch.tensor([2, 1])
    assert torch.autograd.gradcheck(
        lambda x: rnnt_loss_reference(x, targets, logit_lens, target_lens, 3), (logits,)
    )


def test_ragged_batch_matches_each_utterance_alone_and_padding_gets_no_gradient():
    gen = torch.Generator().manual_seed(1)
    vocab, blank = 7, 6
    shapes = [(5, 3), (2, 0), (1, 2), (4, 4), (1, 0)]  # (T_b, U_b), incl. T=1 and U=0
    t_max = max(t for t, _ in shapes)
    u_max = max(u for _, u in shapes)
    # Padding holds garbage: huge logits and out-of-range labels.
    logits = torch.randn(len(shapes), t_max, u_max + 1, vocab, generator=gen) * 1e4
    targets = torch.randint(-50, 50, (len(shapes), u_max), generator=gen)
    singles = []
    for b, (t_len, u_len) in enumerate(shapes):
        one = torch.randn(1, t_len, u_len + 1, vocab, generator=gen)
        logits[b, :t_len, : u_len + 1] = one[0]
        targets[b, :u_len] = torch.randint(0, blank, (u_len,), generator=gen)
        one.requires_grad_(True)
        nll = rnnt_loss_reference(
            one, targets[b : b + 1, :u_len], torch.tensor([t_len]), torch.tensor([u_len]), blank
        )
        nll.sum().backward()
        singles.append((nll.item(), one.grad[0]))
    logits.requires_grad_(True)
    lens_t = torch.tensor([t for t, _ in shapes])
    lens_u = torch.tensor([u for _, u in shapes])
    nll = rnnt_loss_reference(logits, targets, lens_t, lens_u, blank)
    nll.sum().backward()
    grad = logits.grad
    assert torch.isfinite(grad).all()
    for b, (t_len, u_len) in enumerate(shapes):
        assert nll[b].item() == pytest.approx(singles[b][0], rel=1e-5)
        torch.testing.assert_close(grad[b, :t_len, : u_len + 1], singles[b][1])
        inside = torch.zeros_like(grad[b], dtype=torch.bool)
        inside[:t_len, : u_len + 1] = True
        assert (grad[b][~inside] == 0).all()


def test_single_frame_and_empty_target_closed_forms():
    logits = torch.randn(1, 1, 3, 5, dtype=torch.float64)
    lp = torch.log_softmax(logits[0, 0], dim=-1)
    targets = torch.tensor([[2, 0]])
    # T = 1: emit both labels, then the final blank, all at t = 0.
    got = rnnt_loss_reference(logits, targets, torch.tensor([1]), torch.tensor([2]), 4)
    assert got.item() == pytest.approx(-(lp[0, 2] + lp[1, 0] + lp[2, 4]).item(), rel=1e-12)
    # U = 0: blanks only.
    logits = torch.randn(1, 4, 1, 5, dtype=torch.float64)
    got = rnnt_loss_reference(
        logits, torch.zeros(1, 0, dtype=torch.long), torch.tensor([4]), torch.tensor([0]), 4
    )
    want = -torch.log_softmax(logits[0, :, 0], dim=-1)[:, 4].sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-12)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="targets must be"):
        rnnt_loss_reference(
            torch.zeros(1, 2, 3, 4),
            torch.zeros(1, 3, dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([2]),
            3,
        )
    with pytest.raises(ValueError, match="blank index"):
        rnnt_loss_reference(
            torch.zeros(1, 2, 3, 4),
            torch.zeros(1, 2, dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([2]),
            4,
        )


def _joint_inputs(b=3, t=4, u=3, hid=8, vocab=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    joint = Joint(ModelConfig(joint_n_hid=hid, n_classes=vocab, joint_dropout=0.0))
    f = torch.randn(b, t, hid, generator=gen, requires_grad=True)
    g = torch.randn(b, u + 1, hid, generator=gen, requires_grad=True)
    f_lens = torch.tensor([t, t - 1, 1][:b])
    target_lens = torch.tensor([u, 0, u - 1][:b])
    targets = torch.randint(0, vocab - 1, (b, u), generator=gen)
    return joint, f, g, f_lens, targets, target_lens


def test_transducer_loss_reference_backend_is_joint_then_reference():
    joint, f, g, f_lens, targets, target_lens = _joint_inputs()
    loss = TransducerLoss("reference", 5)(joint, f, g, f_lens, targets, target_lens)
    loss.backward()
    got = (f.grad.clone(), g.grad.clone(), joint.fc.weight.grad.clone())
    f.grad = g.grad = joint.fc.weight.grad = None
    want = rnnt_loss_reference(joint(f, g), targets, f_lens, target_lens, 5).mean()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(got, (f.grad, g.grad, joint.fc.weight.grad), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_backend_with_host_lengths_computes_only_near_the_lattices(
    dtype, group_size, monkeypatch
):
    """Given the host lengths, the reference runs the joint on groups of utterances sorted by
    frames, each padded to its own longest (one utterance a group: exactly its T_b x (U_b+1)
    rows), with the padded computation's loss and gradients."""
    monkeypatch.setattr(ReferenceLoss, "group_size", group_size)
    gen = torch.Generator().manual_seed(3)
    b, t_max, u_max, hid, vocab = 7, 9, 5, 8, 6
    joint = Joint(ModelConfig(joint_n_hid=hid, n_classes=vocab, joint_dropout=0.0)).to(dtype)
    f = torch.randn(b, t_max, hid, generator=gen, dtype=dtype, requires_grad=True)
    g = torch.randn(b, u_max + 1, hid, generator=gen, dtype=dtype, requires_grad=True)
    f_lens = torch.tensor([9, 2, 5, 1, 7, 9, 3])
    target_lens = torch.tensor([5, 1, 0, 2, 4, 3, 5])
    targets = torch.randint(0, vocab - 1, (b, u_max), generator=gen)
    leaves = (f, g, joint.fc.weight)
    loss = TransducerLoss("reference", 5)
    padded = loss(joint, f, g, f_lens, targets, target_lens)
    padded_grads = torch.autograd.grad(padded, leaves)
    rows = []
    hook = joint.register_forward_hook(
        lambda _m, inputs, _out: rows.append(inputs[0].shape[1] * inputs[1].shape[1])
    )
    host = (f_lens.tolist(), target_lens.tolist())
    grouped = loss(joint, f, g, f_lens, targets, target_lens, host_lens=host)
    hook.remove()
    by_frames = sorted(zip(*host))
    groups = [by_frames[i : i + group_size] for i in range(0, b, group_size)]
    want_rows = [max(t for t, _ in grp) * (max(u for _, u in grp) + 1) for grp in groups]
    assert rows == want_rows
    assert sum(r * len(grp) for r, grp in zip(rows, groups)) < b * t_max * (u_max + 1)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else {}
    torch.testing.assert_close(grouped, padded, **tol)
    for got, want in zip(torch.autograd.grad(grouped, leaves), padded_grads, strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_reference_backend_computes_in_float32_for_half_inputs():
    joint, f, g, f_lens, targets, target_lens = _joint_inputs()
    loss32 = TransducerLoss("reference", 5)(joint, f, g, f_lens, targets, target_lens)
    joint = joint.to(torch.bfloat16)
    loss16 = TransducerLoss("reference", 5)(
        joint, f.bfloat16(), g.bfloat16(), f_lens, targets, target_lens
    )
    assert loss16.dtype == torch.float32
    assert loss16.item() == pytest.approx(loss32.item(), rel=2e-2)


def test_unknown_backend_names_the_config_key():
    with pytest.raises(ConfigError, match=r"loss\.backend: expected one of 'reference', 'torch"):
        TransducerLoss("warp", 5)


def test_missing_optional_backend_names_the_config_key():
    try:
        import apex.contrib.transducer  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"loss\.backend: 'apex' needs"):
            TransducerLoss("apex", 5)
    else:
        pytest.skip("apex is installed here")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "backend, host",
    [("torchaudio", False), ("apex", False), ("apex", True)],
    ids=["torchaudio", "apex", "apex-host-lengths"],
)
def test_optional_backend_matches_reference(backend, host, dtype):
    pytest.importorskip("torchaudio" if backend == "torchaudio" else "apex.contrib.transducer")
    gen = torch.Generator().manual_seed(5)
    b, t, u, hid, vocab = 6, 30, 12, 32, 50
    joint = Joint(ModelConfig(joint_n_hid=hid, n_classes=vocab, joint_dropout=0.0))
    joint = joint.cuda().to(dtype)
    # the reference sees the same (rounded) values in float32
    ref_joint = Joint(ModelConfig(joint_n_hid=hid, n_classes=vocab, joint_dropout=0.0)).cuda()
    ref_joint.load_state_dict({k: v.float() for k, v in joint.state_dict().items()})
    f = torch.randn(b, t, hid, generator=gen).cuda().to(dtype).requires_grad_(True)
    g = torch.randn(b, u + 1, hid, generator=gen).cuda().to(dtype).requires_grad_(True)
    f32, g32 = (x.detach().float().requires_grad_(True) for x in (f, g))
    # No T = 1 or U = 0 here: torchaudio's CUDA kernel gets those wrong (observed with
    # torchaudio 2.11: 0 instead of the loss that its CPU kernel and the reference agree on).
    f_lens = torch.tensor([30, 25, 2, 17, 30, 8]).cuda()
    target_lens = torch.tensor([12, 1, 3, 12, 5, 1]).cuda()
    targets = torch.randint(0, vocab - 1, (b, u), generator=gen).cuda()
    ref = TransducerLoss("reference", vocab - 1)(ref_joint, f32, g32, f_lens, targets, target_lens)
    ref_grads = torch.autograd.grad(ref, (f32, g32, ref_joint.fc.weight))
    host_lens = (f_lens.tolist(), target_lens.tolist()) if host else None
    got = TransducerLoss(backend, vocab - 1)(
        joint, f, g, f_lens, targets, target_lens, host_lens=host_lens
    )
    got_grads = torch.autograd.grad(got, (f, g, joint.fc.weight))
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert got.item() == pytest.approx(ref.item(), rel=tol)
    for a, r in zip(got_grads, ref_grads, strict=True):
        assert (a.float() - r).abs().max() <= tol * r.abs().max()


def _specialization(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a variant of `kernel` for, as its JIT keys a launch: each
    constexpr's value; for each other argument not in do_not_specialize, an int's being 1 or
    a multiple of 16, and a tensor's dtype and 16-byte alignment (unless
    do_not_specialize_on_alignment); and the launch options."""
    params = list(inspect.signature(kernel.fn).parameters.items())
    bound = dict(zip((name for name, _ in params), args)) | kwargs
    skip = set(kernel.kwargs.get("do_not_specialize") or ())
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    key = []
    for name, param in params:
        value = bound[name]
        if param.annotation == "tl.constexpr":
            key.append((name, value))
        elif name in skip:
            continue
        elif isinstance(value, torch.Tensor):
            key.append((name, value.dtype, name in unaligned or value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            key.append((name, value == 1, value % 16 == 0))
        else:
            key.append((name, type(value).__name__))
    key += sorted((k, v) for k, v in kwargs.items() if k not in dict(params))
    return tuple(key)


def test_the_fused_warm_up_compiles_every_kernel_variant_that_training_batches_run(monkeypatch):
    """Triton compiles a kernel once per specialization. The warm-up's stand-in batches must
    hit every specialization that training batches of other sizes, lengths and transcripts
    hit, or those compile in the timed steps (a GPU test once found six). Launches are
    recorded under the Triton interpreter and keyed as Triton's JIT keys them."""
    jl = pytest.importorskip("rnnt.kernels.joint_loss")
    launched: dict[str, set] = {}

    def recorder(name, kernel):
        class Launch:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launched.setdefault(name, set()).add(_specialization(kernel, args, kwargs))
                    return kernel[grid](*args, **kwargs)

                return run

        return Launch()

    for name in [n for n in dir(jl) if n.endswith("_kernel")]:
        monkeypatch.setattr(jl, name, recorder(name, getattr(jl, name)))
    hid, vocab, longest = 16, 32, 20  # label tiles 16 and 32
    joint = Joint(ModelConfig(joint_n_hid=hid, n_classes=vocab, joint_dropout=0.1)).train()
    loss = TransducerLoss("fused", vocab - 1)
    assert loss.compiles_kernels and not TransducerLoss("reference", vocab - 1).compiles_kernels
    before = {k: v.clone() for k, v in joint.state_dict().items()}
    loss.warm_up(joint, longest)
    # through a copy: the joint's weights and gradients are as they were
    assert all(torch.equal(v, before[k]) for k, v in joint.state_dict().items())
    assert all(param.grad is None for param in joint.parameters())
    warmed = {name: set(keys) for name, keys in launched.items()}
    assert {"hidden_kernel", "posteriors_kernel", "grad_fg_kernel"} <= set(warmed)
    launched.clear()
    gen = torch.Generator().manual_seed(0)
    for bsz, frames, tokens in [(6, 9, 20), (5, 7, 13), (3, 11, 16), (7, 8, 9)]:
        f_lens = torch.randint(1, frames + 1, (bsz,), generator=gen)
        target_lens = torch.randint(0, tokens + 1, (bsz,), generator=gen)
        f_lens[0], target_lens[-1] = frames, tokens
        f = torch.randn(bsz, frames, hid, generator=gen, requires_grad=True)
        g = torch.randn(bsz, tokens + 1, hid, generator=gen, requires_grad=True)
        targets = torch.randint(0, vocab - 1, (bsz, tokens), generator=gen)
        host = (f_lens.tolist(), target_lens.tolist())
        loss(joint, f, g, f_lens, targets, target_lens, host_lens=host).backward()
    for name, keys in launched.items():
        assert keys <= warmed.get(name, set()), f"{name} compiles again in training"
