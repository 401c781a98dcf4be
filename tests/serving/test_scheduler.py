"""Continuous batching against decoding one sequence at a time with the library's
`generate`: the same tokens, whenever a sequence joins or leaves."""

from __future__ import annotations

import threading

import pytest
import torch

from tformer.models.gpt import GPT, GPTConfig
from tformer.models.transformer_xl import TransformerXL, TransformerXLConfig
from tformer.registry import get_family
from tformer.serving.scheduler import LMEngine, PagedEngine
from tformer.serving.sequence import Sampling, Sequence


def decisive(model: torch.nn.Module, *, only_matrices: bool = False) -> torch.nn.Module:
    """Random weights large enough that the logits have no near-ties: greedy decoding then
    compares token streams, not rounding. only_matrices: keep biases and norms as they
    were initialised."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 or not only_matrices:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture
def gpt() -> GPT:
    return decisive(GPT(GPTConfig(vocab_size=29, context=24, n_layer=2, n_head=2, d_model=16)))


def decoder_of(model):
    """How the library decodes this model alone: its family's generate."""
    return get_family("transformer-xl" if isinstance(model, TransformerXL) else "gpt").generate


def alone(model, prompt, sampling: Sampling, eos_id=None) -> list[int]:
    gen = torch.Generator().manual_seed(sampling.seed or 0)
    out = []
    decode = decoder_of(model)
    for token in decode(model, torch.tensor([prompt]), max_new_tokens=sampling.max_tokens,
                        temperature=sampling.temperature, top_k=sampling.top_k,
                        top_p=sampling.top_p, generator=gen, eos_id=eos_id):
        if int(token[0]) == eos_id:
            break
        out.append(int(token[0]))
    return out


class Collect:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.event = threading.Event()

    def __call__(self, token, reason) -> None:
        if token is not None:
            self.tokens.append(token)
        else:
            self.reason = reason
            self.event.set()


def run_engine(model, requests, *, max_batch, batched=True, eos_id=None, speculator=None,
               **options):
    """Step an engine by hand: request i joins before step `requests[i][2]`."""
    engine = LMEngine(model, eos_id=eos_id, max_batch=max_batch, max_waiting=100,
                      batched=batched, generate=decoder_of(model), speculator=speculator,
                      **options)
    sinks = [Collect() for _ in requests]
    seqs = [Sequence(p, s, sink) for (p, s, _), sink in zip(requests, sinks, strict=True)]
    step = 0
    while any(sink.reason is None for sink in sinks):
        for seq, (_, _, at) in zip(seqs, requests, strict=True):
            if at == step:
                engine.submit([seq])
        engine.step()
        step += 1
        assert step < 500
    return sinks


@pytest.mark.parametrize(("context", "max_batch", "step_tokens"),
                         [(24, 4, 5), (160, 7, 512)])
def test_sequences_joining_and_leaving_decode_as_they_would_alone(context, max_batch,
                                                                   step_tokens):
    """(24, 4, 5): rows wait for a free one, and prompts are read a few tokens a step
    between the others' decoding steps; (160, 7, 512): whole prompts in one chunk."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=context, n_layer=2, n_head=2,
                                 d_model=16)))
    torch.manual_seed(3)
    requests = []
    for i in range(10):
        prompt = torch.randint(0, 29, (int(torch.randint(1, 12, ())),)).tolist()
        greedy = i % 2 == 0
        longest = min(context, 100) - len(prompt)
        sampling = Sampling(max_tokens=int(torch.randint(1, longest, ())),
                            temperature=0.0 if greedy else 1.0, top_k=0 if greedy else 7,
                            seed=i)
        requests.append((prompt, sampling, 2 * i))
    sinks = run_engine(gpt, requests, max_batch=max_batch, step_tokens=step_tokens)
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        assert sink.tokens == alone(gpt, prompt, sampling)
        assert sink.reason == "length"


def test_the_end_of_text_token_ends_a_sequence(gpt):
    prompt = [1, 2, 3]
    first = alone(gpt, prompt, Sampling(max_tokens=6, temperature=0.0))
    eos = first[3]
    want = first[: first.index(eos)]
    sinks = run_engine(gpt, [(prompt, Sampling(6, 0.0), 0), ([4, 5], Sampling(9, 0.0), 0)],
                       max_batch=2, eos_id=eos)
    assert sinks[0].tokens == want and sinks[0].reason == "stop"
    assert sinks[1].tokens == alone(gpt, [4, 5], Sampling(9, 0.0), eos_id=eos)


@pytest.mark.parametrize("batched", [True, False])
def test_any_of_several_end_of_text_tokens_ends_a_sequence(gpt, batched):
    """Llama 3 ends a text at any of three ids: a sequence stops at the first it draws."""
    prompts = [[1, 2, 3], [4, 5]]
    free = [alone(gpt, p, Sampling(max_tokens=9, temperature=0.0)) for p in prompts]
    unused = [t for t in range(29) if t not in free[0] + free[1]]
    eos = free[0][3]
    ends = (unused[0], eos, unused[1])
    sinks = run_engine(gpt, [(p, Sampling(9, 0.0), 0) for p in prompts], max_batch=2,
                       batched=batched, eos_id=ends)
    for sink, tokens in zip(sinks, free, strict=True):
        stop = next((i for i, t in enumerate(tokens) if t in ends), None)
        assert sink.tokens == tokens[:stop]
        assert sink.reason == ("length" if stop is None else "stop")
    assert sinks[0].reason == "stop"


def test_a_cancelled_sequence_leaves_and_the_others_go_on(gpt):
    sink = Collect()
    engine = LMEngine(gpt, eos_id=None, max_batch=4, max_waiting=8, batched=True)
    seq = Sequence([1, 2], Sampling(10, 0.0), sink)
    other = Collect()
    engine.submit([seq, Sequence([3], Sampling(5, 0.0), other)])
    engine.step()  # both prompts read, a first token each
    engine.step()
    seq.cancel()
    engine.step()
    assert sink.reason == "cancelled" and len(sink.tokens) == 2
    assert len(engine.active) == 1 and engine.slots.rows == 1


def test_the_queue_is_bounded(gpt):
    engine = LMEngine(gpt, eos_id=None, max_batch=1, max_waiting=2, batched=True)
    assert engine.submit([Sequence([1], Sampling(2), Collect()) for _ in range(2)])
    assert not engine.submit([Sequence([1], Sampling(2), Collect())])


def test_a_memory_model_decodes_one_sequence_per_slot():
    cfg = TransformerXLConfig(vocab_size=29, context=4, mem_len=6, n_layer=2, n_head=2,
                              d_model=16, d_ff=32)
    model = decisive(TransformerXL(cfg), only_matrices=True)
    requests = [([1, 2, 3, 4, 5], Sampling(8, 0.0), 0), ([6], Sampling(12, 1.0, seed=4), 1),
                ([7, 8], Sampling(10, 0.0), 1), ([9, 10, 11], Sampling(6, 0.0), 3)]
    sinks = run_engine(model, requests, max_batch=2, batched=False)
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        assert sink.tokens == alone(model, prompt, sampling)
    greedy = [tuple(sinks[i].tokens[:6]) for i in (0, 2, 3)]
    assert len(set(greedy)) == 3  # the text depends on the prompt


def test_the_thread_drains_its_queue_on_stop(gpt):
    engine = LMEngine(gpt, eos_id=None, max_batch=2, max_waiting=8, batched=True)
    sinks = [Collect() for _ in range(5)]
    engine.submit([Sequence([i + 1], Sampling(4, 0.0), s) for i, s in enumerate(sinks)])
    engine.start()
    engine.stop(timeout=30)
    assert [s.reason for s in sinks] == ["length"] * 5
    assert all(s.tokens == alone(gpt, [i + 1], Sampling(4, 0.0)) for i, s in enumerate(sinks))


def test_the_translation_queue_is_bounded():
    from tformer.decoding.translate import SearchOptions
    from tformer.serving.translation import TranslationEngine, TranslationJob

    batcher = TranslationEngine(None, None, max_waiting=2)
    jobs = [TranslationJob(["a"], SearchOptions(), lambda r: None) for _ in range(3)]
    assert batcher.submit(jobs[0]) and batcher.submit(jobs[1])
    assert not batcher.submit(jobs[2])
    assert batcher.waiting == 2


@pytest.mark.parametrize("max_batch", [1, 4])
def test_sequences_past_the_context_slide_their_window_as_generate_does(max_batch):
    """Prompt + completion longer than the context: each token after the window is full is
    read from the last `context` tokens, as the library's generate does, while shorter
    sequences go on in the pool beside them."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=16, n_layer=2, n_head=2, d_model=16)))
    torch.manual_seed(5)
    requests = []
    for i in range(6):
        prompt = torch.randint(0, 29, (int(torch.randint(1, 16, ())),)).tolist()
        greedy = i % 2 == 0
        sampling = Sampling(max_tokens=[40, 5, 33, 12, 16, 3][i],
                            temperature=0.0 if greedy else 1.0, top_k=0 if greedy else 7,
                            seed=i, logprobs=0)
        requests.append((prompt, sampling, i))
    sinks = run_engine(gpt, requests, max_batch=max_batch)
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        assert sink.tokens == alone(gpt, prompt, sampling)
        assert sink.reason == "length"
    assert sum(len(p) + s.max_tokens > 16 for p, s, _ in requests) >= 3


def test_a_short_prompt_is_answered_while_a_long_one_is_still_being_read():
    """Chunked prefill: the long prompt is read 8 tokens a step; the short one, sent with
    it, is read at once and decodes in the steps that follow."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=160, n_layer=2, n_head=2, d_model=16)))
    engine = LMEngine(gpt, eos_id=None, max_batch=4, max_waiting=8, batched=True,
                      step_tokens=8)
    long_sink, short_sink = Collect(), Collect()
    long_prompt = torch.randint(0, 29, (120,), generator=torch.Generator().manual_seed(0))
    engine.submit([Sequence(long_prompt.tolist(), Sampling(4, 0.0), long_sink),
                   Sequence([3, 4, 5], Sampling(4, 0.0), short_sink)])
    for _ in range(5):
        engine.step()
    assert short_sink.reason == "length" and not long_sink.tokens
    while long_sink.reason is None:
        engine.step()
    assert short_sink.tokens == alone(gpt, [3, 4, 5], Sampling(4, 0.0))
    assert long_sink.tokens == alone(gpt, long_prompt.tolist(), Sampling(4, 0.0))


def test_short_prompts_that_fit_the_step_are_read_whole_while_rows_decode():
    """While rows decode, a long prompt is read a quarter of the step's budget at a time,
    but short prompts that fit in the step are read to their end in it: three 10-token
    prompts sent together each have their first token after one step (30 tokens, more
    than the quarter), and every text is what it would be alone."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=160, n_layer=2, n_head=2, d_model=16)))
    engine = LMEngine(gpt, eos_id=None, max_batch=8, max_waiting=8, batched=True,
                      step_tokens=32)
    g = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(0, 29, (120,), generator=g).tolist()
    shorts = [torch.randint(0, 29, (10,), generator=g).tolist() for _ in range(3)]
    first, long_sink, sinks = Collect(), Collect(), [Collect() for _ in shorts]
    engine.submit([Sequence(long_prompt, Sampling(6, 0.0), long_sink),
                   Sequence([3, 4, 5], Sampling(12, 0.0), first)])
    engine.step()
    assert len(first.tokens) == 1 and not long_sink.tokens  # decoding; the long one read on
    engine.submit([Sequence(p, Sampling(4, 0.0), s) for p, s in zip(shorts, sinks,
                                                                     strict=True)])
    engine.step()
    assert [len(s.tokens) for s in sinks] == [1, 1, 1] and not long_sink.tokens
    while engine.running or engine.waiting:
        engine.step()
    for prompt, sink, sampling in [(long_prompt, long_sink, Sampling(6, 0.0)),
                                   ([3, 4, 5], first, Sampling(12, 0.0)),
                                   *[(p, s, Sampling(4, 0.0)) for p, s in zip(
                                       shorts, sinks, strict=True)]]:
        assert sink.tokens == alone(gpt, prompt, sampling)


def test_rows_preempted_for_want_of_blocks_resume_with_the_same_text(monkeypatch):
    """A pool of 9 blocks of 16 positions cannot hold three 40-token texts growing to 70:
    rows are preempted, read again from their prompt and tokens, and make the text they
    would alone (greedy and seeded sampling alike)."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=80, n_layer=2, n_head=2, d_model=16)))
    g = torch.Generator().manual_seed(2)
    requests = [(torch.randint(0, 29, (40,), generator=g).tolist(),
                 Sampling(30, 0.0 if i % 2 == 0 else 1.0, top_k=0 if i % 2 == 0 else 5,
                          seed=i), 0) for i in range(3)]
    engines = []
    original = PagedEngine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(PagedEngine, "__init__", init)
    sinks = run_engine(gpt, requests, max_batch=3, kv_blocks=10)
    assert engines[0].stats.preemptions >= 1
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        assert sink.tokens == alone(gpt, prompt, sampling)
        assert sink.reason == "length"


def test_a_text_larger_than_the_whole_pool_fails_with_a_clear_error(gpt):
    engine = LMEngine(gpt, eos_id=None, max_batch=2, max_waiting=8, batched=True,
                      kv_blocks=2)  # one block of 16 positions
    sink = Collect()
    engine.submit([Sequence(list(range(20)), Sampling(3, 0.0), sink)])
    engine.step()
    assert sink.reason == "error" and engine.kv_positions() == 16


def test_a_prompt_larger_than_the_kv_memory_is_a_400():
    from fastapi.testclient import TestClient

    from tformer.data.tokenizers import CharTokenizer
    from tformer.serving.app import create_app

    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    gpt = decisive(GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context=24, n_layer=2,
                                 n_head=2, d_model=16)))
    engine = LMEngine(gpt, eos_id=None, max_batch=2, max_waiting=8, batched=True,
                      kv_blocks=2)  # 16 positions in all
    app = create_app(engine, tokenizer, model_name="tiny", kind="lm")
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "a" * 20, "max_tokens": 2})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "kv_memory_exceeded"
        assert "16 positions" in r.json()["error"]["message"]
        ok = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_the_n_choices_of_a_prompt_share_its_blocks_and_chat_turns_reuse_the_last():
    """Choice 2 of a 40-token prompt waits a step and takes choice 1's two full blocks of
    16; a later prompt that continues the first is read from its cached blocks; the texts
    are those each prompt makes alone."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=80, n_layer=2, n_head=2, d_model=16)))
    engine = LMEngine(gpt, eos_id=None, max_batch=4, max_waiting=8, batched=True)
    prompt = torch.randint(0, 29, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    sinks = [Collect(), Collect()]
    engine.submit([Sequence(prompt, Sampling(5, 1.0, seed=i), sink)
                   for i, sink in enumerate(sinks)])
    while any(s.reason is None for s in sinks):
        engine.step()
    pool = engine.slots
    assert pool.found == 32 and pool.looked_up == 80
    for i, sink in enumerate(sinks):
        assert sink.tokens == alone(gpt, prompt, Sampling(5, 1.0, seed=i))
    longer = prompt + sinks[0].tokens + [3, 4]
    sink = Collect()
    engine.submit([Sequence(longer, Sampling(4, 0.0), sink)])
    while sink.reason is None:
        engine.step()
    assert pool.found == 32 + 32 and sink.tokens == alone(gpt, longer, Sampling(4, 0.0))


def test_prompts_that_cannot_all_be_read_at_once_take_turns():
    """Three 40-token prompts, a pool of 4 blocks of 16 (64 positions): one is read at a
    time, the others wait for its blocks; each text is the one it makes alone."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=80, n_layer=2, n_head=2, d_model=16)))
    g = torch.Generator().manual_seed(6)
    requests = [(torch.randint(0, 29, (40,), generator=g).tolist(), Sampling(6, 0.0), 0)
                for _ in range(3)]
    sinks = run_engine(gpt, requests, max_batch=3, kv_blocks=5, step_tokens=16)
    for (prompt, sampling, _), sink in zip(requests, sinks, strict=True):
        assert sink.tokens == alone(gpt, prompt, sampling) and sink.reason == "length"


def test_lower_priority_values_are_served_first_when_the_batch_is_full(gpt):
    """One row, five sequences queued together: they are decoded one after another, the
    lowest priority value first, then in order of arrival."""
    engine = LMEngine(gpt, eos_id=None, max_batch=1, max_waiting=8, batched=True)
    ends: list[int] = []

    def sink(i):
        def deliver(token, reason):
            if token is None:
                ends.append(i)
        return deliver

    engine.submit([Sequence([1, 2], Sampling(3, 0.0, priority=p), sink(i))
                   for i, p in enumerate([0, -1, 0, 2, -1])])
    while len(ends) < 5:
        engine.step()
    assert ends == [1, 4, 0, 2, 3]


def test_past_max_waiting_a_request_gets_503_with_retry_after():
    """The queue full (the decoding thread held before its step, so nothing leaves it), a
    completion is refused with 503 and Retry-After; once the thread goes on, a request with
    a priority is answered, and a priority that is not a number is a 400 naming it."""
    from fastapi.testclient import TestClient

    from tformer.data.tokenizers import CharTokenizer
    from tformer.serving.app import create_app

    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    gpt = decisive(GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context=24, n_layer=2,
                                 n_head=2, d_model=16)))
    engine = LMEngine(gpt, eos_id=None, max_batch=1, max_waiting=2, batched=True)
    go = threading.Event()
    step = engine.step

    def held_step():
        go.wait(30)
        step()

    engine.step = held_step
    app = create_app(engine, tokenizer, model_name="tiny", kind="lm")
    queued = [Collect(), Collect()]
    with TestClient(app) as client:
        assert engine.submit([Sequence([1], Sampling(2, 0.0), s) for s in queued])
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
        go.set()
        for each in queued:  # the queue drained first (a busy machine takes its time)
            assert each.event.wait(60)
        ok = client.post("/v1/completions",
                         json={"prompt": "abc", "max_tokens": 2, "priority": -3})
        assert ok.status_code == 200, ok.text
        bad = client.post("/v1/completions", json={"prompt": "abc", "priority": "high"})
        assert bad.status_code == 400 and "priority" in bad.text
    assert [s.reason for s in queued] == ["length", "length"]


def test_no_step_reads_more_than_its_budget_and_rows_decode_every_step():
    """Three rows decode while two long prompts and a stream of short ones arrive: every
    step's passes read at most --step-tokens positions, every decoding row gets its token
    in every step, and each text is the one it makes alone."""
    gpt = decisive(GPT(GPTConfig(vocab_size=29, context=160, n_layer=2, n_head=2, d_model=16)))
    engine = LMEngine(gpt, eos_id=None, max_batch=8, max_waiting=16, batched=True,
                      step_tokens=24)
    g = torch.Generator().manual_seed(8)
    read_per_step: list[int] = []
    forward = engine.slots.forward

    def counted(rows, tokens, real=None, **kw):
        read_per_step[-1] += int(real.sum()) if real is not None else tokens.numel()
        return forward(rows, tokens, real, **kw)

    engine.slots.forward = counted
    requests = [([1, 2, 3], Sampling(30, 0.0)), ([4, 5], Sampling(30, 0.0)),
                ([6], Sampling(30, 0.0))]
    sinks = [Collect() for _ in range(3)]
    engine.submit([Sequence(p, s, sink) for (p, s), sink in zip(requests, sinks,
                                                                 strict=True)])
    for step in range(25):
        if step == 2:
            for _ in range(2):
                prompt = torch.randint(0, 29, (100,), generator=g).tolist()
                requests.append((prompt, Sampling(3, 0.0)))
                sinks.append(Collect())
                engine.submit([Sequence(prompt, requests[-1][1], sinks[-1])])
        if step % 3 == 0 and step:
            prompt = torch.randint(0, 29, (5,), generator=g).tolist()
            requests.append((prompt, Sampling(2, 0.0)))
            sinks.append(Collect())
            engine.submit([Sequence(prompt, requests[-1][1], sinks[-1])])
        before = [len(s.tokens) for s in sinks[:3]]
        read_per_step.append(0)
        engine.step()
        assert read_per_step[-1] <= 24
        if step:  # from the second step on, the three rows decode every step
            assert [len(s.tokens) for s in sinks[:3]] == [b + 1 for b in before]
    while engine.running or engine.waiting:
        engine.step()
    for (prompt, sampling), sink in zip(requests, sinks, strict=True):
        assert sink.tokens == alone(gpt, prompt, sampling)
