"""Choosing the next token from logits: pure functions of (B, V) logits.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tformer.errors import TformerError


def filter_top_k(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits per row, -inf elsewhere. topk + scatter keeps exactly k
    tokens even when several share the k-th value (a threshold comparison would keep all)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    values, index = logits.topk(k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, index, values)


def filter_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the most likely tokens whose
    probabilities first add up to at least p; the most likely token is always kept."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens before it already reach p.
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def next_token(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, V) logits -> (B,) token ids. temperature 0 is greedy (argmax). -inf marks a
    token that may not be drawn (a constraint's mask); NaN or +inf is a broken model."""
    if not bool((logits < float("inf")).all()):
        raise TformerError(
            "the model's outputs are not finite (NaN or inf logits); its weights or its "
            "input are broken, and no token can be chosen"
        )
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_probs(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """(..., V) logits -> the distribution `next_token` draws from, in float32: temperature,
    then top-k, then top-p, then softmax (a one-hot argmax for temperature 0). Speculative
    decoding's acceptance rule compares these distributions."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    flat = logits.float().reshape(-1, logits.shape[-1]) / temperature
    flat = filter_top_p(filter_top_k(flat, top_k), top_p)
    return flat.softmax(-1).reshape(logits.shape)
