"""Multi-head attention (Vaswani et al. 2017, sec. 3.2.2) and the masks it reads.

Shapes: B batch, H query heads, H_kv key/value heads, T query length, S key length, D model
width, d_head query/key size per head, d_value value size per head.

The module projects queries, keys and values, attends, and projects back. How a decoding
step attends over what earlier steps left is the business of the cache it is handed
(tformer.layers.cache), which knows how its keys lie and may run a kernel that reads them
in place; how the probabilities are formed (fused, or written out to record or drop them)
is scaled_dot_product's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from tformer.layers.masks import attention_bias, causal_mask, lm_mask, padding_mask
from tformer.layers.rotary import Rotary
from tformer.layers.scaled_dot_product import scaled_dot_product

__all__ = [
    "MultiHeadAttention", "attention_bias", "causal_mask", "lm_mask", "padding_mask",
]


class Cache(Protocol):
    """A layer's decoding state (tformer.layers.cache: KVCache, StaticKV)."""

    def kept(self) -> tuple[Tensor, Tensor] | None:
        """Keys and values kept from an earlier step that replace this step's (the encoder's,
        for cross-attention), or None."""
        ...

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
        attention: MultiHeadAttention,
    ) -> Tensor:
        """Take the step's keys and values and attend with q over what the cache holds:
        (B, H, T, d_head) -> (B, H, T, d_value)."""
        ...


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with separate query/key and value head sizes.

    Self-attention projects q, k and v with one fused matmul; cross-attention projects q from
    the queries and k, v (fused) from the memory. Which one it is is fixed at construction.

    n_kv_head: key/value heads, a divisor of n_head that the query heads share in groups
        (grouped-query attention, Ainslie et al. 2023; 1 is multi-query, Shazeer 2019).
    bias: on the q/k/v projections; out_bias: on the output projection (default: `bias`).
    qk_norm: a norm over d_head for each query and key head (Qwen3), made by this factory.
    rotary: rotary position embeddings applied to queries and keys (Su et al. 2021).
    scale: the factor on q . k (None: 1 / sqrt(d_head)); softcap: scores bounded by
        softcap * tanh(s / softcap) before the softmax (Gemma 2), or None.
    sinks: a learned logit per head in each softmax's denominator (gpt-oss's attention sinks,
        after Xiao et al. 2023): a head may give its weight to no key.

    `recorded`: None normally. Set to a list (tformer.viz.attention.recording_attention
    does), every forward pass appends its (B, H, T, S) attention probabilities to it.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        d_head: int | None = None,
        d_value: int | None = None,
        n_kv_head: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        out_bias: bool | None = None,
        cross: bool = False,
        qk_norm: Callable[[int], nn.Module] | None = None,
        rotary: Rotary | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.scale, self.softcap = scale, softcap
        self.n_head = n_head
        self.n_kv_head = n_kv_head or n_head
        if n_head % self.n_kv_head != 0:
            raise ValueError(f"n_kv_head = {self.n_kv_head} does not divide n_head = {n_head}")
        self.d_head = d_head or d_model // n_head
        self.d_value = d_value or self.d_head
        self.cross = cross
        self.dropout = dropout
        q, k, v = (n_head * self.d_head, self.n_kv_head * self.d_head,
                   self.n_kv_head * self.d_value)
        self.widths = (q, k, v)
        if cross:
            self.q_proj = nn.Linear(d_model, q, bias=bias)
            self.kv_proj = nn.Linear(d_model, k + v, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, q + k + v, bias=bias)
        self.out_proj = nn.Linear(n_head * self.d_value, d_model,
                                  bias=bias if out_bias is None else out_bias)
        self.q_norm = qk_norm(self.d_head) if qk_norm is not None else None
        self.k_norm = qk_norm(self.d_head) if qk_norm is not None else None
        self.rotary = rotary
        # A learned logit per head in every softmax's denominator (gpt-oss).
        self.sinks = nn.Parameter(torch.zeros(n_head)) if sinks else None
        self.recorded: list[Tensor] | None = None

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        cache: Cache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, D) -> (B, T, D).

        memory: (B', S, D) the states to attend over for cross-attention (unused when
            `cache` already holds them). B' may divide B: beams of one sentence share their
            encoder output, read through a view instead of a copy.
        mask: boolean may-attend mask (or float bias) broadcastable to (B, H, T, S).
        is_causal: plain causal self-attention with no mask (the fast path).
        cache: self-attention adds its new keys/values to a KVCache and attends over all
            of them; cross-attention fills a StaticKV once and reuses it.
        positions: (B, T) or (T,) positions of the new tokens, for rotary embeddings.
        """
        q, k, v = self.project(x, memory, cache, positions)
        if cache is not None:
            out = cache.attend(q, k, v, mask, is_causal, self)
        elif k.shape[0] != q.shape[0]:
            out = self.attend_shared(q, k, v, mask)
        else:
            out = self.attend(q, k, v, mask, is_causal)
        return self.out_proj(out.transpose(1, 2).flatten(2))

    def project(
        self, x: Tensor, memory: Tensor | None, cache: Cache | None, positions: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, d_head), keys (·, H_kv, ·, d_head), values (·, H_kv, ·, d_value):
        keys and values of x (self-attention) or of the memory (cross-attention, or those
        the cache kept)."""
        q_width, k_width, v_width = self.widths
        if self.cross:
            q = self._heads(self.q_proj(x), self.n_head, self.d_head)
            kept = cache.kept() if cache is not None else None
            if kept is not None:
                return self._norm_rotate(q, positions, self.q_norm), *kept
            if memory is None:
                raise ValueError("cross-attention needs `memory`")
            return self._norm_rotate(q, positions, self.q_norm), *self.memory_kv(memory)
        q, k, v = self.qkv_proj(x).split([q_width, k_width, v_width], dim=-1)
        q = self._heads(q, self.n_head, self.d_head)
        k = self._heads(k, self.n_kv_head, self.d_head)
        v = self._heads(v, self.n_kv_head, self.d_value)
        q = self._norm_rotate(q, positions, self.q_norm)
        k = self._norm_rotate(k, positions, self.k_norm)
        return q, k, v

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention's keys (B', H_kv, S, d_head) and values (B', H_kv, S, d_value) of
        the (B', S, D) memory: what a decoder keeps for every step (StaticKV)."""
        _, k_width, v_width = self.widths
        k, v = self.kv_proj(memory).split([k_width, v_width], dim=-1)
        k = self._norm_rotate(self._heads(k, self.n_kv_head, self.d_head), None, self.k_norm)
        return k, self._heads(v, self.n_kv_head, self.d_value)

    def _heads(self, x: Tensor, heads: int, d: int) -> Tensor:
        """(B, T, heads * d) -> (B, heads, T, d)."""
        return x.unflatten(-1, (heads, d)).transpose(1, 2)

    def _norm_rotate(self, x: Tensor, positions: Tensor | None, norm: nn.Module | None) -> Tensor:
        if norm is not None:
            x = norm(x)
        if self.rotary is not None and positions is not None:
            x = self.rotary(x, positions)
        return x

    @property
    def records(self) -> bool:
        return self.recorded is not None

    @property
    def is_inference(self) -> bool:
        """Whether nothing is dropped or recorded: a kernel computing this attention's
        scores (its scale, soft cap and sinks included) may stand in for it."""
        return not self.training and self.recorded is None

    @property
    def is_plain(self) -> bool:
        """Whether attention is exactly softmax(q k^T / sqrt(d_head) + mask) v, with nothing
        dropped or recorded: what a kernel computing the same may stand in for."""
        return (self.is_inference and self.scale is None and self.softcap is None
                and self.sinks is None)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False
    ) -> Tensor:
        """q (B, H, T, d), k (B, H_kv, S, d), v (B, H_kv, S, d_value) -> (B, H, T, d_value)."""
        return scaled_dot_product(
            q, k, v, mask, is_causal and mask is None,
            dropout_p=self.dropout if self.training else 0.0, recorded=self.recorded,
            scale=self.scale, softcap=self.softcap, sinks=self.sinks,
        )

    def attend_shared(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention where each of B' memories serves B/B' consecutive query rows (the beams
        of one sentence): the rows' queries are stacked along the query axis, so every
        memory is read once, by one matmul, and never copied per beam. Where probabilities
        are recorded, each row gets its own copy instead, so that they come out per row.

        q (B, H, T, d), k (B', H_kv, S, d), v (B', H_kv, S, d_value), mask (B' or 1, 1, 1, S).
        """
        B, H, T, _ = q.shape
        shared, group = k.shape[0], B // k.shape[0]
        if mask is not None and mask.shape[2] != 1:
            raise ValueError("shared cross-attention takes a key-padding mask (B', 1, 1, S)")
        if self.recorded is not None:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            if mask is not None and mask.shape[0] not in (1, B):
                mask = mask.repeat_interleave(group, dim=0)
            return self.attend(q, k, v, mask)
        q = q.view(shared, group, H, T, -1).transpose(1, 2).reshape(shared, H, group * T, -1)
        out = self.attend(q, k, v, mask)
        return out.view(shared, H, group, T, -1).transpose(1, 2).reshape(B, H, T, -1)
