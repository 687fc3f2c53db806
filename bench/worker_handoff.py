"""What a padded batch of a torch-loader worker costs the worker and the training process.

The workers run the loader's own collate function (`rnnt.data.loader.WorkerCollate`) on rows
of int16 PCM, by default 192 utterances of 16.7 s at 16 kHz (a 103 MB batch), and the
DataLoader starts them as the loader does (`worker_processes`), two batches asked of each
worker at a time. Per batch, timed in the training process:
- receive: `next()` on the DataLoader's iterator (with any wait for the workers);
- copy: one copy into a buffer mapped long before, which touches every page of the batch's
  mapping, as the pin-memory thread's copy to pinned memory does (then, with reused buffers,
  the batch's release to its worker, as that thread's does);
- drop: releasing the batch, where the last reference frees its shared-memory segment;
- how far a second Python thread of the training process got during the drop, against its
  rate while the main thread sleeps: near 0 means the drop held the interpreter's lock;
- the workers' CPU time per batch (/proc), which bounds how many batches a core makes.
Three ways, medians over the batches: a new segment a batch that the workers let go once sent
(`new, keep 0`), the same kept for their last two (`new, keep 2`: the loader's way for batches
used where they lie), and the workers' reused buffers (`reused`: the loader's way when it pins
the batches). No GPU is needed.

    python bench/worker_handoff.py [--batch 192] [--seconds 16.7] [--workers 2] [--batches 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

# a sibling script's helpers: run as a script, this folder is first on the path; imported by a
# test, or run again by a loader worker (whose server starts without the script's folder on its
# path), it is added last, where its modules shadow nothing
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from data_pipeline import cpu_seconds  # noqa: E402

from rnnt.data.loader import WorkerCollate, worker_processes  # noqa: E402


class NoiseRows(Dataset):
    """Items as the loader's dataset gives them: (index, seed, int16 row), cheap to make so
    that the workers leave the cores to the training process."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int):
        row = torch.full((self.samples,), index % 1000, dtype=torch.int16)
        return index, index, row


class Ticker:
    """A Python thread that counts as fast as the interpreter's lock lets it, while `go` is
    set (idle otherwise, so that it takes nothing from the copies timed in between)."""

    def __init__(self) -> None:
        self.count = 0
        self.go = threading.Event()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            self.go.wait(0.1)
            while self.go.is_set():
                self.count += 1

    def rate(self, seconds: float) -> float:
        """Counts a second while the main thread sleeps."""
        start = self.count
        self.go.set()
        time.sleep(seconds)
        self.go.clear()
        return (self.count - start) / seconds


ARMS = {
    "new, keep 0": lambda workers: WorkerCollate(keep=0),
    "new, keep 2": lambda workers: WorkerCollate(keep=2),
    "reused": lambda workers: WorkerCollate(WorkerCollate.buffer_flags(workers)),
}


def measure(arm: str, batch: int, samples: int, workers: int, batches: int) -> dict:
    rows_per_batch = [list(range(i * batch, (i + 1) * batch)) for i in range(batches)]
    loader = DataLoader(
        NoiseRows(samples),
        batch_sampler=rows_per_batch,
        num_workers=workers,
        collate_fn=ARMS[arm](workers),
        # the loader's default: each worker has at most two batches asked of it, so a worker
        # cannot run further ahead of the training process than it does in training
        prefetch_factor=2,
        multiprocessing_context=worker_processes(),
    )
    batches_in = iter(loader)
    target = torch.empty(batch, samples, dtype=torch.int16)
    target.fill_(0)  # mapped and touched here, long before the batches
    first = next(batches_in)  # the workers have started; their queue fills now
    first.release()
    del first
    time.sleep(3.0)
    pids = [w.pid for w in batches_in._workers]
    worker_cpu = sum(cpu_seconds(pid) for pid in pids)
    # handing the lock over every 0.1 ms, not every 5: the other thread's count then shows
    # whether the drop held it, and the handovers add little to the times
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    ticker = Ticker()
    idle_rate = ticker.rate(0.05)
    receive, copy, drop, progress = [], [], [], []
    for _ in range(batches - 1):
        t0 = time.perf_counter()
        sent = next(batches_in)
        padded = sent.padded
        t1 = time.perf_counter()
        target[:, : padded.shape[1]].copy_(padded)
        sent.release()
        del sent
        t2 = time.perf_counter()
        ticks = ticker.count
        ticker.go.set()
        t_drop = time.perf_counter()
        del padded
        t3 = time.perf_counter()
        ticker.go.clear()
        progress.append((ticker.count - ticks) / (t3 - t_drop) / idle_rate)
        receive.append(t1 - t0)
        copy.append(t2 - t1)
        drop.append(t3 - t_drop)
    ticker.running = False
    ticker.go.clear()
    sys.setswitchinterval(switch)
    # since the sleep the workers made the batches after the two that each had made ahead
    worker_cpu = sum(cpu_seconds(pid) for pid in pids) - worker_cpu
    made = batches - 1 - 2 * workers
    del batches_in
    return {
        "arm": arm,
        "worker_cpu_ms": 1e3 * worker_cpu / made,
        "receive_ms": 1e3 * statistics.median(receive),
        "copy_ms": 1e3 * statistics.median(copy),
        "drop_ms": 1e3 * statistics.median(drop),
        "other_thread_during_drop": statistics.median(progress),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=192, help="utterances a batch")
    parser.add_argument("--seconds", type=float, default=16.7, help="each utterance's length")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    if (
        args.workers < 1
        or args.batches < 2 + 2 * args.workers
        or args.batch < 1
        or args.seconds <= 0
    ):
        parser.error(
            "--workers >= 1, --batches >= 2 + 2 x workers (the first is not timed, and the "
            "workers make two each ahead of it), --batch >= 1 and --seconds > 0"
        )
    samples = round(args.seconds * 16000)
    mb = args.batch * samples * 2 / 1e6
    for arm in ARMS:
        r = measure(arm, args.batch, samples, args.workers, args.batches)
        print(
            f"{arm}: {mb:.0f} MB a batch: receive {r['receive_ms']:.1f} ms, copy "
            f"{r['copy_ms']:.1f} ms, drop {r['drop_ms']:.1f} ms; another thread ran at "
            f"{100 * r['other_thread_during_drop']:.0f}% of its idle rate during the drop; "
            f"workers {r['worker_cpu_ms']:.1f} ms of CPU a batch",
            flush=True,
        )


if __name__ == "__main__":
    main()
