"""The translation engine batches continuously (serving/translation.py): a request's lines
join the sentences in flight at the next step and leave when finished, each with the
translation it gets alone."""

from __future__ import annotations

import pytest
import torch

from tformer.data.tokenizers import CharTokenizer
from tformer.decoding.translate import SearchOptions, translate
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from tformer.serving.translation import TranslationEngine, TranslationJob

from .conftest import TEXT

EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer(TEXT, specials=True)


@pytest.fixture(scope="module")
def model(tokenizer) -> Seq2Seq:
    """A tiny model that never ends a sentence itself: each ends at its length limit
    (2 * source tokens + 1), so how long each decodes is known."""
    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=tokenizer.vocab_size, max_len=64, n_layer=2,
                                  n_head=2, d_model=16, d_ff=32, dropout=0.0)).eval()
    outputs = model.decoder_outputs
    model.decoder_outputs = lambda x, **kw: outputs(x, **kw).index_fill(-1, torch.tensor(
        [EOS]), -30.0)
    return model


OPTIONS = SearchOptions(beam=3, alpha=0.6, max_len_a=2.0, max_len_b=1, n_best=2)


class Answers:
    def __init__(self) -> None:
        self.got: dict[str, list] = {}
        self.at: dict[str, int] = {}
        self.step = 0

    def job(self, name: str, lines: list[str], options: SearchOptions = OPTIONS
            ) -> TranslationJob:
        def done(results):
            self.got[name], self.at[name] = results, self.step
        return TranslationJob(lines, options, done)


def drive(engine: TranslationEngine, answers: Answers, arrivals: dict[int, list],
          leaving: dict[int, TranslationJob] | None = None) -> None:
    """The engine's loop, a step at a time on this thread: jobs[step] submitted before it,
    leaving[step] cancelled (its client gone)."""
    leaving = dict(leaving or {})
    while arrivals or engine.running or engine.waiting:
        for job in arrivals.pop(answers.step, []):
            assert engine.submit(job)
        if answers.step in leaving:
            leaving.pop(answers.step).cancelled = True
        with torch.inference_mode():
            engine._admit()
            engine._step()
        answers.step += 1
        assert answers.step < 300


def test_a_short_request_joins_a_long_one_in_flight_and_leaves_first(model, tokenizer):
    engine = TranslationEngine(model, tokenizer)
    answers = Answers()
    long_line, short_lines = "the quick brown fox jumps", ["hi", "", "on"]
    drive(engine, answers, {0: [answers.job("long", [long_line])],
                            5: [answers.job("short", short_lines)]})
    # "hi" and "on": 3 tokens with EOS, 7 output tokens: they join at step 5 and end at
    # step 11, long before the long line's 53 steps; the blank line is empty at once.
    assert answers.at["short"] == 5 + 7 - 1 and answers.at["long"] == 2 * 26 + 1 - 1
    alone = translate(model, tokenizer, [long_line, *short_lines], OPTIONS)
    got = answers.got["long"] + answers.got["short"]
    assert [[h.text for h in hyps] for hyps in got] == [[h.text for h in hyps]
                                                         for hyps in alone]
    assert [h.score for hyps in got for h in hyps] == pytest.approx(
        [h.score for hyps in alone for h in hyps], abs=1e-4)
    assert engine._pool is not None and engine._pool.used == 0


def test_requests_with_other_options_wait_for_the_sentences_in_flight(model, tokenizer):
    engine = TranslationEngine(model, tokenizer)
    answers = Answers()
    greedy = SearchOptions(beam=1, max_len_a=2.0, max_len_b=1)
    drive(engine, answers, {0: [answers.job("a", ["abc"])],
                            1: [answers.job("greedy", ["x"], greedy)],
                            2: [answers.job("b", ["y"])]})
    # "b" shares a's options but queues behind the greedy request: first come, first served.
    assert answers.at["a"] == 9 - 1 < answers.at["greedy"] < answers.at["b"]
    [[expected]] = translate(model, tokenizer, ["x"], greedy)
    assert answers.got["greedy"][0][0].text == expected.text


def test_lines_beyond_the_batch_join_as_others_leave(model, tokenizer):
    engine = TranslationEngine(model, tokenizer, batch_size=2)
    answers = Answers()
    lines = ["a", "bb", "c", "dddd", "e"]
    drive(engine, answers, {0: [answers.job("many", lines)]})
    alone = translate(model, tokenizer, lines, OPTIONS)
    assert [h[0].text for h in answers.got["many"]] == [h[0].text for h in alone]
    assert engine.stats.finished_sequences == 5


def test_a_client_that_leaves_takes_its_lines_out(model, tokenizer):
    engine = TranslationEngine(model, tokenizer)
    answers = Answers()
    gone = answers.job("gone", ["the quick brown fox", "jumps over"])
    drive(engine, answers, {0: [gone, answers.job("stays", ["a lazy dog"])]}, {4: gone})
    assert "gone" not in answers.got and engine.running == 0
    [[expected, _]] = translate(model, tokenizer, ["a lazy dog"], OPTIONS)
    assert answers.got["stays"][0][0].text == expected.text
    assert engine._pool is not None and engine._pool.used == 0
