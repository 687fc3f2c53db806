"""bench/trace_streams.py: the streams and side-stream bursts of a Chrome trace, on a made-up
trace whose numbers are known, through the command line with a gzipped file, and its refusal of
a trace with no device work (what a CPU run's profile holds)."""

import gzip
import json
import subprocess
import sys

import pytest

from bench.trace_streams import overlap, step_phases, summarize, time_by_kind


def _kernel(
    stream: int, start_us: float, end_us: float, cat: str = "kernel", name: str = "k"
) -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": start_us,
        "dur": end_us - start_us,
        "args": {"stream": stream, "device": 0},
    }


def _trace() -> dict:
    step = [_kernel(7, 0, 10_000), _kernel(7, 10_000, 30_000), _kernel(7, 40_000, 100_000)]
    # the side stream: a burst of three kernels beside the step's work, gaps under 2 ms, then
    # a kernel and a copy while the step's stream is idle
    side = [
        _kernel(20, 5_000, 6_000),
        _kernel(20, 7_000, 7_500),
        _kernel(20, 8_000, 9_000),
        _kernel(20, 35_000, 36_000),
        _kernel(20, 36_500, 37_000, cat="gpu_memcpy"),
    ]
    # a branch of a replayed graph, on a stream of its own, beside the side stream's kernel
    branch = [_kernel(30, 35_500, 36_200)]
    host = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -50_000, "dur": 500_000},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1, "args": {"stream": 7}},
    ]
    return {"traceEvents": host + side[::-1] + step + branch}


def test_streams_bursts_and_idle_time_of_a_known_trace():
    result = summarize(_trace(), gap_ms=2.0)
    assert result["step_stream"] == 7
    assert result["window_ms"] == pytest.approx(100.0)
    # idle: 30-35, 36.2-36.5 and 37-40 ms
    assert result["gpu_idle_ms"] == pytest.approx(8.3)
    step, side, branch = result["streams"]
    assert (branch["stream"], branch["busy_ms"]) == (30, pytest.approx(0.7))
    # the branch ran beside the side stream's kernel for 0.5 ms, with the step's stream idle
    assert branch["alone_ms"] == pytest.approx(0.7)
    assert branch["alone_on_gpu_ms"] == pytest.approx(0.2)
    assert (step["stream"], step["events"], step["busy_ms"]) == (7, 3, pytest.approx(90.0))
    assert "bursts" not in step
    assert (side["stream"], side["events"], side["busy_ms"]) == (20, 5, pytest.approx(4.0))
    # without the step's stream: the kernel and the copy at 35-37 ms, in its gap at 30-40
    # ms; alone on the GPU 0.5 ms less, beside the graph's branch
    assert side["alone_ms"] == pytest.approx(1.5)
    assert side["alone_on_gpu_ms"] == pytest.approx(1.0)
    first, second = side["bursts"]
    assert first == pytest.approx(
        {
            "start_ms": 5.0,
            "events": 3,
            "span_ms": 4.0,
            "busy_ms": 2.5,
            "step_busy_ms": 4.0,
            "alone_ms": 0.0,
            "alone_on_gpu_ms": 0.0,
        }
    )
    assert second == pytest.approx(
        {
            "start_ms": 35.0,
            "events": 2,
            "span_ms": 2.0,
            "busy_ms": 1.5,
            "step_busy_ms": 0.0,
            "alone_ms": 1.5,
            "alone_on_gpu_ms": 1.0,
        }
    )
    # a gap of 0.75 ms cuts the first burst after its first kernel (1 ms), not after its
    # second (0.5 ms)
    spans = [b["span_ms"] for b in summarize(_trace(), gap_ms=0.75)["streams"][1]["bursts"]]
    assert spans == pytest.approx([1.0, 2.0, 2.0])


def test_device_time_by_kind_shares_overlaps_and_adds_up_to_the_window():
    trace = {
        "traceEvents": [
            _kernel(7, 0, 10_000, name="void bwd::wave_bwd<8, true>(bwd::Params)"),
            _kernel(40, 5_000, 15_000, name="nvjet_sm90_hsh_128x256_64x4_2x1_v_bz_coopA_NTN"),
            _kernel(7, 10_000, 12_000, name="elementwise_kernel<direct_copy_kernel_cuda>"),
            _kernel(7, 20_000, 21_000, cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)"),
            _kernel(7, 21_000, 22_000, name="softmax_warp_forward"),
        ]
    }
    kinds = time_by_kind(trace)
    # 0-5 ms the wave alone, 5-10 shared with the GEMM, 10-12 the GEMM beside the copy, 12-15
    # the GEMM alone, 15-20 idle, then a copy and an unnamed kind
    assert kinds == pytest.approx(
        {
            "wave LSTM backward": 7.5,
            "GEMM": 6.5,
            "copies and fills": 2.0,
            "other": 1.0,
            "idle": 5.0,
        }
    )
    assert summarize(trace)["kinds_ms"] == kinds
    assert sum(kinds.values()) == pytest.approx(summarize(trace)["window_ms"])


def test_step_phases_place_each_kind_inside_its_step():
    wave_f, wave_b = "void fwd::wave_t<7, true>(fwd::Params)", "void bwd::wave_bwd<8, true>(p)"
    events = []
    # three steps of 100, 100 and 90 ms: the forward waves in two stacks 5 ms apart (a pause
    # shorter than the step gap), the loss, the backward waves, and the prediction network's
    # cuDNN work, in series in the first step and beside the backward waves after it
    for t0, rnn in [(0, (32_000, 34_000)), (100_000, (55_000, 80_000))]:
        events += [
            _kernel(7, t0, t0 + 10_000, name=wave_f),
            _kernel(7, t0 + 15_000, t0 + 25_000, name=wave_f),
            _kernel(7, t0 + 26_000, t0 + 30_000, name="logits_lse_kernel"),
            _kernel(7, t0 + 50_000, t0 + 90_000, name=wave_b),
            _kernel(9, t0 + rnn[0], t0 + rnn[1], name="elemWiseRNNcell<__half>"),
        ]
    events += [_kernel(7, 200_000, 210_000, name=wave_f), _kernel(7, 280_000, 290_000, name=wave_b)]
    phases = step_phases({"traceEvents": events[::-1]}, "wave LSTM forward", step_gap_ms=20.0)
    assert phases["periods_ms"] == pytest.approx([100.0, 100.0])
    kinds = phases["kinds"]
    assert kinds["wave LSTM forward"] == pytest.approx(
        {"first_ms": 0.0, "last_ms": 25.0, "steps": 3}
    )
    assert kinds["wave LSTM backward"] == pytest.approx(
        {"first_ms": 50.0, "last_ms": 90.0, "steps": 3}
    )
    # medians of the two steps with cuDNN work: 32 and 55 ms, 34 and 80 ms
    assert kinds["cuDNN RNN"] == pytest.approx({"first_ms": 43.5, "last_ms": 57.0, "steps": 2})
    assert kinds["fused loss"]["steps"] == 2
    assert step_phases({"traceEvents": events}, "GEMM", 20.0) is None
    # an event without a name is "other" work, as in the kinds' table, not an error
    unnamed = {"ph": "X", "cat": "kernel", "ts": 1_000.0, "dur": 500.0, "args": {"stream": 7}}
    phases = step_phases({"traceEvents": events + [unnamed]}, "wave LSTM forward", 20.0)
    assert phases["kinds"]["other"] == {"first_ms": 1.0, "last_ms": 1.5, "steps": 1}


def test_overlap_of_interleaved_intervals():
    a = [(0.0, 5.0), (6.0, 10.0)]
    b = [(3.0, 7.0), (9.0, 12.0)]
    # 3-5, 6-7 and 9-10
    assert overlap(a, b) == overlap(b, a) == pytest.approx(4.0)
    assert overlap(a, []) == 0.0
    assert overlap([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0


def test_command_line_reads_a_gzipped_trace(tmp_path, repo_root):
    path = tmp_path / "rank0_steps60-64.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    out = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, str(repo_root / "bench/trace_streams.py"), str(path), "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=repo_root,
    )
    assert done.returncode == 0, done.stderr
    assert "GPU idle 8.3 ms; the step's stream: 7" in done.stdout
    assert (
        "stream 20: 5 events, 4.00 ms busy, 1.50 ms of it without the step's stream, "
        "1.00 ms alone on the GPU"
    ) in done.stdout
    assert "burst at    35.00 ms:    2 events, span   2.00 ms, busy  1.50 ms" in done.stdout
    assert (
        "the step's stream busy   0.00 ms of it, without it  1.50 ms, alone on the GPU  1.00 ms"
    ) in done.stdout
    assert json.loads(out.read_text())["streams"][1]["busy_ms"] == pytest.approx(4.0)
    assert "no 'wave LSTM forward' work to find the steps by: no phases" in done.stdout


def test_a_trace_without_device_work_is_refused():
    cpu_only = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0}]}
    with pytest.raises(ValueError, match="no kernels, copies or memsets"):
        summarize(cpu_only)


@pytest.mark.parametrize(
    "text,message",
    [
        ("{bad", "not a readable Chrome trace"),
        ('{"traceEvents": []}', "no kernels, copies or memsets"),
        ('{"traceEvents": [{"ph": "X", "cat": "kernel", "args": {"stream": 7}}]}', "'ts'"),
    ],
)
def test_bad_traces_are_one_line_naming_the_file(tmp_path, repo_root, text, message):
    path = tmp_path / "trace.json"
    path.write_text(text)
    for target in (path, tmp_path / "missing.json"):
        done = subprocess.run(
            [sys.executable, str(repo_root / "bench/trace_streams.py"), str(target)],
            capture_output=True,
            text=True,
            cwd=repo_root,
        )
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert done.stderr.strip().startswith(f"{target}: ")
        if target == path:
            assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
