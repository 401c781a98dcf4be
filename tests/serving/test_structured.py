"""Structured outputs and tool calls through the clients people use, against a real
`tformer serve` on a tiny model whose characters can write JSON; and 200 random JSON
schemas, each followed by a text drawn at temperature 1 in the engine's batched steps."""

from __future__ import annotations

import json
import random
import threading
from typing import Literal

import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, Field  # noqa: E402

from .conftest import Server, tiny_checkpoint  # noqa: E402

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
"""A turn ends with the end-of-text token: one token, so a reply ends at it."""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Item(BaseModel):
    name: str = Field(max_length=10)
    count: int = Field(ge=0, le=99)
    kind: Literal["a", "b"]
    flags: list[bool] = Field(max_length=3)


@pytest.fixture(scope="session")
def json_checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("json") / "tiny-json", {
        "family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "context": 2048},
        specials=True, text=CHARS)


@pytest.fixture(scope="module")
def client(json_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    server = Server(json_checkpoint, "--max-batch", "8", "--chat-template", str(path))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.stop()


def test_parse_with_a_pydantic_model_returns_the_object(client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="tiny-json", messages=ASK, response_format=Item, temperature=1.0,
            seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Item), choice.message.content


def test_json_schema_and_json_object_streamed_and_on_completions(client):
    schema = Item.model_json_schema()
    stream = client.chat.completions.create(
        model="tiny-json", messages=ASK, stream=True, temperature=1.0, seed=4,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "item", "schema": schema, "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Item.model_validate_json(text)
    done = client.completions.create(model="tiny-json", prompt="{", max_tokens=1500, n=3,
                                     seed=1, extra_body={"response_format":
                                                         {"type": "json_object"}})
    for choice in done.choices:
        assert isinstance(json.loads(choice.text), dict) and choice.finish_reason == "stop"


def test_vllms_structured_outputs_regex_choice_and_grammar(client):
    def text(**spec):
        done = client.completions.create(model="tiny-json", prompt="x", max_tokens=50,
                                         seed=2, extra_body={"structured_outputs": spec})
        assert done.choices[0].finish_reason == "stop"
        return done.choices[0].text

    import re

    assert re.fullmatch(r"[a-f]{2}-[0-9]{3}", text(regex=r"[a-f]{2}-[0-9]{3}"))
    assert text(choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    assert text(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]/') .startswith("(")
    assert re.fullmatch(r"\[[0-9](;[0-9])*\]", text(grammar='root ::= "[" d (";" d)* "]"\n'
                                                        'd ::= [0-9]'))
    assert isinstance(json.loads(text(json={"type": "array", "maxItems": 2,
                                            "items": {"type": "integer"}})), list)


def test_what_cannot_be_compiled_is_a_400_naming_why(client):
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "bogus"}}}
    with pytest.raises(openai.BadRequestError, match="Invalid type"):
        client.chat.completions.create(model="tiny-json", messages=ASK, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="look-around"):
        client.completions.create(model="tiny-json", prompt="x", extra_body={
            "structured_outputs": {"regex": "(?<=a)b"}})
    with pytest.raises(openai.BadRequestError, match="not one of text, json_object"):
        client.chat.completions.create(model="tiny-json", messages=ASK,
                                       response_format={"type": "yaml"})
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="tiny-json", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})


def check_call(name: str, arguments: str) -> None:
    (tool,) = [t for t in TOOLS if t["function"]["name"] == name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def answer_with_results(client, message, calls, **kwargs):
    """The client's side of the loop: each call's result sent back as a tool message."""
    messages = [*ASK, message] + [
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temp_c": 21})}
        for call_id in calls]
    return client.chat.completions.create(model="tiny-json", messages=messages, tools=TOOLS,
                                          max_tokens=20, **kwargs)


def calls_of(reply, stream: bool) -> tuple[list[dict], str | None, str]:
    """A reply's tool calls (id, name, arguments), its finish reason and its text, from one
    answer or from the chunks of a stream (delta.tool_calls pieces gathered by index)."""
    if not stream:
        choice = reply.choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason, choice.message.content or ""
    gathered: dict[int, dict] = {}
    reason, text = None, ""
    for chunk in reply:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reason = chunk.choices[0].finish_reason or reason
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            call = gathered.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    return [gathered[i] for i in sorted(gathered)], reason, text


@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_loop_with_the_openai_client(client, named, stream):
    """The model calls a tool (the one named, or any: required), the client sends the
    result back as a tool message, and the model answers."""
    choice = ({"type": "function", "function": {"name": "get_weather"}} if named
              else "required")
    reply = client.chat.completions.create(model="tiny-json", messages=ASK, tools=TOOLS,
                                           tool_choice=choice, stream=stream, seed=3,
                                           parallel_tool_calls=False)
    calls, reason, text = calls_of(reply, stream)
    assert reason == "tool_calls" and text == "" and len(calls) == 1
    (call,) = calls
    assert call["id"].startswith("call_")
    assert call["name"] == "get_weather" or (not named and call["name"] in ("get_time",))
    check_call(call["name"], call["arguments"])
    message = {"role": "assistant", "content": None, "tool_calls": [{
        "id": call["id"], "type": "function",
        "function": {"name": call["name"], "arguments": call["arguments"]}}]}
    answer = answer_with_results(client, message, [call["id"]], tool_choice="none",
                                 stream=stream)
    calls, reason, text = calls_of(answer, stream)
    assert not calls and reason in ("stop", "length") and isinstance(text, str)


def test_the_calls_and_results_are_rendered_on_the_next_turn(client):
    done = client.chat.completions.create(
        model="tiny-json", messages=ASK, tools=TOOLS, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls  # a named function is called once
    assert call.type == "function" and call.function.name == "get_weather"
    # The reply goes back as the client returned it (a ChatCompletionMessage).
    reply = answer_with_results(client, choice.message, [call.id], tool_choice="none")
    assert reply.choices[0].message.tool_calls is None
    # The call and its result are in the prompt (one character a token).
    alone = client.chat.completions.create(model="tiny-json", messages=ASK, tools=TOOLS,
                                           tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens + len(
        call.function.arguments) + len('{"temp_c": 21}')
    # "none" forbids calls, not the knowledge of the tools: they are in its prompt too.
    auto = client.chat.completions.create(model="tiny-json", messages=ASK, tools=TOOLS,
                                          tool_choice="auto", max_tokens=1)
    bare = client.chat.completions.create(model="tiny-json", messages=ASK, max_tokens=1)
    assert alone.usage.prompt_tokens == auto.usage.prompt_tokens > bare.usage.prompt_tokens


def test_parallel_tool_calls_may_be_several(client):
    counts = set()
    for seed in range(6):
        done = client.chat.completions.create(model="tiny-json", messages=ASK, tools=TOOLS,
                                              tool_choice="required", seed=seed)
        calls = done.choices[0].message.tool_calls
        for call in calls:
            check_call(call.function.name, call.function.arguments)
        counts.add(len(calls))
    assert min(counts) >= 1 and max(counts) > 1, counts


def test_messages_as_clients_send_them(client):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "name": "ada", "content": [{"type": "text", "text": "hi"},
                                                         {"type": "text", "text": "there"}]},
             {"role": "developer", "content": "Answer."}]
    done = client.chat.completions.create(model="tiny-json", messages=parts, max_tokens=3)
    assert done.choices[0].message.role == "assistant"
    image = [{"role": "user", "content": [{"type": "image_url",
                                           "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="'image_url'"):
        client.chat.completions.create(model="tiny-json", messages=image)
    with pytest.raises(openai.BadRequestError, match="unknown role 'wizard'"):
        client.chat.completions.create(model="tiny-json", messages=[
            {"role": "wizard", "content": "hi"}])


# --- 200 random schemas in the engine's batched steps -----------------------------------


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "number", "string", "boolean", "enum", "null"]
    if depth < 3:
        kinds += ["object", "array"] * 2
    kind = rng.choice(kinds)
    if kind == "object":
        props = {f"{rng.choice('abcxyz')}{i}": random_schema(rng, depth + 1)
                 for i in range(rng.randint(1, 3))}
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [p for p in props if rng.random() < 0.7]}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.randint(-20, 20) / 4
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 40)}
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "a b", 1, 2.5, None, True], rng.randint(1, 4))}
    return {"type": kind}


def test_two_hundred_random_schemas_are_followed_at_temperature_one(json_checkpoint):
    from tformer.decoding.constraints import Constraint, compile_grammar
    from tformer.loading import load_checkpoint
    from tformer.serving.scheduler import LMEngine
    from tformer.serving.sequence import Sampling, Sequence

    loaded = load_checkpoint(json_checkpoint)
    tok = loaded.tokenizer
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(200)]
    engine = LMEngine(loaded.model, eos_id=tok.eos_id, max_batch=16, max_waiting=256,
                      batched=True)
    results: dict[int, list] = {i: [] for i in range(len(schemas))}
    done = threading.Semaphore(0)

    def deliver(i):
        def take(token, reason):
            if token is None:
                results[i].append(reason)
                done.release()
            else:
                results[i].append(token)
        return take

    seqs = [Sequence(tok.encode("{"), Sampling(
        600, temperature=1.0, seed=i,
        constraint=compile_grammar(tok, Constraint.json_schema(schema), tok.vocab_size)),
        deliver(i)) for i, schema in enumerate(schemas)]
    engine.start()
    try:
        assert engine.submit(seqs)
        for _ in seqs:
            assert done.acquire(timeout=120)
    finally:
        engine.stop(10)
    kinds = set()
    for i, schema in enumerate(schemas):
        *tokens, reason = results[i]
        text = tok.decode(tokens)
        assert reason == "stop", (schema, text)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        kinds.add(type(value).__name__)
    assert {"dict", "list"} <= kinds
