"""Structured outputs: what a request asks its text to follow, as a compiled constraint
(tformer.decoding.constraints).

Two ways to ask, on completions and chat completions alike:
- OpenAI's `response_format`: {"type": "text"} (nothing), {"type": "json_object"} (any
  JSON object), {"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}} (an instance of the schema);
- vLLM's `structured_outputs`: exactly one of `json` (a schema, or its JSON), `regex`,
  `choice` (one of the texts), `grammar` (Lark, as llguidance reads it, or GBNF, as
  llama.cpp's server and vLLM's examples write it) or
  `json_object: true`.

Every JSON schema is compiled strict (decoding/constraints.py's `strict_schema`: no keys
beyond an object's properties, numbers of bounded digits, no white space), so that the
text ends; `strict` in response_format is accepted, and changes nothing. A constraint the
engine cannot compile is a 400 naming why.
"""

from __future__ import annotations

from typing import Any

from tformer.decoding.constraints import Constraint, Grammar, compile_grammar
from tformer.errors import TformerError
from tformer.serving.protocol import ApiError, StructuredOutputs


def response_format_constraint(value: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's response_format -> the constraint it asks for (None: plain text)."""
    if value is None:
        return None
    kind = value.get("type")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise ApiError(400, f"response_format: unknown field {sorted(extra)[0]!r}",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "name" not in spec:
            raise ApiError(400, "response_format: json_schema needs an object with a name "
                           "and a schema", param="response_format")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ApiError(400, f"response_format.json_schema: unknown field "
                           f"{sorted(unknown)[0]!r}", param="response_format")
        schema = spec.get("schema", {"type": "object"})
        return _schema(schema, "response_format")
    raise ApiError(400, f"response_format: type {kind!r} is not one of text, json_object, "
                   f"json_schema", param="response_format")


def structured_constraint(value: StructuredOutputs | None) -> Constraint | None:
    if value is None:
        return None
    given = {name: v for name, v in [("json", value.json_), ("regex", value.regex),
                                     ("choice", value.choice), ("grammar", value.grammar),
                                     ("json_object", value.json_object or None)]
             if v is not None}
    if len(given) > 1:
        raise ApiError(400, f"structured_outputs: give one of json, regex, choice, grammar, "
                       f"json_object, not {' and '.join(given)}", param="structured_outputs")
    if not given:
        return None
    (kind, spec), = given.items()
    try:
        if kind == "json":
            return _schema(spec, "structured_outputs")
        if kind == "regex":
            return Constraint.regex(spec)
        if kind == "choice":
            return Constraint.choice(spec)
        if kind == "grammar":
            return Constraint.grammar(spec)
        return Constraint.json_object()
    except TformerError as e:
        raise ApiError(400, f"structured_outputs: {e}", param="structured_outputs") from None


def _schema(schema: Any, param: str) -> Constraint:
    try:
        return Constraint.json_schema(schema)
    except TformerError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None


def request_constraint(response_format: dict[str, Any] | None,
                       structured: StructuredOutputs | None) -> Constraint | None:
    """The constraint a request's fields ask for; both fields at once is a 400."""
    first = response_format_constraint(response_format)
    second = structured_constraint(structured)
    if first is not None and second is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    return first or second


def compile_for(constraint: Constraint | None, tokenizer: Any, n_vocab: int, *,
                batched: bool, param: str) -> Grammar | None:
    """The constraint compiled for the model (cached), or a 400 naming why it cannot be."""
    if constraint is None:
        return None
    if not batched:
        raise ApiError(400, f"{param} is served for models decoded with a KV cache; this "
                       f"model's memory is its cache", param=param)
    try:
        return compile_grammar(tokenizer, constraint, n_vocab)
    except TformerError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
