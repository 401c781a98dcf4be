"""Generating text from a language model, with or without its cache.

A model decodes here if it has
    make_cache(batch, max_len, padded=...) -> cache with .length and .max_len
    forward(tokens, is_real, cache=..., last_only=True) -> (B, 1, V) logits
and a `cfg.context` (the longest window it reads). GPT's cache is a preallocated KV cache.
Transformer-XL has no fixed window: its memory is the cache, and
tformer.decoding.transformer_xl generates from it (each family's registry entry names its
`generate`).

Shapes: B batch, T prompt length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from tformer.decoding.constraints import Matcher, mask_logits
from tformer.decoding.runner import runner
from tformer.decoding.sampling import (
    NO_EXTRA,
    ExtraSampling,
    hold_back,
    next_token,
    penalize_repetition,
)
from tformer.kernels.blocks import REPACK_MIN_ROWS, keep_repacked

EosIds = int | Sequence[int] | None
"""The ids that end a text: none, one, or several (Llama 3 ends one at <|end_of_text|>, at
<|eot_id|> after a turn and at <|eom_id|> after a tool call)."""


def stop_ids(eos_id: EosIds) -> tuple[int, ...]:
    """eos_id, as the tuple of every id that ends a text (its first: what finished rows
    repeat)."""
    if eos_id is None:
        return ()
    if isinstance(eos_id, Sequence):
        return tuple(int(i) for i in eos_id)
    return (int(eos_id),)


class Finished:
    """Which rows of a batch have ended: a row ends at the first of its tokens that is one
    of the eos ids, and repeats the first eos id from then on."""

    def __init__(self, eos_id: EosIds, batch: int, device: torch.device) -> None:
        self.ids = stop_ids(eos_id)
        self.stops = torch.tensor(self.ids, device=device) if self.ids else None
        self.rows = torch.zeros(batch, dtype=torch.bool, device=device)

    def update(self, token: Tensor) -> Tensor:
        """(B,) new tokens -> the same, finished rows' replaced by the first eos id."""
        if self.stops is None:
            return token
        token = token.masked_fill(self.rows, self.ids[0])
        self.rows |= torch.isin(token, self.stops)
        return token

    @property
    def all(self) -> bool:
        return self.stops is not None and bool(self.rows.all())


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    is_real: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    eos_id: EosIds = None,
    constraint: Matcher | None = None,
    extra: ExtraSampling = NO_EXTRA,
) -> Iterator[Tensor]:
    """Yield (B,) new tokens, one step at a time, after a (B, T) prompt.

    is_real: (B, T) False at padding, for left-padded prompts of different lengths.
    A model with a fixed context sees each row's last `context` tokens (`window`): once the
    cache is full, the window slides by running the model afresh over it, so cached and
    uncached generation always see the same tokens and agree exactly. With eos_id (an id,
    or several), stops once every row has produced one of them (finished rows repeat the
    first). constraint (one row): the tokens it disallows are masked before each draw, and
    the text ends where the constrained text is complete (tformer.decoding.constraints).
    extra: min-p, the repetition penalty over each row's prompt and text (its padding
    left out), min_tokens (the eos ids held back) and ignore_eos (no row ends at them).
    """
    if constraint is not None and prompt.shape[0] != 1:
        raise ValueError("a constraint decodes one row")
    if prompt.shape[0] >= REPACK_MIN_ROWS:
        # Every step multiplies a row a sequence: the block layers' repacked copy pays for
        # itself at each (kernels/blocks.py, keep_repacked), as in batched serving.
        keep_repacked(model)
    model = runner(model)  # the one-call kernel step where it serves
    B = prompt.shape[0]
    context = model.cfg.context
    padded = is_real is not None
    tokens = prompt
    real = is_real if padded else None
    ends = stop_ids(eos_id)
    finished = Finished(None if extra.ignore_eos else eos_id, B, prompt.device)

    cache = None
    fresh = True  # the next forward pass reads the whole window
    for step_index in range(max_new_tokens):
        if use_cache and cache is not None and cache.length + 1 > cache.max_len:
            fresh = True
        if fresh or not use_cache:
            texts = (tokens.tolist() if not padded
                     else [row[keep].tolist() for row, keep in zip(tokens, real, strict=True)])
            ids, window_real = window(texts, context)
            cache = model.make_cache(B, context, padded=padded) if use_cache else None
            logits = model(ids.to(tokens.device),
                           None if window_real is None else window_real.to(tokens.device),
                           cache=cache, last_only=True)
            fresh = False
        else:
            logits = model(tokens[:, -1:], real[:, -1:] if padded else None, cache=cache,
                           last_only=True)
        step = logits[:, -1]
        if extra.repetition_penalty != 1.0:
            # Each row's tokens so far, counted where real: a padding id is not text.
            weight = real.float() if padded else torch.ones_like(tokens, dtype=torch.float)
            seen = torch.zeros(step.shape, device=step.device).scatter_add_(1, tokens, weight)
            step = penalize_repetition(step.float(), seen > 0, extra.repetition_penalty)
        if constraint is not None:
            step = mask_logits(step.float().clone(), [constraint])
        if step_index < extra.min_tokens:
            step = hold_back(step, ends)
        token = next_token(
            step, temperature=temperature, top_k=top_k, top_p=top_p, min_p=extra.min_p,
            generator=generator,
        )
        token = finished.update(token)
        if constraint is not None:
            constraint.advance(int(token[0]))
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        if padded:
            real = torch.cat([real, torch.ones_like(token, dtype=torch.bool)[:, None]], dim=1)
        yield token
        if finished.all or (constraint is not None and constraint.stopped):
            break


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token lists of different lengths -> (B, T) ids and is_real mask, padded on the left so
    every row's last token is at the same position."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    is_real = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq):] = torch.tensor(seq)
            is_real[i, width - len(seq):] = True
    return ids, is_real


def window(texts: list[list[int]], context: int) -> tuple[Tensor, Tensor | None]:
    """What a model of `context` positions reads to continue each text: its last `context`
    tokens, left-padded -> (B, T) ids and is_real (None where no row is padded). Every
    decoding path slides so past the context (generate, speculation, the server), and a
    row reads the same whether it decodes in a batch or alone."""
    ids, real = left_pad([text[-context:] for text in texts], 0)
    return ids, None if bool(real.all()) else real
