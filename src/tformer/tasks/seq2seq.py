"""The translation family's task: parallel pairs in token-count batches, label-smoothed
loss for training, plain cross-entropy for validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from tformer.config import RunConfig
from tformer.data.parallel import (
    ParallelData,
    Seq2SeqBatch,
    TokenBatches,
)
from tformer.data.tokenizers import Tokenizer
from tformer.errors import TformerError
from tformer.evaluation.shard import WHOLE, Shard
from tformer.evaluation.translation import evaluate_loss
from tformer.models.seq2seq import label_smoothed_loss


class Seq2SeqTask:
    """`cache` is accepted like the other families' tasks but unused: the pairs are
    tokenized in memory, which takes seconds for Multi30k."""

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer | None = None, *, cache: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.data = ParallelData(cfg.data, tokenizer)
        self.tokenizer = self.data.tokenizer
        if cfg.data.max_len > cfg.model.max_len:
            raise TformerError(
                f"data.max_len = {cfg.data.max_len} is longer than model.max_len = "
                f"{cfg.model.max_len}, the positions the model has; lower data.max_len"
            )

    def model_fields(self) -> dict[str, Any]:
        return self.data.model_fields()

    def train_batches(self, seed: int) -> TokenBatches:
        return TokenBatches(
            self.data.train_src, self.data.train_tgt, self.tokenizer,
            max_tokens=self.cfg.data.max_tokens, seed=seed,
        )

    def loss(
        self, model: nn.Module, batch: Seq2SeqBatch, carry: None
    ) -> tuple[Tensor, int, None]:
        """Pairs are independent: nothing is carried from one step to the next."""
        logits = model(batch.src, batch.src_real, batch.tgt_in)
        loss = label_smoothed_loss(logits, batch.tgt_out, self.cfg.model.label_smoothing)
        return loss, batch.num_tokens, None

    def new_carry(self) -> None:
        return None

    def save_carry(self, carry: None) -> None:
        return None

    def load_carry(self, saved: Any) -> None:
        return None

    def evaluate(
        self, model: nn.Module, max_batches: int = 0, shard: Shard = WHOLE
    ) -> dict[str, float]:
        return evaluate_loss(
            model, self.data.val_src, self.data.val_tgt, self.tokenizer,
            self.cfg.data.max_tokens, max_batches, shard,
        )
