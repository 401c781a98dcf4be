"""Multi-head attention on torch's scaled_dot_product_attention, its masks and its KV cache.

Shapes: B batch, H heads, T query length, S key length, D model width,
d_head query/key size per head, d_value value size per head.

Masks are boolean "may attend" tensors (True = attend) that broadcast to (B, H, T, S); every
mask in the library is built by the functions in this file.

A decoding step of beam search (one query per row over a cache that follows the beams, or
over an encoder output the beams share; in inference, float32 on a CPU) runs
kernels/attend.py instead, which reads the keys where they lie (see Lineage).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.kernels.attend import attend_step, gather_positions, serves
from tformer.kernels.dropout import dropout, runs_natively

# --- masks ----------------------------------------------------------------------------------


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(T, S) mask where query i sits at absolute position S - T + i and sees keys <= it.

    With S > T the first S - T keys are earlier context (a KV cache, or XL memory) that every
    query may see.
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return k_pos <= q_pos


def padding_mask(key_is_real: Tensor) -> Tensor:
    """(B, S) "this key is a real token" -> (B, 1, 1, S) attention mask."""
    return key_is_real[:, None, None, :]


def lm_mask(key_is_real: Tensor | None, q_len: int, k_len: int, device: torch.device) -> Tensor:
    """Causal mask combined with a key-padding mask, as (B or 1, 1, T, S).

    A query always sees its own position, so that a padding query (say at the left of a
    left-padded prompt) has at least one key: a row with no key would make softmax produce
    NaN, and a NaN value leaks into real positions through 0 * NaN in the next layer.
    """
    mask = causal_mask(q_len, k_len, device)[None, None]
    if key_is_real is not None:
        mask = mask & padding_mask(key_is_real)
        diagonal = torch.zeros(q_len, k_len, dtype=torch.bool, device=device)
        diagonal[:, k_len - q_len :].fill_diagonal_(True)
        mask = mask | diagonal
    return mask


def attention_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A may-attend mask -> the float to add to attention scores: 0 where True, -inf where
    False (for attention written out by hand; SDPA takes the boolean mask itself)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


# --- the KV cache ---------------------------------------------------------------------------


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
    ) -> None:
        self.k = torch.empty(batch, n_head, max_len, d_head, dtype=dtype, device=device)
        self.v = torch.empty(batch, n_head, max_len, d_value, dtype=dtype, device=device)
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
        cache._spare, cache._borrowed = None, True
        return cache

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def end_after(self, positions: int) -> int:
        """The length after storing `positions` more; RuntimeError where they do not fit."""
        end = self.length + positions
        if end > self.max_len:
            raise RuntimeError(f"KV cache holds {self.max_len} positions; {end} requested")
        return end

    def store(self, k: Tensor, v: Tensor) -> None:
        """Write (N, H, T, ·) new keys/values after the positions stored so far: to the
        first N buffer rows (all of them, without a lineage)."""
        start, end = self.length, self.end_after(k.shape[2])
        rows = slice(None) if self.lineage is None else slice(0, k.shape[0])
        self.k[rows, :, start:end] = k
        self.v[rows, :, start:end] = v
        self.length = end

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store (N, H, T, ·) new keys/values; return everything stored so far in the rows'
        order: views of the buffers, or with a lineage, copies gathered through it."""
        self.store(k, v)
        if self.lineage is None:
            return self.k[:, :, : self.length], self.v[:, :, : self.length]
        rows = self.lineage.rows
        return (gather_positions(self.k, rows, self.length),
                gather_positions(self.v, rows, self.length))

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


class StaticKV:
    """Keys and values computed once and reused at every step: cross-attention over the
    encoder's output. Beams of one sentence share it when its batch is smaller than the
    query batch (see MultiHeadAttention.forward)."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def keep(self, sentences: Tensor) -> None:
        """Keep the rows of `sentences` (decoding drops the sentences that are finished).
        Beams need nothing here: the encoder output depends only on the source, which
        they share."""
        if self.k is not None:
            self.k = self.k.index_select(0, sentences)
            self.v = self.v.index_select(0, sentences)


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
        """Kept for the model that made the cache: its layers prepared for one-call decoding
        steps over these caches (Seq2Seq: kernels/step.py's DecoderStep), or None."""

    @property
    def length(self) -> int:
        return self.self_attn[0].length

    @property
    def max_len(self) -> int:
        return self.self_attn[0].max_len

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
        return narrowed

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


def _bias_rows(mask: Tensor, rows: int, length: int, dtype: torch.dtype) -> Tensor | None:
    """A (rows, 1, 1, length) float key-padding bias as the (rows, length) that attend_step
    takes; None for any other mask."""
    if mask.dtype != dtype or mask.shape != (rows, 1, 1, length):
        return None
    return mask[:, 0, 0]


# --- multi-head attention -------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with separate query/key and value head sizes.

    Self-attention projects q, k and v with one fused matmul; cross-attention projects q from
    the queries and k, v (fused) from the memory. Which one it is is fixed at construction.

    `recorded`: None normally. Set to a list (tformer.viz.attention.recording_attention
    does), every forward pass appends its (B, H, T, S) attention probabilities to it,
    computed by `attend_explicitly` instead of the fused kernel, which never forms them.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        d_head: int | None = None,
        d_value: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        cross: bool = False,
    ) -> None:
        super().__init__()
        self.n_head = n_head
        self.d_head = d_head or d_model // n_head
        self.d_value = d_value or self.d_head
        self.cross = cross
        self.dropout = dropout
        qk, v = n_head * self.d_head, n_head * self.d_value
        if cross:
            self.q_proj = nn.Linear(d_model, qk, bias=bias)
            self.kv_proj = nn.Linear(d_model, qk + v, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 2 * qk + v, bias=bias)
        self.out_proj = nn.Linear(v, d_model, bias=bias)
        self.recorded: list[Tensor] | None = None

    def _heads(self, x: Tensor, d: int) -> Tensor:
        """(B, T, H*d) -> (B, H, T, d)."""
        return x.unflatten(-1, (self.n_head, d)).transpose(1, 2)

    def _project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv_proj(memory).split(
            [self.n_head * self.d_head, self.n_head * self.d_value], dim=-1
        )
        return self._heads(k, self.d_head), self._heads(v, self.d_value)

    def _attend_shared(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Cross-attention where each of B' memories serves B/B' consecutive query rows (the
        beams of one sentence): the rows' queries are stacked along the query axis, so every
        memory is read once, by one matmul, and never copied per beam.

        q (B, H, T, d), k (B', H, S, d), v (B', H, S, d_value), mask (B' or 1, 1, 1, S).
        """
        B, H, T, _ = q.shape
        shared, group = k.shape[0], B // k.shape[0]
        if mask is not None and mask.shape[2] != 1:
            raise ValueError("shared cross-attention takes a key-padding mask (B', 1, 1, S)")
        q = q.view(shared, group, H, T, -1).transpose(1, 2).reshape(shared, H, group * T, -1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        out = out.view(shared, H, group, T, -1).transpose(1, 2).reshape(B, H, T, -1)
        return self.out_proj(out.transpose(1, 2).flatten(2))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | StaticKV | None = None,
    ) -> Tensor:
        """x (B, T, D) -> (B, T, D).

        memory: (B', S, D) the states to attend over for cross-attention (unused when
            `cache` already holds them). B' may divide B: beams of one sentence share their
            encoder output, read through a view instead of a copy.
        mask: boolean may-attend mask broadcastable to (B, H, T, S).
        is_causal: plain causal self-attention with no cache and no mask (the fast path).
        cache: self-attention appends its new keys/values to a KVCache and attends over all
            of them; cross-attention fills a StaticKV once and reuses it.
        """
        B, T, _ = x.shape
        if self.cross:
            q = self._heads(self.q_proj(x), self.d_head)
            if isinstance(cache, StaticKV) and cache.k is not None:
                k, v = cache.k, cache.v
            else:
                if memory is None:
                    raise ValueError("cross-attention needs `memory`")
                k, v = self._project_memory(memory)
                if isinstance(cache, StaticKV):
                    cache.k, cache.v = k, v
            # Beams that share their sentence's keys read them in place; one row a sentence
            # gains nothing over SDPA (whose matrix products are faster over long sources).
            if T == 1 and k.shape[0] < B and B % k.shape[0] == 0 and self._steps_natively(q):
                bias = mask if mask is None else _bias_rows(mask, k.shape[0], k.shape[2], q.dtype)
                if mask is None or bias is not None:
                    return self._project_step(attend_step(q[:, :, 0], k, v, k.shape[2], bias=bias))
            if k.shape[0] != B:
                if self.recorded is None:
                    return self._attend_shared(q, k, v, mask)
                # Recording: every row gets its own copy of its sentence's keys and values.
                k = k.repeat_interleave(B // k.shape[0], dim=0)
                v = v.repeat_interleave(B // v.shape[0], dim=0)
                if mask is not None and mask.shape[0] not in (1, B):
                    mask = mask.repeat_interleave(B // mask.shape[0], dim=0)
        else:
            qk = self.n_head * self.d_head
            q, k, v = self.qkv_proj(x).split([qk, qk, self.n_head * self.d_value], dim=-1)
            q, k, v = self._heads(q, self.d_head), self._heads(k, self.d_head), self._heads(
                v, self.d_value
            )
            if isinstance(cache, KVCache):
                lineage = cache.lineage
                if (lineage is not None and T == 1 and mask is None
                        and B == lineage.rows.shape[0] and self._steps_natively(q)):
                    # A decoding step over a cache that beam search never copies: the keys
                    # are read where the lineage says. (A cache in query order gains nothing
                    # over SDPA, whose matrix products are faster over long contexts.)
                    cache.store(k, v)
                    return self._project_step(
                        attend_step(q[:, :, 0], cache.k, cache.v, cache.length, rows=lineage.rows)
                    )
                k, v = cache.append(k, v)

        # Attention dropout in training on a CPU: SDPA's fused CPU kernel takes no dropout, and
        # with dropout_p > 0 it runs its math path, these same steps written out, with torch's
        # dropout; written out here, the probabilities go through tformer's dropout kernel.
        if self.recorded is not None or (self.training and runs_natively(q, self.dropout)):
            out = self.attend_explicitly(q, k, v, mask, is_causal and mask is None)
            return self.out_proj(out.transpose(1, 2).flatten(2))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and mask is None,
        )
        return self.out_proj(out.transpose(1, 2).flatten(2))

    def _steps_natively(self, q: Tensor) -> bool:
        """Whether a one-query step over a cache runs kernels/attend.py's kernel here."""
        return not self.training and self.recorded is None and serves(q)

    def _project_step(self, out: Tensor) -> Tensor:
        """(B, H, d_value) attention output of a one-query step -> (B, 1, D)."""
        return self.out_proj(out.flatten(1)[:, None])

    def attend_explicitly(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool
    ) -> Tensor:
        """softmax(q k^T / sqrt(d_head) + mask) v written out, as SDPA computes it, keeping
        the probabilities in `recorded` where that is a list. q (B, H, T, d), k (B, H, S, d),
        v (B, H, S, d_value) -> (B, H, T, d_value)."""
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if is_causal:
            mask = causal_mask(q.shape[2], k.shape[2], q.device)
        if mask is not None:
            scores = scores + (attention_bias(mask, scores.dtype) if mask.dtype == torch.bool
                               else mask)
        probs = scores.softmax(dim=-1)
        if self.recorded is not None:
            self.recorded.append(probs.detach())
        return dropout(probs, self.dropout, self.training) @ v
