"""`tformer plot`: the curves of one or more runs, read from their metrics.csv.

Panels: training and validation loss against steps and against tokens seen, the learning
rate, training speed, and (where a translation run measured them) validation BLEU and chrF.
All but the tokens-seen panel share one horizontal axis: the step, or (x = "time") the
hours since the run started, evaluations included, which is how runs of different speeds
compare fairly.
Each run has one colour in every panel; training is a solid line, validation a dashed one
with a marker per evaluation.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tformer.errors import TformerError
from tformer.viz import require

METRICS = "metrics.csv"


@dataclass
class Curves:
    """One run's metrics.csv as columns."""

    name: str
    train: dict[str, list[float]] = field(default_factory=dict)
    val: dict[str, list[float]] = field(default_factory=dict)

    def has(self, split: str, column: str) -> bool:
        values = getattr(self, split).get(column, [])
        return any(math.isfinite(v) for v in values)


def read_curves(run: str | Path, name: str | None = None) -> Curves:
    """The columns of RUN/metrics.csv by split; a blank cell is NaN."""
    path = Path(run) / METRICS
    if not path.is_file():
        raise TformerError(f"{run} holds no {METRICS}; give a run directory of `tformer train`")
    curves = Curves(name or Path(run).resolve().name)
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            table = {"train": curves.train, "val": curves.val}.get(row.get("split") or "")
            if table is None or not (row.get("step") or "").isdigit():
                continue
            for key, value in row.items():
                if key in (None, "split"):
                    continue
                try:
                    number = float(value) if value not in (None, "") else math.nan
                except ValueError:
                    number = math.nan
                table.setdefault(key, []).append(number)
    if not curves.train.get("step") and not curves.val.get("step"):
        raise TformerError(f"{path} has no rows yet; plot a run that has logged a step")
    return curves


def run_names(runs: list[str | Path]) -> list[str]:
    """The directories' names, or their paths where two runs share a name."""
    names = [Path(r).resolve().name for r in runs]
    if len(set(names)) < len(names):
        return [str(r) for r in runs]
    return names


def at_steps(curves: Curves, column: str, steps: list[float]) -> list[float]:
    """A training column that grows with the step (tokens, elapsed_s) at each of `steps`,
    interpolated between the training rows, from 0 at step 0."""
    import numpy as np

    known = [(s, v) for s, v in zip(curves.train["step"], curves.train.get(column, []),
                                    strict=False) if math.isfinite(v)]
    if not known:
        return [math.nan] * len(steps)
    x, y = zip(*known, strict=True)
    return list(np.interp(steps, (0.0, *x), (0.0, *y)))


X_AXES = {"step": "step", "time": "hours since the start"}
"""plot_runs's choices of horizontal axis, and their labels."""


def x_values(curves: Curves, steps: list[float], x: str) -> list[float]:
    """Where the rows of `steps` go on the horizontal axis `x`."""
    if x == "time":
        return [seconds / 3600 for seconds in at_steps(curves, "elapsed_s", steps)]
    return list(steps)


def plot_runs(runs: list[str | Path], x: str = "step") -> Any:
    """A matplotlib Figure of the runs' curves (see the module docstring). x: the horizontal
    axis, "step" or "time"."""
    require("matplotlib")
    from matplotlib.figure import Figure

    if not runs:
        raise TformerError("plot needs at least one run directory")
    if x not in X_AXES:
        raise TformerError(f"--x {x} is not known; choose one of: {' | '.join(X_AXES)}")
    all_curves = [read_curves(r, n) for r, n in zip(runs, run_names(runs), strict=True)]
    show_bleu = any(c.has("val", "bleu") for c in all_curves)
    panels = ["loss_step", "loss_tokens", "lr", "speed"] + (["bleu", "chrf"] if show_bleu else [])
    n_cols = 3 if show_bleu else 2
    fig = Figure(figsize=(5.0 * n_cols, 7.5), layout="constrained")
    axes = dict(zip(panels, fig.subplots(2, n_cols).flatten(), strict=True))
    shared = X_AXES[x]
    labels = {
        "loss_step": (shared, "loss (nats/token)", "loss"),
        "loss_tokens": ("tokens seen", "loss (nats/token)", "loss against data"),
        "lr": (shared, "learning rate", "learning rate"),
        "speed": (shared, "training tokens/s", "speed"),
        "bleu": (shared, "BLEU", "validation BLEU (greedy)"),
        "chrf": (shared, "chrF", "validation chrF (greedy)"),
    }
    for key, (xlabel, ylabel, title) in labels.items():
        if key in axes:
            axes[key].set(xlabel=xlabel, ylabel=ylabel, title=title)
            axes[key].grid(alpha=0.3)

    colours = [f"C{i % 10}" for i in range(len(all_curves))]
    for curves, colour in zip(all_curves, colours, strict=True):
        train, val = curves.train, curves.val
        train_x = x_values(curves, train.get("step", []), x)
        val_x = x_values(curves, val.get("step", []), x)
        solid = {"color": colour, "linewidth": 1.2}
        dashed = {"color": colour, "linestyle": "--", "marker": "o", "markersize": 3}
        if curves.has("train", "loss"):
            axes["loss_step"].plot(train_x, train["loss"], label=curves.name, **solid)
            if curves.has("train", "tokens"):
                axes["loss_tokens"].plot(train["tokens"], train["loss"], label=curves.name,
                                         **solid)
        if curves.has("val", "loss"):
            axes["loss_step"].plot(val_x, val["loss"], **dashed)
            if curves.has("train", "tokens"):
                val_tokens = at_steps(curves, "tokens", val["step"])
                axes["loss_tokens"].plot(val_tokens, val["loss"], **dashed)
        if curves.has("train", "lr"):
            axes["lr"].plot(train_x, train["lr"], label=curves.name, **solid)
        if curves.has("train", "tokens_per_s"):
            axes["speed"].plot(train_x, train["tokens_per_s"], label=curves.name, **solid)
        for metric in ("bleu", "chrf"):
            if metric in axes and curves.has("val", metric):
                where, values = zip(
                    *[(at, v) for at, v in zip(val_x, val[metric], strict=True)
                      if math.isfinite(v)], strict=True)
                axes[metric].plot(where, values, label=curves.name, **dashed)

    # One legend for the runs, one for what the line styles mean.
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, label=curves.name)
               for curves, c in zip(all_curves, colours, strict=True)]
    handles += [Line2D([], [], color="grey", label="training"),
                Line2D([], [], color="grey", linestyle="--", marker="o", markersize=3,
                       label="validation")]
    axes["loss_step"].legend(handles=handles, fontsize="small")
    axes["loss_tokens"].ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
    return fig
