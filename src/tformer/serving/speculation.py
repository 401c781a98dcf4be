"""Speculative decoding in the server (tformer.decoding.speculative explains the method and
writes the round): a proposer drafts up to K tokens for each sequence in the pool, one target
pass over K + 1 positions scores all of them, and each row keeps what the acceptance rule
keeps.

When a drafter is configured, each engine step is one speculative round for every row of the
pool at once, in one target pass: a row that drafts feeds its pending token and its drafts,
a row that does not (see `speculates`, or prompt lookup found nothing) feeds its pending
token alone, the rest of its columns marked as not real, and takes the plain step's draw
from that position's logits (penalties, logit bias and log-probabilities included). Rows
leave the round with different numbers of new tokens; the positions of the drafts a row
rejected are cut off its row, and the blocks they alone used go back (`PagedPool.truncate`).

The draft model keeps its own paged pool, whose rows mirror the target's: the engine's
`Seats` moves both, and the sequences, together. Each of its rows counts how much of its
text it has read (`PagedPool.read`), so a round first feeds it what it has not.

Which sequences speculate: those whose sampling the round reproduces exactly, that is
temperature (greedy too), top-k and top-p, which the target's and the drafter's
distributions share. Frequency, presence and repetition penalties change with every
accepted token (min-p, min_tokens and ignore_eos are left to the plain step too),
and log-probabilities would need each kept position's logits: such sequences take the plain
step inside the round. A row drafts no more than its max_tokens leaves room for; tokens of
a run after the one that ends a sequence (end of text, a stop token, max_tokens) are
dropped by the engine, and a stop string inside a run is cut where it matches
(serving/completions.py). Rounds need every row's text and its drafts inside the context
(min of the two models'): near the end of it, steps are plain until the long row leaves.

Shapes: n sequences in the pool, K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from tformer.decoding.paged import PagedPool, blocks_for
from tformer.decoding.pool import Rows
from tformer.decoding.speculative import (
    LookupProposer,
    ModelProposer,
    Proposer,
    RowSampling,
    SpeculationStats,
    speculative_round,
)
from tformer.serving.sequence import Sampling, Sequence

Draw = Callable[[Tensor, list[Sequence]], list[int | None]]
"""The engine's plain draw: (m, V) logits of m sequences -> their tokens."""


def speculates(sampling: Sampling) -> bool:
    """Whether a speculative round gives exactly this sampling (see the module's text)."""
    return sampling.logprobs is None and sampling.plain_draw


class Speculator:
    """Drafts for a target's paged pool: with a draft model (its own paged pool, room for
    `capacity` rows of its whole context) or by prompt lookup of `lookup`-grams, up to
    `draft_tokens` a round."""

    def __init__(self, *, capacity: int, draft: nn.Module | None = None, lookup: int = 0,
                 draft_tokens: int = 4) -> None:
        if (draft is None) == (lookup < 1) or draft_tokens < 1:
            raise ValueError("a speculator drafts with a model or by prompt lookup")
        self.pool = None
        if draft is not None:
            self.pool = PagedPool(draft, capacity * blocks_for(draft.cfg.context) + 1,
                                  prefix_cache=False)
            self.pool.reach = draft_tokens  # a round rolls back over its K - 1 draft passes
        self.proposer: Proposer = (ModelProposer(self.pool) if self.pool is not None
                                   else LookupProposer(lookup))
        self.draft_tokens = draft_tokens
        self.stats = SpeculationStats()

    @property
    def pools(self) -> list[PagedPool]:
        """The pools whose rows mirror the target's (the engine's Seats moves them)."""
        return [self.pool] if self.pool is not None else []

    def join(self, prompts: list[list[int]]) -> None:
        """Seat prompts after the target's pool has read them into its next rows."""
        if self.pool is not None:
            # A prompt longer than the draft's context blocks rounds while it is in the
            # pool (ModelProposer.room): its draft row only keeps the rows aligned.
            for prompt in prompts:
                self.pool.join(prompt)

    def round(self, slots: Rows, seqs: list[Sequence], draw: Draw
              ) -> list[list[int | None]] | None:
        """Each row's new tokens of one speculative round over the target's pool (None for
        a row that failed), or None where no row drafts: the engine's plain step then."""
        texts = [seq.prompt + seq.tokens for seq in seqs]
        budgets = [min(self.draft_tokens, seq.sampling.max_tokens - len(seq.tokens) - 1)
                   if speculates(seq.sampling) else 0 for seq in seqs]
        samplings: list[RowSampling | None] = [
            None if seq.finished else RowSampling(seq.sampling.temperature,
                                                  seq.sampling.top_k, seq.sampling.top_p,
                                                  seq.generator)
            for seq in seqs]

        def fail(row: int, what: str, e: Exception) -> None:
            seqs[row].fail(what, e)

        runs = speculative_round(
            slots, self.proposer, texts, budgets, samplings,
            lambda logits, rows: draw(logits, [seqs[row] for row in rows]), self.stats, fail)
        if runs is None:
            return None
        return [[None] if run is None or seq.finished else run
                for seq, run in zip(seqs, runs, strict=True)]
