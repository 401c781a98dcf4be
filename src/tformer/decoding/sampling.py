"""Choosing the next token from logits: pure functions of (B, V) logits.

A draw: the model's logits, a repetition penalty over the text so far, then temperature,
min-p, top-k and top-p (vLLM's order), then softmax and one draw.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tformer.errors import TformerError


@dataclass(frozen=True)
class ExtraSampling:
    """The sampling settings vLLM and llama.cpp's server take beyond OpenAI's, for the
    server, `tformer generate` and the Python API alike.

    min_p: keep the tokens at least min_p times as likely as the likeliest (0 is off);
    repetition_penalty: every token of the prompt and the text so far has its logit
        divided by it where positive, multiplied where negative (1 is off);
    min_tokens: the end of text (and a chat's end of turn) cannot be drawn before this
        many tokens;
    ignore_eos: the end of text does not end the text: max_tokens does."""

    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise TformerError(f"min_p {self.min_p} must be between 0 and 1 (0 is off)")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise TformerError(f"repetition_penalty {self.repetition_penalty} must be more "
                               f"than 0 (1 is off)")
        if self.min_tokens < 0:
            raise TformerError(f"min_tokens {self.min_tokens} must be 0 or more")

    @property
    def changes_logits(self) -> bool:
        """Whether the logits change before the draw (a penalty, ends masked)."""
        return self.repetition_penalty != 1.0 or self.min_tokens > 0


NO_EXTRA = ExtraSampling()


def penalize_repetition(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, as Hugging Face and vLLM apply it):
    (B, V) logits and (B, V) bool `seen` (the tokens of the prompt and the text so far)
    -> the seen tokens' logits divided by `penalty` where positive, multiplied where not,
    so that penalty > 1 always makes a seen token less likely."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def hold_back(logits: Tensor, ends: Sequence[int]) -> Tensor:
    """min_tokens' rule: (B, V) logits -> the same with the `ends` tokens (end of text, end
    of turn) at -inf, in each row where another token may still be drawn (a row that may
    only end, such as a complete constrained text, still ends)."""
    ends = [e for e in ends if e < logits.shape[-1]]
    if not ends:
        return logits
    held = logits.clone()
    held[:, ends] = float("-inf")
    return torch.where((held > float("-inf")).any(-1, keepdim=True), held, logits)


def filter_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Min-p sampling (Nguyen et al. 2024): keep the tokens whose probability is at least
    min_p times the likeliest token's, -inf elsewhere. In logits, p_i >= min_p * p_max is
    l_i >= l_max + log(min_p): no softmax needed."""
    if min_p <= 0.0:
        return logits
    threshold = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


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
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, V) logits -> (B,) token ids. temperature 0 is greedy (argmax). -inf marks a
    token that may not be drawn (a constraint's mask); NaN or +inf is a broken model."""
    if temperature == 0:
        # argmax takes a NaN or +inf where a row has one: checking the logits it chose is
        # checking them all, in one pass over the vocabulary where the check made two more
        token = logits.argmax(dim=-1)
        if not bool((logits.gather(-1, token[..., None]) < float("inf")).all()):
            raise _not_finite()
        return token
    if not bool((logits < float("inf")).all()):
        raise _not_finite()
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _not_finite() -> TformerError:
    return TformerError(
        "the model's outputs are not finite (NaN or inf logits); its weights or its input "
        "are broken, and no token can be chosen"
    )


def sampling_probs(logits: Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> Tensor:
    """(..., V) logits -> the distribution `next_token` draws from, in float32: temperature,
    then min-p, top-k and top-p, then softmax (a one-hot argmax for temperature 0). Speculative
    decoding's acceptance rule compares these distributions."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    flat = logits.float().reshape(-1, logits.shape[-1]) / temperature
    flat = filter_top_p(filter_top_k(filter_min_p(flat, min_p), top_k), top_p)
    return flat.softmax(-1).reshape(logits.shape)
