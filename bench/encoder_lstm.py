"""The encoder's LSTM stacks, forward and forward + backward: cuDNN against the wave kernels.

    python bench/encoder_lstm.py [--batch 192] [--repeats 15] [--json results/encoder_lstm.json]

Per stack at the benchmark's shapes (fp16, dropout 0.1, batch 192): the pre-RNN stack (2 layers,
256 inputs, 490 frames: the 419-frame average batch padded to its bucket) and the post-RNN stack
(3 layers, 2048 inputs, 245 frames). `cudnn` is what `model.encoder_lstm: cudnn` runs (one
multi-layer nn.LSTM + output dropout); `wave F/B` is `model.encoder_lstm: wave` with forward
variant F and backward variant B (csrc/lstm_wave_sm90.cu: kFwdVariants, kBwdVariants; 0 without
and 1 with programmatic dependent launch, 2 as 1 with L2 eviction priorities on the TMA copies,
3 as 2 with each MMA split on the batch rows' halves), all of them, so the defaults in
rnnt/kernels/lstm_wave.py can be chosen from one run. Each row is
captured in a CUDA graph and timed with CUDA events; medians over --repeats replays. Before
timing, each wave variant's output and gradients are checked against the first one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from rnnt.kernels import lstm_wave
from rnnt.model import lstm_layer_weights

STACKS = {"pre": (256, 2, 490), "post": (2048, 3, 245)}  # inputs, layers, frames


def graph_ms(fn, repeats: int) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_stack(name: str, batch: int, p: float, repeats: int) -> list[dict]:
    k_in, n_layers, frames = STACKS[name]
    hidden = lstm_wave.HIDDEN
    torch.manual_seed(0)
    lstm = nn.LSTM(k_in, hidden, n_layers, dropout=p).cuda().half()
    out_dropout = nn.Dropout(p)
    layers = lstm_layer_weights(lstm)
    # the post-RNN stack's input is the pre-RNN stack's output: it needs its gradient too
    x = torch.randn(
        frames, batch, k_in, device="cuda", dtype=torch.float16, requires_grad=name == "post"
    )
    dy = torch.randn(frames, batch, hidden, device="cuda", dtype=torch.float16)
    params = [x, *lstm.parameters()] if x.requires_grad else list(lstm.parameters())

    def cudnn_forward():
        return out_dropout(lstm(x)[0])

    def wave_forward(kernels):
        return lstm_wave.lstm_stack(x, layers, p, kernels=kernels)

    def outputs(kernels):
        # detached, and the autograd graph freed: a graph kept alive keeps the leaves'
        # AccumulateGrad nodes on the default stream, which a later capture cannot join
        torch.manual_seed(1)
        y = wave_forward(kernels)
        grads = torch.autograd.grad(y, params, dy)
        return (y.detach(), *grads)

    def train(forward):
        def step():
            for param in params:
                param.grad = None
            forward().backward(dy)

        return step

    rows = [
        {
            "stack": name,
            "impl": "cudnn",
            "forward_ms": graph_ms(cudnn_forward, repeats),
            "train_ms": graph_ms(train(cudnn_forward), repeats),
        }
    ]
    lib = lstm_wave.library()
    first = None
    for fv in range(lib.wave_lstm_variants(0)):
        for bv in range(lib.wave_lstm_variants(1)):
            kernels = lstm_wave.CudaKernels(fv, bv)
            got = outputs(kernels)
            same = None
            if first is None:
                first = got
            else:
                same = all(torch.equal(a, b) for a, b in zip(first, got))
            rows.append(
                {
                    "stack": name,
                    "impl": f"wave {fv}/{bv}",
                    "same_as_first_wave": same,
                    "forward_ms": graph_ms(lambda k=kernels: wave_forward(k), repeats),
                    "train_ms": graph_ms(train(lambda k=kernels: wave_forward(k)), repeats),
                }
            )
    for row in rows:
        row["backward_ms"] = row["train_ms"] - row["forward_ms"]
        row["per_step_us"] = 1000 * row["train_ms"] / frames
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=192)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--stacks", nargs="+", default=list(STACKS), choices=list(STACKS))
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    reason = "no CUDA device"
    if torch.cuda.is_available():
        reason = lstm_wave.unsupported(torch.device("cuda"), lstm_wave.HIDDEN, lstm_wave.MAX_LAYERS)
    if reason:
        print(f"encoder_lstm: the wave kernels cannot run here: {reason}", file=sys.stderr)
        return 2
    rows = []
    for name in args.stacks:
        rows += bench_stack(name, args.batch, args.dropout, args.repeats)
    print(f"{torch.cuda.get_device_name()}, batch {args.batch}, dropout {args.dropout}, fp16")
    print(
        f"{'stack':6} {'impl':10} {'forward ms':>10} {'backward ms':>11} {'fwd+bwd ms':>10} "
        f"{'us/frame':>8}  same"
    )
    for r in rows:
        same = "" if r.get("same_as_first_wave") is None else str(r["same_as_first_wave"])
        print(
            f"{r['stack']:6} {r['impl']:10} {r['forward_ms']:10.2f} {r['backward_ms']:11.2f} "
            f"{r['train_ms']:10.2f} {r['per_step_us']:8.1f}  {same}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
