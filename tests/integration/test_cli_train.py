"""train.py as a user meets it: each mistake ends in one `error:` line that names the file,
line or key, with exit status 2 and no traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bench.trace_streams import summarize
from rnnt.cli.train import main
from rnnt.run_log import METRICS_FILE, read_metrics

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


def test_too_many_buckets_for_the_training_set_is_one_line(capsys, tiny_sets, tmp_path):
    line = one_line_error(capsys, *tiny_sets(tmp_path / "out", "data.num_buckets=40"))
    assert line.startswith("error: data.num_buckets 40: 48 utterances leave a bucket of 1,")
    assert line.endswith(
        "fewer than one global batch of 8 (training.batch_size x "
        "grad_accumulation x ranks): use fewer buckets"
    )


def test_unknown_data_device_names_the_key(capsys, tiny_sets, tmp_path):
    line = one_line_error(capsys, *tiny_sets(tmp_path / "out", "data.device=tpu"))
    assert line == (
        "error: override 'data.device=tpu': data.device: expected one of 'cpu', 'gpu', got 'tpu'"
    )


def test_misspelled_backend_in_the_file_names_the_key(capsys, tiny_sets, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(f"base: {TINY}\ndata:\n  backend: dalii\n")
    sets = tiny_sets(tmp_path / "out")
    at = sets.index("data.backend=torch")
    del sets[at - 1 : at + 1]  # the file's value stands
    status = main([str(config), *sets])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert err[0] == (
        f"error: {config}: data.backend: expected one of 'auto', 'dali', 'torch', 'synthetic', "
        "got 'dalii'"
    )


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


def test_a_negative_duration_names_the_line(capsys, tiny_sets, tmp_path, corpus):
    manifest = tmp_path / "train.jsonl"
    lines = (corpus["root"] / "train.jsonl").read_text().splitlines()
    entry = json.loads(lines[2])
    lines[2] = json.dumps({**entry, "duration": -1.5})
    manifest.write_text("\n".join(lines) + "\n")
    line = one_line_error(
        capsys, *tiny_sets(tmp_path / "out", f"data.train_manifests=[{manifest}]")
    )
    assert line.startswith(f"error: {manifest}:3: field 'duration' must be positive, got -1.5")


def test_resume_and_overwrite_together_are_refused(capsys, tiny_sets, tmp_path):
    with pytest.raises(SystemExit) as info:
        main([str(TINY), "--resume", "--overwrite", *tiny_sets(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: argument --overwrite: not allowed with argument --resume")


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


def with_lines(corpus: dict, out: Path, name: str, *records: dict) -> Path:
    """A copy of the corpus manifest `name` with `records` appended."""
    manifest = out / f"{name}.jsonl"
    lines = (corpus["root"] / f"{name}.jsonl").read_text().splitlines()
    manifest.write_text("\n".join([*lines, *map(json.dumps, records)]) + "\n")
    return manifest


def test_preflight_lists_every_bad_utterance_before_training(capsys, tiny_sets, tmp_path, corpus):
    first = json.loads((corpus["root"] / "train.jsonl").read_text().splitlines()[0])
    os.symlink("/etc/passwd", corpus["root"] / "passwd.flac")
    try:
        train_manifest = with_lines(
            corpus,
            tmp_path,
            "train",
            {**first, "utt_id": "gone", "audio": "train/gone.flac"},
            {**first, "utt_id": "big", "tokens": [3, 999, 4]},
            {**first, "utt_id": "passwd", "audio": "passwd.flac"},
        )
        dev = json.loads((corpus["root"] / "dev.jsonl").read_text().splitlines()[0])
        dev_manifest = with_lines(
            corpus, tmp_path, "dev", {**dev, "utt_id": "x", "audio": "x.flac"}
        )
        status = main(
            [
                str(TINY),
                *tiny_sets(
                    tmp_path / "out",
                    f"data.train_manifests=[{train_manifest}]",
                    f"data.val_manifests=[{dev_manifest}]",
                ),
            ]
        )
    finally:
        (corpus["root"] / "passwd.flac").unlink()
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    root = corpus["root"]
    assert status == 2 and "Traceback" not in captured.err
    assert lines[0] == (
        f"error: {train_manifest}:49: utterance gone: audio file not found: {root}/train/gone.flac"
    )
    assert lines[1].startswith(f"{train_manifest}:50: utterance big: token id 999 is outside")
    assert lines[2] == (
        f"{train_manifest}:51: utterance passwd: {root}/passwd.flac resolves to /etc/passwd, "
        f"outside the dataset root {root}"
    )
    assert lines[3].startswith(f"{dev_manifest}:13: utterance x: audio file not found")
    assert lines[4].startswith("preflight: 4 problems (2 audio file not found, 1 audio outside")
    assert "epoch 1 step" not in captured.out  # not one training step


@pytest.fixture
def garbage(corpus):
    """An audio file inside the corpus that passes the preflight (a non-empty file) but does
    not decode, as a file corrupted after validation would."""
    path = corpus["root"] / "garbage.flac"
    path.write_bytes(b"fLaC" + bytes(range(256)) * 8)
    yield path
    path.unlink()


def corrupted_train_manifest(corpus: dict, out: Path, garbage: Path) -> Path:
    """The train manifest with its 5th utterance's audio replaced by `garbage`."""
    records = [json.loads(r) for r in (corpus["root"] / "train.jsonl").read_text().splitlines()]
    records[4]["audio"] = garbage.name
    manifest = out / "train.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    return manifest


def test_an_unreadable_utterance_in_training_stops_in_one_line(
    capsys, tiny_sets, tmp_path, corpus, garbage
):
    manifest = corrupted_train_manifest(corpus, tmp_path, garbage)
    line = one_line_error(
        capsys, *tiny_sets(tmp_path / "out", f"data.train_manifests=[{manifest}]")
    )
    assert line.startswith(f"error: {garbage}: cannot decode audio (")


def test_skip_bad_trains_on_the_rest_and_counts(
    capsys, caplog, tiny_sets, tmp_path, corpus, garbage
):
    """Bad utterances the preflight finds are excluded before training; one that cannot be
    decoded is dropped from its batch when it comes, and counted."""
    first = json.loads((corpus["root"] / "train.jsonl").read_text().splitlines()[0])
    manifest = with_lines(
        corpus,
        tmp_path,
        "train",
        {**first, "utt_id": "gone", "audio": "train/gone.flac"},
        {**first, "utt_id": "big", "tokens": [3, 999, 4]},
    )
    lines = manifest.read_text().splitlines(True)
    lines[4] = json.dumps({**json.loads(lines[4]), "audio": garbage.name}) + "\n"
    manifest.write_text("".join(lines))
    dev = tmp_path / "dev.jsonl"  # two utterances: the evaluation is not what is tested
    dev.write_text("".join((corpus["root"] / "dev.jsonl").read_text().splitlines(True)[:2]))
    sets = tiny_sets(
        tmp_path / "out",
        f"data.train_manifests=[{manifest}]",
        f"data.val_manifests=[{dev}]",
        "data.skip_bad=true",
    )
    status = main([str(TINY), *sets])
    captured = capsys.readouterr()
    assert status == 1  # trained, the target not reached
    assert (
        "(48 train, 2 dev kept); 2 excluded by data.skip_bad: 1 audio file not found, "
        "1 token id outside the model's classes" in captured.out
    )
    assert f"excluded: {manifest}:49: utterance gone" in captured.out
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"{garbage}: cannot decode audio (")
    assert warning.endswith("; dropped from its batch (data.skip_bad)")
    assert "epoch 1 step 6 " in captured.out
    last = [r for r in read_metrics(tmp_path / "out" / METRICS_FILE) if r["kind"] == "train"][-1]
    assert last["step"] == 6 and last["dropped_utterances"] == 1
    # the torch loader's parts of the data wait reach the line and the record
    assert "| data wait " in captured.out and "% (workers " in captured.out
    parts = ("data_wait_workers_share", "data_wait_queueing_share", "data_wait_stage_share")
    assert all(0 <= last[key] <= last["data_wait_share"] + 1e-9 for key in parts)


def test_a_run_without_target_runs_every_epoch_and_exits_0(capsys, tiny_sets, tmp_path, corpus):
    """training.target_wer: 0 is no target: both epochs are evaluated, the exit status says the
    run finished (torchrun reports any other as a failed child), the MLPerf run_stop says it
    did not reach a target."""
    dev = tmp_path / "dev.jsonl"  # two utterances: the WER's value is not what is tested
    dev.write_text("".join((corpus["root"] / "dev.jsonl").read_text().splitlines(True)[:2]))
    out = tmp_path / "out"
    sets = tiny_sets(
        out, f"data.val_manifests=[{dev}]", "training.epochs=2", "training.target_wer=0"
    )
    status = main([str(TINY), *sets])
    assert status == 0
    assert "no target (training.target_wer: 0), every epoch run" in capsys.readouterr().out
    evals = [r["epoch"] for r in read_metrics(out / METRICS_FILE) if r["kind"] == "eval"]
    assert evals == [1, 2]
    stops = [
        json.loads(line.split(":::MLLOG", 1)[1])
        for line in (out / "mlperf.log").open()
        if '"run_stop"' in line
    ]
    assert [s["metadata"]["status"] for s in stops] == ["aborted"]


def test_runs_never_mix_in_one_output_dir(capsys, tiny_sets, tmp_path, corpus):
    out = tmp_path / "out"
    (out / "checkpoints" / "ckpt_e3_s30").mkdir(parents=True)  # an earlier run's
    dev = tmp_path / "dev.jsonl"  # two utterances: the evaluation is not what is tested
    dev.write_text("".join((corpus["root"] / "dev.jsonl").read_text().splitlines(True)[:2]))
    sets = tiny_sets(out, f"data.val_manifests=[{dev}]", "training.seed=null")
    assert one_line_error(capsys, *sets) == (
        f"error: training.output_dir {out} holds 1 checkpoint(s) of an earlier run (newest "
        "ckpt_e3_s30): continue it with --resume, train into another training.output_dir, or "
        "pass --overwrite to delete them"
    )
    assert main([str(TINY), "--overwrite", *sets]) == 1  # trained: the target not reached
    printed = capsys.readouterr().out
    (run,) = [r for r in read_metrics(out / METRICS_FILE) if r["kind"] == "run"]
    assert f"run {run['run_id']} (fresh): seed {run['seed']} (drawn), 1 rank(s)" in printed
    assert f"run {run['run_id']}: target NOT reached" in printed
    (checkpoint,) = (out / "checkpoints").iterdir()  # the earlier run's is gone
    meta = json.loads((checkpoint / "complete.json").read_text())["meta"]
    assert (meta["run_id"], meta["seed"]) == (run["run_id"], run["seed"])
    mlperf = (out / "mlperf.log").read_text()
    assert f'"key": "seed", "value": {run["seed"]},' in mlperf

    assert main([str(TINY), "--resume", *sets]) == 1
    again = [r for r in read_metrics(out / METRICS_FILE) if r["kind"] == "run"]
    assert [(r["run_id"], r["seed"], r["seed_source"], r["resumed"]) for r in again] == [
        (run["run_id"], run["seed"], "drawn", False),
        (run["run_id"], run["seed"], "the checkpoint", True),
    ]


def test_a_run_starts_from_another_runs_checkpoint(capsys, tiny_sets, tmp_path, corpus):
    """--init-from: the new run begins at the checkpoint's epoch and step with its weights,
    keeps its own id and seed, and leaves the first run's folder as it was."""
    dev = tmp_path / "dev.jsonl"  # two utterances: the WER's value is not what is tested
    dev.write_text("".join((corpus["root"] / "dev.jsonl").read_text().splitlines(True)[:2]))
    first, second = tmp_path / "first", tmp_path / "second"
    common = (f"data.val_manifests=[{dev}]", "training.target_wer=0")
    sets = tiny_sets(first, *common, "training.epochs=1", "training.seed=3")
    assert main([str(TINY), *sets]) == 0
    (start,) = (first / "checkpoints").iterdir()
    before = sorted(p.name for p in first.rglob("*"))
    capsys.readouterr()

    sets = tiny_sets(second, *common, "training.epochs=2", "training.seed=4")
    assert main([str(TINY), "--init-from", str(start), *sets]) == 0
    printed = capsys.readouterr().out
    first_run = [r for r in read_metrics(first / METRICS_FILE) if r["kind"] == "run"][0]
    (run,) = [r for r in read_metrics(second / METRICS_FILE) if r["kind"] == "run"]
    assert run["run_id"] != first_run["run_id"] and run["seed"] == 4
    assert (
        f"started from {start} (run {first_run['run_id']}) after its step 6, in epoch 2" in printed
    )
    steps = [r["step"] for r in read_metrics(second / METRICS_FILE) if r["kind"] == "train"]
    assert steps and min(steps) > 6 and max(steps) == 12  # epoch 2 only
    assert [r["epoch"] for r in read_metrics(second / METRICS_FILE) if r["kind"] == "eval"] == [2]
    assert sorted(p.name for p in first.rglob("*")) == before

    # a checkpoint of another model: one line naming it and the first mismatch
    other = tiny_sets(tmp_path / "other", *common, "model.pred_n_hid=24")
    line = one_line_error(capsys, "--init-from", str(start), *other)
    assert line.startswith(f"error: {start}: its weights do not fit this config's model (size ")

    # with nothing left to train, the saved state is the checkpoint's own weights
    third = tmp_path / "third"
    sets = tiny_sets(third, *common, "training.epochs=1", "training.seed=5")
    assert main([str(TINY), "--init-from", str(start), *sets]) == 0
    (saved,) = (third / "checkpoints").iterdir()
    ours = torch.load(saved / "model.pt", weights_only=True)["model"]
    theirs = torch.load(start / "model.pt", weights_only=True)["model"]
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_init_from_is_checked_before_training(capsys, tiny_sets, tmp_path):
    out = tmp_path / "out"
    nowhere = tmp_path / "ckpt_e1_s6"
    nowhere.mkdir()
    assert one_line_error(capsys, "--init-from", nowhere, *tiny_sets(out)) == (
        f"error: {nowhere} is not a complete checkpoint (no complete.json)"
    )
    assert one_line_error(capsys, "--init-from", nowhere, "--resume", *tiny_sets(out)) == (
        "error: --init-from starts a fresh run; --resume continues one: pass one"
    )
    inside = out / "checkpoints" / "ckpt_e1_s6"
    inside.mkdir(parents=True)
    (inside / "complete.json").write_text('{"files": {}}')
    assert one_line_error(capsys, "--init-from", inside, *tiny_sets(out)) == (
        f"error: --init-from {inside}: lies inside training.output_dir {out}; start the new run "
        "in another training.output_dir"
    )


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
def test_steps_are_profiled_where_asked(capsys, tiny_sets, tmp_path, corpus, device):
    """training.profile_from_step: a Chrome trace and an operator table of those steps of the
    real loop, the loader's work included; on a GPU, its kernels by device time."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = tmp_path / "dev.jsonl"  # two utterances: the evaluation is not what is tested
    dev.write_text("".join((corpus["root"] / "dev.jsonl").read_text().splitlines(True)[:2]))
    out = tmp_path / "out"
    sets = tiny_sets(
        out,
        f"data.val_manifests=[{dev}]",
        f"data.device={'gpu' if device == 'cuda' else 'cpu'}",
        "training.target_wer=0",
        "training.profile_from_step=2",
        "training.profile_steps=3",
    )
    assert main([str(TINY), "--device", device, *sets]) == 0
    stem = out / "profile" / "rank0_steps2-4"
    assert f"profiled steps 2-4: {stem}.json, by time in {stem}.txt" in capsys.readouterr().out
    events = json.loads(stem.with_suffix(".json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert "aten::lstm" in names  # the model's steps
    assert any(n.startswith("aten::stft") or n.startswith("aten::fft") for n in names)  # features
    table = stem.with_suffix(".txt").read_text()
    assert "aten::lstm" in table
    if device == "cuda":
        assert "CUDA total" in table
        assert any(e.get("cat") == "kernel" for e in events)


@pytest.mark.gpu
def test_a_gpu_window_without_the_host_records_only_device_work(
    capsys, tiny_sets, tmp_path, corpus
):
    """training.profile_host=false on a GPU: the trace holds the steps' kernels and no host
    operator, and bench/trace_streams.py reads it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join((corpus["root"] / "dev.jsonl").read_text().splitlines(True)[:2]))
    out = tmp_path / "out"
    sets = tiny_sets(
        out,
        f"data.val_manifests=[{dev}]",
        "data.device=gpu",
        "training.target_wer=0",
        "training.profile_from_step=2",
        "training.profile_steps=2",
        "training.profile_host=false",
    )
    assert main([str(TINY), "--device", "cuda", *sets]) == 0
    trace = json.loads((out / "profile" / "rank0_steps2-3.json").read_text())
    categories = {e.get("cat") for e in trace["traceEvents"]}
    assert "kernel" in categories and "cpu_op" not in categories
    summary = summarize(trace)
    assert summary["window_ms"] > 0 and summary["streams"][0]["busy_ms"] > 0


def test_a_profile_window_needs_steps(capsys, tiny_sets, tmp_path):
    line = one_line_error(capsys, *tiny_sets(tmp_path / "out", "training.profile_steps=0"))
    assert line.endswith(": training.profile_steps: must be >= 1, got 0")
