"""The engine for a language model whose memory is its own (Transformer-XL): each sequence
decodes through its family's generate, one slot per sequence, the slots taking turns step
by step. There is no shared cache to plan, so a step is: take the queued sequences into
free slots, one token for each, hand them over (serving/apply.py).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from tformer.decoding.lm import EosIds, generate
from tformer.serving.engine import Generate, LMEngine
from tformer.serving.sequence import Sequence


class StreamEngine(LMEngine):
    """Sequences decoded one per slot, at most max_batch at once (see the module's text)."""

    batched = False
    context = None

    def __init__(self, model: nn.Module, *, eos_id: EosIds, max_batch: int = 16,
                 max_waiting: int = 64, batched: bool = False, generate: Generate = generate,
                 **_: object) -> None:
        super().__init__(model, eos_id=eos_id, max_batch=max_batch, max_waiting=max_waiting,
                         batched=False)
        self.generate = generate
        self.active: list[Sequence] = []
        """Decoding, each with its token stream (Sequence.stream)."""
        self.queue: deque[Sequence] = deque()

    @property
    def waiting(self) -> int:
        return len(self.pending) + len(self.queue)

    @property
    def running(self) -> int:
        return len(self.active)

    def in_flight(self) -> list[Sequence]:
        return list(self.active)

    def clear(self) -> None:
        self.active.clear()

    def step(self) -> None:
        self.queue.extend(self._take_pending())
        with torch.inference_mode():
            while self.queue and len(self.active) < self.max_batch:
                self._join(self.queue.popleft())
            for seq in [s for s in self.active if s.cancelled]:
                self._finish(seq, "cancelled")
            self.active = [seq for seq in self.active if not seq.finished]
            if not self.active:
                return
            done = []
            for seq in self.active:
                assert seq.stream is not None
                try:
                    token: int | None = int(next(seq.stream)[0])
                except Exception as e:  # a sequence decoded alone fails alone
                    seq.fail("decoding", e)
                    token = None
                if self._accept(seq, token):
                    done.append(seq)
            self.stats.steps += 1
            self.stats.finished_sequences += len(done)
            self.active = [seq for seq in self.active if seq not in done]

    def _join(self, seq: Sequence) -> None:
        if not self._prepare(seq):
            return
        opts = seq.sampling
        seq.stream = self.generate(
            self.model, torch.tensor([seq.prompt], device=self.device),
            max_new_tokens=opts.max_tokens, temperature=opts.temperature, top_k=opts.top_k,
            top_p=opts.top_p, generator=seq.generator, eos_id=self.eos_ids)
        self.active.append(seq)
