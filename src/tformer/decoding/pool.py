"""A model's KV cache as rows, one per text being decoded: the rows a speculative round
extends and rolls back (decoding/speculative.py). `Rows` is what a round asks of them;
decoding/paged.py's `PagedPool` (many rows, each a list of blocks) and `OneRow` (one text,
its own contiguous cache) give it. `Seats` keeps the order of rows that several pools (a
target's and its drafter's) and a list share.

Shapes: n occupied rows, W cache columns in use, T new tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor, nn

from tformer.decoding.paged import PagedPool, blocks_for
from tformer.decoding.runner import runner

Item = TypeVar("Item")


class Rows(Protocol):
    """A model's cache rows, each continuing one text."""

    model: nn.Module
    """The model whose cache the rows are."""
    device: torch.device
    """Where the cache lies."""
    context: int
    """The most tokens a row may hold."""
    read: list[int]
    """Per row: how many tokens of its text it has read (a text longer than the context
    is read from its last `context` tokens)."""

    def extend(self, tokens: Tensor, real: Tensor, *, last_only: bool = False) -> Tensor:
        """(n, T) new tokens per row, False in `real` where a row has none -> (n, T, V)
        logits, or (n, 1, V) with `last_only`."""
        ...

    def truncate(self, kept: Tensor, written: int) -> None:
        """Row i keeps the first kept[i] (n,) of the `written` columns the last `extend`
        wrote: the rollback of drafts that were rejected."""
        ...

    def held(self) -> int:
        """The most tokens any row holds."""
        ...



class OneRow:
    """One text's cache rows (`Rows`) without padding: a rejected draft's positions are cut
    off and written over by the next step, and the model reads no mask (the fastest path
    at batch 1)."""

    def __init__(self, model: nn.Module, text: list[int]) -> None:
        self.model = model = runner(model)
        self.device = next(model.parameters()).device
        self.context: int = model.cfg.context
        self.cache = model.make_cache(1, self.context)
        if text:
            window = text[-self.context:]
            model(torch.tensor([window], device=self.device), None, cache=self.cache,
                  last_only=True)
        self.read = [len(text)]

    def extend(self, tokens: Tensor, real: Tensor, *, last_only: bool = False) -> Tensor:
        # (A single row's new tokens are all real: the round reads no padding for it.)
        logits = self.model(tokens, None, cache=self.cache, last_only=last_only)
        self.read[0] += tokens.shape[1]
        return logits

    def truncate(self, kept: Tensor, written: int) -> None:
        dropped = written - int(kept[0])
        self.cache.truncate(self.cache.length - dropped)
        self.read[0] -= dropped

    def held(self) -> int:
        return self.cache.length


def rows_for(model: nn.Module, texts: list[list[int]]) -> Rows:
    """Rows that have read these texts (each from its last `context` tokens): `OneRow` for
    one text, else a paged pool (decoding/paged.py) with room for each to fill the context
    (its blocks take memory only once written)."""
    if len(texts) == 1:
        return OneRow(model, texts[0])
    pool = PagedPool(model, len(texts) * blocks_for(model.cfg.context) + 1,
                     prefix_cache=False)
    pool.reach = pool.context  # a round may roll back over any of its passes
    for text in texts:
        pool.join(text)
    return pool


class Seats(Generic[Item]):
    """The order of rows shared by several pools (a target's and its drafter's) and a list
    of what sits in them (the sequences in flight): item i in row i of every pool. A
    leaving item's row is taken by the last one, in all of them at once."""

    def __init__(self, pools: list[PagedPool]) -> None:
        self.pools = pools
        self.items: list[Item] = []

    def remove(self, row: int) -> None:
        for pool in self.pools:
            pool.remove(row)
        last = self.items.pop()
        if row < len(self.items):
            self.items[row] = last

    def clear(self) -> None:
        for pool in self.pools:
            pool.clear()
        self.items.clear()
