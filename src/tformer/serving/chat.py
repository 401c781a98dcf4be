"""Answering chat completions: the messages rendered by the model's chat template (with the
tools offered, serving/tools.py), decoded as a completion, and answered as
chat.completion (or a stream of chat.completion.chunk deltas), the model's tool calls read
out of its reply into `tool_calls`."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tformer.data.chat import ChatTemplate
from tformer.errors import TformerError
from tformer.serving.completions import Completion
from tformer.serving.protocol import ApiError, ChatRequest, Limits
from tformer.serving.scheduler import LMEngine
from tformer.serving.structured import request_constraint
from tformer.serving.tokens import TokenTexts
from tformer.serving.turn import (
    ArgumentsDelta,
    CallBegun,
    CallReader,
    ChatTurn,
    Finished,
    Server,
    TextDelta,
    logprob_entries,
    prepare_turn,
    read_reply,
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
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    param = "response_format" if body.response_format is not None else "structured_outputs"
    # The request as the neutral turn every chat endpoint makes (serving/turn.py): the
    # request itself is the sampling settings.
    turn = ChatTurn([m.model_dump(exclude_none=True) for m in body.messages], body,
                    max_tokens=body.budget(), stops=stops, tools=body.tools,
                    tool_choice=body.tool_choice,
                    parallel_tool_calls=body.parallel_tool_calls is not False,
                    constraint=request_constraint(body.response_format,
                                                  body.structured_outputs),
                    constraint_param=param)
    server = Server(engine, tokenizer, model_name, limits, template, chat_stops)
    ready = await prepare_turn(turn, server)
    stop_texts, stop_tokens = chat_stops
    run = ChatCompletion(body, engine, tokenizer, model_name, limits,
                         request.app.state.mailbox, prompts=[(ready.text, ready.ids)],
                         max_tokens=turn.max_tokens, echo=False,
                         logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                         stops=stops + stop_texts, stop_tokens=stop_tokens,
                         constraint=ready.grammar)
    run.form = ready.form
    run.reader = CallReader(len(run.seqs), ready.form, turn.parallel_tool_calls)
    return await run.answer(request)


def openai_reason(finished: Finished) -> str:
    """A finished reply's finish_reason in OpenAI's words."""
    return "stop" if finished.reason == "stop_sequence" else finished.reason


class ChatCompletion(Completion):
    """One chat completions request: a Completion of the rendered messages, answered as
    chat.completion (or a stream of chat.completion.chunk objects with deltas)."""

    object_name = "chat.completion"
    id_prefix = "chatcmpl"
    form: str | None = None
    """How the model writes tool calls (serving/tools.py), where they are read."""
    reader: CallReader

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
        """A stream's pieces of a reply that may hold tool calls, as the reader
        (serving/turn.py) gives them: its text up to where a call may start is content,
        sent as it comes; each call is sent as it is written (its id and name once whole,
        then its arguments' text piece by piece); a reply whose calls turn out not to
        parse, at the end. Log-probabilities go with the first content delta."""
        chunks = []
        for event in self.reader.feed(index, text, reason):
            if isinstance(event, TextDelta):
                chunks.append(self._event(index, {"content": event.text}, None, logprobs))
                logprobs = None
            elif isinstance(event, CallBegun):
                chunks.append(self._event(index, {"tool_calls": [{
                    "index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}]}, None))
            elif isinstance(event, ArgumentsDelta):
                chunks.append(self._event(index, {"tool_calls": [{
                    "index": event.index, "function": {"arguments": event.text}}]}, None))
            elif isinstance(event, Finished):
                chunks.append(self._event(index, {}, openai_reason(event)))
        if logprobs:
            chunks.insert(0, self._event(index, {"content": ""}, None, logprobs))
        return "".join(chunks)

    def _chunk_head(self) -> dict[str, Any]:
        return {**self._head(), "object": "chat.completion.chunk"}

    def _opening(self, index: int) -> str | None:
        return self._chunk(index, "", None, role=True)

    def _choice_body(self, index: int) -> dict[str, Any]:
        text, reason = self.choices[index].text, self.reasons[index]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.form is not None:
            whole = read_reply(text, self.form, self.reader.parallel, reason or "stop", index)
            # Beside calls, no text is null (as OpenAI's API has it); alone, it is "".
            message = {"role": "assistant",
                       "content": whole.content if whole.calls else whole.content or ""}
            if whole.calls:
                message["tool_calls"] = [call.as_dict() for call in whole.calls]
            reason = openai_reason(whole)
        return {"index": index, "message": message, "logprobs": self._logprobs(index),
                "finish_reason": reason}

    def _logprobs(self, index: int, start: int = 0, end: int | None = None
                  ) -> dict[str, Any] | None:
        """OpenAI's chat log-probabilities of the reply's tokens [start, end): each token's
        text, UTF-8 bytes, log-probability and the likeliest tokens with theirs."""
        if self.logprobs is None:
            return None
        seq, choice = self.seqs[index], self.choices[index]
        content = logprob_entries(self.token_texts,
                                  zip(choice.ids, seq.logprobs, strict=False))
        return {"content": content[start:end]}
