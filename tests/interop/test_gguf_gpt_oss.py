"""gpt-oss in and out of GGUF (llama.cpp's `gpt-oss` architecture): a tiny random
GptOssForCausalLM with YaRN and sliding and full layers in turn, imported, written as GGUF
by tformer and read back. transformers' own GGUF loader is no reference here: 5.25 fails on
the yarn keys of a gpt-oss file (it takes a field's first part, the key's length, for its
value), and without YaRN it places no sinks nor expert stacks and takes no head_dim from
the file; so the file is checked against transformers' forward pass of the original
folder, and its q8_0 blocks against gguf's own quantizer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tformer.errors import TformerError
from tformer.interop.command import export_checkpoint, import_checkpoint
from tformer.interop.gguf import read_gguf
from tformer.loading import load_checkpoint

from .test_gpt_oss import HARMONY
from .test_llama import bpe_tokenizer, randomise

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "rope_theta": 10000.0}
"""llama.cpp's YaRN: the correction range in whole dimensions (truncate)."""
TOKENS = torch.tensor([[5, 17, 3, 88, 41, 9, 62, 23, 7, 1, 54, 33, 2, 71, 45, 8, 19, 60]])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(the HF model, its folder imported as a tformer checkpoint)."""
    config = transformers.GptOssConfig(
        vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=6,
        num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=YARN,
        tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(config).eval()
    randomise(hf)
    with torch.no_grad():  # gates past the clamp's limit somewhere, and varied routes
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(20.0)
            layer.mlp.router.weight.mul_(8.0)
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    hf.save_pretrained(root / "hf")
    tokenizer = bpe_tokenizer()
    tokenizer.chat_template = HARMONY
    tokenizer.save_pretrained(root / "hf")
    return hf, import_checkpoint(root / "hf", root / "run")


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    """type -> (the file, the checkpoint imported from it)."""
    _, run = source
    root = tmp_path_factory.mktemp("gpt-oss-files")
    files = {}
    for kind in ("f32", "q8_0"):
        path = export_checkpoint(run, root / f"model-{kind}.gguf", type=kind)
        files[kind] = path, import_checkpoint(path, root / f"back-{kind}")
    return files


@torch.no_grad()
def test_f32_file_round_trips_to_the_same_tensors_and_transformers_logits(source, written):
    hf, run = source
    path, back = written["f32"]
    file = read_gguf(path)
    assert file.architecture == "gpt-oss"
    assert file.get("attention.sliding_window") == 4 and file.get("expert_count") == 6
    assert file.get("rope.scaling.type") == "yarn"
    assert "blk.0.attn_sinks.weight" in file.tensors
    assert file.metadata["tokenizer.chat_template"] == HARMONY
    assert load_checkpoint(back).tokenizer.chat_template == HARMONY
    assert file.tensors["blk.1.ffn_gate_exps.bias"].shape == (6, 32)
    original, again = load_checkpoint(run).model, load_checkpoint(back).model
    # The file holds the epsilon as float32; everything else comes back as it was.
    assert again.cfg.norm_eps == pytest.approx(original.cfg.norm_eps, rel=1e-6)
    assert replace(again.cfg, norm_eps=original.cfg.norm_eps) == original.cfg
    want, got = original.state_dict(), again.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    expected = hf(TOKENS).logits
    assert (again(TOKENS) - expected).abs().max() <= 1e-5 * expected.abs().max()


@torch.no_grad()
def test_q8_0_file_holds_gguf_quantizers_blocks_and_computes_with_them(source, written):
    """Matrices and expert stacks are q8_0 blocks byte for byte as gguf.quants makes them
    from the original weights (norms, biases, sinks and the router stay f32), and the
    re-imported model computes what transformers computes with those rounded weights."""
    hf, _ = source
    path, back = written["q8_0"]
    file = read_gguf(path)
    q8 = gguf.GGMLQuantizationType.Q8_0
    layer = hf.model.layers[1]
    gate = layer.mlp.experts.gate_up_proj[..., 0::2].transpose(1, 2).contiguous().numpy()
    stack = file.tensors["blk.1.ffn_gate_exps.weight"]
    assert stack.ggml_type == q8
    assert np.array_equal(np.asarray(stack.data), gguf.quants.quantize(gate, q8))
    for name in ("blk.1.ffn_gate_inp.weight", "blk.1.ffn_up_exps.bias",
                 "blk.1.attn_sinks.weight", "blk.1.attn_q.bias"):
        assert file.tensors[name].ggml_type == gguf.GGMLQuantizationType.F32
    rounded = transformers.GptOssForCausalLM(hf.config).eval()
    rounded.load_state_dict(hf.state_dict())
    for name, p in rounded.named_parameters():
        if p.dim() >= 2 and "router" not in name and not name.endswith("_bias"):
            value = p.detach().numpy()
            if name.endswith("gate_up_proj") or name.endswith("down_proj"):
                value = value.transpose(0, 2, 1)  # quantized along the input, as stored
            q = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(value), q8),
                                       q8)
            q = q.transpose(0, 2, 1) if q.ndim == 3 else q
            p.data.copy_(torch.from_numpy(np.ascontiguousarray(q)))
    expected = rounded(TOKENS).logits
    # Held as blocks, the matrices multiply q8_0-rounded activations (as llama.cpp's do);
    # their fp32 values are the exact comparison.
    got = load_checkpoint(back, weights="fp32").model(TOKENS)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    held = load_checkpoint(back).model
    assert "q8_0" in {getattr(m, "fmt", None) for m in held.modules()}
    assert (held(TOKENS) - expected).abs().max() <= 0.2 * expected.abs().max()


def test_what_llama_cpp_cannot_compute_is_refused_by_name(source, tmp_path):
    """The clamp's constants are fixed in llama.cpp's graph; transformers' untruncated
    YaRN has no key; a config so changed is refused, not written wrong."""
    from tformer.interop.gguf_export import _layout

    _, run = source
    cfg = load_checkpoint(run).model.cfg
    with pytest.raises(TformerError, match=r"GGUF's gpt-oss cannot express this model: "
                                           r"model.glu_limit = 5.0"):
        _layout(replace(cfg, glu_limit=5.0))
    with pytest.raises(TformerError, match="model.rope_truncate = false"):
        _layout(replace(cfg, rope_truncate=False))
    with pytest.raises(TformerError, match="global_every = 2"):
        _layout(replace(cfg, window=None))


@torch.no_grad()
def test_experts_in_mxfp4_as_llama_cpp_converts_the_released_models(source, tmp_path,
                                                                      monkeypatch):
    """llama.cpp's converter keeps gpt-oss's experts in MXFP4, which tformer does not
    write: the expert stacks of an f32 file are put in MXFP4 by gguf's quantizer here. They
    come back dequantized as gguf's own dequantizer gives them, the model intact."""
    from tformer.interop import gguf_export

    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    stored = gguf_export._stored

    def experts_in_mxfp4(name, value, kind):
        if name.endswith("_exps.weight"):
            return gguf.quants.quantize(value.numpy(), mxfp4), mxfp4
        return stored(name, value, kind)

    monkeypatch.setattr(gguf_export, "_stored", experts_in_mxfp4)
    _, run = source
    path = export_checkpoint(run, tmp_path / "mxfp4.gguf", type="f32")
    assert read_gguf(path).tensors["blk.0.ffn_down_exps.weight"].ggml_type == mxfp4
    original = load_checkpoint(run).model
    back = load_checkpoint(import_checkpoint(path, tmp_path / "back")).model
    for i, block in enumerate(original.blocks):
        for projection in ("gate", "up", "down"):
            weight = getattr(block.ff.experts, projection).numpy()
            expected = gguf.quants.dequantize(gguf.quants.quantize(weight, mxfp4), mxfp4)
            got = getattr(back.blocks[i].ff.experts, projection)
            assert torch.equal(got, torch.from_numpy(expected))
    assert torch.equal(back.blocks[1].attn.sinks, original.blocks[1].attn.sinks)
