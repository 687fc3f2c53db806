"""The wave stacks' GEMMs outside the waves: over every row of the padded batch
(`model.encoder_gemms: dense`, cuBLAS) against over each utterance's real frames (`packed`,
rnnt/kernels/packed_gemm.py).

    python bench/encoder_gemms.py [--batches 4] [--repeats 10] [--grad-rows 64 32] [--sweep]
        [--json F]

Random training batches of 192 utterances from the shipped LibriSpeech lengths table, with the
speed perturbation training draws (rnnt.data.synthetic), each padded to its CUDA-graph bucket
under the baseline config at `--num_cg 4` and ordered by length, as the encoder orders its
rows. Per batch and stack (pre-RNN: 2 layers, 256 inputs, the batch's spliced frames;
post-RNN: 3 layers, 2048 inputs, half as many frames), fp16, dropout 0.1:
- `gemms`: lstm_stack forward + backward with kernels that launch nothing, so that what runs
  is _WaveStack's own work: the hoisted input GEMM, two weight gradients a layer and the post
  stack's input gradient, plus the small copies around them (the same in both);
- `stack`: lstm_stack forward + backward with the wave kernels, what the trainer runs.
Cases: dense; dense with the rows' dropout keys (the keyed wave kernels that the trainer's
packed stacks run, whose price this case shows); packed with each --grad-rows, with the keys;
with --sweep, packed with each of SWEEP's other tiles, one change from the shipped ones each.
Each case is captured in a CUDA graph and timed with CUDA events (medians of --repeats
replays); the cases take turns on each batch. Before timing, each other case's outputs at the
real frames and its gradients are checked against dense's. `rows` is the share of the bucket's
rows that a case's weight gradients read: the real frames' share is what perfect packing would.
`copies` is the stack with neither waves nor GEMMs: _WaveStack's small copies (weights
concatenated and permuted, transposes, bias sums), which `gemms` also holds. `TFLOP/s` is the
FLOPs a case's GEMMs run (over the rows they read) over `gemms` less `copies`: it says whether
Triton's GEMMs run as fast a FLOP as cuBLAS's.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

# a sibling script's helpers: run as a script, this folder is first on the path; imported by a
# test, it is added last, where its modules shadow nothing
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from encoder_lstm import graph_ms  # noqa: E402
from wave_tile_skip import hopper_device, write_results  # noqa: E402

from rnnt.config import LENGTHS_DIR, load_config  # noqa: E402
from rnnt.data.augment import spliced_length  # noqa: E402
from rnnt.data.synthetic import perturbed_frames, read_lengths_table  # noqa: E402
from rnnt.graphs import BucketTable, bucket_lengths, max_spliced_frames  # noqa: E402
from rnnt.kernels import lstm_wave, packed_gemm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "baseline_v3-1023sp.yaml"
STACKS = {"pre": (256, 2), "post": (2048, 3)}  # inputs, layers
BATCH, NUM_CG, DROPOUT = 192, 4, 0.1


class NoWaves:
    """A kernels object for _WaveStack that launches nothing: its buffers keep whatever they
    held, which the GEMMs' timing does not depend on."""

    @staticmethod
    def forward(*args, **kwargs) -> None:
        pass

    @staticmethod
    def backward(*args, **kwargs) -> None:
        pass


class NoGemms:
    """A GEMMs object for _WaveStack that computes nothing: with NoWaves, what is left of a
    stack's forward + backward is _WaveStack's own small copies, which `gemms` also holds."""

    @staticmethod
    def rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[0], b.shape[1])

    @staticmethod
    def weight_grad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[1], b.shape[1])


# --sweep: packed tiles beside the shipped ones (rnnt/kernels/packed_gemm.py's constants), one
# change each: Triton's usual fp16 shapes on Hopper, larger and deeper than the shipped ones
SWEEP = {
    "rows 128x256x64 w8": {"ROWS_TILE": (128, 256, 64), "ROWS_WARPS": 8},
    "rows 128x128x64 w4 s4": {"ROWS_TILE": (128, 128, 64), "ROWS_STAGES": 4},
    "grad 128x256x64 w8": {"GRAD_TILE": (128, 256, 64)},
    "grad 256x128x64 w8": {"GRAD_TILE": (256, 128, 64)},
    "grad 128x128x64 s4": {"GRAD_STAGES": 4},
}


@contextlib.contextmanager
def overridden(module, values: dict):
    """The module's attributes set to `values` inside the block, and back after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def training_batches(count: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """(bucket length, spliced frames per utterance longest first) of `count` random batches."""
    cfg = load_config(str(CONFIG), [])
    features = cfg.features
    table = read_lengths_table(LENGTHS_DIR / "librispeech_train-clean-5_lengths.tsv")
    durations = table.durations[table.durations <= cfg.data.max_duration]
    buckets = bucket_lengths(max_spliced_frames(cfg.data.max_duration, features), NUM_CG)
    table_of = BucketTable(buckets, "bench")
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        picked = rng.choice(durations, BATCH, replace=False)
        speeds = rng.uniform(
            features.speed_perturbation_min, features.speed_perturbation_max, BATCH
        )
        raw = torch.from_numpy(perturbed_frames(picked, speeds, features))
        frames = spliced_length(raw, features.frame_subsample).numpy()
        frames = np.sort(frames)[::-1].copy()
        batches.append((table_of.lengths[table_of(int(frames[0]))], frames))
    return batches


def rows_read(lengths: np.ndarray, steps: int, tile_rows: int | None) -> float:
    """Share of the (steps x batch) rows a weight gradient reads: every row (None), or the
    tiles of `tile_rows` batch rows up to their longest frame."""
    if tile_rows is None:
        return 1.0
    longest = np.minimum(lengths.reshape(-1, tile_rows).max(1), steps)
    return float(longest.sum() * tile_rows) / (steps * lengths.size)


def output_rows_read(lengths: np.ndarray, steps: int, tile_rows: int) -> float:
    """Share of the (steps x batch) rows that `rows` (one output row a frame) reads: its tiles
    take `tile_rows` consecutive rows of the time-major buffer, across a step's end where the
    batch is no multiple of them, and a tile is read when any of its rows is a real frame."""
    real = (np.arange(steps)[:, None] < lengths[None, :]).ravel()
    tiles = -(-real.size // tile_rows)
    live = np.pad(real, (0, tiles * tile_rows - real.size)).reshape(tiles, tile_rows).any(1)
    return float(live.sum() * tile_rows) / real.size


def random_stack(stack: str, steps: int, frames: np.ndarray, device) -> dict:
    """One stack's fp16 weights, input (zero at the padding, as the encoder's is) and output
    gradient (zero at the padding, as the loss leaves it), at its real shapes."""
    k_in, n_layers = STACKS[stack]
    hidden = lstm_wave.HIDDEN
    gen = torch.Generator(device=device).manual_seed(0)
    half = {"device": device, "dtype": torch.float16}
    layers = [
        tuple(
            (torch.randn(*shape, generator=gen, **half) * 0.03).requires_grad_()
            for shape in (
                (4 * hidden, k_in if layer == 0 else hidden),
                (4 * hidden, hidden),
                (4 * hidden,),
                (4 * hidden,),
            )
        )
        for layer in range(n_layers)
    ]
    lengths = torch.from_numpy(frames).to(device)
    real = torch.arange(steps, device=device)[:, None] < lengths[None, :]
    x = torch.randn(steps, BATCH, k_in, generator=gen, **half) * real[..., None]
    x.requires_grad_(stack == "post")  # the pre-RNN stack's input is the features
    dy = torch.randn(steps, BATCH, hidden, generator=gen, **half) * 0.01 * real[..., None]
    params = ([x] if x.requires_grad else []) + [t for w in layers for t in w]
    seed = torch.tensor([7], dtype=torch.int32, device=device)
    # the encoder gives packed stacks each row's place in the batch before its sort; these
    # rows are in order already, and the keys make the same kernels run as in the trainer
    row_keys = torch.arange(BATCH, dtype=torch.int32, device=device)
    return dict(
        layers=layers,
        lengths=lengths,
        real=real,
        x=x,
        dy=dy,
        params=params,
        seed=seed,
        row_keys=row_keys,
    )


def forward(case: dict, kernels=None, gemms: str = "dense", keyed: bool = False) -> torch.Tensor:
    """lstm_stack on the case's input, `kernels` None for the default wave kernels; `keyed`:
    with the rows' dropout keys, as the trainer's encoder runs packed stacks."""
    for param in case["params"]:
        param.grad = None
    return lstm_wave.lstm_stack(
        case["x"],
        case["layers"],
        DROPOUT,
        case["seed"],
        kernels=kernels,
        lengths=case["lengths"],
        gemms=gemms,
        row_keys=case["row_keys"] if keyed else None,
    )


def gemm_flops(stack: str, steps: int, frames: np.ndarray, grad_rows: int | None) -> float:
    """FLOPs of the stack's GEMMs outside the waves: over every row (grad_rows None), or over
    the rows that packed tiles read (64-row tiles for the GEMMs with an output row per frame,
    `grad_rows` for the weight gradients)."""
    k_in, n_layers = STACKS[stack]
    hidden = lstm_wave.HIDDEN
    per_row = 2 * 4 * hidden
    # the input GEMM where it is hoisted out of the waves (inputs wider than the hidden size),
    # and the input gradient, which only the post stack's input needs
    by_frame = (k_in if k_in > hidden else 0) + (k_in if stack == "post" else 0)
    weights = k_in + hidden + (n_layers - 1) * 2 * hidden
    packed = grad_rows is not None
    by_frame_rows = output_rows_read(frames, steps, packed_gemm.ROWS_TILE[0]) if packed else 1.0
    weight_rows = rows_read(frames, steps, grad_rows)
    return per_row * steps * BATCH * (by_frame * by_frame_rows + weights * weight_rows)


def bench_batch(stack: str, steps: int, frames: np.ndarray, args, device) -> list[dict]:
    case = random_stack(stack, steps, frames, device)

    def run(kernels, gemms, keyed):
        return lambda: forward(case, kernels, gemms, keyed).backward(case["dy"])

    def outputs(gemms, keyed):
        y = forward(case, None, gemms, keyed)
        return y.detach()[case["real"]], *torch.autograd.grad(y, case["params"], case["dy"])

    # (name, GEMMs, row keys, packed_gemm's constants for the case): the dense stack with the
    # keys prices the keyed wave kernels that packed stacks run in the trainer
    grad_mn = packed_gemm.GRAD_TILE[:2]
    cases = [("dense", "dense", False, {}), ("dense, row keys", "dense", True, {})]
    cases += [
        (f"packed, {rows}-row tiles", "packed", True, {"GRAD_TILE": (*grad_mn, rows)})
        for rows in args.grad_rows
    ]
    if args.sweep:
        cases += [(f"packed, {name}", "packed", True, tiles) for name, tiles in SWEEP.items()]
    want = outputs("dense", False)
    with overridden(lstm_wave, {"DenseGemms": NoGemms}):
        copies_ms = graph_ms(run(NoWaves(), "dense", False), args.repeats)
    results = []
    for name, gemms, keyed, tiles in cases:
        # lstm_stack takes the module's tiles (no user chooses them), so the bench swaps them
        with overridden(packed_gemm, tiles):
            grad_rows = packed_gemm.GRAD_TILE[2] if gemms == "packed" else None
            error = None
            if name != "dense":
                got = outputs(gemms, keyed)
                error = max(
                    ((g.float() - w.float()).norm() / w.float().norm()).item()
                    for g, w in zip(got, want)
                )
            row = {
                "stack": stack,
                "steps": steps,
                "case": name,
                "rows": rows_read(frames, steps, grad_rows),
                "real_frames": float(frames.clip(max=steps).sum()) / (steps * BATCH),
                "max_relative_error": error,
                "copies_ms": copies_ms,
                "gemms_ms": graph_ms(run(NoWaves(), gemms, keyed), args.repeats),
                "stack_ms": graph_ms(run(None, gemms, keyed), args.repeats),  # default kernels
                "gemm_tflop": gemm_flops(stack, steps, frames, grad_rows) / 1e12,
            }
        own_ms = max(row["gemms_ms"] - copies_ms, 1e-3)
        row["gemm_tflops"] = row["gemm_tflop"] / (own_ms / 1e3)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4, help="random training batches")
    parser.add_argument("--repeats", type=int, default=10, help="replays per median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--grad-rows",
        type=int,
        nargs="+",
        default=[packed_gemm.GRAD_TILE[2]],
        help="batch rows per tile that the weight gradients skip by (divisors of 192, >= 16)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time packed with each of SWEEP's other tiles (64-row weight-gradient tiles)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    bad = [r for r in args.grad_rows if r < 16 or BATCH % r or r & (r - 1)]
    if bad:
        parser.error(f"--grad-rows: {bad[0]} is no power of two >= 16 that divides {BATCH}")
    device = hopper_device(parser)
    results = []
    for number, (bucket, frames) in enumerate(training_batches(args.batches, args.seed)):
        post_frames = (frames + 1) // 2
        for stack, steps, lengths in (
            ("pre", bucket, frames),
            ("post", math.ceil(bucket / 2), post_frames),
        ):
            for row in bench_batch(stack, steps, lengths, args, device):
                results.append({"batch": number, **row})
    print(f"{torch.cuda.get_device_name(device)}, batch {BATCH}, fp16, medians of {args.repeats}")
    print(
        f"{'batch':>5} {'stack':5} {'steps':>5} {'case':30} {'rows':>5} {'real':>5} "
        f"{'copies ms':>9} {'gemms ms':>8} {'TFLOP/s':>7} {'stack ms':>8} {'error':>8}"
    )
    for r in results:
        error = "" if r["max_relative_error"] is None else f"{r['max_relative_error']:.1e}"
        print(
            f"{r['batch']:5} {r['stack']:5} {r['steps']:5} {r['case']:30} {r['rows']:5.2f} "
            f"{r['real_frames']:5.2f} {r['copies_ms']:9.2f} {r['gemms_ms']:8.2f} "
            f"{r['gemm_tflops']:7.0f} {r['stack_ms']:8.2f} {error:>8}"
        )
    for stack in STACKS:
        for case in dict.fromkeys(r["case"] for r in results):
            rows = [r for r in results if r["stack"] == stack and r["case"] == case]
            dense = [r for r in results if r["stack"] == stack and r["case"] == "dense"]
            ratios = [r["stack_ms"] / d["stack_ms"] for r, d in zip(rows, dense)]
            print(f"{stack} {case}: stack time / dense, median {statistics.median(ratios):.3f}")
    write_results(args.json, device, results)
    failed = [r for r in results if (r["max_relative_error"] or 0) > 2e-2]
    for r in failed:
        print(f"{r['case']} differs from dense: {r}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
