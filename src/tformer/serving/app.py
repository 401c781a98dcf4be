"""The HTTP routes: OpenAI-style completions (with log-probabilities) and chat completions
for language models, translations for seq2seq models, the remote-tokenizer routes
(/tokenizer_info, /tokenize, /detokenize), health and Prometheus metrics; with the limits
and the errors of a public server.

Log-probabilities are those of the distribution each token is drawn from: the model's,
after frequency and presence penalties and logit bias, before temperature, top-k and top-p.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so that
clients written for OpenAI's API report them as they would report OpenAI's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from tformer.decoding.translate import SearchOptions
from tformer.errors import TformerError
from tformer.serving.chat import TEMPLATE_FILE, ChatTemplate, ChatTemplateError
from tformer.serving.scheduler import (
    SEED_LIMIT,
    LMEngine,
    Sampling,
    Sequence,
    TranslationBatcher,
    TranslationJob,
)
from tformer.serving.tokens import TokenTexts, special_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    """For models without a fixed window; a KV-cache model's context is its own limit."""
    max_tokens: int = 2048
    max_lines: int = 256
    """Lines in one translation request."""
    retry_after_s: int = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# --- request bodies ---------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


Prompt = str | list[str] | list[int] | list[list[int]]
"""One text, several, one list of token ids, or several."""


class SamplingFields(Strict):
    """What completions and chat completions share: how to draw, how many, where to stop.

    frequency_penalty and presence_penalty are OpenAI's: a token's logit is lowered by
    frequency_penalty for each time it was drawn before in this completion, and by
    presence_penalty once if it was; logit_bias adds to the logits of the token ids given.
    `user` is accepted and ignored."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < SEED_LIMIT:
            raise ValueError(f"must be between 0 and {SEED_LIMIT - 1}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop holds up to 4 non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids; {key!r} is not one")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {key}: a bias is between -100 and 100, not {bias}")
        if value is not None and len(value) > 1024:
            raise ValueError("at most 1024 tokens may be biased")
        return value

    def bias_for(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, each id in the vocabulary."""
        pairs = tuple((int(k), v) for k, v in (self.logit_bias or {}).items())
        bad = next((t for t, _ in pairs if t >= vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"logit_bias: token id {bad} is outside the vocabulary (0 to "
                           f"{vocab_size - 1})", param="logit_bias")
        return pairs


class CompletionRequest(SamplingFields):
    """OpenAI's completions request. Accepted for its clients with no effect: `user`, and
    `best_of` when it equals n (one draw per choice is all this server makes)."""

    model: str | None = None
    prompt: Prompt
    max_tokens: int = Field(16, ge=0)
    """0 with echo and logprobs: score the prompt only."""
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    suffix: None = None
    """OpenAI's insertion; only null (what clients send by default) is taken."""

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: Prompt) -> Prompt:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list holds no prompt")
            if isinstance(value[0], list | str) and len(value) > 64:
                raise ValueError("a list of prompts holds 1 to 64 of them")
            if isinstance(value[0], list) and not all(value):
                raise ValueError("a list of token ids may not be empty")
        return value


class ChatMessage(Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    """A text, or OpenAI's content parts, handed to the template as they are."""
    name: str | None = None


class ChatRequest(SamplingFields):
    """OpenAI's chat completions request.

    Accepted for OpenAI's clients with no effect: `user`, `store`, `metadata`,
    `service_tier`, `parallel_tool_calls`; `tools` empty, `tool_choice` "none" or "auto",
    `response_format` {"type": "text"} (what they mean when they are given otherwise is not
    served here, and is a 400)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Either; None: as many as the model's window leaves."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise ValueError("tool calls are not served here")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: str | None) -> str | None:
        if value not in (None, "none", "auto"):
            raise ValueError("tool calls are not served here; 'none' or 'auto' only")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value != {"type": "text"}:
            raise ValueError('only {"type": "text"} is served here')
        return value

    def budget(self) -> int | None:
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ApiError(400, f"max_tokens {self.max_tokens} and max_completion_tokens "
                           f"{self.max_completion_tokens} differ; give one",
                           param="max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """Accepted for vLLM's clients; tformer's tokenizers add no special tokens to a text."""


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class TranslationRequest(Strict):
    model: str | None = None
    input: list[str]
    beam: int = Field(4, ge=1, le=16)
    alpha: float = Field(0.6, ge=0.0, le=10.0)
    max_len_a: float = Field(1.5, ge=0.0, le=10.0)
    max_len_b: int = Field(10, ge=0, le=1024)
    n_best: int = Field(1, ge=1)
    scores: bool = False


# --- metrics ----------------------------------------------------------------------------


class Metrics:
    """Counters in the Prometheus text format (version 0.0.4)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.started = time.monotonic()
        self._recent: list[tuple[float, int]] = []

    def count(self, route: str, status: int) -> None:
        self.requests[route, status] = self.requests.get((route, status), 0) + 1

    def tokens_per_second(self, total: int) -> float:
        """Generated tokens per second over the last ten seconds or so."""
        now = time.monotonic()
        self._recent.append((now, total))
        self._recent = [(t, n) for t, n in self._recent if now - t <= 10.0]
        t0, n0 = self._recent[0]
        if now - t0 < 1.0:  # too short a window to say: the average since start
            t0, n0 = self.started, 0
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def render(self, engine: LMEngine | TranslationBatcher) -> str:
        lines = ["# HELP tformer_requests_total HTTP requests by route and status.",
                 "# TYPE tformer_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'tformer_requests_total{{route="{route}",status="{status}"}} {n}')
        stats = engine.stats
        for name, kind, help_, value in [
            ("generated_tokens_total", "counter", "Tokens generated.", stats.generated_tokens),
            ("decoding_steps_total", "counter", "Batched decoding steps.", stats.steps),
            ("prefill_passes_total", "counter", "Forward passes reading joining prompts.",
             stats.prefills),
            ("finished_sequences_total", "counter", "Sequences ended.",
             stats.finished_sequences),
            ("busy_seconds_total", "counter", "Seconds spent decoding.",
             round(stats.busy_seconds, 3)),
            ("tokens_per_second", "gauge", "Tokens generated per second, last ~10 s.",
             round(self.tokens_per_second(stats.generated_tokens), 3)),
            ("queue_length", "gauge", "Requests waiting for a batch.", engine.waiting),
            ("running_sequences", "gauge", "Sequences being decoded.", engine.running),
            ("uptime_seconds", "gauge", "Seconds since start.",
             round(time.monotonic() - self.started, 3)),
        ]:
            lines += [f"# HELP tformer_{name} {help_}", f"# TYPE tformer_{name} {kind}",
                      f"tformer_{name} {value}"]
        return "\n".join(lines) + "\n"


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

    def add(self, token: int) -> None:
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


# --- the application --------------------------------------------------------------------


def create_app(engine: LMEngine | TranslationBatcher, tokenizer: Any, *, model_name: str,
               kind: str, api_key: str | None = None, limits: Limits | None = None,
               created: int | None = None, chat_template: ChatTemplate | None = None
               ) -> FastAPI:
    """kind: 'lm' serves /v1/completions, 'seq2seq' serves /v1/translations.
    created: the model's Unix time (when its checkpoint was written); default now.
    chat_template: the Jinja template that renders chat messages as the model's prompt."""
    limits = limits or Limits()
    created = int(time.time()) if created is None else created
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.mailbox = Mailbox(asyncio.get_running_loop())
        engine.start()
        yield
        # uvicorn has let the requests in flight finish before it gets here.
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="tformer", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message, param = "the body is not valid JSON", None
        elif first.get("type") == "extra_forbidden":
            message, param = f"unknown field {'.'.join(loc)!r}", ".".join(loc)
        else:
            param = ".".join(loc) or None
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       metrics=metrics)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "waiting": engine.waiting,
                "running": engine.running}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "tformer"}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"model {name!r} is not served here; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")

    # The remote-tokenizer routes of vLLM's server, which lm-evaluation-harness looks for
    # (lm_eval.utils.RemoteTokenizer) when it does not hold the model's tokenizer.
    token_texts = TokenTexts(tokenizer)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        names = special_names(tokenizer)
        return {"tokenizer_class": type(tokenizer).__name__, "kind": tokenizer.kind,
                "eos_token": names["eos"], "bos_token": names["bos"],
                "pad_token": names["pad"], "vocab_size": tokenizer.vocab_size,
                "model_max_length": engine.context,
                "chat_template": chat_template.source if chat_template else None}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        try:
            ids = token_texts.encode(body.prompt)
        except TformerError as e:
            raise ApiError(400, f"prompt: {e}", param="prompt") from None
        return {"count": len(ids), "max_model_len": engine.context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary "
                           f"(0 to {vocab - 1})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> dict[str, Any]:
        check_model(name)
        return card

    if kind == "lm":
        assert isinstance(engine, LMEngine)

        @app.post("/v1/completions", response_model=None)
        async def completions(body: CompletionRequest,
                              request: Request) -> JSONResponse | StreamingResponse:
            check_model(body.model)
            return await complete(body, request, engine, tokenizer, model_name, limits)

        chat_stops = end_of_turn(chat_template, token_texts)

        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions(body: ChatRequest,
                                   request: Request) -> JSONResponse | StreamingResponse:
            check_model(body.model)
            if chat_template is None:
                raise ApiError(400, "this model has no chat template: put one in its "
                               f"checkpoint directory as {TEMPLATE_FILE}, or start the server "
                               "with --chat-template FILE", param="messages",
                               code="no_chat_template")
            return await chat(body, request, engine, tokenizer, model_name, limits,
                              chat_template, chat_stops)
    else:
        assert isinstance(engine, TranslationBatcher)

        @app.post("/v1/translations")
        async def translations(body: TranslationRequest, request: Request) -> JSONResponse:
            check_model(body.model)
            return await translate_lines(body, request, engine, model_name, limits)

    return app


KNOWN_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                "/v1/translations", "/tokenizer_info", "/tokenize", "/detokenize")
"""Routes counted by name in /metrics (the rest as 'other')."""


OPEN_ROUTES = ("/health", "/metrics")
"""What answers without the API key."""


class Guard:
    """ASGI middleware in front of every route: the bearer-token check, the body-size limit
    (Content-Length, and bytes counted as they arrive for a chunked body) and the request
    counts. Written for ASGI directly so that streamed responses and the client's
    disconnect pass through untouched."""

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int,
                 metrics: Metrics) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [0]

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            inner_receive = await self._check(scope, receive)
            await self.app(scope, inner_receive, counted_send)
        except ApiError as exc:
            await exc.response()(scope, receive, counted_send)
        self.metrics.count(path if path in KNOWN_ROUTES else "other", status[0])

    async def _check(self, scope: dict, receive: Any) -> Any:
        """Raise ApiError for a request to refuse; else a `receive` that replays the body."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_ROUTES:
            given = headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                               code="invalid_api_key")
        too_large = ApiError(413, f"the body is over {self.max_body_bytes} bytes",
                             code="body_too_large")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise too_large
        if scope["method"] != "POST":
            return receive
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return receive  # the client left: let the route see it
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                raise too_large
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return replay


# --- completions ------------------------------------------------------------------------


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text)
    except TformerError as e:
        raise ApiError(400, f"prompt: {e}", param="prompt") from None
    if ids:
        return ids
    # Nothing to condition on: start from the start of text, as `tformer generate` does.
    return [tokenizer.bos_id] if tokenizer.bos_id is not None else tokenizer.encode("\n")


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
    run = Completion(body, engine, tokenizer, model_name, limits, request.app.state.mailbox,
                     prompts=read_prompts(tokenizer, body.prompt), max_tokens=body.max_tokens,
                     echo=body.echo, logprobs=body.logprobs, stops=stops)
    return await run.answer(request)


class Completion:
    """One completions request: its sequences (n per prompt) in the engine, and the text
    they make, as one answer or as a stream of chunks."""

    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, body: SamplingFields, engine: LMEngine, tokenizer: Any,
                 model_name: str, limits: Limits, mailbox: Mailbox, *,
                 prompts: list[tuple[str, list[int]]], max_tokens: int | None, echo: bool,
                 logprobs: int | None, stops: list[str], stop_tokens: tuple[int, ...] = ()
                 ) -> None:
        """prompts: each prompt's text and ids; max_tokens None: as many as the window
        leaves (up to the server's limit); logprobs: how many likeliest tokens to show
        beside each one's log-probability (None: none)."""
        self.body, self.model_name = body, model_name
        self.echo, self.logprobs = echo, logprobs
        if not engine.batched:
            for name, used in [("logprobs", logprobs is not None),
                               ("logit_bias", bool(body.logit_bias)),
                               ("frequency_penalty", body.frequency_penalty != 0),
                               ("presence_penalty", body.presence_penalty != 0)]:
                if used:
                    raise ApiError(400, f"{name} is served for models decoded with a KV "
                                   f"cache; this model's memory is its cache", param=name)
        bias = body.bias_for(tokenizer.vocab_size)
        self.prompts = [text for text, _ in prompts]
        encoded = [self._check(ids, max_tokens, engine, limits) for _, ids in prompts]
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
                                    stop_tokens=stop_tokens)
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
            self.usage["completion_tokens"] += len(seq.tokens)
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


# --- chat completions -------------------------------------------------------------------


def end_of_turn(template: ChatTemplate | None, token_texts: TokenTexts
                ) -> tuple[list[str], tuple[int, ...]]:
    """What ends a reply besides the end of text: the template's end-of-turn token when
    the tokenizer has it as one token, else its text as a stop string."""
    if template is None or template.end_of_turn is None:
        return [], ()
    try:
        ids = token_texts.encode(template.end_of_turn)
    except TformerError:
        ids = []
    if len(ids) == 1:
        return [], (ids[0],)
    return [template.end_of_turn], ()


async def chat(body: ChatRequest, request: Request, engine: LMEngine, tokenizer: Any,
               model_name: str, limits: Limits, template: ChatTemplate,
               chat_stops: tuple[list[str], tuple[int, ...]]) -> JSONResponse | StreamingResponse:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        text = template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    stop_texts, stop_tokens = chat_stops
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    run = ChatCompletion(body, engine, tokenizer, model_name, limits,
                         request.app.state.mailbox,
                         prompts=[(text, encode_prompt(tokenizer, text))],
                         max_tokens=body.budget(), echo=False,
                         logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                         stops=stops + stop_texts, stop_tokens=stop_tokens)
    return await run.answer(request)


class ChatCompletion(Completion):
    """One chat completions request: a Completion of the rendered messages, answered as
    chat.completion (or a stream of chat.completion.chunk objects with deltas)."""

    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    def _chunk(self, index: int, text: str, reason: str | None,
               logprobs: dict[str, Any] | None = None, *, role: bool = False) -> str:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        if reason is not None and not text:
            delta = {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": reason}
        chunk = {**self._chunk_head(), "choices": [choice]}
        return f"data: {json.dumps(chunk)}\n\n"

    def _chunk_head(self) -> dict[str, Any]:
        return {**self._head(), "object": "chat.completion.chunk"}

    def _opening(self, index: int) -> str | None:
        return self._chunk(index, "", None, role=True)

    def _choice_body(self, index: int) -> dict[str, Any]:
        return {"index": index,
                "message": {"role": "assistant", "content": self.choices[index].text},
                "logprobs": self._logprobs(index), "finish_reason": self.reasons[index]}

    def _logprobs(self, index: int, start: int = 0, end: int | None = None
                  ) -> dict[str, Any] | None:
        """OpenAI's chat log-probabilities of the reply's tokens [start, end): each token's
        text, UTF-8 bytes, log-probability and the likeliest tokens with theirs."""
        if self.logprobs is None:
            return None
        seq, choice = self.seqs[index], self.choices[index]

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_texts(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [{**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                   for token, (lp, top) in zip(choice.ids, seq.logprobs, strict=False)]
        return {"content": content[start:end]}


# --- translations -----------------------------------------------------------------------


async def translate_lines(body: TranslationRequest, request: Request,
                          engine: TranslationBatcher, model_name: str,
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
