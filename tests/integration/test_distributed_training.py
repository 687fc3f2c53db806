"""train.py under torchrun: the sharded optimizer gives the weights of one process, a preempted
run resumes exactly, and a dead rank ends (or, with --max-restarts, restarts) the job.

Each case runs with two CPU processes (gloo, in CI) and on GPUs (NCCL; marked gpu and
multi_gpu, run by `bench/gpu_session.sh multi` on a machine with several GPUs): gloo accepts
what NCCL refuses, so only the GPU runs prove the NCCL paths.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rnnt.checkpoint import CheckpointManager
from rnnt.preemption import EXIT_PREEMPTED, PREEMPTED_MARKER
from rnnt.run_log import METRICS_FILE, read_metrics
from tests.helpers import as_set_args, tiny_overrides, train_command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # about 2 minutes together on 2 cores


def sets(corpus: dict, out: Path, batch: int, *extra: str) -> list[str]:
    return as_set_args(
        tiny_overrides(
            corpus,
            out,
            f"training.batch_size={batch}",
            "training.seed=11",
            "training.deterministic=true",
            "training.collective_timeout_s=60",
            *extra,
        )
    )


CPU2 = ("cpu", 2)
CUDA2 = pytest.param(("cuda", 2), marks=[pytest.mark.gpu, pytest.mark.multi_gpu])
CUDA4 = pytest.param(("cuda", 4), marks=[pytest.mark.gpu, pytest.mark.multi_gpu])


@pytest.fixture
def launch(request) -> tuple[str, int]:
    """(device, processes) of the case; skipped where the machine has too few GPUs."""
    device, nproc = request.param
    if device == "cuda" and torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA devices")
    return device, nproc


# cuBLAS is deterministic (training.deterministic) only with a fixed workspace
ENV = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def train_losses(out: Path) -> dict[int, float]:
    records = read_metrics(out / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def final_state(out: Path) -> tuple[dict, list]:
    states, checkpoint = CheckpointManager(out / "checkpoints").load_latest(
        lambda c: ["model"] + [f"rank{r}" for r in range(c.record["world_size"])]
    )
    ranks = [states[f"rank{r}"] for r in range(checkpoint.record["world_size"])]
    return states["model"], ranks


def start(cmd: list[str]) -> subprocess.Popen:
    # a session of its own, so that the test can signal the launcher and its workers
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=ENV,
    )


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}:\n{proc.stdout.read()}")
        path = out / "metrics.jsonl"
        if path.is_file() and any(s >= step for s in train_losses(out)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def workers(launcher: subprocess.Popen) -> list[int]:
    """The train.py processes torchrun started."""
    pids = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(launcher.pid)], capture_output=True, text=True
    ).stdout.split()
    found = []
    for pid in map(int, pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"train.py" in cmdline:
            found.append(pid)
    return found


EXACT = (
    # no randomness that depends on the rank or the batch's split: dropout, SpecAugment, speed
    # perturbation and dither off, fp32
    "model.enc_dropout=0.0",
    "model.pred_dropout=0.0",
    "model.joint_dropout=0.0",
    "features.spec_augment.freq_masks=0",
    "features.spec_augment.time_masks=0",
    "features.speed_perturbation_min=1.0",
    "features.speed_perturbation_max=1.0",
    "features.dither=0.0",
    "training.epochs=1",
)


@pytest.mark.parametrize("launch", [CPU2, CUDA2, CUDA4], indirect=True)
def test_ranks_train_to_the_weights_of_one_rank(corpus, tmp_path, launch):
    device, world = launch
    one, two = tmp_path / "one", tmp_path / "two"
    for nproc, out in ((1, one), (world, two)):
        command = train_command(
            nproc, *sets(corpus, out, 8 // nproc, *EXACT, "training.peak_tflops=1"), device=device
        )
        proc = run(command)
        assert "target NOT reached" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps_one, steps_two = train_losses(one), train_losses(two)
    assert sorted(steps_one) == sorted(steps_two) == list(range(1, 7))
    for step in steps_one:  # rank 0 logs its own share of the batch: close, not equal
        assert steps_two[step] == pytest.approx(steps_one[step], rel=0.5)
    # The logged utt/s and MFU count every rank's utterances and FLOPs, so the MFU is against
    # the peak of all ranks: per utterance, a step's MFU shrinks with the ranks (the FLOPs are
    # rank 0's times the ranks, hence only close).
    per_utt_one, per_utt_two = (
        statistics.median(
            r["mfu"] / r["utts_per_s"]
            for r in read_metrics(out / METRICS_FILE)
            if r["kind"] == "train"
        )
        for out in (one, two)
    )
    assert per_utt_two * world == pytest.approx(per_utt_one, rel=0.4)
    (model_one, ranks_one), (model_two, ranks_two) = final_state(one), final_state(two)
    pairs = [(model_two["model"][k], v, k) for k, v in model_one["model"].items()]
    pairs += [
        (b, a, "ema") for a, b in zip(model_one["ema"]["weights"], model_two["ema"]["weights"])
    ]
    for got, expected, name in pairs:
        if device == "cpu":
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)
        else:
            # cuDNN picks other kernels for other batch sizes, so gradients differ in their
            # last bits, and LAMB's first steps move each weight by about lr * sign(gradient):
            # a weight whose gradient is rounding noise moves either way. Per tensor, the
            # difference stays a small part of the weights.
            diff = torch.linalg.vector_norm(got - expected)
            assert diff <= 2e-3 * torch.linalg.vector_norm(expected), name
    # each rank holds 1/world of the optimizer state (each of 3 buckets padded to world x 64)
    shard_sizes = {r["optimizer"]["master"].numel() for r in ranks_two}
    one_rank = ranks_one[0]["optimizer"]["master"].numel()
    assert len(ranks_two) == world and len(shard_sizes) == 1
    assert 0 <= world * shard_sizes.pop() - one_rank < 3 * 64 * world


@pytest.mark.parametrize("launch", [CPU2, CUDA2], indirect=True)
def test_a_preempted_run_saves_at_a_step_boundary_and_resumes_exactly(corpus, tmp_path, launch):
    device, _ = launch
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    extra = ("training.epochs=3", "training.save_every_epochs=0")
    proc = run(train_command(2, *sets(corpus, reference, 4, *extra), device=device))
    assert "target NOT reached" in proc.stdout, proc.stderr[-3000:]
    expected = train_losses(reference)
    assert sorted(expected) == list(range(1, 19))

    launcher = start(train_command(2, *sets(corpus, interrupted, 4, *extra), device=device))
    wait_for_step(interrupted, 3, launcher)
    os.kill(launcher.pid, signal.SIGTERM)  # torchrun forwards it to its workers
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode != 0
    assert "preempted: state saved in" in output, output[-3000:]
    model, _ = final_state(interrupted)
    stopped = model["progress"]["step"]
    assert 3 <= stopped < 18 and max(train_losses(interrupted)) == stopped
    # the launcher's sign to requeue, naming the checkpoint, whatever the exit statuses say
    marker = (interrupted / PREEMPTED_MARKER).read_text().strip()
    assert marker.startswith(str(interrupted / "checkpoints" / "ckpt_")) and marker in output

    proc = run(train_command(2, "--resume", *sets(corpus, interrupted, 4, *extra), device=device))
    assert "target NOT reached" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (interrupted / PREEMPTED_MARKER).exists()  # a later crash is not a preemption
    after = train_losses(interrupted)
    assert sorted(after) == list(range(1, 19))
    for step in range(stopped + 1, 19):
        assert after[step] == expected[step], f"step {step}: {after[step]} != {expected[step]}"


@pytest.mark.parametrize("launch", [CPU2, CUDA2], indirect=True)
def test_sigusr1_to_the_workers_stops_them_with_the_requeue_status(corpus, tmp_path, launch):
    """As SLURM's `--signal=USR1@N` does with one task per rank (no torchrun in between)."""
    out = tmp_path / "run"
    launcher = start(
        train_command(2, *sets(corpus, out, 4, "training.epochs=50"), device=launch[0])
    )
    wait_for_step(out, 2, launcher)
    pids = workers(launcher)
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGUSR1)  # one rank hears it: all agree at the next step
    output = launcher.communicate(timeout=120)[0]
    assert "preempted: saved" in output and f"exitcode  : {EXIT_PREEMPTED}" in output, output[
        -3000:
    ]
    model, ranks = final_state(out)
    assert len(ranks) == 2 and model["progress"]["step"] >= 2


@pytest.mark.parametrize("launch", [CPU2, CUDA2], indirect=True)
def test_the_log_counts_the_utterances_every_rank_dropped(corpus, tmp_path, launch):
    """Under data.skip_bad each rank drops the undecodable utterances of its own batches; the
    log line counts all ranks' (a collective queued with the log point, read one step on)."""
    garbage = corpus["root"] / f"garbage_{tmp_path.name}.flac"
    garbage.write_bytes(b"fLaC" + bytes(range(256)) * 8)  # passes the preflight, decodes not
    try:
        records = (corpus["root"] / "train.jsonl").read_text().splitlines()
        for i in range(0, len(records), 8):  # 6 of 48, spread over both ranks' shards
            records[i] = records[i].replace(json.loads(records[i])["audio"], garbage.name)
        manifest = tmp_path / "train.jsonl"
        manifest.write_text("\n".join(records) + "\n")
        out = tmp_path / "run"
        extra = ("data.skip_bad=true", f"data.train_manifests=[{manifest}]")
        proc = run(train_command(2, *sets(corpus, out, 4, *extra), device=launch[0]))
    finally:
        garbage.unlink()
    assert "target NOT reached" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [r for r in read_metrics(out / METRICS_FILE) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert steps[-1]["dropped_utterances"] == 6


@pytest.mark.parametrize("launch", [CPU2, CUDA2], indirect=True)
def test_a_killed_rank_ends_the_job(corpus, tmp_path, launch):
    out = tmp_path / "run"
    launcher = start(
        train_command(2, *sets(corpus, out, 4, "training.epochs=50"), device=launch[0])
    )
    wait_for_step(out, 2, launcher)
    killed = time.monotonic()
    os.kill(workers(launcher)[0], signal.SIGKILL)
    launcher.communicate(timeout=90)
    assert launcher.returncode != 0 and time.monotonic() - killed < 90


@pytest.mark.parametrize("launch", [CPU2, CUDA2], indirect=True)
def test_torchrun_restarts_a_killed_job_which_resumes_and_finishes(corpus, tmp_path, launch):
    out = tmp_path / "run"
    extra = ("training.epochs=2", "training.checkpoint_every_steps=2")
    cmd = train_command(
        2,
        "--resume",
        *sets(corpus, out, 4, *extra),
        device=launch[0],
        torchrun=("--max-restarts", "1"),
    )
    launcher = start(cmd)
    wait_for_step(out, 5, launcher)
    os.kill(workers(launcher)[1], signal.SIGKILL)
    output = launcher.communicate(timeout=240)[0]
    assert "resumed from" in output and "target NOT reached" in output, output[-3000:]
    assert max(train_losses(out)) == 12


def test_a_checkpoint_of_two_ranks_resumes_on_one(corpus, tmp_path):
    """The optimizer shards are cut anew for one rank; with no randomness in the run (EXACT)
    the resumed run ends where the two ranks did."""
    two, one = tmp_path / "two", tmp_path / "one"
    extra = (*EXACT, "training.checkpoint_every_steps=4", "training.keep_last_checkpoints=10")
    proc = run(train_command(2, *sets(corpus, two, 4, *extra)))
    assert "target NOT reached" in proc.stdout, proc.stderr[-3000:]
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "ckpt_e0_s4", one / "checkpoints" / "ckpt_e0_s4")
    proc = run(train_command(1, "--resume", *sets(corpus, one, 8, *extra)))
    assert "; NOT exact: it was written by 2 rank(s)" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:]
    )
    assert sorted(train_losses(one)) == [5, 6]
    (model_two, _), (model_one, ranks_one) = final_state(two), final_state(one)
    assert len(ranks_one) == 1
    for key, value in model_two["model"].items():
        torch.testing.assert_close(model_one["model"][key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("launch", [CPU2, CUDA2], indirect=True)
def test_a_run_started_from_another_runs_checkpoint_continues_it(corpus, tmp_path, launch):
    """--init-from on every rank: with no randomness in the run (EXACT), the new run ends on the
    weights of the run it started from, under its own id."""
    device, _ = launch
    first, second = tmp_path / "first", tmp_path / "second"
    extra = (*EXACT, "training.checkpoint_every_steps=4", "training.keep_last_checkpoints=10")
    proc = run(train_command(2, *sets(corpus, first, 4, *extra), device=device))
    assert "target NOT reached" in proc.stdout, proc.stderr[-3000:]
    start = first / "checkpoints" / "ckpt_e0_s4"
    command = train_command(
        2, "--init-from", str(start), *sets(corpus, second, 4, *extra), device=device
    )
    proc = run(command)
    assert f"started from {start}" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert sorted(train_losses(second)) == [5, 6]
    runs = [read_metrics(out / METRICS_FILE)[0]["run_id"] for out in (first, second)]
    assert runs[0] != runs[1]
    (model_first, _), (model_second, _) = final_state(first), final_state(second)
    for key, value in model_first["model"].items():
        torch.testing.assert_close(model_second["model"][key], value, rtol=1e-4, atol=1e-6)


def test_run_and_time_passes_a_preemption_through_torchrun(corpus, tmp_path):
    """docker/launch.sh runs scripts/run_and_time.sh under torchrun, which signals only that
    shell: the shell hands the signal to train.py, which saves, and reports its status."""
    out = tmp_path / "run"
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--no-python",
        "bash",
        "scripts/run_and_time.sh",
        "configs/tiny.yaml",
        "--device",
        "cpu",
        *sets(corpus, out, 4, "training.epochs=50"),
    ]
    proc = start(launcher)
    wait_for_step(out, 2, proc)
    os.kill(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert "STARTING TIMING RUN" in output and "preempted: saved" in output, output[-3000:]
    assert "ENDING TIMING RUN" in output  # the shell lived on to report
    model, ranks = final_state(out)
    assert len(ranks) == 2 and model["progress"]["step"] >= 2
