"""The viz subcommands as typed functions: `tformer plot`, `tformer info` and
`tformer attention`. They own the terminal; the modules beside them only compute."""

from __future__ import annotations

import json
from pathlib import Path

from tformer.errors import TformerError

FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def check_figure_path(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise TformerError(f"-o {out}: write a {', '.join(FIGURE_SUFFIXES)} file")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plot_command(runs: list[str], out: str) -> int:
    from tformer.viz.plot import plot_runs

    path = check_figure_path(out)
    plot_runs(runs).savefig(path, dpi=100)
    print(f"wrote {path}")
    return 0


def info_command(checkpoint: str, *, as_json: bool = False) -> int:
    from tformer.viz.info import format_summary, summarize

    info = summarize(checkpoint)
    print(json.dumps(info) if as_json else format_summary(info), end="" if not as_json else "\n")
    return 0
