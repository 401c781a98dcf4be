"""The real SmolLM2 served over HTTP (uvicorn in this process, on a free port), asked
through the clients that speak the server's other APIs: openai's Responses (a function
tool, streamed and not, previous_response_id, parse), anthropic's Messages (a tool_use
round trip, created and streamed), ollama's (chat, format, a tool call, embed, list), the
openai-agents SDK running an agent with one function tool to its end, and embeddings that
are the same vectors on every route and in the Python API, and that rank a paraphrase
above an unrelated sentence."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("gguf")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
pydantic = pytest.importorskip("pydantic")

MODEL = "smollm2"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def loaded(smollm2_run):
    """The model as the Python API loads it (its Q4_1 blocks kept), served below too."""
    import tformer

    return tformer.load(smollm2_run, device="cpu", threads=1)


@pytest.fixture(scope="module")
def url(loaded):
    import uvicorn

    from tformer.data.chat import template_of
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    engine = LMEngine(loaded.module, eos_id=list(loaded.tokenizer.eos_ids), max_batch=4,
                      max_waiting=8, batched=True)
    app = create_app(engine, loaded.tokenizer, model_name=MODEL, kind="lm",
                     chat_template=template_of(loaded.tokenizer))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def together(*calls):
    """The calls' results, the calls made at once from threads (the engine batches them)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_responses_with_a_function_tool_streamed_and_not_and_continued(oai):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": PARAMETERS}
    ask = dict(model=MODEL, tools=[tool], tool_choice="required", parallel_tool_calls=False,
               temperature=0, max_output_tokens=40)
    # Requests sent together are decoded together: the time of one.
    done, events = together(lambda: oai.responses.create(input=ASK, **ask),
                            lambda: list(oai.responses.create(input=ASK, stream=True, **ask)))
    (call,) = done.output
    assert done.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"

    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments

    # The tool's answer, continuing the stored response, reads as the same conversation
    # spelled out in full: its prompt is as many tokens.
    answer = {"type": "function_call_output", "call_id": call.call_id,
              "output": "18 degrees and sunny"}
    more = dict(model=MODEL, tools=[tool], temperature=0, max_output_tokens=4)
    follow, whole = together(
        lambda: oai.responses.create(previous_response_id=done.id, input=[answer], **more),
        lambda: oai.responses.create(input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments}, answer], **more))
    assert follow.usage.input_tokens == whole.usage.input_tokens > done.usage.input_tokens
    assert follow.output_text == whole.output_text and follow.output_text
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(previous_response_id="resp_missing", input="hi", model=MODEL)


def test_responses_parse_with_a_pydantic_text_format(oai):
    class City(pydantic.BaseModel):
        name: str
        country: str

    parsed = oai.responses.parse(model=MODEL, temperature=0, max_output_tokens=40,
                                 input="Name the capital of France and its country, as JSON.",
                                 text_format=City)
    assert isinstance(parsed.output_parsed, City) and "Paris" in parsed.output_parsed.name


def test_anthropic_messages_tool_use_round_trip_created_and_streamed(url):
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": PARAMETERS}
    ask = [{"role": "user", "content": ASK}]
    greedy = {"temperature": 0}  # this SDK's create() no longer names it
    common = dict(model=MODEL, max_tokens=40, extra_body=greedy, tools=[tool],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    def streamed_message():
        with client.messages.stream(messages=ask, **common) as stream:
            return stream.get_final_message()

    message, streamed = together(lambda: client.messages.create(messages=ask, **common),
                                 streamed_message)
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    assert streamed.stop_reason == "tool_use" and streamed.content[0].input == use.input

    reply = client.messages.create(model=MODEL, max_tokens=6, extra_body=greedy, tools=[tool],
                                   messages=ask + [
                                       {"role": "assistant", "content": message.content},
                                       {"role": "user", "content": [{
                                           "type": "tool_result", "tool_use_id": use.id,
                                           "content": "18 degrees and sunny"}]}])
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    count = client.messages.count_tokens(model=MODEL, messages=ask, tools=[tool])
    assert count.input_tokens == message.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="input_schema"):
        client.messages.create(model=MODEL, max_tokens=5, messages=ask,
                               tools=[{"name": "get_weather"}])


def test_ollama_chat_format_tools_embed_and_list(url):
    client = ollama.Client(host=url)
    assert [m.model for m in client.list().models] == [MODEL]
    ask = [{"role": "user", "content": "Say hello to Tom."}]
    options = {"temperature": 0, "num_predict": 4}
    whole, pieces = together(
        lambda: client.chat(model=MODEL, messages=ask, options=options),
        lambda: list(client.chat(model=MODEL, messages=ask, options=options, stream=True)))
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert pieces[-1].done and pieces[-1].eval_count == whole.eval_count

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["name", "country"], "additionalProperties": False}
    # A tool call made earlier (its arguments an object) and the tool's answer (naming the
    # tool) read as the same conversation sent to OpenAI's chat completions. (The ollama
    # client sends a schema's type, properties and required only.)
    plain = {"type": "object", "properties": {"city": {"type": "string"}},
             "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather",
                                             "description": "The weather in a city",
                                             "parameters": plain}}
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "",
                                                   "tool_calls": [{"function": {
                                                       "name": "get_weather",
                                                       "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}]
    as_openai = [history[0], {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 degrees and sunny"}]
    chat = openai.OpenAI(base_url=url + "/v1", api_key="x").chat.completions
    formatted, answered, theirs = together(
        lambda: client.chat(model=MODEL, format=schema,
                            options={"temperature": 0, "num_predict": 40},
                            messages=[{"role": "user",
                                       "content": "Name the capital of France, as JSON."}]),
        lambda: client.chat(model=MODEL, tools=[tool], messages=history,
                            options={"temperature": 0, "num_predict": 2}),
        lambda: chat.create(model=MODEL, tools=[tool], max_tokens=2, temperature=0,
                            messages=as_openai))
    assert set(json.loads(formatted.message.content)) == {"name", "country"}
    assert answered.prompt_eval_count == theirs.usage.prompt_tokens
    assert answered.message.content == theirs.choices[0].message.content


def test_the_same_embedding_on_every_route_and_it_ranks_a_paraphrase_first(url, oai,
                                                                           loaded):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.",
             "Stock markets fell sharply today."]
    by_openai = np.array([d.embedding for d in oai.embeddings.create(model=MODEL,
                                                                     input=texts).data])
    by_ollama = np.array(ollama.Client(host=url).embed(model=MODEL, input=texts).embeddings)
    by_python = loaded.embed(texts).numpy()
    assert np.allclose(by_openai, by_ollama, atol=1e-6)
    assert np.allclose(by_openai, by_python, atol=1e-5)
    similar = by_openai @ by_openai.T
    assert np.allclose(np.diag(similar), 1, atol=1e-5)
    assert similar[0, 1] > similar[0, 2] and similar[0, 1] > similar[1, 2]


def test_an_openai_agent_with_a_function_tool_runs_to_its_end(url):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return f"18 degrees and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="weather", tools=[get_weather],
        instructions="Use the tools you have, then answer in one short sentence.",
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        # The tool is required on the first turn; the SDK then sets it back to auto.
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=60))
    result = agents.Runner.run_sync(agent, ASK, max_turns=4)
    assert asked and set(asked) == {"Paris"}  # the small model may ask twice
    assert isinstance(result.final_output, str) and result.final_output
