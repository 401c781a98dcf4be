"""Language-model metrics: loss (nats per token), perplexity, bits per character."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.data.lm import LMBatch, sequential_windows
from tformer.data.tokenizers import IGNORE_INDEX, Tokenizer
from tformer.evaluation.shard import WHOLE, Shard


def lm_loss(logits: Tensor, targets: Tensor, *, reduction: str = "mean") -> Tensor:
    """Cross-entropy of (B, T, V) logits against (B, T) targets; IGNORE_INDEX targets
    (padding) count for nothing."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def lm_metrics(total_nll: float, n_tokens: int, n_chars: int) -> dict[str, float]:
    loss = total_nll / max(n_tokens, 1)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bpc": total_nll / math.log(2) / max(n_chars, 1),
        "tokens": n_tokens,
    }


def count_chars(targets: Tensor, tokenizer: Tokenizer) -> int:
    if tokenizer.kind == "char":
        return int((targets != IGNORE_INDEX).sum())
    return len(tokenizer.decode(targets[targets != IGNORE_INDEX].tolist()))


@torch.no_grad()
def evaluate_batches(
    model: nn.Module, batches: Iterable[LMBatch], tokenizer: Tokenizer, max_batches: int = 0,
    shard: Shard = WHOLE,
) -> dict[str, float]:
    """Summed loss over batches of independent windows (GPT-style models); `shard`: this
    process's rows of each batch, the sums then added over processes."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, n_tokens, n_chars = 0.0, 0, 0
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        batch, counts = shard.rows(batch)
        batch = batch.to(device)
        nll = float(lm_loss(model(batch.tokens), batch.targets, reduction="sum"))
        if counts:
            total_nll += nll
            n_tokens += int((batch.targets != IGNORE_INDEX).sum())
            n_chars += count_chars(batch.targets.cpu(), tokenizer)
    model.train(was_training)
    total_nll, n_tokens, n_chars = shard.total(total_nll, n_tokens, n_chars)
    return lm_metrics(total_nll, int(n_tokens), int(n_chars))


def evaluate_stream(
    model: nn.Module, ids: np.ndarray, tokenizer: Tokenizer, *, context: int, batch_size: int,
    max_batches: int = 0, shard: Shard = WHOLE,
) -> dict[str, float]:
    """Every token of a stream but the first, predicted once from windows of `context`."""
    return evaluate_batches(
        model, sequential_windows(ids, batch_size, context), tokenizer, max_batches, shard
    )
