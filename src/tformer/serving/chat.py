"""Answering chat completions: the messages rendered by the model's chat template (with the
tools offered, serving/tools.py), decoded as a completion, and answered as
chat.completion (or a stream of chat.completion.chunk deltas), the model's tool calls read
out of its reply into `tool_calls`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tformer.data.chat import ChatTemplate, ChatTemplateError
from tformer.errors import TformerError
from tformer.serving.completions import Completion, encode_prompt
from tformer.serving.protocol import ApiError, ChatRequest, Limits
from tformer.serving.scheduler import LMEngine
from tformer.serving.structured import compile_for, request_constraint
from tformer.serving.tokens import TokenTexts
from tformer.serving.tools import (
    ToolCall,
    call_format,
    calls_so_far,
    check_tools,
    held_back,
    parse_calls,
    template_messages,
    tool_constraint,
)


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
    # With tool_choice "none" the model still reads the tools (as with OpenAI's and vLLM's),
    # and what it writes is its answer, never read as calls.
    tools, required = check_tools(body.tools, body.tool_choice)
    messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages],
                                 template, tools)
    try:
        text = template.render(messages, add_generation_prompt=True,
                               tools=tools if tools and template.takes_tools else None)
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    form = call_format(template)
    constraint, param = request_constraint(body.response_format, body.structured_outputs), (
        "response_format" if body.response_format is not None else "structured_outputs")
    if required is not None:
        if constraint is not None:
            raise ApiError(400, f"tool_choice {body.tool_choice!r} makes the reply a tool "
                           f"call; it cannot also follow {param}", param="tool_choice")
        # A named function is one call; "required" is one, or several where allowed.
        parallel = required == "" and body.parallel_tool_calls is not False
        constraint = tool_constraint(tools, required, form, parallel)
        param = "tools"
    # Off the event loop: a model's first constraint reads its vocabulary (about a second).
    grammar = await asyncio.to_thread(compile_for, constraint, tokenizer,
                                      engine.model.cfg.vocab_size, batched=engine.batched,
                                      param=param)
    stop_texts, stop_tokens = chat_stops
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    run = ChatCompletion(body, engine, tokenizer, model_name, limits,
                         request.app.state.mailbox,
                         prompts=[(text, encode_prompt(tokenizer, text, rendered=True))],
                         max_tokens=body.budget(), echo=False,
                         logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                         stops=stops + stop_texts, stop_tokens=stop_tokens, constraint=grammar)
    run.form = form if tools and body.tool_choice != "none" else None
    return await run.answer(request)


class ChatCompletion(Completion):
    """One chat completions request: a Completion of the rendered messages, answered as
    chat.completion (or a stream of chat.completion.chunk objects with deltas)."""

    object_name = "chat.completion"
    id_prefix = "chatcmpl"
    form: str | None = None
    """How the model writes tool calls (serving/tools.py), where tools were offered."""

    def _chunk(self, index: int, text: str, reason: str | None,
               logprobs: dict[str, Any] | None = None, *, role: bool = False) -> str:
        if self.form is not None and not role:
            return self._tool_chunks(index, text, reason, logprobs)
        return self._event(index, {"role": "assistant", "content": text} if role
                           else {"content": text} if text or reason is None else {},
                           reason, logprobs)

    def _event(self, index: int, delta: dict[str, Any], reason: str | None,
               logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": reason}
        chunk = {**self._chunk_head(), "choices": [choice]}
        return f"data: {json.dumps(chunk)}\n\n"

    def _tool_chunks(self, index: int, text: str, reason: str | None,
                     logprobs: dict[str, Any] | None) -> str:
        """A stream's pieces of a reply that may hold tool calls: its text up to where a
        call may start is content, sent as it comes; each call is sent as it is written,
        as tool_calls deltas (its id and name once whole, then its arguments' text piece by
        piece); a reply whose calls turn out not to parse, at the end."""
        if not hasattr(self, "_replies"):
            self._replies = [""] * len(self.seqs)
            self._content_sent = [0] * len(self.seqs)
            self._calls_sent: list[list[ToolCall]] = [[] for _ in self.seqs]
        self._replies[index] += text
        reply, sent = self._replies[index], self._content_sent[index]
        events = ""
        if reason is None:
            cut = held_back(reply, self.form or "")
            if cut > sent or logprobs:
                events = self._event(index, {"content": reply[sent:max(cut, sent)]}, None,
                                     logprobs)
                self._content_sent[index] = max(cut, sent)
            events += self._call_deltas(index, calls_so_far(reply, self.form or ""))
            return events
        content, calls = parse_calls(reply, self.form or "")
        if not calls:
            rest = reply[sent:]
            if rest or logprobs:
                events += self._event(index, {"content": rest}, None, logprobs)
            return events + self._event(index, {}, reason)
        before = (content or "")[sent:]
        if before or logprobs:
            events += self._event(index, {"content": before}, None, logprobs)
        events += self._call_deltas(index, [(c.name, c.arguments) for c in calls])
        return events + self._event(index, {}, "tool_calls")

    def _call_deltas(self, index: int, calls: list[tuple[str, str]]) -> str:
        """The tool_calls deltas that bring what the client has of the reply's calls up to
        `calls` (name, arguments so far): a new call's id and name, then the arguments'
        text it has not had. A call's arguments only grow, by construction of
        tools.calls_so_far."""
        events = ""
        sent = self._calls_sent[index]
        for i, (name, arguments) in enumerate(calls):
            if i == len(sent):
                sent.append(ToolCall(name, ""))
                events += self._event(index, {"tool_calls": [{
                    "index": i, "id": sent[i].id, "type": "function",
                    "function": {"name": name, "arguments": ""}}]}, None)
            have = sent[i].arguments
            if len(arguments) > len(have) and arguments.startswith(have):
                events += self._event(index, {"tool_calls": [{
                    "index": i, "function": {"arguments": arguments[len(have):]}}]}, None)
                sent[i].arguments = arguments
        return events

    def _chunk_head(self) -> dict[str, Any]:
        return {**self._head(), "object": "chat.completion.chunk"}

    def _opening(self, index: int) -> str | None:
        return self._chunk(index, "", None, role=True)

    def _choice_body(self, index: int) -> dict[str, Any]:
        text, reason = self.choices[index].text, self.reasons[index]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.form is not None:
            content, calls = parse_calls(text, self.form)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.as_dict() for call in calls]}
                reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": self._logprobs(index),
                "finish_reason": reason}

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
