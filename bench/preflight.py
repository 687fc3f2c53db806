"""Time the preflight (rnnt.data.preflight) at LibriSpeech's size: 281,241 training utterances.

Writes a tree in the layout of the converted LibriSpeech training splits
(`train-clean-100-wav/<speaker>/<chapter>/<speaker>-<chapter>-<n>.wav`: 28,539 + 104,014 +
148,688 files in about 5,700 chapter folders, each file a few bytes: the preflight only stats
them) and one manifest of them with LibriSpeech-like durations and token ids, then times
`preflight` on it: reading and checking every line, resolving and stat'ing every file, checking
every token id. Prints one JSON line: the wall-clock and CPU seconds of each run, and the
parse and the stat alone (the latter as the preflight chooses, and with its thread pool
forced: the audio files are in the page cache, having just been written or read, and a cold
network file system is where the threads pay).

    python bench/preflight.py                      # a temporary tree, removed afterwards
    python bench/preflight.py --root /raid/bench   # the tree there, kept (a second run reuses it)
    python bench/preflight.py --threads 1 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from rnnt.config import Config
from rnnt.data.manifest import Utterance, scan_manifest
from rnnt.data.preflight import check_audio_files, preflight
from rnnt.prep.manifests import write_manifest

# LibriSpeech's training splits: utterances, speakers
SPLITS = {
    "train-clean-100": (28_539, 251),
    "train-clean-360": (104_014, 921),
    "train-other-500": (148_688, 1_166),
}
CHAPTERS_PER_SPEAKER = 2.4  # 5,466 chapters over 2,338 speakers in LibriSpeech
N_CLASSES = 1024


def make_tree(root: Path, seed: int = 0) -> Path:
    """The audio files and their manifest (kept in `root`: a second run only rewrites the
    manifest)."""
    rng = np.random.default_rng(seed)
    utts = []
    speaker, chapter = 1, 100_000
    for split, (count, speakers) in SPLITS.items():
        per_chapter = int(round(count / (speakers * CHAPTERS_PER_SPEAKER)))
        made = 0
        while made < count:
            chapter += int(rng.integers(1, 50))
            folder = root / f"{split}-wav" / str(speaker) / str(chapter)
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(min(per_chapter, count - made)):
                name = f"{speaker}-{chapter}-{n:04d}"
                path = folder / f"{name}.wav"
                if not path.exists():
                    path.write_bytes(b"RIFF")
                duration = float(np.clip(rng.normal(12.3, 3.5), 1.0, 24.5))
                tokens = rng.integers(1, N_CLASSES - 1, size=int(duration * 4)).tolist()
                utts.append(Utterance(name, str(path), duration, "words " * 10, tokens))
                made += 1
            speaker += 1 if rng.random() < 1 / CHAPTERS_PER_SPEAKER else 0
    manifest = root / "librispeech-train-wav.jsonl"
    write_manifest(manifest, utts, root)
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--root", help="where the tree goes (default: a temporary folder)")
    parser.add_argument("--threads", type=int, nargs="+", default=[16], help="stat threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per thread count")
    args = parser.parse_args()

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="preflight-bench-"))
    try:
        start = time.perf_counter()
        manifest = make_tree(root)
        made_s = time.perf_counter() - start
        cfg = Config()
        cfg.data.dataset_dir = str(root)
        cfg.data.train_manifests = [str(manifest)]
        cfg.data.tokenizer = ""
        wall, cpu = {}, {}
        for threads in args.threads:
            wall[threads], cpu[threads] = [], []
            for _ in range(args.repeats):
                cpu_start = time.process_time()
                result = preflight(cfg.data, N_CLASSES, train=True, threads=threads)
                cpu[threads].append(round(time.process_time() - cpu_start, 2))
                assert len(result.train) == 281_241 and not result.problems and not result.fatal
                wall[threads].append(round(result.seconds, 2))
        # its two large parts alone
        start = time.perf_counter()
        entries, _ = scan_manifest(manifest, root)
        parse_s = time.perf_counter() - start
        paths = [u.audio for _, u in entries]
        stat_s = {}
        for name, slow_stat_s in (("as_chosen", None), ("pool_forced", 0.0)):
            start = time.perf_counter()
            kwargs = {} if slow_stat_s is None else {"slow_stat_s": slow_stat_s}
            check_audio_files(paths, str(root), args.threads[-1], **kwargs)
            stat_s[name] = round(time.perf_counter() - start, 2)
        print(
            json.dumps(
                {
                    "utterances": 281_241,
                    "manifest_mib": round(manifest.stat().st_size / 2**20, 1),
                    "tree_seconds": round(made_s, 1),
                    "wall_seconds_by_threads": wall,
                    "cpu_seconds_by_threads": cpu,
                    "parse_seconds": round(parse_s, 2),
                    "stat_seconds": stat_s,
                    "cpus": os.cpu_count(),
                    "machine": platform.processor() or platform.machine(),
                }
            )
        )
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
