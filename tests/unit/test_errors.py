"""User errors end in one line and exit status 2; bugs keep their traceback."""

from __future__ import annotations

import pytest

from rnnt.checkpoint import CheckpointError
from rnnt.config import ConfigError
from rnnt.data.features import AudioFileError
from rnnt.data.manifest import ManifestError
from rnnt.data.tokenizer import TokenizerError
from rnnt.distributed import DeviceError
from rnnt.errors import EXIT_USER_ERROR, UserError, reports_user_errors
from rnnt.prep.synthetic_corpus import CorpusError
from rnnt.prep.validate import DatasetError
from rnnt.run_dir import OutputDirError


@pytest.mark.parametrize(
    "error",
    [
        ConfigError,
        ManifestError,
        TokenizerError,
        DatasetError,
        AudioFileError,
        CheckpointError,
        CorpusError,
        DeviceError,
        OutputDirError,
    ],
)
def test_every_user_error_prints_one_line_and_exits_2(capsys, error):
    @reports_user_errors
    def main(argv):
        raise error(f"{argv[0]}:3: what is wrong there")

    assert main(["m.jsonl"]) == EXIT_USER_ERROR == 2
    captured = capsys.readouterr()
    assert captured.err == "error: m.jsonl:3: what is wrong there\n" and captured.out == ""


def test_a_bug_keeps_its_traceback():
    @reports_user_errors
    def main(argv):
        return [][1]

    with pytest.raises(IndexError):
        main([])


def test_the_status_of_a_clean_run_passes_through():
    assert reports_user_errors(lambda argv: 0)(None) == 0
    assert reports_user_errors(lambda argv: 1)(None) == 1
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, UserError)
