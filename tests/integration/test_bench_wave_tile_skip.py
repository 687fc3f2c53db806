"""bench/wave_tile_skip.py: its per-tile copy of the wave kernels still patches the shipped
forward (one padding test, after the tile index it reads is known), and on a Hopper GPU the
benchmark runs and times every case."""

import re

import pytest

from bench import wave_tile_skip as skip
from rnnt.kernels import lstm_wave
from tests.helpers import hopper_bench_results


def test_the_per_tile_copy_changes_only_the_forwards_padding_test():
    shipped = lstm_wave.SOURCE.read_text()
    patched = skip.per_tile_source(shipped)
    assert patched.count(skip.TILE_COUNT) == 1 and skip.BATCH_COUNT not in patched
    assert len(patched) - len(shipped) == len(skip.TILE_COUNT) - len(skip.BATCH_COUNT)
    # inside the forward kernel, the tile index `nb` is declared before the test reads it
    kernel = patched[patched.index("__global__ void __launch_bounds__(THREADS, 1) wave_t(") :]
    declared = re.search(r"const int nb = [^;]+;", kernel)
    assert declared and declared.start() < kernel.index(skip.TILE_COUNT)
    with pytest.raises(ValueError, match="expected one forward padding test"):
        skip.per_tile_source(patched)


@pytest.mark.gpu
def test_the_benchmark_times_every_case_on_a_hopper_gpu(repo_root, tmp_path):
    out = tmp_path / "tiles.json"
    results = hopper_bench_results(repo_root, "wave_tile_skip.py", out, "--repeats", "2")
    assert len(results) == 2 * 7 and all(r["ms"] > 0 for r in results)
    empty = {r["stack"]: r["ms"] for r in results if r["case"] == "both empty"}
    full = {r["stack"]: r["ms"] for r in results if r["case"] == "both tiles full"}
    assert all(empty[s] < full[s] for s in full)
