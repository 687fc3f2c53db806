"""Human-readable training log lines (stdout) and a JSON-lines metrics file, main rank only.

Every `step` / `eval` call prints one line and appends one JSON object to
`OUTPUT_DIR/metrics.jsonl` (appending, so a resumed run continues the same file):

    {"kind": "train", "time": 1714000000.1, "step": 120, "epoch": 2, "loss": 48.2, "lr": 0.0031,
     "utts_per_s": 1520.4, "loss_scale": 512.0, "skipped_steps": 0}
    {"kind": "eval", "time": ..., "epoch": 2, "step": 542, "wer": 0.284, "utterances": 2703,
     "seconds": 1.9}

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

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


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
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def _record(self, kind: str, fields: dict) -> None:
        if self._file is None:
            return
        record = {"kind": kind, "time": round(time.time(), 3)}
        record.update({k: _json_value(v) for k, v in fields.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def info(self, message: str) -> None:
        if self.is_main:
            self._print(message)

    def step(
        self,
        step: int,
        epoch: int,
        loss: float,
        lr: float,
        utts_per_s: float,
        loss_scale: float,
        skipped_steps: int,
    ) -> None:
        """One training log point: mean loss of the last step, its LR, throughput since the
        previous log point, the GradScaler scale and the total of skipped (non-finite) steps."""
        if not self.is_main:
            return
        self._print(
            f"epoch {epoch} step {step} | loss {loss:.4f} | lr {lr:.3e} | "
            f"{utts_per_s:.1f} utt/s | loss scale {loss_scale:g} | skipped steps {skipped_steps}"
        )
        self._record(
            "train",
            dict(
                step=step, epoch=epoch, loss=float(loss), lr=float(lr),
                utts_per_s=float(utts_per_s), loss_scale=float(loss_scale),
                skipped_steps=int(skipped_steps),
            ),
        )  # fmt: skip

    def eval(self, epoch: int, step: int, wer: float, utterances: int, seconds: float) -> None:
        """One dev evaluation: WER (a fraction) over `utterances`, taking `seconds`."""
        if not self.is_main:
            return
        self._print(
            f"epoch {epoch} step {step} | dev WER {100 * wer:.3f}% | {utterances} utterances "
            f"in {seconds:.2f} s"
        )
        self._record(
            "eval",
            dict(
                epoch=epoch, step=step, wer=float(wer), utterances=int(utterances),
                seconds=float(seconds),
            ),
        )  # fmt: skip

    def progress(self, iterable: Iterable, total: int | None = None, desc: str = ""):
        """A tqdm bar over `iterable`, shown only on the main rank and an interactive stderr
        (never in batch logs, where it would only add carriage-return noise)."""
        return tqdm(
            iterable, total=total, desc=desc, leave=False, dynamic_ncols=True,
            disable=not (self.is_main and sys.stderr.isatty()),
        )  # fmt: skip


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
