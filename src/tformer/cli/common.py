"""What several commands share: the checkpoint, device, thread and ensemble options, the
figures table, and checks on output files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any

from tformer.arguments import Help
from tformer.errors import TformerError

Device = Annotated[str, Help("auto (CUDA if present) | cpu | cuda:N")]
Threads = Annotated[int | None, Help("CPU threads (default: the decoding rule, see README)")]
Ensemble = Annotated[
    list[str] | None,
    Help("translation: decode with this checkpoint too, the mean of the models' "
         "distributions (repeat for more)", metavar="CHECKPOINT", repeat=True),
]
Checkpoint = Annotated[str, Help("run or checkpoint directory")]


def print_metrics(
    result: dict[str, Any], as_json: bool, *, first: tuple[str, ...] = ()
) -> None:
    """A table with the keys in `first` at its top, or one strict JSON object: a figure that
    is not a finite number (a perplexity too large for a float) is null, and "non_finite"
    says why."""
    order = [k for k in first if k in result] + [k for k in result if k not in first]
    result = {k: result[k] for k in order}
    if as_json:
        clean: dict[str, Any] = dict(result)
        reasons = {}
        for key, value in result.items():
            if isinstance(value, float) and not math.isfinite(value):
                clean[key] = None
                reasons[key] = "too large for a float (inf)" if value > 0 else str(value)
        if reasons:
            clean["non_finite"] = reasons
        print(json.dumps(clean, allow_nan=False))
        return
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def check_output_file(path: str, option: str, *inputs: str | None) -> None:
    """An output file must be creatable, and not one of the inputs, before work starts."""
    target = Path(path)
    if target.is_dir():
        raise TformerError(f"{option} {path} is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir():
        raise TformerError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise TformerError(f"{option} {path}: not writable")
    for given in inputs:
        if given is not None and Path(given).exists() and target.exists():
            if os.path.samefile(given, target):
                raise TformerError(f"{option} {path} is the input file; it would be overwritten")


def ensemble_note(others: list[str] | None) -> str:
    return f" + {len(others)} more as an ensemble" if others else ""
