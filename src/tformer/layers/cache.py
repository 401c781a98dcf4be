"""The state a decoder keeps between steps, and how a step attends over it.

Shapes: N rows (hypotheses), H heads, T new queries, S cached positions, d query/key size per
head, d_value value size per head.

A cache knows how its keys lie, so it decides how a step reads them: attention hands it the
step's queries and new keys and values and the layer itself (`MultiHeadAttention`), whose
`attend` is the plain computation. Where a kernel computes the same thing faster from the
cache's layout (kernels/attend.py: a one-query step that reads the keys where a Lineage says,
or beams that share their sentence's encoder output), the cache runs it; otherwise it hands
the layer's `attend` everything stored so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from tformer.kernels.attend import attend_step, gather_positions, serves


class Attention(Protocol):
    """What a cache needs of the attention layer it serves (layers.MultiHeadAttention)."""

    @property
    def is_plain(self) -> bool:
        """Whether attention is exactly softmax(q k^T / sqrt(d) + mask) v (evaluation,
        nothing recorded), so that a kernel computing the same may stand in for it."""
        ...

    @property
    def is_inference(self) -> bool:
        """Whether nothing is dropped or recorded (a kernel that also takes the attention's
        scale, soft cap and sinks may stand in)."""
        ...

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False
    ) -> Tensor:
        """(N, H, T, d), (N, H_kv, S, d), (N, H_kv, S, d_value) -> (N, H, T, d_value)."""
        ...

    def attend_shared(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """`attend` where each of N' key rows serves N/N' consecutive query rows."""
        ...


class LayerKV(Protocol):
    """One layer's keys and values as its attention reads them, through one method: a
    KVCache (a contiguous buffer per row), or a paged pool's blocks (decoding/paged.py's
    PagedLayer)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
               attention: Attention) -> Tensor:
        """Store the step's new keys and values and attend with q over every position held
        and them: (N, H, T, d) -> (N, H, T, d_value)."""
        ...


class KVView(Protocol):
    """What a decoder-only model's forward reads of its cache (models/gpt.py): a
    DecoderCache, or the view of a paged pool's rows in one pass (decoding/paged.py's
    PagedView)."""

    length: int
    """Positions held before the pass (the longest row's; shorter rows' are padding)."""
    is_real: Tensor | None
    """(N, >= length + T) which positions are a row's own, None where all are."""
    self_attn: Sequence[LayerKV]
    lineage: Lineage | None
    step: object | None
    """A one-call kernel step over this cache (kernels/step.py), or None."""


def _steps_natively(q: Tensor, k: Tensor, attention: Attention) -> bool:
    """Whether a one-query step runs kernels/attend.py's kernel: one key head per query
    head (its layout; grouped-query heads take torch's path), nothing recorded or dropped."""
    return q.shape[2] == 1 and k.shape[1] == q.shape[1] and attention.is_plain and serves(q)


class Lineage:
    """Where each hypothesis' cached positions lie, for KV caches that beam search never copies.

    A reorder would copy every layer's cache into the surviving hypotheses' order at every
    step. Instead, position s of a step's new keys is written to buffer row i (the i-th
    hypothesis then) and stays there, and rows[i, s] says which buffer row holds position s
    of hypothesis i's history: a reorder reorders this table (N x positions int64, one for
    all layers) instead of the caches, and attention reads the keys through it
    (kernels/attend.py). Positions not written yet map each row to itself.
    """

    def __init__(self, batch: int, max_len: int, device: torch.device) -> None:
        self.rows = torch.arange(batch, device=device)[:, None].repeat(1, max_len)

    def reorder(self, index: Tensor, filled: int) -> None:
        """Hypothesis i now continues hypothesis index[i]; `filled` positions are written."""
        rows = self.rows.index_select(0, index)
        rows[:, filled:] = torch.arange(len(index), device=rows.device)[:, None]
        self.rows = rows


class KVCache:
    """Preallocated keys and values of one attention layer, filled as decoding goes on.

    Appending writes into a fixed buffer (no torch.cat per token). Beam search's choice of
    surviving hypotheses is followed in one of two ways:
    - with a `lineage` (shared by a decoder's layers), nothing is copied: new positions go to
      the buffer rows of the hypotheses' current order and the lineage records where each
      hypothesis' earlier positions are (attention reads through it, kernels/attend.py);
    - without one, `reorder` copies the positions filled so far into a second buffer that it
      keeps for this (the two swap at every reorder), so that a step allocates nothing and
      copies no position it has not reached.
    """

    def __init__(
        self,
        batch: int,
        n_head: int,
        max_len: int,
        d_head: int,
        d_value: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        lineage: Lineage | None = None,
        columns: int | None = None,
    ) -> None:
        columns = max_len if columns is None else min(columns, max_len)
        self.k = torch.empty(batch, n_head, columns, d_head, dtype=dtype, device=device)
        self.v = torch.empty(batch, n_head, columns, d_value, dtype=dtype, device=device)
        self.limit = max_len
        """The most positions it will hold: the buffers grow to it as positions arrive."""
        self.length = 0
        self.lineage = lineage
        self._spare: tuple[Tensor, Tensor] | None = None
        """reorder's destination: buffers shaped as k and v (made at the first reorder)."""
        self._borrowed = False
        """Whether k and v are someone else's buffers (`over`), never to be reordered into."""

    @classmethod
    def over(cls, k: Tensor, v: Tensor, length: int) -> KVCache:
        """A cache whose buffers are the given (B, H, max_len, ·) tensors (views, say, of a
        larger pool), holding `length` positions already."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.length, cache.lineage = k, v, length, None
        cache.limit = k.shape[2]
        cache._spare, cache._borrowed = None, True
        return cache

    @property
    def max_len(self) -> int:
        return self.limit

    def end_after(self, positions: int) -> int:
        """The length after storing `positions` more, the buffers grown to hold them;
        RuntimeError where they do not fit."""
        end = self.length + positions
        if end > self.max_len:
            raise RuntimeError(f"KV cache holds {self.max_len} positions; {end} requested")
        if end > self.k.shape[2]:
            self.reserve(end)
        return end

    def reserve(self, columns: int) -> None:
        """Grow the buffers to at least `columns` positions (by half again at least, so
        that growing one position at a time copies each position a few times in all),
        keeping what they hold: a cache holds what its sequences use, not their limit."""
        have = self.k.shape[2]
        if columns <= have:
            return
        if self._borrowed:
            raise RuntimeError(f"a KV cache over borrowed buffers holds {have} positions; "
                               f"{columns} requested")
        columns = min(self.limit, max(columns, have + have // 2))
        k = self.k.new_empty(*self.k.shape[:2], columns, self.k.shape[3])
        v = self.v.new_empty(*self.v.shape[:2], columns, self.v.shape[3])
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v, self._spare = k, v, None

    def store(self, k: Tensor, v: Tensor) -> None:
        """Write (N, H, T, ·) new keys/values after the positions stored so far: to the
        first N buffer rows (all of them, without a lineage)."""
        start, end = self.length, self.end_after(k.shape[2])
        rows = slice(None) if self.lineage is None else slice(0, k.shape[0])
        self.k[rows, :, start:end] = k
        self.v[rows, :, start:end] = v
        self.length = end

    def stored(self) -> tuple[Tensor, Tensor]:
        """Everything stored so far, in the rows' order: views of the buffers, or with a
        lineage, copies gathered through it."""
        if self.lineage is None:
            return self.k[:, :, : self.length], self.v[:, :, : self.length]
        rows = self.lineage.rows
        return (gather_positions(self.k, rows, self.length),
                gather_positions(self.v, rows, self.length))

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store (N, H, T, ·) new keys/values; return everything stored so far (`stored`)."""
        self.store(k, v)
        return self.stored()

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
        attention: Attention,
    ) -> Tensor:
        """Store the step's new keys and values and attend with q over everything stored:
        (N, H, T, d) -> (N, H, T, d_value)."""
        lineage = self.lineage
        if (lineage is not None and mask is None and q.shape[0] == lineage.rows.shape[0]
                and _steps_natively(q, k, attention)):
            # A decoding step over a cache that beam search never copies: the keys are read
            # where the lineage says. (A cache in query order gains nothing over SDPA, whose
            # matrix products are faster over long contexts.)
            self.store(k, v)
            out = attend_step(q[:, :, 0], self.k, self.v, self.length, rows=lineage.rows)
            return out[:, :, None]
        k, v = self.append(k, v)
        return attention.attend(q, k, v, mask, is_causal)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (beam search: the surviving hypotheses' parents), as many
        rows as the cache has or fewer (finished sentences leave)."""
        if self.lineage is not None:
            raise RuntimeError("a KV cache with a lineage is reordered through its lineage")
        rows, filled = len(index), self.length
        if self._spare is None or self._spare[0].shape[0] < rows:
            self._spare = (self.k.new_empty(rows, *self.k.shape[1:]),
                           self.v.new_empty(rows, *self.v.shape[1:]))
        k, v = self._spare[0][:rows], self._spare[1][:rows]
        torch.index_select(self.k[:, :, :filled], 0, index, out=k[:, :, :filled])
        torch.index_select(self.v[:, :, :filled], 0, index, out=v[:, :, :filled])
        self._spare = None if self._borrowed else (self.k, self.v)
        self.k, self.v, self._borrowed = k, v, False


def _bias_rows(mask: Tensor, rows: int, length: int, dtype: torch.dtype) -> Tensor | None:
    """A (rows, 1, 1, length) float key-padding bias as the (rows, length) that attend_step
    takes; None for any other mask."""
    if mask.dtype != dtype or mask.shape != (rows, 1, 1, length):
        return None
    return mask[:, 0, 0]


class StaticKV:
    """Keys and values computed once and reused at every step: cross-attention over the
    encoder's output. Beams of one sentence share it when its batch is smaller than the
    query batch."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def kept(self) -> tuple[Tensor, Tensor] | None:
        """The keys and values computed at the first step, or None before it."""
        return None if self.k is None or self.v is None else (self.k, self.v)

    def keep(self, sentences: Tensor) -> None:
        """Keep the rows of `sentences` (decoding drops the sentences that are finished).
        Beams need nothing here: the encoder output depends only on the source, which
        they share."""
        if self.k is not None and self.v is not None:
            self.k = self.k.index_select(0, sentences)
            self.v = self.v.index_select(0, sentences)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
        attention: Attention,
    ) -> Tensor:
        """Attend with q (N, H, T, d) over the memory's k, v (N' rows, N' dividing N), kept
        for the next steps: (N, H, T, d_value)."""
        self.k, self.v = k, v
        rows, shared = q.shape[0], k.shape[0]
        if shared == rows:
            return attention.attend(q, k, v, mask, is_causal)
        # Beams that share their sentence's keys read them in place; one row a sentence
        # gains nothing over SDPA (whose matrix products are faster over long sources).
        if rows % shared == 0 and _steps_natively(q, k, attention):
            bias = None if mask is None else _bias_rows(mask, shared, k.shape[2], q.dtype)
            if mask is None or bias is not None:
                return attend_step(q[:, :, 0], k, v, k.shape[2], bias=bias)[:, :, None]
        return attention.attend_shared(q, k, v, mask)


class DecoderCache:
    """Everything a decoder stack keeps between steps: one KVCache per layer, optional
    cross-attention StaticKVs, and which cached positions are real tokens (for padded
    batches). Beam search reorders all of it with one call a step."""

    def __init__(
        self,
        self_attn: list[KVCache],
        cross_attn: list[StaticKV] | None = None,
        *,
        track_padding: bool = False,
    ) -> None:
        self.self_attn = self_attn
        self.cross_attn = cross_attn or []
        first = self_attn[0]
        self.lineage = first.lineage
        if any(cache.lineage is not self.lineage for cache in self_attn):
            raise ValueError("the layers of a decoder cache share one lineage, or none")
        self.is_real: Tensor | None = None
        if track_padding:
            self.is_real = torch.ones(
                first.k.shape[0], first.max_len, dtype=torch.bool, device=first.k.device
            )
        self.step: object | None = None
        """Kept for the decoding runner that made the cache (tformer.decoding.runner): the
        model's layers prepared for one-call steps over these caches (kernels/step.py:
        Seq2Seq's DecoderStep, GPT's LMStep), or None (the model alone never sets it)."""

    @property
    def length(self) -> int:
        return self.self_attn[0].length

    @property
    def max_len(self) -> int:
        return self.self_attn[0].max_len

    def reserve(self, columns: int) -> None:
        """Grow every layer's buffers to at least `columns` positions."""
        for cache in self.self_attn:
            cache.reserve(columns)

    def narrow(self, rows: slice, length: int) -> DecoderCache:
        """A cache over some rows of this one, sharing its buffers, at `length` positions:
        what a pool of decoding slots hands the model for the rows it decodes."""
        if self.lineage is not None:
            raise ValueError("a decoder cache with a lineage cannot be narrowed")
        narrowed = DecoderCache(
            [KVCache.over(c.k[rows], c.v[rows], length) for c in self.self_attn]
        )
        if self.is_real is not None:
            narrowed.is_real = self.is_real[rows]
        narrowed.step = self.step
        return narrowed

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding's rejected drafts):
        the next step writes over them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot cut a cache of {self.length} positions to {length}")
        for cache in self.self_attn:
            cache.length = length

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """Keep target rows `index` (beam search: the surviving hypotheses' parents); with
        `sentences`, the cross-attention keeps only those sentences' encoder keys and
        values, the ones `index` still decodes (finished sentences leave the batch)."""
        if self.lineage is not None:
            self.lineage.reorder(index, self.length)
        else:
            for cache in self.self_attn:
                cache.reorder(index)
        if sentences is not None:
            for cache in self.cross_attn:
                cache.keep(sentences)
        if self.is_real is not None:
            self.is_real = self.is_real.index_select(0, index)
