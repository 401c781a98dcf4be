"""One process's share of an evaluation, and how the shares' sums are combined.

Under torchrun every process evaluates its own slice of the rows of every validation batch
and the sums (loss, tokens, characters) are added across processes before the metrics are
computed, so the result equals a single process's (up to the order of floating-point sums)
in a 1/N of the time. Every process runs a forward pass for every batch, as FSDP requires;
a process whose slice of a small batch is empty runs one row that counts for nothing.

Work whose forward passes depend on the data, like decoding (a batch stops when its
sentences end), can be split only where the processes need not run the same passes (DDP,
whose evaluation runs the bare model). There each process decodes every N-th item and the
results are gathered (`Shard.map`); under FSDP, where `gather` is None, every process does
all of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def _keep(totals: Tensor) -> Tensor:
    return totals


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1
    reduce: Callable[[Tensor], Tensor] = _keep
    """Sums a tensor of totals over the shards (in place or not); identity for one."""
    gather: Callable[[Any], list[Any]] | None = None
    """Every shard's object, in shard order, given this shard's own; None where every shard
    must run the same forward passes (FSDP)."""

    def rows(self, batch: Any) -> tuple[Any, bool]:
        """(this shard's rows of a batch dataclass, whether they count). Every batch-first
        tensor field is sliced the same way; a shard left with no rows gets row 0, to be
        ignored, so that every process still runs the same forward passes."""
        if self.count == 1:
            return batch, True
        changes, counts = {}, True
        for field in dataclasses.fields(batch):
            value = getattr(batch, field.name)
            if isinstance(value, Tensor) and value.dim() > 0:
                part = value.tensor_split(self.count)[self.index]
                if part.shape[0] == 0:
                    part, counts = value[:1], False
                changes[field.name] = part
        return dataclasses.replace(batch, **changes), counts

    def map(self, fn: Callable[[Sequence[Any]], list[Any]], items: Sequence[Any]) -> list[Any]:
        """fn(items), one result per item, on every shard. With `gather`, each shard runs fn
        over every count-th item only (from its index on) and the parts are interleaved
        back into the order of `items`."""
        if self.count == 1 or self.gather is None:
            return fn(items)
        parts = self.gather(fn(items[self.index :: self.count]))
        out: list[Any] = [None] * len(items)
        for index, part in enumerate(parts):
            out[index :: self.count] = part
        return out

    def total(self, *values: float) -> list[float]:
        """Sum each value over the shards."""
        totals = torch.tensor(values, dtype=torch.float64)
        return self.reduce(totals).tolist()


WHOLE = Shard()
