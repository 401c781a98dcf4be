"""Speculative decoding in the server's engine: greedy sequences equal the library's plain
decoding of each alone, whatever joins, leaves, speculates or not beside them; sampled ones
follow the target's distribution (tests/decoding/test_speculative.py, the same test over
generate's rows and the server's); a run is cut at the end of a sequence inside it."""

from __future__ import annotations

import copy

import pytest
import torch

from tformer.decoding.speculative import ModelProposer
from tformer.models.gpt import GPT, GPTConfig
from tformer.serving.sequence import Sampling
from tformer.serving.speculation import Speculator, speculates

from .test_scheduler import alone, decisive, run_engine


def gpt(context: int, *, layers: int = 2, width: int = 16, vocab: int = 29) -> GPT:
    return decisive(GPT(GPTConfig(vocab_size=vocab, context=context, n_layer=layers,
                                  n_head=2, d_model=width)))


def near(model: GPT, noise: float = 0.05) -> GPT:
    """The model with its weights perturbed: a draft that agrees with it often, not always."""
    other = copy.deepcopy(model)
    torch.manual_seed(99)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * noise)
    return other


def speculator(target: GPT, drafter: str, *, draft_tokens: int, capacity: int,
               draft: GPT | None = None) -> Speculator:
    if drafter == "lookup":
        return Speculator(capacity=capacity, lookup=2, draft_tokens=draft_tokens)
    return Speculator(capacity=capacity,
                      draft=draft if draft is not None else near(target),
                      draft_tokens=draft_tokens)


def mixed_requests(seed: int, count: int, context: int) -> list[tuple]:
    """Greedy requests of different lengths joining at different steps; every third asks
    for what speculation does not give (log-probabilities, a penalty) and decodes plainly."""
    torch.manual_seed(seed)
    requests = []
    for i in range(count):
        # Repetitive prompts, so that prompt lookup finds something to propose.
        motif = torch.randint(0, 29, (int(torch.randint(1, 5, ())),)).tolist()
        prompt = (motif * 6)[: int(torch.randint(1, 14, ()))]
        extra = [{}, {}, {"logprobs": 0} if i % 2 else {"presence_penalty": 0.5}][i % 3]
        sampling = Sampling(max_tokens=[40, 5, 27, 12, 60, 2, 1, 33][i % 8],
                            temperature=0.0, **extra)
        requests.append((prompt, sampling, i))
    return requests


def plain_engine(model, prompt, sampling):
    """The engine without speculation (penalties are the engine's, not generate's)."""
    return run_engine(model, [(prompt, sampling, 0)], max_batch=1)[0].tokens


@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize(("context", "max_batch", "draft_tokens"),
                         [(24, 3, 4), (96, 5, 3), (96, 8, 1)])
def test_greedy_sequences_decode_as_without_a_drafter(drafter, context, max_batch,
                                                      draft_tokens):
    """(24, 3): rows wait for a free one, rounds meet the end of the context and sequences
    slide past it; (96, ·): longer runs of accepted drafts."""
    target = gpt(context)
    requests = mixed_requests(context + max_batch, 10, context)
    spec = speculator(target, drafter, draft_tokens=draft_tokens, capacity=max_batch)
    sinks = run_engine(target, requests, max_batch=max_batch, speculator=spec)
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        want = (alone(target, prompt, sampling) if speculates(sampling)
                else plain_engine(target, prompt, sampling))
        assert sink.tokens == want
        assert sink.reason == "length"
    stats = spec.stats
    assert stats.rounds > 0 and 0 < stats.accepted <= stats.drafted


@pytest.mark.parametrize(("context", "max_batch", "draft_tokens"), [(24, 3, 4), (96, 5, 3)])
def test_the_draft_model_proposes_its_own_greedy_continuation(context, max_batch,
                                                             draft_tokens, monkeypatch):
    """Its pool follows each row's text through rejections, joins and leaves: what it
    proposes is what the draft model alone continues the text with."""
    target = gpt(context)
    draft = near(target)
    proposals = []
    propose = ModelProposer.propose

    def recorded(self, texts, budgets, samplings, fail):
        drafted, q = propose(self, texts, budgets, samplings, fail)
        proposals.extend((list(text), drafted.tokens[row, :drafted.count[row]].tolist())
                         for row, text in enumerate(texts) if drafted.count[row] > 0)
        return drafted, q

    monkeypatch.setattr(ModelProposer, "propose", recorded)
    spec = speculator(target, "model", draft_tokens=draft_tokens, capacity=max_batch,
                      draft=draft)
    run_engine(target, mixed_requests(context, 10, context), max_batch=max_batch,
               speculator=spec)
    assert len(proposals) > 10 and spec.stats.accepted < spec.stats.drafted
    for text, tokens in proposals:
        assert tokens == alone(draft, text, Sampling(len(tokens), 0.0))


def test_a_draft_longer_than_its_context_leaves_the_target_to_go_on():
    """A draft model of a shorter context: prompts longer than it never draft, the others
    do, and the text is the target's."""
    target = gpt(48)
    spec = speculator(target, "model", draft_tokens=3, capacity=4, draft=gpt(20, layers=1))
    requests = [([1, 2, 3] * 9, Sampling(15, 0.0), 0), ([4, 5], Sampling(30, 0.0), 0),
                ([6], Sampling(25, 0.0), 3)]
    sinks = run_engine(target, requests, max_batch=4, speculator=spec)
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        assert sink.tokens == alone(target, prompt, sampling)
    assert spec.stats.drafted > 0


def test_the_end_of_text_inside_an_accepted_run_ends_the_sequence_there():
    target = gpt(64)
    prompt = [3, 1, 4, 1, 5]
    first = alone(target, prompt, Sampling(20, 0.0))
    eos = next(t for t in first[4:] if t not in first[:4])
    want = first[: first.index(eos)]
    # The target drafting for itself: every draft is accepted, runs of 6 tokens.
    spec = speculator(target, "model", draft_tokens=5, capacity=2, draft=target)
    sinks = run_engine(target, [(prompt, Sampling(20, 0.0), 0), ([7, 8], Sampling(3, 0.0), 0)],
                       max_batch=2, eos_id=eos, speculator=spec)
    assert sinks[0].tokens == want and sinks[0].reason == "stop"
    assert sinks[1].tokens == alone(target, [7, 8], Sampling(3, 0.0), eos_id=eos)
    assert spec.stats.accepted == spec.stats.drafted > 0


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_a_sliding_window_model_speculates_over_the_blocks_it_keeps(drafter):
    """A window of 7: the engine's pool gives back the blocks behind it as texts grow, and
    speculation's rollbacks stay within what it keeps; greedy texts as without a drafter."""
    target = decisive(GPT(GPTConfig(vocab_size=29, context=96, n_layer=2, n_head=2,
                                    d_model=16, window=7)))
    requests = mixed_requests(5, 8, 96)
    spec = speculator(target, drafter, draft_tokens=4, capacity=4)
    sinks = run_engine(target, requests, max_batch=4, speculator=spec)
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        want = (alone(target, prompt, sampling) if speculates(sampling)
                else plain_engine(target, prompt, sampling))
        assert sink.tokens == want
    assert spec.stats.rounds > 0 and 0 < spec.stats.accepted < spec.stats.drafted
