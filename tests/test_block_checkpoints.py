"""Checkpoints holding weights as blocks (kernels/blocks.py): saved under the parameters'
own names with the formats in the safetensors header, loaded as they are (weights=None) or
made fp32."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tformer.config import config_from_dict
from tformer.data.tokenizers import CharTokenizer
from tformer.errors import TformerError
from tformer.kernels import blocks
from tformer.kernels.prepack import swap_linears
from tformer.loading import WEIGHTS, load_checkpoint
from tformer.models.gpt import GPT
from tformer.training.checkpoint import save_checkpoint

HELD = {"lm_head.weight": "q8_0", "blocks.0.ff.up.weight": "q4_0",
        "blocks.1.attn.out_proj.weight": "q4_1"}


@pytest.fixture
def checkpoint(tmp_path):
    """(a checkpoint with HELD's weights as blocks, the model it was saved from)."""
    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz ")
    cfg = config_from_dict({"model": {"n_layer": 2, "n_head": 2, "d_model": 64, "d_ff": 96,
                                      "context": 32, "vocab_size": tokenizer.vocab_size}})
    torch.manual_seed(0)
    fp32 = GPT(cfg.model).eval()
    model = swap_linears(fp32, lambda name, linear: linear)  # a copy whose modules change
    for param, fmt in HELD.items():
        path = param.removesuffix(".weight")
        parent, _, attr = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, blocks.BlockLinear.from_linear(getattr(owner, attr), fmt))
    return save_checkpoint(tmp_path / "ckpt", cfg, model, tokenizer), model


def test_blocks_are_saved_under_the_parameters_names(checkpoint):
    path, _ = checkpoint
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        assert json.loads(f.metadata()[blocks.FORMATS_KEY]) == HELD
        for param, fmt in HELD.items():
            t = f.get_tensor(param)
            assert t.dtype == torch.uint8 and t.shape[1] % blocks.BLOCK_BYTES[fmt] == 0
        assert f.get_tensor("embed.weight").dtype == torch.float32  # untied from lm_head


def test_weights_none_keeps_the_blocks(checkpoint):
    path, model = checkpoint
    loaded = load_checkpoint(path).model
    assert blocks.formats_of(loaded) == HELD
    tokens = torch.randint(0, 27, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_weights_fp32_dequantizes(checkpoint):
    path, model = checkpoint
    loaded = load_checkpoint(path, weights="fp32").model
    assert blocks.formats_of(loaded) == {}
    want = {p: model.get_submodule(p.removesuffix(".weight")).weight for p in HELD}
    for param, w in want.items():
        got = loaded.get_submodule(param.removesuffix(".weight"))
        assert type(got) is torch.nn.Linear and torch.equal(got.weight, w)


def rewrite(path, formats: dict) -> None:
    """The checkpoint's weights saved again with `formats` in the header (and its manifest
    refreshed, so that only the header is wrong)."""
    from tformer.loading import MANIFEST, sha256_of

    file = path / WEIGHTS
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(file), metadata={blocks.FORMATS_KEY: json.dumps(formats)})
    manifest = json.loads((path / MANIFEST).read_text())
    manifest[WEIGHTS] = {"bytes": file.stat().st_size, "sha256": sha256_of(file)}
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("formats, message", [
    (HELD | {"lm_head.weight": "q3_k"}, "unknown block format 'q3_k'"),
    (HELD | {"final_norm.weight": "q8_0"}, "no linear layer or embedding of that name"),
    # an embedding may be held as blocks, but this one's stored tensor is fp32
    (HELD | {"embed.weight": "q8_0"}, r"embed.weight has shape \[27, 64\], its config says "
                                      r"\[27, 68\]"),
    (["lm_head.weight"], "not an object of parameter names and formats"),
])
def test_a_wrong_header_is_a_one_line_error(checkpoint, formats, message):
    path, _ = checkpoint
    rewrite(path, formats)
    with pytest.raises(TformerError, match=message):
        load_checkpoint(path)


def test_load_keeps_the_blocks_or_quantizes_as_asked(checkpoint):
    import tformer

    path, _ = checkpoint
    kept = tformer.load(path, device="cpu", threads=1)
    assert blocks.formats_of(kept.module) == HELD
    assert "q4_0+q4_1+q8_0" in kept.name or kept.weights == "q4_0+q4_1+q8_0"
    assert blocks.formats_of(tformer.load(path, weights="fp32", device="cpu",
                                          threads=1).module) == {}
    again = blocks.formats_of(tformer.load(path, weights="q4_1", device="cpu",
                                           threads=1).module)
    assert again.pop("lm_head.weight") == "q8_0"  # (the 4-bit formats' output layer)
    assert set(again.values()) == {"q4_1"} and HELD.keys() - {"lm_head.weight"} <= again.keys()


def test_a_fp32_checkpoint_quantizes_at_load(tmp_path):
    import tformer

    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz ")
    cfg = config_from_dict({"model": {"n_layer": 1, "n_head": 2, "d_model": 64, "d_ff": 96,
                                      "context": 32, "vocab_size": tokenizer.vocab_size}})
    path = save_checkpoint(tmp_path / "fp32", cfg, GPT(cfg.model).eval(), tokenizer)
    model = tformer.load(path, weights="q8_0", device="cpu", threads=1)
    assert model.weights == "q8_0"
    assert set(blocks.formats_of(model.module).values()) == {"q8_0"}
    assert tformer.load(path, device="cpu", threads=1).weights == "fp32"


def test_an_embedding_held_as_blocks_is_saved_once_and_loads_tied(tmp_path):
    """A tied embedding table held as blocks (a GGUF file's, kept) and the output layer over
    the same bytes: the checkpoint holds the bytes once and names both in its header; they
    load as they were, tied; --weights makes both fp32 (tied), and a model that trains from
    the checkpoint gets the table as a trainable fp32 weight."""
    from tformer.loading import load_weights

    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz ")
    cfg = config_from_dict({"model": {"n_layer": 1, "n_head": 2, "d_model": 64, "d_ff": 96,
                                      "context": 32, "vocab_size": tokenizer.vocab_size}})
    torch.manual_seed(0)
    fp32 = GPT(cfg.model).eval()
    model = swap_linears(fp32, lambda name, linear: linear)
    table = blocks.BlockEmbedding(blocks.quantize(fp32.embed.weight, "q4_0"), "q4_0", 64)
    model.embed, model.lm_head = table, table.tied_output()
    path = save_checkpoint(tmp_path / "ckpt", cfg, model, tokenizer)
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        assert json.loads(f.metadata()[blocks.FORMATS_KEY]) == {"embed.weight": "q4_0",
                                                                 "lm_head.weight": "q4_0"}
        assert "lm_head.weight" not in f.keys()
        assert torch.equal(f.get_tensor("embed.weight"), table.blocks)
    loaded = load_checkpoint(path).model
    assert loaded.lm_head.blocks is loaded.embed.blocks
    tokens = torch.randint(0, 27, (2, 9))
    values = blocks.dequantize(table.blocks, "q4_0")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
        assert torch.equal(loaded.embed(tokens), values[tokens])
    dense = load_checkpoint(path, weights="fp32").model
    assert type(dense.embed) is torch.nn.Embedding and dense.lm_head.weight is dense.embed.weight
    assert torch.equal(dense.embed.weight, values)
    import tformer

    # the start-up line counts the table once, as the values its blocks hold
    assert tformer.load(path, device="cpu", threads=1).parameters == fp32.num_params()
    plain = GPT(cfg.model)
    load_weights(plain, path)
    assert type(plain.embed) is torch.nn.Embedding and plain.lm_head.weight is plain.embed.weight
    assert torch.equal(plain.embed.weight, values) and plain.embed.weight.requires_grad
