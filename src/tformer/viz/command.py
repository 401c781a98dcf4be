"""The viz subcommands as typed functions: `tformer plot`, `tformer info` and
`tformer attention`. They own the terminal; the modules beside them only compute."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tformer.errors import TformerError

FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def check_figure_path(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise TformerError(f"-o {out}: write a {', '.join(FIGURE_SUFFIXES)} file")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plot_command(runs: list[str], out: str, x: str = "step") -> int:
    from tformer.viz.plot import plot_runs

    path = check_figure_path(out)
    plot_runs(runs, x).savefig(path, dpi=100)
    print(f"wrote {path}")
    return 0


def info_command(checkpoint: str, *, as_json: bool = False) -> int:
    from tformer.viz.info import format_summary, summarize

    info = summarize(checkpoint)
    print(json.dumps(info) if as_json else format_summary(info), end="" if not as_json else "\n")
    return 0


def attention_command(
    checkpoint: str, out: str, *, text: str | None = None, source: str | None = None
) -> int:
    """--text for a language model, --source for a translation model."""
    from tformer.registry import get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.viz.attention import plot_attention

    path = check_figure_path(out)
    loaded = load_checkpoint(checkpoint)
    family = get_family(loaded.cfg.family)
    # A family that translates reads a source sentence; a language model, a text.
    wanted = "--source" if family.translate is not None else "--text"
    given = "--source" if source is not None else "--text"
    if given != wanted:
        raise TformerError(
            f"{loaded.path} is a {loaded.cfg.family} model: give the sentence with {wanted}"
        )
    maps = family.attention(loaded.model, loaded.tokenizer, source if text is None else text)
    if maps.note:
        print(f"note: {maps.note}", file=sys.stderr)
    plot_attention(maps, title=f"{loaded.path} ({loaded.cfg.family})").savefig(path, dpi=100)
    print(f"wrote {path}")
    return 0
