"""Training input pipeline throughput: utterances per second, CPU cores used, GPU time.

Times the real loaders (`rnnt.data.loader.build_loader`) on a real manifest, with training
randomness on (speed perturbation, dither) and the Trainer's device transform (SpecAugment,
frame splicing, padding) applied to every batch, at each backend, resampling device and
worker count asked for:

    python bench/data_pipeline.py --manifest datasets/sentences/sentences-train.jsonl \
        --dataset-dir datasets/sentences --backends torch dali --resampling gpu cpu \
        --threads 4 8 --batch-size 192 --json results/data_pipeline.json

- utt/s: utterances delivered per second of wall clock over the timed batches, after warm-up
  batches (worker start, allocations); the consumer does nothing but the device transform,
  so this is what the pipeline can feed.
- first batch: seconds from starting the loader to its first batch: worker start-up, which
  a training run pays inside the timed region (the first setting also starts the process's
  forkserver, which later loaders share). With --epoch-pause S, also the next epoch's first
  batch after the rest of the epoch and S seconds standing in for the evaluation.
- cores: CPU time of this process and every process under it (the loader's workers, DALI's
  threads) per second of that wall clock, read from /proc (the threads' nanosecond counts
  where the kernel keeps them; a thread that ends inside the window takes its time along).
- GPU ms/batch (torch backend on a GPU): the batched feature stage plus the device
  transform, replayed on the same raw batches and timed with CUDA events. What the stage
  steals from a training step when it runs beside it is the trainer's business
  (`bench/gpu_session.sh realstep`).
- GPU kernels ms/batch (any backend on a GPU): the busy time of every kernel and copy on
  the device (DALI's own stream's too) over PROFILED_BATCHES more batches, from
  torch.profiler, per batch. DALI computes batches ahead, so the window's edges can hold a
  batch more or less of its work.

Without a GPU, `--device cpu` times the CPU feature path (features in the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from rnnt.config import Config
from rnnt.data.augment import BatchTransform
from rnnt.data.loader import build_loader, dali_available
from rnnt.data.manifest import read_manifest


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _threads_cpu_ns(pid: int) -> int | None:
    """The CPU time of a process's live threads in nanoseconds (the scheduler's own count),
    or None where the kernel does not keep it."""
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0  # ended meanwhile
    for tid in threads:
        thread = Path(f"/proc/{pid}/task/{tid}")
        try:
            total += int((thread / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            if thread.exists():  # the thread lives: this kernel keeps no such count
                return None
    return total


def cpu_seconds(root: int | None = None) -> float:
    """CPU time (user + system) of process `root` (this one by default) and every live process
    under it: from the scheduler's nanosecond counts of their threads, or else from
    /proc/PID/stat, whose clock ticks (10 ms) would read a short window's time as nothing."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in _descendants(os.getpid() if root is None else root):
        ns = _threads_cpu_ns(pid)
        if ns is not None:
            total += ns / 1e9
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def bench_config(
    backend: str, device: str, resampling: str, threads: int, batch_size: int
) -> Config:
    cfg = Config()
    cfg.data.backend = backend
    cfg.data.device = "gpu" if device == "cuda" else "cpu"
    cfg.data.resampling_device = resampling if device == "cuda" else "cpu"
    cfg.data.num_threads = threads
    cfg.data.num_buckets = 1
    cfg.training.batch_size = batch_size
    cfg.training.seed = 1
    return cfg


PROFILED_BATCHES = 8


def device_kernel_ms(loader_batches, consume, batches: int) -> float:
    """The device's busy time (every kernel and copy that CUPTI sees, whichever library
    launched it) per batch, over the next `batches` of `loader_batches`, each passed to
    `consume`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(batches):
            consume(next(loader_batches))
        torch.cuda.synchronize()
    busy_us = sum(
        e.device_time_total
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return busy_us / 1e3 / batches


def time_loader(
    cfg: Config,
    utts,
    dataset_dir,
    device: str,
    warmup: int,
    batches: int,
    profile: bool = False,
    epoch_pause: float = 0.0,
) -> dict:
    loader = build_loader(cfg, utts, dataset_dir, train=True, device=device)
    transform = BatchTransform(cfg.features, train=True, dtype=torch.float16).to(device)
    loader.set_epoch(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = time.perf_counter()
    it = iter(loader)
    transform(next(it).to(device))
    sync()
    first_batch_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        transform(next(it).to(device))
    sync()
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    utterances = 0
    for _ in range(batches):
        batch = next(it)
        transform(batch.to(device))
        utterances += len(batch)
    sync()
    wall = time.perf_counter() - wall0
    cores = (cpu_seconds() - cpu0) / wall
    kernel_ms = None
    if device == "cuda":
        kernel_ms = device_kernel_ms(it, lambda b: transform(b.to(device)), PROFILED_BATCHES)
    next_epoch_s = None
    if epoch_pause > 0:
        for batch in it:  # the rest of the epoch, then a stand-in for the evaluation
            transform(batch.to(device))
        time.sleep(epoch_pause)
        loader.set_epoch(1)
        start = time.perf_counter()
        it = iter(loader)
        transform(next(it).to(device))
        sync()
        next_epoch_s = time.perf_counter() - start
    del it  # the replay below restarts the loader's persistent workers
    gpu_ms = gpu_stage_ms(loader, transform, profile=profile) if device == "cuda" else None
    return {
        "utterances_per_s": utterances / wall,
        "first_batch_s": first_batch_s,
        "next_epoch_first_batch_s": next_epoch_s,
        "cores": cores,
        "batches": batches,
        "gpu_ms_per_batch": gpu_ms,
        "gpu_kernel_ms_per_batch": kernel_ms,
    }


def gpu_stage_ms(loader, transform, batches: int = 10, profile: bool = False) -> float | None:
    """Median CUDA time of the batched feature stage plus the device transform (torch
    backend on a GPU), replayed on raw batches of the loader's own workers. `profile`: also
    print the stage's kernels, by CUDA time, over its last three replays."""
    stage = getattr(loader.backend, "stage", None)
    raw_batches = getattr(loader.backend, "loader", None)
    if stage is None or raw_batches is None:  # DALI: replayed on its own batches, not here
        return None
    raw = iter(raw_batches)
    times = []
    profiler = None
    for i in range(batches):
        if profile and i == batches - 3:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        sent = next(raw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream()
        start.record(stream)
        feats, feat_lens, host_lens = stage.features_now(sent.padded, sent.lens, sent.seed)
        batch = loader.backend.assembler(sent.indices, feats, feat_lens, host_lens)
        transform(batch.to("cuda"))
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    if profiler is not None:
        profiler.__exit__(None, None, None)
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
    return statistics.median(times)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, help="training manifest (.jsonl)")
    parser.add_argument("--dataset-dir", required=True, help="root of its audio paths")
    parser.add_argument("--backends", nargs="+", default=["torch", "dali"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--resampling",
        nargs="+",
        choices=["gpu", "cpu"],
        default=["gpu"],
        help="where speed perturbation resamples (data.resampling_device; GPU runs only)",
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[8], help="data.num_threads")
    parser.add_argument("--batch-size", type=int, default=192)
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches first (>= 1)")
    parser.add_argument("--batches", type=int, default=40, help="timed batches")
    parser.add_argument(
        "--epoch-pause",
        type=float,
        default=0.0,
        help="also drain the epoch, wait this many seconds (the evaluation) and time the next "
        "epoch's first batch (0: not)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile", action="store_true", help="print the GPU stage's kernels (torch backend)"
    )
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup: at least 1 (the first batch is timed apart)")
    torch.set_num_threads(1)  # the main process assembles batches; the workers decode

    utts = read_manifest(args.manifest, args.dataset_dir)
    needed = (args.warmup + args.batches + PROFILED_BATCHES + 10) * args.batch_size
    if len(utts) < needed:
        raise SystemExit(f"{args.manifest}: {len(utts)} utterances, the run needs {needed}")
    mean_s = statistics.fmean(u.duration for u in utts)
    results = []
    for backend in args.backends:
        if backend == "dali" and not dali_available():
            print("dali: not installed here, skipped")
            continue
        for resampling in args.resampling if args.device == "cuda" else ["cpu"]:
            for threads in args.threads:
                cfg = bench_config(backend, args.device, resampling, threads, args.batch_size)
                r = time_loader(
                    cfg,
                    utts,
                    args.dataset_dir,
                    args.device,
                    args.warmup,
                    args.batches,
                    args.profile,
                    args.epoch_pause,
                )
                r.update(backend=backend, resampling=resampling, threads=threads)
                results.append(r)
                gpu, next_epoch = r["gpu_ms_per_batch"], r["next_epoch_first_batch_s"]
                kernels = r["gpu_kernel_ms_per_batch"]
                print(
                    f"{backend:5} resampling={resampling} threads={threads:2d}: "
                    f"{r['utterances_per_s']:7.0f} utt/s, {r['cores']:5.1f} cores, "
                    f"first batch after {r['first_batch_s']:.1f} s, "
                    + (f"next epoch's after {next_epoch:.2f} s, " if next_epoch is not None else "")
                    + (f"GPU {gpu:.1f} ms/batch" if gpu is not None else "GPU time n/a")
                    + (f", GPU kernels {kernels:.1f} ms/batch" if kernels is not None else ""),
                    flush=True,
                )
    machine = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
    }
    print(f"{len(utts)} utterances, mean {mean_s:.1f} s, batch {args.batch_size}; {machine}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "manifest": args.manifest,
                    "mean_seconds": mean_s,
                    "batch_size": args.batch_size,
                    "machine": machine,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
