"""A GGUF file's tokenizer, in and out: tokenizer.ggml.* metadata <-> a Hugging Face
`tokenizers.Tokenizer` held as tformer's PretrainedBPETokenizer.

Two kinds of vocabulary: `gpt2` (byte-level BPE with merges) and `llama` (SentencePiece's
BPE: scores instead of merges, byte fallback, spaces as U+2581). A byte-level vocabulary
splits text before its merges as llama.cpp does for the file's `tokenizer.ggml.pre`,
llama.cpp's own name for the regular expressions of the model's tokenizer.json, so that
the ids equal llama.cpp's. (`smollm`, for one, splits every digit apart: its merges never
saw two digits together.)
"""

from __future__ import annotations

import json
from typing import Any

from tformer.data.tokenizers import PretrainedBPETokenizer
from tformer.errors import TformerError

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_SPLIT = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    # tokenizer.ggml.pre -> the expressions llama.cpp applies one after the other, each to
    # the pieces the one before left (llama-vocab.cpp)
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt-2": (GPT2_SPLIT,),
    "smollm": (r"\p{N}", GPT2_SPLIT),
    "starcoder": (r"\p{N}", GPT2_SPLIT),
    "llama-bpe": (LLAMA3_SPLIT,),
    "llama3": (LLAMA3_SPLIT,),
    "qwen2": (QWEN2_SPLIT,),
    "deepseek-r1-qwen": (QWEN2_SPLIT,),
}
IGNORE_MERGES = ("llama-bpe", "llama3")
"""Pre-tokenizers whose piece is one token whenever the vocabulary has it, merges or not."""
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
               "<|eom_id|>", "<EOT>")
"""Control tokens llama.cpp also ends a generation at (its end-of-generation set)."""


def _pre_tokenizer(pre: str, source: Any):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_SPLITS:
        raise TformerError(f"{source}: tokenizer.ggml.pre {pre!r} is not known; tformer reads "
                           f"{', '.join(PRE_SPLITS)}")
    splits = PRE_SPLITS[pre]
    parts = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    return pre_tokenizers.Sequence([*parts, pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False)])


def _byte_level(meta: dict[str, Any], tokens: list[str], source: Any):
    from tokenizers import Tokenizer, decoders, models

    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TformerError(f"{source}: a gpt2 vocabulary without tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre", "default")
    vocab = {token: i for i, token in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                       fuse_unk=False, byte_fallback=False, ignore_merges=pre in IGNORE_MERGES)
    tok = Tokenizer(model)
    tok.pre_tokenizer = _pre_tokenizer(pre, source)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], source: Any):
    """SentencePiece's BPE as llama.cpp runs it: the pair whose joined text is the token of
    the highest score merges first, a piece the vocabulary lacks becomes its bytes
    (<0xNN>), and (with add_space_prefix) text after the start or a special token gets a
    leading space; spaces are U+2581."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TformerError(f"{source}: a llama vocabulary needs one tokenizer.ggml.scores "
                           f"value per token")
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                       unk_token=tokens[unk] if unk is not None else None)
    tok = Tokenizer(model)
    space = "\u2581"
    steps = [normalizers.Replace(" ", space)]
    decode = [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(space))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(decode)
    return tok


def tokenizer_from_gguf(file: Any) -> PretrainedBPETokenizer:
    """The tokenizer a GGUF file's metadata describes, its control tokens special (matched
    whole in text, skipped in decoding), its chat template kept."""
    from tokenizers import AddedToken

    meta, source = file.metadata, file.path
    tokens = meta.get("tokenizer.ggml.tokens")
    kind = meta.get("tokenizer.ggml.model")
    if tokens is None or kind is None:
        raise TformerError(f"{source}: the metadata has no tokenizer (tokenizer.ggml.model "
                           f"and tokenizer.ggml.tokens)")
    builders = {"gpt2": _byte_level, "llama": _sentencepiece}
    if kind not in builders:
        raise TformerError(f"{source}: tokenizer.ggml.model {kind!r} is not read; tformer "
                           f"reads {', '.join(builders)}")
    tokens = list(tokens)
    tok = builders[kind](meta, tokens, source)
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
    if tok.get_vocab_size() != len(tokens):
        raise TformerError(f"{source}: the vocabulary has {len(tokens)} tokens but only "
                           f"{tok.get_vocab_size()} different ones")

    def name(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            return None
        if not 0 <= i < len(tokens):
            raise TformerError(f"{source}: tokenizer.ggml.{key}_token_id = {i} is not a token "
                               f"(0 to {len(tokens) - 1})")
        return tokens[i]

    eos = name("eos")
    ends = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    ends += [i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
             if k == CONTROL and t in END_OF_TURN]
    # Without the key, llama.cpp puts bos before a SentencePiece vocabulary's texts only.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    tokenizer = PretrainedBPETokenizer(tok, bos=name("bos"), eos=eos, pad=name("padding"),
                                       more_eos=[i for i in dict.fromkeys(ends)
                                                 if i is not None],
                                       add_bos=add_bos and name("bos") is not None)
    tokenizer.chat_template = meta.get("tokenizer.chat_template")
    return tokenizer


def gguf_vocab(tokenizer: Any) -> dict[str, Any]:
    """tokenizer.ggml.* metadata for a byte-level BPE tokenizer (the `gpt2` model): its
    tokens in id order, token types, merges, pre-tokenizer name and special ids."""
    if getattr(tokenizer, "tok", None) is None:
        raise TformerError(f"a GGUF vocabulary needs a BPE tokenizer; this checkpoint's is "
                           f"{tokenizer.kind!r}")
    data = json.loads(tokenizer.tok.to_str())
    model = data["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise TformerError("only a byte-level BPE tokenizer can be written to a GGUF file")
    vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for token, i in vocab.items():
        tokens[i] = token
    types = [1] * size
    for added in data.get("added_tokens", []):
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    for i, token in enumerate(tokens):
        if token == f"[PAD{i}]" and token not in vocab:
            types[i] = 5  # UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre_name(tokenizer.tok),
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(getattr(tokenizer, "add_bos", False)),
    }
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        i = getattr(tokenizer, f"{key}_id", None)
        if i is not None:
            meta[f"tokenizer.ggml.{gguf_key}_token_id"] = int(i)
    if tokenizer.chat_template is not None:
        meta["tokenizer.chat_template"] = tokenizer.chat_template
    return meta


def pre_name(tok: Any) -> str:
    """The tokenizer.ggml.pre name of a tokenizer's pre-tokenizer: one of those this module
    builds, or GPT-2's plain byte-level one (the BPE trained here); else an error."""
    found = json.loads(tok.to_str()).get("pre_tokenizer")
    for name in PRE_SPLITS:
        if found == json.loads(_as_json(_pre_tokenizer(name, "")))["pre_tokenizer"]:
            return name
    if found is not None and found.get("type") == "ByteLevel" and \
            not found.get("add_prefix_space") and found.get("use_regex", True):
        return "gpt-2"
    digits = {"type": "Digits", "individual_digits": True}
    if found is not None and found.get("type") == "Sequence" and \
            len(found["pretokenizers"]) == 2 and found["pretokenizers"][0] == digits and \
            found["pretokenizers"][1].get("type") == "ByteLevel":
        return "smollm"  # Hugging Face's spelling of the same split
    raise TformerError(f"this tokenizer's pre-tokenizer has no llama.cpp name: "
                       f"{json.dumps(found)[:200]}")


def _as_json(pre) -> str:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    return tok.to_str()
