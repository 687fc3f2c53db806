"""The sm90 logits GEMM with softmax partials (rnnt/kernels/csrc/logits_lse_sm90.cu) against
cuBLAS and a plain-PyTorch oracle of the partials, and the fused loss with it against the fused
loss with cuBLAS (the reference path) and the plain-PyTorch loss.

Without a GPU: the selection rules, and the kernel source built by the real nvcc (where there
is one) with its shape checks, which run before any CUDA call.
"""

import math

import pytest
import torch

pytest.importorskip("triton")
from rnnt.kernels import cuda_build, logits_gemm  # noqa: E402
from rnnt.loss import TransducerLoss  # noqa: E402

LOG2E = 1 / math.log(2)


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (sm_90)")


def test_selection_rules_off_hopper():
    cpu = torch.device("cpu")
    assert not logits_gemm.use_sm90("cublas", cpu, torch.float16, 512, 1024)
    assert not logits_gemm.use_sm90("auto", cpu, torch.float16, 512, 1024)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        logits_gemm.use_sm90("sm90", cpu, torch.float16, 512, 1024)
    with pytest.raises(ValueError, match="must be one of"):
        logits_gemm.use_sm90("cutlass", cpu, torch.float16, 512, 1024)


def test_the_loss_config_names_a_bad_gemm_and_one_set_for_another_backend():
    from rnnt.config import ConfigError

    with pytest.raises(ConfigError, match="loss.fused_gemm: expected one of .* got 'cutlass'"):
        TransducerLoss("fused", 5, "cutlass")
    with pytest.raises(ConfigError, match="applies to loss.backend fused only"):
        TransducerLoss("reference", 5, "sm90")


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc")
def test_the_kernel_source_builds_and_rejects_shapes_it_cannot_tile(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path))
    cuda_build.load.cache_clear()
    try:
        lib = logits_gemm.library()
        # shared memory: W's block + the A stages + the store staging, within Hopper's 227 KB
        assert 200 * 1024 < lib.logits_lse_smem_bytes() <= 227 * 1024
        for m, n, k, grid in (
            (10, 1000, 512, 8),
            (10, 1024, 640, 8),
            (10, 1024, 96, 8),
            (0, 1024, 512, 8),
            (10, 1024, 512, 12),
        ):
            rc = lib.logits_lse_launch(None, None, None, None, None, 1.0, m, n, k, grid, 0, None)
            assert rc != 0
            assert "unsupported shape" in lib.logits_lse_error(rc).decode()
    finally:
        cuda_build.load.cache_clear()


def partials_oracle(logits, bias, scale2):
    """(n, V / 128, 2): per row and 128-class tile max and sum exp2(x - max) of the base-2
    logits x, in fp64."""
    x = logits.double() * scale2 + bias.double() * LOG2E
    tiles = x.view(x.shape[0], -1, 128)
    top = tiles.amax(-1)
    return torch.stack([top, torch.exp2(tiles - top[..., None]).sum(-1)], -1)


def run_kernel(h, weight, bias, scale2, pad_rows=0):
    n, vocab = h.shape[0], weight.shape[0]
    logits = torch.full((n + pad_rows, vocab), 7.0, dtype=torch.float16, device=h.device)
    part = torch.full((n + pad_rows, vocab // 128, 2), 7.0, device=h.device)
    logits_gemm.logits_with_partials(h, weight, bias.float(), scale2, logits[:n], part[:n])
    return logits, part


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "rows,hid,vocab",
    [(1, 512, 1024), (127, 64, 128), (129, 320, 384), (5000, 512, 1024), (385_560, 512, 1024)],
)
def test_gpu_logits_round_the_fp32_product_once_and_partials_match_the_oracle(rows, hid, vocab):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.relu(torch.randn(rows, hid, device="cuda", generator=gen)).half()
    weight = (torch.randn(vocab, hid, device="cuda", generator=gen) * 0.05).half()
    bias = torch.randn(vocab, device="cuda", generator=gen) * 0.1
    scale2 = LOG2E / 0.7  # dropout 0.3's 1 / (1 - p)
    logits, part = run_kernel(h, weight, bias, scale2, pad_rows=3)
    torch.cuda.synchronize()
    exact = h.double() @ weight.double().t()
    # one rounding to fp16 of a tensor-core fp32 sum, whose error (the MMA's adds align their
    # operands to the largest) scales with the terms' magnitudes, not with the sum's: the same
    # bound holds for cuBLAS's result
    terms = h.double().abs() @ weight.double().abs().t()
    assert ((logits[:rows].double() - exact).abs() <= exact.abs() * 2**-11 + terms * 2**-14).all()
    if rows == 385_560:  # a chunk of the fused loss at (192, 204, 44): what cuBLAS gives
        assert torch.equal(logits[:rows], h @ weight.t())
    # rows past the chunk are neither written nor read into the partials
    assert (logits[rows:] == 7.0).all() and (part[rows:] == 7.0).all()
    want = partials_oracle(logits[:rows], bias, scale2)
    got = part[:rows].double()
    assert (got[..., 0] - want[..., 0]).abs().max() <= 1e-6 * want[..., 0].abs().max()
    # ex2.approx: 2 ulp per term
    assert ((got[..., 1] - want[..., 1]).abs() / want[..., 1]).max() <= 1e-6


@pytest.mark.gpu
@needs_hopper
def test_gpu_sm90_is_chosen_for_fp16_and_refused_clearly_otherwise():
    dev = torch.device("cuda", torch.cuda.current_device())
    assert logits_gemm.use_sm90("auto", dev, torch.float16, 512, 1024)
    assert not logits_gemm.use_sm90("auto", dev, torch.float32, 512, 1024)
    assert not logits_gemm.use_sm90("auto", dev, torch.float16, 512, 1000)
    with pytest.raises(RuntimeError, match="fp16 operands"):
        logits_gemm.use_sm90("sm90", dev, torch.bfloat16, 512, 1024)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        logits_gemm.use_sm90("sm90", dev, torch.float16, 512, 1000)


def fused_loss(leaves, f_lens, targets, target_lens, gemm, host, p, reduction):
    from rnnt.kernels.joint_loss import fused_joint_loss

    leaves = [x.detach().requires_grad_(True) for x in leaves]
    loss = fused_joint_loss(
        *leaves,
        f_lens,
        targets,
        target_lens,
        leaves[2].shape[0] - 1,
        p,
        seed=7,
        host_lens=host,
        reduction=reduction,
        gemm=gemm,
    )
    grads = torch.autograd.grad(loss.sum(), leaves)
    return loss.detach(), grads


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gpu_fused_loss_with_sm90_equals_it_with_cublas(packed, reduction):
    gen = torch.Generator().manual_seed(3)
    lens = [(204, 44), (150, 30), (37, 0), (1, 5), (190, 44), *[(120, 20)] * 27]
    bsz, t_max, u_max = len(lens), 204, 44
    leaves = [
        torch.randn(bsz, t_max, 512, generator=gen),
        torch.randn(bsz, u_max + 1, 512, generator=gen),
        torch.randn(1024, 512, generator=gen) * 0.05,
        torch.randn(1024, generator=gen) * 0.1,
    ]
    leaves = [x.cuda().half() for x in leaves]
    f_lens = torch.tensor([t for t, _ in lens], device="cuda")
    target_lens = torch.tensor([u for _, u in lens], device="cuda")
    targets = torch.randint(0, 1023, (bsz, u_max), generator=gen).cuda()
    host = (f_lens.tolist(), target_lens.tolist()) if packed else None
    args = (leaves, f_lens, targets, target_lens)
    loss_c, grads_c = fused_loss(*args, "cublas", host, 0.3, reduction)
    loss_s, grads_s = fused_loss(*args, "sm90", host, 0.3, reduction)
    # the same logits; only the log-sum-exp's exp2 differs (ex2.approx, ~1e-7 relative)
    assert rel_err(loss_s, loss_c) <= 1e-5
    for name, a, b in zip(("f", "g", "W", "bias"), grads_s, grads_c, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 2e-3, name


@pytest.mark.gpu
@needs_hopper
def test_gpu_transducer_loss_prepare_builds_and_reports_the_sm90_gemm():
    from rnnt.config import ModelConfig
    from rnnt.model import Joint

    joint = Joint(ModelConfig()).cuda().half()
    assert "gemm=sm90" in TransducerLoss("fused", 1023).prepare(joint)[0]
    assert "gemm=cublas" in TransducerLoss("fused", 1023, "cublas").prepare(joint)[0]
    choice, reason = TransducerLoss("fused", 1023).prepare(joint.float())
    assert "gemm=cublas" in choice and "fp16 operands" in reason
