"""What skipping a finished 96-row batch tile would save the wave forward (issue 35), measured
before any packing is written.

    python bench/wave_tile_skip.py [--repeats 15] [--json results/wave_tile_skip.json]

Per-utterance packing in the wave kernels would order a batch's rows by length and let each
96-row tile (the wgmma N of the kernels' GEMM) stop at its own longest row. This builds a copy
of csrc/lstm_wave_sm90.cu whose forward cells read their tile's own active-step count,
`active[1 + tile]`, where the shipped kernel reads the batch's, `active[0]`, and runs the
encoder's stacks at batch 192 (two tiles) and the longest LibriSpeech lengths: pre-RNN (2
layers, 256 inputs, 557 steps) and post-RNN (3 layers, 2048 inputs hoisted into one GEMM, 279
steps), with per-tile counts from both full to both empty. Medians of --repeats calls of the
forward kernels alone (CUDA events, after 3 warm-ups).

The outputs of skipped cells are not what a shorter stack computes (the cell state and the
backward's factors stop where they are): the numbers time a design, and nothing here trains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from rnnt.kernels import lstm_wave

# the forward kernel's test for a padding cell, and what it becomes
BATCH_COUNT = "if (t >= active_steps(p.active, p.T)) {"
TILE_COUNT = "if (t >= active_steps(p.active ? p.active + 1 + nb : nullptr, p.T)) {"
STACKS = {"pre": (256, 2, 557), "post": (2048, 3, 279)}  # inputs, layers, steps
BATCH = 192


def per_tile_source(source: str) -> str:
    """The kernels' source with the forward's padding test per batch tile."""
    if source.count(BATCH_COUNT) != 1:
        raise ValueError(
            f"{lstm_wave.SOURCE.name}: expected one forward padding test {BATCH_COUNT!r}, "
            f"found {source.count(BATCH_COUNT)}; update {Path(__file__).name}"
        )
    return source.replace(BATCH_COUNT, TILE_COUNT)


def kernels_from_source(source: str, build_dir: Path) -> lstm_wave.CudaKernels:
    """CudaKernels (default variants) over a copy of the kernels' source with the text
    `source`, built beside copies of its headers in build_dir."""
    build_dir.mkdir(parents=True, exist_ok=True)
    for path in lstm_wave.SOURCE.parent.glob("*.cuh"):
        (build_dir / path.name).write_text(path.read_text())
    patched = build_dir / lstm_wave.SOURCE.name
    patched.write_text(source)
    shipped = lstm_wave.SOURCE
    lstm_wave.SOURCE = patched  # library() builds and types whatever SOURCE names
    try:
        return lstm_wave.CudaKernels()
    finally:
        lstm_wave.SOURCE = shipped


def hopper_device(parser: argparse.ArgumentParser) -> torch.device:
    """The GPU, or the parser's error where the wave kernels cannot run."""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda")
    reason = lstm_wave.unsupported(device, lstm_wave.HIDDEN, 3)
    if reason:
        parser.error(f"the wave kernels cannot run here: {reason}")
    return device


def write_results(path: str | None, device: torch.device, results: list[dict]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(
            json.dumps({"device": torch.cuda.get_device_name(device), "results": results}, indent=1)
        )


def stack_buffers(k_in: int, n_layers: int, steps: int, device: torch.device) -> dict:
    """The forward kernels' buffers for one stack, as _WaveStack.forward lays them out."""
    hidden, rows = lstm_wave.HIDDEN, steps * BATCH
    half = {"device": device, "dtype": torch.float16}
    x = torch.randn(rows, k_in, **half)
    w = [
        torch.randn(4 * hidden, (k_in if layer == 0 else hidden) + hidden, **half) * 0.02
        for layer in range(n_layers)
    ]
    x_gates, w_run = None, w
    if k_in > hidden:
        x_gates = x @ w[0][:, :k_in].T
        w_run = [w[0][:, k_in:].contiguous(), *w[1:]]
    return {
        "x": x,
        "hseq": [torch.zeros(rows + BATCH, hidden, **half) for _ in w],
        "yseq": [torch.empty(rows, hidden, **half) for _ in w],
        "cstate": [torch.zeros(BATCH, hidden, device=device) for _ in w],
        "factors": [torch.empty(lstm_wave.N_FACTORS, rows, hidden, **half) for _ in w],
        "bias": [torch.zeros(4 * hidden, device=device) for _ in w],
        "w": w_run,
        "x_gates": x_gates,
        "seed": torch.tensor([7], dtype=torch.int32, device=device),
    }


def forward_ms(kernels, b: dict, active: torch.Tensor, repeats: int) -> float:
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernels.forward(
            b["x"],
            b["hseq"],
            b["yseq"],
            b["cstate"],
            b["factors"],
            b["bias"],
            b["w"],
            0.1,
            b["seed"],
            b["x_gates"],
            active,
        )
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(steps: int) -> dict[str, tuple[int, int, int]]:
    """(batch, tile 0, tile 1) active steps of each case."""
    return {
        "both tiles full": (steps, steps, steps),
        "tile 1 empty": (steps, steps, 0),
        "tile 1 at half": (steps, steps, steps // 2),
        "tile 1 at 3/4": (steps, steps, 3 * steps // 4),
        "both at half": (steps // 2, steps // 2, steps // 2),
        "both empty": (0, 0, 0),
        "both tiles full, again": (steps, steps, steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = hopper_device(parser)
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as build_dir:
        source = per_tile_source(lstm_wave.SOURCE.read_text())
        kernels = kernels_from_source(source, Path(build_dir))
        print(f"{torch.cuda.get_device_name(device)}, batch {BATCH} (two 96-row tiles), fp16")
        for name, (k_in, n_layers, steps) in STACKS.items():
            buffers = stack_buffers(k_in, n_layers, steps, device)
            full = None
            for case, counts in cases(steps).items():
                active = torch.tensor(counts, dtype=torch.int32, device=device)
                ms = forward_ms(kernels, buffers, active, args.repeats)
                full = full or ms
                print(f"{name} stack, {steps} steps, {case:24s} {ms:7.3f} ms  {ms / full:.3f}")
                results.append(
                    {"stack": name, "steps": steps, "case": case, "active": counts, "ms": ms}
                )
    write_results(args.json, device, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
