"""bench/gpu_session.sh's detached training runs (`converge`, `wait`): runs given one GPU run
one after another, also across calls, runs on different GPUs side by side, and `wait` returns
only once the queued runs have ended too, with their logs in one archive.

The script runs from a copy of this checkout's harness with a stand-in `nvidia-smi` (the GPU
count and memory are all it reads here) and a source tree (`SRC`) whose train.py records
when it ran, on which GPU, with which arguments, so that the schedule itself is what is
checked.
"""

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
case "$*" in
  *--list-gpus*) for i in $(seq 0 $((GPUS - 1))); do echo "GPU $i: stand-in"; done ;;
  *nounits*) for i in $(seq 1 "$GPUS"); do echo 143771; done ;;
  *) for i in $(seq 1 "$GPUS"); do echo "stand-in, 143771 MiB, 0"; done ;;
esac
"""

RECORDING_TRAIN = """import os, sys, time
print("start", time.time(), os.environ["CUDA_VISIBLE_DEVICES"], " ".join(sys.argv[1:]), flush=True)
time.sleep(float(os.environ.get("RUN_S", "1")))
print("end", time.time(), flush=True)
"""


@pytest.fixture
def harness(tmp_path, repo_root):
    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    shutil.copy(Path(repo_root) / "bench" / "gpu_session.sh", root / "bench")
    tree = tmp_path / "tree"
    for folder in ("rnnt", "configs"):
        (tree / folder).mkdir(parents=True)
    (tree / "train.py").write_text(RECORDING_TRAIN)
    (tree / "eval.py").write_text("")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    return root, tree, tools


def _session(harness, phase, gpus, **env):
    root, tree, tools = harness
    full_env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", GPUS=str(gpus), SRC=str(tree))
    full_env.update(env)
    proc = subprocess.run(
        ["bash", "bench/gpu_session.sh", phase],
        cwd=root,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def _spans(root: Path) -> dict[str, tuple[float, float, str, str]]:
    """name -> (start, end, CUDA_VISIBLE_DEVICES, arguments) from each run's log."""
    spans = {}
    for log in (root / "results" / "convergence").glob("*.log"):
        lines = log.read_text().splitlines()
        start = next(line.split(" ", 3) for line in lines if line.startswith("start "))
        end = next(line.split() for line in lines if line.startswith("end "))
        spans[log.stem] = (float(start[1]), float(end[1]), start[2], start[3])
    return spans


needs_two_cores = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or shutil.which("taskset") is None,
    reason="pins runs with taskset to at least one core per stand-in GPU",
)


@needs_two_cores
def test_runs_on_one_gpu_queue_in_order_and_wait_waits_for_the_queue(harness):
    root = harness[0]
    started = _session(harness, "converge", 1, RUNS="fast plain", SEEDS="1 2", RUN_S="1")
    assert "plain_s1: GPUs 0, after the runs before it on them" in started
    waited = _session(harness, "wait", 1)
    assert "all runs ended" in waited
    with tarfile.open(root / "results" / "gpu" / "runs.tar.gz") as archive:
        logs = sorted(Path(name).name for name in archive.getnames() if name.endswith(".log"))
    assert logs == ["fast_s1.log", "fast_s2.log", "plain_s1.log", "plain_s2.log"]
    spans = _spans(root)
    order = sorted(spans, key=lambda name: spans[name][0])
    assert order == ["fast_s1", "plain_s1", "fast_s2", "plain_s2"]
    for before, after in zip(order, order[1:]):
        assert spans[before][1] <= spans[after][0], (before, after, spans)
    assert {spans[name][2] for name in order} == {"0"}
    fast, plain = spans["fast_s1"][3], spans["plain_s1"][3]
    assert fast.startswith("configs/convergence/sentences.yaml --set training.seed=1")
    assert plain.startswith("configs/convergence/sentences_plain.yaml --set training.seed=1")
    assert "--set training.output_dir=results/convergence/plain_s1" in plain


@needs_two_cores
def test_runs_on_two_gpus_run_side_by_side_and_share_gpus_starts_all(harness):
    root = harness[0]
    _session(harness, "converge", 2, RUNS="fast plain", SEEDS="1", RUN_S="2")
    assert "all runs ended" in _session(harness, "wait", 2)
    spans = _spans(root)
    assert spans["fast_s1"][2] == "0" and spans["plain_s1"][2] == "1"
    assert spans["plain_s1"][0] < spans["fast_s1"][1]  # the second began before the first ended

    for log in (root / "results" / "convergence").glob("*.log"):
        log.unlink()
    _session(harness, "converge", 1, RUNS="fast plain", SEEDS="1", RUN_S="2", SHARE_GPUS="1")
    assert "all runs ended" in _session(harness, "wait", 1)
    spans = _spans(root)
    assert spans["fast_s1"][2] == spans["plain_s1"][2] == "0"
    assert spans["plain_s1"][0] < spans["fast_s1"][1]


@needs_two_cores
def test_a_later_call_waits_for_the_runs_of_an_earlier_one_on_its_gpu(harness):
    """Two `converge` calls on one GPU (as `converge` and then `fork` are): the second call's
    run starts only once the first call's has ended, each run holding its GPU's lock."""
    root = harness[0]
    _session(harness, "converge", 1, RUNS="fast", SEEDS="1", RUN_S="2")
    _session(harness, "converge", 1, RUNS="plain", SEEDS="1", RUN_S="1")
    assert "all runs ended" in _session(harness, "wait", 1)
    spans = _spans(root)
    assert spans["fast_s1"][1] <= spans["plain_s1"][0], spans
