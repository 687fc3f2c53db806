"""The programs of rnnt.cli: every flag of train.py and eval.py says what it does, and `--help`
answers without importing torch (a cold torch import takes seconds)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rnnt.cli import eval as eval_cli
from rnnt.cli import train as train_cli

PROGRAMS = [
    "train",
    "eval",
    "build_manifest",
    "validate_dataset",
    "train_tokenizer",
    "make_synthetic_corpus",
]


@pytest.mark.parametrize("program", [train_cli, eval_cli])
def test_every_flag_has_help(program):
    parser = program.build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{action.option_strings or action.dest}"


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_answers_without_importing_torch(program, repo_root):
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['{program}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('rnnt.cli.{program}', run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0, done.code\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=repo_root, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and proc.stdout.strip().endswith("torch not imported")
