"""The training loop on a small real espeak-ng corpus: exact resume, checkpoint fall-back,
non-finite steps. Everything runs through the real data path (FLAC -> features -> model)."""

from __future__ import annotations

import importlib.util
import logging
import math
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from rnnt.checkpoint import CheckpointError
from rnnt.config import load_config
from rnnt.distributed import DistContext
from rnnt.loss import TransducerLoss
from rnnt.preemption import Preempted, PreemptionFlag
from rnnt.run_log import read_metrics
from rnnt.trainer import NonFiniteLossError, Trainer
from tests.helpers import as_set_args, tiny_overrides, train_command

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def make_cfg(corpus: dict, out: Path, *extra: str):
    return load_config(
        Path(__file__).parents[2] / "configs/tiny.yaml",
        tiny_overrides(
            corpus,
            out,
            "data.num_buckets=2",
            "model.enc_dropout=0.1",
            "model.joint_dropout=0.1",
            "training.epochs=2",
            "training.checkpoint_every_steps=4",
            "training.keep_last_checkpoints=100",
            "training.deterministic=true",
            *extra,
        ),
    )


def losses(out: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"
    }


def _short_lengths_tables(lengths_dir: Path, out: Path) -> list[str]:
    """Overrides for the synthetic backend on the CPU: the 37 utterances of at most 3 s of the
    shipped train-clean-5 table, 12 of them for evaluation, a tokenizer trained on them."""
    rows = (lengths_dir / "librispeech_train-clean-5_lengths.tsv").read_text().splitlines()
    short = [r for r in rows if not r.startswith("#") and float(r.split("\t")[1]) <= 3.0]
    out.mkdir(parents=True)
    (out / "train.tsv").write_text("\n".join(short) + "\n")
    (out / "dev.tsv").write_text("\n".join(short[:12]) + "\n")
    return [
        "data.tokenizer=",
        "model.n_classes=41",
        "data.synthetic_steps_per_epoch=6",
        f"data.synthetic_train_lengths={out / 'train.tsv'}",
        f"data.synthetic_val_lengths={out / 'dev.tsv'}",
    ]


@pytest.mark.parametrize(
    "encoder_lstm,backend",
    [
        ("cudnn", "torch"),
        ("wave", "torch"),
        ("cudnn", "synthetic"),
        pytest.param(
            "cudnn",
            "dali",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("nvidia.dali") is None, reason="needs DALI"
            ),
        ),
    ],
)
def test_resume_mid_epoch_continues_exactly(
    corpus, lengths_dir, tmp_path, capsys, encoder_lstm, backend
):
    """Also with the wave LSTM, whose dropout seeds come from torch's (checkpointed) generator;
    with DALI, whose dither generator's state the checkpoint holds; and with the synthetic
    source, whose batches are functions of their position."""
    lstm = (f"model.encoder_lstm={encoder_lstm}", f"data.backend={backend}")
    if backend == "synthetic":
        lstm += tuple(_short_lengths_tables(lengths_dir, tmp_path / "tables"))
    full = tmp_path / "full"
    trainer = Trainer(make_cfg(corpus, full, *lstm), CPU)
    steps_per_epoch = len(trainer.train_loader)
    assert steps_per_epoch == 6 and 4 % steps_per_epoch != 0  # the step-4 save is mid-epoch
    trainer.fit()
    reference = losses(full)
    assert sorted(reference) == list(range(1, 13))
    (chosen,) = [r for r in read_metrics(full / "metrics.jsonl") if r["kind"] == "backends"]
    assert [chosen[k] for k in ("data", "encoder_lstm", "loss", "lamb")] == [
        backend if backend == "synthetic" else f"{backend}/cpu",
        encoder_lstm,
        "reference",
        "torch",
    ]
    # named after the epochs they close: every 4 steps, after epoch 1, and the final state
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == [
        "ckpt_e0_s4",
        "ckpt_e1_s12",
        "ckpt_e1_s6",
        "ckpt_e1_s8",
        "ckpt_e2_s12",
    ]
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    final_ema = [w.clone() for w in trainer.ema.weights]

    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "ckpt_e0_s4", resumed_dir / "checkpoints" / "ckpt_e0_s4")
    resumed = Trainer(make_cfg(corpus, resumed_dir, *lstm), CPU)
    capsys.readouterr()
    assert resumed.resume()
    assert "at epoch 1, step 4; exact" in capsys.readouterr().out
    assert (resumed.progress.epoch, resumed.progress.step) == (1, 4)
    assert (resumed.train_loader.epoch, resumed.train_loader.position) == (1, 4)
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
    ckpts = sorted((out / "checkpoints").glob("ckpt_*"), key=lambda p: int(p.name.split("_s")[1]))
    newest = ckpts[-1] / "model.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a save killed half-way
    trainer = Trainer(cfg, CPU)
    with caplog.at_level(logging.ERROR):
        assert trainer.resume()
    assert any(ckpts[-1].name in rec.getMessage() for rec in caplog.records)
    assert trainer.progress.step == 4  # the previous (mid-epoch) checkpoint
    for path in ckpts[:-1]:
        (path / "rank0.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="refusing to start from scratch"):
        Trainer(cfg, CPU).resume()


def _skip_expectations(trainer: Trainer, poison) -> None:
    """One step with an inf in one gradient: weights, masters, moments and the optimizer's step
    count stay, the EMA moves towards the unchanged weights (as NVIDIA's runs do), the skip
    count rises by exactly one; then a finite step moves the weights and resets the run."""
    batch = next(iter(trainer.train_loader))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    masters = trainer.optimizer.master.clone()
    ema = [w.clone() for w in trainer.ema.weights]
    steps = float(trainer.optimizer.steps)
    handle = poison.register_hook(lambda g: torch.full_like(g, math.inf))
    trainer.train_step(batch, lr=0.01)
    handle.remove()
    assert int(trainer.skipped_total) == 1 and int(trainer.skipped_in_a_row) == 1
    assert float(trainer.optimizer.steps) == steps
    for a, b in zip(before, trainer.model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(masters, trainer.optimizer.master)
    assert not trainer.optimizer.exp_avg.any()  # the first step: no moment moved
    decay = trainer.ema.decay
    (old,), (new,) = ema, trainer.ema.weights
    torch.testing.assert_close(new, old * decay + masters * (1 - decay), rtol=1e-6, atol=1e-7)
    trainer.train_step(batch, lr=0.01)  # a finite step moves the weights and resets the run
    assert int(trainer.skipped_total) == 1 and int(trainer.skipped_in_a_row) == 0
    assert float(trainer.optimizer.steps) == steps + 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_inf_gradient_skips_the_step_and_is_counted(corpus, tmp_path):
    trainer = Trainer(make_cfg(corpus, tmp_path / "run"), CPU)
    _skip_expectations(trainer, next(trainer.model.joint.parameters()))


def test_repeated_nan_losses_stop_the_run_naming_the_step(corpus, tmp_path, monkeypatch):
    trainer = Trainer(
        make_cfg(corpus, tmp_path / "run", "training.max_consecutive_nonfinite=3"), CPU
    )
    real_call = TransducerLoss.__call__
    monkeypatch.setattr(
        TransducerLoss, "__call__", lambda *args, **kwargs: real_call(*args, **kwargs) * math.nan
    )
    with pytest.raises(NonFiniteLossError, match=r"step 3: 3 consecutive steps"):
        trainer.fit()
    assert int(trainer.skipped_total) == 3  # on a GPU, 4: it reads them with step 4 queued


def _deferred(trainer: Trainer) -> list[tuple[int, int]]:
    """Read the log points a step late, as on a GPU; the (line's step, steps taken) of each
    line as it is printed."""
    trainer.defer_log_reads = True
    printed, real_line = [], trainer.log.step

    def line(**fields):
        printed.append((fields["step"], trainer.progress.step))
        real_line(**fields)

    trainer.log.step = line
    return printed


def test_a_deferred_log_point_prints_once_the_next_step_has_run(corpus, tmp_path):
    trainer = Trainer(make_cfg(corpus, tmp_path / "run"), CPU)
    printed = _deferred(trainer)
    trainer.train_epoch()
    assert printed == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 6)]  # the last at the end


def test_deferred_nan_limit_stops_one_step_after_its_line(corpus, tmp_path, monkeypatch):
    trainer = Trainer(
        make_cfg(corpus, tmp_path / "run", "training.max_consecutive_nonfinite=3"), CPU
    )
    printed = _deferred(trainer)
    real_call = TransducerLoss.__call__
    monkeypatch.setattr(
        TransducerLoss, "__call__", lambda *args, **kwargs: real_call(*args, **kwargs) * math.nan
    )
    with pytest.raises(NonFiniteLossError, match=r"step 3: 3 consecutive steps"):
        trainer.fit()
    assert int(trainer.skipped_total) == 4 and printed[-1] == (3, 4)


def test_a_deferred_preemption_saves_at_the_step_it_is_read(corpus, tmp_path):
    """The signal arrives during step 2: log point 2 carries it, read once step 3 has run;
    every line queued so far is printed, and the state saved is that after step 3."""
    trainer = Trainer(make_cfg(corpus, tmp_path / "run"), CPU)
    printed = _deferred(trainer)
    trainer.preemption = PreemptionFlag()
    real_step = trainer.train_step

    def step(batch, lr):
        if trainer.progress.step == 1:
            trainer.preemption.signal = signal.SIGTERM
        return real_step(batch, lr)

    trainer.train_step = step
    with pytest.raises(Preempted, match="ckpt_e0_s3"):
        trainer.train_epoch()
    assert printed == [(1, 2), (2, 3), (3, 3)] and trainer.progress.step == 3
    assert (tmp_path / "run" / "checkpoints" / "ckpt_e0_s3").is_dir()


@pytest.mark.gpu
def test_fp16_overflow_skips_and_scales_as_gradscaler_says(corpus, tmp_path):
    """On CUDA in fp16: the injected inf skips the step like the CPU case, and the loss scale
    after each step is what torch.amp.GradScaler computes from the same gradients."""
    from rnnt.distributed import init_distributed

    cfg = make_cfg(corpus, tmp_path / "run", "training.precision=fp16")
    trainer = Trainer(cfg, init_distributed("cuda"))
    oracle = torch.amp.GradScaler("cuda", init_scale=cfg.training.init_loss_scale)
    shadow = [torch.nn.Parameter(p.detach().float().clone()) for p in trainer.model.parameters()]
    sgd = torch.optim.SGD(shadow, lr=0.0)
    oracle.scale(torch.ones((), device="cuda"))  # GradScaler makes its scale tensor lazily
    scales = []
    real_step = trainer.optimizer.step

    def step_beside_the_oracle(*args, **kwargs):
        for s, p in zip(shadow, trainer.model.parameters()):
            s.grad = p.grad.detach().float()
        oracle.step(sgd)
        oracle.update()
        scales.append(oracle.get_scale())
        return real_step(*args, **kwargs)

    trainer.optimizer.step = step_beside_the_oracle
    _skip_expectations(trainer, next(trainer.model.joint.parameters()))
    assert scales == [256.0, 256.0]  # 512 halved by the skip, kept by the finite step
    assert trainer.scaler.get_scale() == scales[-1]


def test_two_processes_under_torchrun_share_one_log_and_one_eval(corpus, tmp_path, repo_root):
    """Both ranks score the dev set together, at the epoch's end and inside it
    (`training.eval_every_steps`), and rank 0 alone logs it."""
    import subprocess

    out = tmp_path / "ddp"
    sets = tiny_overrides(
        corpus, out, "training.batch_size=4", "eval.batch_size=4", "training.eval_every_steps=4"
    )
    cmd = train_command(2, *as_set_args(sets))
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert "target NOT reached" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    mlperf = (out / "mlperf.log").read_text()
    assert mlperf.count('"key": "run_start"') == 1  # rank 0 alone writes the MLPerf log
    assert '"key": "global_batch_size", "value": 8' in mlperf  # 4 per rank x 2 ranks
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 1 and evals[0]["utterances"] == 12  # both ranks' shards, summed
    inside = [r for r in records if r["kind"] == "mid_epoch_eval"]
    assert [(r["step"], r["utterances"]) for r in inside] == [(4, 12)]
    assert mlperf.count('"key": "eval_accuracy"') == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_cg", [0, 2])
@pytest.mark.parametrize("loss_backend", ["reference", "fused", "apex"])
def test_training_step_never_syncs_with_the_host(tmp_path, lengths_dir, loss_backend, num_cg):
    """Trainer.train_step on the GPU (fp16, loss scale, LAMB, EMA, skip counters; eager and
    graphed) under sync-debug "error": any host-device synchronization inside the step
    raises. The fused and apex losses get the batch's host lengths (packed lattice) and must
    not read the device."""
    from rnnt.distributed import init_distributed

    if loss_backend == "apex":
        pytest.importorskip("apex.contrib.transducer")

    cfg = load_config(
        Path(__file__).parents[2] / "configs/tiny.yaml",
        [
            "data.backend=synthetic",
            "data.tokenizer=",
            "model.n_classes=1024",
            "data.max_duration=4.0",
            "training.batch_size=8",
            "training.precision=fp16",
            f"training.output_dir={tmp_path}",
            f"loss.backend={loss_backend}",
            f"training.num_cg={num_cg}",
            f"data.synthetic_train_lengths={lengths_dir / 'librispeech_train-clean-5_lengths.tsv'}",
            f"data.synthetic_val_lengths={lengths_dir / 'librispeech_dev-clean_lengths.tsv'}",
        ],
    )
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


@pytest.mark.gpu
def test_logged_throughput_matches_the_gpus_clock_and_the_wall_clock(tmp_path):
    """Each log line's utt/s covers the GPU's time from the previous line's step to the end of
    its own, idle time included: it equals the time between events the test records itself
    after each step, and the epoch's windows add up to its wall clock. Measuring before the
    log point's sync (an old bug) gave 3-5x too many utt/s at log_frequency 1. A line is
    printed once the next step is queued, the GPU busy with it while the host logs. (The lines'
    own timestamps are when the host got to them: this eager step at batch 64 queues more
    kernels than CUDA's launch queue holds, so the host runs in step with the GPU.)"""
    from rnnt.distributed import init_distributed

    batch = 64
    cfg = load_config(
        Path(__file__).parents[2] / "configs/baseline_v3-1023sp.yaml",
        [
            "data.backend=synthetic",
            "data.tokenizer=",
            f"training.batch_size={batch}",
            "optimizer.allow_gbs_mismatch=true",
            "data.synthetic_steps_per_epoch=8",
            "training.log_frequency=1",
            f"training.output_dir={tmp_path}",
        ],
    )
    trainer = Trainer(cfg, init_distributed("cuda"))
    printed_at = []  # (the line's step, the steps queued, the GPU still busy) as it prints
    step_ends = []  # the test's own event after each step
    real_line, real_step = trainer.log.step, trainer.train_step

    def step_line(**fields):
        busy = not torch.cuda.current_stream().query()
        printed_at.append((fields["step"], trainer.progress.step, busy))
        real_line(**fields)

    def slow_step(batch, lr):
        # a step that surely lasts longer on the GPU than its queueing on the host
        loss = real_step(batch, lr)
        torch.cuda._sleep(500_000_000)  # about 0.3 s at Hopper's clocks
        step_ends.append(torch.cuda.Event(enable_timing=True))
        step_ends[-1].record()
        return loss

    trainer.log.step, trainer.train_step = step_line, slow_step
    started = time.perf_counter()
    trainer.train_epoch()
    wall = time.perf_counter() - started
    # each line waits for its own step alone: the next one is queued and running by then
    assert printed_at == [(s, s + 1, True) for s in range(1, 8)] + [(8, 8, False)]
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 9))
    windows = [r["window_steps"] * batch / r["utts_per_s"] for r in records]
    assert sum(windows) == pytest.approx(wall, abs=0.02)
    for step, (before, end) in enumerate(zip(step_ends, step_ends[1:]), start=2):
        cur = records[step - 1]
        assert windows[step - 1] == pytest.approx(before.elapsed_time(end) / 1e3, abs=1e-3)
        assert cur["step_ms"] == pytest.approx(1e3 * windows[step - 1])
        assert 0 < cur["mfu"] < 1 and cur["peak_memory_gib"] > 1
        # a skip is an overflow the scale backs off from (it grows only after 2000 clean steps)
        assert 2 ** cur["skipped_steps"] == 512.0 / cur["loss_scale"]


def test_only_the_final_state_is_saved_when_the_run_asks_for_no_checkpoints(corpus, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(corpus, out, "training.save_every_epochs=0", "training.checkpoint_every_steps=0")
    trainer = Trainer(cfg, CPU)
    trainer.fit()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "ckpt_e2_s12"
    ]  # after 2 epochs
    resumed = Trainer(cfg, CPU)
    assert resumed.resume() and resumed.progress.step == 12
    for a, b in zip(resumed.model.parameters(), trainer.model.parameters()):
        assert torch.equal(a, b)
    from bench.log_truth import compare

    windows = compare(read_metrics(out / "metrics.jsonl"), global_batch=8)
    assert len(windows) == 10  # 6 log points per epoch, the first of each left out
    assert all(w["ratio"] == pytest.approx(1.0, rel=0.1) for w in windows)


def test_accumulation_split_keeps_host_lengths_aligned_with_the_batch():
    from rnnt.data.batch import FeatureBatch
    from rnnt.trainer import _split

    lens = torch.tensor([9, 7, 5, 3, 2])
    tokens = torch.tensor([4, 3, 2, 1, 1])
    host = (lens.clone(), tokens.clone())
    batch = FeatureBatch(torch.zeros(5, 2, 9), lens, torch.zeros(5, 4), tokens, host_lens=host)
    parts = _split(batch, 2)
    assert [p.host_lens[0].tolist() for p in parts] == [[9, 7, 5], [3, 2]]
    for part in parts:
        assert torch.equal(part.host_lens[0], part.feat_lens)
        assert torch.equal(part.host_lens[1], part.token_lens)


def test_the_dev_set_is_read_while_the_first_epoch_trains(corpus, tmp_path):
    """Its workers start halfway through the epoch; the first evaluation takes their batches."""
    trainer = Trainer(make_cfg(corpus, tmp_path / "run", "data.num_threads=1"), CPU)
    assert trainer.data.val.ahead is None
    trainer.train_epoch()
    reader = trainer.data.val.ahead
    assert reader is not None
    result = trainer.run_eval()
    assert trainer.data.val.ahead is reader
    assert result.utterances == 12


def test_the_warm_up_before_run_start_changes_nothing_of_the_run(corpus, tmp_path, capsys):
    """The warm-up launches the optimizer's update, the device feature stage and the
    evaluation decoder on stand-in tensors before run_start: the run's losses and weights equal
    those of a run without it. (The fused loss, whose stand-ins draw dropout from the global
    generators too, runs on CUDA only; on an H200 the fast run with its warm-up repeated all
    224 logged losses of a run without one, docs/CONVERGENCE.md.)"""
    extra = ("data.device=gpu", "training.epochs=1")  # the batched feature stage, on the CPU
    warmed = Trainer(make_cfg(corpus, tmp_path / "warmed", *extra), CPU)
    warmed.fit()
    assert "warm-up before run_start: " in capsys.readouterr().out
    cold = Trainer(make_cfg(corpus, tmp_path / "cold", *extra), CPU)
    cold.warm_up = lambda: None
    cold.fit()
    reference = losses(tmp_path / "cold")
    assert losses(tmp_path / "warmed") == reference and len(reference) == 6
    for (key, a), b in zip(warmed.model.state_dict().items(), cold.model.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("mode", ["cg", "cg_unroll_pipeline"])
def test_the_first_evaluation_reuses_what_the_warm_up_built(corpus, tmp_path, mode):
    """The warm-up sizes the graphed decoder for the dev set's longest batch (on a GPU: its
    graphs are captured there, before run_start); the first evaluation then builds nothing."""
    cfg = make_cfg(corpus, tmp_path / "run", f"eval.mode={mode}", "eval.batch_size=6")
    trainer = Trainer(cfg, CPU)
    trainer.warm_up()
    built = trainer.decoder._static
    assert built is not None
    result = trainer.run_eval()
    assert trainer.decoder._static is built and result.utterances == 12


@pytest.mark.gpu
def test_no_triton_kernel_compiles_in_the_first_steps_after_the_warm_up(corpus, tmp_path):
    """LAMB's update, the fused loss and the GPU resampler are Triton kernels, compiled at
    their first launch (seconds each with a cold cache): the warm-up launches them before
    run_start with the specializations that training batches have (for the loss, the label
    tiles of the longest transcripts), so that the timed steps compile none."""
    import triton

    from rnnt.distributed import init_distributed

    cfg = load_config(
        Path(__file__).parents[2] / "configs/tiny.yaml",
        tiny_overrides(
            corpus,
            tmp_path,
            "data.device=gpu",
            "data.resampling_device=gpu",
            "loss.backend=fused",
            "training.precision=fp16",
            "model.enc_n_hid=64",
            "model.pred_n_hid=64",
            "model.joint_n_hid=64",
            "eval.mode=cg_unroll_pipeline",
        ),
    )
    trainer = Trainer(cfg, init_distributed("cuda"))
    trainer.warm_up()
    compiled = []

    def record(*args, **kwargs):
        compiled.append(kwargs.get("fn", args[0] if args else None))
        return False  # compile as usual

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, record
    else:
        from triton.runtime.jit import JITFunction

        previous, JITFunction.cache_hook = JITFunction.cache_hook, record
    try:
        trainer.train_loader.set_epoch(0)
        batches = iter(trainer.train_loader)
        for _ in range(2):
            trainer.train_step(next(batches), lr=0.004)
        torch.cuda.synchronize()
    finally:
        if knobs is not None:
            knobs.runtime.jit_cache_hook = previous
        else:
            JITFunction.cache_hook = previous
    assert trainer.backends["lamb"][0] == "triton"
    assert trainer.backends["loss"][0].startswith("fused")
    assert compiled == []
    graph = trainer.decoder._graph
    assert graph is not None  # captured by the warm-up
    trainer.run_eval()
    assert trainer.decoder._graph is graph


@pytest.mark.parametrize(
    "device,eval_lstm",
    [
        ("cpu", "cudnn"),
        pytest.param(
            "cuda",
            "wave",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wave kernels need a Hopper GPU (sm_90)",
                ),
            ],
        ),
    ],
)
def test_an_evaluation_leaves_trainings_random_streams_where_they_were(
    corpus, tmp_path, device, eval_lstm
):
    """The trainer scores between epochs: a draw from the global generators there would move
    every later dropout mask, so the same seed would train differently with another
    eval.encoder_lstm (the wave forward drew a dropout seed with dropout off, and the fast run
    on an H200 left the plateau an epoch earlier than with cudnn scoring)."""
    from rnnt.distributed import init_distributed

    extra = [f"eval.encoder_lstm={eval_lstm}"]
    if device == "cuda":
        # the wave kernels run stacks of hidden size 1024 only
        extra += ["data.device=gpu", "training.precision=fp16", "model.enc_n_hid=1024"]
        extra += ["model.pred_n_hid=64", "model.joint_n_hid=64"]
    trainer = Trainer(make_cfg(corpus, tmp_path / "run", *extra), init_distributed(device))
    trainer.train_epoch()
    cpu, augment = torch.get_rng_state(), trainer.augment_generator.get_state()
    cuda = torch.cuda.get_rng_state() if device == "cuda" else None
    result = trainer.run_eval()
    assert result.utterances == 12 and 0 <= result.wer
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(trainer.augment_generator.get_state(), augment)
    if device == "cuda":
        assert torch.equal(torch.cuda.get_rng_state(), cuda)


def test_evaluations_inside_epochs_score_between_steps_and_change_nothing_else(
    corpus, tmp_path, capsys
):
    """training.eval_every_steps=2 scores the dev set after steps 2 and 4 of the 6-step epoch
    (step 6 is the epoch's own evaluation): separate records, no MLPerf eval events, and the
    same losses, epoch WER and weights as a run without them."""
    from rnnt.mlperf import MLPerfLogger

    mlperf_log = tmp_path / "probed_mlperf.log"
    probed = Trainer(
        make_cfg(corpus, tmp_path / "probed", "training.eval_every_steps=2"),
        CPU,
        mlperf=MLPerfLogger(str(mlperf_log), CPU.rank),
    )
    probed.fit()
    printed = capsys.readouterr().out
    plain = Trainer(make_cfg(corpus, tmp_path / "plain"), CPU)
    plain.fit()
    records = {
        name: read_metrics(tmp_path / name / "metrics.jsonl") for name in ("probed", "plain")
    }
    mid = [r for r in records["probed"] if r["kind"] == "mid_epoch_eval"]
    assert [(r["epoch"], r["step"]) for r in mid] == [(1, 2), (1, 4), (2, 8), (2, 10)]
    assert all(0 <= r["wer"] and r["utterances"] == 12 for r in mid)
    assert "epoch 1 step 2 (inside the epoch) | dev WER" in printed
    for kind in ("train", "eval"):
        ours, theirs = ([r for r in records[n] if r["kind"] == kind] for n in ("probed", "plain"))
        for key in ("step", "loss", "wer"):
            assert [r.get(key) for r in ours] == [r.get(key) for r in theirs], (kind, key)
    evals = [
        line for line in mlperf_log.read_text().splitlines() if '"key": "eval_accuracy"' in line
    ]
    assert len(evals) == 2  # the epochs' own
    for (key, a), b in zip(probed.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b), key
