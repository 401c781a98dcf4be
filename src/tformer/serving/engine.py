"""What the language-model engines share (serving/scheduler.py's paged engine, serving/
stream.py's for Transformer-XL): the queue that request handlers submit to from any thread,
the decoding thread that runs one step after another, the stats, and handing tokens over
(serving/apply.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from tformer.decoding.lm import EosIds, stop_ids
from tformer.kernels.blocks import REPACK_MIN_ROWS, keep_repacked
from tformer.serving.apply import EngineStats, accept, draw
from tformer.serving.sequence import Sequence

log = logging.getLogger(__name__)

Generate = Callable[..., Iterator[torch.Tensor]]
"""A family's generate (tformer.registry.Family.generate)."""


class LMEngine:
    """One decoding thread for a language model; `submit` from any thread.

    `LMEngine(model, batched=...)` makes the engine for the model's kind: a `PagedEngine`
    (serving/scheduler.py) where it has a KV cache (batched), a `StreamEngine`
    (serving/stream.py) where its memory is its own (Transformer-XL). Importing
    serving/scheduler.py defines both. This class holds what both share: the queue, the thread, the
    stats, and handing tokens over.

    max_batch: sequences decoded together at most; max_waiting: sequences queued at most
    (past it `submit` refuses, and the server answers 503 with Retry-After).
    """

    batched: bool
    context: int | None

    def __new__(cls, model: nn.Module, *, batched: bool = True, **options: Any) -> LMEngine:
        if cls is LMEngine:  # the engine of the model's kind, among those defined
            cls = next(kind for kind in LMEngine.__subclasses__() if kind.batched == batched)
        return super().__new__(cls)

    def __init__(self, model: nn.Module, *, eos_id: EosIds, max_batch: int = 16,
                 max_waiting: int = 64, batched: bool) -> None:
        self.model = model
        layers = getattr(model, "model", model)  # a decoding runner's model
        if batched and max_batch >= REPACK_MIN_ROWS and isinstance(layers, nn.Module):
            # A batch's every step multiplies a row a sequence: the block layers' repacked
            # copy pays for itself at each (kernels/blocks.py, keep_repacked).
            keep_repacked(layers)
        self.eos_ids = stop_ids(eos_id)
        """A sequence ends at any of them (Llama 3 has three)."""
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.device = next(model.parameters()).device
        self.pending: deque[Sequence] = deque()
        """Submitted, not yet taken by the decoding thread (shared: under the lock)."""
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
            if self._stopping or self.waiting + len(seqs) > self.max_waiting:
                return False
            self.pending.extend(seqs)
            self._cond.notify()
        return True

    def kv_positions(self) -> int | None:
        """The most positions one sequence may hold in the KV pool (None: no pool)."""
        return None

    @property
    def waiting(self) -> int:
        return len(self.pending)

    @property
    def running(self) -> int:
        raise NotImplementedError

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
            start = time.perf_counter()
            try:
                self.step()
            except Exception as e:
                # A forward pass over the whole batch failed: no sequence can go on alone.
                log.exception("decoding failed; ending the sequences in flight")
                for seq in self.in_flight():
                    seq.fail("decoding", e)
                self.clear()
            self.stats.busy_seconds += time.perf_counter() - start

    def _take_pending(self) -> list[Sequence]:
        with self._cond:
            seqs = list(self.pending)
            self.pending.clear()
        return seqs

    def _prepare(self, seq: Sequence) -> bool:
        """Make a joining sequence's generator; False where it has ended (cancelled, or
        its preparation failed)."""
        if seq.cancelled:
            self._finish(seq, "cancelled")
            return False
        try:
            seq.make_generator(self.device)
        except Exception as e:
            seq.fail("preparing", e)
            return False
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish(reason)
        self.stats.finished_sequences += 1

    def _accept(self, seq: Sequence, token: int | None) -> bool:
        return accept(seq, token, self.stats, self.eos_ids)

    def _draw(self, logits: Tensor, seqs: list[Sequence]) -> list[int | None]:
        return draw(logits, seqs, self.eos_ids)

    def step(self) -> None:
        """One step of the engine for every sequence it holds."""
        raise NotImplementedError

    def in_flight(self) -> list[Sequence]:
        """Every sequence the thread has taken and not ended."""
        raise NotImplementedError

    def clear(self) -> None:
        """Forget every sequence in flight (after they failed together)."""
        raise NotImplementedError


