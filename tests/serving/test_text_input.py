"""A lone surrogate ("\\ud800": valid JSON, but no text UTF-8 or a tokenizer can encode) in
any text field of any route that takes a body: a 400 in OpenAI's error shape naming the
field, never a 500. The models read byte-level BPE, whose tokenizer fails on it."""

import json

import pytest
import torch
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from tformer.config import config_from_dict
from tformer.data.chat import ChatTemplate
from tformer.data.tokenizers import BPETokenizer
from tformer.registry import get_family
from tformer.serving.app import create_app
from tformer.serving.scheduler import LMEngine
from tformer.serving.translation import TranslationBatcher

BAD = "caf\ud800e"
MESSAGE = [{"role": "user", "content": BAD}]
CASES = {
    "/v1/completions": [("prompt", {"prompt": BAD}), ("prompt", {"prompt": ["ok", BAD]}),
                        ("stop", {"prompt": "ok", "stop": BAD}),
                        ("user", {"prompt": "ok", "user": BAD})],
    "/v1/chat/completions": [("messages", {"messages": MESSAGE}),
                             ("stop", {"messages": [{"role": "user", "content": "ok"}],
                                       "stop": [BAD]})],
    "/tokenize": [("prompt", {"prompt": BAD})],
    "/detokenize": [("model", {"model": BAD, "tokens": [1]})],
    "/v1/translations": [("input", {"input": ["ok", BAD]}), ("model", {"model": BAD,
                                                                        "input": ["ok"]})],
}
"""route -> (the field named, a body with a lone surrogate in it)."""


def app_of(family, **model):
    tokenizer = BPETokenizer.train(["the quick brown fox jumps over the lazy dog"] * 20, 300)
    cfg = config_from_dict({"model": {"family": family, "vocab_size": tokenizer.vocab_size,
                                      "n_layer": 1, "n_head": 2, "d_model": 16, **model}})
    torch.manual_seed(0)
    net = get_family(family).model(cfg.model).eval()
    if family == "gpt":
        engine = LMEngine(net, eos_id=tokenizer.eos_id, max_batch=4, max_waiting=8,
                          batched=True)
        return create_app(engine, tokenizer, model_name="m", kind="lm",
                          chat_template=ChatTemplate("{% for m in messages %}{{ m.content }}"
                                                     "{% endfor %}"))
    return create_app(TranslationBatcher(net, tokenizer), tokenizer, model_name="m",
                      kind="seq2seq")


@pytest.mark.parametrize("family,model", [("gpt", {"context": 32}),
                                          ("seq2seq", {"d_ff": 32, "max_len": 32})])
def test_every_route_answers_a_lone_surrogate_with_a_400(family, model):
    app = app_of(family, **model)
    routes = {r.path for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods}
    assert routes <= CASES.keys(), f"a route with a body but no case here: {routes - CASES.keys()}"
    with TestClient(app, raise_server_exceptions=False) as client:
        for route in sorted(routes):
            for field, body in CASES[route]:
                # json.dumps writes the surrogate as the escape "\ud800", as a client would.
                r = client.post(route, content=json.dumps(body),
                                headers={"content-type": "application/json"})
                assert r.status_code == 400, (route, field, r.status_code, r.text)
                error = r.json()["error"]
                assert error["param"] == field and "lone surrogate" in error["message"], error
        # ...and the same routes answer text that is text.
        ok = {"/v1/completions": {"prompt": "café", "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "café"}],
                                       "max_tokens": 2},
              "/tokenize": {"prompt": "café"}, "/detokenize": {"tokens": [1]},
              "/v1/translations": {"input": ["café"], "max_len_b": 2}}
        for route in sorted(routes):
            assert client.post(route, json=ok[route]).status_code == 200, route
