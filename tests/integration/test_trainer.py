"""The training loop on a small real espeak-ng corpus: exact resume, checkpoint fall-back,
non-finite steps. Everything runs through the real data path (FLAC -> features -> model)."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from rnnt.checkpoint import CheckpointError
from rnnt.config import load_config
from rnnt.data.manifest import build_manifest, tokenize, write_manifest
from rnnt.data.synthetic_corpus import build_corpus
from rnnt.data.tokenizer import Tokenizer, train_tokenizer
from rnnt.distributed import DistContext
from rnnt.run_log import read_metrics
from rnnt.trainer import NonFiniteLossError, Trainer

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/install.sh installs it)")
    root = tmp_path_factory.mktemp("digits")
    build_corpus(root, "digits", train=48, dev=12, seed=3, workers=2, progress=False)
    train, _ = build_manifest(root, ["train"], max_duration=16.7)
    dev, _ = build_manifest(root, ["dev"])
    model = train_tokenizer([u.transcript for u in train], root / "tok", 20)
    tok = Tokenizer(model)
    write_manifest(root / "train.jsonl", tokenize(train, tok))
    write_manifest(root / "dev.jsonl", tokenize(dev, tok))
    return {"root": root, "tokenizer": model}


def make_cfg(corpus: dict, out: Path, *extra: str):
    root = corpus["root"]
    return load_config(
        Path(__file__).parents[2] / "configs/tiny.yaml",
        [
            f"data.dataset_dir={root}",
            f"data.train_manifests=[{root / 'train.jsonl'}]",
            f"data.val_manifests=[{root / 'dev.jsonl'}]",
            f"data.tokenizer={corpus['tokenizer']}",
            "data.backend=torch",
            "data.num_threads=0",
            "data.num_buckets=2",
            "model.n_classes=21",
            "model.enc_n_hid=32",
            "model.pred_n_hid=16",
            "model.joint_n_hid=32",
            "model.enc_dropout=0.1",
            "model.joint_dropout=0.1",
            "training.batch_size=8",
            "training.epochs=2",
            "training.log_frequency=1",
            "training.checkpoint_every_steps=4",
            "training.keep_last_checkpoints=100",
            "training.deterministic=true",
            f"training.output_dir={out}",
            "eval.batch_size=6",
            *extra,
        ],
    )


def losses(out: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"
    }


@pytest.mark.parametrize("encoder_lstm", ["cudnn", "wave"])
def test_resume_mid_epoch_continues_exactly(corpus, tmp_path, encoder_lstm):
    """Also with the wave LSTM, whose dropout seeds come from torch's (checkpointed) generator."""
    lstm = f"model.encoder_lstm={encoder_lstm}"
    full = tmp_path / "full"
    trainer = Trainer(make_cfg(corpus, full, lstm), CPU)
    steps_per_epoch = len(trainer.sampler)
    assert steps_per_epoch == 6 and 4 % steps_per_epoch != 0  # the step-4 save is mid-epoch
    trainer.fit()
    reference = losses(full)
    assert sorted(reference) == list(range(1, 13))
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    final_ema = [w.clone() for w in trainer.ema.weights]

    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    for name in ("ckpt_e1_s4.pt", "ckpt_e1_s4.json"):
        shutil.copy(full / "checkpoints" / name, resumed_dir / "checkpoints" / name)
    resumed = Trainer(make_cfg(corpus, resumed_dir, lstm), CPU)
    assert resumed.resume()
    assert (resumed.progress.epoch, resumed.progress.step, resumed.batches_done) == (1, 4, 4)
    resumed.fit()
    after = losses(resumed_dir)
    assert sorted(after) == list(range(5, 13))
    for step, loss in after.items():
        assert loss == reference[step], f"step {step}: {loss} != {reference[step]}"
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, final[key]), key
    for a, b in zip(resumed.ema.weights, final_ema):
        assert torch.equal(a, b)


def test_truncated_newest_checkpoint_falls_back_loudly(corpus, tmp_path, caplog):
    out = tmp_path / "run"
    cfg = make_cfg(corpus, out, "training.epochs=1")
    Trainer(cfg, CPU).fit()
    ckpts = sorted((out / "checkpoints").glob("*.pt"), key=lambda p: p.stat().st_mtime)
    newest = ckpts[-1]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a save killed half-way
    trainer = Trainer(cfg, CPU)
    with caplog.at_level(logging.ERROR):
        assert trainer.resume()
    assert any(newest.name in rec.getMessage() for rec in caplog.records)
    assert trainer.progress.step == 4  # the previous (mid-epoch) checkpoint
    for path in ckpts[:-1]:
        path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="refusing to start from scratch"):
        Trainer(cfg, CPU).resume()


def test_inf_gradient_skips_the_step_and_is_counted(corpus, tmp_path):
    trainer = Trainer(make_cfg(corpus, tmp_path / "run"), CPU)
    batch = next(iter(trainer.train_loader))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    masters = [m.clone() for m in trainer.optimizer.master_params()]
    poisoned = next(trainer.model.joint.parameters())
    handle = poisoned.register_hook(lambda g: torch.full_like(g, math.inf))
    trainer.train_step(batch, lr=0.01)
    handle.remove()
    assert int(trainer.skipped_total) == 1 and int(trainer.skipped_in_a_row) == 1
    for a, b in zip(before, trainer.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(masters, trainer.optimizer.master_params()):
        assert torch.equal(a, b)
    trainer.train_step(batch, lr=0.01)  # a finite step moves the weights and resets the run
    assert int(trainer.skipped_total) == 1 and int(trainer.skipped_in_a_row) == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_repeated_nan_losses_stop_the_run_naming_the_step(corpus, tmp_path):
    trainer = Trainer(
        make_cfg(corpus, tmp_path / "run", "training.max_consecutive_nonfinite=3"), CPU
    )
    real_loss = trainer.loss_fn
    trainer.loss_fn = lambda *args, **kwargs: real_loss(*args, **kwargs) * math.nan
    with pytest.raises(NonFiniteLossError, match=r"step 3: 3 consecutive steps"):
        trainer.fit()
    assert int(trainer.skipped_total) == 3


@pytest.mark.gpu
def test_fp16_overflow_lowers_the_scale_and_skips(corpus, tmp_path):
    from rnnt.distributed import init_distributed

    trainer = Trainer(
        make_cfg(corpus, tmp_path / "run", "training.precision=fp16"), init_distributed("cuda")
    )
    batch = next(iter(trainer.train_loader))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    handle = next(trainer.model.joint.parameters()).register_hook(
        lambda g: torch.full_like(g, math.inf)
    )
    trainer.train_step(batch, lr=0.01)
    handle.remove()
    assert trainer.scaler.get_scale() == 256.0  # 512 halved
    assert int(trainer.skipped_total) == 1
    for a, b in zip(before, trainer.model.parameters()):
        assert torch.equal(a, b)


def test_two_processes_under_torchrun_share_one_log_and_one_eval(corpus, tmp_path, repo_root):
    import subprocess
    import sys

    out = tmp_path / "ddp"
    root = corpus["root"]
    sets = [
        f"data.dataset_dir={root}", f"data.train_manifests=[{root / 'train.jsonl'}]",
        f"data.val_manifests=[{root / 'dev.jsonl'}]", f"data.tokenizer={corpus['tokenizer']}",
        "data.backend=torch", "data.num_threads=0", "data.num_buckets=1", "model.n_classes=21",
        "model.enc_n_hid=32",
        "model.pred_n_hid=16", "model.joint_n_hid=32", "training.batch_size=4",
        "training.epochs=1", "training.log_frequency=1", f"training.output_dir={out}",
        "eval.batch_size=4",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "train.py", "configs/tiny.yaml", "--device", "cpu"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert "target NOT reached" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    mlperf = (out / "mlperf.log").read_text()
    assert mlperf.count('"key": "run_start"') == 1  # rank 0 alone writes the MLPerf log
    assert '"key": "global_batch_size", "value": 8' in mlperf  # 4 per rank x 2 ranks
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 1 and evals[0]["utterances"] == 12  # both ranks' shards, summed


@pytest.mark.gpu
@pytest.mark.parametrize("loss_backend", ["reference", "fused", "apex"])
def test_training_step_never_syncs_with_the_host(tmp_path, lengths_dir, loss_backend):
    """Trainer.train_step on the GPU (fp16, GradScaler, LAMB, EMA, skip counters) under
    sync-debug "error": any host-device synchronization inside the step raises. The fused
    and apex losses get the batch's host lengths (packed lattice) and must not read the
    device."""
    from rnnt.distributed import init_distributed

    if loss_backend == "apex":
        pytest.importorskip("apex.contrib.transducer")

    cfg = load_config(
        Path(__file__).parents[2] / "configs/tiny.yaml",
        [
            "data.backend=synthetic", "data.tokenizer=", "data.vocab_size=1023",
            "model.n_classes=1024", "data.max_duration=4.0", "training.batch_size=8",
            "training.precision=fp16", f"training.output_dir={tmp_path}",
            f"loss.backend={loss_backend}",
            f"data.synthetic_train_lengths={lengths_dir / 'librispeech_train-clean-5_lengths.tsv'}",
            f"data.synthetic_val_lengths={lengths_dir / 'librispeech_dev-clean_lengths.tsv'}",
        ],
    )  # fmt: skip
    trainer = Trainer(cfg, init_distributed("cuda"))
    batches = iter(trainer.train_loader)
    trainer.train_step(next(batches), lr=0.004)  # warm-up: allocations, cuDNN plans
    batch = next(batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = trainer.train_step(batch, lr=0.004)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)


def test_accumulation_split_keeps_host_lengths_aligned_with_the_batch():
    from rnnt.data.batch import FeatureBatch
    from rnnt.trainer import _split

    lens = torch.tensor([9, 7, 5, 3, 2])
    tokens = torch.tensor([4, 3, 2, 1, 1])
    batch = FeatureBatch(torch.zeros(5, 2, 9), lens, torch.zeros(5, 4), tokens).to("cpu")
    parts = _split(batch, 2)
    assert [p.host_lens[0].tolist() for p in parts] == [[9, 7, 5], [3, 2]]
    for part in parts:
        assert torch.equal(part.host_lens[0], part.feat_lens)
        assert torch.equal(part.host_lens[1], part.token_lens)
