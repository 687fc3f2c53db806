import json
import logging
import random

import numpy as np
import pytest
import torch

from rnnt.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
)


def state_for(step):
    return {
        "model": {"w": torch.full((3, 2), float(step)), "b": torch.arange(4, dtype=torch.int64)},
        "progress": {"epoch": step // 10, "step": step, "best_wer": float("inf")},
        "config": {"optimizer": {"lr": 0.007, "betas": [0.9, 0.999]}, "name": "tiny"},
        "skipped": None,
    }


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_round_trip(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    assert mgr.load_latest() is None  # no directory yet: a fresh run
    saved = state_for(10)
    path = mgr.save(saved, epoch=1, step=10, wer=0.31)
    assert path == tmp_path / "ck" / "ckpt_e1_s10.pt"
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["size"] == path.stat().st_size and meta["wer"] == 0.31
    state, loaded_path = mgr.load_latest(map_location="cpu")
    assert loaded_path == path
    assert torch.equal(state["model"]["w"], saved["model"]["w"])
    assert torch.equal(state["model"]["b"], saved["model"]["b"])
    assert state["progress"] == saved["progress"]
    assert state["config"] == saved["config"] and state["skipped"] is None
    assert not list((tmp_path / "ck").glob("*.tmp"))


def test_retention_keeps_last_and_best(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    wers = {10: 0.5, 20: 0.2, 30: 0.4, 40: 0.3, 50: None}
    for step, wer in wers.items():
        mgr.save(state_for(step), epoch=step // 10, step=step, wer=wer)
    # newest two (s50, s40) plus the best WER (s20, 0.2), each with its record
    assert names(tmp_path) == [
        "ckpt_e2_s20.json", "ckpt_e2_s20.pt", "ckpt_e4_s40.json", "ckpt_e4_s40.pt",
        "ckpt_e5_s50.json", "ckpt_e5_s50.pt",
    ]  # fmt: skip
    assert mgr.best() == (tmp_path / "ckpt_e2_s20.pt", 0.2)
    no_best = CheckpointManager(tmp_path, keep_last=1, keep_best=False)
    no_best.save(state_for(60), epoch=6, step=60, wer=0.9)
    assert names(tmp_path) == ["ckpt_e6_s60.json", "ckpt_e6_s60.pt"]


def test_truncated_newest_falls_back_with_error(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(state_for(10), epoch=1, step=10, wer=None)
    newest = mgr.save(state_for(20), epoch=2, step=20, wer=None)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # e.g. the disk filled up mid-write
    with caplog.at_level(logging.ERROR, logger="rnnt.checkpoint"):
        state, path = mgr.load_latest()
    assert path.name == "ckpt_e1_s10.pt"
    assert state["progress"]["step"] == 10
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("ckpt_e2_s20.pt" in m and "truncated" in m for m in errors)


def test_interrupted_save_without_record_is_skipped(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(state_for(10), epoch=1, step=10, wer=None)
    newest = mgr.save(state_for(20), epoch=2, step=20, wer=None)
    newest.with_suffix(".json").unlink()  # crash between the rename and the record
    with caplog.at_level(logging.ERROR, logger="rnnt.checkpoint"):
        _, path = mgr.load_latest()
    assert path.name == "ckpt_e1_s10.pt"
    assert "no completeness record ckpt_e2_s20.json" in caplog.text


def test_same_size_corruption_is_caught_by_hash(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(state_for(10), epoch=1, step=10, wer=None)
    newest = mgr.save(state_for(20), epoch=2, step=20, wer=None)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="rnnt.checkpoint"):
        _, path = mgr.load_latest()
    assert path.name == "ckpt_e1_s10.pt"
    assert "SHA-256" in caplog.text


def test_all_corrupt_raises(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20):
        p = mgr.save(state_for(step), epoch=step // 10, step=step, wer=None)
        p.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="2 checkpoint.*none can be loaded") as info:
        mgr.load_latest()
    assert "ckpt_e1_s10.pt" in str(info.value) and "ckpt_e2_s20.pt" in str(info.value)


class Payload:
    """An arbitrary class: unpickling it would run code of the file's choosing."""

    def __init__(self):
        self.x = 1


def test_pickled_objects_are_rejected(tmp_path):
    mgr = CheckpointManager(tmp_path)
    # a file with a valid record but a pickled class instance inside
    path = mgr.save({"evil": Payload(), "w": torch.ones(2)}, epoch=1, step=1, wer=None)
    assert path.is_file()
    with pytest.raises(CheckpointError, match="ckpt_e1_s1.pt.*(Unpickl|weights_only)"):
        mgr.load_latest()


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
    mgr.save({"rng": capture_rng_state()}, epoch=1, step=1, wer=None)
    first = draws()
    state, _ = mgr.load_latest()  # through torch.load(weights_only=True)
    draws()  # move every generator on
    restore_rng_state(state["rng"])
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
    path = mgr.save({"w": weights, "nested": [weights[0]]}, epoch=1, step=1, wer=0.5,
                    background=True)  # fmt: skip
    weights.fill_(7.0)  # training goes on while the file is written
    mgr.wait()
    state, loaded = mgr.load_latest()
    assert loaded == path and not state["w"].any() and not state["nested"][0].any()
    assert json.loads(path.with_suffix(".json").read_text())["wer"] == 0.5
    second = mgr.save({"w": weights}, epoch=1, step=2, wer=None, background=True)
    third = mgr.save({"w": weights * 2}, epoch=1, step=3, wer=None, background=True)
    mgr.wait()  # one write at a time: the third waited for the second
    assert second.is_file() and third.is_file()
    assert float(mgr.load_latest()[0]["w"][0, 0]) == 14.0


def test_a_failed_background_save_is_reported_at_the_next_wait(tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the checkpoint folder should be")
    mgr = CheckpointManager(blocker)
    mgr.save({"w": torch.ones(3)}, epoch=1, step=1, wer=None, background=True)
    with pytest.raises(CheckpointError, match="not_a_directory"):
        mgr.wait()
    mgr.wait()  # reported once


@pytest.mark.gpu
def test_a_background_save_of_gpu_tensors_holds_the_state_of_the_call(tmp_path):
    mgr = CheckpointManager(tmp_path)
    weights = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    expected = weights.cpu()
    mgr.save({"w": weights, "half": weights.half()}, epoch=1, step=1, wer=None, background=True)
    weights.mul_(-1.0)  # queued right after the call returns
    mgr.wait()
    state, _ = mgr.load_latest()
    assert torch.equal(state["w"], expected) and state["w"].device.type == "cpu"
    assert torch.equal(state["half"], expected.half())
