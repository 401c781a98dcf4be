"""What happens around the requests: the API key, a full queue, a client that leaves,
SIGTERM with requests in flight, and the other families (Transformer-XL, translation)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tformer.decoding.translate import SearchOptions, translate
from tformer.loading import load_checkpoint

from .conftest import Server, tiny_checkpoint


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    raise KeyError(name)


def test_the_api_key(gpt_checkpoint):
    server = Server(gpt_checkpoint, "--api-key", "s3cret")
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope",
                          max_retries=0).models.list()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny-gpt", prompt="a",
                                         max_tokens=3).usage.completion_tokens == 3
    finally:
        server.stop()


def test_a_full_queue_answers_503_with_retry_after(long_checkpoint):
    server = Server(long_checkpoint, "--max-batch", "1", "--max-waiting", "1")
    try:
        def post(_):
            return httpx.post(server.url + "/v1/completions", timeout=120,
                              json={"prompt": "a", "max_tokens": 300, "temperature": 0})
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(post, range(6)))
        statuses = sorted(r.status_code for r in answers)
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
        busy = next(r for r in answers if r.status_code == 503)
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "overloaded"
        assert all(len(r.json()["choices"][0]["text"]) == 300
                   for r in answers if r.status_code == 200)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def test_a_client_that_leaves_stops_its_generation(long_checkpoint):
    server = Server(long_checkpoint)
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "a", "max_tokens": 500, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
        # The connection is closed; the server notices and drops the sequence.
        wait_for(lambda: gauge(server.url, "tformer_running_sequences") == 0, "the drop")
        assert gauge(server.url, "tformer_generated_tokens_total") < 500
        assert gauge(server.url, "tformer_finished_sequences_total") == 1
        # And a non-streamed one.
        def leave():
            try:
                httpx.post(server.url + "/v1/completions", timeout=0.3,
                           json={"prompt": "b", "max_tokens": 500})
            except httpx.TimeoutException:
                pass
        leave()
        wait_for(lambda: gauge(server.url, "tformer_finished_sequences_total") == 2, "the drop")
        assert gauge(server.url, "tformer_generated_tokens_total") < 1000
    finally:
        server.stop()


def test_sigterm_finishes_the_requests_in_flight(long_checkpoint):
    server = Server(long_checkpoint, "--max-batch", "4")
    results: list[httpx.Response] = []

    def post(prompt: str, stream: bool) -> None:
        body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": stream}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        results.append(r)

    threads = [threading.Thread(target=post, args=(p, i % 2 == 1))
               for i, p in enumerate(["a", "b c", "hello", "zz"])]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: gauge(server.url, "tformer_running_sequences") == 4, "4 in flight")
        status = server.terminate()
        for t in threads:
            t.join(120)
        assert len(results) == 4 and all(r.status_code == 200 for r in results)
        assert status == 0  # drained cleanly: not -15, death by the re-raised signal
        for r in results:
            if r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]")
                assert '"finish_reason": "length"' in r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == 400
        assert "Traceback" not in server.proc.stderr.read()
    finally:
        server.stop()


def test_transformer_xl_is_served_through_its_own_decoder(tmp_path):
    # Random biases and norms make this small Transformer-XL repeat one letter whatever the
    # prompt; random matrices alone make its text depend on the prompt.
    ckpt = tiny_checkpoint(tmp_path / "tiny-txl", {
        "family": "transformer-xl", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64,
        "context": 8, "mem_len": 8}, only_matrices=True)
    server = Server(ckpt)
    try:
        prompts = ["hello", "a", "the quick brown fox jumps", "zz"]

        def text(prompt: str, **sampling) -> str:
            return httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 30, **sampling},
                              ).json()["choices"][0]["text"]

        one = [text(p, temperature=0) for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: text(p, temperature=0), prompts))
        assert together == one and len(set(one)) > 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        streamed = client.completions.create(model="tiny-txl", prompt="hello", max_tokens=30,
                                             temperature=0.9, seed=5, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == text(
            "hello", temperature=0.9, seed=5)
    finally:
        server.stop()


def test_translations_in_order_and_equal_to_the_library(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "tiny-mt", {
        "family": "seq2seq", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64,
        "max_len": 64, "dropout": 0.0}, specials=True, std=0.2)
    loaded = load_checkpoint(ckpt)
    lines = ["hello there", "a", "the quick brown fox", "zz top", "serve me well"]
    options = SearchOptions(beam=3, max_len_a=1.0, max_len_b=5)
    with torch.inference_mode():
        want = translate(loaded.model, loaded.tokenizer, lines, options)
    server = Server(ckpt, "--batch-window-ms", "50")
    try:
        url = server.url + "/v1/translations"
        body = {"beam": 3, "max_len_a": 1.0, "max_len_b": 5, "scores": True}
        got = httpx.post(url, json={"input": lines, **body}, timeout=60).json()["data"]
        assert [d["text"] for d in got] == [h[0].text for h in want]
        for d, h in zip(got, want, strict=True):
            assert d["score"] == pytest.approx(h[0].score, abs=1e-4)
        # Requests arriving together are grouped, and each gets its own lines back.
        with ThreadPoolExecutor(5) as pool:
            alone = list(pool.map(lambda line: httpx.post(
                url, json={"input": [line], **body}, timeout=60).json()["data"][0]["text"],
                lines))
        assert alone == [h[0].text for h in want]
        bad = httpx.post(url, json={"input": [], "beam": 3}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        assert httpx.post(url, json={"input": ["a"], "beam": 2, "n_best": 3}).status_code == 400
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "a"}).status_code == 404
    finally:
        server.stop()
