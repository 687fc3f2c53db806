"""bench/data_pipeline.py times the real loaders on a real manifest (a CPU smoke run on the
digits corpus)."""

import json
import subprocess
import sys
import time

from bench.data_pipeline import cpu_seconds


def test_bench_times_the_torch_loader_on_a_manifest(repo_root, corpus, tmp_path):
    root = corpus["root"]
    out = tmp_path / "pipeline.json"
    cmd = [
        sys.executable,
        "bench/data_pipeline.py",
        "--manifest",
        str(root / "train.jsonl"),
        "--dataset-dir",
        str(root),
        "--backends",
        "torch",
        "--device",
        "cpu",
        "--threads",
        "0",
        "2",
        "--batch-size",
        "2",
        "--warmup",
        "1",
        "--batches",
        "3",
        "--epoch-pause",
        "0.5",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["batch_size"] == 2 and 1.0 < report["mean_seconds"] < 5.0
    assert [(r["backend"], r["threads"]) for r in report["results"]] == [("torch", 0), ("torch", 2)]
    for row in report["results"]:
        assert row["utterances_per_s"] > 0 and row["cores"] > 0 and row["batches"] == 3
        assert 0 < row["first_batch_s"] < 120
        # read ahead during the pause, unlike the first batch (which waited for the workers)
        assert 0 <= row["next_epoch_first_batch_s"] < row["first_batch_s"] or not row["threads"]
        assert row["gpu_ms_per_batch"] is None  # the feature stage ran in the CPU workers
        assert row["gpu_kernel_ms_per_batch"] is None


def test_cores_count_a_few_milliseconds_of_work():
    """The CPU time behind `cores` resolves a window shorter than the 10 ms clock tick of
    /proc/PID/stat (a short smoke run once read as 0.0 cores): 5 ms of work in this thread,
    against the thread's own CPU clock."""
    before, thread_before = cpu_seconds(), time.thread_time()
    while time.thread_time() - thread_before < 0.005:
        pass
    spent = time.thread_time() - thread_before
    assert abs((cpu_seconds() - before) - spent) < 0.003
