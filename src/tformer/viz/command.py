"""The viz subcommands as typed functions: `tformer plot`, `tformer info` and
`tformer attention`. They own the terminal; the modules beside them only compute."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

from tformer.arguments import Help
from tformer.errors import TformerError
from tformer.viz.plot import X_AXES

Figure = Annotated[str, Help("FILE.png (or .pdf, .svg)", flags=("-o", "--output"))]

FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def check_figure_path(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise TformerError(f"-o {out}: write a {', '.join(FIGURE_SUFFIXES)} file")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plot_command(
    runs: Annotated[list[str], Help("run directories (each with its metrics.csv)", nargs="+")],
    *,
    output: Figure,
    x: Annotated[str, Help("horizontal axis: the step, or hours since the run started",
                           choices=tuple(X_AXES))] = "step",
) -> int:
    from tformer.viz.plot import plot_runs

    path = check_figure_path(output)
    plot_runs(runs, x).savefig(path, dpi=100)
    print(f"wrote {path}")
    return 0


def info_command(
    checkpoint: Annotated[str, Help("run or checkpoint directory")],
    *,
    as_json: Annotated[bool, Help("one JSON object instead of tables", flags=("--json",))] = False,
) -> int:
    from tformer.viz.info import format_summary, summarize

    info = summarize(checkpoint)
    print(json.dumps(info) if as_json else format_summary(info), end="" if not as_json else "\n")
    return 0


def attention_command(
    checkpoint: Annotated[str, Help("run or checkpoint directory")],
    *,
    text: Annotated[str | None, Help("language models: the text to read", one_of="text")] = None,
    source: Annotated[
        str | None, Help("translation: the sentence to translate", one_of="text")
    ] = None,
    output: Figure,
) -> int:
    """--text for a language model, --source for a translation model."""
    from tformer.loading import load_checkpoint
    from tformer.registry import get_family
    from tformer.viz.attention import plot_attention

    path = check_figure_path(output)
    loaded = load_checkpoint(checkpoint)
    family = get_family(loaded.cfg.family)
    # A family that translates reads a source sentence; a language model, a text.
    wanted = "--source" if family.translate is not None else "--text"
    given = "--source" if source is not None else "--text"
    if given != wanted:
        raise TformerError(
            f"{loaded.label} is a {loaded.cfg.family} model: give the sentence with {wanted}"
        )
    maps = family.attention(loaded.model, loaded.tokenizer, source if text is None else text)
    if maps.note:
        print(f"note: {maps.note}", file=sys.stderr)
    plot_attention(maps, title=f"{loaded.label} ({loaded.cfg.family})").savefig(path, dpi=100)
    print(f"wrote {path}")
    return 0
