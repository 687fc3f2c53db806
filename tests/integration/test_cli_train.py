"""train.py as a user meets it: each mistake ends in one `error:` line that names the file,
line or key, with exit status 2 and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rnnt.cli.train import main

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


def train(capsys, *argv) -> tuple[int, str]:
    """Exit status and the last line on stderr of `train.py configs/tiny.yaml ARGV`."""
    status = main([str(TINY), *map(str, argv)])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    return status, lines[-1] if lines else ""


def one_line_error(capsys, *argv) -> str:
    status, last = train(capsys, *argv)
    assert status == 2 and last.startswith("error: "), last
    return last


def test_unknown_data_device_names_the_key(capsys, tiny_sets, tmp_path):
    line = one_line_error(capsys, *tiny_sets(tmp_path / "out", "data.device=tpu"))
    assert line == "error: data.device = 'tpu': expected cpu or gpu"


def test_misspelled_backend_in_the_file_names_the_key(capsys, tiny_sets, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(f"base: {TINY}\ndata:\n  backend: dalii\n")
    sets = tiny_sets(tmp_path / "out")
    at = sets.index("data.backend=torch")
    del sets[at - 1 : at + 1]  # the file's value stands
    status = main([str(config), *sets])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert err[0] == "error: data.backend = 'dalii': expected one of auto, dali, torch or synthetic"


def test_missing_manifest(capsys, tiny_sets, tmp_path):
    missing = tmp_path / "nope.jsonl"
    line = one_line_error(capsys, *tiny_sets(tmp_path / "out", f"data.train_manifests=[{missing}]"))
    assert line == f"error: {missing}: manifest not found"


def test_bad_json_names_the_line(capsys, tiny_sets, tmp_path, corpus):
    manifest = tmp_path / "train.jsonl"
    good = (corpus["root"] / "train.jsonl").read_text().splitlines()
    manifest.write_text("\n".join([good[0], '{"utt_id": "x", "audio": ', *good[1:]]) + "\n")
    line = one_line_error(
        capsys, *tiny_sets(tmp_path / "out", f"data.train_manifests=[{manifest}]")
    )
    assert line.startswith(f"error: {manifest}:2: not valid JSON")


def test_missing_tokenizer(capsys, tiny_sets, tmp_path):
    line = one_line_error(
        capsys, *tiny_sets(tmp_path / "out", f"data.tokenizer={tmp_path}/t.model")
    )
    assert line == f"error: tokenizer model not found: {tmp_path}/t.model"


def test_tokenizer_that_does_not_fit_the_model(capsys, tiny_sets, tmp_path):
    line = one_line_error(capsys, *tiny_sets(tmp_path / "out", "model.n_classes=25"))
    assert "model.n_classes=25 but tokenizer" in line and "has 20 pieces" in line


def test_output_dir_that_is_a_file(capsys, tiny_sets, tmp_path):
    out = tmp_path / "out"
    out.write_text("")
    line = one_line_error(capsys, *tiny_sets(out))
    assert line == f"error: training.output_dir {out}: exists and is not a directory"


def test_output_dir_that_cannot_be_created(capsys, tiny_sets, tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    line = one_line_error(capsys, *tiny_sets(out))
    assert line == f"error: training.output_dir {out}: cannot be created (Not a directory)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it(capsys, tiny_sets, tmp_path):
    line = one_line_error(capsys, "--device", "cuda", *tiny_sets(tmp_path / "out"))
    assert line == "error: --device cuda: this machine has no CUDA device (use --device cpu)"
