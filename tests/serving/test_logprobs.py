"""Log-probabilities on /v1/completions against a full forward pass over the same tokens
(what `tformer evaluate`'s loss is made of: tformer.evaluation.loss.lm_loss per token)."""

from __future__ import annotations

import json

import pytest
import torch

from tformer.data.tokenizers import SPECIALS
from tformer.evaluation.loss import lm_loss
from tformer.serving.scheduler import LMEngine
from tformer.serving.sequence import Sampling, Sequence

from .test_scheduler import Collect

TEXT = "the quick brown fox, jumps!"


def full_pass(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log-probabilities of the token after each position, in one plain pass."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)


def evaluate_losses(model, ids: list[int]) -> list[float]:
    """The per-token losses `tformer evaluate` sums: each token after the first."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))
        return lm_loss(logits, torch.tensor([ids[1:]]), reduction="none").flatten().tolist()


def text_of(tokenizer, token: int) -> str:
    """A token as the API shows it: special tokens (ids 0-2 here) by name."""
    return SPECIALS[token] if token < len(SPECIALS) else tokenizer.decode([token])


def complete(app_client, **body) -> dict:
    r = app_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_scoring_a_prompt_equals_the_evaluation_losses(app_client, loaded):
    ids = loaded.tokenizer.encode(TEXT)
    answer = complete(app_client, prompt=TEXT, echo=True, logprobs=3, max_tokens=0)
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids)
    losses = evaluate_losses(loaded.model, ids)
    torch.testing.assert_close(torch.tensor([-x for x in lp["token_logprobs"][1:]]),
                               torch.tensor(losses), rtol=1e-5, atol=1e-5)
    # The likeliest three (and the chosen one) as a full pass ranks them.
    want = full_pass(loaded.model, ids)
    for t in range(1, len(ids)):
        top = lp["top_logprobs"][t]
        values, best = want[t - 1].topk(3)
        expected = {text_of(loaded.tokenizer, int(i)): float(v)
                    for i, v in zip(best, values, strict=True)}
        assert set(expected) <= set(top) and len(top) <= 4
        assert lp["tokens"][t] in top
        for token, value in expected.items():
            assert top[token] == pytest.approx(value, abs=1e-5)
    assert "".join(lp["tokens"]) == TEXT
    assert lp["text_offset"] == list(range(len(ids)))  # one character a token


def test_token_id_prompts_score_as_their_text(app_client, loaded):
    ids = loaded.tokenizer.encode(TEXT)
    by_text = complete(app_client, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    by_ids = complete(app_client, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert by_ids["choices"] == by_text["choices"]
    other = loaded.tokenizer.encode("zebra")
    both = complete(app_client, prompt=[ids, other], echo=True, logprobs=0, max_tokens=0)
    assert [c["text"] for c in both["choices"]] == [TEXT, "zebra"]
    assert both["choices"][1]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [-x for x in evaluate_losses(loaded.model, other)], abs=1e-5)
    bad = app_client.post("/v1/completions", json={"prompt": [1, 999], "max_tokens": 1})
    assert bad.status_code == 400 and "token id 999 is outside the vocabulary" in (
        bad.json()["error"]["message"])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.7, "top_k": 5,
                                                          "top_p": 0.8, "seed": 3}])
def test_generated_tokens_have_the_models_own_log_probabilities(app_client, loaded, sampling):
    """Before temperature, top-k and top-p: the full pass's distribution, whatever drew."""
    prompt = loaded.tokenizer.encode("hello")
    answer = complete(app_client, prompt="hello", logprobs=2, max_tokens=8, echo=True, **sampling)
    lp = answer["choices"][0]["logprobs"]
    text = answer["choices"][0]["text"]
    by_text = {text_of(loaded.tokenizer, i): i for i in range(loaded.tokenizer.vocab_size)}
    ids = [by_text[t] for t in lp["tokens"]]
    assert ids[:5] == prompt and 5 < len(ids) <= 13  # the end of text may come first
    want = full_pass(loaded.model, ids)
    expected = [float(want[t - 1, ids[t]]) for t in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    # Without echo: the completion's tokens only, offsets counted from the prompt's end.
    plain = complete(app_client, prompt="hello", logprobs=2, max_tokens=8, **sampling)
    assert plain["choices"][0]["text"] == text[len("hello"):]
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        lp["token_logprobs"][5:], abs=1e-5)  # one prompt pass reads all positions, one not
    assert plain["choices"][0]["logprobs"]["text_offset"][0] == len("hello")


def test_a_stream_carries_the_log_probabilities(app_client, loaded):
    whole = complete(app_client, prompt="abc", logprobs=1, max_tokens=6, echo=True, temperature=0)
    with app_client.stream("POST", "/v1/completions", json={
            "prompt": "abc", "logprobs": 1, "max_tokens": 6, "echo": True, "temperature": 0,
            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == whole["choices"][0]["text"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in merged:
            merged[key] += c["choices"][0]["logprobs"][key]
    assert merged == whole["choices"][0]["logprobs"]


def test_logprobs_out_of_range_are_refused(app_client):
    for value in (-1, 21):
        r = app_client.post("/v1/completions", json={"prompt": "a", "logprobs": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_scoring_and_generating_share_one_prompt_pass(loaded):
    """Sequences that arrive together are read in one forward pass, scored or not, and each
    prompt scores as it would alone (left padding changes nothing)."""
    tok = loaded.tokenizer
    engine = LMEngine(loaded.model, eos_id=None, max_batch=8, max_waiting=8, batched=True)
    texts = ["a", "brown fox", "jumps over the lazy dog", "q", "hello there"]
    sinks = [Collect() for _ in texts]
    seqs = []
    for i, (text, sink) in enumerate(zip(texts, sinks, strict=True)):
        scoring = i % 2 == 0
        sampling = Sampling(0 if scoring else 4, 0.0, logprobs=2 if scoring else None,
                            prompt_logprobs=scoring)
        seqs.append(Sequence(tok.encode(text), sampling, sink))
    engine.submit(seqs)
    engine.start()
    try:
        assert all(sink.event.wait(30) for sink in sinks)
    finally:
        engine.stop(timeout=30)
    assert engine.stats.prefills == 1
    for seq, text in zip(seqs, texts, strict=True):
        if not seq.sampling.prompt_logprobs:
            assert seq.prompt_logprobs is None and len(seq.tokens) == 4
            continue
        ids = tok.encode(text)
        assert seq.prompt_logprobs[0] is None and not seq.tokens
        got = [lp for lp, _ in seq.prompt_logprobs[1:]]
        assert got == pytest.approx([-x for x in evaluate_losses(loaded.model, ids)]
                                    if len(ids) > 1 else [], abs=1e-5)


def test_the_end_of_text_token_is_listed_with_its_log_probability(app_client, loaded):
    """It has no text, but scoring clients count on it being there (lm-evaluation-harness
    drops the last entry as the generated token)."""
    eos = loaded.tokenizer.eos_id
    answer = complete(app_client, prompt="abc", max_tokens=3, logprobs=1, echo=True,
                      logit_bias={str(eos): 100})
    choice = answer["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "</s>"] and lp["text_offset"][-1] == 3
    assert lp["token_logprobs"][-1] == pytest.approx(0.0, abs=1e-3)  # biased by +100
