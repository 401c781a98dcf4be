"""The rows of metrics.csv, also written as TensorBoard scalars (tag `split/field`, e.g.
`train/loss`, `val/bleu`) under RUN_DIR/tensorboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tformer.viz import require

LOG_DIR = "tensorboard"
NOT_SCALARS = ("step", "split")


class TensorBoardLog:
    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        writer = require("torch.utils.tensorboard", "tensorboard").SummaryWriter
        # A resumed run redoes the steps after its checkpoint: TensorBoard drops the events
        # logged past it, as metrics.csv drops its rows.
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = writer(log_dir=str(run_dir / LOG_DIR), purge_step=purge)

    def add(self, row: dict[str, Any]) -> None:
        """One metrics.csv row: every numeric field but the step becomes a scalar."""
        for field, value in row.items():
            if field in NOT_SCALARS or value in (None, ""):
                continue
            self.writer.add_scalar(f"{row['split']}/{field}", float(value), int(row["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
