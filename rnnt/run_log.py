"""Human-readable training log lines (stdout) and a JSON-lines metrics file, main rank only.

Every `run` / `step` / `eval` call prints one line and appends one JSON object to
`OUTPUT_DIR/metrics.jsonl` (appending, so a resumed run continues the same file), with one
record of the run's implementation choices (rnnt.backends):

    {"kind": "run", "time": 1714000000.0, "run_id": "3f9c0a1b22d4", "seed": 1234567,
     "seed_source": "drawn", "world_size": 8, "resumed": false}
    {"kind": "backends", "time": ..., "data": "torch/cpu", "encoder_lstm": "cudnn",
     "loss": "reference", "lamb": "torch", "reasons": {"data": "auto: ...", ...}}
    {"kind": "train", "time": 1714000000.1, "step": 120, "epoch": 2, "loss": 48.2, "lr": 0.0031,
     "utts_per_s": 1520.4, "step_ms": 126.3, "window_steps": 10, "data_wait_share": 0.01,
     "peak_memory_gib": 61.2, "mfu": 0.212, "loss_scale": 512.0, "skipped_steps": 0}
    (and "dropped_utterances" under data.skip_bad; from the torch loader, the parts of the data
    wait: "data_wait_workers_share", "data_wait_queueing_share", "data_wait_stage_share")
    {"kind": "eval", "time": ..., "epoch": 2, "step": 542, "wer": 0.284, "utterances": 2703,
     "seconds": 1.9}
    (and "kind": "mid_epoch_eval", with the same fields, for `training.eval_every_steps`)

`utts_per_s` and `step_ms` cover the window since the previous log point, measured to the
moment the device finished it (rnnt.throughput); `peak_memory_gib` and `mfu` are absent where
they do not apply (CPU, a GPU without a known peak).
Non-finite numbers are written as the strings "nan", "inf", "-inf" (JSON has no such numbers).
`scripts/plot_metrics.py` draws the file.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from rnnt.throughput import WindowStats

METRICS_FILE = "metrics.jsonl"


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


# what each part of a loader's wait is, in the log line (rnnt.data.device_stage.LoaderTime;
# "workers" are the torch backend's processes or DALI's pipeline)
_WAIT_PART_NAMES = {"workers": "workers", "queueing": "queueing the stage", "stage": "the stage"}


def _wait_parts(shares: dict[str, float] | None) -> str:
    """' (workers 0.4%, queueing the stage 1.1%, the stage 6.0%)', or '' without parts."""
    if not shares:
        return ""
    named = (f"{_WAIT_PART_NAMES.get(name, name)} {share:.1%}" for name, share in shares.items())
    return f" ({', '.join(named)})"


class RunLog:
    """Log lines and metrics of one run; every method is a no-op unless `is_main`."""

    def __init__(self, out_dir: str | Path, is_main: bool = True) -> None:
        self.is_main = is_main
        self.path = Path(out_dir) / METRICS_FILE
        self._file = None
        if is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # closed by close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _print(self, text: str) -> None:
        # through tqdm, so that a progress bar on the terminal is redrawn below the line
        tqdm.write(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stdout)
        sys.stdout.flush()

    def _record(self, kind: str, fields: dict) -> None:
        if self._file is None:
            return
        record = {"kind": kind, "time": round(time.time(), 4)}
        record.update({k: _json_value(v) for k, v in fields.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def run(self, run_id: str, seed: int, seed_source: str, world_size: int, resumed: bool) -> None:
        """The run's identity, once per process start: its id (in its checkpoints too), its
        seed and where it came from (training.seed, the checkpoint, or drawn from the OS), and
        whether it continues from a checkpoint."""
        if not self.is_main:
            return
        how = "resumed" if resumed else "fresh"
        self._print(
            f"run {run_id} ({how}): seed {seed} ({seed_source}), {world_size} rank(s) derive "
            "theirs from it"
        )
        self._record(
            "run",
            dict(
                run_id=run_id,
                seed=int(seed),
                seed_source=seed_source,
                world_size=world_size,
                resumed=resumed,
            ),
        )

    def info(self, message: str) -> None:
        if self.is_main:
            self._print(message)

    def backends(self, line: str, choices: dict[str, tuple[str, str]]) -> None:
        """Which implementation runs each part (rnnt.backends): `line` printed, and a record of
        each choice with the reasons under "reasons"."""
        if not self.is_main:
            return
        self._print(line)
        fields: dict = {part: choice for part, (choice, _) in choices.items()}
        fields["reasons"] = {part: reason for part, (_, reason) in choices.items()}
        self._record("backends", fields)

    def step(
        self,
        step: int,
        epoch: int,
        loss: float,
        lr: float,
        loss_scale: float,
        skipped_steps: int,
        window: WindowStats,
        dropped_utterances: int | None = None,
    ) -> None:
        """One training log point: the mean loss of the last step, its LR, the loss scale,
        the total of skipped (non-finite) steps, the throughput window since the previous
        log point (rnnt.throughput) and, under data.skip_bad, the utterances left out of their
        batches so far because their audio could not be read."""
        if not self.is_main:
            return
        parts = [
            f"epoch {epoch} step {step}",
            f"loss {loss:.4f}",
            f"lr {lr:.3e}",
            f"{window.utts_per_s:.1f} utt/s ({window.step_ms:.1f} ms/step)",
            f"data wait {window.data_wait_share:.1%}" + _wait_parts(window.data_wait_parts),
        ]
        if window.host_lead_ms is not None:
            parts.append(f"host lead {window.host_lead_ms:.1f} ms")
        if window.peak_memory_gib is not None:
            parts.append(f"peak mem {window.peak_memory_gib:.1f} GiB")
        if window.mfu is not None:
            parts.append(f"MFU {window.mfu:.1%}")
        if window.alloc_retries:  # rare, and worth seeing when it happens
            parts.append(f"allocator retries {window.alloc_retries}")
        parts += [f"loss scale {loss_scale:g}", f"skipped steps {skipped_steps}"]
        if dropped_utterances is not None:
            parts.append(f"dropped utterances {dropped_utterances}")
        self._print(" | ".join(parts))
        parts = window.data_wait_parts or {}
        fields = dict(
            step=step,
            epoch=epoch,
            loss=float(loss),
            lr=float(lr),
            utts_per_s=window.utts_per_s,
            step_ms=window.step_ms,
            window_steps=window.steps,
            data_wait_share=window.data_wait_share,
            **{f"data_wait_{name}_share": share for name, share in parts.items()},
            host_lead_ms=window.host_lead_ms,
            peak_memory_gib=window.peak_memory_gib,
            mfu=window.mfu,
            alloc_retries=window.alloc_retries,
            loss_scale=float(loss_scale),
            skipped_steps=int(skipped_steps),
            dropped_utterances=dropped_utterances,
        )
        self._record("train", {k: v for k, v in fields.items() if v is not None})

    def eval(
        self,
        epoch: int,
        step: int,
        wer: float,
        utterances: int,
        seconds: float,
        data_seconds: float = 0.0,
        alloc_retries: int | None = None,
        mid_epoch: bool = False,
    ) -> None:
        """One dev evaluation: WER (a fraction) over `utterances`, taking `seconds`, of which
        `data_seconds` waiting for the loader (rank 0's), and the caching allocator's retries
        during it (rnnt.throughput; None off CUDA). `mid_epoch`: one of
        `training.eval_every_steps`, inside epoch `epoch`, recorded as "mid_epoch_eval" so
        that readers of the epochs' "eval" records never see it."""
        if not self.is_main:
            return
        where = f"epoch {epoch} step {step}" + (" (inside the epoch)" if mid_epoch else "")
        line = (
            f"{where} | dev WER {100 * wer:.3f}% | {utterances} utterances "
            f"in {seconds:.2f} s (waiting for data {data_seconds:.2f} s)"
        )
        self._print(line + (f" | allocator retries {alloc_retries}" if alloc_retries else ""))
        self._record(
            "mid_epoch_eval" if mid_epoch else "eval",
            dict(
                epoch=epoch,
                step=step,
                wer=float(wer),
                utterances=int(utterances),
                seconds=float(seconds),
                data_seconds=float(data_seconds),
                **({} if alloc_retries is None else {"alloc_retries": int(alloc_retries)}),
            ),
        )

    def progress(self, iterable: Iterable, total: int | None = None, desc: str = ""):
        """A tqdm bar with its ETA over `iterable`, shown only on the main rank and an
        interactive stderr (never in batch logs, where it would only add carriage-return
        noise: those get the plain log lines alone)."""
        return tqdm(
            iterable,
            total=total,
            desc=desc,
            leave=False,
            dynamic_ncols=True,
            disable=not (self.is_main and sys.stderr.isatty()),
        )


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file; a malformed line raises ValueError naming file and line."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({err.msg})") from None
            if not isinstance(record, dict) or "kind" not in record:
                raise ValueError(f"{path}:{lineno}: expected an object with a 'kind' key")
            records.append(record)
    return records
