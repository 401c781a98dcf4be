"""Decoding runners: a model's decoding calls, with the model's own signatures, taking the
one-call kernel step (kernels/step.py) where it serves and the model's modules elsewhere.

A model is the maths: its forward runs its modules, and its cache is buffers. Decoding a
token through a small model on a CPU spends more in Python and torch's dispatch (~70
operations a layer) than in arithmetic; step.c runs a whole layer as one call. The runner
makes the step beside the cache it reads (`make_cache`), and at each call asks it whether it
serves this step (fp32 on the CPU, no gradient, few rows, a mask it can read); where it does
not, the model computes as it always does. Both give the same tokens (tests/kernels).

`runner(model)`: a `LMRunner` for a decoder-only model (`inputs`, `stack`, `outputs`, as
models.gpt.GPT), a `Seq2SeqRunner` for an encoder-decoder one (`decoder_inputs`,
`decoder_stack`, `decoder_outputs`, as models.seq2seq.Seq2Seq), the model itself otherwise
(Transformer-XL decodes through its memory, with no kernel step).

Shapes: B batch, T new tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from tformer.kernels.attend import serves_cache
from tformer.kernels.step import DecoderStep, LMStep
from tformer.layers import DecoderCache

if TYPE_CHECKING:
    from tformer.evaluation.loss import Targets


class LMRunner:
    """A language model's `make_cache` and call (tformer.decoding.lm's protocol), its blocks
    run as one C call each where LMStep serves."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cfg = model.cfg
        self._step: LMStep | None = None
        self._made = False

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def step(self) -> LMStep | None:
        """The blocks prepared for step.c, made once (None where it cannot run them)."""
        if not self._made:
            param = next(self.model.parameters())
            if serves_cache(param.dtype, param.device):
                self._step = LMStep.of(self.model.blocks)
            self._made = True
        return self._step

    def make_cache(self, batch: int, max_len: int | None = None, *,
                   padded: bool = False) -> DecoderCache:
        cache = self.model.make_cache(batch, max_len, padded=padded)
        cache.step = self.step()
        return cache

    def __call__(self, tokens: Tensor, is_real: Tensor | None = None, *,
                 cache: DecoderCache | None = None, last_only: bool = False,
                 targets: Targets | None = None) -> Tensor:
        step = cache.step if cache is not None else None
        if not isinstance(step, LMStep):
            return self.model(tokens, is_real, cache=cache, last_only=last_only,
                              targets=targets)
        model = self.model
        inp = model.inputs(tokens, is_real, cache)
        # A few tokens a call only where the last one's mask covers the others'.
        if inp.uniform and step.serves(inp.x, cache):
            x = step.run(inp.x, cache, inp.positions, inp.mask)
        else:
            x = model.stack(inp, cache)
        return model.outputs(x, last_only=last_only, targets=targets)


    def paged_step(self, tokens: Tensor, k: list[Tensor], v: list[Tensor], tables: Tensor,
                   held: list[int], window: int | None, *, last_only: bool = False
                   ) -> Tensor | None:
        """(n, T) new tokens of n sequences over a paged pool (decoding/paged.py: k[i], v[i]
        layer i's blocks, tables (n, ·) each sequence's blocks, held the positions each
        holds before these) -> (n, T, V) logits, or (n, 1, V) with `last_only`, their keys
        and values stored in place; None where the one-call step does not serve (the caller
        takes the model's path)."""
        step = self.step()
        if step is None:
            return None
        n, T = tokens.shape
        start = torch.tensor(held, dtype=torch.long, device=tokens.device)
        positions = start[:, None] + torch.arange(T, device=tokens.device)
        x = self.model.embed_at(tokens, positions)
        if not step.serves_paged(x, k[0]):
            return None
        x = step.run_paged(x, k, v, tables, start + T, positions, window)
        return self.model.outputs(x, last_only=last_only)


class Seq2SeqRunner:
    """An encoder-decoder model's `encode`, `make_cache` and `decode` (tformer.decoding.beam's
    protocol): caches whose keys beam search never copies (a Lineage) where the attention
    kernel serves, and the decoder's layers as one C call each where DecoderStep serves."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cfg = model.cfg

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def encode(self, src: Tensor, src_real: Tensor) -> Tensor:
        return self.model.encode(src, src_real)

    def make_cache(self, batch: int, max_len: int) -> DecoderCache:
        param = next(self.model.parameters())
        lineage = serves_cache(param.dtype, param.device)
        cache = self.model.make_cache(batch, max_len, lineage=lineage)
        if lineage:
            cache.step = DecoderStep.of(self.model.decoder, cache)
        return cache

    def decode(self, tgt: Tensor, memory: Tensor, src_real: Tensor, *,
               cache: DecoderCache | None = None, tgt_real: Tensor | None = None,
               targets: Targets | None = None) -> Tensor:
        step = cache.step if cache is not None and cache.length > 0 else None
        if not isinstance(step, DecoderStep):
            return self.model.decode(tgt, memory, src_real, cache=cache, tgt_real=tgt_real,
                                     targets=targets)
        model = self.model
        x, memory_mask, self_mask = model.decoder_inputs(tgt, src_real, cache=cache,
                                                         tgt_real=tgt_real)
        if step.serves(x, memory_mask):
            x = step.run(x, memory_mask)
        else:
            x = model.decoder_stack(x, memory, memory_mask, self_mask, cache)
        return model.decoder_outputs(x, targets=targets)


def runner(model: Any) -> Any:
    """The model's decoding runner (see the module's text), or the model itself where it
    has no kernel step; a runner is its own."""
    if isinstance(model, LMRunner | Seq2SeqRunner):
        return model
    if all(callable(getattr(model, name, None)) for name in ("inputs", "stack", "outputs")):
        return LMRunner(model)
    if all(callable(getattr(model, name, None))
           for name in ("decoder_inputs", "decoder_stack", "decoder_outputs")):
        return Seq2SeqRunner(model)
    return model
