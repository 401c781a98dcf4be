"""What the language-model families share when a checkpoint is evaluated: the token stream
of a text file, or of the run's own validation split."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tformer.data.corpus import corpus_token_ids
from tformer.data.lm import LMData
from tformer.errors import TformerError

if TYPE_CHECKING:  # the config module reads configs through the registry, which imports tasks
    from tformer.config import RunConfig

EvaluateText = Callable[..., dict[str, float]]
"""(model, ids, tokenizer, cfg, *, progress) -> metrics."""


def evaluate_lm_checkpoint(
    checkpoint: Any, data: list[str], cfg: RunConfig, evaluate_text: EvaluateText,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """`evaluate_text` over the text at data[0], or with no data over the validation split
    of the run `cfg` describes. checkpoint: a tformer.training.checkpoint.Checkpoint;
    progress: called with the tokens of each batch."""
    if len(data) > 1:
        raise TformerError("a language model is evaluated on one DATA path (or none)")
    if data:
        ids = corpus_token_ids(data[0], checkpoint.tokenizer)
    else:
        ids = LMData(cfg.data, checkpoint.tokenizer).val_ids
    return evaluate_text(checkpoint.model, ids, checkpoint.tokenizer, cfg, progress=progress)


def with_batch_size(cfg: RunConfig, batch_size: int) -> RunConfig:
    """The config with train.batch_size = batch_size; 0 keeps the run's."""
    if batch_size < 0:
        raise TformerError(f"--batch-size {batch_size} must be positive")
    return cfg.replace("train", batch_size=batch_size) if batch_size else cfg
