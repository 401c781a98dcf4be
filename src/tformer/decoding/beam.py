"""Translating with an encoder-decoder model: greedy search and batched beam search.

A model decodes here if it has
    encode(src, src_real) -> memory
    decode(tgt, memory, src_real, cache=...) -> logits
    make_cache(batch, max_len) -> a cache with reorder(rows, sentences=None), as DecoderCache
and a `cfg.max_len` (the longest target its positions cover). The encoder runs once per
sentence; its cross-attention keys/values are computed on the first decoder step and kept
in the cache, and the K beams of a sentence read them as a view (no copy per beam). A
sentence that is finished leaves the batch (its rows of the cache, the encoder output and
the search's state), so that the rest decode without it: translating Multi30k's test2016
in batches of 32, 29% (greedy) to 40% (beam 4, alpha 1.6) of the rows decoded would
otherwise be finished ones (benchmarks/translation_speed.py --count-rows).

Shapes: B sentences, K beams, S source length, L longest output (tokens, EOS included),
V vocabulary.

Scores: a hypothesis y is ranked by log P(y | x) / lp(y) with GNMT's length penalty
lp(y) = ((5 + |y|) / 6) ** alpha (Wu et al. 2016, eq. 14), |y| counting the EOS token;
alpha = 0 ranks by log-probability alone. penalty = "hf" is the convention of Hugging Face
and Marian instead: lp(y) = |y| ** alpha, and a sentence ends as Hugging Face's beam search
ends it (below), and an EOS forced by the length limit costs nothing (its
forced_eos_token_id), so that its outputs can be compared one to one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.decoding.runner import runner
from tformer.kernels.search import top_logprobs


@dataclass
class Hypothesis:
    tokens: list[int]
    """Output ids, without BOS and EOS."""
    score: float
    """log-probability / length penalty: what beam search ranks by."""
    logprob: float
    """log P(tokens + EOS | source)."""


PENALTIES = ("gnmt", "hf")


def length_penalty(length: Tensor | float, alpha: float, penalty: str = "gnmt") -> Tensor | float:
    """What a hypothesis' log-probability is divided by; `length` counts the EOS token."""
    if penalty == "hf":
        return length**alpha
    if penalty != "gnmt":
        raise ValueError(f"length penalty must be one of {PENALTIES}, not {penalty!r}")
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src_real: Tensor, a: float, b: int, limit: int) -> Tensor:
    """(B,) the most tokens (EOS included) each sentence may produce: a * source length + b,
    at least 1 and at most `limit` (the model's positions)."""
    src_len = src_real.sum(dim=1).float()
    return (a * src_len + b).floor().long().clamp(min=1, max=limit)


class SearchRules:
    """The rules of decoding, applied to a step's log-probabilities: padding and BOS are
    never produced, and a row whose length limit is reached must produce EOS.

    max_len (N,): each row's limit (tokens, EOS included); banned: ids never produced.
    free_forced_eos: an EOS forced by the limit costs nothing (log-probability 0), as
    Hugging Face's forced_eos_token_id makes it; otherwise it costs log P(EOS).
    """

    def __init__(self, max_len: Tensor, vocab: int, *, eos_id: int, banned: tuple[int, ...],
                 free_forced_eos: bool = False):
        self.max_len = max_len
        self.free_forced_eos = free_forced_eos
        self.banned = torch.tensor(banned, device=max_len.device)
        self.not_eos = torch.arange(vocab, device=max_len.device) != eos_id
        # No row is at its limit before this step, so the check is skipped until then (one
        # read of the limits here instead of a vocabulary-wide mask at every step).
        self.first_forced = int(max_len.min()) - 1

    def logprobs(self, logits: Tensor, step: int | Tensor, latest: int | None = None
                 ) -> Tensor:
        """(N, V) logits of output position `step` (one for all rows, or (N,) each row's,
        `latest` then their largest) -> (N, V) log-probabilities."""
        logprobs = F.log_softmax(logits.float(), dim=-1)
        logprobs.index_fill_(1, self.banned, float("-inf"))
        if (step if latest is None else latest) >= self.first_forced:
            must_end = (step >= self.max_len - 1)[:, None]
            logprobs.masked_fill_(must_end & self.not_eos, float("-inf"))
            if self.free_forced_eos:
                logprobs.masked_fill_(must_end & ~self.not_eos, 0.0)
        return logprobs

    def candidates(
        self, logits: Tensor, step: int | Tensor, scores: Tensor, k: int,
        latest: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(N, V) logits of output position `step` (as in `logprobs`) and the rows' (N,)
        scores so far -> the best k of logprobs(logits, step) + scores in each row (values
        and tokens, (N, k)).

        kernels/search.py finds them without writing out the (N, V) log-probabilities; the
        steps where a row reaches its limit (few) take logprobs' path."""
        if ((step if latest is None else latest) >= self.first_forced
                and bool((step >= self.max_len - 1).any())):
            return self.logprobs(logits, step, latest).add_(scores[:, None]).topk(k, dim=-1)
        return top_logprobs(logits.float(), scores, k, self.banned)

    def keep(self, rows: Tensor) -> None:
        """Apply to rows `rows` of this batch only, from now on."""
        self.max_len = self.max_len[rows]

    def of_rows(self, rows: Tensor) -> SearchRules:
        """The same rules for rows `rows` of this batch (this one unchanged)."""
        rules = copy.copy(self)
        rules.keep(rows)
        return rules


def keep_rows(memory: Tensor | Sequence[Tensor], rows: Tensor) -> Any:
    """Rows `rows` of an encoder output: one tensor, or one per model of an ensemble."""
    if isinstance(memory, Tensor):
        return memory.index_select(0, rows)
    return [keep_rows(m, rows) for m in memory]


@torch.no_grad()
def greedy_search(
    model: nn.Module,
    src: Tensor,
    src_real: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    alpha: float = 0.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    use_cache: bool = True,
    check_every: int = 4,
    penalty: str = "gnmt",
) -> list[Hypothesis]:
    """The most likely next token at each step, for (B, S) sources at once.

    use_cache False runs the decoder over the whole prefix at every step (for tests).
    check_every: steps between checks which sentences have ended (each check waits for the
    device); the ones that have leave the batch then.
    """
    model = runner(model)  # one-call kernel steps where they serve
    B = src.shape[0]
    memory = model.encode(src, src_real)
    max_len = max_output_lengths(src_real, max_len_a, max_len_b, model.cfg.max_len)
    steps = int(max_len.max())
    cache = model.make_cache(B, steps) if use_cache else None
    tokens = torch.full((B, steps + 1), pad_id, dtype=torch.long, device=src.device)
    tokens[:, 0] = bos_id
    logprob = torch.zeros(B, device=src.device)
    length = torch.zeros(B, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    rules = SearchRules(max_len, model.cfg.vocab_size, eos_id=eos_id, banned=(pad_id, bos_id),
                   free_forced_eos=penalty == "hf")
    sentence = torch.arange(B, device=src.device)  # the input sentence of each row
    results: list[Hypothesis | None] = [None] * B

    def finish(rows: Tensor) -> None:
        """Read out the hypotheses of the sentences at `rows`."""
        score = logprob[rows] / length_penalty(length[rows].float(), alpha, penalty)
        for i, toks, n, s, lp in zip(sentence[rows].tolist(), tokens[rows].tolist(),
                                     length[rows].tolist(), score.tolist(),
                                     logprob[rows].tolist(), strict=True):
            results[i] = Hypothesis(toks[1:n], s, lp)

    for t in range(steps):
        prefix = tokens[:, t : t + 1] if use_cache else tokens[:, : t + 1]
        logits = model.decode(prefix, memory, src_real, cache=cache)[:, -1]
        logprobs = rules.logprobs(logits, t)
        token = logprobs.argmax(dim=-1)
        logprob += torch.where(done, 0.0, logprobs.gather(1, token[:, None])[:, 0])
        tokens[:, t + 1] = token.masked_fill(done, pad_id)
        ended = ~done & (token == eos_id)
        length = torch.where(ended, t + 1, length)
        done |= ended
        if (t + 1) % check_every == 0 and (n_done := int(done.sum())):
            finish(done.nonzero()[:, 0])
            if n_done == len(sentence):
                return results
            keep = (~done).nonzero()[:, 0]
            tokens, logprob, length, done = tokens[keep], logprob[keep], length[keep], done[keep]
            sentence, src_real = sentence[keep], src_real[keep]
            memory = keep_rows(memory, keep)
            rules.keep(keep)
            if cache is not None:
                cache.reorder(keep, keep)
    finish(torch.arange(len(sentence), device=src.device))
    return results


@torch.no_grad()
def beam_search(
    model: nn.Module,
    src: Tensor,
    src_real: Tensor,
    *,
    beam: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    alpha: float = 0.6,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    n_best: int = 1,
    early_stopping: bool = False,
    penalty: str = "gnmt",
) -> list[list[Hypothesis]]:
    """Beam search over (B, S) sources at once; the n_best hypotheses of each, best first.

    Each step scores the K * V extensions of a sentence's K beams and takes the best 2K:
    those among the best K that end in EOS become finished hypotheses, and the best K that
    do not end carry on (so the beam stays full, as in fairseq). A sentence is finished when
    no live beam can still beat its n_best-th finished hypothesis, or, with early_stopping,
    as soon as it has K finished ones (fairseq's rule: faster, but on a sharp model K poor
    short hypotheses can end a sentence while a better, longer one is still growing).
    With penalty = "hf", Hugging Face's rule instead: a sentence ends once it has K finished
    hypotheses and its best live beam, divided by the penalty of its current length, does
    not beat the worst of them (a heuristic: with alpha > 0 a longer hypothesis could).
    A finished sentence's results are read out and it leaves the batch. The self-attention
    caches follow the surviving beams, and drop the finished sentences, through one
    DecoderCache.reorder per step; everything else is tensor work on the device, with one
    check per step (once a hypothesis can have finished) which sentences are finished.
    """
    B, K = src.shape[0], beam
    if not 1 <= n_best <= K:
        raise ValueError(f"n_best = {n_best} must be between 1 and the beam size {K}")
    device = src.device
    model = runner(model)  # one-call kernel steps where they serve
    memory = model.encode(src, src_real)
    max_len = max_output_lengths(src_real, max_len_a, max_len_b, model.cfg.max_len)
    steps = int(max_len.max())
    max_len_beams = max_len.repeat_interleave(K)
    cache = model.make_cache(B * K, steps)
    V = model.cfg.vocab_size
    if 2 * K > V:
        raise ValueError(f"beam {K} is too wide for a vocabulary of {V}")

    L = steps + 1
    tokens = torch.full((B, K, L), pad_id, dtype=torch.long, device=device)
    tokens[:, :, 0] = bos_id
    # Only the first beam is alive at the start: the others would repeat it.
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    finished_score = torch.full((B, K), float("-inf"), device=device)
    finished_logprob = torch.full((B, K), float("-inf"), device=device)
    finished_length = torch.zeros(B, K, dtype=torch.long, device=device)
    finished_tokens = torch.full((B, K, L), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    rank = torch.arange(2 * K, device=device)
    row_offset = torch.arange(B, device=device)[:, None] * K

    rules = SearchRules(max_len_beams, V, eos_id=eos_id, banned=(pad_id, bos_id),
                   free_forced_eos=penalty == "hf")
    any_finished = False  # whether any hypothesis has finished yet (known on the host)
    sentence = torch.arange(B, device=device)  # the input sentence of each row of the state
    results: list[list[Hypothesis] | None] = [None] * B

    def finish(which: Tensor) -> None:
        """Read out the n_best finished hypotheses of the sentences at `which`."""
        found = zip(finished_tokens[which].tolist(), finished_length[which].tolist(),
                    finished_score[which].tolist(), finished_logprob[which].tolist(),
                    strict=True)
        for i, (toks, lengths, scores_, logprobs) in zip(sentence[which].tolist(), found,
                                                         strict=True):
            nbest = [Hypothesis(toks[j][1 : lengths[j]], scores_[j], logprobs[j])
                     for j in range(n_best) if math.isfinite(scores_[j])]
            # Only a model that gives EOS probability 0 where the length limit forces it
            # leaves a sentence with nothing finished: it gets the empty output, as greedy
            # search gives.
            results[i] = nbest or [Hypothesis([], float("-inf"), float("-inf"))]

    # The first step decodes one row a sentence: its other beams would repeat the first
    # (their scores are -inf until then). The cache holds those rows, and the step's reorder
    # hands each beam its sentence's row.
    cache.reorder(torch.arange(B, device=device))
    for t in range(steps):
        n = len(sentence)  # sentences still decoding
        inputs = tokens[:, 0, :1] if t == 0 else tokens[:, :, t].reshape(n * K, 1)
        logits = model.decode(inputs, memory, src_real, cache=cache)
        if t == 0:
            top, token = rules.of_rows(row_offset[:, 0]).candidates(logits[:, -1], t,
                                                                    scores[:, 0], 2 * K)
            top, index = top.topk(2 * K, dim=1)
            token = token.gather(1, index)
            parent = torch.zeros_like(index)
            decoded_row = torch.arange(n, device=device)[:, None]
        else:
            # The best 2K of a sentence's K * V extensions are among the best 2K of each
            # beam: two small top-k's, the first over rows of V, cheaper than one over K * V.
            beam_top, beam_token = rules.candidates(logits[:, -1], t, scores.flatten(), 2 * K)
            top, index = beam_top.view(n, 2 * K * K).topk(2 * K, dim=1)
            parent = index // (2 * K)
            token = beam_token.view(n, 2 * K * K).gather(1, index)
            decoded_row = row_offset
        ends = token == eos_id

        # Hypotheses among the best K that end here join the finished ones, and the best K
        # of both are kept. Most steps end none: the check skips a dozen operations then.
        new_finished = ends[:, :K] & top[:, :K].isfinite() & ~done[:, None]
        if bool(new_finished.any()):
            any_finished = True
            ended = tokens.gather(1, parent[:, :K, None].expand(-1, -1, L))
            ended[:, :, t + 1] = token[:, :K]
            normalised = torch.where(
                new_finished, top[:, :K] / length_penalty(t + 1.0, alpha, penalty), -torch.inf
            )
            finished_score, keep = torch.cat([finished_score, normalised], dim=1).topk(K, dim=1)
            finished_logprob = torch.cat([finished_logprob, top[:, :K]], dim=1).gather(1, keep)
            lengths = torch.full_like(finished_length, t + 1)
            finished_length = torch.cat([finished_length, lengths], dim=1).gather(1, keep)
            finished_tokens = torch.cat([finished_tokens, ended], dim=1).gather(
                1, keep[:, :, None].expand(-1, -1, L)
            )

        # The best K candidates that do not end carry on (there are always K: at most K end).
        _, carry = (ends.long() * 2 * K + rank).topk(K, dim=1, largest=False)
        scores = top.gather(1, carry)
        carried = parent.gather(1, carry)
        tokens = tokens.gather(1, carried[:, :, None].expand(-1, -1, L))
        tokens[:, :, t + 1] = token.gather(1, carry)
        parents = (decoded_row + carried).flatten()

        # Until a hypothesis finishes or a row reaches its limit, no sentence can be done.
        if any_finished:
            if early_stopping:
                done |= finished_score.isfinite().all(dim=1)
            elif penalty == "hf":
                best_live = scores.max(dim=1).values / length_penalty(t + 1.0, alpha, penalty)
                worst_kept = finished_score[:, K - 1]
                done |= worst_kept.isfinite() & (best_live <= worst_kept)
            else:
                # A live beam's log-probability (<= 0) only falls, so its best possible score
                # divides it by the largest penalty it can still get.
                best_live = scores.max(dim=1).values / length_penalty(
                    max_len.float(), alpha, penalty
                )
                worst_kept = finished_score[:, n_best - 1]
                done |= worst_kept.isfinite() & (best_live <= worst_kept)
        at_limit = t >= rules.first_forced
        if at_limit:
            done |= t >= max_len - 1
        keep = None
        if (any_finished or at_limit) and (n_done := int(done.sum())):
            finish(done.nonzero()[:, 0])
            if n_done == n:
                return results
            # The finished sentences leave the batch.
            keep = (~done).nonzero()[:, 0]
            parents = parents.view(n, K)[keep].flatten()
            tokens, scores, done = tokens[keep], scores[keep], done[keep]
            finished_score, finished_logprob = finished_score[keep], finished_logprob[keep]
            finished_length, finished_tokens = finished_length[keep], finished_tokens[keep]
            max_len, sentence, src_real = max_len[keep], sentence[keep], src_real[keep]
            memory = keep_rows(memory, keep)
            rules.keep((keep[:, None] * K + torch.arange(K, device=device)).flatten())
            row_offset = row_offset[: len(keep)]
        cache.reorder(parents, keep)
    finish(torch.arange(len(sentence), device=device))
    return results
