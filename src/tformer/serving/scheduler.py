"""Decoding for many clients at once: requests share decoding steps.

A language model with a KV cache decodes by continuous batching (Yu et al. 2022, "Orca"):
one thread owns the model and runs one decoding step at a time for every sequence in
flight; a new request joins at the next step, a finished or abandoned one leaves at once.
Its cache is a pool of rows (decoding/pool.py's `SlotPool`), one per sequence. A model whose memory is not a
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tformer.decoding.lm import EosIds, generate, stop_ids
from tformer.decoding.pool import SlotPool
from tformer.serving.sequence import Sequence, adjust, keep_logprobs, logprobs_of, sample

if TYPE_CHECKING:
    from tformer.decoding.speculative import SpeculationStats
    from tformer.serving.speculation import Speculator

log = logging.getLogger(__name__)

Generate = Callable[..., Iterator[torch.Tensor]]
"""A family's generate (tformer.registry.Family.generate)."""


# --- engines ----------------------------------------------------------------------------


@dataclass
class EngineStats:
    generated_tokens: int = 0
    steps: int = 0
    """Decoding steps (one token for every sequence in flight)."""
    prefills: int = 0
    """Forward passes that read the prompts of joining sequences."""
    finished_sequences: int = 0
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
    """

    def __init__(self, model: nn.Module, *, eos_id: EosIds, max_batch: int = 16,
                 max_waiting: int = 64, batched: bool, generate: Generate = generate,
                 speculator: Speculator | None = None) -> None:
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
        self.slots = SlotPool(model, max_batch) if batched else None
        self.active: list[Sequence] = []
        """In the pool, sequence i in row i."""
        self.sliding: list[Sequence] = []
        """Past the model's context: each step reads its last `context` tokens afresh, as
        tformer.decoding.lm.generate slides its window (they hold no pool row)."""
        self.pending: deque[Sequence] = deque()
        self.speculator = speculator if batched else None
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

    @property
    def waiting(self) -> int:
        return len(self.pending)

    @property
    def running(self) -> int:
        return len(self.active) + len(self.sliding)

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
                while not self.pending and not self.running and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.pending and not self.running:
                    return
                joining = []
                while self.pending and self.running + len(joining) < self.max_batch:
                    joining.append(self.pending.popleft())
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._join(joining)
                    self._drop_cancelled()
                    if self.running:
                        self._step()
            except Exception as e:
                # A forward pass over the whole batch failed: no sequence can go on alone.
                log.exception("decoding failed; ending the sequences in flight")
                for seq in self.active + self.sliding:
                    seq.fail("decoding", e)
                self.active.clear()
                self.sliding.clear()
                if self.slots is not None:
                    self.slots.clear()
                if self.speculator is not None:
                    self.speculator.clear()
            self.stats.busy_seconds += time.perf_counter() - start

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
        if not joining:
            return
        try:
            logits = self._prefill(joining)
        except Exception as e:
            if len(joining) == 1:
                joining[0].fail("reading the prompt", e)
                return
            # Find the one that fails: each prompt read alone. A failed prefill leaves its
            # rows unoccupied, so nothing needs undoing.
            log.warning("reading %d prompts together failed (%s); reading them one by one",
                        len(joining), e)
            for seq in joining:
                self._join_ready([seq])
            return
        self._join_ready(joining, logits)

    def _join_ready(self, joining: list[Sequence], logits: Tensor | None = None) -> None:
        """Seat sequences whose prompts are read (`logits`), or read them first."""
        if logits is None:
            try:
                logits = self._prefill(joining)
            except Exception as e:
                for seq in joining:
                    seq.fail("reading the prompt", e)
                return
        self.stats.prefills += 1
        if logits.dim() == 3:
            self._score_prompts(joining, logits)
            logits = logits[:, -1]
        self.active.extend(joining)
        tokens = self._draw(logits, joining)
        first = len(self.active) - len(joining)
        done = []
        for i, (seq, token) in enumerate(zip(joining, tokens, strict=True)):
            if seq.sampling.max_tokens == 0 and not seq.finished:
                seq.finish("length")  # the prompt scored, nothing generated
                done.append(first + i)
            elif self._accept(seq, token):
                done.append(first + i)
        for row in reversed(done):
            self._leave(row)

    def _prefill(self, joining: list[Sequence]) -> Tensor:
        """(k, V) last-position logits, or (k, P, V) when a prompt is to be scored."""
        assert self.slots is not None
        score = any(seq.sampling.prompt_logprobs for seq in joining)
        logits = self.slots.prefill([seq.prompt for seq in joining], every_position=score)
        if self.speculator is not None:
            try:
                self.speculator.join([seq.prompt for seq in joining])
            except Exception:
                for _ in joining:  # the rows the target read, unoccupied again
                    self.slots.remove(self.slots.rows - 1)
                raise
        return logits

    def _score_prompts(self, joining: list[Sequence], logits: Tensor) -> None:
        """Each prompt token's log-probability given the ones before it, from the (k, P, V)
        logits of the left-padded prompts (a row's L tokens sit in the last L columns)."""
        P = logits.shape[1]
        for row, seq in enumerate(joining):
            if not seq.sampling.prompt_logprobs or seq.finished:
                continue
            try:
                L = len(seq.prompt)
                scored = logprobs_of(logits[row, P - L : P - 1], seq.prompt[1:],
                                     seq.sampling.logprobs or 0)
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
        if self.speculator is not None:
            runs = self.speculator.round(self.slots, self.active, self._draw)
            if runs is not None:
                return runs
        tokens = self._draw(self.slots.step([seq.tokens[-1] for seq in self.active]),
                            self.active)
        return [[token] for token in tokens]

    def _accept_run(self, seq: Sequence, run: list[int | None]) -> bool:
        """Hand a step's tokens over up to the one that ends the sequence (those after it
        are dropped); True when it has ended."""
        for token in run:
            if self._accept(seq, token):
                return True
        return False

    def _draw(self, logits: Tensor, seqs: list[Sequence]) -> list[int | None]:
        """(n, V) next-token logits -> each sequence's token, its log-probability kept."""
        logits = adjust(logits, seqs)
        tokens = sample(logits, seqs)
        keep_logprobs(logits, seqs, tokens)
        return tokens

    def _start_sliding(self) -> None:
        """Move the sequences whose next step would pass the context out of the pool."""
        for row in reversed(range(len(self.active))):
            seq = self.active[row]
            if len(seq.prompt) + len(seq.tokens) > self.model.cfg.context:
                self._unseat(row)
                self.sliding.append(seq)

    def _step_sliding(self) -> None:
        """One token for each sliding sequence, from one pass over their windows (all
        `context` tokens long, so no padding)."""
        context = self.model.cfg.context
        windows = [(seq.prompt + seq.tokens)[-context:] for seq in self.sliding]
        logits = self.model(torch.tensor(windows, device=self.device), None, last_only=True)
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
            if token in self.eos_ids or token in seq.sampling.stop_tokens:
                seq.end_token = token
                seq.finish("stop")
                return True
            seq.tokens.append(token)
            seq.deliver(token, None)
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

    def _leave(self, row: int) -> None:
        """Remove the sequence at `row`: the last one takes its place (in the pool too)."""
        self.stats.finished_sequences += 1
        self._unseat(row)

    def _unseat(self, row: int) -> None:
        if self.slots is not None:
            self.slots.remove(row)
        if self.speculator is not None:
            self.speculator.remove(row)
        last = self.active.pop()
        if row < len(self.active):
            self.active[row] = last


