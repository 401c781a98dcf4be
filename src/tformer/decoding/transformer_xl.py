"""Generating text from Transformer-XL with its memory as the cache.

The prompt is read in segments of the model's segment length, each attending over the
memory the previous ones left; then each new token is one segment of length 1. The memory
keeps every layer's keys and values at the last `mem_len` positions (projected once, as a
KV cache does), so once it is full a token costs the same however long the text has grown,
and the context still reaches past the memory through the layers (Dai et al. 2019,
sec. 3.2: about n_layer * mem_len tokens).

Without the cache, each step runs the model afresh over the last mem_len + 1 tokens: the
tokens a cached step attends to directly. Both give the same result while the whole text
fits in mem_len + 1 tokens (nothing has left the memory yet); past that, the cached states
remember more than the window.

Shapes: B batch, T prompt length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from tformer.decoding.lm import EosIds, Finished
from tformer.decoding.sampling import next_token
from tformer.models.transformer_xl import Memory


@torch.no_grad()
def read_prompt(
    model: nn.Module, prompt: Tensor, memory: Memory, *, is_real: Tensor | None = None,
    segment_len: int | None = None,
) -> Tensor:
    """Feed a (B, T) prompt into `memory` in segments; return the (B, 1, V) logits of its
    last position."""
    segment_len = segment_len or model.cfg.context
    logits = None
    for start in range(0, prompt.shape[1], segment_len):
        end = start + segment_len
        real = is_real[:, start:end] if is_real is not None else None
        logits = model(prompt[:, start:end], real, memory=memory, last_only=True)
    assert logits is not None, "empty prompt"
    return logits


@torch.no_grad()
def generate_with_memory(
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
    mem_len: int | None = None,
) -> Iterator[Tensor]:
    """Yield (B,) new tokens, one step at a time, after a (B, T) prompt.

    mem_len: positions of memory per layer; none means the model's model.eval_mem_len
        (default model.mem_len). The arguments otherwise mean what they mean for
        tformer.decoding.lm.generate.
    """
    B = prompt.shape[0]
    mem_len = model.cfg.memory_for_eval if mem_len is None else mem_len
    tokens = prompt
    real = is_real
    finished = Finished(eos_id, B, prompt.device)
    memory = Memory(mem_len, cache_keys=True)

    for step in range(max_new_tokens):
        if not use_cache:
            window = mem_len + 1
            logits = model(tokens[:, -window:], None if real is None else real[:, -window:],
                           last_only=True)
        elif step == 0:
            logits = read_prompt(model, prompt, memory, is_real=is_real)
        else:
            logits = model(tokens[:, -1:], None if real is None else real[:, -1:],
                           memory=memory, last_only=True)
        token = next_token(
            logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        token = finished.update(token)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        if real is not None:
            real = torch.cat([real, torch.ones_like(token, dtype=torch.bool)[:, None]], dim=1)
        yield token
        if finished.all:
            break
