"""Tool calls in and out of the prompt (serving/tools.py): messages rendered for templates
with and without a place for tools, calls read from Hermes and Llama 3 replies, and the
grammar that makes a required call."""

from __future__ import annotations

import json

import pytest
import torch

from tformer.data.chat import ChatTemplate
from tformer.data.tokenizers import CharTokenizer
from tformer.serving.protocol import ApiError
from tformer.serving.tools import (
    CALL_FORMATS,
    TOOLS_SYSTEM_BLOCK,
    call_format,
    held_back,
    parse_calls,
    template_messages,
    tool_constraint,
)

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}
PLAIN = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
QWEN_LIKE = ChatTemplate(
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
LLAMA_LIKE = ChatTemplate("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                          "<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}"
                          "<|eot_id|>{% endfor %}{# ipython #}")
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 3}'}}
TURNS = [{"role": "user", "content": "add 3"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "3"}]


def test_a_template_with_tools_gets_them_and_the_calls_as_it_reads_them():
    assert QWEN_LIKE.takes_tools and not PLAIN.takes_tools
    messages = template_messages(TURNS, QWEN_LIKE, [TOOL])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 3}
    text = QWEN_LIKE.render(messages, tools=[TOOL])
    # (trim_blocks: a block tag's line end goes.)
    assert text == (f"<tools>{json.dumps(TOOL)}</tools>\n[user]add 3"
                    '[assistant]<tool_call>add {"a": 3}</tool_call>'
                    "[tool]<tool_response>3</tool_response>")


def test_a_template_without_tools_gets_the_default_block_and_hermes_text():
    messages = template_messages([{"role": "system", "content": "Be brief."}, *TURNS], PLAIN,
                                 [TOOL])
    block = TOOLS_SYSTEM_BLOCK.format(tools=json.dumps(TOOL))
    assert messages == [
        {"role": "system", "content": f"Be brief.\n\n{block}"},
        {"role": "user", "content": "add 3"},
        {"role": "assistant",
         "content": '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}]
    # No system message: the block is one.
    assert template_messages(TURNS[:1], PLAIN, [TOOL])[0] == {"role": "system",
                                                              "content": block}


def test_content_parts_roles_and_names():
    messages = template_messages([
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "name": "ada", "content": "hi"}], PLAIN, None)
    assert messages == [{"role": "system", "content": "a\nb"},
                        {"role": "user", "content": "hi", "name": "ada"}]
    for bad, match in [({"role": "user", "content": [{"type": "input_audio"}]}, "input_audio"),
                       ({"role": "wizard", "content": "x"}, "unknown role 'wizard'"),
                       ({"role": "tool", "content": "x"}, "needs tool_call_id"),
                       ({"role": "user", "content": "x", "tool_calls": [CALL]}, "only assistant")]:
        with pytest.raises(ApiError, match=match):
            template_messages([bad], PLAIN, None)


def test_hermes_calls_are_read_with_the_text_before_them():
    reply = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
             '\n<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    content, calls = parse_calls(reply, "hermes")
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}),
                                                                  ("add", {"a": 2})]
    assert len({c.id for c in calls}) == 2
    assert parse_calls("no calls here", "hermes") == ("no calls here", [])
    broken = "<tool_call>{not json</tool_call>"
    assert parse_calls(broken, "hermes") == (broken, [])


def test_a_hermes_call_whose_string_holds_the_close_tag_is_read_whole():
    """A call ends after its JSON value, not at the first close tag: a sampled string
    argument may write the tag itself (SmolLM2 did, at temperature 1)."""
    arguments = {"city": "Lyon.</tool_call> and on", "n": 2}
    reply = (f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}'
             '\n</tool_call>')
    content, calls = parse_calls(reply, "hermes")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", arguments)]
    # Streamed: the call counts as begun, not ended, while its string is open.
    fmt = CALL_FORMATS["hermes"]
    cut = reply.index("</tool_call> and") + len("</tool_call>")
    assert [end for _, end in fmt.begun(reply[:cut])] == [None]
    assert [json.loads(reply[head.start() : end]) for head, end in fmt.begun(reply)] == [
        {"name": "get_weather", "arguments": arguments}]


def test_llama3_json_calls_are_read():
    assert call_format(LLAMA_LIKE) == "llama3" and call_format(QWEN_LIKE) == "hermes"
    content, calls = parse_calls('{"name": "add", "parameters": {"a": 4}}; '
                                 '{"name": "add", "parameters": {"a": 5}}', "llama3")
    assert content is None and [json.loads(c.arguments)["a"] for c in calls] == [4, 5]
    assert parse_calls("The sum is {3}.", "llama3") == ("The sum is {3}.", [])


def test_mistral_calls_are_read_after_their_tag():
    mistral = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"
                           "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]"
                           "{% endif %}[TOOL_CALLS]")
    assert call_format(mistral) == "mistral"
    content, calls = parse_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 4}}, '
                                 '{"name": "add", "arguments": {"a": 5}}]', "mistral")
    assert content is None and [json.loads(c.arguments)["a"] for c in calls] == [4, 5]
    for text in ('[{"name": "add", "arguments": {"a": 4}}]', "[TOOL_CALLS] no calls"):
        assert parse_calls(text, "mistral") == (text, [])
    assert held_back("[TOOL_CA", "mistral") == 0 and held_back("Hi", "mistral") == 2


def test_a_stream_holds_back_what_may_start_a_call():
    text = "Sure. <tool"
    assert held_back(text, "hermes") == len("Sure. ")
    assert held_back("Sure. <tool_call>{", "hermes") == len("Sure. ")
    assert held_back("Sure.", "hermes") == 5
    assert held_back(' {"name"', "llama3") == 0 and held_back("Hi", "llama3") == 2


@pytest.mark.parametrize("form", ["hermes", "llama3", "mistral"])
def test_the_required_call_grammar_gives_calls_that_parse(form):
    from tformer.decoding.constraints import compile_grammar, mask_logits

    tok = CharTokenizer([chr(c) for c in range(32, 127)] + ["\n"], specials=True)
    grammar = compile_grammar(tok, tool_constraint([TOOL], "add", form, parallel=True))
    for seed in range(5):
        matcher, ids = grammar.start(), []
        generator = torch.Generator().manual_seed(seed)
        while True:
            logits = mask_logits(torch.randn(1, tok.vocab_size, generator=generator), [matcher])
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
            if token == tok.eos_id:
                break
            matcher.advance(token)
            ids.append(token)
        content, calls = parse_calls(tok.decode(ids), form)
        assert content is None and calls and all(c.name == "add" for c in calls)
        assert all(0 <= json.loads(c.arguments)["a"] <= 9 for c in calls)


def stream_of(form: str, pieces: list[str], reason: str = "stop") -> list[dict]:
    """The deltas and finish reasons a chat stream sends for a reply arriving in pieces."""
    from tformer.serving.chat import ChatCompletion
    from tformer.serving.turn import CallReader

    run = ChatCompletion.__new__(ChatCompletion)  # the streaming part alone
    run.seqs, run.form, run.reader = [None], form, CallReader(1, form, parallel=True)
    run.id, run.created, run.model_name = "chatcmpl-x", 0, "m"
    events = "".join(run._chunk(0, piece, None) for piece in pieces)
    events += run._chunk(0, "", reason)
    chunks = [json.loads(line[len("data: "):]) for line in events.split("\n\n") if line]
    return [{"delta": c["choices"][0]["delta"], "reason": c["choices"][0]["finish_reason"]}
            for c in chunks]


def test_a_stream_sends_the_text_before_a_call_then_the_call():
    out = stream_of("hermes", ["Sure, ", "<to", 'ol_call>\n{"name": "add", "argu',
                               'ments": {"a": 1}}\n</tool_call>'])
    content = "".join(o["delta"].get("content", "") for o in out)
    assert content == "Sure, "
    calls = [d for o in out for d in o["delta"].get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "add", "arguments": ""} and calls[0]["id"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1}
    assert out[-1] == {"delta": {}, "reason": "tool_calls"}
    # A reply that only looked like it might call: its held-back text is sent at the end.
    out = stream_of("hermes", ["a <tool", " kit"])
    assert "".join(o["delta"].get("content", "") for o in out) == "a <tool kit"
    assert out[-1]["reason"] == "stop"


STREAMED_CALLS = {
    "hermes": ('Sure, <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2, "}"]}}}'
               '\n</tool_call>\n<tool_call>\n{"name": "neg", "arguments": {"x":  -3}}\n'
               '</tool_call>'),
    "llama3": ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": {"c": [2, "}"]}}}; '
               '{"name": "neg", "parameters": {"x":  -3}}'),
    "mistral": ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": {"c": [2, "}"]}}}, '
                '{"name": "neg", "arguments": {"x":  -3}}]'),
}


@pytest.mark.parametrize("form", list(STREAMED_CALLS))
def test_a_stream_sends_each_call_as_it_is_written(form):
    """Piece by piece (a character at a time here): a call's id and name go out once the
    name is whole, its arguments' text as it grows, before the reply ends; the pieces of
    each call join to the arguments the whole reply gives, which are the model's text."""
    from tformer.serving.tools import parse_calls

    reply = STREAMED_CALLS[form]
    out = stream_of(form, list(reply))
    content = "".join(o["delta"].get("content", "") for o in out)
    assert content == ("Sure, " if form == "hermes" else "")
    deltas = [(n, d) for n, o in enumerate(out) for d in o["delta"].get("tool_calls", [])]
    # The first call's name, and most of its arguments, before the reply has ended.
    first_name = next(n for n, d in deltas if d["index"] == 0 and "id" in d)
    assert first_name < len(out) - 20
    argument_deltas = [d for _, d in deltas if d["index"] == 0 and "id" not in d]
    assert len(argument_deltas) > 10
    joined: dict[int, str] = {}
    for _, d in deltas:
        if "id" in d:
            assert d["function"]["arguments"] == "" and d["type"] == "function"
            assert d["index"] not in joined
            joined[d["index"]] = ""
        else:
            joined[d["index"]] += d["function"]["arguments"]
    _, calls = parse_calls(reply, form)
    assert [joined[i] for i in range(2)] == [c.arguments for c in calls] == [
        '{"a": 1, "b": {"c": [2, "}"]}}', '{"x":  -3}']
    assert [d["function"]["name"] for _, d in deltas if "id" in d] == ["add", "neg"]
    assert out[-1] == {"delta": {}, "reason": "tool_calls"}


def test_a_stream_cut_inside_a_call_sends_neither_the_call_text_nor_a_call_end():
    """A reply stopped by max_tokens while writing a call: the text before it is content,
    the call's name went out once whole, and the reply ends with "length", the partial
    call never sent as content."""
    out = stream_of("hermes", ["Sure. ", '<tool_call>\n{"name": "add", "arguments": {"a'],
                    reason="length")
    assert "".join(o["delta"].get("content", "") for o in out) == "Sure. "
    assert out[-1] == {"delta": {}, "reason": "length"}
