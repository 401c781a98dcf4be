"""The APIs of serving/api/ on a tiny model in this process: each one's answers against
OpenAI's chat and completions routes (an independent path to the same greedy text), its
streams against its whole answers, its error bodies; the neutral reply's tool-call events
on scripted text; and embeddings against a float64 pass of the model written out here."""

from __future__ import annotations

import base64
import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from tformer.data.chat import ChatTemplate, encode_text
from tformer.data.tokenizers import prompt_start, text_start
from tformer.decoding.embeddings import embed_ids
from tformer.serving.api.ollama import ollama_calls
from tformer.serving.turn import ArgumentsDelta, CallBegun, Finished, Reply, TextDelta

from .conftest import CHAT_TEMPLATE, tiny_checkpoint

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A tiny model whose characters are printable ASCII: enough for JSON and the tools'
    block."""
    from tformer.loading import load_checkpoint

    text = "".join(chr(c) for c in range(32, 127)) + "\n"
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("apis") / "tiny", {
        "family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "context": 1024},
        specials=True, text=text))


@pytest.fixture(scope="module")
def client(loaded):
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    engine = LMEngine(loaded.model, eos_id=loaded.tokenizer.eos_id, max_batch=8,
                      max_waiting=32, batched=True)
    app = create_app(engine, loaded.tokenizer, model_name="tiny", kind="lm",
                     chat_template=ChatTemplate(CHAT_TEMPLATE))
    with TestClient(app) as http:
        yield http


def chat_text(client, messages, max_tokens: int) -> str:
    """The greedy reply through OpenAI's chat completions: the path the others translate
    onto, answered by its own code."""
    r = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0,
                                                  "max_tokens": max_tokens})
    return r.json()["choices"][0]["message"]["content"]


def prompt_tokens(loaded, messages) -> int:
    """The rendered conversation's length, counted here from the template itself."""
    text = ChatTemplate(CHAT_TEMPLATE).render(messages, add_generation_prompt=True)
    return len(prompt_start(loaded.tokenizer, encode_text(loaded.tokenizer, text)))


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


# --- the neutral reply ------------------------------------------------------------------


class Scripted:
    """A run whose one reply is the given pieces of text, then `reason`: what Reply reads
    of a Completion, without a model."""

    def __init__(self, pieces: list[str], reason: str, stop: str | None = None) -> None:
        self.pieces, self.reason, self.piece = list(pieces), reason, ""
        self.id, self.seqs, self.errors, self.reasons = "x", [None], [None], [None]
        self.logprobs = None  # none asked for
        self.usage = {"prompt_tokens": 3, "completion_tokens": len(pieces)}
        self.choices = [SimpleNamespace(stopped=False, stop_found=stop,
                                        ready=lambda final: self.piece)]

    async def take(self):
        if self.pieces:
            self.piece = self.pieces.pop(0)
            return 0, 1
        self.piece, self.reasons[0] = "", self.reason
        return 0, None

    def finished(self) -> bool:
        return self.reasons[0] is not None

    def cancel(self) -> None:
        pass


def events_of(pieces, reason="stop", *, parallel=True, stop=None, stops=()):
    import asyncio

    reply = Reply(Scripted(pieces, reason, stop), "hermes", parallel, user_stops=list(stops))

    async def read():
        return [e async for e in reply.events()]
    return asyncio.run(read())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_reply_sends_text_then_each_call_as_it_is_written():
    text = "Let me look." + CALL
    events = events_of([text[i:i + 5] for i in range(0, len(text), 5)])
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Let me look."
    (begun,) = [e for e in events if isinstance(e, CallBegun)]
    arguments = "".join(e.text for e in events if isinstance(e, ArgumentsDelta))
    assert begun.name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    (end,) = [e for e in events if isinstance(e, Finished)]
    assert end.reason == "tool_calls" and end.content == "Let me look."
    assert [(c.id, c.name, c.arguments) for c in end.calls] == [(begun.id, "get_weather",
                                                                 arguments)]
    assert ollama_calls(end) == [{"function": {"name": "get_weather",
                                               "arguments": {"city": "Paris"}}}]


def test_without_parallel_calls_a_reply_holds_one():
    events = events_of([CALL, "\n", CALL.replace("Paris", "Rome")], parallel=False)
    assert len([e for e in events if isinstance(e, CallBegun)]) == 1
    (end,) = [e for e in events if isinstance(e, Finished)]
    assert [json.loads(c.arguments)["city"] for c in end.calls] == ["Paris"]


def test_a_call_cut_off_by_the_budget_is_neither_text_nor_a_call():
    events = events_of(["Sure. ", CALL[:40]], reason="length")
    (end,) = [e for e in events if isinstance(e, Finished)]
    assert (end.reason, end.content, end.calls) == ("length", "Sure.", [])
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Sure. "
    # A whole call before the cut one stays.
    end = [e for e in events_of([CALL, "\n", CALL[:30]], reason="length")
           if isinstance(e, Finished)][0]
    assert end.reason == "length" and [c.name for c in end.calls] == ["get_weather"]


def test_a_stop_string_of_the_request_is_named():
    (end,) = [e for e in events_of(["abc"], stop="xy", stops=["xy"])
              if isinstance(e, Finished)]
    assert (end.reason, end.stop_sequence) == ("stop_sequence", "xy")
    (end,) = [e for e in events_of(["abc"], stop=" end!") if isinstance(e, Finished)]
    assert (end.reason, end.stop_sequence) == ("stop", None)  # the template's end of turn


# --- Responses --------------------------------------------------------------------------


def test_responses_answer_as_chat_does_streamed_or_not(client, loaded):
    want = chat_text(client, USER, 6)
    body = {"input": "hello there", "temperature": 0, "max_output_tokens": 6}
    whole = client.post("/v1/responses", json=body).json()
    (item,) = whole["output"]
    assert item["content"][0]["text"] == want
    assert whole["usage"]["input_tokens"] == prompt_tokens(loaded, USER)
    assert whole["status"] in ("completed", "incomplete")
    events = sse(client.post("/v1/responses", json={**body, "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == f"response.{whole['status']}"
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.output_text.delta") == want
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == want


def test_responses_log_probabilities_are_chats(client):
    """Asked with include and top_logprobs: the entries chat completions gives for the same
    greedy reply (its own code computes them), whole and spread over the stream's deltas."""
    chat = client.post("/v1/chat/completions", json={
        "messages": USER, "temperature": 0, "max_tokens": 6, "logprobs": True,
        "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    body = {"input": "hello there", "temperature": 0, "max_output_tokens": 6,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    assert len(chat) == 6 and all(len(e["top_logprobs"]) == 2 for e in chat)

    def same(entries):  # the same tokens; log-probabilities equal up to float rounding
        flat = [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]])
                for e in entries]
        numbers = [v for e in entries for v in [e["logprob"]] + [t["logprob"]
                                                                 for t in e["top_logprobs"]]]
        return flat == [(e["token"], e["bytes"], [(t["token"], t["bytes"])
                                                  for t in e["top_logprobs"]]) for e in chat] \
            and numbers == pytest.approx([v for e in chat for v in [e["logprob"]] + [
                t["logprob"] for t in e["top_logprobs"]]], abs=1e-5)

    whole = client.post("/v1/responses", json=body).json()
    assert same(whole["output"][0]["content"][0]["logprobs"])
    events = sse(client.post("/v1/responses", json={**body, "stream": True}).text)
    assert same([e for ev in events if ev["type"] == "response.output_text.delta"
                 for e in ev["logprobs"]])
    plain = client.post("/v1/responses", json={"input": "hello there", "temperature": 0,
                                                "max_output_tokens": 2}).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []


def test_previous_response_id_continues_the_conversation(client, loaded):
    first = client.post("/v1/responses", json={
        "input": "hello there", "instructions": "be brief", "temperature": 0,
        "max_output_tokens": 4}).json()
    said = first["output"][0]["content"][0]["text"]
    second = client.post("/v1/responses", json={
        "input": "and you?", "previous_response_id": first["id"], "temperature": 0,
        "max_output_tokens": 4}).json()
    # Instructions are not carried over; the reply is.
    conversation = USER + [{"role": "assistant", "content": said},
                           {"role": "user", "content": "and you?"}]
    assert second["usage"]["input_tokens"] == prompt_tokens(loaded, conversation)
    assert second["output"][0]["content"][0]["text"] == chat_text(client, conversation, 4)
    unstored = client.post("/v1/responses", json={"input": "hi", "store": False,
                                                  "max_output_tokens": 1}).json()
    r = client.post("/v1/responses", json={"input": "x",
                                           "previous_response_id": unstored["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_a_response_cut_inside_its_call_is_incomplete_without_it(client):
    tool = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"], "additionalProperties": False}}
    body = {"input": "hi", "tools": [tool], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 40}
    whole = client.post("/v1/responses", json=body).json()
    assert (whole["status"], whole["output"]) == ("incomplete", [])
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    events = sse(client.post("/v1/responses", json={**body, "stream": True}).text)
    assert "response.output_item.added" in [e["type"] for e in events]  # the call begun
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"] == []
    # With room, the same call is whole.
    done = client.post("/v1/responses", json={**body, "max_output_tokens": 200}).json()
    (call,) = done["output"]
    assert done["status"] == "completed" and isinstance(json.loads(call["arguments"])["a"], int)


@pytest.mark.parametrize("body,param,words", [
    ({"input": 5}, "input", "valid"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type", "'image'"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools", "schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "b",
                                        "schema": {"type": "bogus"}}}},
     "text.format", "Invalid type"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens", "integer"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "nope"),
])
def test_responses_bad_input_is_a_400_naming_the_field(client, body, param, words):
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


# --- Anthropic Messages -----------------------------------------------------------------


def test_messages_answer_as_chat_does_and_stop_at_a_stop_sequence(client, loaded):
    want = chat_text(client, USER, 8)
    body = {"model": "tiny", "max_tokens": 8, "messages": USER, "temperature": 0}
    whole = client.post("/v1/messages", json=body).json()
    assert whole["content"] == [{"type": "text", "text": want}]
    assert whole["usage"]["input_tokens"] == prompt_tokens(loaded, USER)
    assert whole["stop_reason"] in ("end_turn", "max_tokens")
    count = client.post("/v1/messages/count_tokens", json={"model": "tiny",
                                                           "messages": USER}).json()
    assert count == {"input_tokens": prompt_tokens(loaded, USER)}
    events = sse(client.post("/v1/messages", json={**body, "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in events
                   if e["type"] == "content_block_delta") == want
    assert events[-2]["delta"]["stop_reason"] == whole["stop_reason"]

    stop = want[3:5]
    cut = client.post("/v1/messages", json={**body, "stop_sequences": [stop]}).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert "".join(b["text"] for b in cut["content"]) == want[:want.index(stop)]


def test_messages_render_tool_use_and_tool_result_as_chat_does(client, loaded):
    tool = {"name": "f", "input_schema": {"type": "object"}}
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "tools": [tool], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "ok"}]}]}
    openai_body = {"max_tokens": 3, "temperature": 0, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": "t1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                     {"role": "tool", "tool_call_id": "t1", "content": "ok"}]}
    ours = client.post("/v1/messages", json=body).json()
    theirs = client.post("/v1/chat/completions", json=openai_body).json()
    assert ours["usage"]["input_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["content"][0]["text"] == theirs["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body,words", [
    ({"model": "tiny", "messages": USER}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"model": "tiny", "max_tokens": 2, "messages": USER, "tools": [{"name": "f"}]},
     "input_schema"),
    ({"model": "tiny", "max_tokens": 2, "messages": USER, "tool_choice": {"type": "all"}},
     "tool_choice"),
    ({"model": "tiny", "max_tokens": "2", "messages": USER, "temperature": 3}, "temperature"),
    ({"model": "tiny", "max_tokens": 2, "messages": USER, "tool_choice": {"type": "any"},
      "tools": [{"name": "f", "input_schema": {"type": "bogus"}}]}, "Invalid type"),
])
def test_messages_bad_input_is_a_400_in_anthropics_shape(client, body, words):
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    r = client.post("/v1/messages", json={**body, "model": "other", "max_tokens": 2,
                                          "temperature": 0, "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# --- Ollama -----------------------------------------------------------------------------


def test_ollama_chat_and_generate_answer_as_the_openai_routes_do(client):
    want = chat_text(client, USER, 6)
    body = {"model": "tiny", "messages": USER, "options": {"temperature": 0,
                                                           "num_predict": 6}}
    whole = client.post("/api/chat", json={**body, "stream": False}).json()
    assert whole["message"] == {"role": "assistant", "content": want} and whole["done"]
    lines = [json.loads(line) for line in client.post("/api/chat", json=body).text.splitlines()]
    assert "".join(line["message"]["content"] for line in lines) == want
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == whole["done_reason"]

    made = client.post("/api/generate", json={"model": "tiny:latest", "prompt": "hello there",
                                              "stream": False, "options": body["options"]})
    assert made.json()["response"] == want
    raw = client.post("/api/generate", json={"model": "tiny", "prompt": "hello", "raw": True,
                                             "stream": False, "options": body["options"]})
    completion = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6,
                                                      "temperature": 0}).json()
    assert raw.json()["response"] == completion["choices"][0]["text"]


def test_ollama_options_reach_the_sampling_as_chats_fields_do(client):
    """repeat_penalty and min_p are Ollama's names for fields the sampling has: the same
    reply as chat completions with repetition_penalty and min_p."""
    r = client.post("/v1/chat/completions", json={
        "messages": USER, "temperature": 0, "max_tokens": 12, "repetition_penalty": 3.0,
        "min_p": 0.1})
    want = r.json()["choices"][0]["message"]["content"]
    assert want != chat_text(client, USER, 12)  # the penalty changes this reply
    got = client.post("/api/chat", json={"model": "tiny", "messages": USER, "stream": False,
                                         "options": {"temperature": 0, "num_predict": 12,
                                                     "repeat_penalty": 3.0, "min_p": 0.1}})
    assert got.json()["message"]["content"] == want


def test_ollama_format_json_gives_json(client):
    r = client.post("/api/chat", json={"model": "tiny", "messages": USER, "stream": False,
                                       "format": {"type": "object", "properties": {
                                           "a": {"type": "boolean"}}, "required": ["a"],
                                           "additionalProperties": False},
                                       "options": {"num_predict": 30, "seed": 1}})
    assert isinstance(json.loads(r.json()["message"]["content"])["a"], bool)


def test_ollama_cards(client):
    tags = client.get("/api/tags").json()["models"]
    assert [m["name"] for m in tags] == ["tiny"]
    assert client.get("/api/version").json()["version"]
    assert client.get("/api/ps").json()["models"][0]["name"] == "tiny"
    show = client.post("/api/show", json={"model": "tiny"}).json()
    assert show["template"] == CHAT_TEMPLATE and "tools" in show["capabilities"]


@pytest.mark.parametrize("route,body,status,words", [
    ("/api/chat", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/api/chat", {"model": "other", "messages": USER}, 404, "'other'"),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": "yaml"}, 400, "format"),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": {"type": "bogus"}}, 400,
     "Invalid type"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"num_predict": 0}}, 400,
     "num_predict"),
    ("/api/chat", {"model": "tiny", "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "none"}}]}, 400,
     "parameters"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "role"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "images": ["AAAA"]}, 400, "images"),
    ("/api/embed", {"model": "tiny", "input": [""]}, 400, "input[0]"),
])
def test_ollama_bad_input_is_an_error_in_ollamas_shape(client, route, body, status, words):
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and words in r.json()["error"], r.json()


# --- embeddings -------------------------------------------------------------------------


def reference_embedding(model, ids: list[int], pooling: str) -> np.ndarray:
    """The model's full forward pass in float64, the last block's normed states caught on
    their way to the vocabulary projection, pooled and scaled to unit length."""
    model = copy.deepcopy(model).double()
    caught = []
    model.lm_head.register_forward_hook(lambda m, inputs, out: caught.append(inputs[0]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    states = caught[0][0].numpy()
    vector = states.mean(0) if pooling == "mean" else states[-1]
    return vector / np.linalg.norm(vector)


def test_embeddings_are_the_pooled_states_on_every_route(client, loaded):
    texts = ["hello there", "the quick brown fox"]
    ids = [text_start(loaded.tokenizer, loaded.tokenizer.encode(t)) for t in texts]
    want = np.stack([reference_embedding(loaded.model, i, "mean") for i in ids])
    r = client.post("/v1/embeddings", json={"input": texts, "model": "tiny"}).json()
    floats = np.array([d["embedding"] for d in r["data"]])
    assert np.allclose(floats, want, atol=1e-5)
    assert r["usage"]["prompt_tokens"] == sum(map(len, ids))
    packed = client.post("/v1/embeddings", json={"input": texts,
                                                 "encoding_format": "base64"}).json()
    unpacked = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in packed["data"]]
    assert np.array_equal(np.stack(unpacked), floats.astype(np.float32))
    by_ids = client.post("/v1/embeddings", json={"input": ids}).json()
    assert np.allclose([d["embedding"] for d in by_ids["data"]], floats, atol=1e-6)
    ollama = client.post("/api/embed", json={"model": "tiny", "input": texts}).json()
    assert np.allclose(ollama["embeddings"], floats, atol=1e-6)
    older = client.post("/api/embeddings", json={"model": "tiny", "prompt": texts[1]}).json()
    assert np.allclose(older["embedding"], floats[1], atol=1e-6)
    # Ollama cuts a text longer than the window to it (truncate, its default); OpenAI's
    # route refuses it.
    long = "ab" * 1024
    cut = client.post("/api/embed", json={"model": "tiny", "input": long}).json()
    window = text_start(loaded.tokenizer, loaded.tokenizer.encode(long))[:1024]
    assert np.allclose(cut["embeddings"][0], reference_embedding(loaded.model, window, "mean"),
                       atol=1e-5)
    refused = client.post("/api/embed", json={"model": "tiny", "input": long,
                                              "truncate": False})
    assert refused.status_code == 400 and "1024" in refused.json()["error"]
    assert client.post("/v1/embeddings", json={"input": long}).status_code == 400
    short = client.post("/v1/embeddings", json={"input": texts[0], "dimensions": 8}).json()
    cut = want[0][:8] / np.linalg.norm(want[0][:8])
    assert np.allclose(short["data"][0]["embedding"], cut, atol=1e-5)
    last = embed_ids(loaded.model, ids, pooling="last").numpy()
    assert np.allclose(last, [reference_embedding(loaded.model, i, "last") for i in ids],
                       atol=1e-5)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "dimensions": 10_000}, "dimensions"),
    ({"input": [[1, 10**6]]}, "input"),
    ({"input": ""}, "input"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": {"text": "hi"}}, "input"),
    ({"input": ["hi"] * 2049}, "input"),
])
def test_embeddings_bad_input_is_a_400_naming_the_field(client, body, param):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_client_that_leaves_cancels_its_reply():
    import asyncio

    from tformer.serving.turn import ClientLeft

    class Endless(Scripted):
        cancelled = False

        async def take(self):
            await asyncio.sleep(3600)

        def cancel(self) -> None:
            self.cancelled = True

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    run = Endless([], "stop")
    with pytest.raises(ClientLeft):
        asyncio.run(Reply(run, None, True, user_stops=[]).collect(Gone()))
    assert run.cancelled


def test_serves_pooling_choices_are_the_poolings():
    import inspect
    import typing

    from tformer.decoding.embeddings import POOLINGS
    from tformer.serving.command import serve_command

    hint = typing.get_type_hints(serve_command, include_extras=True)["pooling"]
    (option,) = hint.__metadata__
    assert tuple(option.choices) == tuple(POOLINGS)
    assert inspect.signature(serve_command).parameters["pooling"].default == "mean"


# Every new route, with every field (at any depth) of a good body made a number or an empty
# text in turn: each answer is 200 or a 4xx, never a 5xx.
GOOD = {
    "/v1/responses": {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "x"}],
        "max_output_tokens": 2, "tool_choice": "auto", "text": {"format": {"type": "text"}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]},
    "/v1/messages": {
        "model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                        "name": "f", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                   "content": [{"type": "text",
                                                                "text": "r"}]}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}, "stop_sequences": ["x"]},
    "/api/chat": {
        "model": "tiny", "stream": False, "format": "json", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"function": {"name": "f", "arguments": {}}}]},
                     {"role": "tool", "content": "r", "tool_name": "f"}],
        "options": {"num_predict": 2, "stop": ["x"]}},
    "/api/generate": {"model": "tiny", "stream": False, "prompt": "hi", "system": "s",
                      "options": {"num_predict": 2}},
    "/api/embed": {"model": "tiny", "input": ["hi"], "dimensions": 4},
    "/v1/embeddings": {"input": ["hi"], "dimensions": 4, "encoding_format": "float"},
}


def field_paths(value, path=()):
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, inner in items:
        yield path + (key,)
        yield from field_paths(inner, path + (key,))


def with_value(body, path, value):
    body = copy.deepcopy(body)
    inner = body
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return body


def test_the_api_key_as_anthropic_and_openai_send_it(loaded):
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    engine = LMEngine(loaded.model, eos_id=loaded.tokenizer.eos_id, max_batch=2,
                      max_waiting=4, batched=True)
    app = create_app(engine, loaded.tokenizer, model_name="tiny", kind="lm", api_key="k",
                     chat_template=ChatTemplate(CHAT_TEMPLATE))
    body = {"model": "tiny", "max_tokens": 1, "messages": USER}
    with TestClient(app) as http:
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "k"}).is_success
        assert http.post("/v1/messages", json=body,
                         headers={"authorization": "Bearer k"}).is_success
        refused = http.post("/v1/messages", json=body, headers={"x-api-key": "no"})
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert http.post("/api/chat", json={**body, "messages": USER}).json() == {
            "error": "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)"}


@pytest.mark.parametrize("route", list(GOOD))
def test_no_field_of_the_wrong_type_is_a_5xx(client, route):
    assert client.post(route, json=GOOD[route]).status_code == 200
    for path in field_paths(GOOD[route]):
        for value in (5, ""):
            r = client.post(route, json=with_value(GOOD[route], path, value))
            assert r.status_code < 500, (path, value, r.text)


def test_messages_tool_choice_names_a_tool_or_none(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    body = {"model": "tiny", "max_tokens": 80, "messages": USER, "tools": [
        {"name": "f", "input_schema": schema}, {"name": "g", "input_schema": schema}]}
    named = client.post("/v1/messages", json={**body, "tool_choice": {
        "type": "tool", "name": "g"}}).json()
    assert named["stop_reason"] == "tool_use"
    assert [(b["type"], b["name"]) for b in named["content"]] == [("tool_use", "g")]
    assert 0 <= named["content"][0]["input"]["a"] <= 9
    # "none": the tools are in the prompt, and the reply is text however it reads.
    none = client.post("/v1/messages", json={**body, "max_tokens": 4,
                                             "tool_choice": {"type": "none"}}).json()
    assert [b["type"] for b in none["content"]] == ["text"]
    assert none["usage"]["input_tokens"] == named["usage"]["input_tokens"]
    responses = client.post("/v1/responses", json={
        "input": "hello there", "max_output_tokens": 80,
        "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": n, "parameters": schema} for n in "fg"]}).json()
    assert [(o["type"], o["name"]) for o in responses["output"]] == [("function_call", "f")]


LLAMA_LIKE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}\n{% endfor %}"
              "{% if tools %}<|python_tag|>{% endif %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
"""A template that takes tools and speaks of Llama 3's tag: its model's calls are JSON."""


def test_the_ollama_client_gets_a_call_with_its_arguments_as_an_object(loaded):
    """Ollama has no tool_choice; a model of Llama 3's form whose reply `format` makes a
    call's JSON shows the call read out of the reply, through the ollama client itself,
    streamed and not."""
    ollama = pytest.importorskip("ollama")
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    engine = LMEngine(loaded.model, eos_id=loaded.tokenizer.eos_id, max_batch=2,
                      max_waiting=4, batched=True)
    app = create_app(engine, loaded.tokenizer, model_name="tiny", kind="lm",
                     chat_template=ChatTemplate(LLAMA_LIKE))
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                  "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    call = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                             "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}
    ask = dict(model="tiny", messages=USER, tools=[tool], format=call,
               options={"num_predict": 200, "seed": 3})
    with TestClient(app) as http:
        client = ollama.Client(host="http://testserver")
        client._client = http  # its requests, to the app in this process
        whole = client.chat(**ask)
        (made,) = whole.message.tool_calls
        assert made.function.name == "get_weather" and whole.message.content == ""
        assert set(made.function.arguments) == {"city"}
        pieces = list(client.chat(**ask, stream=True))
        calls = [c for p in pieces for c in (p.message.tool_calls or [])]
        assert [c.function for c in calls] == [made.function]
        assert pieces[-1].done and pieces[-1].done_reason == "stop"


def test_a_responses_stream_whose_call_does_not_parse_ends_as_text():
    """The call's name went out as an item, but the reply never closed it: the item leaves
    the output and the whole reply is the message's text, its deltas joined."""
    import asyncio

    from tformer.serving.api.responses import Answer, ResponsesRequest, Store, stream

    pieces = ["Hi ", '<tool_call>\n{"name": "f", "arguments": {"a": 1}', " oops"]
    reply = Reply(Scripted(pieces, "stop"), "hermes", True, user_stops=[])
    answer = Answer(ResponsesRequest(input="x"), SimpleNamespace(model_name="m"))

    async def read():
        return [e async for e in stream(reply, answer, Store(), [])]
    events = sse("".join(asyncio.run(read())))
    assert "response.output_item.added" in [e["type"] for e in events]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "".join(pieces)
    (item,) = events[-1]["response"]["output"]
    assert events[-1]["type"] == "response.completed"
    assert item["type"] == "message" and item["content"][0]["text"] == "".join(pieces)
