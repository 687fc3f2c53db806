"""The output folder: usable before the run starts, and never shared by two runs."""

from __future__ import annotations

import pytest

from rnnt.run_dir import OutputDirError, prepare_output_dir


def test_a_new_folder_is_made_with_its_parents(tmp_path):
    out = prepare_output_dir(tmp_path / "a" / "b")
    assert out.is_dir()
    assert prepare_output_dir(out) == out  # and an existing empty one is fine


def test_a_file_or_an_impossible_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputDirError, match=r"file: exists and is not a directory$"):
        prepare_output_dir(tmp_path / "file")
    with pytest.raises(OutputDirError, match=r"file/out: cannot be created \(Not a directory\)$"):
        prepare_output_dir(tmp_path / "file" / "out")


def test_a_fresh_run_where_another_left_checkpoints_is_refused(tmp_path):
    for name in ("ckpt_e1_s6", "ckpt_e2_s12"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    with pytest.raises(OutputDirError) as info:
        prepare_output_dir(tmp_path)
    assert str(info.value) == (
        f"training.output_dir {tmp_path} holds 2 checkpoint(s) of an earlier run (newest "
        "ckpt_e2_s12): continue it with --resume, train into another training.output_dir, "
        "or pass --overwrite to delete them"
    )
    prepare_output_dir(tmp_path, resume=True)  # continuing it is what they are for
    prepare_output_dir(tmp_path, overwrite=True, is_main=False)  # only the main rank deletes
    assert (tmp_path / "checkpoints" / "ckpt_e2_s12").is_dir()
    prepare_output_dir(tmp_path, overwrite=True)
    assert not (tmp_path / "checkpoints").exists()
    prepare_output_dir(tmp_path)  # now a fresh run may start


def test_other_files_do_not_count_as_a_run(tmp_path):
    (tmp_path / "checkpoints" / "notes").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("")
    assert prepare_output_dir(tmp_path) == tmp_path
