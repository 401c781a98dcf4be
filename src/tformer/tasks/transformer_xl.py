"""The Transformer-XL family's task: ordered streams, a memory carried from batch to batch.

Training reads B streams segment by segment (tformer.data.streams); the memory one step
leaves is the context of the next. It is the task's carry: an explicit input and output of
`loss`, which the trainer keeps between steps, puts back when it skips a step, and saves
beside the stream position, so a resumed run computes what an uninterrupted one would have.
With train.accumulate = k, the k micro-batches of a step are k consecutive segments, each
attending over the memory its predecessor left. Under torchrun each process keeps the
memory of its own rows (its slice of the B streams); a run resumed with another number of
processes starts with an empty memory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tformer.config import RunConfig
from tformer.data.lm import LMData
from tformer.data.streams import StreamBatch, TrainStreams, eval_streams
from tformer.data.tokenizers import IGNORE_INDEX, Tokenizer
from tformer.evaluation.lm import count_chars, lm_loss, lm_metrics
from tformer.evaluation.shard import WHOLE, Shard
from tformer.models.transformer_xl import Memory
from tformer.training.distributed import from_environment

log = logging.getLogger(__name__)


def process_slot() -> tuple[int, int]:
    """(rank, world size) under torchrun, else (0, 1): which rows of each batch this process
    trains on, and so which streams its memory belongs to."""
    procs = from_environment()
    return procs.rank, procs.world_size


class TransformerXLTask:
    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer | None = None, *, cache: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.data = LMData(cfg.data, tokenizer, cache=cache)
        self.tokenizer = self.data.tokenizer

    def model_fields(self) -> dict[str, Any]:
        return self.data.model_fields()

    def train_batches(self, seed: int) -> TrainStreams:
        return TrainStreams(
            self.data.train_ids, self.cfg.train.batch_size, self.cfg.model.context, seed
        )

    def new_carry(self) -> Memory:
        return Memory(self.cfg.model.mem_len)

    def loss(
        self, model: nn.Module, batch: StreamBatch, memory: Memory
    ) -> tuple[Tensor, int, Memory]:
        """The segment's loss, attending over `memory`; returns the memory it leaves. The
        memory handed in is not changed, so the caller can go back to it."""
        memory = memory.copy()
        if batch.first:  # the streams start over (a new epoch)
            memory.clear()
        if memory.length and memory.rows != batch.tokens.shape[0]:
            # Resumed with another train.batch_size: the rows are other streams.
            log.warning("the saved memory is for other streams; starting with an empty one")
            memory.clear()
        if memory.states and memory.states[0].device != batch.tokens.device:
            # Restored from a checkpoint, which is read onto the CPU.
            memory.states = [m.to(batch.tokens.device) for m in memory.states]
        logits = model(batch.tokens, memory=memory)
        return lm_loss(logits, batch.targets), batch.num_tokens, memory

    def save_carry(self, memory: Memory) -> dict[str, Any]:
        return {"memory": memory.state_dict(), "memory_owner": process_slot()}

    def load_carry(self, saved: dict[str, Any] | None) -> Memory:
        memory = self.new_carry()
        if not saved or "memory" not in saved:
            return memory
        if tuple(saved.get("memory_owner", (0, 1))) == process_slot():
            memory.load_state_dict(saved["memory"])
        else:
            # Another number of processes: this process's rows are other streams.
            log.warning("resuming with another number of processes: the memory starts empty")
        return memory

    def evaluate(
        self, model: nn.Module, max_batches: int = 0, shard: Shard = WHOLE
    ) -> dict[str, float]:
        return evaluate_text(
            model, self.data.val_ids, self.tokenizer, self.cfg, max_batches, shard
        )


@torch.no_grad()
def evaluate_text(
    model: nn.Module, ids: np.ndarray, tokenizer: Tokenizer, cfg: RunConfig, max_batches: int = 0,
    shard: Shard = WHOLE,
) -> dict[str, float]:
    """Loss, perplexity and bits per character over a token stream, read as
    train.batch_size ordered streams in segments of model.context, each carrying a memory of
    model.eval_mem_len (default model.mem_len) positions.

    Every token but the first is predicted once; the first segment of each stream starts
    with an empty memory. max_batches: stop after this many segments (0: all).
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    memory = Memory(cfg.model.memory_for_eval, cache_keys=True)
    total_nll, n_tokens, n_chars = 0.0, 0, 0
    for i, batch in enumerate(eval_streams(ids, cfg.train.batch_size, cfg.model.context)):
        if max_batches and i >= max_batches:
            break
        batch, counts = shard.rows(batch)  # the same streams, and memory rows, every time
        batch = batch.to(device)
        logits = model(batch.tokens, memory=memory)
        nll = float(lm_loss(logits, batch.targets, reduction="sum"))
        if counts:
            total_nll += nll
            n_tokens += int((batch.targets != IGNORE_INDEX).sum())
            n_chars += count_chars(batch.targets.cpu(), tokenizer)
    model.train(was_training)
    total_nll, n_tokens, n_chars = shard.total(total_nll, n_tokens, n_chars)
    return lm_metrics(total_nll, int(n_tokens), int(n_chars))
