"""Anthropic's Messages API, POST /v1/messages and /v1/messages/count_tokens (what Claude
Code and the Anthropic SDK speak): `system`, messages of content blocks (text, tool_use,
tool_result), `tools` with `input_schema`, `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`), `stop_sequences`, `max_tokens` (required), sampling, and
streaming as its events (message_start, content_block_start / delta / stop with text_delta
and input_json_delta, message_delta, message_stop). Errors are its body,
{"type": "error", "error": {"type", "message"}}. `metadata`, `thinking` and
`service_tier` are accepted and change nothing.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, field_validator

from tformer.serving.api import Route, check_model, read_body
from tformer.serving.protocol import ApiError, SamplingFields, Strict
from tformer.serving.turn import (
    ArgumentsDelta,
    CallBegun,
    ChatTurn,
    Failed,
    Finished,
    Server,
    TextDelta,
    Usage,
    render_turn,
    start_turn,
)

STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
                "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


class CountRequest(Strict):
    """What count_tokens reads: a message request without its sampling."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    model: str
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences are non-empty strings")
        return value


# --- the request as a turn --------------------------------------------------------------


def block_text(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A content that may be text only (system, a tool result) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: a text or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in kinds or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}[{j}]: blocks of type {kind!r} are not served "
                           f"here ({', '.join(kinds)})", param=where)
        texts.append(block["text"])
    return "\n".join(texts)


def chat_messages(body: CountRequest) -> list[dict[str, Any]]:
    """Anthropic's messages -> chat messages: an assistant's tool_use blocks are its tool
    calls; a user's tool_result blocks are tool messages (before the user's text)."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": block_text(body.system, "system")})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role: {role!r} is not user or assistant",
                           param=f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content: a text or a list of content blocks",
                           param=f"{where}.content")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(
                        block.get("input", {}), dict):
                    raise ApiError(400, f"{at}: a tool_use block holds a name and an input "
                                   f"object", param=at)
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(400, f"{at}: a tool_result block needs tool_use_id",
                                   param=at)
                text = block_text(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # this server does not reason apart from its reply
            else:
                raise ApiError(400, f"{at}.type: {kind!r} blocks are not served in "
                               f"{role} messages here", param=f"{at}.type")
        out += results
        if texts or calls or not results:
            item: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
            if calls:
                item["tool_calls"] = calls
            out.append(item)
    return out


def chat_tools(body: CountRequest) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """tools and tool_choice -> chat's tools, tool_choice and whether calls may be several."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if not isinstance(tool.get("name"), str):
                raise ApiError(400, f"tools[{i}]: a tool needs a name", param=f"tools.{i}.name")
            if not isinstance(tool.get("input_schema"), dict):
                raise ApiError(400, f"tools[{i}].input_schema: a tool needs its input's "
                               f"JSON schema", param=f"tools.{i}.input_schema")
            function = {"name": tool["name"], "parameters": tool["input_schema"]}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return tools, kind, parallel
    if kind == "any":
        return tools, "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, "tool_choice: one of {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                   "{\"type\": \"none\"}, {\"type\": \"tool\", \"name\": ...}",
                   param="tool_choice")


def turn_of(body: MessagesRequest) -> ChatTurn:
    tools, choice, parallel = chat_tools(body)
    sampling = SamplingFields(temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k)
    return ChatTurn(chat_messages(body), sampling, max_tokens=body.max_tokens,
                    stops=list(body.stop_sequences or []), tools=tools, tool_choice=choice,
                    parallel_tool_calls=parallel)


# --- the answer -------------------------------------------------------------------------


def tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": json.loads(arguments or "{}")}


async def create(request: Request, server: Server) -> Response:
    body = await read_body(request, MessagesRequest)
    check_model(body.model, server)
    reply = await start_turn(turn_of(body), server, request.app.state.mailbox)
    head = {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
            "model": server.model_name}
    if body.stream:
        return StreamingResponse(stream(reply, head), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    (finished,), usage = await reply.collect(request)
    content: list[dict[str, Any]] = []
    if finished.content:
        content.append({"type": "text", "text": finished.content})
    content += [tool_use(c.id, c.name, c.arguments) for c in finished.calls]
    return JSONResponse({**head, "content": content,
                         "stop_reason": STOP_REASONS[finished.reason],
                         "stop_sequence": finished.stop_sequence,
                         "usage": {"input_tokens": usage.prompt_tokens,
                                   "output_tokens": usage.completion_tokens}})


async def stream(reply: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    yield event("message_start", message={
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}})
    block = -1  # the open block's index
    open_kind: str | None = None
    finished: Finished | None = None
    async for ev in reply.events():
        if isinstance(ev, Failed):
            yield event("error", error={"type": "api_error", "message": ev.message})
            return
        if isinstance(ev, TextDelta) and ev.text:
            if open_kind != "text":
                if open_kind is not None:
                    yield event("content_block_stop", index=block)
                block, open_kind = block + 1, "text"
                yield event("content_block_start", index=block,
                            content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=block,
                        delta={"type": "text_delta", "text": ev.text})
        elif isinstance(ev, CallBegun):
            if open_kind is not None:
                yield event("content_block_stop", index=block)
            block, open_kind = block + 1, "tool_use"
            yield event("content_block_start", index=block, content_block={
                "type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        elif isinstance(ev, ArgumentsDelta):
            yield event("content_block_delta", index=block,
                        delta={"type": "input_json_delta", "partial_json": ev.text})
        elif isinstance(ev, Finished):
            finished = ev
            if open_kind is not None:
                yield event("content_block_stop", index=block)
                open_kind = None
        elif isinstance(ev, Usage) and finished is not None:
            yield event("message_delta",
                        delta={"stop_reason": STOP_REASONS[finished.reason],
                               "stop_sequence": finished.stop_sequence},
                        usage={"output_tokens": ev.completion_tokens})
            yield event("message_stop")


async def count_tokens(request: Request, server: Server) -> Response:
    body = await read_body(request, CountRequest)
    check_model(body.model, server)
    tools, choice, parallel = chat_tools(body)
    turn = ChatTurn(chat_messages(body), SamplingFields(), tools=tools, tool_choice=choice)
    _, ids = render_turn(turn, server)
    return JSONResponse({"input_tokens": len(ids)})


def error_response(exc: ApiError) -> JSONResponse:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else
                           "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}},
                        status_code=exc.status, headers=exc.headers)


ROUTES = [Route("POST", "/v1/messages", create),
          Route("POST", "/v1/messages/count_tokens", count_tokens)]
