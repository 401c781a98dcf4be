"""A model's KV cache as rows, one per text being decoded: continuous batching's cache
(serving/scheduler.py), and the rows a speculative round extends and rolls back
(decoding/speculative.py). `Rows` is what a round asks of them; `SlotPool` (many rows,
rejected columns masked) and `OneRow` (one text, rejected positions cut off) give it.
`Seats` keeps the order of rows that several pools and a list share.

Shapes: n occupied rows, W cache columns in use, T new tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor, nn

from tformer.decoding.lm import left_pad
from tformer.decoding.runner import runner
from tformer.layers import DecoderCache

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



class SlotPool:
    """A KV cache of `capacity` rows, the first n of them occupied by the sequences in
    flight, in that order.

    All rows share one column clock W: a step writes every row's new keys at column W.
    Rows differ in which columns hold their tokens; `is_real` marks them, and the model
    masks the rest and numbers positions by counting real tokens, so a row decodes as it
    would alone. A joining sequence writes its prompt at columns 0..P-1 of a free row (and
    moves the clock to P if it was behind); a leaving one is replaced by the last row. When
    the clock reaches the end of the buffer, or runs far ahead of the longest row, every
    row's real columns are gathered to the right of a narrower window.

    Invariant: columns >= W hold no real token in any row.
    """

    def __init__(self, model: nn.Module, capacity: int) -> None:
        self.model = runner(model)
        self.device = next(model.parameters()).device
        self.context = model.cfg.context
        self.capacity = capacity
        self.rows = 0
        self.width = 0
        self.read: list[int] = []
        """Per occupied row: how many tokens of its text it has read (`Rows.read`)."""
        self._held: list[int] = []
        """Per occupied row: its real columns (what `is_real` counts, without reading it)."""
        self._view: tuple[DecoderCache, int, DecoderCache] | None = None
        # The buffers grow (rows and columns, doubling) as the load asks, up to `capacity`
        # rows of `context` columns: GPT-2 small at 64 x 1024 would hold 4.8 GB from the
        # start.
        self.pool, self.is_real = self._allocate(min(capacity, 4), min(self.context, 64))

    def _allocate(self, rows: int, columns: int) -> tuple[DecoderCache, Tensor]:
        pool = self.model.make_cache(rows, columns, padded=True)
        pool.reserve(columns)
        # Unused columns are read (then masked): they must hold finite numbers, since a
        # masked NaN still spreads through 0 * NaN.
        for layer in pool.self_attn:
            layer.k.zero_()
            layer.v.zero_()
        assert pool.is_real is not None
        pool.is_real.zero_()
        return pool, pool.is_real

    def _reserve(self, rows: int, columns: int) -> None:
        """Grow the buffers to hold at least `rows` rows of `columns` columns."""
        have_rows, have_columns = self.is_real.shape
        if rows <= have_rows and columns <= have_columns:
            return
        if rows > have_rows:
            rows = min(self.capacity, max(rows, 2 * have_rows))
        if columns > have_columns:
            columns = min(self.context, max(columns, 2 * have_columns))
        new_rows, new_columns = max(rows, have_rows), max(columns, have_columns)
        pool, is_real = self._allocate(new_rows, new_columns)
        n, W = self.rows, self.width
        for old, new in zip(self.pool.self_attn, pool.self_attn, strict=True):
            new.k[:n, :, :W] = old.k[:n, :, :W]
            new.v[:n, :, :W] = old.v[:n, :, :W]
        is_real[:n, :W] = self.is_real[:n, :W]
        self.pool, self.is_real = pool, is_real

    def prefill(self, prompts: list[list[int]], *, every_position: bool = False,
                read: list[int] | None = None) -> Tensor:
        """Read prompts into the next free rows, in one forward pass; return their (k, V)
        last-position logits, or with `every_position` all (k, P, V). read: how much of
        each row's text the prompt stands for (default: its length; more where the prompt
        is a long text's last tokens).

        The prompts are left-padded to a common length P, so each row's last token sits in
        column P - 1, where the model's last-position logits are read.
        """
        first, k = self.rows, len(prompts)
        assert first + k <= self.capacity, "not enough free rows"
        device = self.is_real.device
        read = read if read is not None else [len(p) for p in prompts]
        if not any(prompts):  # rows that start empty (a text of one token, its last unread)
            self._reserve(first + k, self.width)
            self.is_real[first:first + k] = False
            self.rows += k
            self.read += read
            self._held += [0] * k
            return torch.empty(k, 0, device=device)
        ids, real = left_pad(prompts, pad_id=0)
        P = ids.shape[1]
        self._reserve(first + k, max(P, self.width))
        rows = slice(first, first + k)
        self.is_real[rows] = False
        padded = not bool(real.all())
        cache = self.pool.narrow(rows, 0)
        if not padded:
            cache.is_real = None  # one prompt, or equal lengths: the plain causal pass
        logits = self.model(ids.to(device), real.to(device) if padded else None, cache=cache,
                            last_only=not every_position)
        self.is_real[rows, :P] = real.to(device)
        self.rows += k
        self.read += read
        self._held += [len(p) for p in prompts]
        self.width = max(self.width, P)
        return logits if every_position else logits[:, -1]

    def step(self, last_tokens: list[int]) -> Tensor:
        """One new token per occupied row -> (n, V) logits for the next ones."""
        tokens = torch.tensor(last_tokens, device=self.is_real.device)[:, None]
        real = torch.ones_like(tokens, dtype=torch.bool)
        return self.extend(tokens, real, last_only=True)[:, -1]

    def extend(self, tokens: Tensor, real: Tensor, *, last_only: bool = False) -> Tensor:
        """(n, T) new tokens per occupied row, False in `real` where a row has none ->
        (n, T, V) logits, or (n, 1, V) with `last_only`. The caller makes sure that every
        row's real tokens, the new ones included, fit in the context."""
        n, T = tokens.shape
        longest = max(self._held)
        if self.width + T > self.context or self.width > 2 * longest + 16:
            self.compact(longest)
        self._reserve(n, self.width + T)
        logits = self.model(tokens, real, cache=self._occupied(n), last_only=last_only)
        self.width += T
        counts = real.sum(1).tolist()
        self.read = [r + t for r, t in zip(self.read, counts, strict=True)]
        self._held = [h + t for h, t in zip(self._held, counts, strict=True)]
        return logits

    def held(self) -> int:
        return max(self._held, default=0)

    def _occupied(self, n: int) -> DecoderCache:
        """The cache of the first n rows at the clock, a view of the buffers. Kept from call
        to call while the buffers and n stay (a new view each step would cost a kernel step
        its prepared pointers, kernels/step.py)."""
        view = self._view
        if view is None or view[0] is not self.pool or view[1] != n:
            self._view = view = (self.pool, n, self.pool.narrow(slice(0, n), self.width))
        for c in view[2].self_attn:
            c.length = self.width
        return view[2]

    def truncate(self, kept: Tensor, written: int) -> None:
        """Row i keeps the first kept[i] of the `written` columns the last `extend` wrote:
        speculation's rollback of the drafts a row rejected."""
        n, W = self.rows, self.width
        columns = torch.arange(written, device=kept.device)
        written_real = self.is_real[:n, W - written : W]
        before = written_real.sum(1)
        written_real &= columns[None] < kept[:, None]
        dropped = (before - written_real.sum(1)).tolist()
        self.read = [r - d for r, d in zip(self.read, dropped, strict=True)]
        self._held = [h - d for h, d in zip(self._held, dropped, strict=True)]

    def clear(self) -> None:
        """Free every row."""
        self.rows = self.width = 0
        self.read, self._held = [], []
        self.is_real.zero_()

    def compact(self, longest: int) -> None:
        """Gather each row's real columns, in order, into the last `longest` columns of a
        window of that width."""
        n, W = self.rows, self.width
        # A stable sort of "is real" puts each row's padding first and its tokens after it,
        # in their order; the last `longest` entries hold every real column.
        order = torch.argsort(self.is_real[:n, :W].to(torch.int8), dim=1, stable=True)
        index = order[:, W - longest :]
        real = self.is_real[:n].gather(1, index)
        for layer in self.pool.self_attn:
            for buf in (layer.k, layer.v):
                H, d = buf.shape[1], buf.shape[3]
                moved = buf[:n].gather(2, index[:, None, :, None].expand(n, H, longest, d))
                buf[:n, :, :longest] = moved
        self.is_real[:n] = False
        self.is_real[:n, :longest] = real
        self.width = longest

    def remove(self, row: int) -> None:
        """Free a row; the last occupied row moves into it (the caller moves its sequence
        the same way)."""
        last = self.rows - 1
        if row != last:
            W = self.width
            for layer in self.pool.self_attn:
                layer.k[row, :, :W] = layer.k[last, :, :W]
                layer.v[row, :, :W] = layer.v[last, :, :W]
            self.is_real[row] = self.is_real[last]
            self.read[row] = self.read[last]
            self._held[row] = self._held[last]
        self.is_real[last] = False
        self.read.pop()
        self._held.pop()
        self.rows = last
        if self.rows == 0:
            self.width = 0


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
    one text, else a `SlotPool`."""
    if len(texts) == 1:
        return OneRow(model, texts[0])
    pool = SlotPool(model, len(texts))
    pool.prefill([t[-pool.context:] for t in texts], read=[len(t) for t in texts])
    return pool


class Seats(Generic[Item]):
    """The order of rows shared by several pools (a target's and its drafter's) and a list
    of what sits in them (the sequences in flight): item i in row i of every pool. A
    leaving item's row is taken by the last one, in all of them at once."""

    def __init__(self, pools: list[SlotPool]) -> None:
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
