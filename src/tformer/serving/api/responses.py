"""OpenAI's Responses API, POST /v1/responses (what Codex CLI and the openai-agents SDK
speak): `input` as a text or as items (messages, function_call, function_call_output),
`instructions`, function `tools` with `tool_choice`, `text.format` (json_schema or
json_object), `max_output_tokens`, sampling, streaming as typed server-sent events, and
`previous_response_id` over a bounded in-memory store of the conversations answered
(`store: false` keeps one out of it). `reasoning`, `include`, `truncation`, `metadata`,
`user` and `service_tier` are accepted and change nothing.

A response holds the reply's text as one `message` item and each tool call as a
`function_call` item. Instructions are not carried to a later response (as OpenAI's
are not): each request gives its own.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from tformer.serving.api import Route, check_model, read_body
from tformer.serving.protocol import ApiError, SamplingFields, Strict
from tformer.serving.structured import response_format_constraint
from tformer.serving.tools import ToolCall
from tformer.serving.turn import (
    ArgumentsDelta,
    CallBegun,
    ChatTurn,
    Failed,
    Finished,
    Logprobs,
    Server,
    TextDelta,
    Usage,
    start_turn,
)

if TYPE_CHECKING:
    from tformer.decoding.constraints import Constraint


class TextOptions(Strict):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    include: list[str] | None = None
    """Of what OpenAI's may hold, "message.output_text.logprobs" is read; the rest changes
    nothing."""
    # Accepted, and nothing changes for them.
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """With include ["message.output_text.logprobs"]: the likeliest tokens beside each."""
    stream_options: dict[str, Any] | None = None


class Store:
    """The conversations answered (each response's messages, its own included), the newest
    `size`, for `previous_response_id`."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        if response_id not in self.items:
            raise ApiError(400, f"previous_response_id: no response {response_id!r} is "
                           f"stored here (this server keeps the last {self.size}, and none "
                           f"made with store: false)", param="previous_response_id",
                           code="previous_response_not_found")
        self.items.move_to_end(response_id)
        return self.items[response_id]

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self.items[response_id] = messages
        while len(self.items) > self.size:
            self.items.popitem(last=False)


# --- the request as a turn --------------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` -> chat messages: a text is one user message; consecutive function_call
    items become one assistant message's tool calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role, content = item.get("role"), item.get("content")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: {role!r} is not one of user, assistant, "
                               f"system, developer", param=f"{where}.role")
            messages.append({"role": role, "content": message_text(content, where)})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise ApiError(400, f"{where}: a function_call holds name and arguments "
                               f"(JSON text)", param=where)
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise ApiError(400, f"{where}: a function_call_output holds call_id and "
                               f"output", param=where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": message_text(output, where)})
        elif kind == "reasoning":
            continue  # this server does not reason apart from its reply
        else:
            raise ApiError(400, f"{where}.type: items of type {kind!r} are not served here "
                           f"(message, function_call, function_call_output)",
                           param=f"{where}.type")
    return messages


def message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a text or a list of text parts",
                       param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}]: parts of type {kind!r} are not "
                           f"served here (input_text, output_text)",
                           param=f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise ApiError(400, f"tools[{i}]: only function tools are served here, "
                           f"{{\"type\": \"function\", \"name\": ..., \"parameters\": ...}}",
                           param="tools")
        if not isinstance(tool.get("parameters"), dict):
            raise ApiError(400, f"tools[{i}].parameters: a function tool needs a JSON schema "
                           f"(an object)", param="tools")
        function = {"name": tool["name"], "parameters": tool["parameters"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def text_constraint(text: TextOptions | None) -> Constraint | None:
    """`text.format` as chat's response_format reads it."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        spec.setdefault("name", "response")
        fmt = {"type": "json_schema", "json_schema": spec}
    try:
        return response_format_constraint(fmt)
    except ApiError as e:
        raise ApiError(400, e.message.replace("response_format", "text.format"),
                       param="text.format") from None


LOGPROBS = "message.output_text.logprobs"


def turn_of(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatTurn:
    messages = history + input_messages(body.input)
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}] + messages
    sampling = SamplingFields(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p)
    return ChatTurn(messages, sampling, max_tokens=body.max_output_tokens,
                    tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
                    parallel_tool_calls=body.parallel_tool_calls is not False,
                    constraint=text_constraint(body.text), constraint_param="text.format",
                    logprobs=(body.top_logprobs or 0) if LOGPROBS in (body.include or [])
                    else None)


# --- the answer -------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}] if status == "completed" or text else []}


def call_item(call: ToolCall, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


class Answer:
    """One response being made: its head, its output items, its usage."""

    def __init__(self, body: ResponsesRequest, server: Server) -> None:
        self.body = body
        self.id = f"resp_{secrets.token_hex(16)}"
        self.created = int(time.time())
        self.model = server.model_name
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self.usage: dict[str, Any] | None = None

    def body_json(self) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": self.status, "model": self.model, "output": self.output,
            "error": None, "incomplete_details": self.incomplete,
            "instructions": body.instructions, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "text": {"format": (body.text.format if body.text and body.text.format
                                else {"type": "text"})},
            "reasoning": body.reasoning, "metadata": body.metadata or {},
            "truncation": body.truncation or "disabled", "usage": self.usage,
        }

    def finish(self, finished: Finished, usage: Usage) -> None:
        if finished.reason == "length":
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        self.usage = {"input_tokens": usage.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens}

    def conversation(self, messages: list[dict[str, Any]],
                     finished: Finished) -> list[dict[str, Any]]:
        """The messages a later response continues: the request's (without its
        instructions) and this reply."""
        reply: dict[str, Any] = {"role": "assistant", "content": finished.content or ""}
        if finished.calls:
            reply["tool_calls"] = [c.as_dict() for c in finished.calls]
        return messages + [reply]


async def create(request: Request, server: Server) -> Response:
    body = await read_body(request, ResponsesRequest)
    check_model(body.model, server)
    store: Store = request.app.state.responses
    history = store.get(body.previous_response_id) if body.previous_response_id else []
    turn = turn_of(body, history)
    reply = await start_turn(turn, server, request.app.state.mailbox)
    answer = Answer(body, server)
    own = history + input_messages(body.input)  # without instructions: not carried over
    if body.stream:
        return StreamingResponse(stream(reply, answer, store, own),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    (finished,), usage = await reply.collect(request)
    if finished.content:
        answer.output.append(message_item(f"msg_{secrets.token_hex(12)}", finished.content,
                                          logprobs=reply.logprobs[0]))
    for call in finished.calls:
        answer.output.append(call_item(call, f"fc_{secrets.token_hex(12)}"))
    answer.finish(finished, usage)
    if body.store:
        store.put(answer.id, answer.conversation(own, finished))
    return JSONResponse(answer.body_json())


async def stream(reply: Any, answer: Answer, store: Store,
                 own: list[dict[str, Any]]) -> AsyncIterator[str]:
    """Responses' typed events: created and in_progress; for the text, an output item with
    one output_text part and its deltas; for each call, an output item with its arguments'
    deltas; each item done as it ends; completed (or incomplete) with the whole response."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        data = json.dumps({"type": kind, "sequence_number": seq, **fields})
        return f"event: {kind}\ndata: {data}\n\n"

    yield event("response.created", response=answer.body_json())
    yield event("response.in_progress", response=answer.body_json())
    text_at: int | None = None  # the message item's place in output, once begun
    text = ""
    scored: list[dict[str, Any]] = []  # log-probabilities not yet sent with a delta
    calls: dict[int, int] = {}  # call index -> its place in output
    finished: Finished | None = None

    def close_text() -> list[str]:
        if text_at is None or answer.output[text_at]["status"] == "completed":
            return []
        item = answer.output[text_at] = message_item(answer.output[text_at]["id"], text,
                                                     logprobs=reply.logprobs[0])
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": text_at}
        return [event("response.output_text.done", **where, content_index=0, text=text,
                      logprobs=part["logprobs"]),
                event("response.content_part.done", **where, content_index=0, part=part),
                event("response.output_item.done", output_index=text_at, item=item)]

    def close_call(index: int) -> list[str]:
        at = calls[index]
        item = answer.output[at]
        if item["status"] == "completed":
            return []
        item["status"] = "completed"
        return [event("response.function_call_arguments.done", item_id=item["id"],
                      output_index=at, name=item["name"], arguments=item["arguments"]),
                event("response.output_item.done", output_index=at, item=item)]

    async for ev in reply.events():
        if isinstance(ev, Failed):
            answer.status = "failed"
            body = answer.body_json()
            body["error"] = {"code": "server_error", "message": ev.message}
            yield event("response.failed", response=body)
            return
        if isinstance(ev, TextDelta):
            if text_at is None:
                text_at = len(answer.output)
                item = {**message_item(f"msg_{secrets.token_hex(12)}", "", "in_progress")}
                answer.output.append(item)
                yield event("response.output_item.added", output_index=text_at, item=item)
                yield event("response.content_part.added", item_id=item["id"],
                            output_index=text_at, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
            text += ev.text
            yield event("response.output_text.delta", item_id=answer.output[text_at]["id"],
                        output_index=text_at, content_index=0, delta=ev.text,
                        logprobs=scored)
            scored = []
        elif isinstance(ev, Logprobs):
            scored = scored + ev.entries
        elif isinstance(ev, CallBegun):
            # The text item stays open: a reply whose calls turn out not to parse sends
            # the rest of its text at its end.
            for index in calls:
                for line in close_call(index):
                    yield line
            calls[ev.index] = len(answer.output)
            item = call_item(ToolCall(ev.name, "", ev.id), f"fc_{secrets.token_hex(12)}",
                             "in_progress")
            answer.output.append(item)
            yield event("response.output_item.added", output_index=calls[ev.index], item=item)
        elif isinstance(ev, ArgumentsDelta):
            at = calls[ev.index]
            answer.output[at]["arguments"] += ev.text
            yield event("response.function_call_arguments.delta",
                        item_id=answer.output[at]["id"], output_index=at, delta=ev.text)
        elif isinstance(ev, Finished):
            finished = ev
            for line in close_text():
                yield line
            whole = {c.id for c in ev.calls}
            # A call cut off by max_output_tokens leaves the output.
            answer.output = [item for item in answer.output if item["type"] != "function_call"
                             or item["call_id"] in whole]
            calls = {i: at for i, at in calls.items() if at < len(answer.output)}
            for index in calls:
                for line in close_call(index):
                    yield line
        elif isinstance(ev, Usage) and finished is not None:
            answer.finish(finished, ev)
            if answer.body.store:
                store.put(answer.id, answer.conversation(own, finished))
            kind = "response.completed" if answer.status == "completed" \
                else "response.incomplete"
            yield event(kind, response=answer.body_json())


def error_response(exc: ApiError) -> JSONResponse:
    """OpenAI's error body, as the rest of its API answers."""
    return exc.response()


ROUTES = [Route("POST", "/v1/responses", create)]
