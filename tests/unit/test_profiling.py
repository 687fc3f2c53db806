"""rnnt/profiling.py: which activities a profiled window records, and the window on the CPU."""

import json

import torch
from torch.profiler import ProfilerActivity

from rnnt.profiling import StepProfiler


def test_gpu_windows_record_the_host_s_operators_unless_told_not_to(tmp_path):
    cuda = torch.device("cuda")  # constructing a device needs no GPU
    both = StepProfiler(3, 2, tmp_path, 0, cuda).activities
    assert both == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert StepProfiler(3, 2, tmp_path, 0, cuda, host=False).activities == [ProfilerActivity.CUDA]


def test_a_cpu_window_records_its_operators_either_way(tmp_path):
    profiler = StepProfiler(2, 2, tmp_path, 1, torch.device("cpu"), host=False)
    assert profiler.activities == [ProfilerActivity.CPU]
    x = torch.ones(64, 64)
    lines = []
    for step in range(1, 5):
        profiler.before_step(step)
        x = x @ x / 64
        lines.append(profiler.after_step(step))
    stem = tmp_path / "profile" / "rank1_steps2-3"
    assert lines == [None, None, f"profiled steps 2-3: {stem}.json, by time in {stem}.txt", None]
    events = json.loads(stem.with_suffix(".json").read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    # steps 2 and 3: the matmul and the division once each
    assert names.count("aten::mm") == 2 and names.count("aten::div") == 2
