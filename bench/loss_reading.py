r"""Do two loss backends read the same on the same batches? The real Trainer's loss, twice.

    python bench/loss_reading.py CONFIG [--init-from CHECKPOINT] [--backends reference fused]
        [--batches 20] [--set key=value ...] [--json FILE]

The trainer logs the loss its backend computes. The fast path's fused loss and the plain
path's reference loss compute the same objective, but in other precisions on fp16 inputs: the
fused loss forms the logits in its own GEMM with float32 sums, the reference rounds them to the
model's fp16 first. docs/CONVERGENCE.md compares the two paths' logged losses to a tenth of a
percent, so how far the readings themselves differ has to be known. This builds the
`rnnt.trainer.Trainer` of CONFIG (optionally from CHECKPOINT's weights, as `--init-from`
does), and for each of `--batches` training batches runs `Trainer._forward_loss`, the loss of
a training step, once per backend on the same batch, with the model in eval mode (no dropout,
so both see one function) and SpecAugment's generator put back between the calls (so both see
the same masks). In eval mode the model runs eagerly, without the CUDA graphs, and its encoder
runs nn.LSTM (cuDNN), not the wave kernels of training: what differs
between the two readings is the loss alone, on the same encoder and prediction outputs. It
prints the median, mean, spread and largest relative difference of the second backend's reading
from the first's, and names the implementation each backend chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from itertools import islice
from pathlib import Path

import torch

from rnnt.config import add_override_arg, load_config
from rnnt.distributed import init_distributed, shutdown
from rnnt.loss import BACKENDS, TransducerLoss
from rnnt.trainer import Trainer


def readings(
    trainer: Trainer, backends: list[str], batches: int
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Each backend's loss on each of the next `batches` training batches of the trainer's
    epoch, and the implementation each backend chose (its `prepare`)."""
    losses, chosen = {}, {}
    for name in backends:
        loss = TransducerLoss(name, trainer.model.blank_idx, trainer.cfg.loss.fused_gemm)
        chosen[name] = loss.prepare(trainer.model.joint)[0]
        losses[name] = loss
    trainer.model.eval()
    trainer.train_loader.set_epoch(trainer.progress.epoch)
    values: dict[str, list[float]] = {name: [] for name in backends}
    with torch.no_grad():
        for batch in islice(trainer.train_loader, batches):
            augment = trainer.augment_generator.get_state()
            for name in backends:
                trainer.augment_generator.set_state(augment)
                trainer.loss_fn = losses[name]
                loss, _ = trainer._forward_loss(batch)
                values[name].append(float(loss))
    return values, chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    add_override_arg(parser)
    parser.add_argument("--init-from", default=None, help="a checkpoint whose weights to use")
    parser.add_argument(
        "--backends", nargs=2, choices=sorted(BACKENDS), default=["reference", "fused"]
    )
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None, help="write the readings here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu for a smoke run)")
    if args.batches < 1:
        parser.error("--batches must be at least 1")
    if args.backends[0] == args.backends[1]:
        parser.error("--backends: name two different backends")
    cfg = load_config(args.config, args.overrides)
    ctx = init_distributed(device.type)
    try:
        trainer = Trainer(cfg, ctx)
        if args.init_from:
            trainer.start_from(args.init_from)
        values, chosen = readings(trainer, args.backends, args.batches)
    finally:
        shutdown(ctx)
    first, second = args.backends
    print(f"backends: {first} ran {chosen[first]}, {second} ran {chosen[second]}")
    rel = [b / a - 1 for a, b in zip(values[first], values[second], strict=True)]
    spread = statistics.stdev(rel) if len(rel) > 1 else 0.0
    median, mean = statistics.median(rel), statistics.fmean(rel)
    print(  # relative differences, as fractions (1e-3 is 0.1%)
        f"{second} against {first} over {len(rel)} batches, relative: median {median:+.2e}, "
        f"mean {mean:+.2e} (sd {spread:.2e}), largest {max(rel, key=abs):+.2e}; "
        f"mean loss {statistics.fmean(values[first]):.4f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"chosen": chosen, "readings": values, "relative": rel}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
