"""metrics.csv: one row per logged training step or evaluation, the record `tformer plot`
draws and a resumed run continues (rows past the checkpoint it resumes from are dropped, so
the resumed run writes them again as an uninterrupted one would)."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from tformer.training import checkpoint as ckpt

METRICS = "metrics.csv"
METRIC_FIELDS = (
    "step", "split", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "tokens", "bleu",
    "chrf",
)
"""tokens: target tokens trained on so far; bleu, chrf: on validation rows that measured them."""


class MetricsLog:
    """metrics.csv in the run directory, one row per logged step or evaluation."""

    def __init__(self, run_dir: Path, resume_step: int | None, *, tensorboard: bool = False):
        self.path = run_dir / METRICS
        self.tensorboard = None
        if tensorboard:
            from tformer.viz.tensorboard import TensorBoardLog

            self.tensorboard = TensorBoardLog(run_dir, resume_step)
        if resume_step is not None and self.path.exists():
            # Rows written after the checkpoint we resume from are about to be redone; a row
            # cut short by a kill is dropped.
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if self._complete(r, resume_step)]
            self._write(rows, "w")
        elif not self.path.exists() or resume_step is None:
            self._write([], "w")

    def _write(self, rows: list[dict[str, Any]], mode: str) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=METRIC_FIELDS)
        if mode == "w":  # a rewrite replaces the file in one rename
            writer.writeheader()
            writer.writerows(rows)
            ckpt.write_text(self.path, text.getvalue())
            return
        writer.writerows(rows)
        try:
            with open(self.path, "a", newline="") as f:
                f.write(text.getvalue())
        except OSError as e:
            raise ckpt.write_error(self.path, e) from None

    @staticmethod
    def _complete(row: dict[str, Any], last_step: int) -> bool:
        if None in row.values() or None in row or not row["step"].isdigit():
            return False
        return int(row["step"]) <= last_step and row["split"] in ("train", "val")

    def add(self, **row: Any) -> None:
        self._write([row], "a")
        if self.tensorboard is not None:
            self.tensorboard.add(row)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
