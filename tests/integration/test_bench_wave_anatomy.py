"""bench/wave_anatomy.py: each ablated copy of the wave kernels patches the shipped source at one
place per patch and still builds, and on a Hopper GPU the benchmark times every case."""

import pytest

from bench import wave_anatomy
from rnnt.kernels import cuda_build, lstm_wave
from tests.helpers import hopper_bench_results


def test_each_ablation_patches_the_shipped_kernels_once_and_only_once():
    shipped = lstm_wave.SOURCE.read_text()
    for ablation, patches in wave_anatomy.ABLATIONS.items():
        patched = wave_anatomy.ablated_source(shipped, ablation)
        grown = sum(len(new) - len(old) for old, new in patches)
        assert len(patched) - len(shipped) == grown
        for old, new in patches:
            assert old not in patched and patched.count(new) == 1
        with pytest.raises(ValueError, match=f"{ablation!r}: expected one"):
            wave_anatomy.ablated_source(patched, ablation)
    # one patch per kernel: the forward's and the backward's mainloop, and their epilogues
    assert all(len(patches) == 2 for patches in wave_anatomy.ABLATIONS.values())


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc")
def test_every_ablated_copy_builds(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path / "cache"))
    cuda_build.load.cache_clear()
    shipped = lstm_wave.SOURCE
    try:
        for ablation in wave_anatomy.ABLATIONS:
            kernels = wave_anatomy.ablated_kernels(ablation, tmp_path / ablation.replace(" ", "_"))
            assert kernels.lib.wave_lstm_variants(1) == lstm_wave.library().wave_lstm_variants(1)
            assert lstm_wave.SOURCE == shipped
    finally:
        cuda_build.load.cache_clear()


@pytest.mark.gpu
def test_the_benchmark_times_every_case_on_a_hopper_gpu(repo_root, tmp_path):
    out = tmp_path / "anatomy.json"
    results = hopper_bench_results(repo_root, "wave_anatomy.py", out, "--repeats", "2")
    variants = lstm_wave.library().wave_lstm_variants(0)
    assert len(results) == 2 * (variants + 3)
    assert all(r["forward_ms"] > 0 and r["backward_ms"] > 0 for r in results)
    for stack in ("pre", "post"):
        rows = {r["case"]: r for r in results if r["stack"] == stack}
        default = next(r for case, r in rows.items() if case.endswith("(default)"))
        empty = rows["empty cells (active = 0)"]
        assert empty["forward_ms"] < default["forward_ms"]
        assert empty["backward_ms"] < default["backward_ms"]
