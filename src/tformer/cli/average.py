"""`tformer average CKPT... --out DIR`: one checkpoint whose weights are the mean of several
(Vaswani et al. 2017 average the last checkpoints of a run)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from tformer.arguments import Help
from tformer.errors import TformerError


def average(
    checkpoints: Annotated[
        list[str], Help("checkpoint directories, or one run with --last", nargs="+")
    ],
    *,
    last: Annotated[
        int, Help("the run's newest N step checkpoints (0: the CHECKPOINTS given)")
    ] = 0,
    out: Annotated[str, Help("the averaged checkpoint's directory")],
) -> int:
    from tformer.loading import is_checkpoint
    from tformer.training.average import average_checkpoints, checkpoints_to_average

    if last < 0:
        raise TformerError(f"--last {last} must be at least 1")
    paths = checkpoints_to_average(checkpoints, last)
    dest = Path(out)
    if dest.exists() and not dest.is_dir():
        raise TformerError(f"--out {dest} is a file; the averaged checkpoint is a directory")
    if dest.exists() and not is_checkpoint(dest) and any(dest.iterdir()):
        raise TformerError(f"--out {dest} exists and is not a checkpoint; choose another --out")
    average_checkpoints(paths, dest)
    print(f"averaged {len(paths)} checkpoints into {dest}: " + ", ".join(p.name for p in paths))
    return 0
