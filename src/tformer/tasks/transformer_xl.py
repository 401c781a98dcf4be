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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor, nn

from tformer.data.lm import LMData
from tformer.data.streams import StreamBatch, TrainStreams
from tformer.data.tokenizers import Tokenizer
from tformer.errors import TformerError
from tformer.evaluation.lm import evaluate_segments
from tformer.evaluation.loss import Targets
from tformer.evaluation.shard import WHOLE, Shard
from tformer.models.transformer_xl import Memory
from tformer.tasks.lm import evaluate_lm_checkpoint, with_batch_size
from tformer.training.distributed import from_environment

if TYPE_CHECKING:  # the config module reads configs through the registry, which imports tasks
    from tformer.config import RunConfig

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
        loss = model(batch.tokens, memory=memory, targets=Targets(batch.targets))
        return loss, batch.num_tokens, memory

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
        self, model: nn.Module, max_batches: int = 0, shard: Shard = WHOLE, index: int = 0
    ) -> dict[str, float]:
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
    """Metrics over a token stream read as train.batch_size ordered streams in segments of
    model.context, with a memory of model.eval_mem_len (default model.mem_len) positions;
    shard: this process's streams; progress: called with the tokens of each batch. The
    result repeats the segment length, memory and number of streams it read with."""
    result = evaluate_segments(
        model, ids, tokenizer, segment_len=cfg.model.context, mem_len=cfg.model.memory_for_eval,
        batch_size=cfg.train.batch_size, max_batches=max_batches, shard=shard, progress=progress,
    )
    settings = {"segment_len": cfg.model.context, "mem_len": cfg.model.memory_for_eval,
                "streams": min(cfg.train.batch_size, max(len(ids) - 1, 1))}
    return {**result, **settings}


def evaluate_checkpoint(
    checkpoint: Any, data: list[str], options: dict[str, Any], *, batch_size: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """The registry's evaluate: metrics over a text file, or the run's validation split.

    options: mem_len and segment_len, the memory and segment length to evaluate with (they
    need not be the trained ones; Dai et al. 2019 evaluate with a longer memory).
    """
    cfg = with_batch_size(checkpoint.cfg, batch_size)
    mem_len, segment_len = options.get("mem_len"), options.get("segment_len")
    if mem_len is not None:
        if mem_len < 0:
            raise TformerError(f"--mem-len {mem_len} must be 0 (no memory) or more")
        cfg = cfg.replace("model", eval_mem_len=mem_len)
    if segment_len is not None:
        if segment_len < 1:
            raise TformerError(f"--segment-len {segment_len} must be at least 1")
        cfg = cfg.replace("model", context=segment_len)
    return evaluate_lm_checkpoint(checkpoint, data, cfg, evaluate_text, progress)
