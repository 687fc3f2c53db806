"""DistributedLamb (rnnt/optim/distributed_lamb.py): the one-process Lamb is its oracle; two
gloo processes must give what one process gives with the averaged gradients."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rnnt.distributed import DistContext
from rnnt.optim.distributed_lamb import DistributedLamb, FlatLayout, reshard
from rnnt.optim.lamb import Lamb

SHAPES = [(7, 5), (5,), (33,), (4, 4, 3), (129,), (2,)]
BUCKETS = [[0, 1], [2, 3], [4, 5]]  # parameter indices per bucket
KW = dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=1e-3, max_grad_norm=1.0)
CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def make_grads(step: int, rank: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) * (1 + step) for s in SHAPES]


def distributed(params, ctx, **kw) -> DistributedLamb:
    opt = DistributedLamb([[params[i] for i in b] for b in BUCKETS], ctx, **{**KW, **kw})
    opt.bind_grads()
    return opt


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_covers_every_parameter_once(world):
    params = make_params()
    layout = FlatLayout([[params[i] for i in b] for b in BUCKETS], world)
    assert layout.numel % world == 0 and layout.shard_numel * world == layout.numel
    covered = [0] * len(params)
    for rank in range(world):
        sizes, owners = layout.pieces(rank)
        assert sum(sizes) == layout.shard_numel
        for n, owner in zip(sizes, owners):
            if owner >= 0:
                covered[owner] += n
    assert covered == [p.numel() for p in params]
    full = torch.arange(layout.numel, dtype=torch.float32)
    views = layout.views(full)
    for p, v, off in zip(params, views, layout.offsets):
        assert v.shape == p.shape and v.flatten()[0] == off


def test_reshard_cuts_the_same_values_for_another_world_size():
    params = make_params()
    layouts = {w: FlatLayout([[params[i] for i in b] for b in BUCKETS], w) for w in (1, 2, 3)}
    full2 = torch.zeros(layouts[2].numel)
    values = [torch.randn(p.shape) for p in params]
    torch._foreach_copy_(layouts[2].views(full2), values)
    shards2 = [layouts[2].shard_of(full2, r) for r in range(2)]
    for w in (1, 3):
        expected = torch.zeros(layouts[w].numel)
        torch._foreach_copy_(layouts[w].views(expected), values)
        for rank in range(w):
            cut = reshard(shards2, layouts[2].describe(), layouts[w], rank)
            assert torch.equal(cut, layouts[w].shard_of(expected, rank))


def run_steps(opt_step, params, grad_steps, scales):
    for grads, scale in zip(grad_steps, scales):
        for p, g in zip(params, grads):
            p.grad.copy_(g * scale)
        opt_step(scale)


def test_one_process_matches_lamb_including_a_skipped_step():
    steps = [make_grads(s) for s in range(4)]
    steps[2][3][1, 2, 0] = math.inf  # the third step overflows: skipped by both
    scales = [8.0, 8.0, 8.0, 4.0]

    ref_params = make_params()
    ref = Lamb(ref_params, lr=0.01, master_weights=True, **KW)
    for p in ref_params:
        p.grad = torch.zeros_like(p)

    def ref_step(scale):
        finite = all(torch.isfinite(p.grad).all() for p in ref_params)
        ref.step(grad_scale=torch.tensor(scale), found_inf=torch.tensor(float(not finite)))

    run_steps(ref_step, ref_params, steps, scales)

    params = make_params()
    opt = distributed(params, CPU, fused=False)
    found = []

    def step(scale):
        opt.arm()
        found.append(float(opt.step(0.01, torch.tensor(scale), torch.tensor(1.5))))

    run_steps(step, params, steps, scales)
    assert found == [0.0, 0.0, 1.0, 0.0] and float(opt.steps) == 3
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    masters = opt.layout.views(opt.master)
    for m, r in zip(masters, ref.master_params()):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)


def test_a_non_finite_loss_skips_the_step():
    params = make_params()
    before = [p.detach().clone() for p in params]
    opt = distributed(params, CPU, fused=False)
    for p, g in zip(params, make_grads(0)):
        p.grad.copy_(g)
    opt.arm()
    assert float(opt.step(0.01, None, torch.tensor(math.nan))) == 1.0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))
    assert not opt.exp_avg.any() and float(opt.steps) == 0
    assert not opt.grad_flat.any()  # ready for the next step


def _worker(rank: int, world: int, backend: str, init_file: str, out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=device)
    params = [torch.nn.Parameter(p.detach().to(device)) for p in make_params()]
    opt = distributed(params, ctx)  # the Triton kernel on CUDA, PyTorch on CPU
    found = []
    for step in range(4):
        opt.arm()
        for p, g in zip(params, make_grads(step, rank)):
            # the trainer divides the loss by the world size: the sum over ranks is the mean
            p.grad.copy_(g / world)
        if step == 2 and rank == world - 1:
            params[4].grad[5] = math.inf  # one rank overflows: every rank must skip
        found.append(float(opt.step(0.01, None, torch.tensor(2.0, device=device))))
    torch.save(
        {
            "params": [p.detach().cpu() for p in params],
            "state": {k: v.cpu() if torch.is_tensor(v) else v for k, v in opt.state_dict().items()},
            "gathered_masters": opt.gather(opt.master).cpu(),
            "found": found,
        },
        f"{out}.{rank}",
    )
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "backend,world",
    [
        ("gloo", 2),
        ("gloo", 3),
        pytest.param("nccl", 2, marks=[pytest.mark.gpu, pytest.mark.multi_gpu]),
        pytest.param("nccl", 4, marks=[pytest.mark.gpu, pytest.mark.multi_gpu]),
    ],
)
def test_ranks_give_what_one_process_gives_with_the_mean_gradient(tmp_path, backend, world):
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    out = str(tmp_path / "result")
    mp.start_processes(
        _worker,
        args=(world, backend, str(tmp_path / "init"), out),
        nprocs=world,
        start_method="spawn",
    )
    ref_params = make_params()
    ref = distributed(ref_params, CPU, fused=False)
    for step in (0, 1, 3):  # step 2 overflowed on one rank: skipped everywhere
        ref.arm()
        mean = [sum(g) / world for g in zip(*(make_grads(step, r) for r in range(world)))]
        for p, g in zip(ref_params, mean):
            p.grad.copy_(g)
        ref.step(0.01, None, torch.tensor(2.0))
    results = [torch.load(f"{out}.{r}", weights_only=True) for r in range(world)]
    layout = FlatLayout([[ref_params[i] for i in b] for b in BUCKETS], world)
    for result in results:
        assert result["found"] == [0.0, 0.0, 1.0, 0.0]
        for p, r in zip(result["params"], ref_params):
            torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
        for m, r in zip(layout.views(result["gathered_masters"]), ref.layout.views(ref.master)):
            torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
        # each rank holds 1/world of the optimizer state
        assert result["state"]["master"].numel() * world == layout.numel
    # the shards, cut anew for one process, restore the one-process optimizer
    fresh = distributed(make_params(), CPU, fused=False)
    fresh.load_state_dicts([r["state"] for r in results])
    torch.testing.assert_close(fresh.master, ref.master, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fresh.exp_avg_sq, ref.exp_avg_sq, rtol=1e-5, atol=1e-9)
    assert float(fresh.steps) == 3


def test_large_finite_fp16_gradients_are_not_skips():
    """100,000 gradient elements of 300 have an L2 norm of 94,868, past fp16's 65,504: a check
    that sums in fp16 calls them inf. An inf or NaN element, or a non-finite loss, is one."""
    big = torch.nn.Parameter(torch.zeros(100_000, dtype=torch.float16))
    small = torch.nn.Parameter(torch.ones(7, dtype=torch.float16))
    opt = DistributedLamb([[big], [small]], CPU, fused=False)
    opt.bind_grads()
    for bad, expected in ((None, 0.0), (math.inf, 1.0), (-math.inf, 1.0), (math.nan, 1.0)):
        big.grad.fill_(300.0)
        small.grad.fill_(1.0)
        if bad is not None:
            big.grad[99_999] = bad
        opt.arm()
        assert float(opt.step(0.01, torch.tensor(512.0), torch.tensor(12.5))) == expected
    big.grad.fill_(300.0)
    opt.arm()
    assert float(opt.step(0.01, torch.tensor(512.0), torch.tensor(math.inf))) == 1.0
