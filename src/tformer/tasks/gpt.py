"""The GPT family's task: random windows of one token stream, next-token loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from tformer.config import RunConfig
from tformer.data.lm import LMBatch, LMData, RandomWindows
from tformer.data.tokenizers import Tokenizer
from tformer.evaluation.lm import evaluate_stream, lm_loss
from tformer.evaluation.shard import WHOLE, Shard


class GPTTask:
    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer | None = None, *, cache: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.data = LMData(cfg.data, tokenizer, cache=cache)
        self.tokenizer = self.data.tokenizer

    def model_fields(self) -> dict[str, Any]:
        return self.data.model_fields()

    def train_batches(self, seed: int) -> RandomWindows:
        return RandomWindows(
            self.data.train_ids, self.cfg.train.batch_size, self.cfg.model.context, seed
        )

    def loss(self, model: nn.Module, batch: LMBatch, carry: None) -> tuple[Tensor, int, None]:
        """Windows are independent: nothing is carried from one step to the next."""
        return lm_loss(model(batch.tokens), batch.targets), batch.num_tokens, None

    def new_carry(self) -> None:
        return None

    def save_carry(self, carry: None) -> None:
        return None

    def load_carry(self, saved: Any) -> None:
        return None

    def evaluate(
        self, model: nn.Module, max_batches: int = 0, shard: Shard = WHOLE
    ) -> dict[str, float]:
        return evaluate_text(
            model, self.data.val_ids, self.tokenizer, self.cfg, max_batches, shard
        )


def evaluate_text(
    model: nn.Module, ids: np.ndarray, tokenizer: Tokenizer, cfg: RunConfig, max_batches: int = 0,
    shard: Shard = WHOLE,
) -> dict[str, float]:
    """Loss, perplexity and bits per character over a token stream, in windows of the
    model's context."""
    return evaluate_stream(
        model, ids, tokenizer, context=cfg.model.context, batch_size=cfg.train.batch_size,
        max_batches=max_batches, shard=shard,
    )
