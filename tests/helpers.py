"""Helpers that several test modules share (fixtures live in tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rnnt.config import ModelConfig


def tiny_overrides(corpus: dict, out: Path, *extra: str) -> list[str]:
    """Overrides that point configs/tiny.yaml at the digits corpus (tests/conftest.py) with a
    model small enough for a CPU test: one epoch of 6 steps at batch 8, logged at every step,
    written into `out`. `extra` come last, so they win."""
    root = corpus["root"]
    return [
        f"data.dataset_dir={root}",
        f"data.train_manifests=[{root / 'train.jsonl'}]",
        f"data.val_manifests=[{root / 'dev.jsonl'}]",
        f"data.tokenizer={corpus['tokenizer']}",
        "data.backend=torch",
        "data.num_threads=0",
        "data.num_buckets=1",
        "model.n_classes=21",
        "model.enc_n_hid=32",
        "model.pred_n_hid=16",
        "model.joint_n_hid=32",
        "training.batch_size=8",
        "training.epochs=1",
        "training.log_frequency=1",
        f"training.output_dir={out}",
        "eval.batch_size=6",
        *extra,
    ]


def as_set_args(overrides: list[str]) -> list[str]:
    """`--set` arguments of a command line, one per override."""
    return [arg for value in overrides for arg in ("--set", value)]


def train_command(
    nproc: int, *args: str, device: str = "cpu", torchrun: tuple[str, ...] = ()
) -> list[str]:
    """`train.py configs/tiny.yaml ARGS` as one process, or under torchrun with `nproc`
    processes (`torchrun`: its own extra flags); run from the repository root."""
    script = ["train.py", "configs/tiny.yaml", "--device", device, *args]
    if nproc == 1:
        return [sys.executable, *script]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, "--nproc_per_node", str(nproc), *torchrun, *script]


def tiny_cfg(**kw) -> ModelConfig:
    """A small RNN-T config, two layers in every stack: fast on the CPU."""
    base = dict(
        n_classes=12,
        in_feats=16,
        enc_n_hid=24,
        enc_pre_rnn_layers=2,
        enc_post_rnn_layers=2,
        pred_n_hid=8,
        pred_rnn_layers=2,
        joint_n_hid=20,
    )
    base.update(kw)
    return ModelConfig(**base)


def make_case(lens, u_max, hid, vocab, dtype=torch.float32, seed=0, device=None):
    """Random joint inputs (f, g, W, bias as leaves needing gradients; f_lens, targets,
    target_lens) for utterances of (T_b, U_b) = lens, the padding filled with garbage. The
    device defaults to CUDA where there is one."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    t_max = max(t for t, _ in lens)
    f = torch.randn(bsz, t_max, hid, generator=gen)
    g = torch.randn(bsz, u_max + 1, hid, generator=gen)
    weight = torch.randn(vocab, hid, generator=gen) / hid**0.5 * 3
    bias = torch.randn(vocab, generator=gen)
    targets = torch.randint(0, vocab - 1, (bsz, u_max), generator=gen)
    for b, (t_len, u_len) in enumerate(lens):
        f[b, t_len:] = 1e3  # garbage past the lengths must not leak into the loss
        g[b, u_len + 1 :] = -1e3
        targets[b, u_len:] = 10**6
    f_lens = torch.tensor([t for t, _ in lens])
    target_lens = torch.tensor([u for _, u in lens])
    leaves = [x.to(device, dtype).requires_grad_(True) for x in (f, g, weight, bias)]
    return leaves, f_lens.to(device), targets.to(device), target_lens.to(device)


def diagonal_major(skew_blank, skew_label, lp_blank, lp_label, lens, layout):
    """Writes (B, T, U+1) transition log-probabilities where the lattice walk reads them: each
    at the diagonal-major cell its move enters (joint_loss_kernels._diagonals)."""
    # imported here: the modules that need no kernels import this one without Triton
    from rnnt.kernels.joint_loss_kernels import SKEW_ALIGN

    align = SKEW_ALIGN.value
    t_max, u1 = lp_blank.shape[1:]
    dev = skew_blank.device
    for b, (t_len, u_len) in enumerate(lens):
        if layout.packed:
            first, width = layout.skew_starts[b], (u_len + align) // align * align
        else:
            width = (u1 + align - 1) // align * align
            first = b * (t_max + u1) * width
        t = torch.arange(t_len, device=dev)[:, None]
        u = torch.arange(u_len + 1, device=dev)[None, :]
        cell = first + (t + 1 + u) * width + u  # (t + 1, u); (t, u + 1) is cell + 1
        skew_blank[cell] = lp_blank[b, :t_len, : u_len + 1]
        skew_label[cell[:, :u_len] + 1] = lp_label[b, :t_len, :u_len]


def hopper_bench_results(repo_root: Path, script: str, out: Path, *args: str) -> list[dict]:
    """The "results" that bench/`script` writes to `out` (--json) on a Hopper GPU, run with
    `args`; skips the calling test where the wave kernels cannot run."""
    from rnnt.kernels import lstm_wave

    if not torch.cuda.is_available() or lstm_wave.unsupported(torch.device("cuda"), 1024, 3):
        pytest.skip("needs a Hopper GPU")
    done = subprocess.run(
        [sys.executable, f"bench/{script}", *args, "--json", str(out)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())["results"]
