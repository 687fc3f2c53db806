"""bench/project_ttt.py on a real CPU run: projected onto its own epochs and training set, the
projection gives back the run's own timed region (past the first epoch's warm-up)."""

import json
import subprocess
import sys

import pytest

from rnnt.cli.train import main as train_main


def _marks(mlperf_log) -> dict[tuple[str, int | None], float]:
    """(key, epoch) -> seconds of the run's interval marks, read straight from the log."""
    marks = {}
    for line in mlperf_log.read_text().splitlines():
        event = json.loads(line.removeprefix(":::MLLOG "))
        epoch = (event.get("metadata") or {}).get("epoch_num")
        marks[event["key"], epoch] = event["time_ms"] / 1e3
    return marks


def test_a_run_projected_onto_itself_takes_its_own_time(repo_root, tiny_sets, tmp_path):
    out = tmp_path / "run"
    sets = tiny_sets(out, "training.epochs=4", "training.target_wer=0", "training.seed=3")
    tiny = repo_root / "configs" / "tiny.yaml"
    # no target (WER 0): all 4 epochs run, and that is a finished run
    assert train_main([str(tiny), "--device", "cpu", *sets]) == 0
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
    # the projection lies within what epochs 2-4 measured (the first pays for warm-up), and
    # near the run's own timed region
    marks = _marks(out / "mlperf.log")
    later = range(2, 5)
    train = [marks["epoch_stop", e] - marks["epoch_start", e] for e in later]
    cycle = [
        marks.get(("epoch_start", e + 1), marks["run_stop", None]) - marks["epoch_start", e]
        for e in later
    ]
    between = [c - t for c, t in zip(cycle, train)]
    per_epoch = projected["time_to_train_s"] / 4
    assert min(train) + min(between) - 1e-6 <= per_epoch <= max(train) + max(between) + 1e-6
    assert projected["epoch_s"] + projected["between_s"] == pytest.approx(per_epoch)
    # the run's own timed region from epoch 2 on, scaled to 4 epochs: the first epoch's
    # warm-up, which the projection leaves out by design, took seconds on a busy 2-core VM
    later_timed = (marks["run_stop", None] - marks["epoch_start", 2]) * 4 / 3
    assert 0.5 * later_timed < projected["time_to_train_s"] < 2 * later_timed
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
