"""Ollama's API (what VS Code's Ollama provider, Home Assistant and the ollama client
speak): /api/chat and /api/generate (streamed as NDJSON unless `stream` is false),
/api/embed (and the older /api/embeddings), /api/tags, /api/show, /api/ps and
/api/version. /api/embed's `truncate` (the default) cuts a text to the model's window.

`format` is "json" (any JSON object) or a JSON schema; `options` takes temperature,
top_p, top_k, min_p, seed, stop, num_predict (-1 or -2: up to the window),
frequency_penalty, presence_penalty and repeat_penalty; num_ctx, repeat_last_n,
keep_alive and Ollama's tuning options (num_thread, num_gpu, ...) are accepted and change
nothing (the model is loaded once, with its own window).
Tool calls carry their arguments as JSON objects, and are sent whole. /api/generate wraps
its prompt (and `system`) in the chat template, or with `raw` sends it as it is.
Errors are Ollama's body, {"error": message}.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, field_validator

from tformer.serving.api import Route, read_body
from tformer.serving.api.embeddings import token_lists, vectors
from tformer.serving.completions import encode_prompt
from tformer.serving.protocol import ApiError, SamplingFields, Strict
from tformer.serving.structured import compile_for, response_format_constraint
from tformer.serving.turn import (
    ChatTurn,
    Failed,
    Finished,
    Reply,
    Server,
    TextDelta,
    Usage,
    start_prompt,
    start_turn,
)

if TYPE_CHECKING:
    from tformer.decoding.constraints import Constraint

VERSION = "0.12.0"
"""The Ollama release whose API this follows (clients check for a least version)."""


class Options(Strict):
    """The options that change a reply, with Ollama's defaults."""

    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0)
    seed: int | None = None
    stop: list[str] | None = None
    num_predict: int | None = Field(None, ge=-2)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=100.0)
    """Ollama's name for repetition_penalty (over the prompt and the text)."""
    # Accepted, and nothing changes for them.
    repeat_last_n: int | None = None
    num_ctx: int | None = None
    num_keep: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    use_mmap: bool | None = None
    numa: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop strings are non-empty")
        return value

    def sampling(self) -> SamplingFields:
        return SamplingFields(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, min_p=self.min_p,
                              repetition_penalty=self.repeat_penalty)

    def max_tokens(self) -> int | None:
        if self.num_predict == 0:
            raise ApiError(400, "options.num_predict: 0 writes nothing; give -1 (up to the "
                           "window) or a count", param="options.num_predict")
        return self.num_predict if self.num_predict and self.num_predict > 0 else None


class Common(Strict):
    model: str
    format: str | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class ChatRequest(Common):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(Common):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class EmbedRequest(Strict):
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class LegacyEmbedRequest(Strict):
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(Strict):
    model: str | None = None
    name: str | None = None
    verbose: bool = False


def check_model(name: str | None, server: Server) -> None:
    """Ollama's names carry a tag; ours is ":latest" where none is given."""
    if name is not None and name.removesuffix(":latest") != \
            server.model_name.removesuffix(":latest"):
        raise ApiError(404, f"model {name!r} not found; this server serves "
                       f"{server.model_name!r}", param="model")


def iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def modified(server: Server) -> str:
    return iso(datetime.fromtimestamp(server.created, UTC))


def now() -> str:
    return iso(datetime.now(UTC))


def format_constraint(value: str | dict[str, Any] | None) -> Constraint | None:
    if value in (None, ""):
        return None
    if value == "json":
        return response_format_constraint({"type": "json_object"})
    if isinstance(value, dict):
        try:
            return response_format_constraint(
                {"type": "json_schema", "json_schema": {"name": "format", "schema": value}})
        except ApiError as e:
            raise ApiError(400, e.message.replace("response_format", "format"),
                           param="format") from None
    raise ApiError(400, f"format: {value!r} is not \"json\" or a JSON schema", param="format")


# --- /api/chat and /api/generate --------------------------------------------------------


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages -> chat messages: tool calls' arguments are objects, and a tool's
    answer names its tool rather than a call (it answers the call of that name before it)."""
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role, content = message.get("role"), message.get("content", "")
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}.role: {role!r} is not one of system, user, "
                           f"assistant, tool", param=f"{where}.role")
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: a text, not {type(content).__name__}",
                           param=f"{where}.content")
        if message.get("images"):
            raise ApiError(400, f"{where}.images: this model reads text only",
                           param=f"{where}.images")
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise ApiError(400, f"{where}.tool_calls: a list of calls",
                               param=f"{where}.tool_calls")
            item["tool_calls"] = []
            for j, call in enumerate(message["tool_calls"]):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ApiError(400, f"{where}.tool_calls[{j}]: a call holds "
                                   f"function.name and function.arguments",
                                   param=f"{where}.tool_calls")
                arguments = function.get("arguments", {})
                call_id = f"call_{len(calls)}"
                calls.append({"id": call_id, "name": function["name"]})
                item["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": function["name"],
                    "arguments": arguments if isinstance(arguments, str)
                    else json.dumps(arguments)}})
        if role == "tool":
            name = message.get("tool_name") or message.get("name")
            answered = next((c["id"] for c in reversed(calls) if c["name"] == name),
                            calls[-1]["id"] if calls else "call_0")
            item["tool_call_id"] = answered
        out.append(item)
    if not out:
        raise ApiError(400, "messages: give one message or more", param="messages")
    return out


def counts(usage: Usage, started: float) -> dict[str, Any]:
    total = int((time.perf_counter() - started) * 1e9)
    return {"total_duration": total, "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": 0,
            "eval_count": usage.completion_tokens, "eval_duration": total}


def done_reason(finished: Finished) -> str:
    return "length" if finished.reason == "length" else "stop"


def ollama_calls(finished: Finished) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")}}
            for c in finished.calls]

async def answer(request: Request, reply: Reply, stream: bool, head: dict[str, Any],
                 started: float, body: Callable[..., dict[str, Any]], calls_line: bool = False
                 ) -> Response:
    """A reply as Ollama sends it: one JSON object, or with `stream` (Ollama's default) one
    line of NDJSON a piece of text and a last line with the counts. `body(text, finished)`
    is the endpoint's own part of each object (chat's "message", generate's "response");
    `calls_line`: a reply's tool calls go out whole on a line of their own before the last,
    as Ollama sends them."""
    if not stream:
        (finished,), usage = await reply.collect(request)
        return JSONResponse({**head, "created_at": now(), **body(finished.content or "", finished),
                             "done": True, "done_reason": done_reason(finished),
                             **counts(usage, started)})

    async def lines() -> AsyncIterator[str]:
        finished: Finished | None = None
        async for ev in reply.events():
            if isinstance(ev, Failed):
                yield json.dumps({"error": ev.message}) + "\n"
                return
            if isinstance(ev, TextDelta) and ev.text:
                yield json.dumps({**head, "created_at": now(), **body(ev.text),
                                  "done": False}) + "\n"
            elif isinstance(ev, Finished):
                finished = ev
                if calls_line and ev.calls:
                    yield json.dumps({**head, "created_at": now(), **body("", ev),
                                      "done": False}) + "\n"
            elif isinstance(ev, Usage) and finished is not None:
                yield json.dumps({**head, "created_at": now(), **body(""), "done": True,
                                  "done_reason": done_reason(finished),
                                  **counts(ev, started)}) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")



async def chat(request: Request, server: Server) -> Response:
    started = time.perf_counter()
    body = await read_body(request, ChatRequest)
    check_model(body.model, server)
    turn = ChatTurn(chat_messages(body.messages), body.options.sampling(),
                    max_tokens=body.options.max_tokens(), stops=list(body.options.stop or []),
                    tools=body.tools, constraint=format_constraint(body.format),
                    constraint_param="format")
    reply = await start_turn(turn, server, request.app.state.mailbox)

    def message(content: str, finished: Finished | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if finished is not None and finished.calls:
            out["tool_calls"] = ollama_calls(finished)
        return out

    return await answer(request, reply, body.stream, {"model": body.model}, started,
                        lambda text, finished=None: {"message": message(text, finished)},
                        calls_line=True)


async def generate(request: Request, server: Server) -> Response:
    started = time.perf_counter()
    body = await read_body(request, GenerateRequest)
    check_model(body.model, server)
    for name in ("suffix", "template", "context", "images"):
        if getattr(body, name):
            raise ApiError(400, f"{name}: not served here (the model's own chat template "
                           f"renders the prompt; give raw: true to send it as it is)",
                           param=name)
    head = {"model": body.model}
    if not body.prompt:  # Ollama's way of asking that the model be loaded: it is
        return JSONResponse({**head, "created_at": now(), "response": "", "done": True,
                             "done_reason": "load"})
    constraint = format_constraint(body.format)
    options = body.options
    mailbox = request.app.state.mailbox
    if body.raw:
        grammar = await asyncio.to_thread(compile_for, constraint, server.tokenizer,
                                          server.engine.model.cfg.vocab_size,
                                          batched=server.engine.batched, param="format")
        ids = encode_prompt(server.tokenizer, body.prompt)
        reply = start_prompt(body.prompt, ids, options.sampling(), server, mailbox,
                             max_tokens=options.max_tokens(), stops=list(options.stop or []),
                             grammar=grammar)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        turn = ChatTurn(messages, options.sampling(), max_tokens=options.max_tokens(),
                        stops=list(options.stop or []), constraint=constraint,
                        constraint_param="format")
        reply = await start_turn(turn, server, mailbox)
    return await answer(request, reply, body.stream, head, started, lambda text, finished=None: {
        "response": text})


# --- embeddings and the model's card ----------------------------------------------------


async def embed(request: Request, server: Server) -> Response:
    started = time.perf_counter()
    body = await read_body(request, EmbedRequest)
    check_model(body.model, server)
    lists = token_lists(server, body.input, truncate=body.truncate)
    out = await vectors(server, lists, body.dimensions)
    return JSONResponse({"model": body.model, "embeddings": out.tolist(),
                         "total_duration": int((time.perf_counter() - started) * 1e9),
                         "load_duration": 0,
                         "prompt_eval_count": sum(len(ids) for ids in lists)})


def architecture(server: Server) -> str:
    """The model's kind as Ollama's cards name it ("gpt")."""
    return type(server.engine.model).__name__.lower()


async def embeddings(request: Request, server: Server) -> Response:
    """Ollama's first embeddings route, which older clients still call: one `prompt`, one
    `embedding`."""
    body = await read_body(request, LegacyEmbedRequest)
    check_model(body.model, server)
    out = await vectors(server, token_lists(server, body.prompt, "prompt", truncate=True))
    return JSONResponse({"embedding": out[0].tolist()})


def details(server: Server) -> dict[str, Any]:
    n = sum(p.numel() for p in server.engine.model.parameters())
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    family = architecture(server)
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family], "parameter_size": size, "quantization_level": ""}


def card(server: Server) -> dict[str, Any]:
    name = server.model_name
    digest = hashlib.sha256(name.encode()).hexdigest()
    size = sum(p.numel() * p.element_size() for p in server.engine.model.parameters())
    return {"name": name, "model": name, "modified_at": modified(server), "size": size,
            "digest": digest, "details": details(server)}


async def tags(request: Request, server: Server) -> Response:
    return JSONResponse({"models": [card(server)]})


async def ps(request: Request, server: Server) -> Response:
    # Loaded for as long as the server runs: no expiry to report but a far one.
    return JSONResponse({"models": [{**card(server), "expires_at": "2999-01-01T00:00:00Z",
                                     "size_vram": 0}]})


async def show(request: Request, server: Server) -> Response:
    body = await read_body(request, ShowRequest)
    check_model(body.model or body.name, server)
    cfg, arch = server.engine.model.cfg, architecture(server)
    # As Ollama lists a chat model's (one listed as "embedding" is taken by clients for an
    # embedding-only model); /api/embed answers all the same.
    capabilities = ["completion"] + (["tools"] if server.template else [])
    return JSONResponse({
        "license": "", "modelfile": "", "parameters": "",
        "template": server.template.source if server.template else "",
        "details": details(server),
        "model_info": {"general.architecture": arch,
                       "general.parameter_count": sum(
                           p.numel() for p in server.engine.model.parameters()),
                       f"{arch}.context_length": cfg.context,
                       f"{arch}.embedding_length": cfg.d_model,
                       f"{arch}.block_count": cfg.n_layer},
        "capabilities": capabilities, "modified_at": modified(server)})


async def version(request: Request, server: Server) -> Response:
    return JSONResponse({"version": VERSION})


def error_response(exc: ApiError) -> JSONResponse:
    """Ollama's error body: {"error": message}."""
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


ROUTES = [Route("POST", "/api/chat", chat), Route("POST", "/api/generate", generate),
          Route("POST", "/api/embed", embed), Route("POST", "/api/embeddings", embeddings),
          Route("GET", "/api/tags", tags),
          Route("GET", "/api/ps", ps), Route("POST", "/api/show", show),
          Route("GET", "/api/version", version)]
