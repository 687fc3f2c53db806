"""eval.py as a user meets it: a checkpoint that is missing, damaged or of another model ends
in one `error:` line naming it, with exit status 2 and no traceback."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from rnnt.checkpoint import COMPLETE
from rnnt.cli.eval import main
from rnnt.config import load_config
from rnnt.data.loader import TorchFeatureLoader
from rnnt.distributed import DistContext
from rnnt.trainer import Trainer

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def checkpoint(tiny_sets, tmp_path) -> tuple[list[str], Path]:
    """The --set arguments of a tiny run and a checkpoint of its untrained state."""
    sets = tiny_sets(tmp_path / "run")
    trainer = Trainer(load_config(TINY, sets[1::2]), CPU)
    return sets, trainer.save()


def evaluate(capsys, *argv) -> tuple[int, list[str]]:
    status = main([str(TINY), *map(str, argv)])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, err.strip().splitlines()


def test_a_checkpoint_scores(capsys, checkpoint):
    sets, path = checkpoint
    status = main([str(TINY), str(path), "--device", "cpu", *sets])
    assert status == 0
    out = capsys.readouterr().out
    assert "WER: " in out
    assert len(path.with_suffix(".hyps.jsonl").read_text().splitlines()) == 12
    # the dev set's time, and the part of it spent waiting for the loader's batches
    (line,) = [x for x in out.splitlines() if x.startswith("throughput:")]
    total, waiting = re.search(r"\(([\d.]+) s, ([\d.]+) s of it waiting for data", line).groups()
    assert 0 < float(waiting) <= float(total)


def test_the_wave_encoder_scores_what_nn_lstm_scores(capsys, checkpoint):
    sets, path = checkpoint
    hyps, lines = {}, {}
    for lstm in ("cudnn", "wave"):
        argv = [
            str(TINY),
            str(path),
            "--device",
            "cpu",
            *sets,
            "--set",
            f"eval.encoder_lstm={lstm}",
        ]
        assert main(argv) == 0
        out = capsys.readouterr().out
        (lines[lstm],) = [x for x in out.splitlines() if x.startswith("backends:")]
        hyps[lstm] = [
            json.loads(x) for x in path.with_suffix(".hyps.jsonl").read_text().splitlines()
        ]
    assert lines["wave"].endswith("encoder_lstm=wave"), lines
    assert lines["cudnn"].endswith("encoder_lstm=cudnn"), lines
    assert len(hyps["wave"]) == 12 and hyps["wave"] == hyps["cudnn"]


def test_the_dev_set_is_read_while_the_checkpoint_loads(capsys, checkpoint, monkeypatch):
    """eval.py's workers start before the checkpoint is opened, so the dev set's time does
    not include their start; the scores are those of a loader started when asked."""
    import rnnt.evaluation as evaluation

    sets, path = checkpoint
    build_eval_data, open_checkpoint = evaluation.build_eval_data, evaluation.open_checkpoint
    loaders = []

    def kept(cfg, ctx):
        loader, checked = build_eval_data(cfg, ctx)
        loaders.append(loader)
        return loader, checked

    def opened_after_the_workers_started(where):
        (loader,) = loaders
        assert isinstance(loader, TorchFeatureLoader) and loader.ahead is not None
        return open_checkpoint(where)

    monkeypatch.setattr(evaluation, "build_eval_data", kept)
    monkeypatch.setattr(evaluation, "open_checkpoint", opened_after_the_workers_started)
    assert main([str(TINY), str(path), "--device", "cpu", *sets]) == 0
    early = path.with_suffix(".hyps.jsonl").read_text()
    monkeypatch.setattr(evaluation, "open_checkpoint", open_checkpoint)
    monkeypatch.setattr(TorchFeatureLoader, "read_ahead", lambda self: None)
    assert main([str(TINY), str(path), "--device", "cpu", *sets]) == 0
    assert path.with_suffix(".hyps.jsonl").read_text() == early
    capsys.readouterr()


def test_missing_checkpoint(capsys, checkpoint, tmp_path):
    sets, _ = checkpoint
    status, err = evaluate(capsys, tmp_path / "ckpt_e9_s9", *sets)
    assert status == 2 and err == [f"error: checkpoint not found: {tmp_path / 'ckpt_e9_s9'}"]


def test_a_checkpoint_whose_save_never_finished(capsys, checkpoint):
    """complete.json is written last: without it the folder is a save cut short."""
    sets, path = checkpoint
    (path / "complete.json").unlink()
    status, err = evaluate(capsys, path, *sets)
    assert status == 2
    assert err == [f"error: {path} is not a complete checkpoint (no complete.json)"]


def test_truncated_checkpoint(capsys, checkpoint):
    sets, path = checkpoint
    model = path / "model.pt"
    size = model.stat().st_size
    model.write_bytes(model.read_bytes()[: size // 2])
    status, err = evaluate(capsys, path, *sets)
    assert status == 2
    assert err == [f"error: {model}: size {size // 2} bytes, but {size} were written"]


def test_truncated_archive_whose_record_was_rewritten(capsys, checkpoint):
    """torch's own 'PytorchStreamReader failed reading zip archive' becomes a one-line error."""
    sets, path = checkpoint
    model = path / "model.pt"
    data = model.read_bytes()[:-100]
    model.write_bytes(data)
    record = json.loads((path / COMPLETE).read_text())
    record["files"]["model"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / COMPLETE).write_text(json.dumps(record))
    status, err = evaluate(capsys, path, *sets)
    assert status == 2 and len(err) == 1
    assert err[0].startswith(f"error: {model}: cannot be read (RuntimeError: PytorchStreamReader")


def test_checkpoint_with_nan_weights(capsys, tiny_sets, tmp_path):
    sets = tiny_sets(tmp_path / "run")
    trainer = Trainer(load_config(TINY, sets[1::2]), CPU)
    trainer.ema.weights[0][5] = float("nan")
    path = trainer.save()
    status, err = evaluate(capsys, path, *sets)
    assert status == 2 and len(err) == 1
    assert re.fullmatch(
        rf"error: {path}/model.pt: ema\.weights\[\d+\] holds NaN or inf values \(not a sound "
        r"state\)",
        err[0],
    )


def test_checkpoint_of_another_model(capsys, checkpoint):
    sets, path = checkpoint
    status, err = evaluate(capsys, path, *sets, "--set", "model.enc_n_hid=48")
    assert status == 2 and err == [
        f"error: {path}: its EMA weights do not fit the model of this config"
    ]


def test_missing_dev_audio_is_found_before_the_checkpoint_loads(
    capsys, checkpoint, tmp_path, corpus
):
    sets, path = checkpoint
    dev = tmp_path / "dev.jsonl"
    record = json.loads((corpus["root"] / "dev.jsonl").read_text().splitlines()[0])
    dev.write_text(json.dumps({**record, "audio": "dev/gone.flac"}) + "\n")
    status, err = evaluate(capsys, tmp_path / "no-checkpoint-here", *sets, "--manifest", dev)
    assert status == 2 and err == [
        f"error: {dev}:1: utterance {record['utt_id']}: audio file not found: "
        f"{corpus['root']}/dev/gone.flac; fix it, or set data.skip_bad=true to exclude such "
        "utterances"
    ]
