"""bench/train_step.py times the real Trainer's step (a CPU smoke run)."""

import json
import subprocess
import sys


def test_bench_times_the_trainers_step_on_cpu(repo_root, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "bench/train_step.py",
        "--device",
        "cpu",
        "--config",
        "configs/tiny.yaml",
        "--batch-sizes",
        "4",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        str(out),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--checkpoint-cost",
        # short utterances keep the CPU run to seconds; the full vocabulary of the table
        "--set",
        "data.max_duration=4",
        "--set",
        "model.n_classes=1024",
        "--set",
        "model.encoder_lstm=auto",
    ]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MFU against nothing: no peak for the CPU" in proc.stdout  # the Trainer's own line
    (row,) = json.loads(out.read_text())["results"]
    assert (row["batch_size"], row["num_cg"], row["steps"]) == (4, 0, 2)
    assert row["encoder_lstm"] == "cudnn"  # what `auto` ran, as the backend line says it
    assert row["median_step_ms"] > 0 and row["utts_per_s"] > 0 and row["mfu"] > 0
    assert row["skipped_steps"] == 0 and row["final_loss"] > 0
    assert 0 < row["checkpoint_gb"] < 0.1 and row["checkpoint_total_s"] > 0
    assert "utts/s" in proc.stdout


def test_bench_counts_every_micro_batch_of_a_step(repo_root, tmp_path):
    """With two micro-batches accumulated, a timed step carries twice the batch: strong-scaling
    rows (half the GPUs, accumulation 2) compare with weak ones by utterances per second."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "bench/train_step.py", "--device", "cpu"]
    cmd += ["--config", "configs/tiny.yaml", "--batch-sizes", "4", "--steps", "2"]
    cmd += ["--warmup", "1", "--json", str(out), "--cache-dir", str(tmp_path / "cache")]
    cmd += ["--set", "data.max_duration=4", "--set", "model.n_classes=1024"]
    cmd += ["--set", "training.grad_accumulation=2"]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["grad_accumulation"] == 2
    assert abs(row["utts_per_s"] - 8 / (row["median_step_ms"] * 1e-3)) < 1e-6 * row["utts_per_s"]


def test_an_unknown_wave_variant_is_one_line_before_any_step(repo_root):
    cmd = [sys.executable, "bench/train_step.py", "--device", "cpu", "--wave-variants", "2", "99"]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    # with nvcc the library names the variants it has; without, why it cannot be built
    assert last.startswith("train_step.py: error: --wave-variants: ")
    assert "Traceback" not in proc.stderr
