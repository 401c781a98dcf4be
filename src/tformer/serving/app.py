"""The HTTP application: its routes (OpenAI-style completions and chat completions for
language models, translations for seq2seq models, the remote-tokenizer routes /tokenizer_info,
/tokenize and /detokenize, health and Prometheus metrics), the API key, the limits of a
public server, and its metrics. What a route answers is in serving/completions.py and
serving/chat.py; the
request bodies and the errors in serving/protocol.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tformer.data.chat import TEMPLATE_FILE, ChatTemplate
from tformer.data.tokenizers import special_names, text_start
from tformer.errors import TformerError
from tformer.serving.api import anthropic, embeddings, invalid_body, ollama, responses
from tformer.serving.api.responses import Store
from tformer.serving.chat import chat, end_of_turn
from tformer.serving.completions import Mailbox, complete, translate_lines
from tformer.serving.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    TranslationRequest,
)
from tformer.serving.scheduler import LMEngine
from tformer.serving.tokens import TokenTexts
from tformer.serving.translation import TranslationEngine
from tformer.serving.turn import ClientLeft, Server

if TYPE_CHECKING:
    from tformer.decoding.speculative import SpeculationStats

log = logging.getLogger(__name__)


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

    def render(self, engine: LMEngine | TranslationEngine) -> str:
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
        ] + speculation_figures(stats.speculation) + pool_figures(engine):
            lines += [f"# HELP tformer_{name} {help_}", f"# TYPE tformer_{name} {kind}",
                      f"tformer_{name} {value}"]
        for name, help_, histogram in [
            ("time_to_first_token_seconds", "From queueing to a sequence's first token.",
             getattr(stats, "first_token", None)),
            ("time_between_tokens_seconds", "Between a sequence's tokens.",
             getattr(stats, "between_tokens", None)),
        ]:
            if histogram is not None:
                lines += histogram_lines(f"tformer_{name}", help_, histogram)
        return "\n".join(lines) + "\n"


def histogram_lines(name: str, help_: str, histogram: Any) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for bound, n in zip(histogram.BUCKETS, histogram.counts, strict=True):
        lines.append(f'{name}_bucket{{le="{bound}"}} {n}')
    lines += [f'{name}_bucket{{le="+Inf"}} {histogram.count}',
              f"{name}_sum {round(histogram.sum, 6)}", f"{name}_count {histogram.count}"]
    return lines


def pool_figures(engine: Any) -> list[tuple[str, str, str, Any]]:
    """/metrics' lines of the paged KV pool (none where the engine has none)."""
    pool = getattr(engine, "slots", None)
    if pool is None:
        return []
    return [
        ("kv_blocks_used", "gauge", "KV cache blocks holding sequences.", pool.used),
        ("kv_blocks_free", "gauge", "KV cache blocks free.",
         pool.blocks.available - pool.blocks.idle),
        ("kv_blocks_cached", "gauge", "KV cache blocks no sequence holds, kept for the prefix "
         "cache until their room is needed.", pool.blocks.idle),
        ("preemptions_total", "counter", "Sequences preempted for want of KV blocks.",
         engine.stats.preemptions),
        ("prefix_cache_hit_rate", "gauge", "Prompt positions found in the prefix cache.",
         round(pool.found / pool.looked_up, 4) if pool.looked_up else 0.0),
    ]


def speculation_figures(spec: SpeculationStats | None) -> list[tuple[str, str, str, Any]]:
    """/metrics' lines of speculative decoding (none where the server does not draft)."""
    if spec is None:
        return []
    return [
        ("draft_tokens_total", "counter", "Tokens drafted (--draft, --prompt-lookup).",
         spec.drafted),
        ("accepted_draft_tokens_total", "counter", "Drafted tokens the model accepted.",
         spec.accepted),
        ("speculative_rounds_total", "counter", "Decoding steps that verified drafts.",
         spec.rounds),
        ("draft_acceptance_rate", "gauge", "Accepted of drafted tokens since start.",
         round(spec.acceptance_rate, 4)),
    ]


# --- the application --------------------------------------------------------------------


def create_app(engine: LMEngine | TranslationEngine, tokenizer: Any, *, model_name: str,
               kind: str, api_key: str | None = None, limits: Limits | None = None,
               created: int | None = None, chat_template: ChatTemplate | None = None,
               pooling: str = "mean") -> FastAPI:
    """kind: 'lm' serves /v1/completions, chat and the APIs of serving/api/, 'seq2seq'
    serves /v1/translations.
    created: the model's Unix time (when its checkpoint was written); default now.
    chat_template: the Jinja template that renders chat messages as the model's prompt.
    pooling: how embeddings pool a text's states (tformer.decoding.embeddings)."""
    limits = limits or Limits()
    created = int(time.time()) if created is None else created
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.mailbox = Mailbox(asyncio.get_running_loop())
        app.state.responses = Store()
        engine.start()
        yield
        # uvicorn has let the requests in flight finish before it gets here.
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="tformer", lifespan=lifespan, docs_url=None, redoc_url=None)

    # Each API answers its errors in its own words (serving/api/); the rest in OpenAI's.
    shapes = {route.path: module.error_response for module in API_MODULES
              for route in module.ROUTES} if kind == "lm" else {}

    def shaped(path: str, exc: ApiError) -> JSONResponse:
        return shapes.get(path, ApiError.response)(exc)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return shaped(request.url.path, exc)

    @app.exception_handler(ClientLeft)
    async def _left(request: Request, exc: ClientLeft) -> JSONResponse:
        return JSONResponse({}, status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return shaped(request.url.path, invalid_body(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return shaped(request.url.path, ApiError(exc.status_code, str(exc.detail), code=code))

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       metrics=metrics, shapes=shapes)

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
        if body.add_special_tokens:
            ids = text_start(tokenizer, ids)
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

        server = Server(engine, tokenizer, model_name, limits, chat_template, chat_stops,
                        created=created, pooling=pooling)
        for module in API_MODULES:
            for route in module.ROUTES:
                app.add_api_route(route.path, bound(route.handler, server),
                                  methods=[route.method], response_model=None)
    else:
        assert isinstance(engine, TranslationEngine)

        @app.post("/v1/translations")
        async def translations(body: TranslationRequest, request: Request) -> JSONResponse:
            check_model(body.model)
            return await translate_lines(body, request, engine, model_name, limits)

    return app


API_MODULES = (responses, anthropic, ollama, embeddings)
"""serving/api/'s adapters: each one's ROUTES become routes of a language model's server."""


def bound(handler: Any, server: Server) -> Any:
    """A route's handler with the server it answers for."""
    async def endpoint(request: Request) -> Any:
        return await handler(request, server)
    endpoint.__name__ = handler.__module__.rsplit(".", 1)[-1] + "_" + handler.__name__
    return endpoint


KNOWN_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                "/v1/translations", "/tokenizer_info", "/tokenize", "/detokenize",
                *(route.path for module in API_MODULES for route in module.ROUTES))
"""Routes counted by name in /metrics (the rest as 'other')."""


OPEN_ROUTES = ("/health", "/metrics")
"""What answers without the API key."""


class Guard:
    """ASGI middleware in front of every route: the bearer-token check, the body-size limit
    (Content-Length, and bytes counted as they arrive for a chunked body) and the request
    counts. Written for ASGI directly so that streamed responses and the client's
    disconnect pass through untouched."""

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int,
                 metrics: Metrics, shapes: dict[str, Any] | None = None) -> None:
        self.app = app
        self.shapes = shapes or {}
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
            shape = self.shapes.get(path, ApiError.response)
            await shape(exc)(scope, receive, counted_send)
        self.metrics.count(path if path in KNOWN_ROUTES else "other", status[0])

    async def _check(self, scope: dict, receive: Any) -> Any:
        """Raise ApiError for a request to refuse; else a `receive` that replays the body."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_ROUTES:
            # Anthropic's clients send the key as x-api-key.
            given = headers.get("authorization", "").encode()
            other = headers.get("x-api-key", "").encode()
            if not (secrets.compare_digest(given, f"Bearer {self.api_key}".encode())
                    or secrets.compare_digest(other, self.api_key.encode())):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY, or "
                               "x-api-key: KEY)", code="invalid_api_key")
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


