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
from tformer.serving.translation import TranslationEngine

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
USER = [{"role": "user", "content": "ok"}]
CASES |= {
    "/v1/responses": [("input", {"input": BAD}), ("instructions", {"input": "ok",
                                                                   "instructions": BAD})],
    "/v1/messages": [("messages", {"model": "m", "max_tokens": 2, "messages": MESSAGE}),
                     ("system", {"model": "m", "max_tokens": 2, "messages": USER,
                                 "system": BAD})],
    "/v1/messages/count_tokens": [("messages", {"model": "m", "messages": MESSAGE})],
    "/api/chat": [("messages", {"model": "m", "messages": MESSAGE})],
    "/api/generate": [("prompt", {"model": "m", "prompt": BAD})],
    "/api/embed": [("input", {"model": "m", "input": [BAD]})],
    "/api/embeddings": [("prompt", {"model": "m", "prompt": BAD})],
    "/api/show": [("model", {"model": BAD})],
    "/v1/embeddings": [("input", {"input": BAD})],
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
    return create_app(TranslationEngine(net, tokenizer), tokenizer, model_name="m",
                      kind="seq2seq")


def error_of(body: dict) -> tuple[str | None, str]:
    """(param, message) of an error body in any of the server's APIs' shapes: OpenAI's
    {"error": {"message", "param"}}, Anthropic's {"type": "error", "error": {"type",
    "message"}}, Ollama's {"error": message}."""
    error = body["error"]
    if isinstance(error, str):
        return None, error
    return error.get("param"), error["message"]


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
                param, message = error_of(r.json())
                assert param in (field, None) and "lone surrogate" in message, r.json()
                assert message.startswith(f"{field}:"), message
        # ...and the same routes answer text that is text.
        ok = {"/v1/completions": {"prompt": "café", "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "café"}],
                                       "max_tokens": 2},
              "/tokenize": {"prompt": "café"}, "/detokenize": {"tokens": [1]},
              "/v1/translations": {"input": ["café"], "max_len_b": 2},
              "/v1/responses": {"input": "café", "max_output_tokens": 2},
              "/v1/messages": {"model": "m", "max_tokens": 2, "messages": USER},
              "/v1/messages/count_tokens": {"model": "m", "messages": USER},
              "/api/chat": {"model": "m", "messages": USER, "stream": False,
                            "options": {"num_predict": 2}},
              "/api/generate": {"model": "m", "prompt": "café", "stream": False,
                                "options": {"num_predict": 2}},
              "/api/embed": {"model": "m", "input": "café"}, "/api/show": {"model": "m"},
              "/api/embeddings": {"model": "m", "prompt": "café"},
              "/v1/embeddings": {"input": "café"}}
        for route in sorted(routes):
            assert client.post(route, json=ok[route]).status_code == 200, route
