"""Decoding for many clients at once: requests share decoding steps.

A language model with a KV cache decodes by continuous batching (Yu et al. 2022, "Orca"):
one thread owns the model and runs one decoding step at a time for every sequence in
flight; a new request joins at the next step, a finished or abandoned one leaves at once.
Its cache is a pool of rows (`SlotPool`), one per sequence. A model whose memory is not a
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

from tformer.decoding.lm import EosIds, generate, left_pad, stop_ids
from tformer.layers import DecoderCache
from tformer.serving.sequence import Sequence, adjust, keep_logprobs, logprobs_of, sample

if TYPE_CHECKING:
    from tformer.decoding.speculative import SpeculationStats
    from tformer.serving.speculation import Speculator

log = logging.getLogger(__name__)

Generate = Callable[..., Iterator[torch.Tensor]]
"""A family's generate (tformer.registry.Family.generate)."""


# --- the cache as a pool of rows --------------------------------------------------------


class SlotPool:
    """A KV cache of `capacity` rows, the first n of them occupied by the sequences in
    flight, in that order.

    All rows share one column clock W: a step writes every row's new keys at column W.
    Rows differ in which columns hold their tokens; `is_real` marks them, and the model
    masks the rest and numbers positions by counting real tokens, so a row decodes as it
    would alone. A joining sequence writes its prompt at columns 0..P-1 of a free row (and
    moves the clock to P if it was behind); a leaving one is replaced by the last row. When
    the clock reaches the end of the buffer, or runs far ahead of the longest row, every
    row's real columns are gathered to the right of a narrower window.

    Invariant: columns >= W hold no real token in any row.
    """

    def __init__(self, model: nn.Module, capacity: int) -> None:
        self.model = model
        self.context = model.cfg.context
        self.capacity = capacity
        self.rows = 0
        self.width = 0
        # The buffers grow (rows and columns, doubling) as the load asks, up to `capacity`
        # rows of `context` columns: GPT-2 small at 64 x 1024 would hold 4.8 GB from the
        # start.
        self.pool, self.is_real = self._allocate(min(capacity, 4), min(self.context, 64))

    def _allocate(self, rows: int, columns: int) -> tuple[DecoderCache, Tensor]:
        pool = self.model.make_cache(rows, columns, padded=True)
        pool.reserve(columns)
        # Unused columns are read (then masked): they must hold finite numbers, since a
        # masked NaN still spreads through 0 * NaN.
        for layer in pool.self_attn:
            layer.k.zero_()
            layer.v.zero_()
        assert pool.is_real is not None
        pool.is_real.zero_()
        return pool, pool.is_real

    def _reserve(self, rows: int, columns: int) -> None:
        """Grow the buffers to hold at least `rows` rows of `columns` columns."""
        have_rows, have_columns = self.is_real.shape
        if rows <= have_rows and columns <= have_columns:
            return
        if rows > have_rows:
            rows = min(self.capacity, max(rows, 2 * have_rows))
        if columns > have_columns:
            columns = min(self.context, max(columns, 2 * have_columns))
        new_rows, new_columns = max(rows, have_rows), max(columns, have_columns)
        pool, is_real = self._allocate(new_rows, new_columns)
        n, W = self.rows, self.width
        for old, new in zip(self.pool.self_attn, pool.self_attn, strict=True):
            new.k[:n, :, :W] = old.k[:n, :, :W]
            new.v[:n, :, :W] = old.v[:n, :, :W]
        is_real[:n, :W] = self.is_real[:n, :W]
        self.pool, self.is_real = pool, is_real

    def prefill(self, prompts: list[list[int]], *, every_position: bool = False) -> Tensor:
        """Read prompts into the next free rows, in one forward pass; return their (k, V)
        last-position logits, or with `every_position` all (k, P, V).

        The prompts are left-padded to a common length P, so each row's last token sits in
        column P - 1, where the model's last-position logits are read.
        """
        first, k = self.rows, len(prompts)
        assert first + k <= self.capacity, "not enough free rows"
        device = self.is_real.device
        ids, real = left_pad(prompts, pad_id=0)
        P = ids.shape[1]
        self._reserve(first + k, max(P, self.width))
        rows = slice(first, first + k)
        self.is_real[rows] = False
        padded = not bool(real.all())
        cache = self.pool.narrow(rows, 0)
        if not padded:
            cache.is_real = None  # one prompt, or equal lengths: the plain causal pass
        logits = self.model(ids.to(device), real.to(device) if padded else None, cache=cache,
                            last_only=not every_position)
        self.is_real[rows, :P] = real.to(device)
        self.rows += k
        self.width = max(self.width, P)
        return logits if every_position else logits[:, -1]

    def step(self, last_tokens: list[int]) -> Tensor:
        """One new token per occupied row -> (n, V) logits for the next ones."""
        tokens = torch.tensor(last_tokens, device=self.is_real.device)[:, None]
        real = torch.ones_like(tokens, dtype=torch.bool)
        return self.extend(tokens, real, last_only=True)[:, -1]

    def extend(self, tokens: Tensor, real: Tensor, *, last_only: bool = False) -> Tensor:
        """(n, T) new tokens per occupied row, False in `real` where a row has none ->
        (n, T, V) logits, or (n, 1, V) with `last_only`. The caller makes sure that every
        row's real tokens, the new ones included, fit in the context."""
        n, T = tokens.shape
        longest = int(self.is_real[:n].sum(1).max())
        if self.width + T > self.context or self.width > 2 * longest + 16:
            self.compact(longest)
        self._reserve(n, self.width + T)
        cache = self.pool.narrow(slice(0, n), self.width)
        logits = self.model(tokens, real, cache=cache, last_only=last_only)
        self.width += T
        return logits

    def truncate(self, kept: Tensor, written: int) -> None:
        """Row i keeps the first kept[i] of the `written` columns the last `extend` wrote:
        speculation's rollback of the drafts a row rejected."""
        n, W = self.rows, self.width
        columns = torch.arange(written, device=kept.device)
        self.is_real[:n, W - written : W] &= columns[None] < kept[:, None]

    def clear(self) -> None:
        """Free every row."""
        self.rows = self.width = 0
        self.is_real.zero_()

    def compact(self, longest: int) -> None:
        """Gather each row's real columns, in order, into the last `longest` columns of a
        window of that width."""
        n, W = self.rows, self.width
        # A stable sort of "is real" puts each row's padding first and its tokens after it,
        # in their order; the last `longest` entries hold every real column.
        order = torch.argsort(self.is_real[:n, :W].to(torch.int8), dim=1, stable=True)
        index = order[:, W - longest :]
        real = self.is_real[:n].gather(1, index)
        for layer in self.pool.self_attn:
            for buf in (layer.k, layer.v):
                H, d = buf.shape[1], buf.shape[3]
                moved = buf[:n].gather(2, index[:, None, :, None].expand(n, H, longest, d))
                buf[:n, :, :longest] = moved
        self.is_real[:n] = False
        self.is_real[:n, :longest] = real
        self.width = longest

    def remove(self, row: int) -> None:
        """Free a row; the last occupied row moves into it (the caller moves its sequence
        the same way)."""
        last = self.rows - 1
        if row != last:
            W = self.width
            for layer in self.pool.self_attn:
                layer.k[row, :, :W] = layer.k[last, :, :W]
                layer.v[row, :, :W] = layer.v[last, :, :W]
            self.is_real[row] = self.is_real[last]
        self.is_real[last] = False
        self.rows = last
        if self.rows == 0:
            self.width = 0


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


