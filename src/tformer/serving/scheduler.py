"""Decoding for many clients at once: requests share decoding steps.

A language model with a KV cache decodes by continuous batching (Yu et al. 2022, "Orca"):
one thread owns the model and runs one step at a time for every sequence in flight; a new
request joins at the next step, a finished or abandoned one leaves at once. Its cache is a
paged pool (decoding/paged.py): blocks of keys and values from one budget, each sequence a
list of them.

Each step is planned before it runs, as vLLM's engine does it: `serving/plan.py` decides,
from a few numbers per request, who joins, who decodes, which chunk of which prompt is read
within the step's token budget (a long prompt never holds up the others' tokens, a short
one is answered at once) and who gives its blocks back to be read again later
(preemption); this module runs the plan (a forward pass, or a speculative round with a
drafter, serving/speculation.py) and `serving/apply.py` hands the tokens over. A model whose
memory is not a KV cache (Transformer-XL) decodes through its own engine
(serving/stream.py). Translations are grouped for a short window and decoded as one batch by
beam search (serving/translation.py).

Shapes: n sequences in flight, V vocabulary.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tformer.decoding.lm import EosIds, generate, left_pad, window
from tformer.decoding.paged import PagedPool, PoolFull, Row, blocks_for
from tformer.decoding.pool import Seats
from tformer.serving.apply import EngineStats, Histogram, accept_run
from tformer.serving.engine import Generate, LMEngine
from tformer.serving.plan import Phase, PoolView, StepPlan, Want, plan_step
from tformer.serving.sequence import Sequence, logprobs_of
from tformer.serving.stream import StreamEngine

if TYPE_CHECKING:
    from tformer.serving.speculation import Speculator

__all__ = ["STEP_TOKENS", "EngineStats", "Histogram", "LMEngine", "PagedEngine", "Request",
           "StreamEngine"]

log = logging.getLogger(__name__)

STEP_TOKENS = 512
"""Tokens a step reads at most, decoding's and prompts' together (chunked prefill)."""


@dataclass(eq=False)
class Request:
    """One sequence's state in the engine: the text its KV rows must hold before it decodes
    (its prompt; after a preemption its prompt and the tokens it had made), the pool row
    that holds them, and where it stands (serving/plan.py's phases)."""

    seq: Sequence
    text: list[int]
    order: int
    """Arrival (ties of priority go to the earlier)."""
    resumed: bool = False
    phase: Phase = Phase.WAITING
    row: Row = field(default_factory=Row)
    scored: list[Tensor] = field(default_factory=list)
    """Every position's logits so far, where the prompt is to be scored."""

    @property
    def computed(self) -> int:
        """Positions of its text whose keys and values the pool holds."""
        return self.row.length

    @property
    def wanted(self) -> int:
        """Positions it must hold before it decodes."""
        return len(self.text)

    @property
    def left(self) -> int:
        return self.wanted - self.computed

    @property
    def scores(self) -> bool:
        """Whether its prompt's log-probabilities are wanted (read once, never resumed)."""
        return bool(self.seq.sampling.prompt_logprobs) and not self.resumed


class PagedEngine(LMEngine):
    """Continuous batching over a paged KV pool, each step planned (serving/plan.py).

    context: the longest prompt a sequence may have (the model's window). A sequence that
    grows past it goes on as tformer.decoding.lm.generate does, each token read from the
    last `context` ones.
    speculator: drafts tokens for the pool's rows (serving/speculation.py), or None.
    kv_blocks: blocks of the paged KV pool (default: room for max_batch full contexts);
    step_tokens: tokens a step reads at most (chunked prefill).
    prefix_cache: texts starting with blocks the pool has read take them (decoding/paged.py).
    """

    batched = True

    def __init__(self, model: nn.Module, *, eos_id: EosIds, max_batch: int = 16,
                 max_waiting: int = 64, batched: bool = True, generate: Generate = generate,
                 speculator: Speculator | None = None, kv_blocks: int | None = None,
                 step_tokens: int = STEP_TOKENS, prefix_cache: bool = True) -> None:
        super().__init__(model, eos_id=eos_id, max_batch=max_batch, max_waiting=max_waiting,
                         batched=True)
        self.context = model.cfg.context
        self.slots = PagedPool(model, kv_blocks or max_batch * blocks_for(self.context) + 1,
                               prefix_cache=prefix_cache)
        self.speculator = speculator
        self.slots.reach = self.ahead  # a round's verification: one pass to roll back into
        self.stats.speculation = speculator.stats if speculator is not None else None
        self.seats: Seats[Request] = Seats(
            [self.slots, *(speculator.pools if speculator is not None else [])])  # type: ignore[list-item]
        """The row order of the pools (the target's, the drafter's) and the requests."""
        self.active = self.seats.items
        """Decoding in the pool, request i in row i."""
        self.step_tokens = step_tokens
        self.queue: list[Request] = []
        """Taken off `pending`, or preempted: waiting for a row (the plan admits them)."""
        self.reading: list[Request] = []
        """Holding a row, their texts partly read."""
        self.sliding: list[Sequence] = []
        """Past the model's context: each step reads its last `context` tokens afresh, as
        tformer.decoding.lm.generate slides its window (they hold no pool row)."""
        self._arrivals = itertools.count()

    def kv_positions(self) -> int:
        return self.slots.total * self.slots.block_size

    @property
    def waiting(self) -> int:
        return len(self.pending) + len(self.queue)

    @property
    def running(self) -> int:
        return len(self.active) + len(self.sliding) + len(self.reading)

    def in_flight(self) -> list[Sequence]:
        resumed = [r for r in self.queue if r.resumed]
        return [r.seq for r in (*self.active, *self.reading, *resumed)] + self.sliding

    def clear(self) -> None:
        self.seats.clear()
        for r in self.reading:
            self.slots.release(r.row)
        self.sliding.clear()
        self.reading.clear()
        self.queue = [r for r in self.queue if not r.resumed]  # the new ones wait on

    # One step: plan, run, apply.

    def step(self) -> None:
        for seq in self._take_pending():
            self.queue.append(Request(seq, list(seq.prompt), next(self._arrivals)))
        with torch.inference_mode():
            self._drop_cancelled()
            self._start_sliding()
            requests = {r.order: r for r in self._requests()}
            # Sequences past the context hold no pool row, but a place in the batch.
            plan = plan_step(self.wants(), self.pool_view(), self.step_tokens,
                             max_batch=self.max_batch - len(self.sliding), ahead=self.ahead)
            self._apply_plan(plan, requests)
            if self.active or self.sliding:
                self._decode()
            if plan.chunks:
                self._read([(requests[key], n) for key, n in plan.chunks])

    @property
    def ahead(self) -> int:
        """Positions a row adds in a step: 1, or a speculative round's drafts too."""
        return 1 + (self.speculator.draft_tokens if self.speculator is not None else 0)

    def wants(self) -> list[Want]:
        """Every request as the plan sees it, its arrival its key."""
        block = self.slots.block_size
        wants = []
        for r in self._requests():
            start = None
            if (r.phase is not Phase.DECODING and self.slots.prefix_cache and not r.scores
                    and r.computed == 0 and len(r.text) > block):
                start = hash(tuple(r.text[:block]))
            wants.append(Want(r.order, r.phase, r.computed, r.wanted, len(r.row.blocks),
                              r.seq.sampling.priority, r.order, r.resumed, start))
        return wants

    def _requests(self) -> list[Request]:
        return [*self.active, *self.reading, *self.queue]

    def pool_view(self) -> PoolView:
        return PoolView(self.slots.available, self.slots.block_size, self.context)

    def _apply_plan(self, plan: StepPlan, requests: dict[int, Request]) -> None:
        """Carry out the plan's failures, preemptions and admissions (the decoding and the
        chunks run after)."""
        for key, why in plan.fail:
            r = requests[key]
            self._drop(r)
            r.seq.fail("decoding" if r.phase is Phase.DECODING else "reading the prompt",
                       PoolFull(f"{why} ({self.kv_positions()} positions)"))
            self.stats.finished_sequences += 1
        for key, _ in plan.preempt:
            self._preempt(requests[key])
        for key in plan.admit:
            self._admit(requests[key])

    def _drop(self, r: Request) -> None:
        """Take a request out of wherever it is, its blocks given back."""
        if r.phase is Phase.DECODING:
            self.seats.remove(self.active.index(r))
        elif r.phase is Phase.READING:
            self.slots.release(r.row)
            self.reading.remove(r)
        else:
            self.queue.remove(r)

    def _preempt(self, r: Request) -> None:
        """Give a request's blocks back; it waits to be read again from its prompt and the
        tokens it has made (the same text as it would have made: a sequence's draws depend
        on its own generator and text alone)."""
        self._drop(r)
        if r.phase is Phase.DECODING:
            r.text, r.resumed = r.seq.prompt + r.seq.tokens, True
        r.phase, r.scored = Phase.WAITING, []
        self.queue.append(r)
        self.stats.preemptions += 1

    def _admit(self, r: Request) -> None:
        self.queue.remove(r)
        if not r.resumed and not self._prepare(r.seq):
            return
        room = self.kv_positions()
        if len(r.text) + 1 > room:
            r.seq.fail("reading the prompt", ValueError(
                f"the prompt of {len(r.text)} tokens does not fit in the KV pool "
                f"({room} positions)"))
            return
        r.phase = Phase.READING
        self.reading.append(r)

    # Reading texts.

    def _read(self, chunks: list[tuple[Request, int]]) -> None:
        """Read the planned chunks: chunks of similar lengths share a forward pass
        (left-padded to the longest)."""
        planned = []
        for r, n in chunks:
            if r.phase is not Phase.READING:
                continue
            if not r.scores:  # blocks the pool has read already are taken, not read
                self.slots.reuse(r.row, r.text)
            planned.append((r, min(n, r.left)))
        groups: list[list[tuple[Request, int]]] = []
        for r, n in sorted(planned, key=lambda p: p[1]):
            group = groups[-1] if groups else None
            if group and n * (len(group) + 1) <= 2 * (sum(m for _, m in group) + n) + 64:
                group.append((r, n))
            else:
                groups.append([(r, n)])
        for group in groups:
            if len(group) > 1 and self._read_together(group):
                continue
            for r, n in group:
                if r.phase is Phase.READING:
                    self._read_alone(r, n)

    def _read_alone(self, r: Request, n: int) -> None:
        """Read n more tokens of r's text (none where the pool has no room: it waits)."""
        try:
            ids = torch.tensor([r.text[r.computed : r.computed + n]], device=self.device)
            logits = self.slots.forward([r.row], ids, last_only=not r.scores)[0]
        except PoolFull:
            return
        except Exception as e:
            self._drop(r)
            r.seq.fail("reading the prompt", e)
            return
        self.stats.prefills += 1
        self._chunk_read(r, n, logits)

    def _read_together(self, group: list[tuple[Request, int]]) -> bool:
        """Read a chunk of each text in one pass; False where it failed, nothing stored."""
        chunks = [r.text[r.computed : r.computed + n] for r, n in group]
        ids, real = left_pad(chunks, pad_id=0)
        every = any(r.scores for r, _ in group)
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

    def _chunk_read(self, r: Request, n: int, logits: Tensor) -> None:
        """n tokens of r's text were read, whose logits are `logits` ((n or 1, V)); seat
        it where it is read to its end."""
        if r.scores:
            r.scored.append(logits)
        self.stats.prefill_chunks += 1
        if r.left == 0:
            self.reading.remove(r)
            self._seat(r, logits[-1])

    def _seat(self, r: Request, logits: Tensor) -> None:
        """A text read to its end joins the decoding rows with its next token drawn from
        its last position's (V,) logits."""
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
        r.phase = Phase.DECODING
        self.active.append(r)
        if seq.sampling.max_tokens == 0 and not seq.finished:
            seq.finish("length")  # the prompt scored, nothing generated
            self._leave(r)
        elif self._accept(seq, self._draw(logits[None], [seq])[0]):
            self._leave(r)

    def _score_prompt(self, seq: Sequence, logits: Tensor) -> None:
        """Each prompt token's log-probability given the ones before it, from the (P, V)
        logits of every position."""
        try:
            scored = logprobs_of(logits[:-1], seq.prompt[1:], seq.sampling.logprobs or 0)
            seq.prompt_logprobs = [None, *scored]
        except Exception as e:
            seq.fail("scoring the prompt", e)

    # Decoding.

    def _decode(self) -> None:
        """A token (or a speculative round) for every row, one for each sliding sequence."""
        runs = self._step_pool() if self.active else []
        if self.sliding:
            self._step_sliding()
        self.stats.steps += 1
        done = [r for r, run in zip(self.active, runs, strict=True)
                if accept_run(r.seq, run, self.stats, self.eos_ids)]
        for r in done:
            self._leave(r)

    def _step_pool(self) -> list[list[int | None]]:
        """A speculative round where rows draft, else one token for every row."""
        seqs = [r.seq for r in self.active]
        if self.speculator is not None:
            runs = self.speculator.round(self.slots, seqs, self._draw)
            if runs is not None:
                return runs
        try:
            logits = self.slots.step([seq.tokens[-1] for seq in seqs])
        except PoolFull:
            # The plan gave every row its block, but a shared block's copy (rollback) may
            # have taken one since: the rows wait for the next plan.
            return [[] for _ in seqs]
        return [[token] for token in self._draw(logits, seqs)]

    def _start_sliding(self) -> None:
        """Move the sequences whose next step would pass the context out of the pool."""
        for r in [r for r in self.active if len(r.seq.prompt) + len(r.seq.tokens)
                  > self.context]:
            self.seats.remove(self.active.index(r))
            self.sliding.append(r.seq)

    def _step_sliding(self) -> None:
        """One token for each sliding sequence, from one pass over their windows
        (tformer.decoding.lm.window: all `context` tokens long here, so no padding)."""
        ids, real = window([seq.prompt + seq.tokens for seq in self.sliding], self.context)
        logits = self.model(ids.to(self.device), None if real is None else real.to(self.device),
                            last_only=True)
        tokens = self._draw(logits[:, -1], self.sliding)
        ended = {id(seq) for seq, token in zip(self.sliding, tokens, strict=True)
                 if self._accept(seq, token)}
        self.stats.finished_sequences += len(ended)
        self.sliding = [seq for seq in self.sliding if id(seq) not in ended]

    def _drop_cancelled(self) -> None:
        for r in [r for r in self._requests() if r.seq.cancelled]:
            self._drop(r)
            self._finish(r.seq, "cancelled")
        for seq in self.sliding:
            if seq.cancelled:
                self._finish(seq, "cancelled")
        self.sliding = [seq for seq in self.sliding if not seq.cancelled]

    def _leave(self, r: Request) -> None:
        """A decoding request has ended: its row goes (the last one takes its place)."""
        self.stats.finished_sequences += 1
        self.seats.remove(self.active.index(r))
