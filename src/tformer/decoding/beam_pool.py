"""Beam search that sentences join and leave between steps (continuous batching for an
encoder-decoder model, as serving's LMEngine batches a language model's texts), with the
decoder's self-attention keys and values in a paged pool.

decoding/beam.py's beam_search decodes a batch from its first step to its last: a sentence
that arrives meanwhile waits for the whole batch, and every hypothesis holds a buffer of
the longest output's positions. Here each sentence keeps its own step count: it joins the
rows in flight before any step (`join`) and leaves at the step it is finished (`step`
returns its hypotheses), so a server's translation starts at the next step, not after the
longest one in flight has ended.

The search is beam_search's, step for step, for each sentence: the same rules
(SearchRules, with each row's own step), the best 2K candidates, the finished hypotheses,
and when a sentence ends (fairseq's rule, early stopping, or Hugging Face's), so a sentence
gets the hypotheses it gets from beam_search alone (tests/decoding/test_beam_pool.py).
What differs is where its state lies:

- self-attention: each hypothesis is a Row of a PagedPool (decoding/paged.py). A step's
  reorder copies no keys: a hypothesis that continues another holds the other's blocks
  (`PagedPool.fork`, reference counts), so a sentence's beams hold their common past once,
  and a last block that several hold is copied by each that writes into it next but the
  last (copy on write: one indexed copy per layer a step; vLLM's beams share blocks
  alike). Attention reads the blocks in place where the paged kernel serves (PagedView).
- cross-attention: each sentence's keys and values of its encoder output, per layer,
  computed when it joins and stacked (n, H, S, ·) beside the others', padded to the
  longest source in flight and masked; its K beams read them shared (StaticKV).
- the search: beam_search's tensors with a row per sentence, and each sentence's step;
  sentences that join are appended, finished ones dropped.

A sentence decodes all K rows at its first step (beam_search decodes one row a sentence
then, since the others repeat it), so that every step decodes n * K rows: K - 1 rows
wasted once per sentence. Its blocks are reserved when it joins, for K hypotheses of its
longest output each (`fits`), so that no step runs out of them.

Shapes: n sentences in flight, K beams, L columns of the longest output (BOS first), S the
longest source, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tformer.data.parallel import pad_right
from tformer.decoding.beam import Hypothesis, SearchRules, length_penalty, max_output_lengths
from tformer.decoding.paged import BLOCK_SIZE, PagedPool, PagedView, Row, blocks_for
from tformer.decoding.runner import Seq2SeqRunner
from tformer.kernels.attend import serves_cache
from tformer.kernels.step import DecoderStep
from tformer.layers.cache import StaticKV
from tformer.layers.masks import attention_bias, padding_mask

NO_SCORE = float("-inf")


@dataclass(frozen=True)
class Finished:
    """A sentence that `step` finished: the key it joined with, its n_best hypotheses."""

    key: Any
    hypotheses: list[Hypothesis]


def pool_blocks(max_len: int, sentences: int, beam: int, *, widest: int | None = None,
                block_size: int = BLOCK_SIZE) -> int:
    """Blocks for `sentences` sentences of `beam` hypotheses of up to 128 target tokens
    (fewer where the model's max_len is), and at least for one sentence of the `widest` beam
    (default: `beam`) at max_len, block 0 besides."""
    widest = beam if widest is None else widest
    return 1 + max(sentences * beam * blocks_for(min(max_len, 128), block_size),
                   widest * blocks_for(max_len, block_size))


class BeamPool:
    """Sentences decoded by beam search together, each from the step it joined.

    `model`: an encoder-decoder model (models/seq2seq.py's Seq2Seq protocol, with
    `embed_targets` and its `decoder` layers). `pool`: the PagedPool to decode over (empty),
    or None for one of `blocks` blocks (None: room for `sentences` sentences of K
    hypotheses of up to 128 target tokens, and for one of the longest the model allows).
    With beam 1 and early stopping, this is greedy search.
    """

    def __init__(self, model: nn.Module, *, beam: int, bos_id: int, eos_id: int,
                 pad_id: int, alpha: float = 0.6, max_len_a: float = 1.5, max_len_b: int = 10,
                 n_best: int = 1, early_stopping: bool = False, penalty: str = "gnmt",
                 sentences: int = 32, blocks: int | None = None,
                 block_size: int = BLOCK_SIZE, pool: PagedPool | None = None) -> None:
        self.model = model.model if isinstance(model, Seq2SeqRunner) else model
        cfg = self.model.cfg
        K = self.beam = beam
        if not 1 <= n_best <= K:
            raise ValueError(f"n_best = {n_best} must be between 1 and the beam size {K}")
        if 2 * K > cfg.vocab_size:
            raise ValueError(f"beam {K} is too wide for a vocabulary of {cfg.vocab_size}")
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.alpha, self.penalty, self.n_best = alpha, penalty, n_best
        self.early_stopping = early_stopping
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        length_penalty(1.0, alpha, penalty)  # an unknown penalty fails here, not mid-flight
        if pool is None:
            if blocks is None:
                blocks = pool_blocks(cfg.max_len, sentences, K, block_size=block_size)
            pool = PagedPool(self.model, blocks, block_size=block_size, prefix_cache=False)
        elif pool.used:
            raise ValueError("a beam pool starts over an empty KV pool")
        self.pool = pool
        self.device = device = self.pool.device
        self._step = DecoderStep.paged(self.model.decoder) if serves_cache(
            pool.k[0].dtype, device) else None
        """The decoder's layers as step.c's one call each over the pool, or None."""
        self.reserve: list[int] = []
        """The blocks each sentence in flight reserves (K times its longest output's)."""

        # The search's state, a row per sentence in flight (beam_search's tensors).
        self.keys: list[Any] = []
        self.rows: list[Row] = []  # n * K hypotheses, sentence by sentence
        self.steps = torch.zeros(0, dtype=torch.long, device=device)
        """(n,) steps each sentence has taken (the column of its last token)."""
        self.max_len = torch.zeros(0, dtype=torch.long, device=device)
        self.tokens = torch.zeros(0, K, 1, dtype=torch.long, device=device)
        self.scores = torch.zeros(0, K, device=device)
        self.finished_score = torch.zeros(0, K, device=device)
        self.finished_logprob = torch.zeros(0, K, device=device)
        self.finished_length = torch.zeros(0, K, dtype=torch.long, device=device)
        self.finished_tokens = torch.zeros(0, K, 1, dtype=torch.long, device=device)
        self.src_real = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.cross = [StaticKV() for _ in self.model.decoder]
        self.memory_bias = torch.zeros(0, 1, 1, 0, device=device)
        self.rules: SearchRules | None = None
        self._latest = 0  # the most steps any sentence in flight has taken (on the host)

    @property
    def reserved(self) -> int:
        return sum(self.reserve)

    @property
    def sentences(self) -> int:
        """Sentences in flight."""
        return len(self.keys)

    def reserve_for(self, sources: Sequence[Sequence[int]]) -> list[int]:
        """The blocks sentences of these source ids reserve: K hypotheses of their longest
        output each."""
        lengths = torch.tensor([len(ids) for ids in sources], dtype=torch.long)
        real = torch.arange(max(lengths.tolist(), default=0))[None] < lengths[:, None]
        longest = max_output_lengths(real, self.max_len_a, self.max_len_b,
                                     self.model.cfg.max_len)
        return [self.beam * blocks_for(n, self.pool.block_size) for n in longest.tolist()]

    def fits(self, sources: Sequence[Sequence[int]]) -> bool:
        """Whether sentences of these source ids may join now (their blocks are free)."""
        return self.reserved + sum(self.reserve_for(sources)) <= self.pool.total

    def join(self, sources: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Encode (key, source ids) sentences and add them to those in flight: their first
        step is the next `step`. ValueError where they do not fit (`fits`)."""
        if not sources:
            return
        ids = [list(s) for _, s in sources]
        if any(not s for s in ids):
            raise ValueError("a source to translate has no tokens")
        reserve = self.reserve_for(ids)
        if self.reserved + sum(reserve) > self.pool.total:
            raise ValueError(f"{len(ids)} sentences need more KV blocks than are free")
        K, device, model = self.beam, self.device, self.model
        src, src_real = (t.to(device) for t in pad_right(ids, self.pad_id))
        memory = model.encode(src, src_real)
        max_len = max_output_lengths(src_real, self.max_len_a, self.max_len_b,
                                     model.cfg.max_len)
        m = len(ids)
        width = max(self.src_real.shape[1], src.shape[1])
        self.src_real = torch.cat([_widen(self.src_real, width, False),
                                   _widen(src_real, width, False)])
        for cache, layer in zip(self.cross, model.decoder, strict=True):
            k, v = layer.cross_attn.memory_kv(memory)
            if cache.k is None or cache.v is None:
                cache.k, cache.v = k, v
            else:
                cache.k = torch.cat([_widen(cache.k, width, 0.0, 2), _widen(k, width, 0.0, 2)])
                cache.v = torch.cat([_widen(cache.v, width, 0.0, 2), _widen(v, width, 0.0, 2)])
        self.memory_bias = attention_bias(padding_mask(self.src_real), memory.dtype)

        columns = max(self.tokens.shape[2], int(max_len.max()) + 1)
        tokens = torch.full((m, K, columns), self.pad_id, dtype=torch.long, device=device)
        tokens[:, :, 0] = self.bos_id
        scores = torch.full((m, K), NO_SCORE, device=device)
        scores[:, 0] = 0.0  # only the first beam is alive at the start
        self.tokens = torch.cat([_widen(self.tokens, columns, self.pad_id, 2), tokens])
        self.finished_tokens = torch.cat([_widen(self.finished_tokens, columns, self.pad_id, 2),
                                          torch.full_like(tokens, self.pad_id)])
        self.scores = torch.cat([self.scores, scores])
        self.finished_score = torch.cat([self.finished_score, torch.full_like(scores, NO_SCORE)])
        self.finished_logprob = torch.cat([self.finished_logprob,
                                           torch.full_like(scores, NO_SCORE)])
        self.finished_length = torch.cat([self.finished_length,
                                          torch.zeros_like(scores, dtype=torch.long)])
        self.steps = torch.cat([self.steps, torch.zeros(m, dtype=torch.long, device=device)])
        self.max_len = torch.cat([self.max_len, max_len])
        self.keys += [key for key, _ in sources]
        self.rows += [Row() for _ in range(m * K)]
        self.reserve += reserve
        self._new_rules()

    def _new_rules(self) -> None:
        self.rules = None if not self.keys else SearchRules(
            self.max_len.repeat_interleave(self.beam), self.model.cfg.vocab_size,
            eos_id=self.eos_id, banned=(self.pad_id, self.bos_id),
            free_forced_eos=self.penalty == "hf")

    def _decode(self, inputs: Tensor) -> Tensor:
        """(n * K, 1) each hypothesis' last token -> (n * K, V) logits of the next, their
        keys and values stored in the hypotheses' blocks."""
        pool, rows, model = self.pool, self.rows, self.model
        pool.own_last([row for row in rows if row.length % pool.block_size])
        pool.allocate(rows, [1] * len(rows))
        x = model.embed_targets(inputs, self.steps.repeat_interleave(self.beam)[:, None])
        step = self._step
        if (pool.in_place and step is not None
                and step.serves_paged(x, self.cross, self.memory_bias, pool.k[0])):
            # Every layer one C call, its self-attention reading the blocks in place.
            lengths = torch.tensor([row.length + 1 for row in rows], device=self.device)
            x = step.run_paged(x, pool.k, pool.v, pool.block_tables(rows), lengths,
                               self.cross, self.memory_bias)
        else:
            x = self._layers(x)
        for row in rows:
            row.length += 1
        return model.decoder_outputs(x)[:, -1]

    def _layers(self, x: Tensor) -> Tensor:
        """The decoder's layers as modules on (n * K, 1, D) inputs, their keys and values
        stored in the hypotheses' blocks: read in place by the paged attention kernel where
        it serves, else gathered (PagedView)."""
        view = PagedView(self.pool, self.rows, torch.ones(*x.shape[:2], dtype=torch.bool,
                                                          device=self.device))
        # Where the blocks are gathered into a window (not read in place), rows shorter
        # than the longest are padded in it, and masked.
        self_mask = None if view.is_real is None else attention_bias(
            padding_mask(view.is_real), x.dtype)
        for layer, self_kv, cross in zip(self.model.decoder, view.self_attn, self.cross,
                                         strict=True):
            x = layer(x, None, self.memory_bias, self_kv, cross, self_mask)
        return x

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """One token for every hypothesis in flight; the sentences that are finished now,
        which leave."""
        if not self.keys:
            return []
        n, K, device = len(self.keys), self.beam, self.device
        assert self.rules is not None
        t = self.steps
        columns = self.tokens.shape[2]
        inputs = self.tokens.gather(2, t[:, None, None].expand(n, K, 1)).reshape(n * K, 1)
        logits = self._decode(inputs)

        # The best 2K of a sentence's K * V extensions are among the best 2K of each beam.
        beam_top, beam_token = self.rules.candidates(
            logits, t.repeat_interleave(K), self.scores.flatten(), 2 * K, latest=self._latest)
        top, index = beam_top.view(n, 2 * K * K).topk(2 * K, dim=1)
        parent = index // (2 * K)
        token = beam_token.view(n, 2 * K * K).gather(1, index)
        ends = token == self.eos_id
        column = (t + 1)[:, None, None].expand(n, K, 1)

        # Hypotheses among the best K that end here join the finished ones; the best K of
        # both are kept.
        new_finished = ends[:, :K] & top[:, :K].isfinite()
        if bool(new_finished.any()):
            ended = self.tokens.gather(1, parent[:, :K, None].expand(-1, -1, columns))
            ended.scatter_(2, column, token[:, :K, None])
            length = (t + 1)[:, None].expand(n, K)
            normalised = torch.where(
                new_finished,
                top[:, :K] / length_penalty(length.float(), self.alpha, self.penalty),
                NO_SCORE)
            self.finished_score, keep = torch.cat([self.finished_score, normalised],
                                                  dim=1).topk(K, dim=1)
            self.finished_logprob = torch.cat([self.finished_logprob, top[:, :K]],
                                              dim=1).gather(1, keep)
            self.finished_length = torch.cat([self.finished_length, length],
                                             dim=1).gather(1, keep)
            self.finished_tokens = torch.cat([self.finished_tokens, ended], dim=1).gather(
                1, keep[:, :, None].expand(-1, -1, columns))

        # The best K candidates that do not end carry on (at most K end).
        rank = torch.arange(2 * K, device=device)
        _, carry = (ends.long() * 2 * K + rank).topk(K, dim=1, largest=False)
        self.scores = top.gather(1, carry)
        carried = parent.gather(1, carry)
        self.tokens = self.tokens.gather(1, carried[:, :, None].expand(-1, -1, columns))
        self.tokens.scatter_(2, column, token.gather(1, carry)[:, :, None])
        parents = (torch.arange(n, device=device)[:, None] * K + carried).flatten()

        done = self._done(t)
        self.steps = t + 1
        self._latest += 1
        finished: list[Finished] = []
        if int(done.sum()):
            which = done.nonzero()[:, 0]
            finished = self._read_out(which)
            keep = (~done).nonzero()[:, 0]
            parents = parents.view(n, K)[keep].flatten()
            self._keep(keep)
        self._follow(parents.tolist())
        return finished

    def _done(self, t: Tensor) -> Tensor:
        """(n,) whether each sentence is finished after its step t (beam_search's rules)."""
        scores, finished_score = self.scores, self.finished_score
        if self.early_stopping:
            done = finished_score.isfinite().all(dim=1)
        elif self.penalty == "hf":
            best_live = scores.max(dim=1).values / length_penalty(
                t.float() + 1.0, self.alpha, self.penalty)
            worst_kept = finished_score[:, self.beam - 1]
            done = worst_kept.isfinite() & (best_live <= worst_kept)
        else:
            # A live beam's log-probability (<= 0) only falls, so its best possible score
            # divides it by the largest penalty it can still get.
            best_live = scores.max(dim=1).values / length_penalty(
                self.max_len.float(), self.alpha, self.penalty)
            worst_kept = finished_score[:, self.n_best - 1]
            done = worst_kept.isfinite() & (best_live <= worst_kept)
        return done | (t >= self.max_len - 1)

    def _read_out(self, which: Tensor) -> list[Finished]:
        """The n_best finished hypotheses of the sentences at `which`."""
        found = zip(which.tolist(), self.finished_tokens[which].tolist(),
                    self.finished_length[which].tolist(), self.finished_score[which].tolist(),
                    self.finished_logprob[which].tolist(), strict=True)
        out = []
        for i, toks, lengths, scores, logprobs in found:
            nbest = [Hypothesis(toks[j][1 : lengths[j]], scores[j], logprobs[j])
                     for j in range(self.n_best) if math.isfinite(scores[j])]
            # Only a model that gives EOS probability 0 where the length limit forces it
            # leaves a sentence with nothing finished: it gets the empty output.
            out.append(Finished(self.keys[i], nbest or [Hypothesis([], NO_SCORE, NO_SCORE)]))
        return out

    def _keep(self, keep: Tensor) -> None:
        """Only the sentences at `keep` stay in flight (their rows follow in `_follow`)."""
        for name in ("tokens", "scores", "finished_score", "finished_logprob",
                     "finished_length", "finished_tokens", "steps", "max_len", "src_real"):
            setattr(self, name, getattr(self, name)[keep])
        width = int(self.src_real.sum(1).max()) if len(keep) else 0
        self.src_real = self.src_real[:, :width]
        for cache in self.cross:
            assert cache.k is not None and cache.v is not None
            cache.k, cache.v = cache.k[keep, :, :width], cache.v[keep, :, :width]
        self.memory_bias = attention_bias(padding_mask(self.src_real), self.memory_bias.dtype)
        kept = keep.tolist()
        self.keys = [self.keys[i] for i in kept]
        self.reserve = [self.reserve[i] for i in kept]
        self._latest = int(self.steps.max()) if kept else 0
        self._new_rules()

    def _follow(self, parents: list[int]) -> None:
        """Hypothesis i continues the row parents[i] of this step: the first to continue a
        row takes it, the others hold its blocks too (`fork`); rows none continues give
        their blocks back."""
        pool, rows = self.pool, self.rows
        taken: set[int] = set()
        following = []
        for p in parents:
            if p in taken:
                following.append(pool.fork(rows[p]))
            else:
                taken.add(p)
                following.append(rows[p])
        for i, row in enumerate(rows):
            if i not in taken:
                pool.release(row)
        self.rows = following

    def leave(self, keys: Sequence[Any]) -> None:
        """The sentences joined with these keys leave unfinished (a client gone)."""
        gone = {id(key) for key in keys}
        stay = [i for i, key in enumerate(self.keys) if id(key) not in gone]
        K = self.beam
        self._keep(torch.tensor(stay, dtype=torch.long, device=self.device))
        self._follow([i * K + k for i in stay for k in range(K)])

    def clear(self) -> list[Any]:
        """Drop every sentence in flight (their blocks back); the keys they joined with."""
        keys = self.keys
        self.leave(keys)
        return keys


def _widen(x: Tensor, width: int, fill: Any, dim: int = 1) -> Tensor:
    """x padded with `fill` along `dim` to `width`."""
    if x.shape[dim] >= width:
        return x
    shape = list(x.shape)
    shape[dim] = width - x.shape[dim]
    return torch.cat([x, x.new_full(shape, fill)], dim=dim)
