"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap proposer drafts K
tokens, the target model scores all of them in one forward pass, and an acceptance rule keeps
exactly the target's distribution. At batch 1 a step of the target reads every weight once
whatever its number of tokens, so each accepted draft token is nearly free.

Proposers: a small model of the same vocabulary (`ModelProposer`, over its own cache rows),
or prompt lookup (`LookupProposer`: the continuation of the last n-gram's earlier occurrence
in the text so far; no model).

The rule, for a draft token x drawn from q where the target gives p (both after temperature,
top-k and top-p, the distribution plain sampling draws from): accept x with probability
min(1, p(x) / q(x)); at the first rejection draw from max(0, p - q), normalised, and stop;
if all K are accepted, draw one more token from the target's next distribution. Greedy
(temperature 0) accepts x where it is the target's argmax, and takes the argmax at the
first mismatch: the output is the target's own greedy output. Greedy decoding compares
token ids alone (`accept_greedy`): no distribution is formed.

`speculative_round` is one round over any cache rows (decoding/pool.py's `Rows`): propose,
verify (one target pass over each row's pending token and its drafts), accept, roll back
(each cache forgets the drafts its row rejected). `speculative_generate` is a loop of
rounds over generate's rows; the server's engine (serving/speculation.py) runs the same
round over its pool. Rows accept different numbers of tokens: each row's rejected positions
are cut off its blocks (decoding/paged.py) or its one cache (decoding/pool.py's OneRow).

Shapes: n rows, K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from tformer.decoding.lm import EosIds, left_pad, stop_ids, window
from tformer.decoding.pool import Rows, rows_for
from tformer.decoding.sampling import next_token, sampling_probs
from tformer.errors import TformerError
from tformer.kernels.blocks import REPACK_MIN_ROWS, keep_repacked


@dataclass
class SpeculationStats:
    """What the drafts bought: `accepted` of `drafted` tokens kept, over `rounds` passes of
    the target."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    tokens: int = 0
    """Tokens produced, the target's own among them."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"drafted": self.drafted, "accepted": self.accepted, "rounds": self.rounds,
                "tokens": self.tokens, "acceptance_rate": round(self.acceptance_rate, 4)}


@dataclass(frozen=True)
class RowSampling:
    """How a row samples: the distribution (temperature, top-k, top-p) and its generator."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def key(self) -> tuple:
        """Rows with equal keys draw together, as one batch."""
        return self.temperature, self.top_k, self.top_p, id(self.generator)


Draw = Callable[[Tensor, list[int]], list]
"""A row's plain draw, for rows that drafted nothing: (m, V) logits of rows -> m tokens
(None for a row that failed)."""
Fail = Callable[[int, str, Exception], None]
"""What to do when a row's drafting or sampling raises (row, what failed, the error); the
row takes no token this round. None: the error propagates."""


@dataclass
class Drafted:
    tokens: Tensor
    """(n, K) proposed tokens (rows with fewer proposals are filled up: see count)."""
    count: Tensor
    """(n,) how many of each row's tokens were really proposed."""


class Proposer(Protocol):
    """Drafts tokens for the rows of a round. Its rows follow the target's."""

    def room(self, texts: list[list[int]], budgets: list[int]) -> int:
        """The most tokens a row may draft this round (its own cache's bound)."""
        ...

    def propose(self, texts: list[list[int]], budgets: list[int],
                samplings: list[RowSampling | None], fail: Fail | None
                ) -> tuple[Drafted, Tensor | None]:
        """Up to budgets[i] tokens after text i, and the (n, K, V) distributions q they
        were drawn from (None: point masses on the tokens, as prompt lookup's)."""
        ...

    def settle(self, drafted: Drafted, n_accepted: Tensor) -> None:
        """After verification: keep what each row accepted, forget the rest."""
        ...


def lookup_draft(history: list[int], n: int, k: int) -> list[int]:
    """Prompt lookup: the up to k tokens that followed the latest earlier occurrence of the
    history's last n tokens (trying n, then shorter n-grams down to 1); none if it never
    occurred."""
    for size in range(min(n, len(history) - 1), 0, -1):
        tail = history[-size:]
        for start in range(len(history) - size - 1, -1, -1):
            if history[start:start + size] == tail:
                return history[start + size:start + size + k]
    return []


class LookupProposer:
    """Prompt lookup of `n`-grams: no model, no cache."""

    def __init__(self, n: int) -> None:
        self.n = n

    def room(self, texts: list[list[int]], budgets: list[int]) -> int:
        return 1 << 30

    def propose(self, texts: list[list[int]], budgets: list[int],
                samplings: list[RowSampling | None], fail: Fail | None
                ) -> tuple[Drafted, Tensor | None]:
        tokens = torch.zeros(len(texts), max(budgets), dtype=torch.long)
        count = torch.zeros(len(texts), dtype=torch.long)
        for row, (text, budget) in enumerate(zip(texts, budgets, strict=True)):
            proposal = lookup_draft(text, self.n, budget) if budget else []
            tokens[row, :len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            count[row] = len(proposal)
        return Drafted(tokens, count), None

    def settle(self, drafted: Drafted, n_accepted: Tensor) -> None:
        pass


class ModelProposer:
    """A draft model over its own cache rows (decoding/pool.py), which follow the target's.
    A round first feeds each drafting row what it has not read of its text (its pending
    token; also the last draft where all were accepted, or what plain steps added), then
    drafts one token a pass."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows

    def room(self, texts: list[list[int]], budgets: list[int]) -> int:
        # The whole text inside the draft's context (a longer one slides, and its positions
        # move), and its columns: the longest row, the unread tokens, then K - 1 drafts.
        unread = max(len(text) - read for text, read, budget
                     in zip(texts, self.rows.read, budgets, strict=True) if budget > 0)
        context = self.rows.context
        return min(context - max(len(text) for text in texts),
                   context - self.rows.held() - unread + 1)

    def propose(self, texts: list[list[int]], budgets: list[int],
                samplings: list[RowSampling | None], fail: Fail | None
                ) -> tuple[Drafted, Tensor | None]:
        K = max(budgets)
        count = torch.tensor(budgets)
        device = self.rows.device
        drafting = (count > 0).to(device)[:, None]
        unread = [text[read:] if budget else []
                  for text, read, budget in zip(texts, self.rows.read, budgets, strict=True)]
        ids, real = left_pad(unread, 0)
        logits = self.rows.extend(ids.to(device), real.to(device), last_only=True)[:, -1]
        draws = [row if budget else None for row, budget in enumerate(budgets)]
        tokens, qs = [], []
        for i in range(K):
            q, token = _draft_step(logits, samplings, draws, fail)
            tokens.append(token)
            qs.append(q)
            if i < K - 1:
                logits = self.rows.extend(token[:, None], drafting, last_only=True)[:, -1]
        q = None if all(q is None for q in qs) else torch.stack(
            [q if q is not None else torch.zeros_like(logits, dtype=torch.float32)
             for q in qs], dim=1)
        return Drafted(torch.stack(tokens, dim=1), count), q

    def settle(self, drafted: Drafted, n_accepted: Tensor) -> None:
        # The draft read drafts 1..K-1: a row keeps the accepted ones (the K-th, and the
        # target's token, it reads next round); a row that drafted nothing read nothing.
        K = drafted.tokens.shape[1]
        if K > 1:
            kept = [min(n, K - 1) if c > 0 else K - 1
                    for n, c in zip(n_accepted.tolist(), drafted.count.tolist(), strict=True)]
            self.rows.truncate(torch.tensor(kept, device=self.rows.device), K - 1)


def _index(rows: list[int], n: int, device: torch.device) -> Tensor | slice:
    """Rows as an index: every row of n as a slice, so one group of all rows (generate's
    batch, one row alone) indexes nothing."""
    return slice(None) if len(rows) == n else torch.tensor(rows, device=device)


def _groups(rows: list[int], samplings: list[RowSampling | None]) -> dict[tuple, list[int]]:
    """The rows, by the sampling they share (each group draws as one batch)."""
    groups: dict[tuple, list[int]] = {}
    for row in rows:
        sampling = samplings[row]
        assert sampling is not None
        groups.setdefault(sampling.key, []).append(row)
    return groups


def _draft_step(logits: Tensor, samplings: list[RowSampling | None], rows: list[int | None],
                fail: Fail | None) -> tuple[Tensor | None, Tensor]:
    """(n, V) draft logits -> each drafting row's distribution q (None where every row is
    greedy: greedy acceptance needs the tokens alone) and its token drawn from q."""
    n = logits.shape[0]
    live = [row for row in rows if row is not None and samplings[row] is not None]
    groups = _groups(live, samplings)
    whole = len(live) == n and len(groups) == 1  # one draw for every row: no indexing
    tokens = None if whole else torch.zeros(n, dtype=torch.long, device=logits.device)
    q = None
    for group in groups.values():
        opts = samplings[group[0]]
        assert opts is not None
        index = _index(group, n, logits.device)
        try:
            if opts.temperature == 0:
                drawn = logits[index].argmax(-1)
            else:
                probs = sampling_probs(logits[index], opts.temperature, opts.top_k, opts.top_p)
                drawn = torch.multinomial(probs, 1, generator=opts.generator)[:, 0]
                if whole:
                    q = probs
                else:
                    if q is None:
                        q = torch.zeros(logits.shape, dtype=torch.float32,
                                        device=logits.device)
                    q[index] = probs
            if whole:
                return q, drawn
            tokens[index] = drawn
        except Exception as e:  # a broken draft distribution fails its rows
            if fail is None:
                raise
            for row in group:
                fail(row, "drafting", e)
                samplings[row] = None
    if tokens is None:  # the one group failed
        tokens = torch.zeros(n, dtype=torch.long, device=logits.device)
    return q, tokens


def speculative_round(
    target: Rows, proposer: Proposer, texts: list[list[int]], budgets: list[int],
    samplings: list[RowSampling | None], draw: Draw, stats: SpeculationStats,
    fail: Fail | None = None,
) -> list[list | None] | None:
    """One round: each row's new tokens (None for a row that takes none: samplings[row] is
    None, or it failed), or None where no row drafts (the caller's plain step then).

    target: the target's rows, having read each text but its last token (pending); budgets:
    the most tokens each row may draft (0: it takes a plain draw from the same pass, as
    `draw` makes it). Every row's text and its drafts stay inside both contexts.
    """
    samplings = list(samplings)
    longest = max(len(text) for text in texts)
    budgets = [b if samplings[row] is not None else 0 for row, b in enumerate(budgets)]
    if max(budgets) > 0:
        # The target reads each row's pending token and drafts after the text it holds.
        room = min(target.context - longest, proposer.room(texts, budgets))
        budgets = [max(0, min(budget, room)) for budget in budgets]
    if max(budgets) == 0:
        return None
    drafted, q = proposer.propose(texts, budgets, samplings, fail)
    counts = drafted.count.tolist()
    width = max(counts)
    if width == 0:
        return None
    device = target.device
    count = drafted.count.to(device)
    alive = [s is not None for s in samplings]
    pending = torch.tensor([text[-1] for text in texts], device=device)
    draft_tokens = drafted.tokens[:, :width].to(device)
    verify = torch.cat([pending[:, None], draft_tokens], dim=1)
    # A row that takes no token (a finished one) reads nothing.
    real = torch.arange(width + 1, device=device)[None] <= count[:, None]
    if not all(alive):
        real &= torch.tensor(alive, device=device)[:, None]
    logits = target.extend(verify, real)

    runs: list[list | None] = [None] * len(texts)
    n_accepted = torch.zeros(len(texts), dtype=torch.long, device=device)
    plain = [row for row, n in enumerate(counts) if n == 0 and samplings[row] is not None]
    if plain:
        for row, token in zip(plain, draw(logits[plain, 0], plain), strict=True):
            runs[row] = [token]
    verifying = [row for row, n in enumerate(counts) if n > 0 and samplings[row] is not None]
    for group in _groups(verifying, samplings).values():
        opts = samplings[group[0]]
        assert opts is not None
        index = _index(group, len(texts), device)
        w = max(counts[row] for row in group)
        if isinstance(index, slice) and w == width:  # every row, every column
            part, scores, q_part = Drafted(draft_tokens, count), logits, q
        else:
            part = Drafted(draft_tokens[index, :w], count[index])
            scores, q_part = logits[index, :w + 1], None if q is None else q[index, :w]
        try:
            if opts.temperature == 0:
                new, accepted = accept_greedy(scores.argmax(-1), part)
            else:
                p = sampling_probs(scores, opts.temperature, opts.top_k, opts.top_p)
                new, accepted = accept(p, None if q_part is None else q_part.to(device),
                                       part, opts.temperature, opts.generator)
        except Exception as e:
            if fail is None:
                raise
            for row in group:
                fail(row, "sampling", e)
            continue
        if isinstance(index, slice):
            n_accepted = accepted
        else:
            n_accepted[index] = accepted
        for row, tokens in zip(group, new, strict=True):
            runs[row] = tokens
            stats.drafted += counts[row]
            stats.accepted += len(tokens) - 1  # its accepted drafts, then the target's own
    target.truncate(1 + n_accepted, width + 1)
    proposer.settle(drafted, n_accepted.cpu())
    stats.rounds += 1
    return runs


def accept_greedy(best: Tensor, drafted: Drafted) -> tuple[list[list[int]], Tensor]:
    """`accept` at temperature 0, from the target's argmax after pending and each draft
    (best: n x K + 1): drafts are kept while they are the target's choice, then the
    target's own token follows."""
    K = drafted.tokens.shape[1]
    ok = drafted.tokens == best[:, :K]
    ok &= torch.arange(K, device=best.device)[None] < drafted.count[:, None]
    n_accepted = ok.long().cumprod(dim=1).sum(dim=1)
    rows = best.tolist()
    counts = n_accepted.tolist()
    return [row[:n + 1] for row, n in zip(rows, counts, strict=True)], n_accepted


def accept(
    p: Tensor, q: Tensor | None, drafted: Drafted, temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[list[int]], Tensor]:
    """Each row's tokens of this round (its accepted drafts, then the target's own), and
    how many drafts each accepted. p (n, K + 1, V): the target after pending and each
    draft; q (n, K, V) the drafter's, None for a point mass on each draft token."""
    B, K = drafted.tokens.shape
    tokens = drafted.tokens
    p_draft = p[:, :K].gather(-1, tokens[..., None])[..., 0]
    if q is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = q.gather(-1, tokens[..., None])[..., 0]
    if temperature == 0:
        ok = p_draft > 0  # one-hot p: the draft is the target's argmax
    else:
        u = torch.rand(B, K, generator=generator, device=p.device)
        ok = u * q_draft < p_draft  # u < p / q, without dividing by a q that may be 0
    ok &= torch.arange(K, device=p.device)[None] < drafted.count[:, None]
    # Drafts are kept up to the first rejection.
    n_accepted = ok.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=p.device)
    last = p[rows, n_accepted]
    rejected = n_accepted < drafted.count
    if q is None:
        q_last = torch.nn.functional.one_hot(tokens[rows, n_accepted.clamp(max=K - 1)],
                                             p.shape[-1]).float()
    else:
        q_last = q[rows, n_accepted.clamp(max=K - 1)]
    residual = (last - q_last).clamp(min=0)
    # A rejected draft leaves max(0, p - q); where that is all zero (p = q up to rounding),
    # p itself is the right distribution.
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), last)
    final = torch.where(rejected[:, None], residual, last)
    if temperature == 0:
        chosen = final.argmax(-1)
    else:
        chosen = torch.multinomial(final, 1, generator=generator)[:, 0]
    out = [tokens[row, :n_accepted[row]].tolist() + [int(chosen[row])] for row in range(B)]
    return out, n_accepted


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    draft: nn.Module | None = None,
    lookup: int = 0,
    draft_tokens: int = 4,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    eos_id: EosIds = None,
    stats: SpeculationStats | None = None,
) -> Iterator[list[list[int]]]:
    """Yield, round by round, each row's new tokens of that round (a list per row; a
    finished row's is empty). draft: a drafting model of the target's vocabulary; lookup: the
    n-gram size of prompt lookup (used where `draft` is None). A row ends at eos_id (or at
    any of several) or after max_new_tokens; past the target's context, rounds are plain
    steps over the sliding window (tformer.decoding.lm.window)."""
    if not callable(getattr(target, "make_cache", None)) or (
            draft is not None and not callable(getattr(draft, "make_cache", None))):
        raise TformerError("speculative decoding needs models with a KV cache (gpt)")
    if draft is None and lookup < 1:
        raise TformerError("speculative decoding needs a draft model or --prompt-lookup N >= 1")
    if draft_tokens < 1:
        raise TformerError(f"--draft-tokens {draft_tokens} must be at least 1")
    stats = stats if stats is not None else SpeculationStats()
    # Every round verifies draft_tokens + 1 rows a sequence: the block layers' repacked
    # copy pays for itself at each (kernels/blocks.py, keep_repacked).
    if draft_tokens + 1 >= REPACK_MIN_ROWS:
        for model in (target, draft):
            model = getattr(model, "model", model)  # a decoding runner's model
            if isinstance(model, nn.Module):
                keep_repacked(model)
    device = next(target.parameters()).device
    context = target.cfg.context
    history = [list(p) for p in prompts]
    produced = [0] * len(prompts)
    stops = frozenset(stop_ids(eos_id))
    sampling = RowSampling(temperature, top_k, top_p, generator)
    samplings: list[RowSampling | None] = [sampling] * len(prompts)

    def draw(logits: Tensor, rows: list[int]) -> list[int]:
        return next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator).tolist()

    # The caches hold all but each row's last token (pending).
    rows = rows_for(target, [h[:-1] for h in history])
    proposer: Proposer = (ModelProposer(rows_for(draft, [h[:-1] for h in history]))
                          if draft is not None else LookupProposer(lookup))
    while any(s is not None for s in samplings):
        live = [row for row, s in enumerate(samplings) if s is not None]
        if max(len(h) for h in history) > context:
            # Past the context, every row reads its window afresh (a text slides, and its
            # positions move): plain steps.
            ids, real = window([history[row] for row in live], context)
            logits = target(ids.to(device), None if real is None else real.to(device),
                            last_only=True)[:, -1]
            runs: list[list | None] = [None] * len(history)
            for row, token in zip(live, draw(logits, live), strict=True):
                runs[row] = [token]
            stats.rounds += 1
        else:
            budgets = [min(draft_tokens, max_new_tokens - produced[row] - 1)
                       if samplings[row] is not None else 0 for row in range(len(history))]
            runs = speculative_round(rows, proposer, history, budgets, samplings, draw, stats)
            if runs is None:
                pending = torch.tensor([[h[-1]] for h in history], device=device)
                alive = torch.tensor([[s is not None] for s in samplings], device=device)
                logits = rows.extend(pending, alive, last_only=True)[:, -1]
                runs = [None] * len(history)
                for row, token in zip(live, draw(logits[live], live), strict=True):
                    runs[row] = [token]
                stats.rounds += 1
        out: list[list[int]] = []
        for row, run in enumerate(runs):
            kept: list[int] = []
            for token in run or []:
                kept.append(token)
                produced[row] += 1
                if token in stops or produced[row] >= max_new_tokens:
                    samplings[row] = None
                    break
            history[row] += kept
            stats.tokens += len(kept)
            out.append(kept)
        yield out
