import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import as_set_args, tiny_overrides

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


def build_digits_corpus(root: Path) -> dict:
    """A spoken-digits corpus of 48 training and 12 dev utterances (espeak-ng), with manifests
    carrying token ids of a 20-piece tokenizer: the real data path at CPU-test size."""
    from rnnt.data.tokenizer import Tokenizer, train_tokenizer
    from rnnt.prep.manifests import build_manifest, tokenize, write_manifest
    from rnnt.prep.synthetic_corpus import build_corpus

    build_corpus(root, "digits", train=48, dev=12, seed=3, workers=2, progress=False)
    train, _ = build_manifest(root, ["train"], max_duration=16.7)
    dev, _ = build_manifest(root, ["dev"])
    model = train_tokenizer([u.transcript for u in train], root / "tok", 20)
    tok = Tokenizer(model)
    for name, utts in (("train", train), ("dev", dev)):
        tokenized, report = tokenize(utts, tok, [u.utt_id for u in utts])
        assert not report.problems, report.summary()
        write_manifest(root / f"{name}.jsonl", tokenized)
    return {"root": root, "tokenizer": model}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """The digits corpus, built here (needs espeak-ng), or the one $RNNT_TEST_CORPUS names (a
    copy built elsewhere, for the GPU machine, which has no espeak-ng)."""
    import shutil

    prebuilt = os.environ.get("RNNT_TEST_CORPUS")
    if prebuilt:
        return {
            "root": Path(prebuilt).resolve(),
            "tokenizer": Path(prebuilt).resolve() / "tok.model",
        }
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/install.sh installs it)")
    return build_digits_corpus(tmp_path_factory.mktemp("digits"))


@pytest.fixture
def tiny_sets(corpus):
    """tiny_sets(out, *extra): `--set` arguments that point configs/tiny.yaml at the digits
    corpus with a model small enough for a CPU test (one epoch of 6 steps at batch 8), writing
    into `out`; `extra` overrides come last."""

    def sets(out: Path, *extra: str) -> list[str]:
        return as_set_args(tiny_overrides(corpus, out, *extra))

    return sets
