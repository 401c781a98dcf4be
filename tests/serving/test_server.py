"""The real server, in a subprocess on 127.0.0.1, called with httpx and the openai client."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

PROMPTS = ["hello", "a", "the quick brown fox", "zz", "serve me", "q", "lorem ipsum", "!"]


def complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(url: str, **body) -> tuple[list[dict], list[str]]:
    """The stream's JSON chunks and its raw data lines."""
    chunks, lines = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line[6:] != "[DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks, lines


def test_models_and_health(gpt_server):
    models = httpx.get(gpt_server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-gpt"]
    assert httpx.get(gpt_server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(gpt_server.url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = [line for line in metrics.text.splitlines() if not line.startswith("#")]
    names = {line.split("{")[0].split(" ")[0] for line in samples}
    assert {"tformer_requests_total", "tformer_tokens_per_second",
            "tformer_queue_length", "tformer_kv_blocks_used", "tformer_kv_blocks_free",
            "tformer_time_to_first_token_seconds_bucket",
            "tformer_time_between_tokens_seconds_count"} <= names
    for line in samples:  # name{labels} value, the value a number
        float(line.rsplit(" ", 1)[1])


def test_every_kv_block_is_used_free_or_cached(gpt_server):
    """The three gauges add up to the pool, before and after a text whose full blocks the
    prefix cache keeps once it is done."""
    def blocks():
        lines = httpx.get(gpt_server.url + "/metrics").text.splitlines()
        return {line.split(" ")[0].removeprefix("tformer_kv_blocks_"): int(line.split(" ")[1])
                for line in lines if line.startswith("tformer_kv_blocks_")}

    before = blocks()
    complete(gpt_server.url, prompt="hello there", max_tokens=40, temperature=0.0)
    after = blocks()
    assert set(after) == {"used", "free", "cached"}
    assert sum(after.values()) == sum(before.values())
    assert after["used"] == 0 and after["cached"] >= before["cached"] + 2


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.9, "top_k": 12, "seed": 7}])
def test_streamed_chunks_concatenate_to_the_whole_text(gpt_server, sampling):
    body = {"prompt": "hello", "max_tokens": 30, "n": 2, **sampling}
    whole = complete(gpt_server.url, **body)
    chunks, lines = stream_chunks(gpt_server.url, **body)
    assert lines[-1] == "[DONE]"
    for choice in whole["choices"]:
        pieces = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(p["text"] for p in pieces) == choice["text"]
        assert pieces[-1]["finish_reason"] == choice["finish_reason"] == "length"
        assert len(pieces) > 5  # streamed as it was made, not in one piece
    assert whole["usage"] == {"prompt_tokens": 10, "completion_tokens": 60, "total_tokens": 70}
    if sampling["temperature"] > 0:
        texts = [c["text"] for c in whole["choices"]]
        assert texts[0] != texts[1]  # the n choices draw with seeds seed, seed + 1
        again = complete(gpt_server.url, **body)
        assert [c["text"] for c in again["choices"]] == texts


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {name: float(value) for name, value in (
        line.split(" ") for line in text.splitlines()
        if line.startswith("tformer_") and "{" not in line)}


def test_eight_concurrent_greedy_requests_equal_one_by_one(gpt_server):
    body = {"max_tokens": 40, "temperature": 0.0}
    one_by_one = [complete(gpt_server.url, prompt=p, **body)["choices"][0]["text"]
                  for p in PROMPTS]
    # Eight clients, each connected already, send at the same moment: a tiny model decodes
    # 40 tokens in tens of milliseconds, about what opening eight connections one after
    # another takes on a busy host, and requests that do not overlap share no steps.
    clients = [httpx.Client(base_url=gpt_server.url, timeout=60) for _ in PROMPTS]
    for client in clients:
        assert client.get("/health").status_code == 200
    start = threading.Barrier(len(PROMPTS))

    def send(client: httpx.Client, prompt: str) -> str:
        start.wait()
        r = client.post("/v1/completions", json={"prompt": prompt, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    before = counters(gpt_server.url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(send, clients, PROMPTS))
    after = counters(gpt_server.url)
    for client in clients:
        client.close()
    assert together == one_by_one
    assert len(set(one_by_one)) > 4
    # They shared decoding steps: far fewer steps than tokens.
    steps = after["tformer_decoding_steps_total"] - before["tformer_decoding_steps_total"]
    tokens = after["tformer_generated_tokens_total"] - before["tformer_generated_tokens_total"]
    assert tokens == 8 * 40 and steps < tokens / 2


def test_stop_echo_and_a_list_of_prompts(gpt_server):
    full = complete(gpt_server.url, prompt="hello", max_tokens=30, temperature=0.0)
    text = full["choices"][0]["text"]
    stop = text[10:12]
    cut = text[: text.index(stop)]
    got = complete(gpt_server.url, prompt=["hello", "a"], max_tokens=30, temperature=0.0,
                   stop=[stop], echo=True)
    assert got["choices"][0]["text"] == "hello" + cut
    assert got["choices"][0]["finish_reason"] == "stop"
    chunks, _ = stream_chunks(gpt_server.url, prompt="hello", max_tokens=30, temperature=0.0,
                              stop=stop, stream_options={"include_usage": True})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == cut
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 5


def test_the_openai_client(gpt_server):
    client = openai.OpenAI(base_url=gpt_server.url + "/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="tiny-gpt", prompt="serve me", max_tokens=25,
                                      temperature=0, seed=1)
    stream = client.completions.create(model="tiny-gpt", prompt="serve me", max_tokens=25,
                                       temperature=0, seed=1, stream=True)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    assert whole.usage.completion_tokens == 25
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny-gpt", prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


BAD = [
    (b"{not json", 400, None),
    (json.dumps({"prompt": "x", "frobnicate": 1}).encode(), 400, None),
    (json.dumps({"prompt": "x", "temperature": 9}).encode(), 400, None),
    (json.dumps({"prompt": "x", "n": 0}).encode(), 400, None),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, None),
    (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, None),
    (json.dumps({"max_tokens": 3}).encode(), 400, None),
    (json.dumps({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, None),
    (json.dumps({"prompt": "abc" * 30, "max_tokens": 2}).encode(), 400,
     "context_length_exceeded"),
    (json.dumps({"prompt": "a", "logprobs": 21}).encode(), 400, None),
    (json.dumps({"prompt": "\u00e9t\u00e9"}).encode(), 400, None),
    (json.dumps({"prompt": "x" * 5000}).encode(), 413, "body_too_large"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD)
def test_bad_requests_get_their_status_and_the_server_goes_on(gpt_server, body, status, code):
    r = httpx.post(gpt_server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert httpx.get(gpt_server.url + "/health").status_code == 200


def test_a_chunked_body_over_the_limit_is_refused(gpt_server):
    def body():
        for _ in range(10):
            yield b" " * 1000
    r = httpx.post(gpt_server.url + "/v1/completions", content=body(), timeout=30)
    assert r.status_code == 413
    assert httpx.get(gpt_server.url + "/health").status_code == 200


def test_unknown_routes_and_methods(gpt_server):
    assert httpx.get(gpt_server.url + "/v1/nothing").status_code == 404
    assert httpx.get(gpt_server.url + "/v1/completions").status_code == 405
    assert httpx.post(gpt_server.url + "/v1/translations", json={}).status_code == 404


def test_a_completion_runs_past_the_context_as_generate_does(gpt_server, gpt_checkpoint):
    """The README's example: 6 prompt tokens and 60 new ones from a context-64 model (here
    100 after 5): the window slides, as `tformer generate` slides it."""
    import torch

    from tformer.decoding.lm import generate
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(gpt_checkpoint)
    prompt = loaded.tokenizer.encode("hello")
    with torch.no_grad():
        want = [int(t[0]) for t in generate(loaded.model, torch.tensor([prompt]),
                                             max_new_tokens=100, temperature=0.0)]
    answer = complete(gpt_server.url, prompt="hello", max_tokens=100, temperature=0)
    assert answer["choices"][0]["text"] == loaded.tokenizer.decode(want)
    assert answer["usage"]["completion_tokens"] == 100
