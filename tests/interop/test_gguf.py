"""GGUF import on tiny random files written here with gguf.GGUFWriter: every architecture
against transformers' own GGUF reading, every tensor type's dequantization against a
float64 rendering of its block layout written out below, the tokenizer's pre-tokenizers
against transformers' and a plain re-implementation of llama.cpp's, and bad files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from tformer.cli import main
from tformer.errors import TformerError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tformer.interop.gguf import (  # noqa: E402
    import_gguf,
    llama3_factors,
    model_from_gguf,
    read_gguf,
)
from tformer.interop.gguf_vocab import tokenizer_from_gguf  # noqa: E402

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt2")
"""Those conftest.write_tiny_gguf writes (Gemma's and Phi-3's: test_families.py)."""


def reference(path):
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_and_type_equals_transformers(arch, tiny_gguf):
    # qwen2's output is its embedding (no output.weight), the others have their own
    path = tiny_gguf(arch, tied=arch == "qwen2")
    file = read_gguf(path)
    assert {t.type for t in file.tensors.values()} >= {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                                      "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"}
    ours, _ = model_from_gguf(file)
    theirs = reference(path)
    tokens = torch.randint(0, 322, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-5
    assert ours.cfg.tie_embeddings == (arch == "qwen2")


def test_import_writes_a_checkpoint_that_generates(tiny_gguf, tmp_path, capsys):
    path = tiny_gguf("llama")
    assert main(["import", str(path), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    # matrices whose tensors are all of one block type stay blocks; the rest is fp32
    assert out[-2].startswith("kept as blocks: Q4_0 (") and "Q4_1" in out[-2]
    assert "Q4_K" in out[-2] and "Q6_K" in out[-2]
    assert out[-1].startswith("dequantized to fp32: ") and "BF16" in out[-1]
    import tformer

    model = tformer.load(tmp_path / "run")
    assert model.tokenizer.chat_template is not None
    assert model.tokenizer.eos_id == 321  # <|im_end|>, from tokenizer.ggml.eos_token_id
    assert isinstance(model.generate("hello", max_new_tokens=4, temperature=0), str)


# --- dequantization against float64 renderings of the block layouts ----------------------


def f16(b: bytes) -> float:
    return float(np.frombuffer(b, dtype=np.float16)[0])


def scale_min_k4(j: int, s: bytes) -> tuple[int, int]:
    """The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 bytes)."""
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def render(kind: str, block: bytes) -> list[float]:
    """One block's values, computed in float64 from llama.cpp's struct of the type."""
    if kind == "Q8_0":  # fp16 d; int8 q[32]
        d = f16(block[:2])
        return [d * q for q in struct.unpack("32b", block[2:34])]
    if kind in ("Q4_0", "Q4_1"):  # fp16 d; (fp16 m;) uint8 qs[16]: low nibbles, then high
        d, m = f16(block[:2]), (f16(block[2:4]) if kind == "Q4_1" else 0.0)
        qs = block[4:] if kind == "Q4_1" else block[2:]
        q = [b & 15 for b in qs] + [b >> 4 for b in qs]
        return [d * (v - 8) for v in q] if kind == "Q4_0" else [d * v + m for v in q]
    if kind in ("Q5_0", "Q5_1"):  # fp16 d; (fp16 m;) uint32 qh; uint8 qs[16]
        d, m = f16(block[:2]), (f16(block[2:4]) if kind == "Q5_1" else 0.0)
        rest = block[4:] if kind == "Q5_1" else block[2:]
        qh, qs = struct.unpack("<I", rest[:4])[0], rest[4:]
        q = [(qs[j] & 15) | (((qh >> j) & 1) << 4) for j in range(16)]
        q += [(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) for j in range(16)]
        return [d * (v - 16) for v in q] if kind == "Q5_0" else [d * v + m for v in q]
    if kind in ("Q4_K", "Q5_K"):  # fp16 d, dmin; scales[12]; (qh[32];) qs[128]
        d, dmin, scales = f16(block[:2]), f16(block[2:4]), block[4:16]
        qh, qs = (block[16:48], block[48:]) if kind == "Q5_K" else (bytes(32), block[16:])
        out = []
        for j in range(8):  # 8 sub-blocks of 32; pairs share 32 bytes of qs
            sc, mn = scale_min_k4(j, scales)
            chunk = qs[32 * (j // 2): 32 * (j // 2) + 32]
            for i in range(32):
                q = (chunk[i] >> 4) if j % 2 else (chunk[i] & 15)
                q += 16 * ((qh[i] >> j) & 1) if kind == "Q5_K" else 0
                out.append(d * sc * q - dmin * mn)
        return out
    if kind == "Q6_K":  # ql[128]; qh[64]; int8 scales[16]; fp16 d
        ql, qh, d = block[:128], block[128:192], f16(block[208:210])
        scales = struct.unpack("16b", block[192:208])
        out = [0.0] * 256
        for half in range(2):  # 128 values each: ql 64 bytes, qh 32 bytes, 8 scales
            lo, hi, sc = ql[64 * half:], qh[32 * half:], scales[8 * half:]
            for i in range(32):
                quads = ((lo[i] & 15) | ((hi[i] & 3) << 4),
                         (lo[i + 32] & 15) | (((hi[i] >> 2) & 3) << 4),
                         (lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4),
                         (lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4))
                for k, q in enumerate(quads):
                    out[128 * half + 32 * k + i] = d * sc[i // 16 + 2 * k] * (q - 32)
        return out
    if kind == "F16":
        return [float(v) for v in np.frombuffer(block, dtype=np.float16)]
    if kind == "BF16":  # the top half of a float32
        return [struct.unpack("<f", b"\0\0" + block[i:i + 2])[0]
                for i in range(0, len(block), 2)]
    raise AssertionError(kind)


HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Where each block type keeps its fp16 scales."""


def _finite(kind: str, stored: np.ndarray, size: int, rng) -> np.ndarray:
    """Random blocks whose fp16 (or bf16) numbers are finite; every other byte random."""
    if kind in ("F16", "BF16"):
        values = rng.standard_normal(stored.shape[0] * stored.shape[1] // 2).astype(np.float32)
        half = values.astype(np.float16) if kind == "F16" else \
            (values.view(np.uint32) >> 16).astype(np.uint16)
        return half.view(np.uint8).reshape(stored.shape)
    blocks = stored.reshape(stored.shape[0], -1, size)
    for at in HALVES[kind]:
        scale = rng.uniform(-2, 2, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, at:at + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(stored.shape)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                  "Q6_K", "F16", "BF16"])
def test_dequantization_follows_the_block_layout(kind, tmp_path):
    from tformer.interop.gguf import GGUFTensor

    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    cols = 2 * max(block, 32)
    stored = np.random.default_rng(1).integers(0, 256, (3, cols // block * size), np.uint8)
    stored = _finite(kind, stored, size, rng)
    tensor = GGUFTensor("w", kind, int(qtype), (3, cols), stored)
    got = tensor.dequantize().double()
    raw = stored.tobytes()
    rows = [[v for b in range(cols // block)
             for v in render(kind, raw[(r * (cols // block) + b) * size:][:size])]
            for r in range(3)]
    want = torch.tensor(rows, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


# --- bad files ----------------------------------------------------------------------------


def tensor_info_at(data: bytes, name: str) -> tuple[int, int]:
    """Where tensor `name`'s dimensions and its type are in the file's tensor infos."""
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4, at + 4 + 8 * n_dims


def patched(path, tmp_path, edit) -> str:
    data = bytearray(path.read_bytes())
    edit(data)
    out = tmp_path / "bad.gguf"
    out.write_bytes(bytes(data))
    return str(out)


def set_type(name: str, ggml_type: int):
    def edit(data):
        _, at = tensor_info_at(bytes(data), name)
        struct.pack_into("<I", data, at, ggml_type)
    return edit


def set_first_dim(name: str, value: int):
    def edit(data):
        at, _ = tensor_info_at(bytes(data), name)
        struct.pack_into("<Q", data, at, value)
    return edit


def truncate(data):
    del data[len(data) // 2:]


def wrong_magic(data):
    data[:4] = b"GGML"


BAD = {
    "truncated": (truncate, "truncated"),
    "wrong magic": (wrong_magic, "not a GGUF file"),
    "type llama.cpp does not know": (set_type("output_norm.weight", 99), "tensor type"),
    "type tformer does not read": (set_type("output_norm.weight", 10), "Q2_K"),
    "rows of part blocks": (set_first_dim("token_embd.weight", 250), "250"),
    "data past the end": (set_first_dim("output.weight", 1 << 20), "truncated"),
    # the K types (the tiny file's blk.0.ffn_gate is Q4_K, blk.0.ffn_down Q6_K)
    "K rows of part super-blocks": (set_first_dim("blk.0.ffn_gate.weight", 128),
                                    ("blk.0.ffn_gate.weight", "Q4_K", "256")),
    "K data past the end": (set_first_dim("blk.0.ffn_down.weight", 1 << 20),
                            ("blk.0.ffn_down.weight", "Q6_K", "truncated")),
    "IQ2_XXS": (set_type("output_norm.weight", 16), ("output_norm.weight", "IQ2_XXS")),
    "TQ1_0": (set_type("output_norm.weight", 34), ("output_norm.weight", "TQ1_0")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_file_is_a_one_line_error(case, tiny_gguf, tmp_path, capsys):
    edit, words = BAD[case]
    bad = patched(tiny_gguf("llama"), tmp_path, edit)
    assert main(["import", bad, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tformer: error: ") and err.count("\n") == 1, err
    for word in (words,) if isinstance(words, str) else words:
        assert word in err, err
    assert not (tmp_path / "run").exists()


def test_an_unknown_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TformerError, match="architecture 'mamba' cannot be imported"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "run")


# --- tokenizers ---------------------------------------------------------------------------

TEXTS = [
    "Héllo wörld, ça va? Ünïcödé façade naïve",
    "emoji 🙂🚀 and 👩‍👩‍👧 family",
    "\ttabbed\tline\t\t end",
    "runs   of    spaces     here  ",
    "In 1492, 3.14159 and 12345678 items; x=42+7",
    "new\nlines\n\n\nand\r\nreturns",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "it's they'LL we've I'm",
]


@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "default"])
def test_token_ids_equal_llama_cpp(pre, tiny_gguf, llama_cpp_tokenize):
    file = read_gguf(tiny_gguf("llama", pre=pre))
    tokenizer = tokenizer_from_gguf(file)
    for text in TEXTS:
        assert tokenizer.encode(text) == llama_cpp_tokenize(text, file.metadata, pre), text
        assert tokenizer.decode(tokenizer.encode(text)) == text.replace(
            "<|im_start|>", "").replace("<|im_end|>", "")


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_token_ids_equal_transformers(pre, tiny_gguf):
    path = tiny_gguf("llama", pre=pre)
    tokenizer = tokenizer_from_gguf(read_gguf(path))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer.encode(text) == theirs(text, add_special_tokens=False).input_ids, text


def test_an_unknown_pre_tokenizer_is_named(tiny_gguf):
    file = read_gguf(tiny_gguf("llama"))
    file.metadata["tokenizer.ggml.pre"] = "no-such-model"
    with pytest.raises(TformerError, match="tokenizer.ggml.pre 'no-such-model' is not known"):
        tokenizer_from_gguf(file)


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tiny_gguf):
    """Llama 3.x files keep their rope scaling as llama.cpp's converter computed it: one
    divisor per frequency (written out below as the converter's loop); the import finds the
    llama3 parameters again, and an export writes the same divisors."""
    import math

    theta, head, factor = 1000.0, 64, 8.0
    want = []
    for i in range(0, head, 2):
        wavelen = 2 * math.pi * theta ** (i / head)
        if wavelen < 8192 / 4:
            want.append(1.0)
        elif wavelen > 8192 / 1:
            want.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want.append(1 / ((1 - smooth) / factor + smooth))
    assert np.allclose(llama3_factors(theta, head, factor, 1.0, 4.0, 8192), want, rtol=1e-6)
    file = read_gguf(tiny_gguf("llama", rope_freqs=want))
    cfg = model_from_gguf(file)[0].cfg
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor, cfg.rope_original_context) == ("llama3", 8.0, 1.0, 4.0,
                                                                     8192)
    bent = file.tensors["rope_freqs.weight"].data.copy()
    bent[-1] *= 1.5
    file.tensors["rope_freqs.weight"].data = bent
    with pytest.raises(TformerError, match="rope_freqs tensor is not Llama 3's scaling"):
        model_from_gguf(file)


@pytest.mark.parametrize("add_bos", [None, False])
def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece(add_bos, tmp_path):
    """A `llama` vocabulary (SentencePiece's BPE: scores, byte fallback, U+2581 for spaces)
    gives the ids of the sentencepiece library's own model it was written from; a prompt
    begins with bos unless the file says tokenizer.ggml.add_bos_token = false (llama.cpp's
    default for this kind of vocabulary)."""
    import io

    from tformer.data.tokenizers import text_start

    spm = pytest.importorskip("sentencepiece")
    lines = [f"the {w} of {v} and {w}{v}s, naïve façade" for w in ("cat", "dog", "lobster")
             for v in ("sea", "red", "blue", "night")] * 20
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=proto,
                                   vocab_size=400, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2,
                                   # as llama.cpp: runs of spaces kept
                                   remove_extra_whitespaces=False)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    writer = gguf.GGUFWriter(tmp_path / "spm.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = tokenizer_from_gguf(read_gguf(tmp_path / "spm.gguf"))
    for text in ["the cat of sea", "lobsters at night", "naïve façade ü€ 42", "  two  spaces"]:
        assert tokenizer.encode(text) == sp.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == sp.decode(sp.encode(text))
        assert text_start(tokenizer, tokenizer.encode(text)) == sp.encode(
            text, add_bos=add_bos is None), text


@pytest.mark.parametrize("key, value, words", [
    ("llama.rope.scaling.type", "longrope", "rope scaling 'longrope' cannot be expressed"),
    # yarn is read, but only with the factor it scales by
    ("llama.rope.scaling.type", "yarn", "the metadata has no llama.rope.scaling.factor"),
    # a llama file with experts is Mixtral's, and needs how many a token uses
    ("llama.expert_count", 8, "the metadata has no llama.expert_used_count"),
    ("llama.attention.head_count_kv", [2, 1], "key/value heads per layer"),
    ("llama.attention.value_length", 32, "value heads of another size"),
])
def test_metadata_tformer_cannot_express_is_named(key, value, words, tiny_gguf):
    file = read_gguf(tiny_gguf("llama"))
    file.metadata[key] = value
    with pytest.raises(TformerError, match=words):
        model_from_gguf(file)
