"""Constrained decoding: text that follows a JSON schema, a regular expression or a grammar,
by masking, before every draw, the tokens that cannot continue it.

The engine is llguidance (the `structured` extra), chosen by measurement among it,
xgrammar and outlines-core (benchmarks/constraint_engines.py): it compiles a schema in
about a millisecond, takes a `tokenizers` JSON as it is (byte-level BPE and SentencePiece
vocabularies alike) and embeds JSON schemas in grammars, which tool calls need.

- `Vocabulary`: a tokenizer's tokens as the engine sees them (their bytes), built once
  per tokenizer. A character tokenizer's token is its character's UTF-8 bytes; special
  tokens are special. A vocabulary without an end-of-text token gets one past the model's
  (never drawn: a masked id), since the engine needs one.
- `strict_schema`: a JSON schema made to end (no keys beyond its properties, numbers of
  bounded digits), as every schema here is compiled; white space is none
  (`JSON_OPTIONS`).
- `Grammar`: one constraint compiled for one vocabulary, cached by its text
  (`compile_grammar`); `start()` gives a fresh `Matcher` for one sequence.
- `Matcher`: where a sequence stands in its grammar; `allowed(...)` fills its row of a
  bit mask, `advance(token)` takes the drawn token, `stopped` is True once the text is
  complete and nothing may follow (the end of the constrained text ends the sequence).

Shapes: n rows, V vocabulary, W = ceil(V / 32) words of a bit mask.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tformer.errors import TformerError

INSTALL = "structured outputs need llguidance: pip install 'tformer[structured]'"
CACHE_SIZE = 256
"""Compiled grammars kept per vocabulary."""
JSON_OPTIONS = {"whitespace_flexible": False}
"""JSON as json.dumps(separators=(",", ":")) writes it: a model free to add white space
may add it forever."""

_BLOCKED = torch.tensor([[not (byte >> bit) & 1 for bit in range(8)] for byte in range(256)])
"""A mask byte -> which of its 8 tokens are disallowed."""


class ConstraintError(TformerError):
    """The engine cannot compile the constraint; the message says why."""


def require_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise TformerError(INSTALL) from None
    return llguidance


# --- what a constraint is -------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    """One constraint as text the engine compiles: kind "json_schema" (a schema's JSON),
    "regex" or "grammar" (Lark syntax, which may embed `%json{...}` schemas, or GBNF)."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ConstraintError("a JSON schema is an object (or true/false)")
        # Its order is the output's order.
        return cls("json_schema", json.dumps(strict_schema(schema)))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        return cls("grammar", lark)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        """Exactly one of the texts."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError("choice is a list of non-empty texts")
        return cls.grammar("start: " + " | ".join(json.dumps(o) for o in options))

    def engine_grammar(self) -> str:
        llguidance = require_llguidance()
        matcher = llguidance.LLMatcher
        if self.kind == "json_schema":
            return matcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.source)
        return matcher.grammar_from_lark(lark_of(self.source))


# --- JSON schemas made to end -------------------------------------------------------------
#
# Plain JSON Schema lets an object take any key beyond its properties and a number any
# count of digits: a model that keeps writing digits or keys is never stopped by the mask,
# and only max_tokens ends it. llguidance has no option that bounds either (its options
# are separators and white space), but it compiles `additionalProperties`, `minimum`,
# `maximum` and `multipleOf` exactly, into finite patterns: so the schema is rewritten
# into these keywords before it is compiled (what OpenAI's strict mode and xgrammar's
# default do in their own ways).

INTEGER_LIMIT = 10**18 - 1
"""An integer is within +-INTEGER_LIMIT: at most 18 digits, which an int64 holds."""
NUMBER_LIMIT = 10**15
"""A number is within +-NUMBER_LIMIT: at most 16 digits before the point."""
NUMBER_STEP = 1e-10
"""...and a multiple of NUMBER_STEP: at most 10 digits after it (no exponent, since a
range is written in plain decimals). llguidance reads multipleOf as a float64, and 1e-11
has too many digits there."""
ANY_VALUE = "tformer_any_value"
"""The $defs entry of a JSON value whose numbers are bounded as above."""
_ANY_REF = {"$ref": f"#/$defs/{ANY_VALUE}"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly", "$schema", "$id"}
_COMBINATORS = ("anyOf", "oneOf", "allOf")


def any_value() -> dict[str, Any]:
    """Any JSON value, its numbers bounded as `strict_schema` bounds them."""
    return {"anyOf": [
        {"type": "null"}, {"type": "boolean"}, _bounded_number({"type": "number"}),
        {"type": "string"}, {"type": "array", "items": dict(_ANY_REF)},
        {"type": "object", "additionalProperties": dict(_ANY_REF)}]}


def strict_schema(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """The schema rewritten so that text following it ends (a new schema; the given one is
    left as it is). Where it differs from plain JSON Schema:

    - an object that lists `properties` takes no other key unless it says
      `additionalProperties: true` or gives it a schema; required keys are required,
      optional ones may be left out, and each comes at most once, in the listed order.
      An object that lists no properties (`{"type": "object"}`, JSON mode) takes any key;
    - an integer has at most 18 digits (INTEGER_LIMIT); a number at most 16 before the
      point and 10 after it, with no exponent (NUMBER_LIMIT, NUMBER_STEP), unless the
      schema sets its own minimum, maximum or multipleOf, which are kept where tighter;
    - a value of any type (`{}`, `true`, an array without `items`, an open object's
      values) has its numbers bounded so too.

    Objects combined with allOf, or with sibling properties beside anyOf/oneOf, stay open:
    closing each part would refuse the keys the other parts give.
    """
    used: list[bool] = []
    out = _strict(schema, open_object=False, used=used)
    if used:
        out = dict(out) if isinstance(out, dict) else {}
        out["$defs"] = {**out.get("$defs", {}), ANY_VALUE: any_value()}
    return out


def _strict(node: Any, *, open_object: bool, used: list[bool]) -> Any:
    """One schema node rewritten; `open_object`: a part of a combination, whose keys the
    other parts may give. `used` gets an entry when the any-value definition is needed."""
    if node is True or (isinstance(node, dict) and set(node) <= _ANNOTATIONS):
        used.append(True)
        return dict(_ANY_REF)
    if not isinstance(node, dict):
        return node
    node = dict(node)

    def each(schemas: Any) -> Any:
        if isinstance(schemas, dict):
            return {k: _strict(v, open_object=False, used=used) for k, v in schemas.items()}
        if isinstance(schemas, list):
            return [_strict(v, open_object=False, used=used) for v in schemas]
        return schemas

    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            node[key] = each(node[key])
    for key in ("items", "prefixItems", "additionalProperties"):
        if key in node and node[key] is not False:
            value = node[key]
            node[key] = each(value) if isinstance(value, list) else _strict(
                value, open_object=False, used=used)
    combined = any(key in node for key in _COMBINATORS)
    has_properties = "properties" in node or "patternProperties" in node
    for key in _COMBINATORS:
        if isinstance(node.get(key), list):
            # allOf's parts each give some of the keys; anyOf's and oneOf's parts do where
            # this node lists properties of its own.
            keep_open = (key == "allOf" and len(node[key]) > 1) or has_properties
            node[key] = [_strict(v, open_object=keep_open, used=used) for v in node[key]]

    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if ("object" in types or has_properties) and "additionalProperties" not in node:
        if not has_properties:
            used.append(True)
            node["additionalProperties"] = dict(_ANY_REF)
        elif not (open_object or combined):
            node["additionalProperties"] = False
    if "array" in types and "items" not in node and "prefixItems" not in node:
        used.append(True)
        node["items"] = dict(_ANY_REF)
    if types & {"number", "integer"}:
        node = _bounded_number(node)
    return node


def _bounded_number(node: dict[str, Any]) -> dict[str, Any]:
    """A number or integer schema with its range (and a number's step) bounded, the
    schema's own bounds kept where tighter. Left as it is where its values are listed
    (enum, const: bounding them could refuse them all), where its bounds are not numbers
    (the engine says why), or where they lie beyond ours (what it asks cannot be bounded)."""
    if "enum" in node or "const" in node:
        return node
    types = node["type"]
    integer_only = "number" not in ({types} if isinstance(types, str) else set(types))
    limit = INTEGER_LIMIT if integer_only else NUMBER_LIMIT
    bounds = {key: node[key] for key in ("minimum", "exclusiveMinimum", "maximum",
                                         "exclusiveMaximum") if key in node}
    if not all(isinstance(v, int | float) and not isinstance(v, bool)
               for v in bounds.values()):
        return node
    low = max([-limit] + [bounds[k] for k in ("minimum", "exclusiveMinimum") if k in bounds])
    high = min([limit] + [bounds[k] for k in ("maximum", "exclusiveMaximum") if k in bounds])
    if low > high:
        return node
    node = {**node, "minimum": max(bounds.get("minimum", -limit), -limit),
            "maximum": min(bounds.get("maximum", limit), limit)}
    if not integer_only and "multipleOf" not in node:
        node["multipleOf"] = NUMBER_STEP
    return node


def lark_of(grammar: str) -> str:
    """A grammar in llguidance's Lark: as given, or converted from GBNF, llama.cpp's form
    (`root ::= ...`), which its server and vLLM's `grammar` take. ValueError naming the
    fault where it is neither."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        return any_to_lark(grammar)
    except GbnfToLarkError as e:
        raise ValueError(f"the grammar is neither Lark nor GBNF: {e}") from None


# --- a tokenizer's vocabulary as the engine reads it ------------------------------------


class _CharTokens:
    """What llguidance's TokenizerWrapper reads of a tokenizer given by its tokens' bytes;
    it tokenizes a text greedily, longest token first (any tokenization of the bytes
    serves: the engine tokenizes the text a grammar forces)."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None,
                 specials: list[int]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, bos
        self.special_token_ids = specials
        special = set(specials)
        self.ids: dict[bytes, int] = {}
        for i, piece in enumerate(tokens):
            if piece and i not in special:
                self.ids.setdefault(piece, i)
        self.longest = max(map(len, self.ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        out, at = [], 0
        while at < len(data):
            for n in range(min(self.longest, len(data) - at), 0, -1):
                token = self.ids.get(data[at : at + n])
                if token is not None:
                    out.append(token)
                    at += n
                    break
            else:
                at += 1  # a byte no token holds: nothing can write it
        return out


class Vocabulary:
    """A tokenizer's tokens for the engine, for a model of `n_vocab` logits."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        llguidance = require_llguidance()
        self.n_vocab = n_vocab
        ends = [t for t in getattr(tokenizer, "eos_ids", ()) if t < n_vocab]
        self.size = n_vocab if ends else n_vocab + 1
        """The engine's vocabulary: one more where an end-of-text token is added."""
        eos = ends or [n_vocab]
        self.ends = tuple(ends)
        kind = getattr(tokenizer, "kind", None)
        if kind == "char":
            n = len(tokenizer.specials)
            tokens = [b""] * n + [c.encode("utf-8") for c in tokenizer.chars]
            tokens += [b""] * (self.size - len(tokens))
            specials = list(range(n)) + list(range(len(tokenizer.itos), self.size))
            wrapper = _CharTokens(tokens, eos[0], tokenizer.bos_id, specials)
            self.engine = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper),
                                                 eos_token=eos)
        elif hasattr(tokenizer, "tok"):  # a Hugging Face `tokenizers` model (BPE, SentencePiece)
            try:
                self.engine = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=self.size,
                                                     eos_token=eos)
            except ValueError:  # a decoder llguidance does not read (SentencePiece's Metaspace)
                tokens, specials = _piece_bytes(tokenizer.tok, self.size)
                wrapper = _CharTokens(tokens, eos[0], tokenizer.bos_id, specials)
                self.engine = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper),
                                                     eos_token=eos)
        else:
            raise ConstraintError(f"constraints need a character, BPE or SentencePiece "
                                  f"tokenizer; this model's is {kind!r}")
        self.grammars: OrderedDict[Constraint, Grammar] = OrderedDict()
        self.lock = threading.Lock()


def _piece_bytes(tok: Any, size: int) -> tuple[list[bytes], list[int]]:
    """Each token's bytes read from its piece, as SentencePiece writes them ("▁" a
    space, "<0xHH>" a byte), and the special tokens' ids."""
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    tokens, special_ids = [], []
    for i in range(size):
        piece = tok.id_to_token(i)
        if piece is None or piece in specials:
            tokens.append(b"")
            special_ids.append(i)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            tokens.append(bytes([int(piece[3:5], 16)]))
        else:
            tokens.append(piece.replace("▁", " ").encode("utf-8"))
    return tokens, special_ids


_VOCABULARIES: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def vocabulary(tokenizer: Any, n_vocab: int | None = None) -> Vocabulary:
    """The tokenizer's Vocabulary, built once (about a second for 50,000 tokens)."""
    n_vocab = n_vocab or tokenizer.vocab_size
    with _LOCK:
        found = _VOCABULARIES.get(tokenizer)
        if found is None or found.n_vocab != n_vocab:
            found = _VOCABULARIES[tokenizer] = Vocabulary(tokenizer, n_vocab)
        return found


def compile_grammar(tokenizer: Any, constraint: Constraint, n_vocab: int | None = None
                    ) -> Grammar:
    """The constraint compiled for the tokenizer, from the cache when it was before;
    ConstraintError naming why when the engine cannot compile it."""
    vocab = vocabulary(tokenizer, n_vocab)
    with vocab.lock:
        grammar = vocab.grammars.get(constraint)
        if grammar is not None:
            vocab.grammars.move_to_end(constraint)
            return grammar
    grammar = Grammar(vocab, constraint)
    with vocab.lock:
        vocab.grammars[constraint] = grammar
        if len(vocab.grammars) > CACHE_SIZE:
            vocab.grammars.popitem(last=False)
    return grammar


class Grammar:
    """A constraint compiled for a vocabulary: a matcher at the start, copied per use."""

    def __init__(self, vocab: Vocabulary, constraint: Constraint) -> None:
        llguidance = require_llguidance()
        self.vocab, self.constraint = vocab, constraint
        try:
            text = constraint.engine_grammar()
        except (ValueError, TypeError) as e:
            raise ConstraintError(str(e)) from None
        self.start_matcher = llguidance.LLMatcher(vocab.engine, text, log_level=0)
        if self.start_matcher.is_error():
            error = self.start_matcher.get_error().strip().replace("\n", " ")
            raise ConstraintError(f"the {constraint.kind.replace('_', ' ')} cannot be "
                                  f"compiled: {error}")
        first = self.start()
        bits = torch.zeros(first.words, dtype=torch.int32)
        first.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        if first.matcher.is_error() or not bool(bits.any()):
            raise ConstraintError(f"no token of this model's vocabulary can start text that "
                                  f"follows the {constraint.kind.replace('_', ' ')}")

    def start(self, ends: tuple[int, ...] = ()) -> Matcher:
        """A matcher for one new sequence; `ends`: more tokens that end it as the
        end-of-text token does (a chat's end of turn)."""
        return Matcher(self, self.start_matcher.deep_copy(), ends)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, grammar: Grammar, matcher: Any, ends: tuple[int, ...]) -> None:
        self.grammar, self.matcher = grammar, matcher
        self.ends = tuple(t for t in ends if t < grammar.vocab.n_vocab)
        self.words = (grammar.vocab.size + 31) // 32

    @property
    def stopped(self) -> bool:
        """The text is complete and nothing may follow it."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def fill(self, bits: Tensor) -> None:
        """Write the allowed next tokens into `bits`, a contiguous (W,) int32 CPU row."""
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        if self.matcher.is_error():
            raise ConstraintError(f"the constraint failed: {self.matcher.get_error()}")

    def advance(self, token: int) -> None:
        """Take the drawn token (an end token ends the sequence and needs no taking)."""
        if token in self.ends or token in self.grammar.vocab.ends:
            return
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"token {token} does not continue the constrained text: "
                                  f"{self.matcher.get_error()}")


def blocked(matchers: list[Matcher], V: int) -> Tensor:
    """(n, V) bool: True where a matcher disallows the token; its end tokens are allowed
    wherever the end of text is."""
    n = len(matchers)
    bits = torch.zeros(n, matchers[0].words, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill(bits[row])
    # Bit k of word w is token 32 w + k: the words' bytes in memory order (x86 and ARM are
    # little-endian) are the tokens in groups of 8, each unpacked by one table lookup.
    out = _BLOCKED[bits.view(torch.uint8).long()].reshape(n, -1)[:, :V]
    vocab = matchers[0].grammar.vocab
    ends = list(vocab.ends) or [vocab.n_vocab]
    words = bits[:, [e // 32 for e in ends]]
    shifts = torch.tensor([e % 32 for e in ends], dtype=torch.int32)
    can_end = ((words >> shifts) & 1).any(-1).tolist()
    for row, matcher in enumerate(matchers):
        if matcher.ends and can_end[row]:
            out[row, list(matcher.ends)] = False
    return out


def allowed(matchers: list[Matcher], V: int) -> Tensor:
    """(n, V) bool: each matcher's allowed next tokens (the complement of `blocked`)."""
    return ~blocked(matchers, V)


def mask_logits(logits: Tensor, matchers: list[Matcher]) -> Tensor:
    """(n, V) logits -> the same with every token the matchers disallow at -inf (in
    place, and returned)."""
    mask = blocked(matchers, logits.shape[-1])
    if bool(mask.all(-1).any()):
        raise ConstraintError("the constraint allows no next token")
    return logits.masked_fill_(mask.to(logits.device), float("-inf"))
