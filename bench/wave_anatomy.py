"""Where a wave step's time goes (issue 35): the encoder stacks' forward and backward waves, with
one part of the kernels taken out at a time, timed against the whole.

    python bench/wave_anatomy.py [--repeats 10] [--json results/wave_anatomy.json]

Per stack at batch 192 and the longest LibriSpeech lengths (pre-RNN: 2 layers, 256 inputs, 557
steps; post-RNN: 3 layers, 2048 inputs hoisted into one GEMM, 279 steps), each direction's waves
alone (not the GEMMs around them), one eager call between CUDA events, medians of --repeats
after 2 warm-ups:

- every launch variant of the library (csrc: kFwdVariants, kBwdVariants), the default marked;
- without the MMAs: a copy of the source whose mainloops skip their wgmma instructions (the
  loads, the barriers and the epilogue stay);
- without the epilogue: a copy whose cells skip the epilogue's arithmetic and stores, after
  waiting for every copy into their shared memory, so none is left in flight;
- empty cells: every step padding (active = 0), what the trainer's graphs pay per padded step:
  a launch, its wait for the previous one and its zero rows.

The whole minus "without the MMAs" is what the tensor-core work adds to the chain of waves,
"without the MMAs" minus the empty cells what the loads, the barriers and the epilogue add.
The copies time a design: their outputs are garbage, and nothing here trains. Each copy comes
from the shipped source through text patches that must each match once, so a changed kernel
makes this fail, rather than time something else.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

# a sibling script's helpers: run as a script, this folder is first on the path; imported by a
# test, it is added last, where its modules shadow nothing
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from wave_tile_skip import (  # noqa: E402
    BATCH,
    STACKS,
    hopper_device,
    kernels_from_source,
    stack_buffers,
    write_results,
)

from rnnt.kernels import lstm_wave  # noqa: E402

# (anchor, replacement) pairs; `p.T < 0` never holds, and the compiler cannot know it, so the
# skipped code keeps its registers and its place in the kernel
ABLATIONS = {
    "without the MMAs": [
        (
            "\n            mma_64x96(d[half],",
            "\n            if (p.T < 0) mma_64x96(d[half],",
        ),
        ("\n          mma_64x96(d, a", "\n          if (p.T < 0) mma_64x96(d, a"),
    ],
    "without the epilogue": [
        (
            "    mbar_wait(cbar, 0);\n    {\n",
            "    mbar_wait(cbar, 0);\n    if (p.has_xw[l]) mbar_wait(xbar, 0);\n"
            "    if (p.T < 0) {\n",
        ),
        (
            "      mbar_wait(ebar, 0);\n      {\n        if (!top) mbar_wait<true>(pbar, 0);\n",
            "      mbar_wait(ebar, 0);\n      if (!top) mbar_wait<true>(pbar, 0);\n"
            "      if (p.T < 0) {\n        if (!top) mbar_wait<true>(pbar, 0);\n",
        ),
    ],
}


def ablated_source(source: str, ablation: str) -> str:
    """The kernels' source with `ablation`'s patches applied, each to its one match."""
    for anchor, replacement in ABLATIONS[ablation]:
        if source.count(anchor) != 1:
            raise ValueError(
                f"{lstm_wave.SOURCE.name}, {ablation!r}: expected one {anchor!r}, found "
                f"{source.count(anchor)}; update {Path(__file__).name}"
            )
        source = source.replace(anchor, replacement)
    return source


def ablated_kernels(ablation: str, build_dir: Path) -> lstm_wave.CudaKernels:
    """CudaKernels (default variants) over the ablated copy, built in build_dir."""
    return kernels_from_source(ablated_source(lstm_wave.SOURCE.read_text(), ablation), build_dir)


def backward_buffers(k_in: int, forward: dict, device: torch.device) -> dict:
    """The backward kernels' buffers for the stack whose forward buffers are `forward`, laid out
    as _WaveStack.backward lays them out (W^T of [W_ih | W_hh] per layer)."""
    hidden = lstm_wave.HIDDEN
    n_layers = len(forward["w"])
    rows = forward["yseq"][0].shape[0]
    half = {"device": device, "dtype": torch.float16}
    kin = [k_in] + [hidden] * (n_layers - 1)
    return {
        "kin": kin,
        "wt": [torch.randn(k + hidden, 4 * hidden, **half) * 0.02 for k in kin],
        "dz": [torch.empty(rows, 4 * hidden, **half) for _ in kin],
        "dc": [torch.empty(BATCH, hidden, device=device) for _ in kin],
        "dbias": [
            torch.empty(rows // lstm_wave.BATCH_TILE, 4 * hidden, device=device) for _ in kin
        ],
        "dy": torch.randn(rows, hidden, **half) * 0.01,
    }


def call_ms(call, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_stack(kernels, fwd: dict, bwd: dict, active: torch.Tensor, repeats: int):
    """(forward ms, backward ms) of one stack's waves through `kernels`."""

    def forward():
        kernels.forward(
            fwd["x"],
            fwd["hseq"],
            fwd["yseq"],
            fwd["cstate"],
            fwd["factors"],
            fwd["bias"],
            fwd["w"],
            0.1,
            fwd["seed"],
            fwd["x_gates"],
            active,
        )

    def backward():
        kernels.backward(
            bwd["kin"],
            bwd["wt"],
            bwd["dz"],
            fwd["factors"],
            bwd["dc"],
            bwd["dbias"],
            bwd["dy"],
            0.1,
            fwd["seed"],
            active,
        )

    return call_ms(forward, repeats), call_ms(backward, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = hopper_device(parser)
    torch.manual_seed(0)
    lib = lstm_wave.library()
    defaults = (lstm_wave.FORWARD_VARIANT, lstm_wave.BACKWARD_VARIANT)
    counts = (lib.wave_lstm_variants(0), lib.wave_lstm_variants(1))
    cases: dict[str, lstm_wave.CudaKernels] = {}
    for v in range(max(counts)):  # forward and backward variant v (the default past the last)
        fv, bv = (v if v < n else default for n, default in zip(counts, defaults))
        mark = " (default)" if (fv, bv) == defaults else ""
        cases[f"variant {fv} / {bv}{mark}"] = lstm_wave.CudaKernels(fv, bv)
    print(f"{torch.cuda.get_device_name(device)}, batch {BATCH}, fp16, dropout 0.1")
    results = []
    with tempfile.TemporaryDirectory() as build_root:
        for ablation in ABLATIONS:
            build_dir = Path(build_root) / ablation.replace(" ", "_")
            cases[ablation] = ablated_kernels(ablation, build_dir)
        shipped = lstm_wave.CudaKernels(*defaults)
        cases["empty cells (active = 0)"] = shipped
        for name, (k_in, n_layers, steps) in STACKS.items():
            fwd = stack_buffers(k_in, n_layers, steps, device)
            bwd = backward_buffers(k_in, fwd, device)
            full = torch.tensor([steps], dtype=torch.int32, device=device)
            empty = torch.zeros(1, dtype=torch.int32, device=device)
            time_stack(shipped, fwd, bwd, full, 1)  # the factors the backward reads
            for case, kernels in cases.items():
                active = empty if case.startswith("empty") else full
                f_ms, b_ms = time_stack(kernels, fwd, bwd, active, args.repeats)
                print(
                    f"{name} stack, {steps} steps, {case:28s} forward {f_ms:7.3f} ms "
                    f"({1e3 * f_ms / steps:5.1f} us a step), backward {b_ms:7.3f} ms "
                    f"({1e3 * b_ms / steps:5.1f} us a step)"
                )
                results.append(
                    {
                        "stack": name,
                        "steps": steps,
                        "case": case,
                        "forward_ms": f_ms,
                        "backward_ms": b_ms,
                    }
                )
    write_results(args.json, device, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
