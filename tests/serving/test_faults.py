"""One sequence's failure stays its own: it gets an error answer, the sequences decoding
beside it finish with the tokens they would have had alone, and the engine keeps serving."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from tformer.data.tokenizers import CharTokenizer
from tformer.decoding.beam_pool import BeamPool
from tformer.decoding.translate import SearchOptions, Translation
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from tformer.serving import sequence, translation
from tformer.serving.app import create_app
from tformer.serving.scheduler import LMEngine
from tformer.serving.sequence import Sampling, Sequence
from tformer.serving.translation import TranslationEngine, TranslationJob

from .conftest import TEXT
from .test_scheduler import Collect, alone, decisive

POISON_SEED = 666
"""The seed of the sequence whose sampling raises."""


@pytest.fixture
def gpt() -> GPT:
    return decisive(GPT(GPTConfig(vocab_size=35, context=64, n_layer=2, n_head=2, d_model=16)))


@pytest.fixture
def poisoned_sampling(monkeypatch):
    """Sampling raises for the sequence seeded POISON_SEED, at its third draw."""
    real = sequence.next_token
    draws: weakref.WeakKeyDictionary[torch.Generator, int] = weakref.WeakKeyDictionary()

    def next_token(logits, *, generator, **options):
        if generator is not None and generator.initial_seed() == POISON_SEED:
            draws[generator] = draws.get(generator, 0) + 1  # each sequence has its own
            if draws[generator] == 3:
                raise RuntimeError("injected fault")
        return real(logits, generator=generator, **options)

    monkeypatch.setattr(sequence, "next_token", next_token)


def test_a_sampling_fault_ends_its_sequence_alone(gpt, poisoned_sampling):
    engine = LMEngine(gpt, eos_id=None, max_batch=8, max_waiting=16, batched=True)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    samplings = [Sampling(20, 1.0, top_k=5, seed=s) for s in (1, POISON_SEED, 2, 3)]
    sinks = [Collect() for _ in prompts]
    seqs = [Sequence(p, s, sink) for p, s, sink in zip(prompts, samplings, sinks, strict=True)]
    engine.submit(seqs)
    engine.start()
    try:
        # The failing one is answered at once, not when its client gives up.
        assert sinks[1].event.wait(10)
        assert sinks[1].reason == "error" and len(sinks[1].tokens) == 2
        assert "sampling failed" in seqs[1].error and "injected fault" in seqs[1].error
        for i in (0, 2, 3):
            assert sinks[i].event.wait(30)
            assert sinks[i].reason == "length"
            assert sinks[i].tokens == alone(gpt, prompts[i], samplings[i])
        # And the engine goes on serving.
        later = Collect()
        engine.submit([Sequence([7, 7], Sampling(5, 0.0), later)])
        assert later.event.wait(30) and later.reason == "length"
        assert later.tokens == alone(gpt, [7, 7], Sampling(5, 0.0))
    finally:
        engine.stop(timeout=30)


def test_a_prompt_that_cannot_be_read_fails_alone(gpt):
    """A token id past the vocabulary makes the shared prompt pass raise: each prompt is
    then read alone, and only the bad one fails."""
    engine = LMEngine(gpt, eos_id=None, max_batch=8, max_waiting=16, batched=True)
    good = [Collect(), Collect()]
    bad = Collect()
    seqs = [Sequence([1, 2], Sampling(6, 0.0), good[0]),
            Sequence([3, 999], Sampling(6, 0.0), bad),
            Sequence([4, 5, 6], Sampling(6, 0.0), good[1])]
    engine.submit(seqs)
    engine.start()
    try:
        assert bad.event.wait(10) and bad.reason == "error" and not bad.tokens
        assert "reading the prompt failed" in seqs[1].error
        for prompt, sink in zip([[1, 2], [4, 5, 6]], good, strict=True):
            assert sink.event.wait(30) and sink.reason == "length"
            assert sink.tokens == alone(gpt, prompt, Sampling(6, 0.0))
    finally:
        engine.stop(timeout=30)


def test_a_seed_a_generator_cannot_take_is_refused(app_client):
    for seed in (100000000000000000000000, -1, 2**64):
        r = app_client.post("/v1/completions",
                            json={"prompt": "a", "max_tokens": 2, "seed": seed})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "seed"
        assert "between 0 and 18446744073709551615" in error["message"]
    # The largest seed works, also for choices past it (they wrap around).
    r = app_client.post("/v1/completions",
                        json={"prompt": "a", "max_tokens": 2, "seed": 2**64 - 1, "n": 2})
    assert r.status_code == 200, r.text


def test_the_server_answers_the_failing_request_and_the_others(gpt, poisoned_sampling):
    tokenizer = CharTokenizer(TEXT, specials=True)
    engine = LMEngine(gpt, eos_id=tokenizer.eos_id, max_batch=8, max_waiting=16,
                      batched=True)
    app = create_app(engine, tokenizer, model_name="tiny", kind="lm")
    bodies = [{"prompt": p, "max_tokens": 30, "temperature": 1.0, "seed": s, "top_k": 4}
              for p, s in [("hello", 1), ("abc", POISON_SEED), ("xyz", 5), ("q", 9)]]
    with TestClient(app) as client:
        alone_answers = [client.post("/v1/completions", json=b).json() for b in bodies[::2]]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda b: client.post("/v1/completions", json=b), bodies))
        assert answers[1].status_code == 500
        assert "sampling failed: RuntimeError: injected fault" in (
            answers[1].json()["error"]["message"])
        assert [a.json()["choices"] for a in answers[::2]] == [
            a["choices"] for a in alone_answers]
        assert answers[3].status_code == 200
        # A stream gets the error as its event.
        stream = client.post("/v1/completions", json={**bodies[1], "stream": True})
        assert '"message": "sampling failed: RuntimeError: injected fault"' in stream.text
        assert "[DONE]" not in stream.text


def test_a_detokenizing_fault_fails_its_request_alone(gpt):
    tokenizer = CharTokenizer(TEXT, specials=True)
    greedy = {p: alone(gpt, tokenizer.encode(p), Sampling(12, 0.0), tokenizer.eos_id)
              for p in "abcdefgh"}
    marker = greedy["a"][0]
    fine = next(p for p, ids in greedy.items() if ids[0] != marker)

    class Fragile(CharTokenizer):
        def decode(self, ids):
            if ids and ids[0] == marker:
                raise ValueError("cannot decode")
            return super().decode(ids)

    engine = LMEngine(gpt, eos_id=tokenizer.eos_id, max_batch=8, max_waiting=16,
                      batched=True)
    app = create_app(engine, Fragile(TEXT, specials=True), model_name="tiny", kind="lm")
    with TestClient(app) as client:
        body = {"max_tokens": 12, "temperature": 0, "stop": ["@@"]}
        with ThreadPoolExecutor(2) as pool:
            bad, good = pool.map(lambda p: client.post("/v1/completions",
                                                       json={**body, "prompt": p}),
                                 ["a", fine])
        assert bad.status_code == 500
        assert "detokenizing failed: ValueError: cannot decode" in bad.json()["error"]["message"]
        assert good.status_code == 200
        assert good.json()["choices"][0]["text"] == tokenizer.decode(greedy[fine])
        assert client.post("/v1/completions", json={**body, "prompt": fine}).status_code == 200


def test_a_translation_fault_fails_its_line_alone(monkeypatch):
    # A step with a bad line in flight fails: every line in flight is translated again one
    # by one, and only the bad one fails.
    def fake_translate(model, tokenizer, lines, options, *, batch_size):
        if any("boom" in line for line in lines):
            raise RuntimeError("injected fault")
        return [[Translation(line[::-1], -1.0)] for line in lines]

    tokenizer = CharTokenizer(TEXT, specials=True)
    step = BeamPool.step

    def failing_step(self):
        if any(key[1] == 1 and key[0].lines[1] == "a boom" for key in self.keys):
            raise RuntimeError("a step failed")
        return step(self)

    monkeypatch.setattr(translation, "translate", fake_translate)
    monkeypatch.setattr(BeamPool, "step", failing_step)
    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=tokenizer.vocab_size, max_len=32, n_layer=1,
                                  n_head=2, d_model=16, d_ff=32, dropout=0.0)).eval()
    batcher = TranslationEngine(model, tokenizer, window=0.05)
    answers: dict[int, list] = {}
    done = [threading.Event() for _ in range(3)]

    def sink(i):
        def deliver(results):
            answers[i] = results
            done[i].set()
        return deliver

    jobs = [TranslationJob(["one", "two"], SearchOptions(), sink(0)),
            TranslationJob(["three", "a boom"], SearchOptions(), sink(1)),
            TranslationJob(["four"], SearchOptions(), sink(2))]
    for job in jobs:
        batcher.submit(job)
    batcher.start()
    try:
        assert all(event.wait(10) for event in done)
    finally:
        batcher.stop(timeout=10)
    assert [[h[0].text for h in answers[i]] for i in (0, 2)] == [["eno", "owt"], ["ruof"]]
    assert answers[1][0][0].text == "eerht" and answers[1][1] is None
    assert jobs[1].errors == {1: "translation failed: RuntimeError: injected fault"}

