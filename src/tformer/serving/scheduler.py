"""Decoding for many clients at once: requests share decoding steps.

A language model with a KV cache decodes by continuous batching (Yu et al. 2022, "Orca"):
one thread owns the model and runs one decoding step at a time for every sequence in
flight; a new request joins at the next step, a finished or abandoned one leaves at once.
Its cache is a pool of rows (`SlotPool`), one per sequence. A model whose memory is not a
KV cache (Transformer-XL) decodes through its own generation path, one sequence per slot,
the slots taking turns step by step. Translations are grouped for a short window and
decoded as one batch by beam search (`TranslationBatcher`).

Shapes: n sequences in flight, W cache columns in use, V vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tformer.decoding.lm import generate, left_pad
from tformer.decoding.sampling import next_token
from tformer.decoding.translate import SearchOptions, Translation, translate
from tformer.layers import DecoderCache

log = logging.getLogger(__name__)

Generate = Callable[..., Iterator[torch.Tensor]]
"""A family's generate (tformer.registry.Family.generate)."""

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

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before drawing (penalties, bias)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)


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


def adjust(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """(n, V) logits -> the logits each sequence draws from: OpenAI's frequency and
    presence penalties over the tokens it has drawn so far, and its logit bias. A sequence
    whose adjustment fails is failed (and dropped after this step)."""
    if not any(seq.sampling.adjusts for seq in seqs):
        return logits
    logits = logits.float().clone()
    V = logits.shape[-1]
    for row, seq in enumerate(seqs):
        opts = seq.sampling
        if not opts.adjusts or seq.finished:
            continue
        try:
            if seq.tokens and (opts.frequency_penalty or opts.presence_penalty):
                counts = torch.bincount(torch.tensor(seq.tokens, device=logits.device),
                                        minlength=V)[:V].to(logits.dtype)
                logits[row] -= (counts * opts.frequency_penalty
                                + (counts > 0).to(logits.dtype) * opts.presence_penalty)
            for token, bias in opts.logit_bias:
                logits[row, token] += bias
        except Exception as e:
            seq.fail("adjusting the logits", e)
    return logits


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
                               top_k=opts.top_k, top_p=opts.top_p, generator=seq.generator)
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
        n = self.rows
        longest = int(self.is_real[:n].sum(1).max())
        if self.width + 1 > self.context or self.width > 2 * longest + 16:
            self.compact(longest)
        self._reserve(n, self.width + 1)
        device = self.is_real.device
        tokens = torch.tensor(last_tokens, device=device)[:, None]
        real = torch.ones(n, 1, dtype=torch.bool, device=device)
        cache = self.pool.narrow(slice(0, n), self.width)
        logits = self.model(tokens, real, cache=cache, last_only=True)
        self.width += 1
        return logits[:, -1]

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


class LMEngine:
    """One decoding thread for a language model; `submit` from any thread.

    max_batch: sequences decoded together at most; max_waiting: sequences waiting for a
    row at most (past it `submit` refuses, and the server answers 503).
    context: the longest prompt a sequence may have (a KV-cache model's window; None when
    the model has no fixed window). A sequence that grows past it goes on as
    tformer.decoding.lm.generate does, each token read from the last `context` ones.
    """

    def __init__(self, model: nn.Module, *, eos_id: int | None, max_batch: int = 16,
                 max_waiting: int = 64, batched: bool, generate: Generate = generate) -> None:
        self.model = model
        self.generate = generate
        """Decodes one sequence when it cannot share a batch (its family's generate)."""
        self.eos_id = eos_id
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
        self.stats = EngineStats()
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
                    self.slots.rows = self.slots.width = 0
                    self.slots.is_real.zero_()
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
                    eos_id=self.eos_id,
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
        return self.slots.prefill([seq.prompt for seq in joining], every_position=score)

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
        tokens: list[int | None]
        if self.slots is None:
            tokens = []
            for seq in self.active:
                assert seq.stream is not None
                try:
                    tokens.append(int(next(seq.stream)[0]))
                except Exception as e:  # a sequence decoded alone fails alone
                    seq.fail("decoding", e)
                    tokens.append(None)
        else:
            self._start_sliding()
            tokens = self._draw(self.slots.step([seq.tokens[-1] for seq in self.active]),
                                self.active) if self.active else []
            if self.sliding:
                self._step_sliding()
        self.stats.steps += 1
        done = [row for row, (seq, token) in enumerate(zip(self.active, tokens, strict=True))
                if self._accept(seq, token)]
        for row in reversed(done):
            self._leave(row)

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
            if token == self.eos_id or token in seq.sampling.stop_tokens:
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
        last = self.active.pop()
        if row < len(self.active):
            self.active[row] = last


# --- translation ------------------------------------------------------------------------


@dataclass
class TranslationJob:
    lines: list[str]
    options: SearchOptions
    done: Callable[[list[list[Translation] | None]], None]
    """Called from the batching thread with the results in order; a line whose translation
    failed has None (and its error in `errors`)."""
    errors: dict[int, str] = field(default_factory=dict)
    """Line index -> what failed."""
    cancelled: bool = False


class TranslationBatcher:
    """Groups the translation requests that arrive within `window` seconds of each other
    (and share search options) into one call of tformer.decoding.translate."""

    def __init__(self, model: nn.Module, tokenizer: Any, *, window: float = 0.01,
                 batch_size: int = 32, max_waiting: int = 64) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.window = window
        self.batch_size = batch_size
        self.max_waiting = max_waiting
        self.context: int | None = None
        self.pending: deque[TranslationJob] = deque()
        self.stats = EngineStats()
        self._busy = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tformer-translate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: TranslationJob) -> bool:
        with self._cond:
            if self._stopping or len(self.pending) >= self.max_waiting:
                return False
            self.pending.append(job)
            self._cond.notify()
        return True

    @property
    def waiting(self) -> int:
        return len(self.pending)

    @property
    def running(self) -> int:
        return self._busy

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.pending and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.pending:
                    return
            # Let the requests that arrive together gather before decoding them as one.
            time.sleep(self.window)
            with self._cond:
                first = self.pending[0].options
                group = [job for job in self.pending if job.options == first]
                for job in group:
                    self.pending.remove(job)
                self._busy = len(group)
            live = [job for job in group if not job.cancelled]
            try:
                self._translate(live)
            except Exception as e:  # the thread must outlive any one group
                log.exception("translation failed")
                for job in live:
                    job.errors.update({i: f"translation failed: {e}"
                                       for i in range(len(job.lines))})
                    with contextlib.suppress(Exception):
                        job.done([None] * len(job.lines))
            self._busy = 0

    def _translate(self, group: list[TranslationJob]) -> None:
        if not group:
            return
        lines = [line for job in group for line in job.lines]
        try:
            with torch.inference_mode():
                results: list[list[Translation] | None] = list(translate(
                    self.model, self.tokenizer, lines, group[0].options,
                    batch_size=self.batch_size))
            errors: list[str | None] = [None] * len(lines)
        except Exception as e:
            # One line may be what fails: translate each alone, so the others are answered.
            log.warning("translating %d lines together failed (%s); translating them one "
                        "by one", len(lines), e)
            results, errors = self._one_by_one(lines, group[0].options)
        self.stats.steps += 1
        start = 0
        for job in group:
            part = results[start : start + len(job.lines)]
            for i, error in enumerate(errors[start : start + len(job.lines)]):
                if error is not None:
                    job.errors[i] = error
            start += len(job.lines)
            self.stats.generated_tokens += sum(
                len(self.tokenizer.encode(hyps[0].text)) for hyps in part if hyps)
            self.stats.finished_sequences += len(part)
            try:
                job.done(part)
            except Exception:
                log.exception("a translation's answer could not be handed over")

    def _one_by_one(self, lines: list[str], options: SearchOptions
                    ) -> tuple[list[list[Translation] | None], list[str | None]]:
        results: list[list[Translation] | None] = []
        errors: list[str | None] = []
        for line in lines:
            try:
                with torch.inference_mode():
                    results.append(translate(self.model, self.tokenizer, [line], options,
                                             batch_size=1)[0])
                errors.append(None)
            except Exception as e:
                log.error("translating one line failed: %s", e, exc_info=e)
                results.append(None)
                errors.append(f"translation failed: {type(e).__name__}: {e}")
        return results, errors
