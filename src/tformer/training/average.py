"""Checkpoint averaging: the mean of several checkpoints' weights, as one checkpoint.

Vaswani et al. 2017 (sec. 6.1) translate with the average of the last 5 (base) or 20 (big)
checkpoints, written 10 minutes apart: it smooths the noise of the last steps much like a
lower learning rate would.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from tformer import loading
from tformer.errors import TformerError
from tformer.training import checkpoint as ckpt

log = logging.getLogger(__name__)


def _model_config(path: Path) -> dict:
    raw = loading.read_config_json(path)
    return {"model": raw["model"], "tokenizer": raw.get("tokenizer")}


def checkpoints_to_average(paths: Sequence[str | Path], last: int = 0) -> list[Path]:
    """Checkpoint directories from the CLI's arguments: checkpoint directories as given, or
    with `last`, the newest `last` step checkpoints of one run directory."""
    if last:
        if len(paths) != 1:
            raise TformerError("--last N takes one run directory")
        found = loading.step_checkpoints(Path(paths[0]))
        if len(found) < last:
            raise TformerError(
                f"--last {last}: {paths[0]} holds {len(found)} step checkpoints"
            )
        return found[-last:]
    chosen = [loading.resolve_checkpoint(p) for p in paths]
    if len(chosen) < 2:
        raise TformerError("average needs at least two checkpoints (or a run and --last N)")
    return chosen


@torch.no_grad()
def average_checkpoints(paths: Sequence[Path], out: str | Path) -> Path:
    """Write the element-wise mean of the checkpoints' weights to `out`, with the first
    checkpoint's config and tokenizer. They must be the same model with the same tokenizer."""
    first = _model_config(paths[0])
    for path in paths[1:]:
        if _model_config(path) != first:
            raise TformerError(
                f"cannot average {paths[0]} and {path}: their model configs or tokenizers differ"
            )
    loaded = [loading.load_checkpoint(p, weights="fp32") for p in paths]
    if len({c.tokenizer.to_json() for c in loaded}) > 1:
        raise TformerError("cannot average checkpoints with different tokenizers")
    target = loading.load_checkpoint(paths[0], weights="fp32")
    states = [c.model.state_dict() for c in loaded]
    # Tied weights appear under several names with one storage; each name gets the same mean.
    for name, tensor in target.model.state_dict().items():
        if tensor.is_floating_point():
            mean = torch.stack([s[name].double() for s in states]).mean(dim=0)
            tensor.copy_(mean.to(tensor.dtype))
    log.info("averaged %d checkpoints: %s", len(paths), ", ".join(str(p) for p in paths))
    return ckpt.save_checkpoint(Path(out), target.cfg, target.model, target.tokenizer)
