"""JSON schemas compiled strict (tformer.decoding.constraints.strict_schema): read through
the masks themselves, character by character, on a character vocabulary: no key beyond an
object's properties, numbers that run out of digits, no white space, and the texts drawn
from random logits that favour digits and keys checked by Python's own float and json."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tformer.data.tokenizers import CharTokenizer  # noqa: E402
from tformer.decoding.constraints import (  # noqa: E402
    INTEGER_LIMIT,
    NUMBER_LIMIT,
    Constraint,
    allowed,
    compile_grammar,
    mask_logits,
    strict_schema,
)

CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
TOK = CharTokenizer(CHARS, specials=True)
DIGITS = set("0123456789")
WHITE = set(" \n\t")


def after(constraint: Constraint, text: str) -> set[str]:
    """The characters the mask allows after `text` ('<end>' for the end of text); an
    AssertionError where the mask refuses a character of `text` on the way."""
    matcher = compile_grammar(TOK, constraint).start()
    for i, char in enumerate(text):
        token = TOK.encode(char)[0]
        assert allowed([matcher], TOK.vocab_size)[0, token], f"{text[:i]!r} + {char!r}"
        matcher.advance(token)
    ids = allowed([matcher], TOK.vocab_size)[0].nonzero().flatten().tolist()
    return {"<end>" if i == TOK.eos_id else TOK.itos[i] for i in ids}


def takes(constraint: Constraint, text: str) -> bool:
    try:
        return "<end>" in after(constraint, text)
    except AssertionError:
        return False


def draw(constraint: Constraint, *, seed: int, favour: str, limit: int = 200) -> str:
    """Text drawn from random logits with `favour`'s characters 8 higher: a model that
    would write digits (or keys) for ever if the mask let it."""
    matcher = compile_grammar(TOK, constraint).start()
    generator = torch.Generator().manual_seed(seed)
    boost = torch.zeros(TOK.vocab_size)
    boost[[TOK.encode(c)[0] for c in favour]] = 8.0
    ids: list[int] = []
    for _ in range(limit):
        logits = torch.randn(1, TOK.vocab_size, generator=generator) + boost
        token = int(torch.multinomial(mask_logits(logits, [matcher]).softmax(-1), 1,
                                      generator=generator))
        if token == TOK.eos_id:
            return TOK.decode(ids)
        matcher.advance(token)
        ids.append(token)
    raise AssertionError(f"no end within {limit} characters: {TOK.decode(ids)!r}")


CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                        "population": {"type": "number"}},
        "required": ["name", "population"]}


def test_an_object_takes_no_key_beyond_its_properties():
    schema = Constraint.json_schema(CITY)  # additionalProperties not said: closed
    assert after(schema, '{"name":"Paris","population":2.1') >= {"}"}
    assert "," not in after(schema, '{"name":"Paris","population":2.1')
    # Only the listed keys can start, in their order.
    assert after(schema, '{"') == {"n"}
    assert not takes(schema, '{"name":"Paris","population":2,"x":1}')
    assert takes(schema, '{"name":"Paris","population":2}')
    # Said open, other keys may follow.
    open_ = Constraint.json_schema({**CITY, "additionalProperties": True})
    assert "," in after(open_, '{"name":"Paris","population":2')
    typed = Constraint.json_schema({**CITY, "additionalProperties": {"type": "boolean"}})
    assert takes(typed, '{"name":"P","population":2,"ok":true}')
    assert not takes(typed, '{"name":"P","population":2,"ok":1}')


def test_required_keys_are_required_and_optional_ones_may_be_left_out():
    schema = Constraint.json_schema({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["b"]})
    assert takes(schema, '{"b":true}') and takes(schema, '{"a":1,"b":false}')
    assert not takes(schema, '{"a":1}') and not takes(schema, "{}")
    assert not takes(schema, '{"b":true,"a":1}')  # the listed order


def test_an_object_with_no_properties_is_any_object_with_bounded_numbers():
    schema = Constraint.json_object()
    assert takes(schema, '{"x":[1,{"y":null}],"z":"w"}')
    assert not takes(schema, '{"x":1e5}')
    assert after(schema, '{"x":' + "9" * 15) & DIGITS == set()


@pytest.mark.parametrize(("kind", "limit", "decimals"), [
    ("integer", INTEGER_LIMIT, 0), ("number", NUMBER_LIMIT, 10)])
def test_numbers_run_out_of_digits(kind, limit, decimals):
    schema = Constraint.json_schema({"type": kind})
    biggest = str(limit)
    assert takes(schema, biggest) and takes(schema, "-" + biggest)
    # One more digit is past the limit, whatever it is.
    assert after(schema, biggest) & DIGITS == set()
    assert after(schema, "-" + biggest) & DIGITS == set()
    assert "e" not in after(schema, "12") and "E" not in after(schema, "12")
    if decimals:
        assert after(schema, "1." + "5" * decimals) & DIGITS == set()
        assert takes(schema, "0." + "0" * (decimals - 1) + "1")
    else:
        assert "." not in after(schema, "12")
    for seed in range(10):
        text = draw(schema, seed=seed, favour="123456789.")
        assert re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", text), text
        assert abs(float(text)) <= limit
        assert len(text.partition(".")[2]) <= decimals


def test_a_schemas_own_bounds_are_kept_where_tighter():
    schema = Constraint.json_schema({"type": "number", "minimum": -4.75, "maximum": 30,
                                     "multipleOf": 0.25})
    assert takes(schema, "-4.75") and takes(schema, "29.25")
    assert not takes(schema, "-5") and not takes(schema, "30.1")
    assert not takes(schema, "1.3")
    wide = strict_schema({"type": "integer", "minimum": -10**30})
    assert wide["minimum"] == -INTEGER_LIMIT and wide["maximum"] == INTEGER_LIMIT
    # Listed values, and ranges beyond ours, are left to the schema.
    for schema in [{"type": "number", "enum": [1e20, 2]}, {"type": "integer", "const": 7},
                   {"type": "number", "exclusiveMinimum": 1e20}]:
        assert strict_schema(schema) == schema
    assert takes(Constraint.json_schema({"type": "number", "enum": [1e20, 2]}), "2")
    above = Constraint.json_schema({"type": "integer", "exclusiveMinimum": 5})
    assert takes(above, "6") and not takes(above, "5")
    assert after(above, str(INTEGER_LIMIT)) & DIGITS == set()


def test_no_white_space_between_tokens():
    schema = Constraint.json_schema({"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "ok": {"type": "boolean"}}, "required": ["xs", "ok"]})
    for prefix in ["", "{", '{"xs"', '{"xs":', '{"xs":[', '{"xs":[1', '{"xs":[1,',
                   '{"xs":[1]', '{"xs":[1],', '{"xs":[1],"ok":true']:
        assert after(schema, prefix) & WHITE == set(), prefix


def test_texts_drawn_toward_keys_and_digits_end_and_follow_the_schema():
    schema = {"type": "object", "properties": {
        "id": {"type": "integer"}, "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
        "extra": {}}, "required": ["id", "score"]}
    constraint = Constraint.json_schema(schema)
    for seed in range(8):
        text = draw(constraint, seed=seed, favour='123456789,"abc')
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert set(value) <= set(schema["properties"])


def test_strict_schema_leaves_its_input_alone_and_combinations_open():
    schema = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}}}},
              "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}
    before = json.dumps(schema)
    out = strict_schema(schema)
    assert json.dumps(schema) == before
    assert out["additionalProperties"] is False
    assert out["$defs"]["P"]["additionalProperties"] is False
    both = Constraint.json_schema({"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]})
    assert takes(both, '{"a":1,"b":2}')


def test_a_named_tools_arguments_take_only_its_parameters():
    from tformer.serving.tools import tool_constraint

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    constraint = tool_constraint([weather], "get_weather", "llama3", parallel=False)
    start = '{"name":"get_weather","parameters":{"city":"Paris"'
    assert after(constraint, start) == {"}"}
    assert takes(constraint, start + "}}")
