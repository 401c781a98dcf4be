"""Scaled dot-product attention, softmax(q k^T / sqrt(d) + mask) v (Vaswani et al. 2017,
sec. 3.2.1), on the path that suits the call.

Two variants: another `scale` than 1 / sqrt(d) (Gemma's query_pre_attn_scalar), which every
path takes, and scores soft-capped to (-softcap, softcap) by softcap * tanh(s / softcap)
before the mask (Gemma 2), which only the written-out path computes: torch's fused kernels
have no place for a function between the product and the softmax.

torch's fused kernel (scaled_dot_product_attention) never forms the probabilities, so two
callers get them written out instead: attention maps, which record them, and training on a
CPU with attention dropout. There SDPA's fused CPU kernel takes no dropout: with
dropout_p > 0 it runs its math path, these same steps written out, with torch's dropout;
written out here, the probabilities go through tformer's dropout kernel.

Shapes: B batch, H query heads, H_kv key/value heads (H_kv divides H: grouped-query
attention), T queries, S keys, d query/key size, d_value value size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.kernels.dropout import dropout, runs_natively
from tformer.layers.masks import attention_bias, causal_mask

SDPA_GROUPS = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 5)
"""Whether scaled_dot_product_attention takes enable_gqa (PyTorch 2.5 on)."""

QUERY_CHUNK = 512
"""Queries attended at a time under a mask: SDPA turns a boolean mask into a float bias of
its full (T, S) shape (per query head where heads are grouped), 1.6 GB for a 7,314-token
prompt, where this many rows of it take a few MB. Causal attention without a mask takes
SDPA's flash path, which forms no (T, S) matrix at all."""


def scaled_dot_product(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, *,
    dropout_p: float, recorded: list[Tensor] | None, scale: float | None = None,
    softcap: float | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """q (B, H, T, d), k (B, H_kv, S, d), v (B, H_kv, S, d_value) -> (B, H, T, d_value).

    mask: a boolean may-attend mask, or a float bias, broadcastable to (B, H, T, S).
    is_causal: the causal mask, without building it (only where `mask` is None).
    dropout_p: dropout on the probabilities (0 outside training).
    recorded: a list to append the (B, H, T, S) probabilities to, or None.
    scale: the factor on q . k (None: 1 / sqrt(d)); softcap: the scores' bound, or None.
    sinks: (H,) a logit per head that joins every query's softmax with no value behind it
        (attention sinks: gpt-oss), so a head may attend to nothing; None: none.
    """
    if sinks is not None:
        return _with_sinks(q, k, v, mask, is_causal, sinks, dropout_p, recorded, scale,
                           softcap)
    written = recorded is not None or runs_natively(q, dropout_p) or softcap is not None
    T = q.shape[2]
    # Capped scores are written out, (B, H, T, S) of them at once: a long prompt's are taken
    # a chunk of queries at a time too, the causal mask built to be cut into rows.
    capped = softcap is not None and recorded is None and dropout_p == 0.0
    if capped and mask is None and is_causal and T > QUERY_CHUNK:
        mask, is_causal = causal_mask(T, k.shape[2], q.device), False
    if ((not written or capped) and dropout_p == 0.0 and mask is not None and T > QUERY_CHUNK
            and mask.shape[-2] == T):
        # Each query's row of the mask is its own: attend a chunk of queries at a time.
        return torch.cat([
            scaled_dot_product(q[:, :, i : i + QUERY_CHUNK], k, v,
                               mask[..., i : i + QUERY_CHUNK, :], False, dropout_p=0.0,
                               recorded=None, scale=scale, softcap=softcap)
            for i in range(0, T, QUERY_CHUNK)
        ], dim=2)
    if k.shape[1] != q.shape[1]:
        # Grouped-query attention (Ainslie et al. 2023): query head h reads key/value head
        # h // (H / H_kv).
        if not (written or is_causal) and (mask is None or mask.shape[1] == 1):
            return _grouped(q, k, v, mask, dropout_p, scale)
        if not written and SDPA_GROUPS:  # SDPA's kernels index the shared heads themselves
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, enable_gqa=True,
                                                  scale=scale)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if written:
        return written_out(q, k, v, mask, is_causal, dropout_p=dropout_p, recorded=recorded,
                           scale=scale, softcap=softcap)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def _with_sinks(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, sinks: Tensor,
    dropout_p: float, recorded: list[Tensor] | None, scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention with a sink logit per head: one more key, of zeros (so q . k = 0) with a
    value of zeros, whose score the bias sets to the head's sink. The softmax's denominator
    gains exp(sink) and the output nothing else, which is the sink's definition. A scale or
    soft cap leaves the zero score zero, so the sink's logit is uncapped and unscaled."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    if mask is None:
        mask = causal_mask(T, S, q.device) if is_causal else torch.ones(
            T, S, dtype=torch.bool, device=q.device)
    bias = attention_bias(mask, q.dtype) if mask.dtype == torch.bool else mask.to(q.dtype)
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    bias = bias.expand(bias.shape[0], H, T, S)
    sink = sinks.to(q.dtype).view(1, H, 1, 1).expand(bias.shape[0], H, T, 1)
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
    kept: list[Tensor] | None = [] if recorded is not None else None
    out = scaled_dot_product(q, k, v, torch.cat([bias, sink], dim=-1), False,
                             dropout_p=dropout_p, recorded=kept, scale=scale, softcap=softcap)
    if recorded is not None:
        recorded.append(kept[0][..., :S])  # the keys' probabilities, not the sink's
    return out


def _grouped(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
    scale: float | None = None,
) -> Tensor:
    """Grouped-query attention without copying keys and values per query head: the G
    query heads that share a key/value head are stacked along the query axis, so each
    key/value head is read once (a decoding step's cache is the largest operand). mask:
    one for all heads, (B or 1, 1, T or 1, S)."""
    B, H, T, _ = q.shape
    H_kv = k.shape[1]
    group = H // H_kv
    q = q.reshape(B, H_kv, group * T, -1)
    if mask is not None and mask.shape[2] == T and T > 1:
        mask = mask.repeat(1, 1, group, 1)  # row g * T + t is query t of head g
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         scale=scale)
    return out.reshape(B, H, T, -1)


def written_out(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, *,
    dropout_p: float, recorded: list[Tensor] | None, scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v as SDPA computes it, with the probabilities kept in
    `recorded` where that is a list and dropped by tformer's dropout; `scale` for
    1 / sqrt(d) where given, and the scores soft-capped where `softcap` is."""
    product = q @ k.transpose(-1, -2)
    scores = product / math.sqrt(q.shape[-1]) if scale is None else product * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = scores + (attention_bias(mask, scores.dtype) if mask.dtype == torch.bool
                           else mask)
    probs = scores.softmax(dim=-1)
    if recorded is not None:
        recorded.append(probs.detach())
    return dropout(probs, dropout_p, dropout_p > 0.0) @ v
