"""Strict schemas on the real SmolLM2-135M-Instruct (its Q4_1 GGUF, imported once a
session), served in this process and asked through the openai client at temperature 0 and
1: a number field ends (the model would otherwise write digits until max_tokens), and a
named tool call whose schema does not say additionalProperties: false still takes only its
parameters' keys."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")
pytest.importorskip("gguf")


class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"}},
        "required": ["city"]}}}  # other keys not refused by the schema itself


@pytest.fixture(scope="module")
def client(smollm2_run):
    from fastapi.testclient import TestClient

    from tformer.data.chat import template_of
    from tformer.loading import load_checkpoint
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    held = load_checkpoint(smollm2_run)
    # Every request reads its prompt cold: with the prefix cache a later request reads the
    # rest of the same prompt as a shorter chunk, through other kernels (the same logits to
    # rounding), and a sample at temperature 1 would then depend on the tests' order.
    engine = LMEngine(held.model, eos_id=list(held.tokenizer.eos_ids), max_batch=2,
                      max_waiting=4, batched=True, prefix_cache=False)
    app = create_app(engine, held.tokenizer, model_name="smollm2", kind="lm",
                     chat_template=template_of(held.tokenizer))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                            max_retries=0)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 1)])
def test_parse_of_a_model_with_a_number_returns_the_object(client, temperature, seed):
    # Without the bound on digits this prompt writes the population's digits (at 0) or
    # keys beyond the model's (at 1) until max_tokens.
    ask = "Tell me about Paris as JSON."
    choice = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": ask}], response_format=City,
        temperature=temperature, seed=seed, max_tokens=80).choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    city = choice.message.parsed
    assert isinstance(city, City), choice.message.content
    assert abs(city.population_millions) <= 10**15


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 1)])
def test_a_named_tool_call_takes_only_its_schemas_keys(client, temperature, seed):
    choice = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is it raining in Lyon?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=temperature, seed=seed, max_tokens=80).choices[0]
    assert choice.finish_reason != "length", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
