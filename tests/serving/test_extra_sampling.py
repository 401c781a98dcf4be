"""The sampling fields beyond OpenAI's that vLLM and llama.cpp's server take (min_p,
repetition_penalty, min_tokens, ignore_eos) through the server: each drawn text against a
full forward pass per token with the rule written out in float64, the lengths min_tokens and
ignore_eos make, and bad values refused naming the field."""

from __future__ import annotations

import pytest
import torch

from tformer.data.chat import ChatTemplate

PROMPT = [5, 6, 7, 5, 6]


def full_pass(model, ids: list[int]) -> torch.Tensor:
    """The next token's logits after `ids`, in float64, from one pass over all of them."""
    with torch.no_grad():
        return model(torch.tensor([ids])).double()[0, -1]


def tokens_of(tok, text: str) -> list[int]:
    return tok.encode(text)  # one character, one token


def complete(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_repetition_penalty_draws_the_argmax_of_the_penalised_logits(app_client, loaded):
    model, tok = loaded.model, loaded.tokenizer
    penalty = 1.8
    text = complete(app_client, max_tokens=12, temperature=0,
                    repetition_penalty=penalty)["choices"][0]["text"]
    tokens = tokens_of(tok, text)
    expected: list[int] = []
    for _ in range(12):
        logits = full_pass(model, PROMPT + expected)
        for t in set(PROMPT + expected):  # the prompt's tokens and the text's, once each
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        token = int(logits.argmax())
        if token == tok.eos_id:
            break
        expected.append(token)
    assert tokens == expected
    plain = complete(app_client, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert plain != text  # the penalty is not a no-op on this model


def test_min_p_draws_only_tokens_min_p_times_as_likely_as_the_likeliest(app_client, loaded):
    model, tok = loaded.model, loaded.tokenizer
    min_p, temperature = 0.2, 1.5
    widest = 0
    for seed in range(4):
        text = complete(app_client, max_tokens=10, temperature=temperature, min_p=min_p,
                        seed=seed)["choices"][0]["text"]
        so_far = list(PROMPT)
        for token in tokens_of(tok, text):
            probs = torch.softmax(full_pass(model, so_far) / temperature, dim=-1)
            kept = (probs >= min_p * probs.max()).nonzero().flatten().tolist()
            assert token in kept
            widest = max(widest, len(kept))
            so_far.append(token)
    assert widest > 1  # the rule left a choice, and the draws stayed inside it
    greedy = complete(app_client, max_tokens=10, temperature=0)["choices"][0]["text"]
    only_best = complete(app_client, max_tokens=10, temperature=1.0, min_p=1.0, seed=1)
    assert only_best["choices"][0]["text"] == greedy


def test_min_tokens_holds_the_end_back_and_ignore_eos_runs_to_max_tokens(app_client, loaded):
    eos = {str(loaded.tokenizer.eos_id): 100}  # a model that would end at once
    ends = complete(app_client, max_tokens=8, temperature=0, logit_bias=eos)
    assert ends["usage"]["completion_tokens"] == 0
    assert ends["choices"][0]["finish_reason"] == "stop"
    held = complete(app_client, max_tokens=8, temperature=0, logit_bias=eos, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 5
    assert len(held["choices"][0]["text"]) == 5
    assert held["choices"][0]["finish_reason"] == "stop"
    ignored = complete(app_client, max_tokens=7, temperature=0, logit_bias=eos,
                       ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == 7
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["choices"][0]["text"] == ""  # the end token, drawn 7 times, is no text


def test_chat_honours_min_tokens_and_ignore_eos(loaded):
    """A template whose turns end at the end-of-text token: the reply's end of turn."""
    from fastapi.testclient import TestClient

    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    tok = loaded.tokenizer
    engine = LMEngine(loaded.model, eos_id=tok.eos_id, max_batch=4, max_waiting=8,
                      batched=True)
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{{ eos_token }}"
                            "{% endfor %}", special_tokens={"eos_token": "</s>"})
    app = create_app(engine, tok, model_name="m", kind="lm", chat_template=template)
    body = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0,
            "max_tokens": 6, "logit_bias": {str(tok.eos_id): 100}}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        plain = r.json()
        held = client.post("/v1/chat/completions", json={**body, "min_tokens": 4}).json()
        ignored = client.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json()
    assert plain["usage"]["completion_tokens"] == 0
    assert held["usage"]["completion_tokens"] == 4
    assert held["choices"][0]["finish_reason"] == "stop"
    assert ignored["usage"]["completion_tokens"] == 6
    assert ignored["choices"][0]["finish_reason"] == "length"


def test_the_fields_vllms_benchmark_sends_are_taken(app_client):
    r = app_client.post("/v1/completions", json={
        "prompt": "ab", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "min_tokens": 0, "min_p": 0.0, "repetition_penalty": 1.0, "stream": True})
    assert r.status_code == 200, r.text
    assert "[DONE]" in r.text


@pytest.mark.parametrize(("field", "value", "says"), [
    ("min_p", 1.5, "less than or equal to 1"),
    ("min_p", -0.5, "greater than or equal to 0"),
    ("repetition_penalty", 0, "greater than 0"),
    ("min_tokens", -1, "greater than or equal to 0"),
    ("min_tokens", 20, "min_tokens 20 is more than the 16 tokens max_tokens allows"),
    ("ignore_eos", [1], "valid boolean"),
    ("repeat_penalty", 1.1, "unknown field 'repeat_penalty'"),
])
def test_bad_values_are_a_400_naming_the_field(app_client, field, value, says):
    r = app_client.post("/v1/completions", json={"prompt": "ab", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["param"].startswith(field)


def test_a_model_whose_memory_is_its_cache_refuses_them_naming_each(tmp_path):
    from fastapi.testclient import TestClient

    from tformer.loading import load_checkpoint
    from tformer.registry import get_family
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    from .conftest import tiny_checkpoint

    txl = load_checkpoint(tiny_checkpoint(tmp_path / "txl", {
        "family": "transformer-xl", "n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32,
        "context": 8, "mem_len": 8}))
    engine = LMEngine(txl.model, eos_id=None, max_batch=2, max_waiting=4, batched=False,
                      generate=get_family("transformer-xl").generate)
    app = create_app(engine, txl.tokenizer, model_name="txl", kind="lm")
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}
                           ).status_code == 200
        for field, value in [("min_p", 0.1), ("repetition_penalty", 1.3), ("min_tokens", 1),
                             ("ignore_eos", True)]:
            r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2,
                                                     field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field
            assert "decoded with a KV cache" in r.json()["error"]["message"]
