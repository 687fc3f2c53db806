"""Throughput windows (rnnt/throughput.py)."""

import time

import pytest
import torch

from rnnt.throughput import StepParts, ThroughputWindow


def test_windows_tile_the_wall_clock_and_count_what_happened():
    window = ThroughputWindow(torch.device("cpu"), peak_flops=1e9)
    t0 = time.perf_counter()
    window.start()
    for _ in range(3):
        window.waited_for_data(0.001)
        time.sleep(0.01)
        window.add_step(utterances=8, flops=2_000_000)
    first = window.close().stats()
    time.sleep(0.02)
    window.add_step(utterances=8, flops=0)
    second = window.close().stats()
    elapsed = time.perf_counter() - t0
    assert (first.steps, first.utterances, second.steps, second.utterances) == (3, 24, 1, 8)
    assert first.seconds >= 0.03 and second.seconds >= 0.02
    assert first.seconds + second.seconds == pytest.approx(elapsed, abs=2e-3)
    assert first.utts_per_s == pytest.approx(24 / first.seconds)
    assert first.step_ms == pytest.approx(1e3 * first.seconds / 3)
    assert first.data_wait_share == pytest.approx(0.003 / first.seconds)
    assert first.mfu == pytest.approx(6e6 / first.seconds / 1e9)
    assert first.peak_memory_gib is None and first.alloc_retries is None  # no GPU


def test_the_loaders_wait_parts_are_shares_of_each_window():
    """A loader that times the parts of its wait (cumulative seconds by name): each window gets
    the part of them spent since its start, as shares of its own length; none without one."""
    spent = {"workers": 0.5, "queueing": 0.0, "stage": 1.0}
    window = ThroughputWindow(torch.device("cpu"), wait_parts=lambda: dict(spent))
    window.start()
    time.sleep(0.02)
    spent["workers"] += 0.004
    spent["stage"] += 0.01
    first = window.close().stats()
    assert first.data_wait_parts["workers"] == pytest.approx(0.004 / first.seconds)
    assert first.data_wait_parts["stage"] == pytest.approx(0.01 / first.seconds)
    assert first.data_wait_parts["queueing"] == 0.0
    time.sleep(0.01)
    assert window.close().stats().data_wait_parts == {"workers": 0.0, "queueing": 0.0, "stage": 0.0}
    bare = ThroughputWindow(torch.device("cpu"))
    bare.start()
    assert bare.close().stats().data_wait_parts is None


def test_no_peak_means_no_mfu():
    window = ThroughputWindow(torch.device("cpu"))
    window.start()
    window.add_step(1, 10)
    stats = window.close().stats()
    assert stats.mfu is None
    assert stats.host_lead_ms is None  # the host clock ends a CPU window: nothing to wait for


@pytest.mark.gpu
def test_a_window_ends_when_the_gpu_has_finished_its_work_without_waiting_for_it():
    """The host queues far more GPU work than it takes to queue: closing the window returns at
    once, the GPU still busy, and the window lasts until the GPU finished that work."""
    a = torch.randn(4096, 4096, device="cuda")
    window = ThroughputWindow(torch.device("cuda"))
    window.start()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        a = torch.tanh(a @ a)
    end.record()
    window.add_step(1, 0)
    closed = window.close()
    assert not torch.cuda.current_stream().query()  # still running: close() did not sync
    waited = time.perf_counter()
    stats = closed.stats()
    waited = time.perf_counter() - waited
    gpu_seconds = start.elapsed_time(end) * 1e-3
    assert stats.seconds >= gpu_seconds
    assert stats.peak_memory_gib > 0
    # the host was ahead: the read waited for the GPU, and the window says for how long
    assert 0.1 * gpu_seconds < stats.host_lead_ms / 1e3 <= waited
    assert closed.stats().host_lead_ms == stats.host_lead_ms  # measured once
    torch.cuda.synchronize()
    window.add_step(1, 0)
    assert window.close().stats().host_lead_ms < 1.0  # the GPU was done before the read


@pytest.mark.gpu
def test_a_windows_time_holds_the_gpus_idle_time_and_the_windows_tile_the_wall_clock():
    """The GPU idles while the host sleeps between steps: that time belongs to the window, as
    in a host-clock measurement, and consecutive windows add up to the wall clock."""
    a = torch.randn(2048, 2048, device="cuda")
    window = ThroughputWindow(torch.device("cuda"))
    window.start()
    t0 = time.perf_counter()
    closed = []
    for _ in range(3):
        a = torch.tanh(a @ a)
        time.sleep(0.05)
        window.add_step(1, 0)
        closed.append(window.close())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    seconds = [c.stats().seconds for c in closed]
    assert all(s >= 0.05 for s in seconds[1:])
    assert sum(seconds) == pytest.approx(elapsed, abs=5e-3)


@pytest.mark.gpu
def test_step_parts_time_between_marks_and_after_gradients():
    parts = StepParts()
    x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    parts.mark("start")
    y = (x @ x).tanh()
    parts.mark_when_grads_reach([y], "grads")
    y.sum().backward()
    parts.mark("end")
    (total,) = parts.milliseconds("start", "end")
    (to_grads,) = parts.milliseconds("start", "grads")
    assert 0 < to_grads < total


@pytest.mark.gpu
def test_a_window_counts_the_allocators_retries_in_it():
    """A cudaMalloc past the memory limit makes the caching allocator free its cache and try
    again: counted in the window where it happened, not in the next."""
    device = torch.device("cuda", torch.cuda.current_device())  # the memory fraction wants an index
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    live = torch.cuda.memory_reserved(device)  # what earlier tests still hold
    torch.cuda.set_per_process_memory_fraction((live + (2 << 30)) / total, device)
    try:
        window = ThroughputWindow(device)
        window.start()
        cached = torch.empty(1200 << 20, dtype=torch.uint8, device=device)
        del cached  # 1.2 GiB stays in the cache: 2.7 GiB would pass the 2 GiB allowed
        bigger = torch.empty(1500 << 20, dtype=torch.uint8, device=device)
        del bigger
        first = window.close().stats()
        second = window.close().stats()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    assert (first.alloc_retries, second.alloc_retries) == (1, 0)
