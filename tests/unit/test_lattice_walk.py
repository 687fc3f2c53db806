"""The CUDA lattice walk (rnnt/kernels/csrc/lattice_walk.cu) against the Triton walk it
replaces (bitwise: the same arithmetic), and the fused loss with either.

Without a GPU: the source builds with the real nvcc (where there is one) and its launch rejects
shapes it cannot take, before any CUDA call.
"""

import random

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402

from rnnt.kernels import cuda_build, lattice_walk  # noqa: E402
from rnnt.kernels import joint_loss as jl  # noqa: E402
from rnnt.kernels import joint_loss_kernels as jk  # noqa: E402
from tests.helpers import diagonal_major, make_case  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc")
def test_the_source_builds_and_rejects_shapes_it_cannot_take(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path))
    cuda_build.load.cache_clear()
    try:
        lib = lattice_walk.library((9, 0))
        assert lib.lattice_walk_max_u1() == lattice_walk.MAX_U1
        for b0, bc, t_max, u1 in ((0, 0, 10, 5), (-1, 4, 10, 5), (0, 4, 0, 5), (0, 4, 10, 257)):
            rc = lib.lattice_walk_launch(*[None] * 8, b0, bc, t_max, u1, 0, 0, None)
            assert "bad launch shape" in lib.lattice_walk_error(rc).decode()
    finally:
        cuda_build.load.cache_clear()


def walk_both(lens, packed, b0, bc, seed=0):
    """alpha, beta, log P of utterances [b0, b0 + bc) by the Triton and the CUDA walk, from the
    same diagonal-major inputs (NaN where a walk writes nothing)."""
    dev = torch.device("cuda")
    bsz, t_max, u1 = len(lens), max(t for t, _ in lens), max(u for _, u in lens) + 1
    host = ([t for t, _ in lens], [u for _, u in lens])
    layout = jl._Layout(host if packed else None, bsz, t_max, u1)
    assert layout.packed == packed
    gen = torch.Generator(device=dev).manual_seed(seed)
    f_lens, t_lens = (torch.tensor(x, dtype=torch.int32, device=dev) for x in host)
    soffs = torch.tensor(layout.skew_starts or [0], dtype=torch.int32, device=dev)
    # the walk's inputs: random log-probabilities at each utterance's diagonal-major cells
    # (NaN elsewhere: cells no move enters must not be read)
    skb, skl = torch.full((2, layout.skew_cells + lattice_walk.OVERREAD), float("nan"), device=dev)
    lp_blank = torch.log(torch.rand(bsz, t_max, u1, device=dev, generator=gen) * 0.9 + 0.05)
    lp_label = torch.log(torch.rand(bsz, t_max, u1, device=dev, generator=gen) * 0.5 + 0.01)
    diagonal_major(skb, skl, lp_blank, lp_label, lens, layout)
    block_u = max(16, triton.next_power_of_2(u1))
    out = []
    for cuda in (False, True):
        alpha, beta = torch.full(
            (2, layout.skew_cells), float("nan"), dtype=torch.float64, device=dev
        )
        log_lik = torch.full((bsz,), float("nan"), dtype=torch.float64, device=dev)
        args = (skb, skl, soffs, f_lens, t_lens, alpha, beta, log_lik, b0)
        if cuda:
            lattice_walk.walk(*args, bc, t_max, u1, packed)
        else:
            jk.lattice_kernel[(bc, 2)](
                *args,
                t_max,
                u1,
                BLOCK_U=block_u,
                PACKED=packed,
                HW_LOG2=True,
                num_warps=jl.LATTICE_WARPS,
            )
        out.append((alpha, beta, log_lik))
    return out


def random_lens(n, t_range, u_range, seed):
    rng = random.Random(seed)
    return [(rng.randint(*t_range), rng.randint(*u_range)) for _ in range(n)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("u_max", [20, 44, 100, 255])  # 1, 2, 4 and 8 lanes per thread
def test_gpu_cuda_walk_equals_the_triton_walk_bitwise(packed, u_max):
    lens = random_lens(13, (1, 90), (0, u_max), seed=u_max)
    lens[0] = (90, u_max)  # the box's corner
    lens[1] = (1, 0)
    if not packed:
        lens = [(90, u_max)] * 6 + lens[1:4]  # padded: lengths below the box's read from device
    for b0, bc in ((0, len(lens)), (2, len(lens) - 3)):
        triton_out, cuda_out = walk_both(lens, packed, b0, bc)
        for name, a, b in zip(("alpha", "beta", "log P"), triton_out, cuda_out, strict=True):
            assert torch.equal(a.isnan(), b.isnan()), f"{name}: different cells written"
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name}: values differ"
        log_lik = cuda_out[2][b0 : b0 + bc]
        assert torch.isfinite(log_lik).all() and (log_lik < 0).all()


@needs_cuda
@pytest.mark.gpu
def test_gpu_fused_loss_is_the_same_with_either_walk(monkeypatch):
    lens = random_lens(24, (5, 120), (0, 40), seed=3)
    u_max = max(u for _, u in lens)
    leaves, f_lens, targets, target_lens = make_case(lens, u_max, 64, 96, dtype=torch.float16)
    host = (f_lens.tolist(), target_lens.tolist())

    def run():
        loss = jl.fused_joint_loss(
            *leaves, f_lens, targets, target_lens, 95, 0.2, seed=7, host_lens=host, reduction="mean"
        )
        return loss, torch.autograd.grad(loss, leaves)

    assert jl._Problem(*leaves, f_lens, targets, target_lens, host, 95, 0.2, 7, "auto").cuda_walk
    loss_cuda, grads_cuda = run()
    monkeypatch.setattr(lattice_walk, "available", lambda device: False)
    loss_triton, grads_triton = run()
    assert torch.equal(loss_cuda, loss_triton)
    for a, b in zip(grads_cuda, grads_triton, strict=True):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.gpu
def test_gpu_transducer_loss_prepare_builds_the_walk(tmp_path, monkeypatch):
    from rnnt.config import ModelConfig
    from rnnt.loss import TransducerLoss
    from rnnt.model import Joint

    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path))
    cuda_build.load.cache_clear()
    lattice_walk.resolve.cache_clear()
    try:
        TransducerLoss("fused", 1023).prepare(Joint(ModelConfig()).cuda().half())
        assert list(tmp_path.glob("lattice_walk-*.so")), "prepare builds the walk"
        assert lattice_walk.available(torch.device("cuda"))
    finally:
        cuda_build.load.cache_clear()
        lattice_walk.resolve.cache_clear()
