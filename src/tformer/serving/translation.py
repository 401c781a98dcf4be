"""Translations for many clients at once: lines that arrive within a short window are decoded
as one batch by beam search; a batch that fails is decoded again line by line, so one bad
line fails alone."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tformer.decoding.translate import SearchOptions, Translation, translate
from tformer.serving.scheduler import EngineStats

log = logging.getLogger(__name__)

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
