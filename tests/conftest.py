import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Two CPU cores in CI: one intra-op thread per test process keeps timings predictable.
torch.set_num_threads(int(os.environ.get("RNNT_TEST_THREADS", "1")))
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under its interpreter. It must be chosen before Triton
    # is first imported: its own library functions (tl.cdiv, ...) are decorated then, and a
    # compiled one cannot be called from an interpreted kernel.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def lengths_dir() -> Path:
    """The LibriSpeech utterance-length tables shipped with the package."""
    from rnnt.config import LENGTHS_DIR

    return LENGTHS_DIR
