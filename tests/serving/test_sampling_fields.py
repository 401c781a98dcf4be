"""The sampling fields OpenAI's clients send: frequency and presence penalties and logit
bias against a naive loop over full forward passes; the fields accepted and ignored; values
out of range and unknown fields refused."""

from __future__ import annotations

import pytest
import torch

from tformer.decoding.sampling import next_token
from tformer.serving.scheduler import LMEngine
from tformer.serving.sequence import Sampling, Sequence

from .test_scheduler import Collect


def naive(model, prompt: list[int], sampling: Sampling) -> tuple[list[int], list[float]]:
    """Draw token by token from a full pass over everything so far, with the penalties as
    OpenAI defines them (over the completion's tokens) and the bias added; each token's
    log-probability under those logits."""
    generator = torch.Generator().manual_seed(sampling.seed or 0)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(sampling.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).float()[0, -1].clone()
        for token in set(tokens):
            count = tokens.count(token)
            logits[token] -= count * sampling.frequency_penalty + sampling.presence_penalty
        for token, bias in sampling.logit_bias:
            logits[token] += bias
        if sampling.temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(next_token(logits[None], temperature=sampling.temperature,
                                   top_k=sampling.top_k, top_p=sampling.top_p,
                                   generator=generator)[0])
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        tokens.append(token)
    return tokens, logprobs


@pytest.mark.parametrize("sampling", [
    Sampling(12, 0.0, frequency_penalty=1.5, presence_penalty=0.5, logprobs=0),
    Sampling(12, 1.0, top_k=6, seed=5, frequency_penalty=0.7, presence_penalty=-0.3,
             logit_bias=((7, 3.0), (8, -100.0)), logprobs=1),
    Sampling(6, 0.0, logit_bias=((9, 100.0),), logprobs=0),
])
def test_penalties_and_bias_draw_as_a_naive_loop(loaded, sampling):
    model = loaded.model
    prompts = [[5, 6, 7], [10], [11, 12, 13, 14]]
    engine = LMEngine(model, eos_id=None, max_batch=4, max_waiting=8, batched=True)
    sinks = [Collect() for _ in prompts]
    seqs = [Sequence(p, sampling, sink) for p, sink in zip(prompts, sinks, strict=True)]
    # A plain sequence beside them, so that the batch mixes adjusted and plain rows.
    plain = Collect()
    engine.submit([*seqs, Sequence([3, 4], Sampling(12, 0.0), plain)])
    engine.start()
    try:
        assert all(sink.event.wait(30) for sink in [*sinks, plain])
    finally:
        engine.stop(timeout=30)
    for prompt, seq, sink in zip(prompts, seqs, sinks, strict=True):
        tokens, logprobs = naive(model, prompt, sampling)
        assert sink.tokens == tokens
        assert [lp for lp, _ in seq.logprobs] == pytest.approx(logprobs, abs=1e-5)
    assert plain.tokens == naive(model, [3, 4], Sampling(12, 0.0))[0]
    if sampling.logit_bias == ((9, 100.0),):
        assert set(sinks[0].tokens) == {9}
    if sampling.frequency_penalty == 1.5:
        unpenalised = naive(model, prompts[0], Sampling(12, 0.0))[0]
        assert len(set(sinks[0].tokens)) > len(set(unpenalised))


def test_the_fields_openai_clients_send_by_default_are_taken(app_client):
    body = {"prompt": "ab", "max_tokens": 3, "temperature": 0, "frequency_penalty": 0,
            "presence_penalty": 0, "logit_bias": {}, "user": "someone", "best_of": 1,
            "suffix": None, "n": 1, "stream": False, "logprobs": None, "echo": False}
    r = app_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    plain = app_client.post("/v1/completions",
                            json={"prompt": "ab", "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize(("field", "value", "says"), [
    ("frequency_penalty", 2.5, "less than or equal to 2"),
    ("presence_penalty", -3, "greater than or equal to -2"),
    ("logit_bias", {"abc": 1}, "keys are token ids"),
    ("logit_bias", {"5": 101}, "between -100 and 100"),
    ("logit_bias", {"100000": 1}, "token id 100000 is outside the vocabulary"),
    ("best_of", 3, "best_of 3 differs from n 1"),
    ("suffix", "the end", "suffix"),
    ("functions", [], "unknown field 'functions'"),
])
def test_values_out_of_range_and_unknown_fields_are_refused(app_client, field, value, says):
    r = app_client.post("/v1/completions", json={"prompt": "ab", field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert says in error["message"] and error["param"].startswith(field)
