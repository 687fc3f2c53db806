"""The README's quickstart end to end on CPU: an espeak-ng digits corpus with a 2,703-utterance
dev split, the tiny config trained until the dev WER reaches 5.8%, eval.py re-scoring the
checkpoint, and the MLPerf compliance checker accepting the log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from rnnt.run_log import read_metrics


@pytest.mark.slow
def test_quickstart_trains_digits_to_target_with_a_compliant_log(repo_root, tmp_path):
    data, out = tmp_path / "digits", tmp_path / "run"
    env = dict(os.environ, DATA=str(data), OUT=str(out), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        ["bash", "scripts/quickstart.sh"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    sys.stdout.write(log[-3000:])  # shown with -s / on failure: the run's numbers

    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and evals[-1]["wer"] <= 0.058 and evals[-1]["utterances"] == 2703
    assert all(r["wer"] > 0.058 for r in evals[:-1])  # the run stopped at the first success

    # the compliance checker's own verdict, run by the quickstart on the run's MLPerf log
    assert re.search(r"SUCCESS", log), log[-2000:]
    lines = [
        json.loads(line.split(":::MLLOG", 1)[1])
        for line in (out / "mlperf.log").read_text().splitlines()
        if ":::MLLOG" in line
    ]
    accuracy = [r["value"] for r in lines if r["key"] == "eval_accuracy"]
    assert accuracy[-1] == pytest.approx(evals[-1]["wer"])
    assert [r["metadata"]["status"] for r in lines if r["key"] == "run_stop"] == ["success"]

    # training and eval.py say which implementations ran (rnnt.backends)
    assert re.search(
        r"backends: data=\S+/cpu encoder_lstm=cudnn loss=reference lamb=torch "
        r"eval_encoder_lstm=cudnn$",
        log,
        re.M,
    )
    assert re.search(r"^backends: data=\S+/cpu encoder_lstm=cudnn$", log, re.M), log[-2000:]

    # eval.py re-scores the newest checkpoint to the WER the training log reported
    match = re.search(r"^WER: ([0-9.]+)$", log, re.MULTILINE)
    assert match, log[-2000:]
    assert float(match.group(1)) == pytest.approx(evals[-1]["wer"], abs=1e-6)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
