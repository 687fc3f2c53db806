"""Training-step throughput of the RNN-T: eager vs per-bucket CUDA graphs (`--num-cg`).

One step = encoder + prediction forward, joint + loss, backward, GradScaler + LAMB (fp32 master
weights), EMA, and the asynchronous copy of the loss and loss scale to the host. Batches are
synthetic with real LibriSpeech shapes (durations and transcripts of a lengths table, speed
perturbation, the real tokenizer's token counts), transformed on the device to model input
before timing, so the input pipeline is not measured.

For each (batch size, num_cg) it reports the median step time (CUDA events), utterances/s,
peak memory, model FLOP utilisation against a fp16 matrix-multiply peak measured in the same
run, and two parts timed on their own: joint + loss (forward and backward), and everything else
(encoder, prediction, their backward, scaler, optimizer, EMA). Prints one table, writes JSON.

    python bench/train_step.py --batch-sizes 16 64 192 --num-cg 0 4 8 --json results/train_step.json
    python bench/train_step.py --device cpu --config configs/tiny.yaml --batch-sizes 4 --steps 2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rnnt.config import Config, ModelConfig, add_override_arg, load_config  # noqa: E402
from rnnt.data.augment import BatchTransform  # noqa: E402
from rnnt.data.batch import FeatureBatch  # noqa: E402
from rnnt.data.synthetic import SyntheticFeatureSource, tokenizer_for_lengths_table  # noqa: E402
from rnnt.graphs import TrainingGraphs, max_spliced_frames  # noqa: E402
from rnnt.loss import TransducerLoss  # noqa: E402
from rnnt.model import RNNT  # noqa: E402
from rnnt.optim.ema import EMA  # noqa: E402
from rnnt.optim.lamb import Lamb  # noqa: E402
from rnnt.sync_free import AsyncScalars  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # x, x_lens, y, y_lens


class StepRunner:
    """The training step under test: fp16 model (fp32 on CPU), LAMB with fp32 masters,
    GradScaler, EMA, optional TrainingGraphs; no host sync anywhere in `step`."""

    def __init__(
        self,
        model: RNNT,
        loss_backend: str,
        batch_size: int,
        max_feat_len: int,
        max_token_len: int,
        num_cg: int,
        lr: float = 1e-3,
        ema_decay: float = 0.99,
        init_loss_scale: float = 512.0,
        fused_gemm: str = "auto",
    ) -> None:
        param = next(model.parameters())
        self.model = model.train()
        self.ema = EMA(model, ema_decay)
        self.optimizer = Lamb(
            model.parameters(),
            lr=lr,
            betas=(0.9, 0.999),
            eps=1e-9,
            weight_decay=1e-3,
            max_grad_norm=1.0,
        )
        self.scaler = torch.amp.GradScaler(
            param.device.type, init_scale=init_loss_scale, enabled=param.dtype == torch.float16
        )
        self.loss_fn = TransducerLoss(loss_backend, model.blank_idx, fused_gemm)
        self.sm90_logits = self.loss_fn.prepare(model.joint)
        self.graphs = None
        if num_cg > 0:
            self.graphs = TrainingGraphs(
                model, batch_size, max_feat_len, max_token_len, num_cg, param.dtype, param.device
            )
        self.scalars = AsyncScalars(["loss", "scale"], param.device)
        # LAMB needs a gradient for every parameter; the joint gets none without the loss
        self._zero_joint_grads = [torch.zeros_like(p) for p in model.joint.parameters()]

    def encode_predict(self, x, x_lens, y) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.graphs is not None:
            f, f_lens = self.graphs.encode(x, x_lens)
            return f, f_lens, self.graphs.predict(y)
        return self.model(x, x_lens, y)

    def update(self) -> None:
        """Scaler, optimizer and EMA: everything after the backward."""
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update(self.optimizer.master_params())

    def host_lens(self, spliced_lens: torch.Tensor | None, y_lens_host: torch.Tensor | None):
        """The loss's host lengths (encoder frames, tokens), as the trainer derives them."""
        if spliced_lens is None:
            return None
        return self.model.encoded_lengths(spliced_lens).tolist(), y_lens_host.tolist()

    def step(self, x, x_lens, y, y_lens, host=(None, None)) -> torch.Tensor:
        f, f_lens, g = self.encode_predict(x, x_lens, y)
        loss = self.loss_fn(
            self.model.joint, f, g, f_lens, y, y_lens, host_lens=self.host_lens(*host)
        )
        self.scaler.scale(loss).backward()
        self.update()
        # the scale stays a device tensor: GradScaler.get_scale() would sync with .item()
        scale = self.scaler._get_scale_async() if self.scaler.is_enabled() else 1.0
        self.scalars.record(loss=loss, scale=scale)
        return loss

    def step_without_joint(self, x, x_lens, y, grads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The step with joint + loss replaced by given output gradients for f and g."""
        f, _, g = self.encode_predict(x, x_lens, y)
        torch.autograd.backward(
            [f, g], [grads[0][: f.shape[0], : f.shape[1]], grads[1][: g.shape[0], : g.shape[1]]]
        )
        for p, zero in zip(self.model.joint.parameters(), self._zero_joint_grads):
            p.grad = zero
        self.update()

    def joint_and_loss(self, f, g, f_lens, y, y_lens, host=(None, None)) -> None:
        """Joint + loss forward and backward on fixed joint inputs (leaves that need grad)."""
        loss = self.loss_fn(
            self.model.joint, f, g, f_lens, y, y_lens, host_lens=self.host_lens(*host)
        )
        self.scaler.scale(loss).backward()


# ------------------------------------------------------------------------------ measuring


class Timer:
    """Wall time of a callable: CUDA events on the GPU, perf_counter on CPU; milliseconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[..., object], *args) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t0) * 1e3


def matmul_peak_flops(device: torch.device, timer: Timer) -> float:
    """Measured dense matmul FLOP/s: fp16 8192^3 on the GPU (fp32 1024^3 on CPU, a smoke value)."""
    n, dtype, reps = (
        (8192, torch.float16, 20) if device.type == "cuda" else (1024, torch.float32, 3)
    )
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)

    def run():
        for _ in range(reps):
            torch.matmul(a, b, out=out)

    return 2 * n**3 * reps / (min(timer(run) for _ in range(3)) * 1e-3)


def lstm_flops(in_size: int, hidden: int, steps: int, batch: int) -> int:
    """Forward matmul FLOPs of one LSTM layer: gates = W_ih x + W_hh h, (4H x (in + H))."""
    return 2 * batch * steps * 4 * hidden * (in_size + hidden)


def step_flops(cfg: ModelConfig, batch: int, frames: int, tokens: int) -> int:
    """Model FLOPs of one training step on a (frames, tokens) padded batch: every GEMM's
    2*M*N*K forward, times 3 for forward + backward (input and weight gradients)."""
    h, f = cfg.enc_n_hid, cfg.enc_stack_time_factor
    t2 = -(-frames // f)
    fwd = 0
    for i in range(cfg.enc_pre_rnn_layers):
        fwd += lstm_flops(cfg.in_feats if i == 0 else h, h, frames, batch)
    for i in range(cfg.enc_post_rnn_layers):
        fwd += lstm_flops(h * f if i == 0 else h, h, t2, batch)
    fwd += 2 * batch * t2 * h * cfg.joint_n_hid  # joint_enc
    u1, p = tokens + 1, cfg.pred_n_hid
    fwd += cfg.pred_rnn_layers * lstm_flops(p, p, u1, batch)
    fwd += 2 * batch * u1 * p * cfg.joint_n_hid  # joint_pred
    fwd += 2 * batch * t2 * u1 * cfg.joint_n_hid * cfg.n_classes  # joint fc
    return 3 * fwd


def synthetic_batches(
    cfg: Config, args, batch_size: int, count: int, device, dtype
) -> tuple[list[Batch], SyntheticFeatureSource]:
    """`count` model-input batches with real LibriSpeech shapes, already on the device, and
    their source (its durations and token lists size the graphs)."""
    tokenizer = tokenizer_for_lengths_table(args.lengths_tsv, args.tokenizer_vocab, args.cache_dir)
    source = SyntheticFeatureSource(
        args.lengths_tsv,
        batch_size,
        tokenizer,
        cfg.features,
        train=True,
        max_duration=cfg.data.max_duration,
        vocab_size=cfg.model.n_classes - 1,
        num_batches=count,
        seed=cfg.training.seed,
        device=device,
    )
    transform = BatchTransform(cfg.features, train=True, dtype=dtype)
    out = []
    for fb in source:
        if args.average_lengths:
            fb = _at_average_lengths(fb, source)
        mb = transform(fb)
        # Without host lengths the fused loss computes the padded (B, T, U+1) box.
        host = (None, None) if args.padded_loss else mb.host_lens
        out.append((mb.feats, mb.feat_lens, mb.tokens, mb.token_lens, host))
    return out, source


def _at_average_lengths(fb: FeatureBatch, source: SyntheticFeatureSource) -> FeatureBatch:
    """Every utterance of the batch at the table's mean duration and mean token count: the
    shape at which per-step targets "at average LibriSpeech lengths" are stated."""
    frames = int(source.frames(np.array([source.durations.mean()]), np.ones(1))[0])
    tokens = round(float(np.mean([len(t) for t in source.tokens])))
    b = len(fb)
    gen = torch.Generator(device=fb.feats.device).manual_seed(0)
    feats = torch.randn(b, fb.feats.shape[1], frames, generator=gen, device=fb.feats.device)
    vocab = source.random_ids_below or max(max(t) for t in source.tokens) + 1
    ids = torch.randint(1, vocab, (b, tokens), generator=gen, device=fb.feats.device)
    full = torch.full((b,), frames, dtype=torch.int64, device=fb.feats.device)
    host = (torch.full((b,), frames), torch.full((b,), tokens))
    return FeatureBatch(feats, full, ids, torch.full_like(full, tokens), host_lens=host)


def bench_one(cfg: Config, args, batch_size: int, num_cg: int, peak: float) -> dict:
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    torch.manual_seed(cfg.training.seed)
    model = RNNT(cfg.model).to(device, dtype)
    n_batches = args.warmup + args.steps
    batches, source = synthetic_batches(cfg, args, batch_size, n_batches, device, dtype)
    longest = min(cfg.data.max_duration, float(source.durations.max()))
    runner = StepRunner(
        model,
        args.loss_backend,
        batch_size,
        max_feat_len=max_spliced_frames(longest, cfg.features),
        max_token_len=max(len(t) for t in source.tokens),
        num_cg=num_cg,
        fused_gemm=cfg.loss.fused_gemm,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    for batch in batches[: args.warmup]:
        runner.step(*batch)
    step_ms = [timer(runner.step, *batch) for batch in batches[args.warmup :]]
    peak_mem = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0

    # the parts, on the same batches: joint + loss on fixed joint inputs, and the rest with
    # fixed output gradients in place of the joint's
    joint_ms, rest_ms = [], []
    for x, x_lens, y, y_lens, host in batches[args.warmup :]:
        with torch.no_grad():
            f, f_lens, g = runner.encode_predict(x, x_lens, y)
        f = f.detach().clone().requires_grad_()
        g = g.detach().clone().requires_grad_()
        joint_ms.append(timer(runner.joint_and_loss, f, g, f_lens, y, y_lens, host))
        runner.optimizer.zero_grad(set_to_none=True)
        grads = (torch.randn_like(f) * 1e-3, torch.randn_like(g) * 1e-3)
        rest_ms.append(timer(runner.step_without_joint, x, x_lens, y, grads))

    timed = batches[args.warmup :]
    flops = statistics.mean(
        step_flops(cfg.model, batch_size, b[0].shape[0], b[2].shape[1]) for b in timed
    )
    median = statistics.median(step_ms)
    result = {
        "batch_size": batch_size,
        "num_cg": num_cg,
        "packed_loss": not args.padded_loss,
        "sm90_logits_gemm": runner.sm90_logits,
        "steps": len(step_ms),
        "median_step_ms": median,
        "utts_per_s": batch_size / (median * 1e-3),
        "median_joint_loss_ms": statistics.median(joint_ms),
        "median_rest_ms": statistics.median(rest_ms),
        "peak_memory_gib": peak_mem / 2**30,
        "model_tflops_per_step": flops / 1e12,
        "mfu": flops / (median * 1e-3) / peak,
        "mean_frames": statistics.mean(float(b[0].shape[0]) for b in timed),
        "mean_tokens": statistics.mean(float(b[2].shape[1]) for b in timed),
        "final_loss": runner.scalars.read()["loss"],
    }
    if runner.graphs is not None:
        result["feat_buckets"] = runner.graphs.feat_buckets
        result["token_buckets"] = runner.graphs.token_buckets
    if args.profile:
        result["profile"] = str(profile_step(runner, timed[0], args.profile, batch_size, num_cg))
    return result


def profile_step(runner: StepRunner, batch: Batch, out_dir: str, batch_size: int, num_cg: int):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and batch[0].is_cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        runner.step(*batch)
        if batch[0].is_cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if ProfilerActivity.CUDA in activities else "cpu_time_total"
    path = Path(out_dir) / f"train_step_b{batch_size}_cg{num_cg}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    return path


def print_table(rows: list[dict], peak: float) -> None:
    print(f"matmul peak: {peak / 1e12:.3f} TFLOP/s")
    head = (
        f"{'batch':>5} {'num_cg':>6} {'step ms':>8} {'utts/s':>8} {'joint+loss ms':>13} "
        f"{'rest ms':>8} {'peak GiB':>8} {'MFU':>6}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['batch_size']:>5} {r['num_cg']:>6} {r['median_step_ms']:>8.2f} "
            f"{r['utts_per_s']:>8.1f} {r['median_joint_loss_ms']:>13.2f} "
            f"{r['median_rest_ms']:>8.2f} {r['peak_memory_gib']:>8.2f} {r['mfu']:>6.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/baseline_v3-1023sp.yaml"))
    add_override_arg(parser)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 192])
    parser.add_argument(
        "--num-cg",
        type=int,
        nargs="+",
        default=None,
        help="graph counts to compare (default: 0 4 8 on CUDA, 0 on CPU)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--loss-backend",
        default=None,
        help="loss backend (default: fused on CUDA, reference on CPU)",
    )
    parser.add_argument(
        "--lengths-tsv",
        default=str(ROOT / "rnnt/data/lengths/librispeech_train-clean-5_lengths.tsv"),
    )
    parser.add_argument(
        "--tokenizer-vocab",
        type=int,
        default=1023,
        help="pieces of the tokenizer that sets token counts (MLPerf: 1023)",
    )
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "rnnt-bench"))
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--padded-loss",
        action="store_true",
        help="do not give the loss host lengths (the fused loss then computes the padded box)",
    )
    parser.add_argument(
        "--average-lengths",
        action="store_true",
        help="every utterance at the table's mean duration and token count (no padding)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a torch.profiler table of one step per configuration",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu for a smoke run)")
    if args.num_cg is None:
        args.num_cg = [0, 4, 8] if device.type == "cuda" else [0]
    if device.type != "cuda" and any(n > 0 for n in args.num_cg):
        parser.error("--num-cg > 0 needs a CUDA device")
    if args.loss_backend is None:
        args.loss_backend = "fused" if device.type == "cuda" else "reference"
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(args.config, args.overrides)

    peak = matmul_peak_flops(device, Timer(device))
    rows = []
    for batch_size in args.batch_sizes:
        for num_cg in args.num_cg:
            rows.append(bench_one(cfg, args, batch_size, num_cg, peak))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, peak)
    if args.json:
        meta = {
            "config": args.config,
            "overrides": args.overrides,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "loss_backend": args.loss_backend,
            "fused_gemm": cfg.loss.fused_gemm,
            "lengths_tsv": args.lengths_tsv,
            "matmul_peak_tflops": peak / 1e12,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return 0 if all(math.isfinite(r["final_loss"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
