"""The modern decoder's options (RMSNorm, SwiGLU, rotary embeddings, grouped-query
attention, q/k norms, q/k/v biases, a decoupled head size, sliding windows) against a
forward pass written out here in float64: one head and one query at a time, rotations and
frequencies from Python's math, every parameter random (norm weights included)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tformer.errors import TformerError
from tformer.layers import Rotary, RotaryScaling
from tformer.models.gpt import GPT, GPTConfig

from .test_options import ACT, randomise


def rms(x, module, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * module.weight.double()


def layer_norm(x, module, eps):
    mean = x.mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
    out = out * module.weight.double()
    return out + module.bias.double() if module.bias is not None else out


def normed(cfg, x, module):
    if module is None:
        return x
    return (rms if cfg.norm_kind == "rmsnorm" else layer_norm)(x, module, cfg.norm_eps)


def linear(x, layer):
    out = x @ layer.weight.double().T
    return out + layer.bias.double() if layer.bias is not None else out


def frequencies(cfg, rotated: int) -> list[float]:
    """Angle per position of each rotated pair, scaled as cfg says, in Python floats."""
    out = []
    for i in range(rotated // 2):
        f = cfg.rope_theta ** (-2 * i / rotated)
        if cfg.rope_scaling == "linear":
            f /= cfg.rope_factor
        elif cfg.rope_scaling == "llama3":
            wavelength = 2 * math.pi / f
            low = cfg.rope_original_context / cfg.rope_low_freq_factor
            high = cfg.rope_original_context / cfg.rope_high_freq_factor
            if wavelength > low:
                f /= cfg.rope_factor
            elif wavelength >= high:
                s = ((cfg.rope_original_context / wavelength - cfg.rope_low_freq_factor)
                     / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
                f = (1 - s) * f / cfg.rope_factor + s * f
        out.append(f)
    return out


def rotate(cfg, vec: torch.Tensor, pos: int) -> torch.Tensor:
    """One head's (d,) query or key at position `pos`, each pair turned by its angle."""
    if not cfg.rotary:
        return vec
    d = vec.shape[0]
    rotated = 2 * int(d * cfg.rope_fraction // 2)
    out = vec.clone()
    for i, f in enumerate(frequencies(cfg, rotated)):
        a, b = (2 * i, 2 * i + 1) if cfg.rope_layout == "interleaved" else (i, i + rotated // 2)
        c, s = math.cos(pos * f), math.sin(pos * f)
        out[a], out[b] = vec[a] * c - vec[b] * s, vec[a] * s + vec[b] * c
    return out


def attention(cfg, attn, x):
    """x (T, D) -> (T, D): causal (and windowed) grouped-query attention, written out."""
    T = x.shape[0]
    H, H_kv, d, dv = attn.n_head, attn.n_kv_head, attn.d_head, attn.d_value
    qkv = linear(x, attn.qkv_proj)
    q, k, v = qkv.split([H * d, H_kv * d, H_kv * dv], dim=-1)
    heads = []
    for h in range(H):
        g = h // (H // H_kv)  # the key/value head this query head reads
        out = torch.zeros(T, dv, dtype=torch.float64)
        for i in range(T):
            qi = q[i, h * d : (h + 1) * d]
            if attn.q_norm is not None:
                qi = rms(qi, attn.q_norm, cfg.norm_eps)
            qi = rotate(cfg, qi, i)
            scores, values = [], []
            for j in range(i + 1):
                if cfg.window is not None and i - j >= cfg.window:
                    continue
                kj = k[j, g * d : (g + 1) * d]
                if attn.k_norm is not None:
                    kj = rms(kj, attn.k_norm, cfg.norm_eps)
                scores.append(float(qi @ rotate(cfg, kj, j)) / math.sqrt(d))
                values.append(v[j, g * dv : (g + 1) * dv])
            weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            out[i] = sum(w * val for w, val in zip(weights, values, strict=True))
        heads.append(out)
    return linear(torch.cat(heads, -1), attn.out_proj)


def feedforward(cfg, ff, x):
    act = ACT[cfg.activation]
    if cfg.feedforward == "gated":
        return linear(act(linear(x, ff.gate)) * linear(x, ff.up), ff.down)
    return linear(act(linear(x, ff.up)), ff.down)


def naive(model: GPT, tokens: list[int]) -> torch.Tensor:
    cfg = model.cfg
    x = model.embed.weight.double()[tokens]
    if cfg.position == "learned":
        x = x + model.positions.table.weight.double()[: len(tokens)]
    for block in model.blocks:
        x = x + attention(cfg, block.attn, normed(cfg, x, block.attn_residual.norm))
        x = x + feedforward(cfg, block.ff, normed(cfg, x, block.ff_residual.norm))
    return linear(normed(cfg, x, model.final_norm), model.lm_head)


LLAMA = {"position": "none", "rotary": True, "norm_kind": "rmsnorm", "norm_eps": 1e-6,
         "feedforward": "gated", "activation": "silu", "bias": False}
OPTIONS = [
    {"norm_kind": "rmsnorm"},
    {"feedforward": "gated", "activation": "silu"},
    {"feedforward": "gated", "activation": "gelu_tanh", "bias": False},
    {"rotary": True},
    {"rotary": True, "position": "none", "rope_layout": "interleaved"},
    {"rotary": True, "position": "none", "rope_fraction": 0.5, "rope_theta": 500.0},
    {**LLAMA, "rope_scaling": "linear", "rope_factor": 4.0},
    # Llama 3's scaling, with an original context that puts pairs in all three bands.
    {**LLAMA, "rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
     "rope_high_freq_factor": 4.0, "rope_original_context": 16, "rope_theta": 500000.0},
    {**LLAMA, "n_kv_head": 2},
    {**LLAMA, "n_kv_head": 1},
    {**LLAMA, "qkv_bias": True},  # Qwen2: biases on q, k, v only
    {**LLAMA, "qk_norm": True, "d_head": 6, "n_kv_head": 2},  # Qwen3
    {**LLAMA, "window": 3, "n_kv_head": 2},  # Mistral
    {"window": 4, "attn_bias": False, "qkv_bias": True},
]


def named(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items())


def tiny(vocab: int = 11, **options) -> GPT:
    cfg = GPTConfig(vocab_size=vocab, context=12, n_layer=2, n_head=4, d_model=16,
                    tie_embeddings=False, **options)
    return GPT(cfg).eval()


def test_defaults_are_todays_layers():
    block = tiny().blocks[0]
    assert isinstance(block.attn_residual.norm, torch.nn.LayerNorm)
    assert not hasattr(block.ff, "gate") and block.attn.rotary is None
    assert block.attn.n_kv_head == block.attn.n_head and block.attn.q_norm is None


@pytest.mark.parametrize("options", OPTIONS, ids=named)
def test_option_matches_a_float64_forward_written_out(options):
    model = tiny(**options)
    randomise(model)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    with torch.no_grad():
        got = model(torch.tensor([tokens]))[0].double()
        want = naive(model, tokens)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_qkv_bias_is_apart_from_the_output_projections():
    attn = tiny(**{**LLAMA, "qkv_bias": True}).blocks[0].attn
    assert attn.qkv_proj.bias is not None and attn.out_proj.bias is None
    assert attn.qkv_proj.weight.shape == (4 * 4 + 2 * 4 * 4, 16)
    gqa = tiny(n_kv_head=2, d_head=6).blocks[0].attn
    assert gqa.qkv_proj.weight.shape == (4 * 6 + 2 * 2 * 6, 16)
    assert gqa.out_proj.weight.shape == (16, 4 * 6)


CACHED = [{**LLAMA, "n_kv_head": 2}, {**LLAMA, "n_kv_head": 1, "qk_norm": True},
          {**LLAMA, "window": 4, "n_kv_head": 2}, {"window": 3}]


@pytest.mark.parametrize("options", CACHED, ids=named)
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward(options):
    # Past the window's length: 12 tokens through a window of 3 or 4.
    model = tiny(37, **options)
    randomise(model, seed=3)
    tokens = torch.randint(0, 37, (3, 12))
    full = model(tokens)
    cache = model.make_cache(3)
    assert cache.self_attn[0].k.shape[1] == model.blocks[0].attn.n_kv_head
    pieces = [model(tokens[:, :5], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", CACHED, ids=named)
@torch.no_grad()
def test_a_left_padded_batch_equals_each_row_alone(options):
    model = tiny(37, **options)
    randomise(model, seed=4)
    rows = [torch.randint(0, 37, (n,)) for n in (9, 5, 7)]
    width = max(len(r) for r in rows)
    tokens = torch.stack([torch.cat([torch.full((width - len(r),), 2), r]) for r in rows])
    is_real = torch.stack([torch.arange(width) >= width - len(r) for r in rows])
    batched = model(tokens, is_real)
    cache = model.make_cache(3, padded=True)
    model(tokens[:, :-2], is_real[:, :-2], cache=cache)
    steps = [model(tokens[:, t : t + 1], is_real[:, t : t + 1], cache=cache)
             for t in (width - 2, width - 1)]
    for i, row in enumerate(rows):
        alone = model(row[None])[0]
        torch.testing.assert_close(batched[i, width - len(row):], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat(steps, 1)[i], alone[-2:], atol=1e-5, rtol=1e-5)


def test_rotary_dot_products_depend_on_distance_only():
    rotary = Rotary(8, theta=100.0, scaling=RotaryScaling("linear", 2.0))
    q, k = torch.randn(2, 1, 1, 1, 8, dtype=torch.float64)
    dots = [float(rotary(q, torch.tensor([p + 3])) @ rotary(k, torch.tensor([p])).mT)
            for p in (0, 5, 40)]
    # The angles are float32, as the reference implementations make them.
    assert dots == pytest.approx([dots[0]] * 3, abs=1e-5)


def test_rotary_angles_stay_float32_in_a_bfloat16_model():
    model = tiny(37, **LLAMA)
    positions = torch.arange(300, 302)
    x = torch.ones(1, 1, 2, 4)
    want = model.blocks[0].attn.rotary(x, positions)
    model.to(torch.bfloat16)
    got = model.blocks[0].attn.rotary(x.bfloat16(), positions)
    # bfloat16 rounding of the result only (a bfloat16 angle at 300 is off by ~1 radian).
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=0)


@pytest.mark.parametrize("options,message", [
    ({"n_kv_head": 3}, "model.n_kv_head = 3 must divide model.n_head = 4"),
    ({"norm_kind": "batchnorm"}, "model.norm_kind = 'batchnorm' is not allowed"),
    ({"feedforward": "moe"}, "model.feedforward = 'moe' is not allowed"),
    ({"rope_scaling": "dynamic"}, "model.rope_scaling = 'dynamic' is not allowed"),
    ({"rope_beta_fast": 1.0}, "model.rope_beta_fast = 1.0 must exceed model.rope_beta_slow"),
    ({"rotary": True, "rope_fraction": 0.1}, "model.rope_fraction = 0.1 rotates nothing"),
    ({"window": 0}, "model.window"),
])
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(TformerError, match=message.replace("(", r"\(")):
        GPTConfig(vocab_size=11, n_head=4, d_model=16, **options)


@torch.no_grad()
def test_sampling_with_the_cache_equals_without_and_the_cpu_paths_take_the_options():
    from tformer.decoding.lm import generate
    from tformer.kernels.formats import quantize_model

    model = tiny(37, **{**LLAMA, "n_kv_head": 2, "qk_norm": True, "window": 5})
    randomise(model, seed=5)
    prompt = torch.randint(0, 37, (2, 3))

    def sample(m, use_cache):
        g = torch.Generator().manual_seed(0)
        return torch.stack(list(generate(m, prompt, max_new_tokens=8, top_k=5, generator=g,
                                         use_cache=use_cache)), 1)

    cached = sample(model, True)
    assert torch.equal(cached, sample(model, False))
    tokens = torch.randint(0, 37, (2, 10))
    want = model(tokens)
    torch.testing.assert_close(quantize_model(model, "fp32")(tokens), want,
                               atol=1e-5, rtol=1e-5)
    # int8 weights: close, not equal (a per-channel int8 matrix keeps ~2-3 digits).
    int8 = quantize_model(model, "int8")(tokens)
    assert (int8 - want).abs().max() < 0.1 * want.abs().max()


def test_a_modern_config_trains_a_step_and_its_checkpoint_loads(tmp_path):
    from tformer import loading
    from tformer.config import config_from_dict
    from tformer.training.trainer import train

    model = {"family": "gpt", "n_layer": 1, "n_head": 4, "d_model": 16, "context": 16,
             **LLAMA, "n_kv_head": 2, "qk_norm": True, "window": 8, "rope_scaling": "llama3",
             "rope_factor": 8.0, "rope_original_context": 8}
    cfg = config_from_dict({"model": model}, [
        "train.steps=1", "train.batch_size=2", "train.device=cpu", "train.eval_every=1",
        "train.checkpoint_every=1", "train.eval_batches=1", "train.warmup_steps=0",
        "train.schedule=noam", "model.dropout=0.1"])
    result = train(cfg, tmp_path / "run")
    assert result.step == 1 and result.skipped_steps == 0
    loaded = loading.load_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001")
    saved = loaded.model.cfg
    assert saved == dataclasses.replace(cfg.model, vocab_size=saved.vocab_size)
    assert (saved.window, saved.n_kv_head, saved.rope_scaling) == (8, 2, "llama3")


@pytest.mark.parametrize("feedforward,norm_kind", [("gated", "layernorm"), ("plain", "rmsnorm")])
@torch.no_grad()
def test_a_gated_or_rmsnorm_translation_model_decodes_as_its_full_pass(feedforward, norm_kind):
    # The one-call decoder step (kernels/step.py) runs plain feed-forward layers only, under
    # either norm: a gated model's cache carries none, and its layers run as modules.
    from tformer.decoding.runner import runner
    from tformer.kernels.step import DecoderStep
    from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

    model = Seq2Seq(Seq2SeqConfig(vocab_size=23, max_len=16, n_layer=2, n_head=2, d_model=16,
                                  dropout=0.0, feedforward=feedforward, activation="silu",
                                  norm_kind=norm_kind)).eval()
    randomise(model, seed=6)
    src, tgt = torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 6))
    real = torch.ones_like(src, dtype=torch.bool)
    full = model(src, real, tgt)
    model = runner(model)
    cache = model.make_cache(3, 6)
    if feedforward == "gated":
        assert cache.step is None
    else:
        assert isinstance(cache.step, DecoderStep) or cache.lineage is None  # (no kernel)
    memory = model.encode(src, real)
    steps = [model.decode(tgt[:, t : t + 1], memory, real, cache=cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
