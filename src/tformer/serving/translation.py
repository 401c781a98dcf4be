"""Translations for many clients at once, batched continuously: a request's lines join the
sentences being decoded at the next step (decoding/beam_pool.py's BeamPool, the decoder's
keys and values in a paged pool), and each line leaves as soon as its beam search is
finished, so that a short request is not held behind a long one that arrived first.

Sentences decode together when they share their search options (beam width, length
penalty, limits): requests with other options wait until the sentences in flight finish,
and once one waits, no more lines join the running ones (first come, first served among
the option sets). Where a step fails, the lines in flight are translated again one by one
(decoding/translate.py), so that one bad line fails alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tformer.decoding.beam_pool import BeamPool, pool_blocks
from tformer.decoding.paged import PagedPool
from tformer.decoding.translate import SearchOptions, Translation, source_ids, translate
from tformer.serving.apply import EngineStats

log = logging.getLogger(__name__)

WIDEST_BEAM = 16
"""The widest beam a request may ask for (serving/protocol.py's TranslationRequest)."""


@dataclass
class TranslationJob:
    lines: list[str]
    options: SearchOptions
    done: Callable[[list[list[Translation] | None]], None]
    """Called from the engine's thread with the results in order; a line whose translation
    failed has None (and its error in `errors`)."""
    errors: dict[int, str] = field(default_factory=dict)
    """Line index -> what failed."""
    cancelled: bool = False
    results: list[list[Translation] | None] = field(default_factory=list)
    queue: deque[int] = field(default_factory=deque)
    """Its lines that have not joined yet (indexes)."""
    sources: list[list[int]] = field(default_factory=list)
    left: int = 0
    """Lines not answered yet."""


def default_blocks(model: nn.Module, sentences: int) -> int:
    """A pool for `sentences` sentences of 4 hypotheses of up to 128 target tokens, and at
    least for one sentence of the widest beam and the longest target the model allows."""
    return pool_blocks(model.cfg.max_len, sentences, 4, widest=WIDEST_BEAM)


class TranslationEngine:
    """Decodes the translation jobs submitted to it on its own thread (`start`), their lines
    joining and leaving a BeamPool between steps: at most `batch_size` sentences in flight,
    `max_waiting` jobs queued, keys and values in a pool of `blocks` blocks (None:
    default_blocks). `window`: how long an idle engine waits for requests arriving together
    to start them in one step."""

    def __init__(self, model: nn.Module, tokenizer: Any, *, window: float = 0.01,
                 batch_size: int = 32, max_waiting: int = 64, blocks: int | None = None
                 ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.window = window
        self.batch_size = batch_size
        self.max_waiting = max_waiting
        self.blocks = blocks
        self.context: int | None = None
        self.pending: deque[TranslationJob] = deque()
        self.stats = EngineStats()
        self._pool: PagedPool | None = None  # made on the engine's thread, at its first job
        self._beams: BeamPool | None = None
        self._options: SearchOptions | None = None
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
        """Sentences in flight."""
        return self._beams.sentences if self._beams is not None else 0

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the engine's thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.pending and not self.running and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.pending and not self.running:
                    return
            if not self.running:
                time.sleep(self.window)  # let the requests that arrive together gather
            try:
                with torch.inference_mode():
                    self._admit()
                    self._step()
            except Exception as e:  # the thread must outlive any one batch
                log.warning("a translation step failed (%s); translating its lines one by "
                            "one", e)
                self._rescue()

    def _admit(self) -> None:
        """Let lines of the waiting jobs join the sentences in flight: those of jobs with
        the running options, while no job with other options waits before them and the
        pool and batch have room."""
        beams = self._beams
        while True:
            with self._cond:
                job = self.pending[0] if self.pending else None
            if job is None:
                return
            if not job.sources:
                try:
                    self._prepare(job)
                except Exception as e:
                    log.warning("a translation's lines could not be read: %s", e)
                    job.results, job.left = [None] * len(job.lines), len(job.lines)
                    for i in range(len(job.lines)):
                        self._answer(job, i, None, f"translation failed: {e}")
                if not job.left:
                    self._pop(job)
                    continue
            if beams is None or (not beams.sentences and job.options != self._options):
                beams = self._begin(job.options)
            if job.options != self._options:
                return  # it waits for the sentences in flight to finish
            if job.cancelled:
                self._pop(job)
                continue
            room = self.batch_size - beams.sentences
            lines = []
            while job.queue and len(lines) < room:
                i = job.queue[0]
                if not beams.fits([job.sources[j] for j in lines] + [job.sources[i]]):
                    if not beams.sentences and not lines:
                        job.queue.popleft()  # alone in an empty pool it would not fit
                        self._answer(job, i, None, "the line needs more KV memory than the "
                                     "server holds at this beam width")
                        continue
                    break
                lines.append(job.queue.popleft())
            try:
                beams.join([((job, i), job.sources[i]) for i in lines])
            except Exception as e:  # nothing joined: the lines are tried one by one
                log.warning("%d lines could not join (%s); translating them one by one",
                            len(lines), e)
                for i in lines:
                    self._translate_alone(job, i)
            if job.queue:
                return  # its other lines wait for room
            self._pop(job)

    def _pop(self, job: TranslationJob) -> None:
        with self._cond:
            if self.pending and self.pending[0] is job:
                self.pending.popleft()

    def _prepare(self, job: TranslationJob) -> None:
        """Encode a job's lines; its blank ones are answered (empty) at once."""
        job.sources, blank = source_ids(self.tokenizer, job.lines, self.model.cfg.max_len)
        job.results = [None] * len(job.lines)
        job.left = len(job.lines)
        skip = set(blank)
        job.queue = deque(i for i in range(len(job.lines)) if i not in skip)
        for i in blank:
            self._answer(job, i, [Translation("", 0.0)] * job.options.n_best)

    def _begin(self, options: SearchOptions) -> BeamPool:
        """A BeamPool for these options over the engine's one KV pool (empty now)."""
        if self._pool is None or self._pool.used:  # (a pool left holding blocks: anew)
            blocks = self.blocks or default_blocks(self.model, self.batch_size)
            self._pool = PagedPool(self.model, blocks, prefix_cache=False)
        greedy = options.beam == 1
        self._beams = BeamPool(
            self.model, beam=options.beam, alpha=options.alpha, max_len_a=options.max_len_a,
            max_len_b=options.max_len_b, n_best=options.n_best,
            early_stopping=options.early_stopping or greedy, penalty=options.length_penalty,
            bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id, pool=self._pool)
        self._options = options
        return self._beams

    def _step(self) -> None:
        beams = self._beams
        if beams is None or not beams.sentences:
            return
        started = time.perf_counter()
        cancelled = [key for key in beams.keys if key[0].cancelled]
        if cancelled:
            beams.leave(cancelled)
        for finished in beams.step():
            job, i = finished.key
            hyps = finished.hypotheses
            self.stats.generated_tokens += len(hyps[0].tokens) + 1
            self.stats.finished_sequences += 1
            try:
                texts = [self.tokenizer.decode(h.tokens) for h in hyps]
            except Exception as e:
                self._answer(job, i, None, f"detokenizing failed: {type(e).__name__}: {e}")
                continue
            self._answer(job, i, [Translation(text, h.score)
                                  for text, h in zip(texts, hyps, strict=True)])
        self.stats.steps += 1
        self.stats.busy_seconds += time.perf_counter() - started

    def _answer(self, job: TranslationJob, i: int, result: list[Translation] | None,
                error: str | None = None) -> None:
        """A line's result (None: it failed, with `error`); the job is answered with its
        last line."""
        job.results[i] = result
        if error is not None:
            job.errors[i] = error
        job.left -= 1
        if job.left:
            return
        try:
            job.done(job.results)
        except Exception:
            log.exception("a translation's answer could not be handed over")

    def _rescue(self) -> None:
        """After a failed step: the lines in flight, translated again one by one."""
        keys = self._beams.clear() if self._beams is not None else []
        for job, i in keys:
            if not job.cancelled:
                self._translate_alone(job, i)

    def _translate_alone(self, job: TranslationJob, i: int) -> None:
        """Translate one line of a job by itself (decoding/translate.py), and answer it."""
        try:
            with torch.inference_mode():
                [result] = translate(self.model, self.tokenizer, [job.lines[i]], job.options,
                                     batch_size=1)
            self._answer(job, i, result)
        except Exception as e:
            log.error("translating one line failed: %s", e, exc_info=e)
            self._answer(job, i, None, f"translation failed: {type(e).__name__}: {e}")
