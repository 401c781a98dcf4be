"""Chat templates: messages -> the prompt text a chat model was trained on, rendered as
Hugging Face transformers renders a tokenizer's `chat_template` (apply_chat_template), so
that a template imported with a model gives the prompts the model knows.

That is: Jinja2's immutable sandbox (templates come with downloaded models and are
untrusted), `trim_blocks` and `lstrip_blocks`, the loop controls (`break`, `continue`),
the `{% generation %}` block (rendered as its body), `raise_exception(message)`,
`strftime_now(format)`, a `tojson` that leaves non-ASCII text and HTML characters alone;
variables `messages`, `add_generation_prompt`, `tools`, `documents` and the tokenizer's
special tokens (`bos_token`, `eos_token`, `pad_token`).

A checkpoint's template is its `chat_template.jinja` file (its tokenizer's, which `tformer
import` brings from a Hugging Face model and fine-tuning keeps), or the one `serve
--chat-template FILE` names. Training on chat rows (data/instruct.py) renders them with the
checkpoint's template, or with DEFAULT_TEMPLATE where it has none, which the run then keeps
as its own.

Rendered text names special tokens by their text (`</s>`, `<|im_end|>`): encode_text maps
the tokenizer's bos, eos and pad names to their ids whatever the tokenizer, where only a
pretrained one would otherwise know them.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from tformer.data.tokenizers import (
    CHAT_TEMPLATE,
    Tokenizer,
    read_chat_template_file,
    special_names,
)
from tformer.errors import TformerError

TEMPLATE_FILE = CHAT_TEMPLATE
PROBE = "\x00end-of-turn probe\x00"
"""An assistant message no template changes, to find what a template writes after one."""


DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' and eos_token is defined %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""The plain template of a model that has none: `role: content` a line each, a reply
ending with the eos token where the tokenizer has one, and `assistant: ` to prompt one."""


class ChatTemplateError(ValueError):
    """The template refused the messages (its raise_exception, or a rendering error)."""


def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training
        masks; rendering keeps its body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


class ChatTemplate:
    """A compiled chat template with the special tokens it is rendered with."""

    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None,
                 origin: str = "the chat template") -> None:
        import jinja2

        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TformerError(f"{origin} is not a valid Jinja template: line {e.lineno}: "
                               f"{e.message}") from None
        self.end_of_turn = self._find_end_of_turn()
        from jinja2 import meta

        self.takes_tools = "tools" in meta.find_undeclared_variables(
            self.template.environment.parse(source))
        """Whether the template writes the `tools` it is given into the prompt."""

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template could not render these messages: "
                                    f"{type(e).__name__}: {e}") from None

    def _find_end_of_turn(self) -> str | None:
        """The text a template writes after an assistant's message (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>, Gemma's <end_of_turn>): where a reply ends, as the model
        learnt it. None when it writes nothing there, or refuses the probe."""
        try:
            text = self.render([{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": PROBE}],
                               add_generation_prompt=False)
        except ChatTemplateError:
            return None
        if PROBE not in text:
            return None
        after = text.split(PROBE, 1)[1].split("\n", 1)[0].strip()
        return after or None


def load_chat_template(checkpoint: Path, override: str | Path | None,
                       special_tokens: dict[str, str]) -> ChatTemplate | None:
    """The template of `override` (a file) if given, else the checkpoint's
    chat_template.jinja, else None."""
    path = Path(override) if override is not None else Path(checkpoint) / TEMPLATE_FILE
    if not path.is_file():
        if override is not None:
            raise TformerError(f"--chat-template {override}: no such file")
        return None
    return ChatTemplate(read_chat_template_file(path), special_tokens=special_tokens,
                        origin=str(path))


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The template variables `bos_token`, `eos_token`, `pad_token` the tokenizer has."""
    return {f"{key}_token": name for key, name in special_names(tokenizer).items()
            if name is not None}


def template_of(tokenizer: Tokenizer) -> ChatTemplate:
    """The tokenizer's own template, or DEFAULT_TEMPLATE."""
    source = tokenizer.chat_template or DEFAULT_TEMPLATE
    return ChatTemplate(source, special_tokens=special_tokens(tokenizer))


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of rendered text: the names of the tokenizer's special tokens become their
    ids, the text between them is encoded as text."""
    ids_by_name = {name: getattr(tokenizer, f"{key}_id")
                   for key, name in special_names(tokenizer).items() if name is not None}
    if not ids_by_name:
        return tokenizer.encode(text)
    pattern = "(" + "|".join(re.escape(name) for name in ids_by_name) + ")"
    ids: list[int] = []
    for i, piece in enumerate(re.split(pattern, text)):
        if i % 2:  # re.split puts the separators it kept at the odd places
            ids.append(ids_by_name[piece])
        elif piece:
            ids.extend(tokenizer.encode(piece))
    return ids


def chat_segments(template: ChatTemplate, messages: list[dict[str, Any]]
                  ) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is the assistant's) pieces, in order.

    An assistant reply is what rendering the conversation up to it adds to rendering the
    turns before it with the generation prompt: the very text a model generates after that
    prompt, up to and including the template's end of turn. This needs a template that
    renders a conversation's start the same when more follows, as chat templates do; one
    that does not (it rewrites earlier turns) is a ChatTemplateError.
    """
    ends = [end for end in (template.end_of_turn, template.special_tokens.get("eos_token"))
            if end]
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (prompt.startswith(done) and upto.startswith(prompt)):
            raise ChatTemplateError(
                f"the chat template renders the turns before message {i + 1} differently "
                f"once a reply follows, so the replies cannot be told apart")
        reply = upto[len(prompt):]
        cut = max((reply.rfind(end) + len(end) for end in ends if end in reply),
                  default=len(reply))
        pieces += [(prompt[len(done):], False), (reply[:cut], True), (reply[cut:], False)]
        done = upto
    whole = template.render(messages, add_generation_prompt=False)
    if not whole.startswith(done):
        raise ChatTemplateError("the chat template renders the last turns differently once "
                                "the conversation ends")
    pieces.append((whole[len(done):], False))
    merged: list[tuple[str, bool]] = []
    for text, reply in pieces:
        if merged and merged[-1][1] == reply:
            merged[-1] = (merged[-1][0] + text, reply)
        elif text:
            merged.append((text, reply))
    return merged
