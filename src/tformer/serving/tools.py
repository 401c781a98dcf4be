"""Chat messages as clients send them, and tool calls: the tools written into the prompt,
the calls read back out of the model's reply, and the constraint that makes a call
happen when `tool_choice` requires one.

Messages: `content` is a text or a list of text parts, joined with a newline (as vLLM
joins them); another part type (image_url, input_audio, file) is a 400 naming it. Roles:
system, developer (rendered as system), user, assistant, tool.

Tools reach the prompt through the chat template when it takes `tools` (Qwen2.5/3's,
Llama 3.1+'s, Hermes'), with assistant `tool_calls` and `tool` messages as such templates
read them. A template that does not gets TOOLS_SYSTEM_BLOCK at the start of its system
message, an assistant's calls as Hermes blocks in its text, and a tool's result as a user
turn in a <tool_response> block (Hermes' and Qwen's convention).

A reply's calls are read in the template's form: Hermes/Qwen `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks (FORMAT "hermes"; also the default block's), or
Llama 3's JSON `{"name": ..., "parameters": {...}}` (several joined by ";"; FORMAT "llama3",
for templates that speak of `<|python_tag|>` or `ipython`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tformer.data.chat import ChatTemplate
from tformer.decoding.constraints import Constraint, strict_schema
from tformer.serving.protocol import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOLS_SYSTEM_BLOCK = (
    "You can call these functions (tools); their parameters are JSON schemas:\n"
    "{tools}\n"
    "To call one, answer with a block of this form, one for each call:\n"
    "<tool_call>\n"
    '{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}\n'
    "</tool_call>"
)
"""The system block that offers the tools to a template that has no place for them
(`{tools}`: one JSON object a line, each {"type": "function", "function": {...}})."""
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
"""What Llama 3.1+ may write before its JSON calls."""
MISTRAL_TAG = "[TOOL_CALLS]"
"""What Mistral writes before its array of calls."""


# --- messages ---------------------------------------------------------------------------


def message_text(content: Any, index: int) -> str | None:
    """A message's content as one text: text parts joined with a newline."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text", "refusal") and isinstance(
                part.get("text", part.get("refusal")), str):
            texts.append(part.get("text", part.get("refusal")))
        else:
            raise ApiError(400, f"messages[{index}]: content parts of type {kind!r} are not "
                           f"served here (text only)", param="messages")
    return "\n".join(texts)


def template_messages(messages: list[dict[str, Any]], template: ChatTemplate,
                      tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Request messages -> the dicts the template renders: roles checked, texts joined,
    tool calls and tool results in the template's form (or written out as text where
    the template has no place for them)."""
    native = template.takes_tools
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}]: unknown role {role!r}; one of "
                           f"{', '.join(ROLES)}", param="messages")
        text = message_text(message.get("content"), i)
        item: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": text or ""}
        if message.get("name") is not None:
            item["name"] = message["name"]
        calls = message.get("tool_calls")
        if calls and role != "assistant":
            raise ApiError(400, f"messages[{i}]: only assistant messages hold tool_calls",
                           param="messages")
        if role == "tool" and message.get("tool_call_id") is None:
            raise ApiError(400, f"messages[{i}]: a tool message needs tool_call_id",
                           param="messages")
        if calls:
            parsed = [_call_of(call, i) for call in calls]
            if native:
                item["tool_calls"] = [
                    {"id": c.get("id"), "type": "function",
                     "function": {"name": name, "arguments": args}}
                    for c, (name, args) in zip(calls, parsed, strict=True)]
            else:
                blocks = [hermes_block(name, args) for name, args in parsed]
                item["content"] = "\n".join(([text] if text else []) + blocks)
        if role == "tool":
            if native:
                item["tool_call_id"] = message["tool_call_id"]
            else:
                item = {"role": "user",
                        "content": f"<tool_response>\n{text or ''}\n</tool_response>"}
        out.append(item)
    if tools and not native:
        block = TOOLS_SYSTEM_BLOCK.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_of(call: dict[str, Any], index: int) -> tuple[str, Any]:
    """An assistant's tool call -> (name, arguments as a JSON value)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"messages[{index}]: a tool call needs function.name",
                       param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise ApiError(400, f"messages[{index}]: the arguments of tool call "
                           f"{function['name']!r} are not JSON", param="messages") from None
    return function["name"], arguments


def hermes_block(name: str, arguments: Any) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}"


# --- tools and tool_choice --------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any
                ) -> tuple[list[dict[str, Any]], str | None]:
    """The request's tools (each {"type": "function", "function": {"name", ...}}) and
    which call is required: None (auto or none), "" (any one), or a function's name."""
    tools = tools or []
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str):
            raise ApiError(400, f"tools[{i}]: a tool is {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}", param="tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{i}]: parameters is a JSON schema (an object)",
                           param="tools")
        names.append(function["name"])
    if tool_choice is None or tool_choice in ("auto", "none"):
        return tools, None
    if tool_choice == "required":
        if not tools:
            raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return tools, ""
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in names:
                raise ApiError(400, f"tool_choice names {name!r}, which is not among the "
                               f"tools", param="tool_choice")
            return tools, name
    raise ApiError(400, "tool_choice is 'none', 'auto', 'required' or {\"type\": "
                   "\"function\", \"function\": {\"name\": ...}}", param="tool_choice")


def call_format(template: ChatTemplate) -> str:
    """The name of the form the template's model writes its calls in (CALL_FORMATS): the
    first format that recognises the template, else Hermes'."""
    for name, form in CALL_FORMATS.items():
        if form.recognises(template):
            return name
    return "hermes"


def tool_constraint(tools: list[dict[str, Any]], required: str, form: str,
                    parallel: bool) -> Constraint:
    """The grammar of a reply that is tool calls only: any of the tools ('' required) or
    the named one, each call's arguments an instance of its function's parameters; one
    call, or with `parallel` one or more."""
    fmt = CALL_FORMATS[form]
    schemas = []
    for tool in tools:
        function = tool["function"]
        if required and function["name"] != required:
            continue
        schemas.append({"type": "object", "properties": {
            "name": {"const": function["name"]},
            fmt.key: function.get("parameters") or {"type": "object"}},
            "required": ["name", fmt.key], "additionalProperties": False})
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # Strict, as response_format's schemas are: only the parameters' keys, bounded numbers.
    schema = {**strict_schema(schema), "x-guidance": {"whitespace_flexible": False}}
    return Constraint.grammar(fmt.grammar(f"%json {json.dumps(schema)}", parallel))


# --- reading the calls out of a reply ---------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str
    """JSON text, as OpenAI's API carries it."""
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{secrets.token_hex(12)}"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                         r'"(?:arguments|parameters)"\s*:\s*')
"""The start of a call that names its function first, up to its arguments."""


def _call(text: str, key: str) -> ToolCall | None:
    """A call's JSON -> the call, its arguments the text the model wrote where it wrote
    its name first (as a stream sends them), else written out again."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    head = _NAME_FIRST.match(text)
    if head is not None:
        _, end = json.JSONDecoder().raw_decode(text, head.end())  # parsed whole above
        return ToolCall(value["name"], text[head.end():end])
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _text_held(text: str, tag: str) -> int:
    """Where `tag`, or what may yet become it at the text's end, starts; else len(text)."""
    at = text.find(tag)
    if at >= 0:
        return at
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


class CallFormat:
    """How one family of models writes tool calls, read back out of its replies: a class
    per form, one instance each in CALL_FORMATS, chosen from the chat template."""

    key = "arguments"
    """The name the form gives a call's arguments in its JSON."""

    def recognises(self, template: ChatTemplate) -> bool:
        return False

    def grammar(self, call: str, parallel: bool) -> str:
        """The Lark grammar of a reply that is calls only, given one call's rule."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A reply -> its text before the calls (None when empty) and the calls; a reply
        whose calls do not parse is text with no calls."""
        raise NotImplementedError

    def begun(self, text: str) -> Iterator[tuple[re.Match[str], int | None]]:
        """Each call a reply has begun that names its function first: its start up to its
        arguments (_NAME_FIRST's match), and where the call ends (None while it is being
        written)."""
        raise NotImplementedError

    def held_back(self, text: str) -> int:
        """Where a stream must stop sending a reply's text as content: at the start of a
        call, or of what may yet become one; len(text) when nothing needs holding."""
        raise NotImplementedError

    def ends_in_a_call(self, text: str) -> bool:
        """Whether a reply stops inside a call it has begun (cut off by its budget)."""
        raise NotImplementedError

    def unfinished(self, body: str) -> str:
        """The arguments' text of a call being written, less what may be the call's end."""
        return body

    def so_far(self, text: str) -> list[tuple[str, str]]:
        """The calls of a reply still being written: for each call begun whose name is
        whole (and written first), (the name, the text of its arguments so far), so that a
        stream sends a call as it is written. Of a call not yet closed, the arguments' last
        closing braces and spaces wait: they may close the call rather than them."""
        found = []
        for head, end in self.begun(text):
            whole = _call(text[head.start():end], self.key) if end is not None else None
            if whole is not None:
                found.append((whole.name, whole.arguments))
                continue
            body = text[head.end():end] if end is not None else self.unfinished(
                text[head.end():])
            found.append((json.loads(f'"{head.group(1)}"'), body.rstrip("} \n\t\r")))
            break  # a call not yet whole is the last that can be sent
        return found


class Hermes(CallFormat):
    """Hermes' and Qwen's <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks,
    after any text; also what the default tools block asks for."""

    def recognises(self, template: ChatTemplate) -> bool:
        return HERMES_OPEN in template.source

    def grammar(self, call: str, parallel: bool) -> str:
        more = '("\\n" call)*' if parallel else ""
        return f'start: call {more}\ncall: "{HERMES_OPEN}\\n" {call} "\\n{HERMES_CLOSE}"\n'

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        calls = []
        for at, end in _hermes_spans(text):
            call = _call(text[at:end], "arguments") if end is not None else None
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def begun(self, text: str) -> Iterator[tuple[re.Match[str], int | None]]:
        for at, end in _hermes_spans(text):
            head = _NAME_FIRST.match(text, at)
            if head is None:
                return
            yield head, end

    def unfinished(self, body: str) -> str:
        return body[:_text_held(body, HERMES_CLOSE)]

    def held_back(self, text: str) -> int:
        return _text_held(text, HERMES_OPEN)

    def ends_in_a_call(self, text: str) -> bool:
        closed = text.rfind(HERMES_CLOSE)
        rest = text[closed + len(HERMES_CLOSE):] if closed >= 0 else text
        return self.held_back(rest) < len(rest)


class JsonCalls(CallFormat):
    """Calls as bare JSON objects that open the reply, after an optional tag, between
    separators: Llama 3's and Mistral's."""

    tag = ""
    """What may come before the calls."""
    open, separator, close = "", ";", ""
    """Around and between the calls."""

    def grammar(self, call: str, parallel: bool) -> str:
        more = f'("{self.separator}" call)*' if parallel else ""
        tag = json.dumps(self.tag + self.open) + " " if self.tag + self.open else ""
        close = " " + json.dumps(self.close) if self.close else ""
        return f"start: {tag}call {more}{close}\ncall: {call}\n"

    def _start(self, text: str) -> int | None:
        """Where the first call starts (after the tag and the opening), or None."""
        body = text.lstrip()
        at = len(text) - len(body)
        if self.tag and body.startswith(self.tag):
            at += len(self.tag)
        elif self.tag and not self.optional_tag:
            return None
        rest = text[at:].lstrip()
        at = len(text) - len(rest)
        if self.open:
            if not rest.startswith(self.open):
                return None
            at += len(self.open)
        return at

    optional_tag = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self._start(text)
        if at is None:
            return text, []
        body = text[at:].strip().removesuffix(self.close).strip() if self.close \
            else text[at:].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                _, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call(body[pos:end], self.key)
            if call is None:
                return text, []
            calls.append(call)
            rest = body[end:].lstrip()
            if rest and not rest.startswith(self.separator):
                return text, []
            pos = len(body) - len(rest.removeprefix(self.separator).lstrip())
        return (None, calls) if calls else (text, [])

    def begun(self, text: str) -> Iterator[tuple[re.Match[str], int | None]]:
        at = self._start(text)
        if at is None:
            return
        at = len(text) - len(text[at:].lstrip())
        while (head := _NAME_FIRST.match(text, at)) is not None:
            try:
                _, end = json.JSONDecoder().raw_decode(text, text.index("{", at))
            except json.JSONDecodeError:
                yield head, None
                return
            yield head, end
            rest = text[end:].lstrip().removeprefix(self.separator).lstrip()
            at = len(text) - len(rest)

    def held_back(self, text: str) -> int:
        # A reply that is calls starts with them.
        start = text.lstrip()
        opening = self.tag + self.open
        may_call = start.startswith(("{", opening) if opening else "{") or (
            bool(opening) and opening.startswith(start))
        return 0 if may_call else len(text)

    def ends_in_a_call(self, text: str) -> bool:
        return self.held_back(text) == 0 and bool(text.strip()) and not self.parse(text)[1]


class Llama3(JsonCalls):
    """Llama 3.1+'s JSON calls, {"name": ..., "parameters": {...}}, several joined by ";",
    perhaps after <|python_tag|>; for templates that speak of the tag or of ipython."""

    key = "parameters"
    tag = PYTHON_TAG

    def recognises(self, template: ChatTemplate) -> bool:
        return template.takes_tools and (PYTHON_TAG in template.source
                                         or "ipython" in template.source) \
            and HERMES_OPEN not in template.source

    def grammar(self, call: str, parallel: bool) -> str:
        more = '(";" call)*' if parallel else ""
        return f"start: call {more}\ncall: {call}\n"


class Mistral(JsonCalls):
    """Mistral's [TOOL_CALLS] followed by a JSON array of {"name", "arguments"} objects
    (its v3 tokenizer's form; the text is read as the tokenizer decodes it, so the tag must
    be decoded as text)."""

    tag = MISTRAL_TAG
    optional_tag = False
    open, separator, close = "[", ",", "]"

    def recognises(self, template: ChatTemplate) -> bool:
        return MISTRAL_TAG in template.source


CALL_FORMATS: dict[str, CallFormat] = {"mistral": Mistral(), "llama3": Llama3(),
                                       "hermes": Hermes()}
"""The forms by name, in the order they are tried on a template (Hermes' the default)."""


_SPACES = re.compile(r"\s*")
_HERMES_CLOSED = re.compile(r"\s*" + re.escape(HERMES_CLOSE))
_JSON = json.JSONDecoder()


def _hermes_spans(text: str) -> Iterator[tuple[int, int | None]]:
    """Each call a reply opens: where its text starts (after the open tag) and where its
    JSON value ends when the close tag follows it (None while it is unfinished or is not
    JSON). A call ends after its value, not at the first close in the text, since a string
    in its arguments may hold one; the next call is looked for after it."""
    opened = text.find(HERMES_OPEN)
    while opened >= 0:
        at = opened + len(HERMES_OPEN)
        try:
            _, end = _JSON.raw_decode(text, _SPACES.match(text, at).end())
        except json.JSONDecodeError:
            end = None
        if end is not None and not _HERMES_CLOSED.match(text, end):
            end = None
        yield at, end
        opened = text.find(HERMES_OPEN, at if end is None else end)


def parse_calls(text: str, form: str) -> tuple[str | None, list[ToolCall]]:
    """A reply -> its text before the calls (None when empty) and the calls, in `form`."""
    return CALL_FORMATS[form].parse(text)


def calls_so_far(text: str, form: str = "hermes") -> list[tuple[str, str]]:
    """CallFormat.so_far of the named form."""
    return CALL_FORMATS[form].so_far(text)


def held_back(text: str, form: str) -> int:
    """CallFormat.held_back of the named form."""
    return CALL_FORMATS[form].held_back(text)


def ends_in_a_call(text: str, form: str) -> bool:
    """CallFormat.ends_in_a_call of the named form."""
    return CALL_FORMATS[form].ends_in_a_call(text)
