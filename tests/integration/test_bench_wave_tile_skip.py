"""bench/wave_tile_skip.py: its per-tile copy of the wave kernels still patches the shipped
forward (one padding test, after the tile index it reads is known), and on a Hopper GPU the
benchmark runs and times every case."""

import importlib.util
import re

import pytest

from rnnt.kernels import lstm_wave
from tests.helpers import hopper_bench_results


@pytest.fixture
def bench(repo_root):
    spec = importlib.util.spec_from_file_location(
        "wave_tile_skip", repo_root / "bench/wave_tile_skip.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_per_tile_copy_changes_only_the_forwards_padding_test(bench):
    shipped = lstm_wave.SOURCE.read_text()
    patched = bench.per_tile_source(shipped)
    assert patched.count(bench.TILE_COUNT) == 1 and bench.BATCH_COUNT not in patched
    assert len(patched) - len(shipped) == len(bench.TILE_COUNT) - len(bench.BATCH_COUNT)
    # inside the forward kernel, the tile index `nb` is declared before the test reads it
    kernel = patched[patched.index("__global__ void __launch_bounds__(THREADS, 1) wave_t(") :]
    declared = re.search(r"const int nb = [^;]+;", kernel)
    assert declared and declared.start() < kernel.index(bench.TILE_COUNT)
    with pytest.raises(ValueError, match="expected one forward padding test"):
        bench.per_tile_source(patched)


@pytest.mark.gpu
def test_the_benchmark_times_every_case_on_a_hopper_gpu(repo_root, tmp_path):
    out = tmp_path / "tiles.json"
    results = hopper_bench_results(repo_root, "wave_tile_skip.py", out, "--repeats", "2")
    assert len(results) == 2 * 7 and all(r["ms"] > 0 for r in results)
    empty = {r["stack"]: r["ms"] for r in results if r["case"] == "both empty"}
    full = {r["stack"]: r["ms"] for r in results if r["case"] == "both tiles full"}
    assert all(empty[s] < full[s] for s in full)
