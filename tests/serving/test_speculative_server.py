"""`tformer serve --draft CKPT` and `--prompt-lookup N`: the same greedy answers as the server
without them, concurrent requests of different lengths included; stop strings inside an
accepted run; /metrics' drafted and accepted tokens; a bad draft is a one-line error."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from fastapi.testclient import TestClient

from tformer.cli import main
from tformer.loading import load_checkpoint
from tformer.serving.app import create_app
from tformer.serving.command import speculator_for
from tformer.serving.scheduler import LMEngine

from .conftest import tiny_checkpoint

PROMPTS = ["hello", "a", "the quick brown fox", "zz", "serve me", "abcabcabc", "lorem", "!"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Random matrices alone: a text that depends on its prompt."""
    return tiny_checkpoint(tmp_path_factory.mktemp("target") / "tiny", {
        "family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "context": 64},
        only_matrices=True)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A smaller model of the same tokenizer."""
    return tiny_checkpoint(tmp_path_factory.mktemp("draft") / "small", {
        "family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "context": 64})


@contextmanager
def served(checkpoint, *, draft=None, prompt_lookup=0, draft_tokens=4):
    """The app as `tformer serve` builds it, in this process."""
    loaded = load_checkpoint(checkpoint)
    speculator = speculator_for(loaded, loaded.model, draft=draft, draft_tokens=draft_tokens,
                                prompt_lookup=prompt_lookup, weights="fp32",
                                device=torch.device("cpu"), capacity=8)
    engine = LMEngine(loaded.model, eos_id=loaded.tokenizer.eos_id, max_batch=8,
                      max_waiting=32, batched=True, speculator=speculator)
    app = create_app(engine, loaded.tokenizer, model_name="tiny", kind="lm")
    with TestClient(app) as client:
        yield client


def answers(client, bodies):
    """The requests sent together, each answer's first choice."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: client.post("/v1/completions", json=b), bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0] for r in replies]


def counters(client) -> dict[str, float]:
    return {name: float(value) for name, value in (
        line.split(" ") for line in client.get("/metrics").text.splitlines()
        if line.startswith("tformer_") and "{" not in line)}


@pytest.mark.parametrize("speculation", ["draft", "lookup"])
def test_greedy_answers_equal_the_server_without_drafts(target, small_draft,
                                                        speculation):
    options = {"draft": str(small_draft)} if speculation == "draft" else {"prompt_lookup": 2}
    bodies = [{"prompt": p, "max_tokens": 10 + 7 * i, "temperature": 0.0}
              for i, p in enumerate(PROMPTS)]
    bodies[3]["logprobs"] = 2  # decodes plainly beside the others
    bodies[5]["frequency_penalty"] = 0.5
    with served(target) as client:
        want = answers(client, bodies)
    with served(target, **options) as client:
        got = answers(client, bodies)
        stream = client.post("/v1/completions", json={**bodies[6], "stream": True}).text
        figures = counters(client)
    assert [c["text"] for c in got] == [c["text"] for c in want]
    shown, plain = got[3]["logprobs"], want[3]["logprobs"]
    assert shown["tokens"] == plain["tokens"]
    assert shown["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    assert all(c["finish_reason"] == "length" for c in got)
    pieces = [line for line in stream.splitlines() if line.startswith("data: {")]
    assert len(pieces) > 5 and "".join(
        json.loads(p[6:])["choices"][0]["text"] for p in pieces
    ) == got[6]["text"]
    assert figures["tformer_speculative_rounds_total"] > 0
    assert figures["tformer_draft_tokens_total"] > 0


def test_a_stop_string_inside_an_accepted_run_cuts_it_there(target):
    """The model drafting for itself: every draft is accepted, runs of 5 tokens (one
    character each) after the first one's: characters 1-5, 6-10, ..."""
    body = {"prompt": "hello", "max_tokens": 30, "temperature": 0.0}
    with served(target) as client:
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # A two-character stop that first occurs at `at`, and ends before its run does.
    at = next(i for i in range(6, 25) if text.index(text[i:i + 2]) == i and (i + 1) % 5 != 0)
    stop, cut = text[at:at + 2], text[:at]
    with served(target, draft=str(target)) as client:
        got = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
        stream = client.post("/v1/completions",
                             json={**body, "stop": stop, "stream": True,
                                   "stream_options": {"include_usage": True}}).text
        figures = counters(client)
    assert got["choices"][0]["text"] == cut and got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == at + 2  # to the stop's end, none after
    chunks = [json.loads(line[6:]) for line in stream.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == cut
    assert chunks[-1]["usage"]["completion_tokens"] == at + 2
    assert figures["tformer_draft_acceptance_rate"] == 1.0


def test_metrics_count_the_drafts_as_the_tokens_came(target):
    """One greedy sequence, no end of text: its first token comes from reading the prompt,
    then each step makes one token of the model's own plus the drafts it accepted."""
    body = {"prompt": "abcabcabc", "max_tokens": 50, "temperature": 0.0}
    with served(target, prompt_lookup=2, draft_tokens=3) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        figures = counters(client)
    drafted = figures["tformer_draft_tokens_total"]
    accepted = figures["tformer_accepted_draft_tokens_total"]
    assert 0 < accepted <= drafted
    assert figures["tformer_draft_acceptance_rate"] == round(accepted / drafted, 4)
    assert figures["tformer_generated_tokens_total"] == 50
    assert 1 + figures["tformer_decoding_steps_total"] + accepted == 50
    assert figures["tformer_speculative_rounds_total"] <= figures["tformer_decoding_steps_total"]


def test_the_server_without_drafts_shows_no_speculation(target):
    with served(target) as client:
        assert "draft" not in client.get("/metrics").text


def test_bad_speculation_options_are_one_line_errors(target, small_draft, tmp_path,
                                                     capsys):
    other_vocabulary = tiny_checkpoint(tmp_path / "other", {
        "family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "context": 64},
        specials=True)
    txl = tiny_checkpoint(tmp_path / "txl", {
        "family": "transformer-xl", "n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32,
        "context": 8, "mem_len": 8})
    translation = tiny_checkpoint(tmp_path / "mt", {
        "family": "seq2seq", "n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32,
        "max_len": 32, "dropout": 0.0}, specials=True)
    for args, message in [
        ([str(target), "--draft", str(other_vocabulary)], "its tokenizer is not"),
        ([str(target), "--draft", str(small_draft), "--prompt-lookup", "2"],
         "choose one"),
        ([str(target), "--prompt-lookup", "2", "--draft-tokens", "0"],
         "--draft-tokens 0"),
        ([str(target), "--prompt-lookup", "-1"], "--prompt-lookup -1"),
        ([str(txl), "--prompt-lookup", "2"], "needs models with a KV cache"),
        ([str(target), "--draft", str(txl)], "needs models with a KV cache"),
        ([str(translation), "--prompt-lookup", "2"], "is for language models"),
    ]:
        assert main(["serve", *args, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tformer: error: ") and err.count("\n") == 1, err
        assert message in err
