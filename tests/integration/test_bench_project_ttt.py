"""bench/project_ttt.py on a real CPU run: projected onto its own epochs and training set, the
projection gives back the run's own timed region."""

import json
import subprocess
import sys

import pytest

from rnnt.cli.train import main as train_main


def _timed_region(mlperf_log) -> float:
    stamps = {}
    for line in mlperf_log.read_text().splitlines():
        event = json.loads(line.removeprefix(":::MLLOG "))
        if event["key"] in ("run_start", "run_stop"):
            stamps[event["key"]] = event["time_ms"] / 1e3
    return stamps["run_stop"] - stamps["run_start"]


def test_a_run_projected_onto_itself_takes_its_own_time(repo_root, tiny_sets, tmp_path):
    out = tmp_path / "run"
    sets = tiny_sets(out, "training.epochs=4", "training.target_wer=0", "training.seed=3")
    tiny = repo_root / "configs" / "tiny.yaml"
    # the target (WER 0) is never reached: exit status 1
    assert train_main([str(tiny), "--device", "cpu", *sets]) == 1
    train_utterances = 48  # the digits corpus: 48 training utterances, 6 steps of 8
    proc = subprocess.run(
        [
            sys.executable,
            "bench/project_ttt.py",
            str(out),
            "--epochs",
            "4",
            "--train-utterances",
            str(train_utterances),
            "--json",
            str(tmp_path / "p.json"),
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    projected = json.loads((tmp_path / "p.json").read_text())
    assert projected["steps_per_epoch"] == 6 and projected["epochs"] == 4
    assert projected["epoch_s"] == pytest.approx(6 * projected["step_s"])
    assert 0 < projected["evaluation_s"] <= projected["between_s"]
    # medians of epochs 2-4 for every epoch: the first one's warm-up is the difference
    assert projected["time_to_train_s"] == pytest.approx(_timed_region(out / "mlperf.log"), rel=0.3)
    assert "time to train = 4 x (" in proc.stdout


def test_a_folder_without_a_run_is_one_line(repo_root, tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/project_ttt.py", str(tmp_path)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {tmp_path}: ") and len(proc.stderr.splitlines()) == 1
