"""bench/worker_handoff.py runs the loader's collate in real worker processes and times what
a batch costs the workers and the training process, in each of the three ways a worker can
hand a batch over (a CPU smoke run at a small size)."""

import re
import subprocess
import sys


def test_the_benchmark_times_every_way_of_handing_a_batch_over(repo_root):
    cmd = [sys.executable, "bench/worker_handoff.py", "--batch", "8", "--seconds", "1"]
    cmd += ["--workers", "1", "--batches", "6"]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pattern = (
        r"(new, keep 0|new, keep 2|reused): 0 MB a batch: receive ([\d.]+) ms, copy ([\d.]+) "
        r"ms, drop ([\d.]+) ms; another thread ran at (\d+)% of its idle rate during the drop; "
        r"workers ([\d.]+) ms of CPU a batch"
    )
    found = [re.fullmatch(pattern, line) for line in proc.stdout.splitlines()]
    assert [m.group(1) for m in found if m] == ["new, keep 0", "new, keep 2", "reused"], proc.stdout
    for m in filter(None, found):
        assert all(float(v) >= 0 for v in m.groups()[1:])


def test_the_benchmark_refuses_too_few_batches_to_time_the_workers(repo_root):
    cmd = [sys.executable, "bench/worker_handoff.py", "--workers", "2", "--batches", "5"]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--batches >= 2 + 2 x workers" in proc.stderr
