"""bench/encoder_gemms.py: the batches it draws are training's, padded to their CUDA-graph
bucket and ordered by length; its row shares count what each case reads; and on a Hopper GPU it
checks packed against dense and times both."""

import argparse

import numpy as np
import pytest

from bench import encoder_gemms
from rnnt.kernels import lstm_wave, packed_gemm
from tests.helpers import hopper_bench_results


def test_the_batches_are_ordered_longest_first_and_padded_to_the_smallest_bucket():
    batches = encoder_gemms.training_batches(20, seed=3)
    for bucket, frames in batches:
        assert bucket in (656, 492, 328, 164)  # the four at --num_cg 4
        assert frames.shape == (encoder_gemms.BATCH,)
        assert np.all(np.diff(frames) <= 0) and frames[-1] >= 1
        assert bucket - 164 < frames[0] <= bucket
    # a third of a bucket's rows are padding in random batches
    shares = [frames.sum() / (bucket * frames.size) for bucket, frames in batches]
    assert 0.55 < np.mean(shares) < 0.75


def test_the_row_shares_count_whole_tiles_up_to_their_longest_frame():
    lengths = np.array([5, 3, 2, 0])
    assert encoder_gemms.rows_read(lengths, 6, None) == 1.0
    assert encoder_gemms.rows_read(lengths, 6, 2) == (5 + 2) * 2 / (6 * 4)
    assert encoder_gemms.rows_read(np.array([9, 9]), 6, 2) == 1.0  # clamped to the steps


def test_the_flop_count_is_the_stacks_gemms_outside_the_waves():
    full = np.full(encoder_gemms.BATCH, 10)
    unit = 2 * 4096 * 10 * encoder_gemms.BATCH  # one gate-column output for every row
    # pre: its 256 inputs stay in the cells; two layers' weight gradients
    assert encoder_gemms.gemm_flops("pre", 10, full, None) == unit * ((256 + 1024) + 2 * 1024)
    # post: the hoisted input GEMM, three layers' weight gradients, the input gradient
    post = unit * (2048 + (2048 + 1024) + 2 * 2 * 1024 + 2048)
    assert encoder_gemms.gemm_flops("post", 10, full, None) == post
    assert encoder_gemms.gemm_flops("post", 10, full, 64) == post  # nothing to skip
    # rows 96 on at half length: 32-row weight-gradient tiles read 3 x 10 + 3 x 5 of 6 x 10
    # steps, the 64-row tiles of the other GEMMs 10 + 10 + 5 of 3 x 10 (one straddles)
    half = np.repeat([10, 5], encoder_gemms.BATCH // 2)
    got = encoder_gemms.gemm_flops("post", 10, half, 32)
    assert got == pytest.approx(unit * ((2048 + 2048) * 25 / 30 + 7168 * 45 / 60))


def test_grad_rows_that_cannot_tile_the_batch_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        encoder_gemms.main(["--grad-rows", "48"])
    assert exit_info.value.code == 2
    assert "--grad-rows: 48 is no power of two >= 16 that divides 192" in capsys.readouterr().err


@pytest.mark.gpu
def test_packed_matches_dense_and_both_are_timed_on_a_hopper_gpu(repo_root, tmp_path):
    out = tmp_path / "gemms.json"
    results = hopper_bench_results(
        repo_root,
        "encoder_gemms.py",
        out,
        "--batches",
        "1",
        "--repeats",
        "2",
        "--grad-rows",
        "64",
        "32",
    )
    assert len(results) == 2 * 4
    for stack in ("pre", "post"):
        rows = {r["case"]: r for r in results if r["stack"] == stack}
        dense = rows.pop("dense")
        assert dense["rows"] == 1.0 and 0 < dense["copies_ms"] < dense["gemms_ms"]
        keyed = rows.pop("dense, row keys")  # the same masks: keys 0, 1, ... are the rows
        assert keyed["rows"] == 1.0 and keyed["max_relative_error"] < 1e-3
        for packed in rows.values():
            assert packed["real_frames"] <= packed["rows"] < 1.0
            assert packed["max_relative_error"] < 2e-2
            assert packed["gemms_ms"] > 0 and packed["stack_ms"] > 0


def test_each_case_times_its_own_tiles_and_leaves_the_shipped_ones(monkeypatch):
    """The cases' logic on the CPU (a small stack under Triton's interpreter, a stand-in for
    the GPU timer): every case is checked against dense, the packed ones time the tiles they
    name, and packed_gemm's constants are the shipped ones afterwards."""
    shipped = {name: getattr(packed_gemm, name) for name in ("ROWS_TILE", "GRAD_TILE")}
    seen = []

    def timer(fn, repeats):
        fn()
        seen.append((lstm_wave.DenseGemms, packed_gemm.ROWS_TILE, packed_gemm.GRAD_TILE))
        return 1.0 + len(seen)

    monkeypatch.setattr(encoder_gemms, "graph_ms", timer)
    monkeypatch.setattr(encoder_gemms, "STACKS", {"post": (64, 2)})
    monkeypatch.setattr(lstm_wave, "HIDDEN", 32)
    frames = np.sort(np.random.default_rng(0).integers(1, 5, encoder_gemms.BATCH))[::-1].copy()
    args = argparse.Namespace(grad_rows=[32], sweep=True, repeats=1)
    rows = encoder_gemms.bench_batch("post", 4, frames, args, "cpu")
    names = [r["case"] for r in rows]
    assert names[:3] == ["dense", "dense, row keys", "packed, 32-row tiles"]
    assert names[3:] == [f"packed, {name}" for name in encoder_gemms.SWEEP]
    assert all(r["max_relative_error"] < 1e-3 for r in rows[1:])  # fp16 buffers
    assert seen[0][0] is encoder_gemms.NoGemms  # the copies alone
    # per case: gemms then stack, each with the case's tiles
    tiles = [t for _, *t in seen[1::2]]
    assert tiles[2] == [shipped["ROWS_TILE"], (*shipped["GRAD_TILE"][:2], 32)]
    for (_, sweep), (rows_tile, grad_tile) in zip(encoder_gemms.SWEEP.items(), tiles[3:]):
        assert rows_tile == sweep.get("ROWS_TILE", shipped["ROWS_TILE"])
        assert grad_tile == sweep.get("GRAD_TILE", shipped["GRAD_TILE"])
    assert rows[2]["rows"] == encoder_gemms.rows_read(frames, 4, 32)
    assert {name: getattr(packed_gemm, name) for name in shipped} == shipped
    assert lstm_wave.DenseGemms is not encoder_gemms.NoGemms


def test_output_row_tiles_run_across_a_steps_end():
    # batch 3, steps 2: real rows (t-major) 1 1 0 / 1 0 0; tiles of 2: [1 1] [0 1] [0 0]
    lengths = np.array([2, 1, 0])
    assert encoder_gemms.output_rows_read(lengths, 2, 2) == 4 / 6
    assert encoder_gemms.output_rows_read(lengths, 2, 4) == 4 / 6  # [1 1 0 1] [0 0 pad pad]
    # with tiles that divide the batch, as the weight gradients' row share
    frames = np.sort(np.random.default_rng(1).integers(0, 30, 192))[::-1].copy()
    assert encoder_gemms.output_rows_read(frames, 30, 64) == encoder_gemms.rows_read(frames, 30, 64)
