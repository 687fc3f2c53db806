"""Utterances per second per CPU thread of the DALI CPU and torch input pipelines.

Speaks a few 12-second espeak-ng utterances into a private temporary directory (16 kHz FLAC,
with a little noise), then times whole training epochs (speed perturbation and dither on, the
per-utterance CPU feature path of each backend) at each thread count. Prints a table and
writes JSON.

    python bench/data_pipeline.py --threads 1 2 --out results/data_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from rnnt.config import Config
from rnnt.data.loader import build_loader, dali_available
from rnnt.data.manifest import Utterance

SECONDS = 12.0
RATE = 16000
TEXTS = [
    "the old lighthouse keeper climbed the narrow stairs every evening to light the lamp, "
    "and from the top he watched the ships crossing the dark water toward the harbour",
    "after the rain stopped the children ran into the garden, collecting snails and "
    "counting the puddles, while their grandmother read quietly by the open window",
    "a committee of engineers reviewed the proposal for the new bridge and asked for "
    "stronger cables, wider lanes and a path for bicycles along the southern side",
]


def speak(text: str, path: Path, seed: int) -> None:
    """Exactly SECONDS of 16 kHz speech (repeated if espeak-ng is shorter) with noise."""
    raw = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True).stdout
    wav = path.with_suffix(".espeak.wav")
    wav.write_bytes(raw)
    converted = path.with_suffix(".16k.wav")
    subprocess.run(["sox", str(wav), "-r", str(RATE), str(converted)], check=True)
    speech, _ = sf.read(converted, dtype="float32")
    n = int(SECONDS * RATE)
    audio = np.resize(speech, n)  # np.resize repeats the signal to fill n samples
    audio += 0.003 * np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    sf.write(path, np.clip(audio, -1, 1), RATE, subtype="PCM_16")
    wav.unlink()
    converted.unlink()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_backend(
    backend: str, threads: int, utts: list[Utterance], batch_size: int, epochs: int
) -> float:
    cfg = Config()
    cfg.data.backend = backend
    cfg.data.device = "cpu"
    cfg.data.resampling_device = "cpu"
    cfg.data.num_threads = threads
    cfg.training.batch_size = batch_size
    loader = build_loader(cfg, utts, None, train=True)
    loader.set_epoch(0)
    for _ in loader:  # warm-up: worker start-up, DALI allocations
        pass
    count = 0
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch)
        for batch in loader:
            count += len(batch)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--utterances", type=int, default=24, help="utterances per epoch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs after warm-up")
    parser.add_argument("--backends", nargs="+", default=["dali", "torch"])
    parser.add_argument("--out", default="data_pipeline.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the main process only pads and stacks

    backends = [b for b in args.backends if b != "dali" or dali_available()]
    results = []
    with tempfile.TemporaryDirectory(prefix="rnnt-bench-") as tmp:
        files = []
        for i, text in enumerate(TEXTS):
            path = Path(tmp) / f"utt{i}.flac"
            speak(text, path, seed=i)
            files.append(path)
        utts = [
            Utterance(f"u{i}", str(files[i % len(files)]), SECONDS, "x", [1])
            for i in range(args.utterances)
        ]
        for backend in backends:
            for threads in args.threads:
                rate = time_backend(backend, threads, utts, args.batch_size, args.epochs)
                results.append(
                    {
                        "backend": backend,
                        "threads": threads,
                        "utterances_per_s": rate,
                        "utterances_per_s_per_thread": rate / threads,
                    }
                )
    machine = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    print(
        f"{SECONDS:.0f} s utterances, training front end, batch {args.batch_size}, "
        f"{machine['cpu']} ({machine['cpu_count']} logical CPUs)"
    )
    print(f"{'backend':8} {'threads':>7} {'utt/s':>8} {'utt/s/thread':>13}")
    for r in results:
        print(
            f"{r['backend']:8} {r['threads']:7d} {r['utterances_per_s']:8.2f} "
            f"{r['utterances_per_s_per_thread']:13.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "utterance_seconds": SECONDS,
                "batch_size": args.batch_size,
                "machine": machine,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
