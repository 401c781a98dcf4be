"""One neutral chat turn, and the reply to it as a stream of neutral events: what every chat
endpoint (OpenAI's chat completions in serving/chat.py; serving/api/: OpenAI's Responses,
Anthropic's Messages, Ollama's /api/chat and /api/generate) maps its request to and its
answer from, as llama.cpp's server does.

A `ChatTurn` holds what a model needs to reply: the messages (in the neutral form
serving/tools.py renders: OpenAI's chat messages, text only), the tools offered, the call
the reply must be (if any), what its text must follow, the sampling settings as one
object, the stop strings, how many replies and how long. `start_turn` renders it with the
model's chat template and submits it to the engine; `Reply.events()` then yields what the
model writes, with the tool calls read out of it in the template's form:

    TextDelta      a piece of final text
    CallBegun      a tool call whose name is whole (its id and name)
    ArgumentsDelta a piece of a call's arguments (JSON text)
    Logprobs       the new tokens' log-probabilities, where the turn asks for them
    Finished       a reply has ended: its reason, and the whole reply read once more
    Usage          tokens read and written, once every reply has ended
    Failed         decoding failed; nothing follows

An adapter turns these into its own frames (server-sent events or NDJSON), or gathers them
(`Reply.collect`) into one answer. The reading of the text into events is `CallReader`'s
alone, and chat completions' stream (which also sends log-probabilities) reads through it
too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tformer.data.chat import ChatTemplate, ChatTemplateError
from tformer.serving.completions import Completion, Mailbox, encode_prompt
from tformer.serving.protocol import ApiError, Limits, SamplingFields
from tformer.serving.scheduler import LMEngine
from tformer.serving.structured import compile_for
from tformer.serving.tokens import TokenTexts
from tformer.serving.tools import (
    ToolCall,
    call_format,
    calls_so_far,
    check_tools,
    ends_in_a_call,
    held_back,
    parse_calls,
    template_messages,
    tool_constraint,
)

if TYPE_CHECKING:
    from tformer.decoding.constraints import Constraint, Grammar

log = logging.getLogger(__name__)


# --- the turn ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTurn:
    """What a chat endpoint asks of the model, in no API's words."""

    messages: list[dict[str, Any]]
    """OpenAI chat messages: role, content (text), tool_calls, tool_call_id, name."""
    sampling: SamplingFields
    """How to draw and how many replies (temperature, top_p, top_k, seed, penalties, n):
    one object, so that a sampling field added to the protocol reaches every endpoint."""
    max_tokens: int | None = None
    """None: as many as the model's window leaves (up to the server's limit)."""
    stops: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    """OpenAI's shape: {"type": "function", "function": {"name", "description",
    "parameters"}}."""
    tool_choice: str | dict[str, Any] | None = None
    """OpenAI's: "auto", "none", "required" or {"type": "function", "function": {"name"}}."""
    parallel_tool_calls: bool = True
    """False: a reply holds at most one call."""
    constraint: Constraint | None = None
    """What the reply's text follows (a JSON schema, ...)."""
    constraint_param: str = "response_format"
    """The request field that asked for `constraint`, to name in errors."""
    logprobs: int | None = None
    """Each token's log-probability and the `logprobs` likeliest (None: none)."""


@dataclass(frozen=True)
class Server:
    """What a route needs of the server to answer a turn."""

    engine: LMEngine
    tokenizer: Any
    model_name: str
    limits: Limits
    template: ChatTemplate | None
    chat_stops: tuple[list[str], tuple[int, ...]]
    """The template's end of turn: as stop strings, or as stop tokens."""
    created: int = 0
    """The model's Unix time (when its checkpoint was written)."""
    pooling: str = "mean"
    """How embeddings pool a text's states (tformer.decoding.embeddings)."""

    def need_template(self, param: str = "messages") -> ChatTemplate:
        if self.template is None:
            raise ApiError(400, "this model has no chat template: put one in its checkpoint "
                           "directory as chat_template.jinja, or start the server with "
                           "--chat-template FILE", param=param, code="no_chat_template")
        return self.template


def render_turn(turn: ChatTurn, server: Server) -> tuple[str, list[int]]:
    """The turn's prompt: the template's text and its token ids."""
    template = server.need_template()
    tools, _ = check_tools(turn.tools, turn.tool_choice)
    messages = template_messages(turn.messages, template, tools)
    try:
        text = template.render(messages, add_generation_prompt=True,
                               tools=tools if tools and template.takes_tools else None)
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    return text, encode_prompt(server.tokenizer, text, rendered=True)


@dataclass(frozen=True)
class Prepared:
    """A turn made ready for the engine."""

    text: str
    ids: list[int]
    grammar: Grammar | None
    form: str | None
    """The form the reply's tool calls are read in; None: the reply is not read for calls
    (no tools, or tool_choice "none")."""


async def prepare_turn(turn: ChatTurn, server: Server) -> Prepared:
    """Render the turn and compile what its reply must follow: its constraint, or the
    grammar of the tool call it requires."""
    template = server.need_template()
    tools, required = check_tools(turn.tools, turn.tool_choice)
    text, ids = render_turn(turn, server)
    form = call_format(template)
    constraint, param = turn.constraint, turn.constraint_param
    if required is not None:
        if constraint is not None:
            raise ApiError(400, f"tool_choice {turn.tool_choice!r} makes the reply a tool "
                           f"call; it cannot also follow {param}", param="tool_choice")
        # A named function is one call; "required" is one, or several where allowed.
        parallel = required == "" and turn.parallel_tool_calls
        constraint, param = tool_constraint(tools, required, form, parallel), "tools"
    # Off the event loop: a model's first constraint reads its vocabulary (about a second).
    grammar = await asyncio.to_thread(compile_for, constraint, server.tokenizer,
                                      server.engine.model.cfg.vocab_size,
                                      batched=server.engine.batched, param=param)
    # With tool_choice "none" the model still reads the tools (as with OpenAI's and vLLM's),
    # and what it writes is its answer, never read as calls.
    reads_calls = bool(tools) and turn.tool_choice != "none"
    return Prepared(text, ids, grammar, form if reads_calls else None)


async def start_turn(turn: ChatTurn, server: Server, mailbox: Mailbox) -> Reply:
    """Prepare the turn and submit its replies to the engine."""
    ready = await prepare_turn(turn, server)
    return start_prompt(ready.text, ready.ids, turn.sampling, server, mailbox,
                        max_tokens=turn.max_tokens, stops=turn.stops,
                        end_of_turn=server.chat_stops, grammar=ready.grammar,
                        form=ready.form, parallel=turn.parallel_tool_calls,
                        logprobs=turn.logprobs)


def start_prompt(text: str, ids: list[int], sampling: SamplingFields, server: Server,
                 mailbox: Mailbox, *, max_tokens: int | None, stops: list[str],
                 end_of_turn: tuple[list[str], tuple[int, ...]] = ([], ()),
                 grammar: Grammar | None = None, form: str | None = None,
                 parallel: bool = True, logprobs: int | None = None) -> Reply:
    """Submit the replies to a prompt already rendered (a turn's, or a raw text's)."""
    stop_texts, stop_tokens = end_of_turn
    sampling = sampling.model_copy(update={"stream": True, "stop": None})
    run = Completion(sampling, server.engine, server.tokenizer, server.model_name,
                     server.limits, mailbox, prompts=[(text, ids)], max_tokens=max_tokens,
                     echo=False, logprobs=logprobs, stops=stops + stop_texts,
                     stop_tokens=stop_tokens, constraint=grammar)
    return Reply(run, form, parallel, user_stops=stops)


# --- the reply's events -----------------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    choice: int
    text: str


@dataclass(frozen=True)
class CallBegun:
    choice: int
    index: int
    """The call's place among the reply's calls."""
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    choice: int
    index: int
    text: str


@dataclass(frozen=True)
class Logprobs:
    choice: int
    entries: list[dict[str, Any]]
    """For each new token, in OpenAI's form: its text ("token"), "logprob", UTF-8 "bytes",
    and "top_logprobs", the likeliest tokens with theirs. Log-probabilities are those of
    the distribution the token is drawn from, before temperature, top-k and top-p."""


@dataclass(frozen=True)
class Finished:
    choice: int
    reason: str
    """"stop" (the end of the turn or of the text), "stop_sequence" (one of the turn's stop
    strings), "length" (max_tokens) or "tool_calls"."""
    content: str | None
    """The reply's text besides its calls (None: none)."""
    calls: list[ToolCall]
    """The whole calls; a call cut off by max_tokens is in neither these nor `content`."""
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = TextDelta | CallBegun | ArgumentsDelta | Logprobs | Finished | Usage | Failed


def logprob_entries(texts: TokenTexts, scored: Iterable[tuple[int, tuple[float, Any]]]
                    ) -> list[dict[str, Any]]:
    """(token, (its log-probability, the likeliest (token, log-probability) pairs)) ->
    OpenAI's chat entries: each token's text, log-probability, UTF-8 bytes and
    top_logprobs, the likeliest tokens with theirs."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = texts(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in top]}
            for token, (lp, top) in scored]


class ClientLeft(Exception):
    """The client left before its answer was whole (the server answers 499, to no one)."""


class Reply:
    """The replies to one turn (n of them, `choice` 0 to n - 1), read as they are decoded.

    Text is sent as it becomes final; where the reply may hold tool calls, the text from
    where a call may start is held back, and each call is sent as it is written (its name
    once whole, then its arguments piece by piece). A reply whose calls turn out not to
    parse sends the rest as text at its end."""

    def __init__(self, run: Completion, form: str | None, parallel: bool, *,
                 user_stops: list[str]) -> None:
        self.run = run
        self.id = run.id
        self.prompt_tokens = run.usage["prompt_tokens"] // max(1, len(run.seqs))
        self.reader = CallReader(len(run.seqs), form, parallel, user_stops=user_stops,
                                 stop_found=lambda index: run.choices[index].stop_found)
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in run.seqs]
        """Each reply's log-probability entries so far (Logprobs events, gathered)."""

    def cancel(self) -> None:
        self.run.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """Every reply's events, then Usage; cancels what still decodes when the reader
        stops reading (a client that left)."""
        run = self.run
        try:
            while not run.finished():
                index, token = await run.take()
                choice = run.choices[index]
                if run.errors[index] is not None or run.reasons[index] == "error":
                    yield Failed(run.errors[index] or "decoding failed")
                    return
                if token is not None and not choice.stopped:
                    for event in self._logprobs(index) + self.reader.feed(
                            index, choice.ready(final=False), None):
                        yield event
                elif token is None:
                    reason = run.reasons[index] or "stop"
                    for event in self._logprobs(index) + self.reader.feed(
                            index, choice.ready(final=True), reason):
                        yield event
            yield Usage(run.usage["prompt_tokens"], run.usage["completion_tokens"])
        finally:
            run.cancel()

    def _logprobs(self, index: int) -> list[Event]:
        """The Logprobs event of reply `index`'s tokens not yet given (none if the turn
        asked for none)."""
        run = self.run
        if run.logprobs is None:
            return []
        scored = list(zip(run.choices[index].ids, run.seqs[index].logprobs, strict=False))
        new = scored[len(self.logprobs[index]):]
        if not new:
            return []
        entries = logprob_entries(run.token_texts, new)
        self.logprobs[index] += entries
        return [Logprobs(index, entries)]

    async def collect(self, request: Request) -> tuple[list[Finished], Usage]:
        """Every reply whole, and the usage; decoding that fails is a 500, and a client
        that leaves before the end cancels the decoding (ClientLeft)."""
        finished: list[Finished] = []
        usage = Usage(0, 0)
        events = self.events()
        pending: asyncio.Task | None = None
        try:
            while True:
                pending = pending or asyncio.ensure_future(anext(events, None))
                done, _ = await asyncio.wait({pending}, timeout=0.5)
                if not done:
                    if await request.is_disconnected():
                        log.info("client left; cancelling %s", self.id)
                        raise ClientLeft
                    continue
                event, pending = pending.result(), None
                if event is None:
                    break
                if isinstance(event, Failed):
                    raise ApiError(500, event.message, type="server_error")
                if isinstance(event, Finished):
                    finished.append(event)
                elif isinstance(event, Usage):
                    usage = event
        finally:
            if pending is not None:
                pending.cancel()
            self.cancel()
        return sorted(finished, key=lambda f: f.choice), usage


def read_reply(reply: str, form: str, parallel: bool, reason: str, index: int = 0
               ) -> Finished:
    """A whole reply read for tool calls in `form`: its text besides the calls and the
    calls (the first only, without `parallel`). A reply cut off by its budget inside a
    call ends with "length", the part of the call written in neither."""
    content, calls = parse_calls(reply, form)
    calls = calls[:None if parallel else 1]
    if reason == "length" and ends_in_a_call(reply, form):
        return Finished(index, "length", reply[:held_back(reply, form)].strip() or None, calls)
    if not calls:
        return Finished(index, reason, reply or None, [])
    return Finished(index, "tool_calls", content, calls)


class CallReader:
    """Reads n replies as their text arrives, into neutral events: the text as it becomes
    final, held back where a tool call may start (in `form`; None: the reply is text), and
    each call as it is written; at the end, the whole reply read once more (Finished)."""

    def __init__(self, n: int, form: str | None, parallel: bool, *,
                 user_stops: Sequence[str] = (),
                 stop_found: Callable[[int], str | None] = lambda index: None) -> None:
        """parallel: False keeps a reply's first call only; user_stops: the request's stop
        strings, and stop_found which one ended reply `index` (if one did)."""
        self.form, self.parallel = form, parallel
        self.user_stops, self.stop_found = list(user_stops), stop_found
        self._replies = [""] * n
        self._sent = [0] * n
        self._calls: list[list[ToolCall]] = [[] for _ in range(n)]

    def feed(self, index: int, piece: str, reason: str | None) -> list[Event]:
        """The events that bring the client up to reply `index` plus `piece`; with
        `reason`, the reply has ended."""
        self._replies[index] += piece
        reply, sent = self._replies[index], self._sent[index]
        events: list[Event] = []
        if self.form is None:
            if piece:
                events.append(TextDelta(index, piece))
            if reason is not None:
                events.append(self._finished(index, reply or None, [], reason))
            return events
        if reason is None:
            cut = max(held_back(reply, self.form), sent)
            if cut > sent:
                events.append(TextDelta(index, reply[sent:cut]))
                self._sent[index] = cut
            return events + self._call_deltas(index, calls_so_far(reply, self.form))
        whole = read_reply(reply, self.form, self.parallel, reason, index)
        if not whole.calls:
            # Text (or text and a call cut off, which is held back for good).
            end = len(reply) if whole.reason != "length" else held_back(reply, self.form)
            if end > sent:
                events.append(TextDelta(index, reply[sent:end]))
            return events + [self._finished(index, whole.content, [], whole.reason)]
        before = (whole.content or "")[sent:]
        if before:
            events.append(TextDelta(index, before))
        events += self._call_deltas(index, [(c.name, c.arguments) for c in whole.calls])
        # The calls keep the ids the stream gave them.
        calls = [ToolCall(c.name, c.arguments, sent_call.id)
                 for c, sent_call in zip(whole.calls, self._calls[index], strict=False)]
        return events + [self._finished(index, whole.content, calls, whole.reason)]

    def _finished(self, index: int, content: str | None, calls: list[ToolCall],
                  reason: str) -> Finished:
        stop = self.stop_found(index)
        if reason == "stop" and stop in self.user_stops:
            return Finished(index, "stop_sequence", content, calls, stop)
        return Finished(index, reason, content, calls)

    def _call_deltas(self, index: int, calls: list[tuple[str, str]]) -> list[Event]:
        """CallBegun and ArgumentsDelta events that bring the calls sent up to `calls`
        (name, arguments so far); a call's arguments only grow (tools.calls_so_far)."""
        events: list[Event] = []
        sent = self._calls[index]
        for i, (name, arguments) in enumerate(calls):
            if i >= 1 and not self.parallel:
                break
            if i == len(sent):
                sent.append(ToolCall(name, ""))
                events.append(CallBegun(index, i, sent[i].id, name))
            have = sent[i].arguments
            if len(arguments) > len(have) and arguments.startswith(have):
                events.append(ArgumentsDelta(index, i, arguments[len(have):]))
                sent[i].arguments = arguments
        return events
