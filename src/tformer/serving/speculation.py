"""Speculative decoding in the server (tformer.decoding.speculative explains the method): a
drafter proposes up to K tokens for each sequence in the pool, one target pass over K + 1
positions scores all of them, and each row keeps what the acceptance rule keeps.

The design. When a drafter is configured, each engine step is one speculative round for
every row of the pool at once, in one target pass: a row that drafts feeds its pending
token and its drafts, a row that does not (see `speculates`, or prompt lookup found
nothing) feeds its pending token alone, the rest of its columns marked as not real, and
takes the plain step's draw from that position's logits (penalties, logit bias and
log-probabilities included). Rows leave the round with different numbers of new tokens;
the columns of the drafts a row rejected are marked as not real (`SlotPool.truncate`), the
same rollback as speculative.py's, so the pool's one column clock goes on for all rows.

The draft model keeps its own pool, whose rows mirror the target's (they join, leave and
move together). `fed` says how much of each row's text that pool has read: a round first
feeds each drafting row the tokens it has not read (its pending token, and the last draft
where all were accepted, or what plain steps added), then drafts one token a pass.

Which sequences speculate: those whose sampling the round reproduces exactly, that is
temperature (greedy too), top-k and top-p, which the target's and the drafter's
distributions share. Frequency and presence penalties change with every accepted token,
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

import torch
from torch import Tensor, nn

from tformer.decoding.lm import left_pad
from tformer.decoding.pool import SlotPool
from tformer.decoding.speculative import (
    Drafted,
    SpeculationStats,
    accept,
    accept_greedy,
    lookup_draft,
    sampling_probs,
)
from tformer.serving.sequence import Sampling, Sequence

Draw = Callable[[Tensor, list[Sequence]], list[int | None]]
"""The engine's plain draw: (m, V) logits of m sequences -> their tokens."""


def speculates(sampling: Sampling) -> bool:
    """Whether a speculative round gives exactly this sampling (see the module's text)."""
    return sampling.logprobs is None and not sampling.adjusts


class Speculator:
    """Drafts for a target's SlotPool: with a draft model (its own pool of `capacity`
    rows) or by prompt lookup of `lookup`-grams, up to `draft_tokens` a round."""

    def __init__(self, *, context: int, capacity: int, draft: nn.Module | None = None,
                 lookup: int = 0, draft_tokens: int = 4) -> None:
        if (draft is None) == (lookup < 1) or draft_tokens < 1:
            raise ValueError("a speculator drafts with a model or by prompt lookup")
        self.pool = SlotPool(draft, capacity) if draft is not None else None
        self.context = min(context, self.pool.context) if self.pool is not None else context
        self.lookup = lookup
        self.draft_tokens = draft_tokens
        self.fed: list[int] = []
        """Per row: how many tokens of its text the draft pool has read."""
        self.stats = SpeculationStats()

    # Rows, as the target's pool seats them.

    def join(self, prompts: list[list[int]]) -> None:
        """Seat prompts after the target's pool has read them into its next rows."""
        if self.pool is not None:
            # A prompt longer than the draft's context blocks rounds while it is in the
            # pool (see `_budgets`): its draft row only keeps the rows aligned.
            self.pool.prefill([p[-self.pool.context:] for p in prompts])
        self.fed += [len(p) for p in prompts]

    def remove(self, row: int) -> None:
        """Free a row as SlotPool.remove does: the last row moves into it."""
        if self.pool is not None:
            self.pool.remove(row)
        last = self.fed.pop()
        if row < len(self.fed):
            self.fed[row] = last

    def clear(self) -> None:
        if self.pool is not None:
            self.pool.clear()
        self.fed = []

    # A round.

    def round(self, slots: SlotPool, seqs: list[Sequence], draw: Draw
              ) -> list[list[int | None]] | None:
        """Each row's new tokens of one speculative round over the target's pool (None for
        a row that failed), or None where no row drafts: the engine's plain step then."""
        texts = [seq.prompt + seq.tokens for seq in seqs]
        budgets = self._budgets(seqs, texts)
        if max(budgets) == 0:
            return None
        device = slots.device
        tokens, count, q = self._propose(seqs, texts, budgets, device)
        width = int(count.max())
        if width == 0:
            return None
        pending = torch.tensor([text[-1] for text in texts], device=device)
        verify = torch.cat([pending[:, None], tokens[:, :width]], dim=1)
        real = torch.arange(width + 1, device=device)[None] <= count[:, None]
        logits = slots.extend(verify, real)
        n_accepted = torch.zeros(len(seqs), dtype=torch.long, device=device)
        runs: list[list[int | None]] = [[None] for _ in seqs]
        plain = [row for row, seq in enumerate(seqs) if count[row] == 0 and not seq.finished]
        if plain:
            drawn = draw(logits[plain, 0], [seqs[row] for row in plain])
            for row, token in zip(plain, drawn, strict=True):
                runs[row] = [token]
        for row, seq in enumerate(seqs):
            if count[row] > 0 and not seq.finished:
                runs[row], n_accepted[row] = self._verify(seq, logits[row], tokens[row],
                                                          q[row] if q is not None else None,
                                                          int(count[row]))
        slots.truncate(1 + n_accepted, width + 1)
        if self.pool is not None:
            self._keep_drafts(texts, budgets, n_accepted, int(max(budgets)))
        self.stats.rounds += 1
        return runs

    def _budgets(self, seqs: list[Sequence], texts: list[list[int]]) -> list[int]:
        """How many tokens each row drafts this round: 0 for a row that does not speculate
        or has one token left to make, and none where the round would not fit."""
        longest = max(len(text) for text in texts)
        # The target reads each row's pending token and drafts after the text it holds.
        room = min(self.draft_tokens, self.context - longest)
        budgets = [min(room, seq.sampling.max_tokens - len(seq.tokens) - 1)
                   if speculates(seq.sampling) else 0 for seq in seqs]
        if self.pool is not None and max(budgets) > 0:
            # The draft's columns: its longest row, the unread tokens, then K - 1 drafts.
            n = self.pool.rows
            held = int(self.pool.is_real[:n].sum(1).max())
            unread = max(len(text) - fed for text, fed, budget
                         in zip(texts, self.fed, budgets, strict=True) if budget > 0)
            room = min(room, self.pool.context - held - unread + 1)
        return [max(0, min(budget, room)) for budget in budgets]

    def _propose(self, seqs: list[Sequence], texts: list[list[int]], budgets: list[int],
                 device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
        """(n, K) draft tokens, (n,) how many each row proposes, and the (n, K, V)
        distributions a draft model drew them from (None: prompt lookup's point masses)."""
        K = max(budgets)
        count = torch.tensor(budgets, device=device)
        if self.pool is None:
            tokens = torch.zeros(len(seqs), K, dtype=torch.long, device=device)
            for row, (text, budget) in enumerate(zip(texts, budgets, strict=True)):
                proposal = lookup_draft(text, self.lookup, budget) if budget else []
                tokens[row, :len(proposal)] = torch.tensor(proposal, dtype=torch.long)
                count[row] = len(proposal)
            return tokens, count, None
        drafting = count > 0
        unread = [text[fed:] if budget else []
                  for text, fed, budget in zip(texts, self.fed, budgets, strict=True)]
        ids, real = left_pad(unread, 0)
        logits = self.pool.extend(ids.to(device), real.to(device), last_only=True)[:, -1]
        drafts, qs = [], []
        for i in range(K):
            q, token = self._draft_step(logits, seqs, drafting)
            drafts.append(token)
            qs.append(q)
            if i < K - 1:
                logits = self.pool.extend(token[:, None], drafting[:, None], last_only=True)
                logits = logits[:, -1]
        return torch.stack(drafts, dim=1), count, torch.stack(qs, dim=1)

    @staticmethod
    def _draft_step(logits: Tensor, seqs: list[Sequence], drafting: Tensor
                    ) -> tuple[Tensor, Tensor]:
        """(n, V) draft logits -> each drafting row's distribution q (its own temperature,
        top-k and top-p) and its token drawn from q with its own generator."""
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        tokens = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
        for row, seq in enumerate(seqs):
            if not drafting[row] or seq.finished:
                continue
            opts = seq.sampling
            try:
                q[row] = sampling_probs(logits[row], opts.temperature, opts.top_k, opts.top_p)
                tokens[row] = (q[row].argmax() if opts.temperature == 0 else
                               torch.multinomial(q[row], 1, generator=seq.generator)[0])
            except Exception as e:  # a broken draft distribution fails its sequence
                seq.fail("drafting", e)
        return q, tokens

    def _verify(self, seq: Sequence, logits: Tensor, tokens: Tensor, q: Tensor | None,
                count: int) -> tuple[list[int | None], int]:
        """A drafting row's tokens of the round and how many drafts it accepted, from the
        target's (count + 1, V) logits after its pending token and its drafts."""
        opts = seq.sampling
        try:
            drafted = Drafted(tokens[None, :count], torch.tensor([count], device=logits.device))
            if opts.temperature == 0:  # token ids alone: no distribution to form
                new, n_accepted = accept_greedy(logits[None, :count + 1].argmax(-1), drafted)
            else:
                p = sampling_probs(logits[None, :count + 1], opts.temperature, opts.top_k,
                                   opts.top_p)
                new, n_accepted = accept(p, None if q is None else q[None, :count], drafted,
                                         opts.temperature, seq.generator)
        except Exception as e:
            seq.fail("sampling", e)
            return [None], 0
        self.stats.drafted += count
        self.stats.accepted += int(n_accepted[0])
        self.stats.tokens += len(new[0])
        return list(new[0]), int(n_accepted[0])

    def _keep_drafts(self, texts: list[list[int]], budgets: list[int], n_accepted: Tensor,
                     K: int) -> None:
        """The draft pool read each drafting row's text and drafts 1..K-1: it keeps the
        accepted ones (the K-th, and the target's token, it reads next round)."""
        assert self.pool is not None
        read = n_accepted.clamp(max=K - 1)
        drafting = torch.tensor(budgets, device=read.device) > 0
        if K > 1:
            self.pool.truncate(torch.where(drafting, read, K - 1), K - 1)
        for row, (text, budget) in enumerate(zip(texts, budgets, strict=True)):
            if budget:
                self.fed[row] = len(text) + int(read[row])
