"""Tokenizers: characters, words, or byte-level BPE trained with Hugging Face `tokenizers`.

Each saves to one JSON file (tokenizer.json in every checkpoint) and load back from it with
`load_tokenizer`. Special tokens (padding, begin and end of sequence) are handled here and
nowhere else: ids 0, 1, 2 when a tokenizer has them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from tformer.errors import TformerError

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IGNORE_INDEX = -100
"""A target id that counts for nothing in a loss (padding, or past the end of a stream)."""
SPECIALS = (PAD, BOS, EOS)
KINDS = ("char", "bpe")
LM_KINDS = (*KINDS, "word")
"""Language models may also read words (translation needs the special tokens)."""
UNK, LINE_END = "<unk>", "\n"


class Tokenizer(Protocol):
    kind: str
    pad_id: int | None
    bos_id: int | None
    eos_id: int | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_json(self) -> str: ...


class CharTokenizer:
    """One id per character seen in training, after the special tokens (if any)."""

    kind = "char"

    def __init__(self, chars: Iterable[str], *, specials: bool = False) -> None:
        self.specials = SPECIALS if specials else ()
        self.chars = sorted(set(chars))
        self.itos = list(self.specials) + self.chars
        self.stoi = {c: i for i, c in enumerate(self.itos) if c not in self.specials}
        self.pad_id, self.bos_id, self.eos_id = (0, 1, 2) if specials else (None, None, None)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unseen = sorted({c for c in text if c not in self.stoi})
            shown = ", ".join(repr(c) for c in unseen[:5]) + (" ..." if len(unseen) > 5 else "")
            raise TformerError(
                f"the character tokenizer never saw {len(unseen)} of these characters: {shown}"
            ) from None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        n = len(self.specials)
        return "".join(self.itos[i] for i in ids if i >= n)

    def to_json(self) -> str:
        return json.dumps(
            {"kind": "char", "specials": bool(self.specials), "chars": self.chars},
            ensure_ascii=False,
        )


class WordTokenizer:
    """Words split on white space, and the end of each line as a token of its own: the
    convention of the word-level language-model corpora (Penn Treebank, WikiText), whose
    published perplexities count one token per word and one per line end. Words not seen
    in training become <unk>. Decoding puts a space before each word but the first of a
    line, so white space does not come back exactly."""

    kind = "word"
    pad_id = bos_id = eos_id = None

    def __init__(self, words: Iterable[str]) -> None:
        self.itos = [UNK, LINE_END] + sorted(set(words) - {UNK, LINE_END})
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        lines = text.split("\n")
        for i, line in enumerate(lines):
            ids.extend(self.stoi.get(w, 0) for w in line.split())
            if i < len(lines) - 1:
                ids.append(1)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        parts: list[str] = []
        for i in ids:
            word = self.itos[i]
            if word == LINE_END or not parts or parts[-1] == LINE_END:
                parts.append(word)
            else:
                parts.append(" " + word)
        return "".join(parts)

    def to_json(self) -> str:
        return json.dumps({"kind": "word", "words": self.itos[2:]}, ensure_ascii=False)


class BPETokenizer:
    """Byte-level BPE (GPT-2 style): any text encodes, and decoding gives it back exactly."""

    kind = "bpe"

    def __init__(self, tokenizer) -> None:  # a tokenizers.Tokenizer
        self.tok = tokenizer
        # Text that happens to contain "<s>" is text: special tokens enter only by id.
        self.tok.encode_special_tokens = True
        self.pad_id = tokenizer.token_to_id(PAD)
        self.bos_id = tokenizer.token_to_id(BOS)
        self.eos_id = tokenizer.token_to_id(EOS)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        return self.tok.to_str()


def train_tokenizer(
    kind: str, texts: Iterable[str], *, vocab_size: int = 8000, specials: bool = False
) -> Tokenizer:
    """A new tokenizer of `kind` fitted to `texts` (BPE always has the special tokens)."""
    if kind == "char":
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return CharTokenizer(chars, specials=specials)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size)
    if kind == "word":
        words: set[str] = set()
        for text in texts:
            words.update(text.split())
        return WordTokenizer(words)
    raise TformerError(
        f"data.tokenizer = {kind!r} is not allowed; choose one of: {' | '.join(LM_KINDS)}"
    )


def tokenizer_from_json(text: str) -> Tokenizer:
    data = json.loads(text)
    if data.get("kind") == "char":
        return CharTokenizer(data["chars"], specials=data["specials"])
    if data.get("kind") == "word":
        return WordTokenizer(data["words"])
    from tokenizers import Tokenizer as HFTokenizer

    return BPETokenizer(HFTokenizer.from_str(text))


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    try:
        return tokenizer_from_json(path.read_text(encoding="utf-8"))
    except Exception as e:  # tokenizers raises its own exception types
        raise TformerError(f"cannot read tokenizer {path}: {e}") from e


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    Path(path).write_text(tokenizer.to_json(), encoding="utf-8")
