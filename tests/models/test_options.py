"""Every architecture option of the GPT and the seq2seq model against a naive forward pass
written out here: float64, one head at a time, positions from Python's math, masks as
loops. Every parameter is random (LayerNorm weights and biases too)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from tformer.config import config_from_dict
from tformer.layers import RMSNorm
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

ACT = {
    "relu": lambda x: x.clamp(min=0),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                      * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1 + torch.exp(-x)),
}


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)


def sinusoid_table(n: int, d: int, layout: str) -> torch.Tensor:
    table = torch.zeros(n, d, dtype=torch.float64)
    for pos in range(n):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            sin_at, cos_at = (i, d // 2 + i) if layout == "halves" else (2 * i, 2 * i + 1)
            table[pos, sin_at], table[pos, cos_at] = math.sin(angle), math.cos(angle)
    return table


def norm(x, module):
    if module is None:
        return x
    if isinstance(module, RMSNorm):  # x / rms(x) * weight, no mean taken out
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + module.eps) * module.weight.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(var + module.eps) * module.weight.double()
    return out + module.bias.double() if module.bias is not None else out


def linear(x, weight, bias):
    out = x @ weight.double().T
    return out + bias.double() if bias is not None else out


def attend(x, memory, weight, bias, out, n_head, may_attend):
    """x (T, D), memory (S, D); weight/bias: the q, k, v projections stacked; may_attend(i, j)."""
    D = x.shape[1]
    d = D // n_head
    wq, wk, wv = weight.split(D)
    bq, bk, bv = bias.split(D) if bias is not None else (None, None, None)
    q, k, v = linear(x, wq, bq), linear(memory, wk, bk), linear(memory, wv, bv)
    heads = []
    for h in range(n_head):
        cols = slice(h * d, (h + 1) * d)
        scores = q[:, cols] @ k[:, cols].T / math.sqrt(d)
        for i in range(scores.shape[0]):
            for j in range(scores.shape[1]):
                if not may_attend(i, j):
                    scores[i, j] = -math.inf
        heads.append(torch.softmax(scores, -1) @ v[:, cols])
    return linear(torch.cat(heads, -1), out.weight, out.bias)


def self_attention(x, mha, n_head, may_attend):
    return attend(x, x, mha.qkv_proj.weight, mha.qkv_proj.bias, mha.out_proj, n_head, may_attend)


def cross_attention(x, memory, mha, n_head, may_attend):
    weight = torch.cat([mha.q_proj.weight, mha.kv_proj.weight])
    bias = None if mha.q_proj.bias is None else torch.cat([mha.q_proj.bias, mha.kv_proj.bias])
    return attend(x, memory, weight, bias, mha.out_proj, n_head, may_attend)


def feedforward(x, ff, activation):
    if hasattr(ff, "gate"):  # SwiGLU's shape: down(act(gate x) * up x)
        gated = ACT[activation](linear(x, ff.gate.weight, ff.gate.bias))
        return linear(gated * linear(x, ff.up.weight, ff.up.bias), ff.down.weight, ff.down.bias)
    return linear(ACT[activation](linear(x, ff.up.weight, ff.up.bias)), ff.down.weight,
                  ff.down.bias)


def sublayer(x, residual, f, pre):
    if pre:
        return x + f(norm(x, residual.norm))
    return norm(x + f(x), residual.norm)


def naive_gpt(model: GPT, tokens: list[int]) -> torch.Tensor:
    cfg = model.cfg
    T = len(tokens)
    x = model.embed.weight.double()[tokens]
    if cfg.scale_embeddings:
        x = x * math.sqrt(cfg.d_model)
    if cfg.position == "learned":
        x = x + model.positions.table.weight.double()[:T]
    else:
        x = x + sinusoid_table(T, cfg.d_model, cfg.sinusoid_layout)
    x = norm(x, model.embed_norm)
    pre = cfg.norm == "pre"
    for block in model.blocks:
        x = sublayer(x, block.attn_residual,
                     lambda h, b=block: self_attention(h, b.attn, cfg.n_head, lambda i, j: j <= i),
                     pre)
        x = sublayer(x, block.ff_residual, lambda h, b=block: feedforward(h, b.ff, cfg.activation),
                     pre)
    if pre and cfg.final_norm:
        x = norm(x, model.final_norm)
    return linear(x, model.lm_head.weight, model.lm_head.bias)


GPT_OPTIONS = [
    {},
    {"scale_embeddings": True},
    {"embed_norm": True},
    {"output_bias": True},
    {"final_norm": False},
    {"attn_bias": False},
    {"bias": False, "attn_bias": True},
    {"position": "sinusoidal", "sinusoid_layout": "halves"},
    {"position": "sinusoidal"},
    {"activation": "gelu_tanh"},
    {"activation": "silu"},
    {"norm": "post", "embed_norm": True, "output_bias": True, "activation": "relu"},
    {"norm_kind": "rmsnorm", "embed_norm": True},
    {"norm": "post", "norm_kind": "rmsnorm", "feedforward": "gated"},
]


@pytest.mark.parametrize("options", GPT_OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_gpt_options_match_a_naive_forward(options):
    model = GPT(GPTConfig(vocab_size=11, context=8, n_layer=2, n_head=2, d_model=8,
                          tie_embeddings=False, **options)).eval()
    randomise(model)
    tokens = [3, 1, 4, 1, 5, 9, 2]
    with torch.no_grad():
        got = model(torch.tensor([tokens]))[0].double()
    assert torch.allclose(got, naive_gpt(model, tokens), atol=1e-5, rtol=0)


def naive_seq2seq(model: Seq2Seq, src: list[int], tgt: list[int]) -> torch.Tensor:
    cfg = model.cfg
    pre = cfg.norm == "pre"
    scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
    table = sinusoid_table(max(len(src), len(tgt)), cfg.d_model, cfg.sinusoid_layout)

    x = norm(model.src_embed.weight.double()[src] * scale + table[: len(src)],
             model.src_embed_norm)
    for layer in model.encoder:
        x = sublayer(x, layer.attn_residual,
                     lambda h, m=layer: self_attention(h, m.attn, cfg.n_head, lambda i, j: True),
                     pre)
        x = sublayer(x, layer.ff_residual,
                     lambda h, m=layer: feedforward(h, m.ff, cfg.activation), pre)
    memory = norm(x, model.encoder_norm)

    y = norm(model.tgt_embed.weight.double()[tgt] * scale + table[: len(tgt)],
             model.tgt_embed_norm)
    for layer in model.decoder:
        y = sublayer(y, layer.self_residual,
                     lambda h, m=layer: self_attention(h, m.self_attn, cfg.n_head,
                                                       lambda i, j: j <= i), pre)
        y = sublayer(y, layer.cross_residual,
                     lambda h, m=layer: cross_attention(h, memory, m.cross_attn, cfg.n_head,
                                                        lambda i, j: True), pre)
        y = sublayer(y, layer.ff_residual,
                     lambda h, m=layer: feedforward(h, m.ff, cfg.activation), pre)
    y = norm(y, model.decoder_norm)
    return linear(y, model.out_proj.weight, model.out_proj.bias)


SEQ2SEQ_OPTIONS = [
    {},
    {"output_bias": True},
    {"embed_norm": True},
    {"scale_embeddings": False},
    {"final_norm": False},
    {"attn_bias": False},
    {"sinusoid_layout": "halves"},
    {"activation": "silu"},
    {"activation": "gelu_tanh"},
    # Marian's shape: post-norm, [sin | cos], SiLU, an output bias.
    {"norm": "post", "sinusoid_layout": "halves", "activation": "silu", "output_bias": True},
    {"norm_kind": "rmsnorm", "norm_eps": 1e-6, "embed_norm": True},
    {"feedforward": "gated", "activation": "silu", "bias": False},
    {"norm": "post", "norm_kind": "rmsnorm", "feedforward": "gated"},
]


@pytest.mark.parametrize("options", SEQ2SEQ_OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_seq2seq_options_match_a_naive_forward(options):
    model = Seq2Seq(Seq2SeqConfig(vocab_size=13, max_len=16, n_layer=2, n_head=2, d_model=8,
                                  dropout=0.0, **options)).eval()
    randomise(model)
    src, tgt = [4, 7, 2, 9, 2], [1, 5, 6, 3]
    with torch.no_grad():
        got = model(torch.tensor([src]), torch.ones(1, len(src), dtype=torch.bool),
                    torch.tensor([tgt]))[0].double()
    assert torch.allclose(got, naive_seq2seq(model, src, tgt), atol=1e-5, rtol=0)


def test_seq2seq_target_padding_mask_makes_padding_invisible():
    """Targets padded at the left, in the middle of a batch: with tgt_real each real
    position gives what the same target unpadded gives."""
    model = Seq2Seq(Seq2SeqConfig(vocab_size=13, max_len=16, n_layer=2, n_head=2, d_model=8,
                                  dropout=0.0)).eval()
    randomise(model)
    src = torch.tensor([[4, 7, 2, 9, 2], [5, 5, 3, 2, 0]])
    src_real = src != 0
    targets = [[1, 5, 6, 3], [1, 8]]
    tgt = torch.tensor([[1, 5, 6, 3], [0, 0, 1, 8]])
    tgt_real = tgt != 0
    with torch.no_grad():
        padded = model(src, src_real, tgt, tgt_real)
        unmasked = model(src, src_real, tgt)
        for row, target in enumerate(targets):
            alone = model(src[row : row + 1, : int(src_real[row].sum())],
                          src_real[row : row + 1, : int(src_real[row].sum())],
                          torch.tensor([target]))[0]
            real = padded[row][tgt_real[row]]
            assert torch.allclose(real, alone, atol=1e-5), row
    # Without the mask the left padding leaks into the second row.
    assert not torch.allclose(unmasked[1][tgt_real[1]], padded[1][tgt_real[1]], atol=1e-3)


@pytest.mark.parametrize("family,model_keys", [
    ("gpt", {"n_layer": 1, "n_head": 2, "d_model": 8, "context": 8, "vocab_size": 11}),
    ("seq2seq", {"n_layer": 1, "n_head": 2, "d_model": 8, "max_len": 8, "vocab_size": 11}),
    ("transformer-xl", {"n_layer": 1, "n_head": 2, "d_model": 8, "context": 8,
                        "vocab_size": 11}),
])
def test_an_old_config_without_the_new_keys_keeps_its_meaning(family, model_keys):
    """A config.json written before these options existed loads, and builds the model it
    built then: the same tensors and no new ones."""
    from tformer.registry import get_family

    cfg = config_from_dict({"model": {"family": family, **model_keys}})
    model = get_family(family).model(cfg.model)
    names = set(model.state_dict())
    assert not any("embed_norm" in n for n in names)
    assert not any(n.endswith(("lm_head.bias", "out_proj.bias")) and "attn" not in n
                   and "blocks" not in n and "encoder" not in n and "decoder" not in n
                   for n in names)
    assert cfg.model.activation in ("gelu", "relu")
    assert cfg.model.sinusoid_layout == "interleaved"
    if family == "gpt":
        assert "final_norm.weight" in names and not cfg.model.scale_embeddings


def test_transformer_xl_halves_layout_and_output_bias():
    """Transformer-XL's relative encodings in the [sin | cos] layout are the math loop's
    table read at distances K-1 ... 0, and its output bias adds to every position's logits."""
    from tformer.models.transformer_xl import TransformerXL, TransformerXLConfig

    cfg = TransformerXLConfig(vocab_size=11, context=6, mem_len=0, n_layer=1, n_head=2,
                              d_model=8, sinusoid_layout="halves", output_bias=True,
                              activation="silu")
    model = TransformerXL(cfg).eval()
    randomise(model)
    table = sinusoid_table(6, 8, "halves")
    got = model.relative_positions(6, torch.device("cpu")).double()
    assert torch.allclose(got, table.flip(0), atol=1e-6)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        with_bias = model(tokens)
        bias = model.lm_head.bias.clone()
        model.lm_head.bias.zero_()
        without = model(tokens)
    assert torch.allclose(with_bias - without, bias.expand_as(with_bias), atol=1e-6)
    assert bias.abs().min() > 0


SAVED = Path(__file__).parent / "data" / "saved_before_the_modern_options.json"
"""The [model] table of a config.json as the code before the shared base config and the
modern options wrote it, for each family, and the state dict's shapes of its model."""


@pytest.mark.parametrize("family", ["gpt", "seq2seq", "transformer-xl"])
def test_a_config_json_saved_before_loads_unchanged(family):
    from tformer.registry import get_family

    saved = json.loads(SAVED.read_text())[family]
    cfg = config_from_dict({"model": saved["model"]})
    now = cfg.to_dict()["model"]
    assert {k: now[k] for k in saved["model"]} == saved["model"]
    defaults = dataclasses.asdict(get_family(family).model_config())
    assert all(now[k] == defaults[k] for k in set(now) - set(saved["model"]))
    model = get_family(family).model(cfg.model)
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == saved["shapes"]
