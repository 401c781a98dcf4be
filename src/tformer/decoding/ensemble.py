"""Several translation models decoding as one: an ensemble.

At every step the ensemble's next-token distribution is the mean of its models'
distributions, P(y_t | y_<t, x) = 1/M sum_m P_m(y_t | y_<t, x), returned as its log. Greedy
search, beam search and the loss take it as they take one model's logits (log_softmax
leaves a normalised log-distribution as it is), so every search option works unchanged.
Each model keeps its own encoder output and decoder cache; beam search reorders them all
with the one `reorder` call it makes per step. The models must share the vocabulary (one
tokenizer); their sizes and depths may differ.

Shapes as in tformer.decoding.beam: B rows, T target tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.decoding.runner import runner
from tformer.errors import TformerError
from tformer.evaluation.loss import Targets


class EnsembleCache:
    """One decoder cache per model, reordered together."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    @property
    def length(self) -> int:
        return self.caches[0].length

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        for cache in self.caches:
            cache.reorder(index, sentences)


class Ensemble(nn.Module):
    """The encoder-decoder protocol of tformer.decoding.beam over M models at once.

    `cfg` is the first model's, with the shortest max_len of them all (the longest target
    every model's positions cover).
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        sizes = sorted({m.cfg.vocab_size for m in models})
        if len(sizes) > 1:
            raise TformerError(f"an ensemble's models must share one vocabulary; these have "
                               f"{' and '.join(map(str, sizes))} tokens")
        self.members = nn.ModuleList(models)
        self.cfg = dataclasses.replace(models[0].cfg,
                                       max_len=min(m.cfg.max_len for m in models))

    def encode(self, src: Tensor, src_real: Tensor) -> list[Tensor]:
        return [m.encode(src, src_real) for m in self.members]

    def make_cache(self, batch: int, max_len: int) -> EnsembleCache:
        return EnsembleCache([runner(m).make_cache(batch, max_len) for m in self.members])

    def decode(
        self,
        tgt: Tensor,
        memory: list[Tensor],
        src_real: Tensor,
        *,
        cache: EnsembleCache | None = None,
        tgt_real: Tensor | None = None,
    ) -> Tensor:
        """(B, T) target ids so far -> (B, T, V) log of the models' mean distribution."""
        caches = cache.caches if cache is not None else [None] * len(self.members)
        logprobs = torch.stack([
            F.log_softmax(runner(m).decode(tgt, mem, src_real, cache=c, tgt_real=tgt_real)
                          .float(), -1)
            for m, mem, c in zip(self.members, memory, caches, strict=True)
        ])
        return torch.logsumexp(logprobs, dim=0) - math.log(len(self.members))

    def forward(
        self, src: Tensor, src_real: Tensor, tgt: Tensor, tgt_real: Tensor | None = None, *,
        targets: Targets | None = None,
    ) -> Tensor:
        """Teacher forcing, as Seq2Seq.forward: the log of the mean distribution, or the
        loss of `targets` under it."""
        logprobs = self.decode(tgt, self.encode(src, src_real), src_real, tgt_real=tgt_real)
        return logprobs if targets is None else targets.of_logits(logprobs)
