"""One client's sequence as the engines decode it: its sampling settings, what it has
produced, and the per-sequence steps of a shared decoding step (penalties and logit bias,
sampling, log-probabilities), each sequence with its own generator.

Shapes: n sequences in flight, V vocabulary.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tformer.decoding.constraints import mask_logits
from tformer.decoding.sampling import (
    NO_EXTRA,
    ExtraSampling,
    hold_back,
    next_token,
    penalize_repetition,
)

if TYPE_CHECKING:
    from tformer.decoding.constraints import Grammar, Matcher

log = logging.getLogger(__name__)

Deliver = Callable[[int | None, str | None], None]
"""Called from the decoding thread with (token, None) for each new token, then once with
(None, finish_reason): 'stop' (end of text), 'length' (max_tokens), 'cancelled' or 'error'
(then `Sequence.error` says what failed)."""

SEED_LIMIT = 2**64
"""Seeds are 0 <= seed < SEED_LIMIT: what torch.Generator.manual_seed takes."""

@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    """0 is greedy."""
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    """None: a fresh random seed."""
    logprobs: int | None = None
    """Keep each new token's log-probability and the `logprobs` likeliest (None: keep none)."""
    prompt_logprobs: bool = False
    """Also the prompt's tokens' log-probabilities (with as many likeliest)."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, added to its logit)."""
    stop_tokens: tuple[int, ...] = ()
    """Tokens that end the sequence as the end of text does (a chat's end of turn)."""
    constraint: Grammar | None = None
    """What the text follows (a JSON schema, a regex, a tool call's form): every draw is
    among the tokens that can continue it, and the sequence ends where it is complete."""
    extra: ExtraSampling = NO_EXTRA
    """min_p, repetition_penalty, min_tokens, ignore_eos (vLLM's and llama.cpp's)."""
    priority: int = 0
    """Where the engine has no room for every sequence, lower values are served first
    (vLLM's `priority`)."""

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before drawing (penalties, bias, a constraint, ends
        held back by min_tokens)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias
                    or self.constraint is not None or self.extra.changes_logits)

    @property
    def plain_draw(self) -> bool:
        """Whether a draw is temperature, top-k and top-p of the model's logits alone, and
        only the end of text (or a constraint, or max_tokens) ends the text."""
        return not self.adjusts and self.extra == NO_EXTRA


TokenLogprob = tuple[float, list[tuple[int, float]]]
"""A token's log-probability, and the likeliest tokens with theirs, best first."""


class Sequence:
    """One text being generated: its prompt, its tokens so far, and where they go.

    `cancel()` may be called from any thread (the client left, or a stop string matched);
    the decoding thread drops the sequence before its next step.
    """

    def __init__(self, prompt: list[int], sampling: Sampling, deliver: Deliver) -> None:
        if not prompt:
            raise ValueError("a sequence needs at least one prompt token")
        self.prompt = prompt
        self.sampling = sampling
        self.deliver = deliver
        self.tokens: list[int] = []
        self.generator: torch.Generator | None = None
        self.cancelled = False
        self.finished = False
        self.stream: Iterator[Tensor] | None = None
        """The per-sequence decoder's token stream (models decoded one sequence per slot)."""
        self.error: str | None = None
        """Why the sequence ended with 'error'."""
        self.logprobs: list[TokenLogprob] = []
        """One per token drawn (an end-of-text token too), kept before it is handed over."""
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        """One per prompt token (None for the first, which nothing predicts), once read."""
        self.end_token: int | None = None
        """The token that ended the sequence (end of text, or a stop token), if one did."""
        self.queued = time.perf_counter()
        self.last_token_at: float | None = None
        """When its last token was handed over (for the latency histograms)."""
        self.matcher: Matcher | None = None
        if sampling.constraint is not None:
            self.matcher = sampling.constraint.start(sampling.stop_tokens)

    @property
    def complete(self) -> bool:
        """The constrained text is complete and nothing may follow it."""
        return self.matcher is not None and self.matcher.stopped

    def cancel(self) -> None:
        self.cancelled = True

    def make_generator(self, device: torch.device) -> torch.Generator:
        seed = self.sampling.seed
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator(device=device).manual_seed(seed % SEED_LIMIT)
        return self.generator

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finished = True
            self.deliver(None, reason)

    def fail(self, what: str, exc: BaseException) -> None:
        """End this sequence alone with an error answer."""
        log.error("%s failed for one sequence: %s", what, exc, exc_info=exc)
        self.error = f"{what} failed: {type(exc).__name__}: {exc}"
        self.cancelled = True
        try:
            self.finish("error")
        except Exception:  # its client cannot be told; the others go on
            log.exception("the answer of a failed sequence could not be handed over")


def adjust(logits: Tensor, seqs: list[Sequence], ends: tuple[int, ...] = ()) -> Tensor:
    """(n, V) logits -> the logits each sequence draws from: the repetition penalty over
    its prompt and the tokens it has drawn, OpenAI's frequency and presence penalties over
    the tokens drawn, its logit bias, its constraint's mask (-inf where a token cannot
    continue the constrained text), and under min_tokens its end tokens (`ends`, the
    model's end of text, and its stop tokens) at -inf. A sequence whose adjustment fails is
    failed (and dropped after this step)."""
    if not any(seq.sampling.adjusts for seq in seqs):
        return logits
    logits = logits.float().clone()
    V = logits.shape[-1]
    for row, seq in enumerate(seqs):
        opts = seq.sampling
        if not opts.adjusts or seq.finished:
            continue
        try:
            if opts.extra.repetition_penalty != 1.0:
                seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
                seen[torch.tensor(seq.prompt + seq.tokens, device=logits.device)] = True
                logits[row] = penalize_repetition(logits[row], seen,
                                                  opts.extra.repetition_penalty)
            if seq.tokens and (opts.frequency_penalty or opts.presence_penalty):
                counts = torch.bincount(torch.tensor(seq.tokens, device=logits.device),
                                        minlength=V)[:V].to(logits.dtype)
                logits[row] -= (counts * opts.frequency_penalty
                                + (counts > 0).to(logits.dtype) * opts.presence_penalty)
            for token, bias in opts.logit_bias:
                logits[row, token] += bias
        except Exception as e:
            seq.fail("adjusting the logits", e)
    constrained = [row for row, seq in enumerate(seqs)
                   if seq.matcher is not None and not seq.finished]
    if constrained:
        try:
            matchers = [seqs[row].matcher for row in constrained]
            if len(constrained) == len(seqs):
                mask_logits(logits, matchers)  # in place
            else:
                logits[constrained] = mask_logits(logits[constrained], matchers)
        except Exception:  # find the sequence whose mask fails: each alone
            for row in constrained:
                try:
                    logits[row : row + 1] = mask_logits(logits[row : row + 1],
                                                        [seqs[row].matcher])
                except Exception as e:
                    seqs[row].fail("constraining the logits", e)
    for row, seq in enumerate(seqs):
        if len(seq.tokens) < seq.sampling.extra.min_tokens and not seq.finished:
            logits[row : row + 1] = hold_back(logits[row : row + 1],
                                              ends + seq.sampling.stop_tokens)
    return logits


def advance(seqs: list[Sequence], tokens: list[int | None]) -> None:
    """Move each constrained sequence's matcher past its drawn token."""
    for seq, token in zip(seqs, tokens, strict=True):
        if seq.matcher is None or token is None or seq.finished:
            continue
        try:
            seq.matcher.advance(token)
        except Exception as e:
            seq.fail("following the constraint", e)


def sample(logits: Tensor, seqs: list[Sequence]) -> list[int | None]:
    """(n, V) logits of the last position -> one token per sequence, each with its own
    sampling options and random generator, so a sequence draws what it would draw alone.
    A sequence whose draw fails gets None, and has been failed."""
    if all(s.sampling.temperature == 0 for s in seqs):
        return logits.argmax(dim=-1).tolist()
    out: list[int | None] = []
    for row, seq in enumerate(seqs):
        opts = seq.sampling
        try:
            token = next_token(logits[row : row + 1], temperature=opts.temperature,
                               top_k=opts.top_k, top_p=opts.top_p, min_p=opts.extra.min_p,
                               generator=seq.generator)
            out.append(int(token[0]))
        except Exception as e:
            seq.fail("sampling", e)
            out.append(None)
    return out


def logprobs_of(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """(k, V) logits and the k tokens they were followed by -> each token's log-probability
    under the distribution it was drawn from (the model's, after penalties and logit bias,
    before temperature, top-k or top-p) and the `top` likeliest tokens with theirs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)[:, 0].tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    values, ids = logp.topk(top, dim=-1)
    return [(c, list(zip(i, v, strict=True)))
            for c, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]


def keep_logprobs(logits: Tensor, seqs: list[Sequence], tokens: list[int | None]) -> None:
    """Record the drawn tokens' log-probabilities for the sequences that asked."""
    for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
        top = seq.sampling.logprobs
        if top is None or token is None or seq.finished:
            continue
        try:
            seq.logprobs += logprobs_of(logits[row : row + 1], [token], top)
        except Exception as e:
            seq.fail("computing log-probabilities", e)


