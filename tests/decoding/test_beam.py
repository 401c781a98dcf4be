import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tformer.decoding import beam as beam_module
from tformer.decoding import runner as runner_module
from tformer.decoding.beam import beam_search, greedy_search, length_penalty
from tformer.kernels import library
from tformer.kernels import step as step_module
from tformer.kernels.formats import quantize_model
from tformer.kernels.search import torch_top_logprobs
from tformer.layers import cache as cache_module
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

PAD, BOS, EOS, A, B = 0, 1, 2, 3, 4
IDS = {"pad": PAD, "bos": BOS, "eos": EOS}
SPECIAL = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD}


# --- beam search against hand-written probability tables ---------------------------------


class TableCache:
    """Remembers each row's prefix; reorder follows the beams like a real cache."""

    def __init__(self, batch: int) -> None:
        self.history = torch.empty(batch, 0, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.history.shape[1]

    def reorder(self, index: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        self.history = self.history.index_select(0, index)


class TableModel(nn.Module):
    """P(next token | output so far) from a dict; unlisted tokens have probability 0."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], vocab: int = 5) -> None:
        super().__init__()
        self.table = table
        self.cfg = SimpleNamespace(max_len=16, vocab_size=vocab)

    def encode(self, src, src_real):
        return src.float()[:, :, None]

    def make_cache(self, batch, max_len):
        return TableCache(batch)

    def decode(self, tgt, memory, src_real, *, cache):
        cache.history = torch.cat([cache.history, tgt], dim=1)
        logits = torch.full((tgt.shape[0], 1, self.cfg.vocab_size), float("-inf"))
        for row, prefix in enumerate(cache.history.tolist()):
            for token, p in self.table.get(tuple(prefix[1:]), {EOS: 1.0}).items():
                logits[row, 0, token] = math.log(p)
        return logits


TABLE = {
    (): {A: 0.6, B: 0.4},
    (A,): {EOS: 0.4, A: 0.35, B: 0.25},
    (B,): {EOS: 0.9, A: 0.05, B: 0.05},
    (A, A): {EOS: 1.0},
    (A, B): {EOS: 1.0},
}
SRC = torch.tensor([[5, 5, EOS]])
REAL = torch.ones_like(SRC, dtype=torch.bool)


def test_greedy_takes_the_locally_best_token():
    [hyp] = greedy_search(TableModel(TABLE), SRC, REAL, **SPECIAL)
    assert hyp.tokens == [A]
    assert hyp.logprob == pytest.approx(math.log(0.6 * 0.4))


def test_beam_search_finds_the_more_likely_translation_greedy_misses():
    [hyps] = beam_search(TableModel(TABLE), SRC, REAL, beam=2, n_best=2, alpha=0.0, **SPECIAL)
    assert [h.tokens for h in hyps] == [[B], [A]]
    assert [h.logprob for h in hyps] == pytest.approx([math.log(0.36), math.log(0.24)])


def test_the_length_penalty_prefers_longer_hypotheses_without_early_stopping():
    alpha = 2.0
    [hyps] = beam_search(TableModel(TABLE), SRC, REAL, beam=2, n_best=2, alpha=alpha,
                         early_stopping=False, max_len_a=0.0, max_len_b=4, **SPECIAL)
    assert [h.tokens for h in hyps] == [[B], [A, A]]
    expected = math.log(0.6 * 0.35) / length_penalty(3, alpha)
    assert hyps[1].score == pytest.approx(expected)
    # With early stopping the search ends as soon as two hypotheses are finished.
    [early] = beam_search(TableModel(TABLE), SRC, REAL, beam=2, n_best=2, alpha=alpha,
                          max_len_a=0.0, max_len_b=4, early_stopping=True, **SPECIAL)
    assert [h.tokens for h in early] == [[B], [A]]


def test_the_maximum_length_forces_the_end():
    # At most 1 token + EOS: the (A, A) and (A, B) continuations are out of reach.
    [hyps] = beam_search(TableModel(TABLE), SRC, REAL, beam=2, n_best=2, alpha=0.0,
                         early_stopping=False, max_len_a=0.0, max_len_b=2, **SPECIAL)
    assert [h.tokens for h in hyps] == [[B], [A]]
    [forced] = beam_search(TableModel(TABLE), SRC, REAL, beam=2, alpha=0.0, max_len_a=0.0,
                           max_len_b=1, **SPECIAL)
    # The table gives EOS probability 0 at the first step: the forced end has logprob -inf.
    assert forced[0].tokens == [] and forced[0].logprob == float("-inf")


# --- a real (tiny, random) model --------------------------------------------------------


V = 23


@pytest.fixture(scope="module")
def model() -> Seq2Seq:
    return tiny_model()


def tiny_model() -> Seq2Seq:
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=V, max_len=40, n_layer=2, n_head=2, d_model=16, d_ff=32,
                        dropout=0.0)
    model = Seq2Seq(cfg).eval()
    with torch.no_grad():  # sharper distributions than at initialisation: fewer near-ties
        model.out_proj.weight.mul_(4.0)
    return model


def sources(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, V, (int(k),), generator=g).tolist() + [EOS]
            for k in torch.randint(1, 12, (n,), generator=g)]
    width = max(map(len, seqs))
    src = torch.zeros(n, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        src[i, : len(s)] = torch.tensor(s)
    return src, src != PAD, seqs


def one(seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([seq])
    return src, torch.ones_like(src, dtype=torch.bool)


@pytest.mark.parametrize("alpha, early_stopping", [(0.6, True), (0.0, False)])
def test_beam_size_one_equals_greedy(model, alpha, early_stopping):
    # (With alpha > 0 and no early stopping, beam 1 may go on past greedy's EOS and find a
    # longer hypothesis with a better normalised score, so they can differ by design.)
    src, real, _ = sources(8)
    greedy = greedy_search(model, src, real, alpha=alpha, **SPECIAL)
    beam = beam_search(model, src, real, beam=1, alpha=alpha, early_stopping=early_stopping,
                       **SPECIAL)
    for g, [b] in zip(greedy, beam, strict=True):
        assert g.tokens == b.tokens
        # Equal up to rounding: finished sentences leave each search's batch at other steps,
        # and a matrix product's rounding may depend on how many rows it has.
        assert g.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert g.score == pytest.approx(b.score, abs=1e-4)


def test_cached_greedy_equals_uncached(model):
    src, real, _ = sources(6)
    cached = greedy_search(model, src, real, **SPECIAL)
    uncached = greedy_search(model, src, real, use_cache=False, **SPECIAL)
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    assert [h.logprob for h in cached] == pytest.approx([h.logprob for h in uncached], abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_sixteen_sentences_as_one_batch_equal_one_at_a_time(model, beam):
    src, real, seqs = sources(16, seed=2)
    batched = beam_search(model, src, real, beam=beam, n_best=beam, **SPECIAL)
    for seq, together in zip(seqs, batched, strict=True):
        [alone] = beam_search(model, *one(seq), beam=beam, n_best=beam, **SPECIAL)
        assert [h.tokens for h in together] == [h.tokens for h in alone]
        assert [h.score for h in together] == pytest.approx([h.score for h in alone], abs=1e-4)


def test_greedy_batched_equals_one_at_a_time(model):
    src, real, seqs = sources(16, seed=3)
    batched = greedy_search(model, src, real, **SPECIAL)
    for seq, together in zip(seqs, batched, strict=True):
        [alone] = greedy_search(model, *one(seq), **SPECIAL)
        assert together.tokens == alone.tokens
        assert together.logprob == pytest.approx(alone.logprob, abs=1e-4)


class RowCounter(nn.Module):
    """The model, recording how many rows each decoder step runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.cfg, self.rows = model, model.cfg, []

    def encode(self, src, src_real):
        return self.model.encode(src, src_real)

    def make_cache(self, batch, max_len):
        return self.model.make_cache(batch, max_len)

    def decode(self, tgt, memory, src_real, *, cache):
        self.rows.append(tgt.shape[0])
        return self.model.decode(tgt, memory, src_real, cache=cache)


@pytest.mark.parametrize("alpha, early_stopping", [(0.6, False), (0.0, True)])
def test_a_finished_sentence_leaves_the_batch(model, alpha, early_stopping):
    # Each sentence is finished at the step it would be alone, so the batch decodes exactly
    # the rows its sentences decode one at a time, and fewer each time some finish.
    src, real, seqs = sources(16, seed=6)
    options = dict(beam=3, alpha=alpha, early_stopping=early_stopping, **SPECIAL)
    batched = RowCounter(model)
    beam_search(batched, src, real, **options)
    alone = RowCounter(model)
    for seq in seqs:
        beam_search(alone, *one(seq), **options)
    assert sum(batched.rows) == sum(alone.rows)
    # The first step decodes one row a sentence (the other beams would repeat it).
    assert batched.rows[0] == 16 and batched.rows[1] == 16 * 3
    assert batched.rows[1:] == sorted(batched.rows[1:], reverse=True)
    assert len(set(batched.rows)) > 3


def test_a_finished_sentence_leaves_greedy_search_at_the_next_check(model):
    src, real, seqs = sources(16, seed=7)
    batched = RowCounter(model)
    greedy_search(batched, src, real, check_every=4, **SPECIAL)
    alone = RowCounter(model)
    for seq in seqs:
        greedy_search(alone, *one(seq), check_every=4, **SPECIAL)
    assert batched.rows == sorted(batched.rows, reverse=True) and len(set(batched.rows)) > 2
    # Alone, a sentence stops at the first check after its end, or at its own length limit.
    assert sum(alone.rows) <= sum(batched.rows) <= sum(alone.rows) + 3 * 16


def test_beam_hypotheses_are_sorted_by_length_normalised_score(model):
    src, real, _ = sources(3, seed=4)
    for hyps in beam_search(model, src, real, beam=4, n_best=4, alpha=0.6, **SPECIAL):
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        for h in hyps:
            assert h.score == pytest.approx(h.logprob / length_penalty(len(h.tokens) + 1, 0.6))


def test_beam_logprobs_equal_a_teacher_forced_rescoring(model):
    src, real, seqs = sources(2, seed=5)
    hyps = beam_search(model, src, real, beam=3, n_best=3, **SPECIAL)
    for seq, nbest in zip(seqs, hyps, strict=True):
        s, r = one(seq)
        for h in nbest:
            tgt_in = torch.tensor([[BOS, *h.tokens]])
            target = torch.tensor([*h.tokens, EOS])
            with torch.no_grad():
                logp = torch.log_softmax(model(s, r, tgt_in)[0], dim=-1)
            assert h.logprob == pytest.approx(float(logp.gather(1, target[:, None]).sum()),
                                              abs=1e-3)


def test_hugging_face_length_penalty_and_its_stopping_rule():
    """penalty = "hf": score = log P / |y| ** alpha, |y| counting EOS. After step 2 both
    beams have finished ([B] and [A]) and the best live one, (A, A) at log 0.21, divided by
    its current length 2 ** 2, scores below both: Hugging Face's rule stops there, though
    (A, A, EOS) would score log 0.21 / 3 ** 2 = -0.17 (the GNMT search above finds it)."""
    [hyps] = beam_search(TableModel(TABLE), SRC, REAL, beam=2, n_best=2, alpha=2.0,
                         penalty="hf", max_len_a=0.0, max_len_b=4, **SPECIAL)
    assert [h.tokens for h in hyps] == [[B], [A]]
    assert [h.score for h in hyps] == pytest.approx([math.log(0.36) / 4, math.log(0.24) / 4])
    assert length_penalty(3, 2.0, "hf") == 9.0
    with pytest.raises(ValueError, match="gnmt"):
        length_penalty(3, 1.0, "fairseq")


def test_candidates_from_the_kernel_and_from_torch_give_the_same_search(model, monkeypatch):
    # kernels/search.py picks each beam's candidates without writing out the
    # log-probabilities; torch's log-softmax and top-k, the path without the kernel, must
    # find the same translations (scores equal up to the order of a sum's terms).
    src, real, _ = sources(8)
    fast = beam_search(model, src, real, beam=3, n_best=3, alpha=0.6, **SPECIAL)
    monkeypatch.setattr(beam_module, "top_logprobs", torch_top_logprobs)
    plain = beam_search(model, src, real, beam=3, n_best=3, alpha=0.6, **SPECIAL)
    for a, b in zip(fast, plain, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_caches_read_in_place_give_the_same_search_as_copied_ones(model, monkeypatch, beam):
    # Where the attention kernel is built, beam search never copies the caches (a Lineage
    # follows the beams) and each step's attention runs the kernel; torch's attention over
    # caches copied into the beams' order at every step must find the same translations.
    src, real, _ = sources(12, seed=4)
    fast = beam_search(model, src, real, beam=beam, n_best=beam, alpha=0.6, **SPECIAL)
    fast_greedy = greedy_search(model, src, real, **SPECIAL)
    monkeypatch.setattr(runner_module, "serves_cache", lambda dtype, device: False)
    monkeypatch.setattr(cache_module, "serves", lambda x: False)
    plain = beam_search(model, src, real, beam=beam, n_best=beam, alpha=0.6, **SPECIAL)
    plain_greedy = greedy_search(model, src, real, **SPECIAL)
    for a, b in zip(fast, plain, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
    assert [h.tokens for h in fast_greedy] == [h.tokens for h in plain_greedy]


@pytest.mark.skipif(library.load() is None, reason="the kernels are not built here")
@pytest.mark.parametrize("int8", [False, True])
def test_one_call_per_decoder_layer_gives_the_same_search(model, monkeypatch, int8):
    # kernels/step.py runs each decoder layer's step as one call where it can (int8 at any
    # number of rows where the CPU packs the weights; fp32 at up to four rows: one sentence
    # at beam 4): the layers run as modules must find the same translations, sentences
    # finishing and leaving the batch on the way.
    model = quantize_model(model, "int8" if int8 else "fp32")
    calls = []
    run = step_module.DecoderStep.run
    monkeypatch.setattr(step_module.DecoderStep, "run",
                        lambda self, *a: calls.append(1) or run(self, *a))
    src, real, _ = sources(6, seed=5)
    fast = [beam_search(model, src[i : i + 1], real[i : i + 1], beam=4, n_best=4, alpha=0.6,
                        **SPECIAL) for i in range(6)]
    fast += [beam_search(model, src, real, beam=4, n_best=4, alpha=0.6, **SPECIAL)]
    assert calls
    monkeypatch.setattr(step_module.DecoderStep, "of", lambda *a: None)
    plain = [beam_search(model, src[i : i + 1], real[i : i + 1], beam=4, n_best=4, alpha=0.6,
                         **SPECIAL) for i in range(6)]
    plain += [beam_search(model, src, real, beam=4, n_best=4, alpha=0.6, **SPECIAL)]
    for a, b in zip(fast, plain, strict=True):
        for x, y in zip(a, b, strict=True):
            assert [h.tokens for h in x] == [h.tokens for h in y]
            assert [h.score for h in x] == pytest.approx([h.score for h in y], abs=1e-4)
