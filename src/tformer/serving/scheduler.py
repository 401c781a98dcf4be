"""Decoding for many clients at once: requests share decoding steps.

A language model with a KV cache decodes by continuous batching (Yu et al. 2022, "Orca"):
one thread owns the model and runs one decoding step at a time for every sequence in
flight; a new request joins at the next step, a finished or abandoned one leaves at once.
Its cache is a paged pool (decoding/paged.py): blocks of keys and values from one budget,
each sequence a list of them. A prompt is read a chunk at a time, within a budget of tokens
per step that the running sequences' decoding shares, so a long prompt never holds up the
others' tokens; a sequence that needs a block when none is free is preempted (its blocks
freed) and read again later. A model whose memory is not a
KV cache (Transformer-XL) decodes through its own generation path, one sequence per slot,
the slots taking turns step by step. Translations are grouped for a short window and
decoded as one batch by beam search (serving/translation.py). With a drafter
(serving/speculation.py), a step of the pool is one speculative round, and a sequence may
take several tokens from it.

Shapes: n sequences in flight, W cache columns in use, V vocabulary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tformer.decoding.lm import EosIds, generate, left_pad, stop_ids, window
from tformer.decoding.paged import PagedPool, PoolFull, Row, blocks_for
from tformer.decoding.pool import Seats
from tformer.serving.sequence import (
    Sequence,
    adjust,
    advance,
    keep_logprobs,
    logprobs_of,
    sample,
)

if TYPE_CHECKING:
    from tformer.decoding.speculative import SpeculationStats
    from tformer.serving.speculation import Speculator

log = logging.getLogger(__name__)

Generate = Callable[..., Iterator[torch.Tensor]]
"""A family's generate (tformer.registry.Family.generate)."""


STEP_TOKENS = 512
"""Tokens a step reads at most, decoding's and prompts' together (chunked prefill)."""


@dataclass
class Reading:
    """A sequence whose text the pool reads a chunk at a time: its prompt, or after a
    preemption its prompt and the tokens it had made (recomputed)."""

    seq: Sequence
    text: list[int]
    resumed: bool = False
    row: Row = field(default_factory=Row)
    done: int = 0
    scored: list[Tensor] = field(default_factory=list)
    """Every position's logits so far, where the prompt is to be scored."""

    @property
    def left(self) -> int:
        return len(self.text) - self.done


# --- engines ----------------------------------------------------------------------------


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


class LMEngine:
    """One decoding thread for a language model; `submit` from any thread.

    max_batch: sequences decoded together at most; max_waiting: sequences waiting for a
    row at most (past it `submit` refuses, and the server answers 503).
    context: the longest prompt a sequence may have (a KV-cache model's window; None when
    the model has no fixed window). A sequence that grows past it goes on as
    tformer.decoding.lm.generate does, each token read from the last `context` ones.
    speculator: drafts tokens for the pool's rows (serving/speculation.py), or None.
    kv_blocks: blocks of the paged KV pool (default: room for max_batch full contexts);
    step_tokens: tokens a step reads at most (chunked prefill).
    prefix_cache: texts starting with blocks the pool has read take them (decoding/paged.py).
    """

    def __init__(self, model: nn.Module, *, eos_id: EosIds, max_batch: int = 16,
                 max_waiting: int = 64, batched: bool, generate: Generate = generate,
                 speculator: Speculator | None = None, kv_blocks: int | None = None,
                 step_tokens: int = STEP_TOKENS, prefix_cache: bool = True) -> None:
        self.model = model
        self.generate = generate
        """Decodes one sequence when it cannot share a batch (its family's generate)."""
        self.eos_ids = stop_ids(eos_id)
        """A sequence ends at any of them (Llama 3 has three)."""
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.batched = batched
        self.device = next(model.parameters()).device
        self.context: int | None = model.cfg.context if batched else None
        self.slots: PagedPool | None = None
        if batched:
            assert self.context is not None
            self.slots = PagedPool(model, kv_blocks or max_batch * blocks_for(self.context) + 1,
                                   prefix_cache=prefix_cache)
        self.speculator = speculator if batched else None
        self.seats: Seats[Sequence] = Seats(
            ([self.slots] if self.slots is not None else [])  # type: ignore[list-item]
            + (self.speculator.pools if self.speculator is not None else []))
        """The row order of the pools (the target's, the drafter's) and the sequences."""
        self.active = self.seats.items
        """In the pool, sequence i in row i."""
        self.step_tokens = step_tokens
        self.reading: list[Reading] = []
        """Seated in the pool, their texts partly read."""
        self.preempted: deque[Reading] = deque()
        """Taken out of the pool for want of blocks; seated again before any new sequence."""
        self.sliding: list[Sequence] = []
        """Past the model's context: each step reads its last `context` tokens afresh, as
        tformer.decoding.lm.generate slides its window (they hold no pool row)."""
        self.pending: deque[Sequence] = deque()
        self.stats = EngineStats(speculation=speculator.stats if self.speculator else None)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tformer-decode", daemon=True)

    # The server's side.

    def start(self) -> None:
        self._thread.start()

    def submit(self, seqs: list[Sequence]) -> bool:
        """Queue sequences (the n choices of one request go in together); False if the
        queue has no room for them."""
        with self._cond:
            if self._stopping or len(self.pending) + len(seqs) > self.max_waiting:
                return False
            self.pending.extend(seqs)
            self._cond.notify()
        return True

    def kv_positions(self) -> int | None:
        """The most positions one sequence may hold in the KV pool (None: no pool)."""
        return None if self.slots is None else self.slots.total * self.slots.block_size

    @property
    def waiting(self) -> int:
        return len(self.pending) + len(self.preempted)

    @property
    def running(self) -> int:
        return len(self.active) + len(self.sliding) + len(self.reading)

    def stop(self, timeout: float | None = None) -> None:
        """Finish every queued and running sequence, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # The decoding thread.

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.waiting and not self.running and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.waiting and not self.running:
                    return
                joining = self._admit()
            start = time.perf_counter()
            try:
                self._turn(joining)
            except Exception as e:
                # A forward pass over the whole batch failed: no sequence can go on alone.
                log.exception("decoding failed; ending the sequences in flight")
                for seq in (self.active + self.sliding + [r.seq for r in self.reading]
                            + [r.seq for r in self.preempted]):
                    seq.fail("decoding", e)
                self.seats.clear()
                self.sliding.clear()
                self.reading.clear()
                self.preempted.clear()
            self.stats.busy_seconds += time.perf_counter() - start

    def _admit(self) -> list[Sequence]:
        """Take sequences off the queues while there is room in the batch: the preempted
        (straight back to reading) before the new, which are returned."""
        while self.preempted and self.running < self.max_batch:
            self.reading.append(self.preempted.popleft())
        joining = []
        while self.pending and self.running + len(joining) < self.max_batch:
            joining.append(self.pending.popleft())
        return joining

    def _turn(self, joining: list[Sequence]) -> None:
        """One step of the engine: seat the joining sequences, decode a token (or a
        speculative round) for the running ones, read the waiting texts' next chunks."""
        with torch.inference_mode():
            self._join(joining)
            self._drop_cancelled()
            if self.active or self.sliding:
                self._step()
            if self.reading:
                self._read()

    def _join(self, joining: list[Sequence]) -> None:
        for seq in joining:
            if seq.cancelled:
                seq.finish("cancelled")
                continue
            try:
                seq.make_generator(self.device)
            except Exception as e:
                seq.fail("preparing", e)
        joining = [seq for seq in joining if not seq.finished]
        if self.slots is None:
            for seq in joining:
                opts = seq.sampling
                seq.stream = self.generate(
                    self.model, torch.tensor([seq.prompt], device=self.device),
                    max_new_tokens=opts.max_tokens, temperature=opts.temperature,
                    top_k=opts.top_k, top_p=opts.top_p, generator=seq.generator,
                    eos_id=self.eos_ids,
                )
                self.active.append(seq)
            return
        room = self.kv_positions()
        for seq in joining:
            if room is not None and len(seq.prompt) + 1 > room:
                seq.fail("reading the prompt", ValueError(
                    f"the prompt of {len(seq.prompt)} tokens does not fit in the KV pool "
                    f"({room} positions)"))
            else:
                self.reading.append(Reading(seq, list(seq.prompt)))

    def _read(self) -> None:
        """Read the waiting texts, shortest left first, within the step's budget: a text
        that fits is read to its end and seated (a short prompt never waits behind a long
        one); the rest a chunk at a time, at most a quarter of the budget in all while rows
        decode (so that their steps stay short while a long prompt is read)."""
        assert self.slots is not None
        piece = max(self.step_tokens // 4 - len(self.active), 16) if self.active else \
            self.step_tokens
        budget = max(self.step_tokens - len(self.active), piece)
        plan: list[tuple[Reading, int]] = []
        starting: set[tuple[int, ...]] = set()
        block = self.slots.block_size
        for r in sorted(self.reading, key=lambda r: r.left):
            if budget <= 0:
                break
            if not self._scores(r) and r.done == r.row.length:
                r.done += self.slots.reuse(r.row, r.text)
            if self.slots.prefix_cache and r.done == 0 and len(r.text) > block:
                # A text that starts as another one read now (the n choices of a prompt)
                # waits a step, and then takes that one's blocks.
                start = tuple(r.text[:block])
                if start in starting:
                    continue
                starting.add(start)
            n = r.left if r.left <= budget else min(budget, piece)
            if n <= 0:
                break
            piece -= n if n < r.left else 0
            plan.append((r, n))
            budget -= n
        # Chunks of similar lengths share a forward pass (left-padded to the longest).
        groups: list[list[tuple[Reading, int]]] = []
        for r, n in sorted(plan, key=lambda p: p[1]):
            group = groups[-1] if groups else None
            if group and n * (len(group) + 1) <= 2 * (sum(m for _, m in group) + n) + 64:
                group.append((r, n))
            else:
                groups.append([(r, n)])
        for group in groups:
            if len(group) > 1 and self._read_together(group):
                continue
            for r, n in group:
                if r in self.reading and not self._read_alone(r, n):
                    break

    def _scores(self, r: Reading) -> bool:
        return bool(r.seq.sampling.prompt_logprobs) and not r.resumed

    def _read_alone(self, r: Reading, n: int) -> bool:
        """Read n more tokens of r's text; False where the pool has no room for them."""
        assert self.slots is not None
        try:
            logits = self.slots.read_chunk(r.row, r.text[r.done : r.done + n],
                                           every_position=self._scores(r))
        except PoolFull:
            return self._free_for(r)
        except Exception as e:
            self._drop_reading(r)
            r.seq.fail("reading the prompt", e)
            return True
        self.stats.prefills += 1
        self._chunk_read(r, n, logits)
        return True

    def _read_together(self, group: list[tuple[Reading, int]]) -> bool:
        """Read a chunk of each text in one pass; False where it failed, nothing stored."""
        assert self.slots is not None
        chunks = [r.text[r.done : r.done + n] for r, n in group]
        ids, real = left_pad(chunks, pad_id=0)
        every = any(self._scores(r) for r, _ in group)
        try:
            logits = self.slots.forward([r.row for r, _ in group], ids, real,
                                        last_only=not every)
        except Exception as e:
            if not isinstance(e, PoolFull):
                log.warning("reading %d prompts together failed (%s); reading them one by "
                            "one", len(group), e)
            return False
        self.stats.prefills += 1
        width = ids.shape[1]
        for i, (r, n) in enumerate(group):
            self._chunk_read(r, n, logits[i, width - n :] if every else logits[i])
        return True

    def _chunk_read(self, r: Reading, n: int, logits: Tensor) -> None:
        """Count n tokens of r's text read, whose logits are `logits` ((n or 1, V)); seat
        it where it is read to its end."""
        r.done += n
        if self._scores(r):
            r.scored.append(logits)
        self.stats.prefill_chunks += 1
        if r.left == 0:
            self.reading.remove(r)
            self._seat(r, logits[-1])

    def _free_for(self, r: Reading) -> bool:
        """Blocks for a text that does not fit: those of a partly read text with more left
        to read (read again later); False where r must wait for others to finish. A text
        that cannot fit even alone fails."""
        holders = [o for o in self.reading if o is not r and o.row.blocks]
        later = [o for o in holders if o.left > r.left]
        if later:
            victim = max(later, key=lambda o: o.left)
            self._drop_reading(victim)
            victim.done, victim.scored = 0, []
            self.preempted.appendleft(victim)
            self.stats.preemptions += 1
            return True
        if not self.active and not holders:
            self._drop_reading(r)
            r.seq.fail("reading the prompt", PoolFull(
                f"{len(r.text)} tokens do not fit in the KV pool "
                f"({self.kv_positions()} positions)"))
        return False

    def _drop_reading(self, r: Reading) -> None:
        assert self.slots is not None
        self.slots.release(r.row)
        if r in self.reading:
            self.reading.remove(r)

    def _seat(self, r: Reading, logits: Tensor) -> None:
        """A text read to its end joins the decoding rows with its next token drawn from
        its last position's (V,) logits."""
        assert self.slots is not None
        seq = r.seq
        if r.scored:
            self._score_prompt(seq, torch.cat(r.scored))
        if self.speculator is not None:
            try:
                self.speculator.join([r.text])
            except Exception as e:
                self.slots.release(r.row)
                seq.fail("reading the prompt", e)
                return
        self.slots.seat(r.row)
        self.active.append(seq)
        row = len(self.active) - 1
        if seq.sampling.max_tokens == 0 and not seq.finished:
            seq.finish("length")  # the prompt scored, nothing generated
            self._leave(row)
        elif self._accept(seq, self._draw(logits[None], [seq])[0]):
            self._leave(row)

    def _score_prompt(self, seq: Sequence, logits: Tensor) -> None:
        """Each prompt token's log-probability given the ones before it, from the (P, V)
        logits of every position."""
        try:
            scored = logprobs_of(logits[:-1], seq.prompt[1:], seq.sampling.logprobs or 0)
            seq.prompt_logprobs = [None, *scored]
        except Exception as e:
            seq.fail("scoring the prompt", e)

    def _step(self) -> None:
        runs: list[list[int | None]]  # each active sequence's new tokens, in order
        if self.slots is None:
            runs = []
            for seq in self.active:
                assert seq.stream is not None
                try:
                    runs.append([int(next(seq.stream)[0])])
                except Exception as e:  # a sequence decoded alone fails alone
                    seq.fail("decoding", e)
                    runs.append([None])
        else:
            self._start_sliding()
            runs = self._step_pool() if self.active else []
            if self.sliding:
                self._step_sliding()
        self.stats.steps += 1
        done = [row for row, (seq, run) in enumerate(zip(self.active, runs, strict=True))
                if self._accept_run(seq, run)]
        for row in reversed(done):
            self._leave(row)

    def _step_pool(self) -> list[list[int | None]]:
        """A speculative round where rows draft, else one token for every row."""
        assert self.slots is not None
        self._make_room()
        if not self.active:
            return []
        if self.speculator is not None:
            runs = self.speculator.round(self.slots, self.active, self._draw)
            if runs is not None:
                return runs
        tokens = self._draw(self.slots.step([seq.tokens[-1] for seq in self.active]),
                            self.active)
        return [[token] for token in tokens]

    def _make_room(self) -> None:
        """Free blocks until every row can take a step (a speculative round's drafts
        included): partly read texts first, then the rows seated last, each read again
        later from its prompt and the tokens it made. A row that cannot step even alone
        fails."""
        assert self.slots is not None
        pool = self.slots
        ahead = 1 + (self.speculator.draft_tokens if self.speculator is not None else 0)

        def short() -> int:
            need = sum(max(0, blocks_for(min(row.length + ahead, self.context or 1 << 30),
                                         pool.block_size) - len(row.blocks))
                       for row in pool.active)
            return need - pool.available

        while self.active and short() > 0:
            holding = [r for r in self.reading if r.row.blocks]
            if holding:
                victim = max(holding, key=lambda r: r.left)
                self._drop_reading(victim)
                victim.done, victim.scored = 0, []
                self.preempted.appendleft(victim)
            elif len(self.active) > 1:
                seq = self.active[-1]
                self._unseat(len(self.active) - 1)
                self.preempted.appendleft(Reading(seq, seq.prompt + seq.tokens, resumed=True))
            else:
                seq = self.active[0]
                seq.fail("decoding", PoolFull(
                    f"{len(seq.prompt) + len(seq.tokens)} tokens fill the KV pool "
                    f"({self.kv_positions()} positions)"))
                self._leave(0)
                return
            self.stats.preemptions += 1

    def _accept_run(self, seq: Sequence, run: list[int | None]) -> bool:
        """Hand a step's tokens over up to the one that ends the sequence (those after it
        are dropped); True when it has ended."""
        for token in run:
            if self._accept(seq, token):
                return True
        return False

    def _draw(self, logits: Tensor, seqs: list[Sequence]) -> list[int | None]:
        """(n, V) next-token logits -> each sequence's token, its log-probability kept."""
        logits = adjust(logits, seqs, self.eos_ids)
        tokens = sample(logits, seqs)
        keep_logprobs(logits, seqs, tokens)
        advance(seqs, tokens)
        return tokens

    def _start_sliding(self) -> None:
        """Move the sequences whose next step would pass the context out of the pool."""
        for row in reversed(range(len(self.active))):
            seq = self.active[row]
            if len(seq.prompt) + len(seq.tokens) > self.model.cfg.context:
                self._unseat(row)
                self.sliding.append(seq)

    def _step_sliding(self) -> None:
        """One token for each sliding sequence, from one pass over their windows
        (tformer.decoding.lm.window: all `context` tokens long here, so no padding)."""
        ids, real = window([seq.prompt + seq.tokens for seq in self.sliding],
                           self.model.cfg.context)
        logits = self.model(ids.to(self.device), None if real is None else real.to(self.device),
                            last_only=True)
        tokens = self._draw(logits[:, -1], self.sliding)
        ended = {id(seq) for seq, token in zip(self.sliding, tokens, strict=True)
                 if self._accept(seq, token)}
        self.stats.finished_sequences += len(ended)
        self.sliding = [seq for seq in self.sliding if id(seq) not in ended]

    def _accept(self, seq: Sequence, token: int | None) -> bool:
        """Hand a new token over; True when the sequence has ended (None: it failed)."""
        if token is None or seq.finished:  # failed already
            return True
        self.stats.generated_tokens += 1
        try:
            ends = (() if seq.sampling.extra.ignore_eos
                    else (*self.eos_ids, *seq.sampling.stop_tokens))
            if token in ends:
                seq.end_token = token
                seq.finish("stop")
                return True
            seq.tokens.append(token)
            now = time.perf_counter()
            if seq.last_token_at is None:
                self.stats.first_token.observe(now - seq.queued)
            else:
                self.stats.between_tokens.observe(now - seq.last_token_at)
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

    def _drop_cancelled(self) -> None:
        for row in reversed(range(len(self.active))):
            if self.active[row].cancelled:
                self.active[row].finish("cancelled")
                self._leave(row)
        for seq in self.sliding:
            if seq.cancelled:
                seq.finish("cancelled")
                self.stats.finished_sequences += 1
        self.sliding = [seq for seq in self.sliding if not seq.cancelled]
        for r in [r for r in self.reading if r.seq.cancelled]:
            self._drop_reading(r)
            r.seq.finish("cancelled")
        for r in [r for r in self.preempted if r.seq.cancelled]:
            self.preempted.remove(r)
            r.seq.finish("cancelled")

    def _leave(self, row: int) -> None:
        """Remove the sequence at `row`: the last one takes its place (in the pool too)."""
        self.stats.finished_sequences += 1
        self._unseat(row)

    def _unseat(self, row: int) -> None:
        self.seats.remove(row)


