import json
import logging
import random

import numpy as np
import pytest
import torch

from rnnt.checkpoint import (
    COMPLETE,
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    open_checkpoint,
    restore_rng_state,
)


def state_for(step):
    return {
        "model": {"w": torch.full((3, 2), float(step)), "b": torch.arange(4, dtype=torch.int64)},
        "progress": {"epoch": step // 10, "step": step, "best_wer": float("inf")},
        "config": {"optimizer": {"lr": 0.007, "betas": [0.9, 0.999]}, "name": "tiny"},
        "skipped": None,
    }


def files_for(step):
    return {"model": state_for(step), "rank0": {"shard": torch.full((5,), float(step))}}


def both(checkpoint):
    return ["model", "rank0"]


def save(mgr, step, wer=None, **kw):
    return mgr.save(files_for(step), epoch=step // 10, step=step, meta={"wer": wer}, **kw)


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_round_trip(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    assert mgr.load_latest(both) is None  # no directory yet: a fresh run
    path = save(mgr, 10, wer=0.31)
    assert path == tmp_path / "ck" / "ckpt_e1_s10"
    assert names(path) == ["complete.json", "model.json", "model.pt", "rank0.json", "rank0.pt"]
    record = json.loads((path / COMPLETE).read_text())
    assert record["meta"] == {"epoch": 1, "step": 10, "wer": 0.31}
    assert record["files"]["model"]["size"] == (path / "model.pt").stat().st_size
    states, checkpoint = mgr.load_latest(both, map_location="cpu")
    assert checkpoint.path == path
    saved = state_for(10)
    assert torch.equal(states["model"]["model"]["w"], saved["model"]["w"])
    assert states["model"]["progress"] == saved["progress"]
    assert states["model"]["config"] == saved["config"] and states["model"]["skipped"] is None
    assert torch.equal(states["rank0"]["shard"], torch.full((5,), 10.0))
    assert not list(path.glob("*.tmp"))
    assert open_checkpoint(path / "model.pt").load("model")["progress"]["step"] == 10


def test_retention_keeps_last_and_best(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    wers = {10: 0.5, 20: 0.2, 30: 0.4, 40: 0.3, 50: None}
    for step, wer in wers.items():
        save(mgr, step, wer)
    # newest two (s50, s40) plus the best WER (s20, 0.2)
    assert names(tmp_path) == ["ckpt_e2_s20", "ckpt_e4_s40", "ckpt_e5_s50"]
    assert mgr.best() == (tmp_path / "ckpt_e2_s20", 0.2)
    no_best = CheckpointManager(tmp_path, keep_last=1, keep_best=False)
    save(no_best, 60, 0.9)
    assert names(tmp_path) == ["ckpt_e6_s60"]


def test_retention_deletes_only_its_own_run(tmp_path):
    """Two runs in one folder (an old run's checkpoints kept): each deletes only its own, and
    an unfinished save of the other is left alone too."""
    old = CheckpointManager(tmp_path, keep_last=1, run_id="0ld0ld0ld0ld")
    for step in (10, 20):
        save(old, step)
    (tmp_path / "ckpt_e2_s25").mkdir()  # the old run, killed while saving
    (tmp_path / "ckpt_e2_s25" / "rank0.json").write_text('{"token": "0ld0ld0ld0ld:2:25:3"}')
    new = CheckpointManager(tmp_path, keep_last=1, run_id="0e50e50e50e5")
    for step in (30, 40):
        save(new, step)
    assert names(tmp_path) == ["ckpt_e2_s20", "ckpt_e2_s25", "ckpt_e4_s40"]
    record = json.loads((tmp_path / "ckpt_e4_s40" / COMPLETE).read_text())
    assert record["meta"]["run_id"] == "0e50e50e50e5"
    save(old, 50)  # the old run again: s20 goes, s25 (older than its newest complete) too
    assert names(tmp_path) == ["ckpt_e4_s40", "ckpt_e5_s50"]


def test_truncated_newest_falls_back_with_error(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 10)
    newest = save(mgr, 20) / "model.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # e.g. the disk filled up mid-write
    with caplog.at_level(logging.ERROR, logger="rnnt.checkpoint"):
        states, checkpoint = mgr.load_latest(both)
    assert checkpoint.path.name == "ckpt_e1_s10"
    assert states["model"]["progress"]["step"] == 10
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("ckpt_e2_s20" in m and "were written" in m for m in errors)


def test_interrupted_save_without_record_is_skipped(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 10)
    newest = save(mgr, 20)
    (newest / COMPLETE).unlink()  # a crash before the commit
    _, checkpoint = mgr.load_latest(both)
    assert checkpoint.path.name == "ckpt_e1_s10"


def test_same_size_corruption_is_caught_by_hash(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 10)
    newest = save(mgr, 20) / "rank0.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="rnnt.checkpoint"):
        _, checkpoint = mgr.load_latest(both)
    assert checkpoint.path.name == "ckpt_e1_s10"
    assert "SHA-256" in caplog.text


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensors_make_a_checkpoint_unusable(tmp_path, caplog, bad):
    """Bytes flipped before the hash was taken: the file matches its record, but holds NaN."""
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 10)
    files = files_for(20)
    files["rank0"]["shard"][3] = bad  # an optimizer moment, say
    mgr.save(files, epoch=2, step=20)
    with caplog.at_level(logging.ERROR, logger="rnnt.checkpoint"):
        _, checkpoint = mgr.load_latest(both)
    assert checkpoint.path.name == "ckpt_e1_s10"
    assert "ckpt_e2_s20/rank0.pt: shard holds NaN or inf values (not a sound state)" in caplog.text
    with pytest.raises(CheckpointError, match=r"rank0.pt: shard holds NaN or inf"):
        open_checkpoint(tmp_path / "ckpt_e2_s20").load("rank0")
    assert open_checkpoint(tmp_path / "ckpt_e2_s20").load("model")["progress"]["step"] == 20


def test_all_corrupt_raises(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20):
        (save(mgr, step) / "model.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="2 checkpoint.*none can be loaded") as info:
        mgr.load_latest(both)
    assert "ckpt_e1_s10" in str(info.value) and "ckpt_e2_s20" in str(info.value)


def test_every_rank_falls_back_to_the_same_checkpoint(tmp_path):
    """The newest checkpoint loads here but not on another rank: skipped here too."""
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 10)
    save(mgr, 20)
    votes = iter([False, True])  # what the other rank says about s20, then s10
    _, checkpoint = mgr.load_latest(both, agree=lambda ok: ok and next(votes))
    assert checkpoint.path.name == "ckpt_e1_s10"


class Payload:
    """An arbitrary class: unpickling it would run code of the file's choosing."""

    def __init__(self):
        self.x = 1


def test_pickled_objects_are_rejected(tmp_path):
    mgr = CheckpointManager(tmp_path)
    # a file with a valid record but a pickled class instance inside
    mgr.save({"model": {"evil": Payload()}, "rank0": {}}, epoch=1, step=1)
    with pytest.raises(CheckpointError, match="ckpt_e1_s1.*(Unpickl|weights_only)"):
        mgr.load_latest(both)


def test_two_ranks_commit_only_when_both_have_written(tmp_path):
    ranks = [CheckpointManager(tmp_path, rank=r, world_size=2) for r in range(2)]
    path = ranks[0].save(
        {"model": {"m": torch.ones(2)}, "rank0": {"s": torch.zeros(3)}}, 1, 6, background=True
    )
    ranks[0]._writer.join(timeout=0.5)
    assert ranks[0]._writer.is_alive() and not (path / COMPLETE).exists()  # waits for rank 1
    ranks[1].save({"rank1": {"s": torch.ones(3)}}, 1, 6)
    ranks[0].wait()
    record = json.loads((path / COMPLETE).read_text())
    assert sorted(record["files"]) == ["model", "rank0", "rank1"] and record["world_size"] == 2
    states, _ = ranks[1].load_latest(lambda c: ["model", "rank1"])
    assert torch.equal(states["rank1"]["s"], torch.ones(3))


def test_a_rank_that_never_writes_leaves_the_checkpoint_incomplete(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=2, commit_timeout_s=0.2)
    with pytest.raises(CheckpointError, match="rank1 not written within"):
        mgr.save({"model": {}, "rank0": {}}, 1, 6)
    assert mgr.load_latest(both) is None


def draws():
    return (
        torch.rand(3).tolist(),
        np.random.rand(3).tolist(),
        np.random.randn(),  # leaves a cached gaussian in numpy's state
        random.random(),
        random.gauss(0, 1),
    )


def test_rng_capture_restore_reproduces_draws(tmp_path):
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    np.random.randn()
    mgr = CheckpointManager(tmp_path)
    mgr.save({"model": {}, "rank0": {"rng": capture_rng_state()}}, epoch=1, step=1)
    first = draws()
    states, _ = mgr.load_latest(both)  # through torch.load(weights_only=True)
    draws()  # move every generator on
    restore_rng_state(states["rank0"]["rng"])
    assert draws() == first
    assert draws() != first  # the generators really advance


@pytest.mark.gpu
def test_cuda_rng_restore():
    state = capture_rng_state()
    first = torch.rand(4, device="cuda").tolist()
    torch.rand(4, device="cuda")
    restore_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == first


def test_a_background_save_holds_the_state_of_the_call(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    weights = torch.zeros(1000, 100)
    path = mgr.save(
        {"model": {"w": weights, "nested": [weights[0]]}, "rank0": {}},
        1,
        1,
        meta={"wer": 0.5},
        background=True,
    )
    weights.fill_(7.0)  # training goes on while the file is written
    mgr.wait()
    states, checkpoint = mgr.load_latest(both)
    model = states["model"]
    assert checkpoint.path == path and not model["w"].any() and not model["nested"][0].any()
    assert checkpoint.meta["wer"] == 0.5
    second = mgr.save({"model": {"w": weights}, "rank0": {}}, 1, 2, background=True)
    third = mgr.save({"model": {"w": weights * 2}, "rank0": {}}, 1, 3, background=True)
    mgr.wait()  # one write at a time: the third waited for the second
    assert (second / COMPLETE).is_file() and (third / COMPLETE).is_file()
    assert float(mgr.load_latest(both)[0]["model"]["w"][0, 0]) == 14.0


def test_a_failed_background_save_is_reported_at_the_next_wait(tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the checkpoint folder should be")
    mgr = CheckpointManager(blocker)
    mgr.save({"model": {"w": torch.ones(3)}, "rank0": {}}, 1, 1, background=True)
    with pytest.raises(CheckpointError, match="not_a_directory"):
        mgr.wait()
    mgr.wait()  # reported once


@pytest.mark.gpu
def test_a_background_save_of_gpu_tensors_holds_the_state_of_the_call(tmp_path):
    mgr = CheckpointManager(tmp_path)
    # finite in fp16 too (up to 1024): a checkpoint holding inf is refused as unsound
    weights = torch.arange(1 << 20, dtype=torch.float32, device="cuda") / 1024
    expected = weights.cpu()
    mgr.save({"model": {"w": weights, "half": weights.half()}, "rank0": {}}, 1, 1, background=True)
    weights.mul_(-1.0)  # queued right after the call returns
    mgr.wait()
    states, _ = mgr.load_latest(both)
    assert torch.equal(states["model"]["w"], expected) and states["model"]["w"].device.type == "cpu"
    assert torch.equal(states["model"]["half"], expected.half())
