"""bench/worker_handoff.py runs the loader's collate in real worker processes and times what
the training process pays per batch, with the workers keeping their batches and without (a
CPU smoke run at a small size)."""

import re
import subprocess
import sys


def test_the_benchmark_times_both_ways_of_releasing_a_batch(repo_root):
    cmd = [sys.executable, "bench/worker_handoff.py", "--batch", "8", "--seconds", "1"]
    cmd += ["--workers", "1", "--batches", "4"]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pattern = (
        r"keep (\d): 0 MB a batch: receive ([\d.]+) ms, copy ([\d.]+) ms, drop ([\d.]+) ms; "
        r"another thread ran at (\d+)% of its idle rate during the drop"
    )
    found = [re.fullmatch(pattern, line) for line in proc.stdout.splitlines()]
    assert [m.group(1) for m in found if m] == ["0", "2"], proc.stdout
    for m in filter(None, found):
        assert all(float(v) >= 0 for v in m.groups()[1:])
