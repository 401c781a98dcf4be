"""Answering completions (with log-probabilities), chat completions and translations: each
request's choices decoded by the engine, as one JSON body or as server-sent events.

Log-probabilities are those of the distribution each token is drawn from: the model's,
after frequency and presence penalties and logit bias, before temperature, top-k and top-p.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tformer.data.chat import encode_text
from tformer.data.tokenizers import prompt_start
from tformer.decoding.translate import SearchOptions
from tformer.errors import TformerError
from tformer.serving.protocol import (
    ApiError,
    CompletionRequest,
    Limits,
    Prompt,
    SamplingFields,
    TranslationRequest,
)
from tformer.serving.scheduler import LMEngine
from tformer.serving.sequence import Sampling, Sequence
from tformer.serving.structured import compile_for, request_constraint
from tformer.serving.tokens import TokenTexts
from tformer.serving.translation import TranslationEngine, TranslationJob

if TYPE_CHECKING:
    from tformer.decoding.constraints import Grammar

log = logging.getLogger(__name__)


# --- text of one choice -----------------------------------------------------------------


class Choice:
    """Turns a sequence's tokens into text as they come, holding back what may still turn
    out to be the start of a stop string or half of a character, so that every piece
    streamed is final: the pieces concatenate to the whole text."""

    def __init__(self, tokenizer: Any, stops: list[str], *, incremental: bool) -> None:
        """incremental: keep the text up to date at every token (for a stream, or to find
        stop strings); else it is decoded once, by `ready(final=True)`."""
        self.tokenizer = tokenizer
        self.stops = stops
        self.incremental = incremental or bool(stops)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.stop_found: str | None = None
        """The stop string that ended the text, if one did."""

    def add(self, token: int) -> None:
        """Take the next token; once a stop string has matched, the ones still on their way
        (decoded in the same step, or before the engine saw the cancel) are dropped."""
        if self.stopped:
            return
        self.ids.append(token)
        if not self.incremental:
            return
        self.text = self.tokenizer.decode(self.ids)
        for stop in self.stops:
            # Search only where a new match can start: the text before was checked.
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
                self.stop_found = stop

    def ready(self, final: bool) -> str:
        """The text not sent yet that can be sent now."""
        if not self.incremental:
            self.text = self.tokenizer.decode(self.ids)
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            for stop in self.stops:
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[:end].endswith(stop[:k]):
                        end -= k
                        break
        end = max(end, self.sent)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece


class Mailbox:
    """Hands items from the decoding thread to asyncio queues with one wake-up of the event
    loop per batch of items rather than one per token (a wake-up is a write to a pipe, and
    a decoding step hands over a token per sequence)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[tuple[asyncio.Queue, Any]] = []
        self.lock = threading.Lock()

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        with self.lock:
            self.items.append((queue, item))
            wake = len(self.items) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._hand_out)

    def _hand_out(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


# --- completions ------------------------------------------------------------------------


def encode_prompt(tokenizer: Any, text: str, *, rendered: bool = False) -> list[int]:
    """The prompt's token ids, after bos where the model reads texts so; `rendered` text (a
    chat template's) names special tokens by their text, which become their ids."""
    try:
        ids = encode_text(tokenizer, text) if rendered else tokenizer.encode(text)
    except TformerError as e:
        raise ApiError(400, f"prompt: {e}", param="prompt") from None
    return prompt_start(tokenizer, ids)  # as `tformer generate` starts it


def read_prompts(tokenizer: Any, prompt: Prompt) -> list[tuple[str, list[int]]]:
    """Each prompt's text and token ids."""
    if isinstance(prompt, str):
        return [(prompt, encode_prompt(tokenizer, prompt))]
    if isinstance(prompt[0], str):
        return [(text, encode_prompt(tokenizer, text)) for text in prompt]
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    vocab = tokenizer.vocab_size
    for ids in lists:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary "
                           f"(0 to {vocab - 1})", param="prompt")
    return [(tokenizer.decode(ids), list(ids)) for ids in lists]


async def complete(body: CompletionRequest, request: Request, engine: LMEngine, tokenizer: Any,
                   model_name: str, limits: Limits) -> JSONResponse | StreamingResponse:
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, f"best_of {body.best_of} differs from n {body.n}: this server "
                       f"draws each choice once", param="best_of")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    param = "response_format" if body.response_format is not None else "structured_outputs"
    # Off the event loop: a model's first constraint reads its vocabulary (about a second).
    constraint = await asyncio.to_thread(
        compile_for, request_constraint(body.response_format, body.structured_outputs),
        tokenizer, engine.model.cfg.vocab_size, batched=engine.batched, param=param)
    run = Completion(body, engine, tokenizer, model_name, limits, request.app.state.mailbox,
                     prompts=read_prompts(tokenizer, body.prompt), max_tokens=body.max_tokens,
                     echo=body.echo, logprobs=body.logprobs, stops=stops,
                     constraint=constraint)
    return await run.answer(request)


class Completion:
    """One completions request: its sequences (n per prompt) in the engine, and the text
    they make, as one answer or as a stream of chunks."""

    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, body: SamplingFields, engine: LMEngine, tokenizer: Any,
                 model_name: str, limits: Limits, mailbox: Mailbox, *,
                 prompts: list[tuple[str, list[int]]], max_tokens: int | None, echo: bool,
                 logprobs: int | None, stops: list[str], stop_tokens: tuple[int, ...] = (),
                 constraint: Grammar | None = None) -> None:
        """prompts: each prompt's text and ids; max_tokens None: as many as the window
        leaves (up to the server's limit); logprobs: how many likeliest tokens to show
        beside each one's log-probability (None: none); constraint: what every choice's
        text follows."""
        self.body, self.model_name = body, model_name
        self.echo, self.logprobs = echo, logprobs
        if not engine.batched:
            for name, used in [("logprobs", logprobs is not None),
                               ("logit_bias", bool(body.logit_bias)),
                               ("frequency_penalty", body.frequency_penalty != 0),
                               ("presence_penalty", body.presence_penalty != 0),
                               ("min_p", body.min_p != 0),
                               ("repetition_penalty", body.repetition_penalty != 1),
                               ("min_tokens", body.min_tokens != 0),
                               ("ignore_eos", body.ignore_eos)]:
                if used:
                    raise ApiError(400, f"{name} is served for models decoded with a KV "
                                   f"cache; this model's memory is its cache", param=name)
        bias = body.bias_for(tokenizer.vocab_size)
        self.prompts = [text for text, _ in prompts]
        encoded = [self._check(ids, max_tokens, engine, limits) for _, ids in prompts]
        if any(body.min_tokens > budget for _, budget in encoded):
            raise ApiError(400, f"min_tokens {body.min_tokens} is more than the "
                           f"{min(b for _, b in encoded)} tokens max_tokens allows",
                           param="min_tokens")
        self.token_texts = TokenTexts(tokenizer)

        self.events: asyncio.Queue[tuple[int, int | None, str | None]] = asyncio.Queue()
        self.seqs: list[Sequence] = []
        for ids, budget in encoded:
            for i in range(body.n):
                # Choice i of a seeded request draws with seed + i: reproducible, and the
                # choices differ.
                seed = None if body.seed is None else body.seed + i
                sampling = Sampling(budget, body.temperature, body.top_k, body.top_p,
                                    seed, logprobs=logprobs,
                                    prompt_logprobs=echo and logprobs is not None,
                                    frequency_penalty=body.frequency_penalty,
                                    presence_penalty=body.presence_penalty, logit_bias=bias,
                                    stop_tokens=stop_tokens, constraint=constraint,
                                    extra=body.extra_sampling(), priority=body.priority)
                self.seqs.append(Sequence(ids, sampling, self._deliver(len(self.seqs),
                                                                       mailbox)))
        if len(self.seqs) > engine.max_waiting:
            raise ApiError(400, f"{len(self.prompts)} prompts x n = {body.n} make "
                           f"{len(self.seqs)} sequences; this server queues at most "
                           f"{engine.max_waiting}", param="n")
        if not engine.submit(self.seqs):
            raise ApiError(503, "the server is busy; try again shortly", type="server_error",
                           code="overloaded",
                           headers={"Retry-After": str(limits.retry_after_s)})

        self.id = f"{self.id_prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.submitted = time.perf_counter()
        self.first_token: float | None = None
        self.choices = [Choice(tokenizer, stops, incremental=body.stream) for _ in self.seqs]
        self.reasons: list[str | None] = [None] * len(self.seqs)
        self.errors: list[str | None] = [None] * len(self.seqs)
        self.logprobs_sent = [0] * len(self.seqs)
        """Stream: the log-probability entries (prompt's, then completion's) sent so far."""
        self.usage = {"prompt_tokens": sum(len(ids) for ids, _ in encoded) * body.n,
                      "completion_tokens": 0, "total_tokens": 0}

    async def answer(self, request: Request) -> JSONResponse | StreamingResponse:
        if self.body.stream:
            return StreamingResponse(self.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.whole(request)

    @staticmethod
    def _check(ids: list[int], max_tokens: int | None, engine: LMEngine,
               limits: Limits) -> tuple[list[int], int]:
        """The prompt's ids and its completion's token budget, or a 400."""
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit "
                           f"of {limits.max_tokens}", param="max_tokens")
        room = engine.kv_positions()
        if room is not None and len(ids) + 1 > room:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this server's KV memory "
                           f"holds {room} positions in all (--kv-memory)", param="prompt",
                           code="kv_memory_exceeded")
        window = engine.context or limits.max_prompt_tokens
        if max_tokens is None:
            # A chat reply may run to the end of the window (past it, the window slides).
            if len(ids) >= window:
                raise ApiError(400, f"the prompt is {len(ids)} tokens; the model reads at "
                               f"most {window}, with room for the reply",
                               param="messages", code="context_length_exceeded")
            return ids, min(window - len(ids), limits.max_tokens)
        if len(ids) > window:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the model reads at most "
                           f"{window}", param="prompt", code="context_length_exceeded")
        return ids, max_tokens

    def _deliver(self, index: int, mailbox: Mailbox):
        def deliver(token: int | None, reason: str | None) -> None:
            mailbox.post(self.events, (index, token, reason))
        return deliver

    async def _next(self) -> tuple[int, int | None]:
        """Take in the next (index, token) from the engine; token None means the sequence
        ended. A token that completes a stop string cancels its sequence."""
        try:
            index, token, reason = self.events.get_nowait()
        except asyncio.QueueEmpty:
            index, token, reason = await self.events.get()
        choice, seq = self.choices[index], self.seqs[index]
        if token is not None:
            if self.errors[index] is not None:
                return index, None  # a token that was on its way when the choice failed
            if self.first_token is None:
                self.first_token = time.perf_counter()
            try:
                choice.add(token)
            except Exception as e:
                log.error("detokenizing failed for one sequence: %s", e, exc_info=e)
                self.errors[index] = f"detokenizing failed: {type(e).__name__}: {e}"
                seq.cancel()
                return index, None
            if choice.stopped:
                seq.cancel()
        else:
            self.usage["completion_tokens"] += len(choice.ids if choice.stopped else seq.tokens)
            if reason == "error" and self.errors[index] is None:
                self.errors[index] = seq.error or "decoding failed"
            if self.errors[index] is not None:
                reason = "error"
            self.reasons[index] = "stop" if choice.stopped or reason == "stop" else reason
        return index, token

    def _finished(self) -> bool:
        return all(r is not None for r in self.reasons)

    def _cancel(self) -> None:
        for seq in self.seqs:
            seq.cancel()

    # What serving/turn.py's Reply reads a run through.
    take = _next
    finished = _finished
    cancel = _cancel

    def _echo(self, index: int) -> str:
        return self._prompt_text(index) if self.echo else ""

    def _stream_echo(self, index: int) -> str:
        """The prompt, in the first chunk of a stream that echoes it with log-probabilities
        (it is scored by then)."""
        if self.logprobs is None or self.logprobs_sent[index] > 0:
            return ""
        return self._echo(index)

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model_name}

    def _chunk_head(self) -> dict[str, Any]:
        """The head of a stream's chunk."""
        return self._head()

    def _logprobs(self, index: int, start: int = 0, end: int | None = None
                  ) -> dict[str, Any] | None:
        """OpenAI's legacy log-probabilities of choice `index`'s tokens [start, end) (the
        prompt's first when echoed): each token's text, its log-probability (None for the
        first prompt token), the likeliest tokens and the chosen one with theirs, and its
        offset in the prompt + completion text (a special token shows its name, and takes
        no room in the text)."""
        if self.logprobs is None:
            return None
        seq = self.seqs[index]
        entries: list[tuple[int, Any]] = []
        if self.echo:
            entries += zip(seq.prompt, seq.prompt_logprobs or [None] * len(seq.prompt),
                           strict=True)
        entries += zip(self._generated(index), seq.logprobs, strict=False)
        texts = [self.token_texts(token) for token, _ in entries]
        offset = 0 if self.echo else len(self._prompt_text(index))
        offsets = []
        for token, _ in entries:
            offsets.append(offset)
            offset += len(self.token_texts.piece(token))
        top: list[dict[str, float] | None] = []
        for (_, scored), text in zip(entries, texts, strict=True):
            if scored is None:
                top.append(None)
                continue
            likeliest = {self.token_texts(t): lp for t, lp in scored[1]}
            top.append({**likeliest, text: scored[0]})
        window = slice(start, end)
        return {"tokens": texts[window],
                "token_logprobs": [None if e is None else e[0] for _, e in entries][window],
                "top_logprobs": top[window], "text_offset": offsets[window]}

    def _prompt_text(self, index: int) -> str:
        return self.prompts[index // self.body.n]

    def _generated(self, index: int) -> list[int]:
        """The tokens choice `index` drew, with the end-of-text token that ended it (it has
        no text, but clients that score text count on it: OpenAI's and vLLM's list it)."""
        seq, choice = self.seqs[index], self.choices[index]
        ended = seq.end_token is not None and self.reasons[index] is not None
        return choice.ids + [seq.end_token] if ended and not choice.stopped else choice.ids

    def _opening(self, index: int) -> str | None:
        """A stream's first chunk for a choice, before any token: the echoed prompt (with
        log-probabilities, it goes with the first piece instead, once it is scored)."""
        if self._echo(index) and self.logprobs is None:
            return self._chunk(index, self._echo(index), None)
        return None

    def _choice_body(self, index: int) -> dict[str, Any]:
        """Choice `index` in the whole answer."""
        return {"index": index, "text": self._echo(index) + self.choices[index].text,
                "logprobs": self._logprobs(index), "finish_reason": self.reasons[index]}

    def _chunk(self, index: int, text: str, reason: str | None,
               logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return f"data: {json.dumps({**self._head(), 'choices': [choice]})}\n\n"

    def _chunk_logprobs(self, index: int) -> dict[str, Any] | None:
        """The log-probabilities of the tokens not sent yet in a stream."""
        if self.logprobs is None:
            return None
        done = self.logprobs_sent[index]
        prompt = len(self.seqs[index].prompt) if self.echo else 0
        self.logprobs_sent[index] = prompt + len(self._generated(index))
        return self._logprobs(index, done, self.logprobs_sent[index])

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of final text, a last chunk per choice with
        its finish reason, usage if asked, then [DONE]."""
        try:
            for index in range(len(self.seqs)):
                opening = self._opening(index)
                if opening is not None:
                    yield opening
            while not self._finished():
                index, token = await self._next()
                choice = self.choices[index]
                if self.errors[index] is not None:
                    error = {"message": self.errors[index], "type": "server_error",
                             "param": None, "code": None}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    return
                if token is not None and not choice.stopped:
                    piece = choice.ready(final=False)
                    if piece:
                        yield self._chunk(index, self._stream_echo(index) + piece, None,
                                          self._chunk_logprobs(index))
                elif token is None:
                    if self.reasons[index] == "error":
                        error = {"message": self.errors[index] or "decoding failed",
                                 "type": "server_error", "param": None, "code": None}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                        return
                    yield self._chunk(index, self._stream_echo(index) + choice.ready(final=True),
                                      self.reasons[index], self._chunk_logprobs(index))
            options = self.body.stream_options
            if options is not None and options.include_usage:
                self.usage["total_tokens"] = (self.usage["prompt_tokens"]
                                              + self.usage["completion_tokens"])
                last = {**self._chunk_head(), "choices": [], "usage": self.usage}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # The client left (or the stream ended): stop whatever still decodes.
            self._cancel()

    async def whole(self, request: Request) -> JSONResponse:
        """The answer once every choice has ended; a client that leaves before cancels."""
        try:
            while not self._finished():
                if not self.events.empty():
                    await self._next()
                    continue
                try:
                    await asyncio.wait_for(self._next(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        log.info("client left; cancelling %s", self.id)
                        return JSONResponse({}, status_code=499)
        finally:
            self._cancel()
        failed = [e for e in self.errors if e is not None]
        if failed:
            raise ApiError(500, failed[0], type="server_error")
        end = time.perf_counter()
        log.info("%s: first token after %.3f s, done after %.3f s", self.id,
                 (self.first_token or end) - self.submitted, end - self.submitted)
        self.usage["total_tokens"] = self.usage["prompt_tokens"] + self.usage["completion_tokens"]
        for choice in self.choices:
            choice.ready(final=True)
        choices = [self._choice_body(i) for i in range(len(self.choices))]
        return JSONResponse({**self._head(), "choices": choices, "usage": self.usage})


# --- translations -----------------------------------------------------------------------


async def translate_lines(body: TranslationRequest, request: Request,
                          engine: TranslationEngine, model_name: str,
                          limits: Limits) -> JSONResponse:
    if not 1 <= len(body.input) <= limits.max_lines:
        raise ApiError(400, f"input holds {len(body.input)} lines; send 1 to "
                       f"{limits.max_lines}", param="input")
    if body.n_best > body.beam:
        raise ApiError(400, f"n_best {body.n_best} may not exceed beam {body.beam}",
                       param="n_best")
    if body.max_len_a == 0 and body.max_len_b == 0:
        raise ApiError(400, "max_len_a and max_len_b may not both be 0", param="max_len_b")
    limit = engine.model.cfg.max_len
    for i, line in enumerate(body.input):
        try:
            n = len(engine.tokenizer.encode(line))
        except TformerError as e:
            raise ApiError(400, f"input line {i}: {e}", param="input") from None
        if n + 1 > limit:
            raise ApiError(400, f"input line {i} is {n} tokens; the model reads at most "
                           f"{limit - 1}", param="input", code="context_length_exceeded")
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def done(results: Any) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(results))

    options = SearchOptions(beam=body.beam, alpha=body.alpha, max_len_a=body.max_len_a,
                            max_len_b=body.max_len_b, n_best=body.n_best)
    job = TranslationJob(list(body.input), options, done)
    if not engine.submit(job):
        raise ApiError(503, "the server is busy; try again shortly", type="server_error",
                       code="overloaded", headers={"Retry-After": str(limits.retry_after_s)})
    while True:
        try:
            results = await asyncio.wait_for(asyncio.shield(future), timeout=0.5)
            break
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled = True
                return JSONResponse({}, status_code=499)
    for i, hyps in enumerate(results):
        if hyps is None:
            raise ApiError(500, f"input line {i}: {job.errors.get(i, 'translation failed')}",
                           type="server_error")
    data = []
    for i, hyps in enumerate(results):
        item: dict[str, Any] = {"index": i, "text": hyps[0].text}
        if body.scores:
            item["score"] = hyps[0].score
        if body.n_best > 1:
            item["n_best"] = [{"text": h.text, **({"score": h.score} if body.scores else {})}
                              for h in hyps]
        data.append(item)
    return JSONResponse({"object": "translation", "model": model_name, "data": data})
