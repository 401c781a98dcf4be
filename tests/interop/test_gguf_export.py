"""GGUF export: tiny random files of every architecture imported, exported and imported
again (the same tensors), the export read by transformers (the same logits), the quantized
types as llama.cpp's blocks, and a GPT trained here with its own BPE tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tformer.cli import main
from tformer.errors import TformerError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tformer.interop.command import export_checkpoint  # noqa: E402
from tformer.interop.gguf import import_gguf, read_gguf  # noqa: E402

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt2")
"""Those conftest.write_tiny_gguf writes; Gemma's and Phi-3's files are written by tformer's
own export in test_families.py."""


def reference(path):
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def imported(request, tiny_gguf, tmp_path_factory):
    arch = request.param
    path = tiny_gguf(arch, tied=arch == "qwen2")
    return arch, import_gguf(path, tmp_path_factory.mktemp(f"run-{arch}") / "run")


def test_export_then_import_gives_the_same_tensors_and_transformers_logits(imported, tmp_path,
                                                                           capsys):
    arch, run = imported
    out = tmp_path / "model.gguf"
    assert main(["export", str(run), "--out", str(out)]) == 0  # .gguf: the format is gguf
    assert f"as GGUF {arch} (--format gguf)" in capsys.readouterr().out
    assert read_gguf(out).architecture == arch
    back = import_gguf(out, tmp_path / "back")
    from tformer.loading import load_checkpoint

    ours = load_checkpoint(run, weights="fp32").model  # the kept blocks dequantized
    before, after = ours.state_dict(), load_file(back / "model.safetensors")
    assert set(before) - set(after) <= {"lm_head.weight"}  # a tied head is saved once
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), name
    assert (back / "chat_template.jinja").read_text() == (run / "chat_template.jinja").read_text()
    tokens = torch.randint(0, 322, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(tokens) - reference(out)(tokens).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "f16"])
def test_quantized_exports_hold_llama_cpp_blocks(kind, tiny_gguf, tmp_path):
    from tformer.loading import load_checkpoint

    source = tiny_gguf("llama")  # its embedding table Q8_0, kept as those blocks
    run = import_gguf(source, tmp_path / "run")
    out = export_checkpoint(run, tmp_path / "m.gguf", "gguf", type=kind)
    file = read_gguf(out)
    matrices = {t.type for t in file.tensors.values() if len(t.shape) == 2}
    assert matrices == {kind.upper()}
    assert {t.type for t in file.tensors.values() if len(t.shape) == 1} == {"F32"}
    # a block type's values: each block's own scale times small integers (plus its min)
    held = load_checkpoint(run, weights="fp32").model.embed.weight
    embed = file.tensors["token_embd.weight"].dequantize()
    step = {"q8_0": 1 / 127, "q4_0": 1 / 7, "q4_1": 1 / 15, "f16": 1e-3}[kind]
    error = (embed - held).abs().max()
    assert error <= step * held.abs().max()
    if kind == "q8_0":  # the type it is held in: its bytes as they came
        assert np.array_equal(file.tensors["token_embd.weight"].data,
                              read_gguf(source).tensors["token_embd.weight"].data)
    elif kind != "f16":  # quantized as llama.cpp does: gguf's own quantizer, byte for byte
        want = gguf.quants.quantize(held.numpy(), gguf.GGMLQuantizationType[kind.upper()])
        assert np.array_equal(file.tensors["token_embd.weight"].data, want)


def test_a_gpt_trained_here_exports_with_its_tokenizer(tmp_path):
    """A GPT-2-layout model with tformer's own byte-level BPE (<pad>, <s>, </s>)."""
    from tformer.config import RunConfig, TrainConfig
    from tformer.data.lm import LMDataConfig
    from tformer.data.tokenizers import BPETokenizer
    from tformer.models.gpt import GPT, GPTConfig
    from tformer.training.checkpoint import save_checkpoint

    tokenizer = BPETokenizer.train(["Before we proceed any further, hear me speak. 123"] * 20,
                                   300)
    # transformers' GGUF reading of GPT-2 takes 4 d_model and 1024 positions whatever the
    # file says (llama.cpp reads them from the file)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, d_model=32,
                    d_ff=128, context=1024, dropout=0.0, activation="gelu_tanh")
    model = GPT(cfg).eval()
    save_checkpoint(tmp_path / "run", RunConfig("gpt", cfg, LMDataConfig(), TrainConfig()),
                    model, tokenizer)
    out = export_checkpoint(tmp_path / "run", tmp_path / "m.gguf")
    meta = read_gguf(out).metadata
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.eos_id
    ids = torch.tensor([tokenizer.encode("hear me speak")])
    with torch.no_grad():
        assert (model(ids) - reference(out)(ids).logits).abs().max() <= 1e-5
    back = import_gguf(out, tmp_path / "back")
    import tformer

    assert tformer.load(back).tokenizer.encode("hear me 42") == tokenizer.encode("hear me 42")


def test_export_refuses_what_gguf_cannot_hold(tiny_gguf, tmp_path):
    run = import_gguf(tiny_gguf("llama"), tmp_path / "run")
    with pytest.raises(TformerError, match="--type 'q2_k' is not known"):
        export_checkpoint(run, tmp_path / "m.gguf", type="q2_k")
    with pytest.raises(TformerError, match="--type is for --format gguf"):
        export_checkpoint(run, tmp_path / "hf", "llama", type="q8_0")


def test_llama3_scaling_goes_out_as_the_same_rope_freqs(tiny_gguf, tmp_path):
    from tformer.interop.gguf import llama3_factors

    divisors = llama3_factors(1000.0, 64, 8.0, 1.0, 4.0, 8192)
    path = tiny_gguf("llama", rope_freqs=list(divisors))
    out = export_checkpoint(import_gguf(path, tmp_path / "run"), tmp_path / "m.gguf")
    assert np.array_equal(read_gguf(out).tensors["rope_freqs.weight"].data,
                          read_gguf(path).tensors["rope_freqs.weight"].data)


def test_blocks_brought_in_go_out_as_the_same_bytes(tiny_gguf, tmp_path):
    """A file's matrices kept as blocks on import are written back as those bytes when the
    export asks for their type, not dequantized and rounded again. Its Q8_0 blocks here use
    integers within +-60, which rounding again would stretch to +-127; another type rounds
    them anew."""
    path = tmp_path / "narrow.gguf"
    original = tiny_gguf("llama", types=("Q8_0",) * 8)
    data = bytearray(original.read_bytes())
    rng = np.random.default_rng(0)
    for tensor in gguf.GGUFReader(original).tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            blocks = np.frombuffer(data, np.uint8, tensor.n_bytes, tensor.data_offset)
            narrow = rng.integers(-60, 61, (len(blocks) // 34, 32)).astype(np.int8)
            patch = blocks.reshape(-1, 34).copy()
            patch[:, 2:] = narrow.view(np.uint8)
            data[tensor.data_offset:tensor.data_offset + tensor.n_bytes] = patch.tobytes()
    path.write_bytes(bytes(data))
    source = read_gguf(path)
    run = import_gguf(path, tmp_path / "run")
    out = read_gguf(export_checkpoint(run, tmp_path / "m.gguf", "gguf", type="q8_0"))
    kept = [n for n, t in source.tensors.items() if t.type == "Q8_0"]  # the embedding too
    assert len(kept) >= 8 and "token_embd.weight" in kept
    for name in kept:
        raw = np.asarray(source.tensors[name].data)
        again = gguf.quants.quantize(source.tensors[name].dequantize().numpy(),
                                     gguf.GGMLQuantizationType.Q8_0)
        assert not np.array_equal(again, raw)  # what rounding again would have written
        assert out.tensors[name].type == "Q8_0"
        assert np.array_equal(out.tensors[name].data, raw), name
    other = read_gguf(export_checkpoint(run, tmp_path / "o.gguf", "gguf", type="q4_1"))
    assert {other.tensors[n].type for n in kept} == {"Q4_1"}
