"""Beam search that sentences join and leave between steps (decoding/beam_pool.py) against
beam_search and greedy_search (decoding/beam.py) decoding each sentence alone."""

import pytest
import torch

from tformer.decoding import paged as paged_module
from tformer.decoding.beam import beam_search, greedy_search
from tformer.decoding.beam_pool import BeamPool
from tformer.kernels import attend as attend_module
from tformer.kernels.step import DecoderStep
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

from .test_beam import EOS, SPECIAL, V, tiny_model


@pytest.fixture(scope="module")
def model() -> Seq2Seq:
    return tiny_model()


def sentences(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(k),), generator=g).tolist() + [EOS]
            for k in torch.randint(1, 12, (n,), generator=g)]


def alone(model, seq: list[int], **options):
    src = torch.tensor([seq])
    real = torch.ones_like(src, dtype=torch.bool)
    if options.get("beam") == 1 and options.pop("greedy", False):
        options.pop("beam")
        options.pop("early_stopping", None)
        options.pop("n_best", None)
        return [greedy_search(model, src, real, **options, **SPECIAL)[0]]
    options.pop("greedy", None)
    return beam_search(model, src, real, **options, **SPECIAL)[0]


def run(pool: BeamPool, seqs: list[list[int]], arrivals: list[int]) -> dict:
    """Sentence i joins before step arrivals[i]; every sentence's hypotheses by index."""
    results, step = {}, 0
    while len(results) < len(seqs):
        pool.join([(i, s) for i, s in enumerate(seqs) if arrivals[i] == step])
        for done in pool.step():
            assert done.key not in results
            results[done.key] = done.hypotheses
        step += 1
        assert step < 500
    assert pool.sentences == 0 and pool.pool.used == 0 and pool.reserved == 0
    return results


def assert_same(got, want):
    assert [h.tokens for h in got] == [h.tokens for h in want]
    assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)
    assert [h.logprob for h in got] == pytest.approx([h.logprob for h in want], abs=1e-4)


OPTIONS = [
    dict(beam=4, alpha=0.6, n_best=4),
    dict(beam=3, alpha=0.0, early_stopping=True, n_best=2),
    dict(beam=4, alpha=1.0, penalty="hf"),
    dict(beam=5, alpha=0.6, max_len_a=0.5, max_len_b=3),  # the length limit ends most
]


@pytest.mark.parametrize("options", OPTIONS)
def test_sentences_joining_at_any_step_get_what_beam_search_gives_each_alone(model, options):
    seqs = sentences(12, seed=3)
    arrivals = [0, 0, 0, 1, 2, 2, 5, 7, 8, 8, 13, 20]
    pool = BeamPool(model, **options, **SPECIAL)
    results = run(pool, seqs, arrivals)
    for i, seq in enumerate(seqs):
        assert_same(results[i], alone(model, seq, **options))


def test_a_marian_shaped_model_with_hugging_faces_rules(model):
    # Post-norm, SiLU, an output bias, more decoder layers than encoder ones, sinusoids in
    # Marian's layout, and Hugging Face's length penalty and end rule (its MarianMTModel's).
    torch.manual_seed(1)
    cfg = Seq2SeqConfig(vocab_size=V, max_len=40, n_layer=1, n_decoder_layer=2, n_head=2,
                        d_model=16, d_ff=32, dropout=0.0, activation="silu", norm="post",
                        output_bias=True, sinusoid_layout="halves")
    marian = Seq2Seq(cfg).eval()
    with torch.no_grad():
        marian.out_proj.weight.mul_(4.0)
    options = dict(beam=3, alpha=1.0, penalty="hf", n_best=2)
    seqs = sentences(8, seed=8)
    results = run(BeamPool(marian, **options, **SPECIAL), seqs, [0, 0, 1, 2, 2, 4, 7, 7])
    for i, seq in enumerate(seqs):
        assert_same(results[i], alone(marian, seq, **options))


def test_beam_one_with_early_stopping_is_greedy_search(model):
    seqs = sentences(10, seed=4)
    pool = BeamPool(model, beam=1, alpha=0.6, early_stopping=True, **SPECIAL)
    results = run(pool, seqs, [0, 0, 1, 1, 2, 3, 3, 6, 9, 9])
    for i, seq in enumerate(seqs):
        assert_same(results[i], alone(model, seq, beam=1, alpha=0.6, greedy=True))


def paths_used(monkeypatch) -> dict[str, int]:
    """Counts of the pool's decoding steps through step.c's paged decoder step, and of its
    layers' attentions through the paged attention kernel."""
    used = {"step": 0, "attend": 0}
    run_paged, attend_paged = DecoderStep.run_paged, paged_module.attend_paged

    def counted(name, f):
        def g(*args, **kwargs):
            used[name] += 1
            return f(*args, **kwargs)
        return g

    monkeypatch.setattr(DecoderStep, "run_paged", counted("step", run_paged))
    monkeypatch.setattr(paged_module, "attend_paged", counted("attend", attend_paged))
    return used


@pytest.mark.parametrize("path", ["layers", "gathered"])
def test_every_path_over_the_blocks_gives_the_same_search(model, monkeypatch, path):
    # step.c's decoder step over the blocks in place (where it serves: fp32 on a CPU), the
    # layers as modules with the paged attention kernel over them, or with the blocks
    # gathered into a padded window by torch (the path off the CPU): the same hypotheses.
    # (step.c's fp32 products take 4 rows at most: steps of one or two sentences run
    # there, the others as modules, in one search.)
    seqs = sentences(10, seed=5)
    arrivals = [0, 0, 1, 3, 3, 4, 9, 10, 25, 40]
    used = paths_used(monkeypatch)
    first = run(BeamPool(model, beam=2, **SPECIAL), seqs, arrivals)
    assert used["step"] > 10 or not attend_module.serves(torch.zeros(1, 2, 1, 8))
    pool = BeamPool(model, beam=2, **SPECIAL)
    pool._step = None
    pool.pool.in_place = path == "layers"
    used.update(step=0, attend=0)
    other = run(pool, seqs, arrivals)
    assert used["step"] == 0
    assert (used["attend"] > 10) == (path == "layers" and attend_module.serves(
        torch.zeros(1, 2, 1, 8)))
    for i in range(len(seqs)):
        assert_same(other[i], first[i])


def test_beams_share_their_blocks_and_copy_only_the_last_one_they_write(model):
    # A sentence's hypotheses hold their common past once: after a few dozen steps its K
    # beams hold fewer blocks than K private copies would, and the pool's count of blocks
    # in use is what the rows hold, each block counted once.
    pool = BeamPool(model, beam=4, max_len_a=0.0, max_len_b=38, block_size=4, **SPECIAL)
    pool.join([(0, sentences(1, seed=6)[0])])
    most_private = most_shared = 0
    while pool.sentences:
        pool.step()
        if pool.sentences:
            held = [set(row.blocks) for row in pool.rows]
            private = sum(map(len, held))
            distinct = len(set().union(*held))
            assert pool.pool.used == distinct
            most_private, most_shared = max(most_private, private), max(most_shared, distinct)
    assert most_shared < most_private
    assert pool.pool.used == 0


def test_a_sentence_waits_until_its_blocks_are_free(model):
    pool = BeamPool(model, beam=2, max_len_a=0.0, max_len_b=16, blocks=1 + 2 * 2 * 4,
                    block_size=4, **SPECIAL)
    seqs = sentences(3, seed=7)
    assert pool.fits(seqs[:2]) and not pool.fits(seqs)
    pool.join([(0, seqs[0]), (1, seqs[1])])
    assert not pool.fits(seqs[2:])
    with pytest.raises(ValueError, match="KV blocks"):
        pool.join([(2, seqs[2])])
    while pool.sentences == 2:
        pool.step()
    assert pool.fits(seqs[2:])


def test_bad_options_and_sources_are_refused(model):
    with pytest.raises(ValueError, match="n_best"):
        BeamPool(model, beam=2, n_best=3, **SPECIAL)
    with pytest.raises(ValueError, match="penalty"):
        BeamPool(model, beam=2, penalty="nope", **SPECIAL)
    pool = BeamPool(model, beam=2, **SPECIAL)
    with pytest.raises(ValueError, match="no tokens"):
        pool.join([(0, [])])
    assert pool.step() == [] and pool.sentences == 0


def test_sentences_that_leave_unfinished_harm_none_of_the_others(model):
    seqs = sentences(8, seed=9)
    pool = BeamPool(model, beam=3, **SPECIAL)
    pool.join([(i, s) for i, s in enumerate(seqs)])
    results = {}
    for step in range(200):
        if step == 2:
            pool.leave([key for key in pool.keys if key in (1, 4, 6)])
        for done in pool.step():
            results[done.key] = done.hypotheses
        if not pool.sentences:
            break
    assert sorted(results) == [0, 2, 3, 5, 7]
    assert pool.pool.used == 0 and pool.reserved == 0
    for i in results:
        assert_same(results[i], alone(model, seqs[i], beam=3))
