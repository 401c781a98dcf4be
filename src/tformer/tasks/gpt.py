"""The GPT family's task: random windows of one token stream, next-token loss; or, for a
.jsonl data.path, prompt/completion rows with the loss on completions (data/instruct.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor, nn

from tformer.data.instruct import (
    InstructData,
    RandomRows,
    encode_rows,
    is_instruct_path,
    read_rows,
    sequential_rows,
)
from tformer.data.lm import LMBatch, LMData, RandomWindows
from tformer.data.tokenizers import IGNORE_INDEX, Tokenizer
from tformer.evaluation.lm import evaluate_batches, evaluate_stream
from tformer.evaluation.loss import Targets
from tformer.evaluation.shard import WHOLE, Shard
from tformer.tasks.lm import evaluate_lm_checkpoint, with_batch_size

if TYPE_CHECKING:  # the config module reads configs through the registry, which imports tasks
    from tformer.config import RunConfig


class GPTTask:
    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer | None = None, *, cache: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.data: LMData | InstructData
        if is_instruct_path(cfg.data.path):
            self.data = InstructData(cfg.data, tokenizer, cfg.model.context)
        else:
            self.data = LMData(cfg.data, tokenizer, cache=cache)
        self.tokenizer = self.data.tokenizer

    def model_fields(self) -> dict[str, Any]:
        return self.data.model_fields()

    def train_batches(self, seed: int) -> RandomWindows | RandomRows:
        if isinstance(self.data, InstructData):
            return RandomRows(self.data.train_rows, self.cfg.train.batch_size, seed)
        return RandomWindows(
            self.data.train_ids, self.cfg.train.batch_size, self.cfg.model.context, seed
        )

    def loss(self, model: nn.Module, batch: LMBatch, carry: None) -> tuple[Tensor, int, None]:
        """Windows are independent: nothing is carried from one step to the next."""
        n_targets = int((batch.targets != IGNORE_INDEX).sum())  # prompts and padding: none
        return model(batch.tokens, targets=Targets(batch.targets)), n_targets, None

    def new_carry(self) -> None:
        return None

    def save_carry(self, carry: None) -> None:
        return None

    def load_carry(self, saved: Any) -> None:
        return None

    def evaluate(
        self, model: nn.Module, max_batches: int = 0, shard: Shard = WHOLE, index: int = 0
    ) -> dict[str, float]:
        if isinstance(self.data, InstructData):
            batches = sequential_rows(self.data.val_rows, self.cfg.train.batch_size)
            return evaluate_batches(model, batches, self.tokenizer, max_batches, shard=shard)
        return evaluate_text(
            model, self.data.val_ids, self.tokenizer, self.cfg, max_batches, shard
        )

    def summary(self) -> dict[str, str]:
        """What training reads, for the start-up summary."""
        return self.data.summary()


def evaluate_text(
    model: nn.Module, ids: np.ndarray, tokenizer: Tokenizer, cfg: RunConfig, max_batches: int = 0,
    shard: Shard = WHOLE, progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Loss, perplexity and bits per character over a token stream, in windows of the
    model's context; with the window it used. progress: called with the tokens of each
    batch."""
    result = evaluate_stream(
        model, ids, tokenizer, context=cfg.model.context, batch_size=cfg.train.batch_size,
        max_batches=max_batches, shard=shard, progress=progress,
    )
    return {**result, "context": cfg.model.context}


def evaluate_checkpoint(
    checkpoint: Any, data: list[str], options: dict[str, Any], *, batch_size: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """The registry's evaluate: metrics over a text file, or the run's validation split
    (prompt/completion rows: over their completions)."""
    cfg = with_batch_size(checkpoint.cfg, batch_size)
    rows_file = data[0] if data else cfg.data.path
    if is_instruct_path(rows_file):
        if data:
            rows = encode_rows(read_rows(data[0]), checkpoint.tokenizer, cfg.model.context,
                               data[0])
        else:
            rows = InstructData(cfg.data, checkpoint.tokenizer, cfg.model.context).val_rows
        batches = sequential_rows(rows, cfg.train.batch_size)
        return evaluate_batches(checkpoint.model, batches, checkpoint.tokenizer,
                                progress=progress)
    return evaluate_lm_checkpoint(checkpoint, data, cfg, evaluate_text, progress)
