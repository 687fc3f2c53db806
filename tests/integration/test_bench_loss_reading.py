"""bench/loss_reading.py: the Trainer's loss with two backends on the same batches (a CPU run
on the tiny corpus; the fused backend under Triton's interpreter)."""

import json
import sys

import pytest

from tests.helpers import as_set_args, tiny_overrides


def test_the_fused_and_the_reference_loss_read_the_same_in_float32(corpus, tmp_path, repo_root):
    sys.path.insert(0, str(repo_root / "bench"))
    from loss_reading import main

    sets = tiny_overrides(corpus, tmp_path / "run", "training.precision=fp32")
    out = tmp_path / "readings.json"
    args = [str(repo_root / "configs/tiny.yaml"), "--device", "cpu", "--batches", "2"]
    assert main([*args, *as_set_args(sets), "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    assert found["chosen"]["reference"] == "reference"
    assert found["chosen"]["fused"].startswith("fused")  # two implementations, not one twice
    reference, fused = found["readings"]["reference"], found["readings"]["fused"]
    assert len(reference) == len(fused) == 2 and all(v > 0 for v in reference)
    # one function, two implementations: float32 agrees to far below the 0.1% that matters
    assert all(abs(r) < 1e-4 for r in found["relative"]), found["relative"]
    assert reference[0] != reference[1]  # two batches, not one twice


def test_one_backend_named_twice_is_refused(repo_root, capsys):
    sys.path.insert(0, str(repo_root / "bench"))
    from loss_reading import main

    with pytest.raises(SystemExit):
        main(["configs/tiny.yaml", "--device", "cpu", "--backends", "fused", "fused"])
    assert "name two different backends" in capsys.readouterr().err
