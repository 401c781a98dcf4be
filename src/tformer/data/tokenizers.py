"""Tokenizers: characters, words, or byte-level BPE trained with Hugging Face `tokenizers`,
or a pretrained model's own (GPT-2's byte-level BPE, imported with its weights).

Each saves to one JSON file (tokenizer.json in every checkpoint) and loads back from it with
`load_tokenizer`. Special tokens (padding, begin and end of sequence) are handled here and
nowhere else: ids 0, 1, 2 when a tokenizer trained here has them; a pretrained tokenizer
names its own, and may end a text at several ids. A chat template, where a tokenizer has
one, is saved beside its JSON file as chat_template.jinja, as Hugging Face saves it beside
its tokenizer files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tformer.errors import TformerError

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IGNORE_INDEX = -100
"""A target id that counts for nothing in a loss (padding, or past the end of a stream)."""
SPECIALS = (PAD, BOS, EOS)
KINDS = ("char", "bpe")
"""The kinds a run can train; a pretrained tokenizer ("gpt2") comes with its checkpoint."""
LM_KINDS = (*KINDS, "word")
"""Language models may also read words (translation needs the special tokens)."""
UNK, LINE_END = "<unk>", "\n"
CHAT_TEMPLATE = "chat_template.jinja"


class Tokenizer(Protocol):
    kind: str
    pad_id: int | None
    bos_id: int | None
    eos_id: int | None
    eos_ids: tuple[int, ...]
    """Every id that ends a text, eos_id first; empty where there is none."""
    chat_template: str | None
    """The Jinja template that renders chat messages as the model's prompt (a checkpoint's
    chat_template.jinja), or None."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Translation targets: the same as encode_batch, except for tokenizers with a
        model per side (Marian's)."""
        ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_json(self) -> str: ...


def special_names(tokenizer: Tokenizer) -> dict[str, str | None]:
    """'bos', 'eos', 'pad' -> the token's name, None where the tokenizer has none."""
    named = getattr(tokenizer, "names", None)  # a pretrained tokenizer names its own
    if isinstance(named, dict):
        return {key: named.get(key) for key in ("bos", "eos", "pad")}
    return {key: name if getattr(tokenizer, f"{key}_id", None) is not None else None
            for key, name in (("bos", BOS), ("eos", EOS), ("pad", PAD))}


class CharTokenizer:
    """One id per character seen in training, after the special tokens (if any)."""

    kind = "char"
    chat_template: str | None = None

    def __init__(self, chars: Iterable[str], *, specials: bool = False) -> None:
        self.specials = SPECIALS if specials else ()
        self.chars = sorted(set(chars))
        self.itos = list(self.specials) + self.chars
        self.stoi = {c: i for i, c in enumerate(self.itos) if c not in self.specials}
        self.pad_id, self.bos_id, self.eos_id = (0, 1, 2) if specials else (None, None, None)
        self.eos_ids = (2,) if specials else ()

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

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encode_batch(texts)

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
    eos_ids: tuple[int, ...] = ()
    chat_template: str | None = None

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
    chat_template: str | None = None

    def __init__(self, tokenizer) -> None:  # a tokenizers.Tokenizer
        self.tok = tokenizer
        # Text that happens to contain "<s>" is text: special tokens enter only by id.
        self.tok.encode_special_tokens = True
        self.pad_id = tokenizer.token_to_id(PAD)
        self.bos_id = tokenizer.token_to_id(BOS)
        self.eos_id = tokenizer.token_to_id(EOS)
        self.eos_ids = () if self.eos_id is None else (self.eos_id,)

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

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        return self.tok.to_str()


class BPEDropout:
    """BPE-dropout (Provilkov et al., 2020, "BPE-Dropout: Simple and Effective Subword
    Regularization"): the merge loop of a trained BPE in which every applicable merge is
    skipped with probability p at each step, so that a word comes out in one of its many
    segmentations into the vocabulary's own tokens, more often a finer one. Trained on a
    fresh segmentation every epoch, a translation model sees rare words in their parts and
    the parts in many words. Only training reads it; decoding uses the tokenizer's one
    segmentation.

    Each step merges the lowest-ranked pair that survives its draw (the leftmost of equal
    ones); with p = 0 that is exactly the tokenizer's own encoding. Hugging Face's BPE has a
    dropout option too, but its draws cannot be seeded from Python, and a resumed run must
    see the same segmentations again: the draws here come from the `random.Random` passed in.
    """

    def __init__(self, tokenizer: BPETokenizer, p: float) -> None:
        model = json.loads(tokenizer.tok.to_str())["model"]
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or \
                model.get("ignore_merges"):
            raise TformerError("BPE-dropout reads only the plain byte-level BPE trained here")
        self.p = p
        self.vocab: dict[str, int] = model["vocab"]
        # Merges are saved as "a b" by older versions of `tokenizers`, as ["a", "b"] by newer.
        self.rank = {
            tuple(m.split(" ") if isinstance(m, str) else m): i
            for i, m in enumerate(model["merges"])
        }
        self.pre_tokenize = tokenizer.tok.pre_tokenizer.pre_tokenize_str

    def segment(self, word: str, rng: random.Random) -> list[str]:
        """One word (a pre-tokenized piece, in byte-level characters) -> its tokens."""
        parts = list(word)
        while len(parts) > 1:
            best, at = len(self.rank), -1
            for i in range(len(parts) - 1):
                rank = self.rank.get((parts[i], parts[i + 1]), best)
                # A draw only decides anything for a merge that would beat the best so far,
                # so only those draw: the same distribution, fewer calls.
                if rank < best and (self.p == 0 or rng.random() >= self.p):
                    best, at = rank, i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        return parts

    def encode(self, text: str, rng: random.Random) -> list[int]:
        return [
            self.vocab[token]
            for word, _ in self.pre_tokenize(text)
            for token in self.segment(word, rng)
        ]

    def encode_batch(self, texts: Sequence[str], rng: random.Random) -> list[list[int]]:
        return [self.encode(text, rng) for text in texts]


class PretrainedBPETokenizer:
    """A pretrained model's byte-level BPE (GPT-2's), held as a `tokenizers.Tokenizer` with
    the names of its special tokens. GPT-2 has one, <|endoftext|>, that both begins and
    ends a document, and no padding token.

    Text that contains a special token's name encodes to that token, as Hugging Face's
    tokenizer does: a fine-tuning corpus marks its documents' ends with <|endoftext|>.

    A model may end a text at more ids than its eos token: Llama 3's instruct models list
    <|end_of_text|>, <|eom_id|> and <|eot_id|> in their generation config. `more_eos` are
    those ids; eos_ids is eos_id followed by them.

    Some models were trained on texts that each begin with bos (Llama 2, Mistral, Llama 3):
    `add_bos` says so, and `text_start` puts it before a prompt. `encode` itself never adds
    it, since it also encodes pieces of texts.
    """

    kind = "gpt2"
    chat_template: str | None = None

    def __init__(
        self, tokenizer, *, bos: str | None, eos: str | None, pad: str | None = None,
        more_eos: Sequence[int] = (), add_bos: bool = False,
    ) -> None:  # tokenizer: a tokenizers.Tokenizer
        self.tok = tokenizer
        self.names = {"bos": bos, "eos": eos, "pad": pad}
        self.bos_id = self._id(bos)
        self.eos_id = self._id(eos)
        self.pad_id = self._id(pad)
        if add_bos and self.bos_id is None:
            raise TformerError("the tokenizer adds bos to every text but names no bos token")
        self.add_bos = add_bos
        for token in more_eos:
            if not isinstance(token, int) or self.tok.id_to_token(token) is None:
                raise TformerError(f"end-of-text id {token!r} is not a token of the tokenizer "
                                   f"(0 to {self.vocab_size - 1})")
        ends = [self.eos_id, *more_eos] if self.eos_id is not None else list(more_eos)
        self.eos_ids = tuple(dict.fromkeys(ends))

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        found = self.tok.token_to_id(token)
        if found is None:
            raise TformerError(f"the tokenizer has no token {token!r}")
        return found

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        more: dict[str, Any] = {"eos_ids": list(self.eos_ids)} if self.eos_ids[1:] else {}
        if self.add_bos:
            more["add_bos"] = True
        return json.dumps(
            {"kind": self.kind, **self.names, **more,
             "tokenizer": json.loads(self.tok.to_str())},
            ensure_ascii=False,
        )


class SentencePieceTokenizer:
    """Marian's tokenization (as Hugging Face's MarianTokenizer does it): a source and a
    target SentencePiece model whose pieces map to ids through one shared vocabulary
    (vocab.json; a piece not in it is <unk>). A leading language code such as ">>de<<" is
    one token. The decoder starts from `bos_id`, which for Marian is the padding token.
    Sources are encoded with the source model, targets (for training) with the target one,
    and `decode` detokenizes with the target one.
    """

    kind = "sentencepiece"
    chat_template: str | None = None

    def __init__(
        self, source: bytes, target: bytes, vocab: dict[str, int], *, eos: str, unk: str,
        pad: str, bos_id: int,
    ) -> None:
        spm = require_sentencepiece()
        self.models = {"source": source, "target": target}
        self.source = spm.SentencePieceProcessor(model_proto=source)
        self.target = spm.SentencePieceProcessor(model_proto=target)
        self.vocab = vocab
        self.pieces = {i: piece for piece, i in vocab.items()}
        self.names = {"eos": eos, "unk": unk, "pad": pad}
        for name in (eos, unk, pad):
            if name not in vocab:
                raise TformerError(f"the vocabulary has no {name!r} token")
        self.eos_id, self.unk_id, self.pad_id = vocab[eos], vocab[unk], vocab[pad]
        self.eos_ids = (self.eos_id,)
        self.bos_id = bos_id
        self.special = {self.eos_id, self.unk_id, self.pad_id, bos_id}

    @property
    def vocab_size(self) -> int:
        return max(self.vocab.values()) + 1

    def encode(self, text: str) -> list[int]:
        return self._encode(text, self.source)

    def _encode(self, text: str, model) -> list[int]:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        pieces = code + model.encode(text, out_type=str)
        return [self.vocab.get(p, self.unk_id) for p in pieces]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._encode(t, self.target) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        pieces = [self.pieces[i] for i in ids if i not in self.special and i in self.pieces]
        return self.target.decode_pieces(pieces).replace("\u2581", " ").strip()

    def to_json(self) -> str:
        import base64

        return json.dumps(
            {
                "kind": self.kind,
                **{k: base64.b64encode(v).decode("ascii") for k, v in self.models.items()},
                "vocab": self.vocab,
                **self.names,
                "bos_id": self.bos_id,
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_dict(cls, data: dict) -> SentencePieceTokenizer:
        import base64

        return cls(
            base64.b64decode(data["source"]), base64.b64decode(data["target"]), data["vocab"],
            eos=data["eos"], unk=data["unk"], pad=data["pad"], bos_id=data["bos_id"],
        )


def require_sentencepiece():
    try:
        import sentencepiece
    except ImportError:
        raise TformerError(
            "Marian models need the sentencepiece package: pip install 'tformer[interop]'"
        ) from None
    return sentencepiece


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


def text_start(tokenizer: Any, ids: list[int]) -> list[int]:
    """A text's ids as its model reads a text from the start: after bos where the model was
    trained so (a pretrained tokenizer's `add_bos`), unless the text already begins with it
    (a chat template that writes bos itself)."""
    if getattr(tokenizer, "add_bos", False) and ids[:1] != [tokenizer.bos_id]:
        return [tokenizer.bos_id, *ids]
    return ids


def prompt_start(tokenizer: Any, ids: list[int]) -> list[int]:
    """A prompt's ids as generation reads them: text_start's, and where the prompt is empty
    (nothing to condition on) the start of a text, bos (or a newline where there is none)."""
    ids = text_start(tokenizer, ids)
    if ids:
        return ids
    return [tokenizer.bos_id] if tokenizer.bos_id is not None else tokenizer.encode("\n")


def tokenizer_from_json(text: str) -> Tokenizer:
    data = json.loads(text)
    if data.get("kind") == "char":
        return CharTokenizer(data["chars"], specials=data["specials"])
    if data.get("kind") == "word":
        return WordTokenizer(data["words"])
    from tokenizers import Tokenizer as HFTokenizer

    if data.get("kind") == SentencePieceTokenizer.kind:
        return SentencePieceTokenizer.from_dict(data)
    if data.get("kind") == PretrainedBPETokenizer.kind:
        return PretrainedBPETokenizer(
            HFTokenizer.from_str(json.dumps(data["tokenizer"])),
            bos=data["bos"], eos=data["eos"], pad=data["pad"],
            more_eos=data.get("eos_ids", [])[1:],  # none before several could be kept
            add_bos=data.get("add_bos", False),
        )
    return BPETokenizer(HFTokenizer.from_str(text))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved at `path`, with the chat template saved beside it if there is
    one (so that a run fine-tuned from a checkpoint keeps its template)."""
    path = Path(path)
    try:
        tokenizer = tokenizer_from_json(path.read_text(encoding="utf-8"))
    except Exception as e:  # tokenizers raises its own exception types
        raise TformerError(f"cannot read tokenizer {path}: {e}") from e
    template = path.with_name(CHAT_TEMPLATE)
    if template.is_file():
        tokenizer.chat_template = read_chat_template_file(template)
    return tokenizer


def read_chat_template_file(path: Path) -> str:
    """A chat template's text; unreadable is a one-line error naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TformerError(f"cannot read the chat template {path}: {e}") from None


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """The tokenizer's JSON at `path`, its chat template (if any) beside it."""
    Path(path).write_text(tokenizer.to_json(), encoding="utf-8")
    if tokenizer.chat_template is not None:
        Path(path).with_name(CHAT_TEMPLATE).write_text(tokenizer.chat_template,
                                                        encoding="utf-8")
