"""Text embeddings from a decoder-only language model: the last block's states (after the
closing norm) pooled into one vector per text and scaled to unit length, so that a dot
product is the cosine similarity.

Two poolings, one a name in POOLINGS:
- "mean" (the default): the average over the text's positions. A language model trained
  only to predict the next token has no token that summarises the text, and the mean
  is the steadier reading of such a model;
- "last": the last position's state, which under causal attention has read every token;
  what decoder models trained for embeddings (Qwen3-Embedding, e5-mistral) use.

Shapes: T a text's tokens, D the model's width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tformer.errors import TformerError
from tformer.models.gpt import GPT


def mean_pool(states: Tensor) -> Tensor:
    return states.mean(dim=0)


def last_pool(states: Tensor) -> Tensor:
    return states[-1]


POOLINGS: dict[str, Callable[[Tensor], Tensor]] = {"mean": mean_pool, "last": last_pool}
"""(T, D) states -> (D,) one vector."""
DEFAULT_POOLING = "mean"


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise TformerError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")


def check_embedder(model: torch.nn.Module) -> None:
    """Embeddings are read from a decoder-only stack of the GPT family."""
    if not isinstance(model, GPT):
        raise TformerError(f"embeddings are read from GPT-family models; this one is "
                           f"{type(model).__name__}")


@torch.no_grad()
def embed_ids(model: torch.nn.Module, texts: list[list[int]], *,
              pooling: str = DEFAULT_POOLING) -> Tensor:
    """Each text's token ids -> its unit-length embedding, (len(texts), D) float32. Each
    text is read on its own (no padding can change its states); every text must fit the
    model's window."""
    check_pooling(pooling)
    check_embedder(model)
    window = model.cfg.context
    vectors = []
    for i, ids in enumerate(texts):
        if not 1 <= len(ids) <= window:
            raise TformerError(f"text {i} is {len(ids)} tokens; an embedding reads 1 to "
                               f"{window}")
        device = next(model.parameters()).device
        tokens = torch.tensor([ids], device=device)
        states = model.stack(model.inputs(tokens))
        if model.final_norm is not None:
            states = model.final_norm(states)
        vector = POOLINGS[pooling](states[0].float())
        vectors.append(vector / vector.norm().clamp_min(1e-12))
    return torch.stack(vectors).cpu()
