"""Speculative decoding keeps the target's output: greedy tokens equal plain decoding's for
every K and both drafters, in a batch as alone, through the cache's edge cases; sampled
tokens follow the target's distribution (a chi-square test against the exact one)."""

import copy
import itertools

import pytest
import torch

from tformer.config import config_from_dict
from tformer.decoding.lm import generate
from tformer.decoding.sampling import sampling_probs
from tformer.decoding.speculative import (
    SpeculationStats,
    lookup_draft,
    speculative_generate,
)
from tformer.errors import TformerError
from tformer.registry import get_family


def gpt(seed, vocab=50, context=64, **fields):
    torch.manual_seed(seed)
    cfg = config_from_dict({"model": {"family": "gpt", "vocab_size": vocab,
                                      "context": context, **fields}})
    return get_family("gpt").model(cfg.model).eval()


@pytest.fixture(scope="module")
def target():
    return gpt(1, n_layer=2, d_model=32, n_head=4)


@pytest.fixture(scope="module")
def draft():
    return gpt(2, n_layer=1, d_model=16, n_head=2)


def plain(model, prompt, n, eos_id=None):
    return [int(t[0]) for t in generate(model, torch.tensor([prompt]), max_new_tokens=n,
                                        temperature=0, eos_id=eos_id)]


def speculative(target, prompts, n, temperature=0.0, **options):
    rows = [[] for _ in prompts]
    for new in speculative_generate(target, prompts, max_new_tokens=n,
                                    temperature=temperature, **options):
        for row, tokens in zip(rows, new, strict=True):
            row += tokens
    return rows


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4, 4, 4, 30, 31, 4, 4, 4, 4]]


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_tokens_are_plain_decodings(target, draft, k):
    for prompt in PROMPTS:
        expected = plain(target, prompt, 30)
        assert speculative(target, [prompt], 30, draft=draft, draft_tokens=k) == [expected]
        assert speculative(target, [prompt], 30, lookup=2, draft_tokens=k) == [expected]


def test_a_batch_of_different_lengths_decodes_as_each_row_alone(target, draft):
    expected = [plain(target, p, 25) for p in PROMPTS]
    assert speculative(target, PROMPTS, 25, draft=draft, draft_tokens=4) == expected
    assert speculative(target, PROMPTS, 25, lookup=3, draft_tokens=5) == expected


class Contrary(torch.nn.Module):
    """A model whose logits are another's negated: its greedy choice is the other's least
    likely token."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def make_cache(self, *args, **kwargs):
        return self.model.make_cache(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return -self.model(*args, **kwargs)


def test_all_accepted_and_none_accepted(target):
    prompt = PROMPTS[0]
    expected = plain(target, prompt, 24)
    stats = SpeculationStats()
    # The target drafting for itself: every draft is accepted, K + 1 tokens a round.
    assert speculative(target, [prompt], 24, draft=target, draft_tokens=5,
                       stats=stats) == [expected]
    assert stats.accepted == stats.drafted > 0 and stats.rounds == 4
    # A draft whose choice is the target's least likely token: nothing is accepted, and
    # each round gives the target's own token.
    stats = SpeculationStats()
    contrary = Contrary(copy.deepcopy(target))
    assert speculative(target, [prompt], 24, draft=contrary, draft_tokens=3,
                       stats=stats) == [expected]
    assert stats.accepted == 0 and stats.rounds == 24


def test_eos_inside_a_draft_ends_the_row_there(target):
    prompt = PROMPTS[0]
    free = plain(target, prompt, 30)
    eos = free[7]
    expected = plain(target, prompt, 30, eos_id=eos)
    assert expected[-1] == eos and len(expected) <= 8
    got = speculative(target, [prompt, PROMPTS[1]], 30, draft=target, draft_tokens=6,
                      eos_id=eos)
    assert got[0] == expected


def test_any_of_several_eos_ids_ends_the_row(target):
    prompt = PROMPTS[0]
    free = plain(target, prompt, 30)
    ends = (free[9], free[5])
    stop = next(i for i, t in enumerate(free) if t in ends)
    expected = free[: stop + 1]
    assert plain(target, prompt, 30, eos_id=ends) == expected
    got = speculative(target, [prompt], 30, draft=target, draft_tokens=6, eos_id=list(ends))
    assert got[0] == expected


def test_past_the_context_the_window_slides_as_in_plain_decoding(draft):
    small = gpt(3, context=24, n_layer=2, d_model=32, n_head=4)
    prompt = list(range(1, 21))
    expected = plain(small, prompt, 30)
    assert speculative(small, [prompt], 30, draft=draft, draft_tokens=4) == [expected]
    assert speculative(small, [prompt], 30, lookup=2, draft_tokens=8) == [expected]


def exact_distribution(model, prompt, vocab):
    """P(t2, t3 | prompt) of plain sampling at temperature 1 (t1 summed out), enumerated."""
    with torch.no_grad():
        def next_probs(texts):
            return model(torch.tensor(texts))[:, -1].double().softmax(-1)

        p1 = next_probs([prompt])[0]
        p2 = next_probs([[*prompt, a] for a in range(vocab)])
        p3 = next_probs([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
        p3 = p3.reshape(vocab, vocab, vocab)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def sharp(seed, vocab):
    """A tiny model with weights large enough that its distributions are far from uniform:
    two of them differ by far more than the test's critical value (a chi-square of ~1300
    at 800 draws), so a round that drew from the drafter's would fail it."""
    model = gpt(seed, vocab=vocab, n_layer=1, d_model=16, n_head=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3, generator=g)
    return model


def generated(target, prompt, runs, options, stats):
    """Three tokens a call of speculative_generate: one row, its cache cut back after a
    rejection (decoding/pool.py's OneRow)."""
    generator = torch.Generator().manual_seed(0)
    return [speculative(target, [prompt], 3, temperature=1.0, draft_tokens=2,
                        generator=generator, stats=stats, **options)[0] for _ in range(runs)]


def served(target, prompt, runs, options, stats):
    """Three tokens a sequence of the server's engine, one sequence at a time: the first
    from reading the prompt, the others from rounds over its paged pool (decoding/paged.py),
    rejected positions cut back, each sequence with its own generator."""
    from tformer.serving.scheduler import LMEngine
    from tformer.serving.sequence import Sampling, Sequence
    from tformer.serving.speculation import Speculator

    spec = Speculator(capacity=1, draft_tokens=2, **options)
    spec.stats = stats
    engine = LMEngine(target, eos_id=None, max_batch=1, max_waiting=runs, batched=True,
                      speculator=spec)
    texts = [[] for _ in range(runs)]
    engine.submit([Sequence(prompt, Sampling(3, 1.0, seed=i),
                            lambda token, _, text=text: token is not None and text.append(token))
                   for i, text in enumerate(texts)])
    while engine.waiting or engine.running:
        engine.step()  # the decoding thread's loop, without the thread
    return texts


# The chi-square statistic's 0.1% critical value for 15 degrees of freedom.
CHI2_15_999 = 37.70


@pytest.mark.parametrize("rows", [
    generated,
    served,
], ids=["generate", "serve"])
@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_sampled_tokens_follow_the_targets_distribution(rows, drafter):
    """The same speculative round (decoding/speculative.py) over generate's rows and over
    the server's: (t2, t3), drafted and verified, follow plain sampling's distribution."""
    vocab, runs = 4, 800
    target, other = sharp(4, vocab), sharp(5, vocab)  # the drafter disagrees often
    prompt = [1, 2, 3, 1, 2]
    options = {"draft": other} if drafter == "model" else {"lookup": 2}
    stats = SpeculationStats()
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _, a, b in rows(target, prompt, runs, options, stats):
        counts[a, b] += 1
    expected = exact_distribution(target, prompt, vocab) * runs
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_15_999, chi2
    assert 0 < stats.accepted < stats.drafted  # the drafts were both right and wrong


def test_sampling_probs_is_what_plain_sampling_draws_from():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    probs = sampling_probs(logits, 0.7, 4, 0.9)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert ((probs > 0).sum(-1) <= 4).all()
    assert torch.equal(sampling_probs(logits, 0, 0, 1.0).argmax(-1), logits.argmax(-1))


def test_lookup_proposes_what_followed_the_last_ngram():
    assert lookup_draft([1, 2, 3, 9, 9, 1, 2], 2, 3) == [3, 9, 9]
    assert lookup_draft([5, 1, 7, 8, 1], 3, 2) == [7, 8]  # falls back to a 1-gram
    assert lookup_draft([1, 2, 3], 2, 4) == []


def test_what_cannot_speculate_is_one_line(target):
    with pytest.raises(TformerError, match="draft model or --prompt-lookup"):
        next(speculative_generate(target, [[1]], max_new_tokens=2))
    with pytest.raises(TformerError, match="--draft-tokens 0"):
        next(speculative_generate(target, [[1]], max_new_tokens=2, lookup=2, draft_tokens=0))
    for _ in itertools.islice(speculative_generate(target, [[1]], max_new_tokens=1, lookup=1),
                              1):
        pass


def test_an_int8_target_and_a_llama_layout_one_keep_their_own_greedy_output(draft):
    from tformer.kernels.formats import quantize_model

    int8 = quantize_model(gpt(6, n_layer=2, d_model=32, n_head=4), "int8")
    modern = gpt(7, n_layer=2, d_model=32, n_head=4, n_kv_head=2, rotary=True,
                 position="none", norm_kind="rmsnorm", feedforward="gated", qk_norm=True,
                 window=12)
    for target in (int8, modern):
        for prompt in PROMPTS:
            expected = plain(target, prompt, 24)
            assert speculative(target, [prompt], 24, draft=draft, draft_tokens=3) == [expected]
            assert speculative(target, [prompt], 24, lookup=2, draft_tokens=4) == [expected]
        assert speculative(target, PROMPTS, 24, draft=quantize_model(draft, "int8"),
                           draft_tokens=3) == [plain(target, p, 24) for p in PROMPTS]
