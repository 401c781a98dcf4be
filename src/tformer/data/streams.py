"""Ordered batching for recurrent-memory models (Transformer-XL): one token stream cut into
B parallel streams that are read in order, so that row b of batch t+1 continues row b of
batch t and a memory carried from one batch to the next holds the text just before.

Shapes: B batch (streams), T segment length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tformer.data.lm import check_stream_length
from tformer.data.tokenizers import IGNORE_INDEX
from tformer.errors import TformerError


@dataclass
class StreamBatch:
    tokens: Tensor
    """(B, T) inputs: the next segment of each stream."""
    targets: Tensor
    """(B, T) the next token at each position; IGNORE_INDEX past a stream's end."""
    first: bool
    """The streams start here: a memory from earlier batches does not belong to them."""

    def to(self, device: torch.device) -> StreamBatch:
        return StreamBatch(self.tokens.to(device), self.targets.to(device), self.first)

    @property
    def num_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def _segment(ids: np.ndarray, starts: np.ndarray, start: int, length: int) -> StreamBatch:
    offsets = starts[:, None] + start + np.arange(length + 1)
    window = torch.from_numpy(ids[offsets].astype(np.int64))
    return StreamBatch(window[:, :-1], window[:, 1:], first=start == 0)


class TrainStreams:
    """Endless training batches: each epoch cuts the stream into B equal streams and reads
    them segment by segment; a stream's tail shorter than a segment is left out.

    Every epoch after the first starts at an offset in [0, T) drawn from (seed, epoch), so the
    segment boundaries move from epoch to epoch. Its whole state is (epoch, segment), saved in
    checkpoints for exact resume.
    """

    def __init__(self, ids: np.ndarray, batch_size: int, segment_len: int, seed: int) -> None:
        if len(ids) < batch_size * segment_len + segment_len + 1:
            raise TformerError(
                f"the training split has {len(ids)} tokens, too few for {batch_size} streams "
                f"of at least one segment of {segment_len} (train.batch_size x model.context); "
                f"use more data or smaller values"
            )
        self.ids = ids
        self.batch_size = batch_size
        self.segment_len = segment_len
        self.seed = seed
        self.epoch = 0
        self.segment = 0

    def _layout(self) -> tuple[np.ndarray, int]:
        """This epoch's stream starts (B,) and its number of segments."""
        offset = 0
        if self.epoch > 0:
            offset = int(np.random.default_rng([self.seed, self.epoch]).integers(self.segment_len))
        stream_len = (len(self.ids) - offset - 1) // self.batch_size
        starts = offset + stream_len * np.arange(self.batch_size)
        return starts, stream_len // self.segment_len

    def __iter__(self) -> Iterator[StreamBatch]:
        return self

    def __next__(self) -> StreamBatch:
        starts, n_segments = self._layout()
        if self.segment >= n_segments:
            self.epoch, self.segment = self.epoch + 1, 0
            starts, n_segments = self._layout()
        batch = _segment(self.ids, starts, self.segment * self.segment_len, self.segment_len)
        self.segment += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "segment": self.segment}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.segment = int(state["epoch"]), int(state["segment"])


def eval_streams(ids: np.ndarray, batch_size: int, segment_len: int) -> Iterator[StreamBatch]:
    """Batches that predict every token of the stream but the first exactly once, in B
    ordered streams of (nearly) equal length; rows that end early are padded with target
    IGNORE_INDEX (right padding: earlier positions never see it)."""
    check_stream_length(ids, 1, "evaluation")
    n_targets = len(ids) - 1
    batch_size = min(batch_size, n_targets)
    lengths = np.full(batch_size, n_targets // batch_size)
    lengths[: n_targets % batch_size] += 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    longest = int(lengths[0])
    for start in range(0, longest, segment_len):
        width = min(segment_len, longest - start)
        tokens = np.zeros((batch_size, width), dtype=np.int64)
        targets = np.full((batch_size, width), IGNORE_INDEX, dtype=np.int64)
        for b in range(batch_size):
            n = int(min(width, lengths[b] - start))
            if n > 0:
                row = ids[starts[b] + start : starts[b] + start + n + 1].astype(np.int64)
                tokens[b, :n], targets[b, :n] = row[:-1], row[1:]
        yield StreamBatch(torch.from_numpy(tokens), torch.from_numpy(targets), first=start == 0)
