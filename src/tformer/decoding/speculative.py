"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap drafter proposes K
tokens, the target model scores all of them in one forward pass, and an acceptance rule keeps
exactly the target's distribution. At batch 1 a step of the target reads every weight once
whatever its number of tokens, so each accepted draft token is nearly free.

Drafters: a small model of the same vocabulary (its own KV cache), or prompt lookup (the
continuation of the last n-gram's earlier occurrence in the text so far; no model).

The rule, for a draft token x drawn from q where the target gives p (both after temperature,
top-k and top-p, the distribution plain sampling draws from): accept x with probability
min(1, p(x) / q(x)); at the first rejection draw from max(0, p - q), normalised, and stop;
if all K are accepted, draw one more token from the target's next distribution. Greedy
(temperature 0) accepts x where it is the target's argmax, and takes the argmax at the
first mismatch: the output is the target's own greedy output.

Rows of a batch accept different numbers of tokens. The caches keep one length for all
rows; a row's rejected positions are marked as not real (the padding mask every cache keeps),
so they are never attended to and positions count only the tokens a row kept. A single row
needs no mask: its caches are cut back to the tokens it kept, and the next round writes over
the rejected positions.

Greedy decoding compares token ids alone (`accept_greedy`): no distribution is formed, so a
round costs the passes and little else.

Shapes: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tformer.decoding.lm import EosIds, left_pad, stop_ids
from tformer.decoding.sampling import filter_top_k, filter_top_p
from tformer.errors import TformerError


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


def sampling_probs(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """(..., V) logits -> the distribution plain sampling draws from (one-hot argmax for
    temperature 0), in float32."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    flat = logits.float().reshape(-1, logits.shape[-1]) / temperature
    flat = filter_top_p(filter_top_k(flat, top_k), top_p)
    return flat.softmax(-1).reshape(logits.shape)


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


class _Model:
    """A model and its cache while speculation runs. A batch's cache is padded: rejected
    positions are masked. One row's is not: rejected positions are cut off."""

    def __init__(self, module: nn.Module, batch: int, max_len: int) -> None:
        self.module = module
        self.cache = module.make_cache(batch, max_len, padded=batch > 1)

    @property
    def padded(self) -> bool:
        return self.cache.is_real is not None

    def step(self, tokens: Tensor, is_real: Tensor) -> Tensor:
        """(B, T) tokens after what the cache holds -> (B, T, V) logits."""
        return self.module(tokens, is_real if self.padded else None, cache=self.cache)

    def keep(self, start: int, keep: Tensor) -> None:
        """Keep each row's positions before keep[row] (B,) of those from `start` on."""
        cache = self.cache
        if self.padded:
            slots = torch.arange(start, cache.length, device=keep.device)
            cache.is_real[:, start:cache.length] &= slots < keep[:, None]
        else:
            cache.truncate(int(keep[0]))


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
    steps over the sliding window, as tformer.decoding.lm.generate takes them."""
    if not callable(getattr(target, "make_cache", None)) or (
            draft is not None and not callable(getattr(draft, "make_cache", None))):
        raise TformerError("speculative decoding needs models with a KV cache (gpt)")
    if draft is None and lookup < 1:
        raise TformerError("speculative decoding needs a draft model or --prompt-lookup N >= 1")
    if draft_tokens < 1:
        raise TformerError(f"--draft-tokens {draft_tokens} must be at least 1")
    stats = stats if stats is not None else SpeculationStats()
    B = len(prompts)
    device = next(target.parameters()).device
    context = target.cfg.context
    if draft is not None:
        context = min(context, draft.cfg.context)
    history = [list(p) for p in prompts]
    produced = [0] * B
    done = [False] * B
    stops = frozenset(stop_ids(eos_id))

    def finished(row: int, token: int) -> bool:
        return token in stops or produced[row] >= max_new_tokens

    while not all(done):
        longest = max(len(h) for h in history)
        # Room for the draft tokens and the pending token: speculation needs every row's
        # whole text inside the context (a longer one slides, and its positions move).
        k = min(draft_tokens, context - longest - 1)
        if k < 1:
            yield from _plain_steps(target, history, produced, done, context, finished,
                                    temperature, top_k, top_p, generator, stats)
            return
        # The caches hold all but each row's last token. Rejected drafts leave slots that
        # are not real: a cache that fills up is rebuilt from the rows' texts.
        width = longest - 1
        max_len = context
        ids, real = left_pad([h[:-1] for h in history], 0)
        ids, real = ids.to(device), real.to(device)
        models = [_Model(target, B, max_len)]
        if draft is not None:
            models.append(_Model(draft, B, max_len))
        if width > 0:
            for m in models:
                m.step(ids, real)
        pending = torch.tensor([[h[-1]] for h in history], device=device)
        extra: Tensor | None = None  # a draft token the draft model has not read yet
        while not all(done):
            k = min(draft_tokens, context - max(len(h) for h in history) - 1)
            if k < 1 or models[0].cache.length + k + 2 > max_len:
                break  # start afresh: rebuilt caches, or plain steps past the context
            alive = torch.tensor([not d for d in done], device=device)
            drafted, q = _propose(models, draft, lookup, history, pending, extra, k,
                                  alive, temperature, top_k, top_p, generator)
            start = models[0].cache.length
            verify = torch.cat([pending, drafted.tokens], dim=1)
            logits = models[0].step(verify, torch.ones_like(verify, dtype=torch.bool))
            if temperature == 0:
                new_tokens, n_accepted = accept_greedy(logits.argmax(-1), drafted)
            else:
                p = sampling_probs(logits, temperature, top_k, top_p)
                new_tokens, n_accepted = accept(p, q, drafted, temperature, generator)
            round_out: list[list[int]] = []
            for row in range(B):
                if done[row]:
                    round_out.append([])
                    continue
                kept: list[int] = []
                for token in new_tokens[row]:
                    kept.append(token)
                    produced[row] += 1
                    if finished(row, token):
                        done[row] = True
                        break
                history[row] += kept
                round_out.append(kept)
                stats.drafted += int(drafted.count[row])
                stats.accepted += min(int(n_accepted[row]), len(kept))
                stats.tokens += len(kept)
            stats.rounds += 1
            yield round_out
            # The target read pending + k drafts: rows keep pending and their accepted ones.
            models[0].keep(start, start + 1 + n_accepted)
            if draft is not None:
                # The draft read pending and drafts 1..k-1; it keeps pending and the accepted
                # ones it has read, and reads the k-th next round where all k were accepted.
                dm = models[1]
                dstart = dm.cache.length - k
                dm.keep(dstart, dstart + 1 + n_accepted.clamp(max=k - 1))
                all_in = n_accepted == k
                extra = torch.where(all_in, drafted.tokens[:, -1], -1)[:, None]
                extra = None if not bool(all_in.any()) else extra
            pending = torch.tensor([[h[-1]] for h in history], device=device)


@dataclass
class Drafted:
    tokens: Tensor
    """(B, K) proposed tokens (rows with fewer proposals are filled up: see count)."""
    count: Tensor
    """(B,) how many of each row's tokens were really proposed."""


def _propose(
    models: list[_Model], draft: nn.Module | None, lookup: int, history: list[list[int]],
    pending: Tensor, extra: Tensor | None, k: int, alive: Tensor, temperature: float,
    top_k: int, top_p: float, generator: torch.Generator | None,
) -> tuple[Drafted, Tensor | None]:
    """k draft tokens a row, and q (B, K, V) where a model drafted them (None: lookup)."""
    B = pending.shape[0]
    device = pending.device
    if draft is None:
        tokens = torch.zeros(B, k, dtype=torch.long, device=device)
        count = torch.zeros(B, dtype=torch.long, device=device)
        for row, h in enumerate(history):
            proposal = lookup_draft(h, lookup, k) if alive[row] else []
            if proposal:
                tokens[row, :len(proposal)] = torch.tensor(proposal, device=device)
                count[row] = len(proposal)
        return Drafted(tokens, count), None
    dm = models[1]
    feed, real = pending, torch.ones_like(pending, dtype=torch.bool)
    if extra is not None:
        # Rows that accepted every draft last round read that round's last one first.
        feed = torch.cat([extra.clamp(min=0), pending], dim=1)
        real = torch.cat([extra >= 0, real], dim=1)
    drafted, qs = [], []
    for i in range(k):
        logits = dm.step(feed, real)[:, -1]
        if temperature == 0:  # greedy acceptance needs the draft's tokens only
            token = logits.argmax(-1)
        else:
            q = sampling_probs(logits, temperature, top_k, top_p)
            token = torch.multinomial(q, 1, generator=generator)[:, 0]
            qs.append(q)
        drafted.append(token)
        if i < k - 1:
            feed, real = token[:, None], torch.ones(B, 1, dtype=torch.bool, device=device)
    tokens = torch.stack(drafted, dim=1)
    count = torch.where(alive, k, 0)
    return Drafted(tokens, count), torch.stack(qs, dim=1) if qs else None


def accept_greedy(best: Tensor, drafted: Drafted) -> tuple[list[list[int]], Tensor]:
    """`accept` at temperature 0, from the target's argmax after pending and each draft
    (best: B x K + 1): drafts are kept while they are the target's choice, then the
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
    how many drafts each accepted. p (B, K + 1, V): the target after pending and each
    draft; q (B, K, V) the drafter's, None for a point mass on each draft token."""
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


def _plain_steps(
    target: nn.Module, history: list[list[int]], produced: list[int], done: list[bool],
    context: int, finished, temperature: float, top_k: int, top_p: float,
    generator: torch.Generator | None, stats: SpeculationStats,
) -> Iterator[list[list[int]]]:
    """One token a round for every row, each row's own sliding window over its last
    `context` tokens (plain decoding's rule once a text outgrows the context)."""
    from tformer.decoding.sampling import next_token

    device = next(target.parameters()).device
    window = target.cfg.context
    while not all(done):
        ids, real = left_pad([h[-window:] for h in history], 0)
        logits = target(ids.to(device), real.to(device), last_only=True)[:, -1]
        chosen = next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                            generator=generator)
        out: list[list[int]] = []
        for row, token in enumerate(chosen.tolist()):
            if done[row]:
                out.append([])
                continue
            history[row].append(token)
            produced[row] += 1
            stats.tokens += 1
            done[row] = finished(row, token)
            out.append([token])
        stats.rounds += 1
        yield out
