"""Attention masks: boolean "may attend" tensors (True = attend) that broadcast to
(B, H, T, S); every mask in the library is built here.

Shapes: B batch, H heads, T query length, S key length.
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def window_mask(key_positions: Tensor, q_len: int, window: int) -> Tensor:
    """(B or 1, S) positions of the keys, the last T of them the queries' -> (B or 1, 1, T, S)
    mask of the keys within `window` positions of each query (sliding-window attention,
    Beltagy et al. 2020; Mistral), itself included. With positions that count real tokens
    only, padding takes no place in the window."""
    q_pos = key_positions[:, -q_len:, None]
    return (q_pos - key_positions[:, None, :] < window)[:, None]
