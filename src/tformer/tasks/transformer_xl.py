"""The Transformer-XL family's task: ordered streams, a memory carried from batch to batch.

Training reads B streams segment by segment (tformer.data.streams); the memory of one step is
the context of the next. With train.accumulate = k, the k micro-batches of a step are k
consecutive segments, each attending over the memory its predecessor left.

The training memory is part of the data cursor: checkpoints store it beside the stream
position, so a resumed run computes what an uninterrupted one would have. Under torchrun
each process keeps the memory of its own rows (its slice of the B streams); a run resumed
with another number of processes starts with an empty memory.
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
from tformer.evaluation.loss import lm_loss
from tformer.models.transformer_xl import Memory
from tformer.tasks.lm import evaluate_lm_checkpoint, with_batch_size
from tformer.training.distributed import from_environment

if TYPE_CHECKING:  # the config module reads configs through the registry, which imports tasks
    from tformer.config import RunConfig

log = logging.getLogger(__name__)


class TrainSegments:
    """TrainStreams plus the memory that continues them, saved and restored together."""

    def __init__(self, streams: TrainStreams, memory: Memory) -> None:
        self.streams = streams
        self.memory = memory

    def __iter__(self) -> TrainSegments:
        return self

    def __next__(self) -> StreamBatch:
        batch = next(self.streams)
        if batch.first:
            self.memory.clear()
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {**self.streams.state_dict(), "memory": self.memory.state_dict(),
                "memory_owner": process_slot()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streams.load_state_dict(state)
        self.memory.clear()
        if tuple(state.get("memory_owner", (0, 1))) == process_slot():
            self.memory.load_state_dict(state["memory"])
        else:
            # Another number of processes: this process's rows are other streams.
            log.warning("resuming with another number of processes: the memory starts empty")


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
        self.memory = Memory(cfg.model.mem_len)
        """The training memory: what the last training batch left for the next one."""

    def model_fields(self) -> dict[str, Any]:
        return self.data.model_fields()

    def train_batches(self, seed: int) -> TrainSegments:
        self.memory.clear()
        streams = TrainStreams(
            self.data.train_ids, self.cfg.train.batch_size, self.cfg.model.context, seed
        )
        return TrainSegments(streams, self.memory)

    def loss(self, model: nn.Module, batch: StreamBatch) -> tuple[Tensor, int]:
        if self.memory.length and self.memory.rows != batch.tokens.shape[0]:
            # Resumed with another train.batch_size: the rows are other streams.
            log.warning("the saved memory is for other streams; starting with an empty one")
            self.memory.clear()
        if self.memory.states and self.memory.states[0].device != batch.tokens.device:
            # Restored from a checkpoint, which is read onto the CPU.
            self.memory.states = [m.to(batch.tokens.device) for m in self.memory.states]
        logits = model(batch.tokens, memory=self.memory)
        return lm_loss(logits, batch.targets), batch.num_tokens

    def evaluate(self, model: nn.Module, max_batches: int = 0) -> dict[str, float]:
        return evaluate_text(model, self.data.val_ids, self.tokenizer, self.cfg, max_batches)


def evaluate_text(
    model: nn.Module, ids: np.ndarray, tokenizer: Tokenizer, cfg: RunConfig, max_batches: int = 0
) -> dict[str, float]:

    """Metrics over a token stream read as train.batch_size ordered streams in segments of
    model.context, with a memory of model.eval_mem_len (default model.mem_len) positions."""
    return evaluate_segments(
        model, ids, tokenizer, segment_len=cfg.model.context, mem_len=cfg.model.memory_for_eval,
        batch_size=cfg.train.batch_size, max_batches=max_batches,
    )


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
    return evaluate_lm_checkpoint(checkpoint, data, cfg, evaluate_text)
