"""bench/data_pipeline.py times the real loaders on a real manifest (a CPU smoke run on the
digits corpus)."""

import json
import subprocess
import sys


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


_CPU_WINDOW = """
import json, time
from bench.data_pipeline import cpu_seconds
p0 = time.process_time(); c0 = cpu_seconds(); p1 = time.process_time()
start = time.thread_time()
while time.thread_time() - start < 0.005:
    pass
p2 = time.process_time(); c1 = cpu_seconds(); p3 = time.process_time()
print(json.dumps({"counted": c1 - c0, "least": p2 - p1, "most": p3 - p0}))
"""


def test_cores_count_a_few_milliseconds_of_work(repo_root):
    """The CPU time behind `cores` resolves a window shorter than the 10 ms clock tick of
    /proc/PID/stat (a short smoke run once read as 0.0 cores): 5 ms of work, against the
    process's own CPU clock read on either side of each sample. A fresh process, because
    pytest's own leftover threads (OpenMP workers still spinning) would add to the count."""
    out = subprocess.run(
        [sys.executable, "-c", _CPU_WINDOW],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=True,
    )
    window = json.loads(out.stdout)
    # The scheduler credits a running thread's time at ticks, so a sample may lag by one.
    assert window["least"] - 0.003 < window["counted"] < window["most"] + 0.003
