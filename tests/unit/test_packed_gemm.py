"""The wave stack's GEMMs over real frames (rnnt/kernels/packed_gemm.py) under Triton's
interpreter, against torch's matmul over every row. Padding rows of the tiles that must be
skipped hold NaN, so a kernel that reads one fails."""

import pytest
import torch

from rnnt.kernels import packed_gemm
from rnnt.kernels.packed_gemm import PackedGemms

TILES = dict(rows_tile=(16, 32, 16), grad_tile=(32, 32, 16))


def frames(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """(T * B,) True where row t * B + b is a real frame."""
    return (torch.arange(steps)[:, None] < lengths[None, :]).reshape(-1)


def ragged(batch=48, steps=9, seed=0, order="sorted"):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, steps + 1, (batch,), generator=gen)
    lengths[0] = steps
    if order == "sorted":
        lengths = lengths.sort(descending=True).values
    return lengths, gen


def live_tiles(lengths, steps, rows):
    """(T * B,) True where the row's tile of `rows` batch rows at its step has a real frame."""
    batch = lengths.numel()
    live = frames(lengths, steps).view(steps, batch // rows, rows).any(2)
    return live.repeat_interleave(rows, 1).reshape(-1)


@pytest.mark.parametrize("order", ["sorted", "batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_gemm_computes_live_tiles_and_zeros_the_rest_without_reading_them(order, dtype):
    steps, k_dim, n_cols = 9, 48, 64
    lengths, gen = ragged(steps=steps, order=order)
    gemms = PackedGemms(lengths, steps, **TILES)
    a = torch.randn(steps * lengths.numel(), k_dim, generator=gen).to(dtype)
    w = torch.randn(n_cols, k_dim, generator=gen).to(dtype)  # b = w.T: a strided operand
    live = live_tiles(lengths, steps, TILES["rows_tile"][0])
    want = (a.float() @ w.float().T).to(dtype)
    a[~live] = float("nan")
    got = gemms.rows(a, w.T)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[live], want[live], rtol=tol, atol=tol)
    if order == "sorted":  # the ordered rows leave tiles to skip
        assert (~live).sum() > live.numel() // 4


@pytest.mark.parametrize("order", ["sorted", "batch"])
@pytest.mark.parametrize("shape", [(64, 48), (32, 16)], ids=["one-pass", "split"])
def test_weight_grad_sums_the_live_tiles_only(order, shape):
    """`a` is zero at every padding row (as the gate gradients are); the rows of tiles without a
    real frame hold NaN in both operands. (32, 16) is one output tile, so the interpreter's
    grid splits the frames across four programs and adds their partial sums."""
    steps, batch = 9, 48
    m_dim, n_cols = shape
    lengths, gen = ragged(batch, steps, seed=1, order=order)
    real = frames(lengths, steps)
    a = torch.randn(steps * batch, m_dim, generator=gen) * real[:, None]
    b = torch.randn(steps * batch, n_cols, generator=gen)
    want = a.T @ b
    live = live_tiles(lengths, steps, TILES["grad_tile"][2])
    a[~live], b[~live] = float("nan"), float("nan")
    got = PackedGemms(lengths, steps, **TILES).weight_grad(a, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_weight_grad_in_fp16_sums_in_fp32():
    steps, batch = 7, 32
    lengths, gen = ragged(batch, steps, seed=2)
    a = (torch.randn(steps * batch, 32, generator=gen) * frames(lengths, steps)[:, None]).half()
    b = torch.randn(steps * batch, 48, generator=gen).half()
    got = PackedGemms(lengths, steps, **TILES).weight_grad(a, b)
    want = (a.float().T @ b.float()).half()
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)


def test_the_walk_counts_each_tiles_steps_up_to_its_longest_frame():
    lengths = torch.tensor([9, 7, 7, 2, 0, 0, 0, 0])
    gemms = PackedGemms(lengths, 8, rows_tile=(16, 16, 16), grad_tile=(16, 16, 2))
    # tiles of two rows: longest 9 (clamped to the 8 steps), 7, 0 and 0
    assert gemms.starts.tolist() == [0, 8, 15, 15, 15]


def test_shapes_and_dtypes_the_kernels_cannot_take_are_refused():
    lengths = torch.full((24,), 3)
    with pytest.raises(ValueError, match=r"batch \(24 rows\) must be a multiple of the weight"):
        PackedGemms(lengths, 3, grad_tile=(32, 32, 16))
    gemms = PackedGemms(torch.full((32,), 3), 3, **TILES)
    a = torch.randn(96, 24)
    with pytest.raises(ValueError, match=r"rows's K \(24\) must be a multiple of 16"):
        gemms.rows(a, torch.randn(24, 32))
    with pytest.raises(ValueError, match="float16, bfloat16 and float32, got torch.float64"):
        gemms.weight_grad(a[:, :16].double(), torch.randn(96, 16, dtype=torch.float64))
