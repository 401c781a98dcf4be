"""What a step's output does to the sequences (the "apply" of plan -> run -> apply): draw
each row's token from its logits, hand tokens over up to the one that ends a sequence (end
of text, a stop token, a complete constrained text, max_tokens), and count it all in the
engine's metrics. The engines (serving/scheduler.py, serving/stream.py) call these after
each forward pass or speculative round.

Shapes: n sequences, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from tformer.serving.sequence import Sequence, adjust, advance, keep_logprobs, sample

if TYPE_CHECKING:
    from tformer.decoding.speculative import SpeculationStats


class Histogram:
    """Seconds in cumulative buckets, as a Prometheus histogram counts them."""

    BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def __init__(self) -> None:
        self.counts = [0] * len(self.BUCKETS)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        for i, bound in enumerate(self.BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1


@dataclass
class EngineStats:
    generated_tokens: int = 0
    steps: int = 0
    """Decoding steps (one token for every sequence in flight)."""
    prefills: int = 0
    """Forward passes that read the prompts of joining sequences."""
    finished_sequences: int = 0
    prefill_chunks: int = 0
    """Chunks of prompts read (several in one pass where they are read together)."""
    preemptions: int = 0
    """Sequences whose blocks were taken back for others, to be read again."""
    first_token: Histogram = field(default_factory=Histogram)
    """Seconds from a sequence's queueing to its first token."""
    between_tokens: Histogram = field(default_factory=Histogram)
    """Seconds between a sequence's tokens."""
    busy_seconds: float = 0.0
    """Time spent reading prompts and decoding (the rest the thread waits for work)."""
    speculation: SpeculationStats | None = None
    """What the drafts bought, where the engine speculates."""


def draw(logits: Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> list[int | None]:
    """(n, V) next-token logits -> each sequence's token (None where its draw failed), its
    log-probability kept and its constraint moved on."""
    logits = adjust(logits, seqs, eos_ids)
    tokens = sample(logits, seqs)
    keep_logprobs(logits, seqs, tokens)
    advance(seqs, tokens)
    return tokens


def accept(seq: Sequence, token: int | None, stats: EngineStats,
           eos_ids: tuple[int, ...]) -> bool:
    """Hand a new token over; True when the sequence has ended (None: it failed)."""
    if token is None or seq.finished:  # failed already
        return True
    stats.generated_tokens += 1
    try:
        ends = () if seq.sampling.extra.ignore_eos else (*eos_ids, *seq.sampling.stop_tokens)
        if token in ends:
            seq.end_token = token
            seq.finish("stop")
            return True
        seq.tokens.append(token)
        now = time.perf_counter()
        if seq.last_token_at is None:
            stats.first_token.observe(now - seq.queued)
        else:
            stats.between_tokens.observe(now - seq.last_token_at)
        seq.last_token_at = now
        seq.deliver(token, None)
        if seq.complete:  # the constrained text ends the choice
            seq.finish("stop")
            return True
        if len(seq.tokens) >= seq.sampling.max_tokens:
            seq.finish("length")
            return True
    except Exception as e:
        seq.fail("handing over the token", e)
        return True
    return False


def accept_run(seq: Sequence, run: list[int | None], stats: EngineStats,
               eos_ids: tuple[int, ...]) -> bool:
    """Hand a step's tokens over up to the one that ends the sequence (those after it are
    dropped: a speculative round's); True when it has ended."""
    return any(accept(seq, token, stats, eos_ids) for token in run)
