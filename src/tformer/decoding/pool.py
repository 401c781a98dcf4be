"""A KV cache as a pool of rows, one per text being decoded: continuous batching's cache
(serving/scheduler.py), and the rows a speculative round extends and rolls back
(decoding/speculative.py).

Shapes: n occupied rows, W cache columns in use, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tformer.decoding.lm import left_pad
from tformer.layers import DecoderCache


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
        self.model = model
        self.context = model.cfg.context
        self.capacity = capacity
        self.rows = 0
        self.width = 0
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

    @property
    def device(self) -> torch.device:
        return self.is_real.device

    def prefill(self, prompts: list[list[int]], *, every_position: bool = False) -> Tensor:
        """Read prompts into the next free rows, in one forward pass; return their (k, V)
        last-position logits, or with `every_position` all (k, P, V).

        The prompts are left-padded to a common length P, so each row's last token sits in
        column P - 1, where the model's last-position logits are read.
        """
        first, k = self.rows, len(prompts)
        assert first + k <= self.capacity, "not enough free rows"
        device = self.is_real.device
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
        longest = int(self.is_real[:n].sum(1).max())
        if self.width + T > self.context or self.width > 2 * longest + 16:
            self.compact(longest)
        self._reserve(n, self.width + T)
        cache = self.pool.narrow(slice(0, n), self.width)
        logits = self.model(tokens, real, cache=cache, last_only=last_only)
        self.width += T
        return logits

    def truncate(self, kept: Tensor, written: int) -> None:
        """Row i keeps the first kept[i] of the `written` columns the last `extend` wrote:
        speculation's rollback of the drafts a row rejected."""
        n, W = self.rows, self.width
        columns = torch.arange(written, device=kept.device)
        self.is_real[:n, W - written : W] &= columns[None] < kept[:, None]

    def clear(self) -> None:
        """Free every row."""
        self.rows = self.width = 0
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
        self.is_real[last] = False
        self.rows = last
        if self.rows == 0:
            self.width = 0
