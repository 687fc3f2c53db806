import json
import subprocess
import sys

import pytest

from rnnt.config import Config
from rnnt.mlperf import MLPerfLogger


def write_run(path, eval_samples=2703, cfg=None, wers=(0.31, 0.12, 0.055), rank=0):
    """A whole 3-epoch run through the public API, in the order train.py uses it."""
    cfg = cfg or Config()
    ml = MLPerfLogger(str(path) if path is not None else None, rank)
    ml.submission_info(org="rnnt-open", platform="1xH200", division="closed", status="research")
    ml.cache_clear(True)
    ml.init_start()
    ml.hyperparameters(
        cfg,
        global_batch_size=1024,
        train_samples=278_528,
        eval_samples=eval_samples,
        grad_accumulation=1,
    )
    ml.init_stop()
    ml.run_start()
    status = "aborted"
    for epoch, wer in enumerate(wers, start=1):
        ml.block_start(epoch)
        ml.epoch_start(epoch)
        ml.epoch_stop(epoch)
        ml.eval_start(epoch)
        ml.eval_accuracy(wer, epoch)
        ml.eval_stop(epoch)
        ml.block_stop(epoch)
        if wer <= cfg.training.target_wer:
            status = "success"
            break
    ml.run_stop(status)
    ml.close()


def check(path):
    """The MLPerf compliance checker's verdict (it also writes its own log, kept beside)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlperf_logging.compliance_checker",
            "--usage",
            "training",
            "--ruleset",
            "3.1.0",
            "--log_output",
            str(path) + ".checker",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=path.parent,
    )
    return out.returncode, out.stdout + out.stderr


def records(path):
    lines = path.read_text().splitlines()
    assert all(line.startswith(":::MLLOG ") for line in lines)
    return [json.loads(line[len(":::MLLOG ") :]) for line in lines]


def test_full_run_passes_the_compliance_checker(tmp_path):
    log = tmp_path / "mlperf.log"
    write_run(log)
    code, output = check(log)
    assert code == 0 and "SUCCESS" in output, output
    recs = {r["key"]: r for r in records(log)}
    assert recs["eval_samples"]["value"] == 2703
    assert recs["data_speed_perturbaton_min"]["value"] == 0.85
    assert recs["run_stop"]["metadata"]["status"] == "success"
    # the caller of the public method is reported, not this module's plumbing
    assert recs["eval_accuracy"]["metadata"]["file"].endswith("test_mlperf.py")


def test_small_eval_set_fails_the_checker(tmp_path):
    log = tmp_path / "mlperf.log"
    write_run(log, eval_samples=100)
    code, output = check(log)
    assert "SUCCESS" not in output
    assert code != 0 and "eval_samples" in output


def test_non_compliant_config_is_logged_as_is(tmp_path):
    cfg = Config()
    cfg.features.spec_augment.time_masks = 4
    log = tmp_path / "mlperf.log"
    write_run(log, cfg=cfg)
    code, output = check(log)
    assert code != 0 and "data_spec_augment_time_n" in output


def test_other_ranks_and_no_path_write_nothing(tmp_path):
    log = tmp_path / "rank1.log"
    write_run(log, rank=1)
    assert not log.exists()
    write_run(None)  # no file anywhere, no error


def test_reopening_a_log_does_not_duplicate_lines(tmp_path):
    path = str(tmp_path / "x.log")
    MLPerfLogger(path, 0).init_start()  # never closed
    MLPerfLogger(path, 0).init_stop()
    assert [r["key"] for r in records(tmp_path / "x.log")] == ["init_start", "init_stop"]


def test_run_stop_status_is_checked(tmp_path):
    ml = MLPerfLogger(str(tmp_path / "x.log"), 0)
    with pytest.raises(ValueError, match="success"):
        ml.run_stop("done")
    ml.close()
