"""Language-model metrics: loss (nats per token), perplexity, bits per character, over
independent windows (GPT) or over ordered segments that carry a memory (Transformer-XL)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import Tensor, nn

from tformer.data.lm import LMBatch, sequential_windows
from tformer.data.streams import StreamBatch, eval_streams
from tformer.data.tokenizers import IGNORE_INDEX, Tokenizer
from tformer.evaluation.loss import Targets
from tformer.evaluation.shard import WHOLE, Shard
from tformer.models.transformer_xl import Memory


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
    model: nn.Module, batches: Iterable[LMBatch | StreamBatch], tokenizer: Tokenizer,
    max_batches: int = 0, progress: Callable[[int], None] | None = None, shard: Shard = WHOLE,
    forward: Callable[..., Tensor] | None = None,
) -> dict[str, float]:
    """Summed loss over batches (by default of independent windows, GPT-style models);
    `shard`: this process's rows of each batch, the sums then added over processes.
    progress: called with the number of tokens this process predicted after each batch.
    forward: (B, T) tokens, targets=Targets -> their loss, when the model needs more than the
    tokens (a memory); default: the loss of model(tokens) (Targets.score)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    if forward is None:
        def forward(tokens: Tensor, targets: Targets) -> Tensor:
            return targets.score(model, tokens)
    total_nll, n_tokens, n_chars = 0.0, 0, 0
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        batch, counts = shard.rows(batch)  # the same rows every time (memory rows too)
        batch = batch.to(device)
        nll = float(forward(batch.tokens, targets=Targets(batch.targets, reduction="sum")))
        if counts:
            batch_tokens = int((batch.targets != IGNORE_INDEX).sum())
            total_nll += nll
            n_tokens += batch_tokens
            n_chars += count_chars(batch.targets.cpu(), tokenizer)
            if progress is not None:
                progress(batch_tokens)
    model.train(was_training)
    total_nll, n_tokens, n_chars = shard.total(total_nll, n_tokens, n_chars)
    return lm_metrics(total_nll, int(n_tokens), int(n_chars))


def evaluate_stream(
    model: nn.Module, ids: np.ndarray, tokenizer: Tokenizer, *, context: int, batch_size: int,
    max_batches: int = 0, shard: Shard = WHOLE, progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Every token of a stream but the first, predicted once from windows of `context`."""
    return evaluate_batches(
        model, sequential_windows(ids, batch_size, context), tokenizer, max_batches,
        progress=progress, shard=shard,
    )


@torch.no_grad()
def evaluate_segments(
    model: nn.Module, ids: np.ndarray, tokenizer: Tokenizer, *, segment_len: int, mem_len: int,
    batch_size: int, max_batches: int = 0, shard: Shard = WHOLE,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Every token of a stream but the first, predicted once by a model with a recurrence
    memory (Transformer-XL): the stream is read as `batch_size` ordered streams in segments of
    `segment_len`, each attending over a memory of the last `mem_len` positions.

    The first segment of each stream starts with an empty memory. max_batches: stop after
    this many segments (0: all). shard: this process's rows (streams) of every segment.
    progress: called with the tokens of each batch.
    """
    memory = Memory(mem_len, cache_keys=True)
    return evaluate_batches(
        model, eval_streams(ids, batch_size, segment_len), tokenizer, max_batches,
        progress=progress, shard=shard, forward=lambda tokens, targets: model(
            tokens, memory=memory, targets=targets),
    )
