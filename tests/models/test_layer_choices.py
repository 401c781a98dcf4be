"""Gemma's and Phi's layer choices of the GPT decoder, on tiny random models: each against an
independent computation (float64 full passes, written-out formulas), through cached decoding,
the one-call step kernel (which serves a query scale and refuses what it does not compute)
and the paged pool (which keeps what global layers read behind the window)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tformer.decoding.paged import PagedPool, Row
from tformer.decoding.runner import runner
from tformer.errors import TformerError
from tformer.evaluation.loss import Targets
from tformer.kernels import library
from tformer.kernels.formats import quantize_model
from tformer.kernels.step import LMStep
from tformer.layers.norm import OffsetRMSNorm
from tformer.models.gpt import GPT, GPTConfig

VOCAB = 41
MODERN = dict(position="none", rotary=True, norm_kind="rmsnorm", feedforward="gated",
              activation="silu", bias=False, n_kv_head=2)
GEMMA = MODERN | dict(norm_kind="rmsnorm_plus1", activation="gelu_tanh", sandwich_norm=True,
                      scale_embeddings=True, attn_scale=0.3, window=4, global_every=2,
                      rope_local_theta=100.0, rope_theta=5000.0, attn_softcap=1.5,
                      logit_softcap=3.0, d_head=10)
REFUSED = {  # each a choice kernels/step.py's one call does not compute
    "offset norm": MODERN | dict(norm_kind="rmsnorm_plus1"),
    "sandwich norm": MODERN | dict(sandwich_norm=True),
    "score soft cap": MODERN | dict(attn_softcap=1.0),
    "global layers among sliding ones": MODERN | dict(window=4, global_every=2),
    "a rotary base for the sliding layers": MODERN | dict(window=40, global_every=2,
                                                          rope_local_theta=50.0),
    "gemma": GEMMA,
}


def make_model(options: dict, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(**(dict(vocab_size=VOCAB, d_model=32, n_head=4, n_layer=4, context=32,
                            dropout=0.0) | options))
    model = GPT(cfg).eval()
    with torch.no_grad():  # every weight away from its initial value, norms included
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def left_padded(rows: int = 3, length: int = 13):
    g = torch.Generator().manual_seed(rows)
    tokens = torch.randint(0, VOCAB, (rows, length), generator=g)
    is_real = torch.ones(rows, length, dtype=torch.bool)
    for i in range(rows):
        is_real[i, : 3 * i] = False
    return tokens, is_real


def decode(model: GPT, tokens, is_real, prefill: int):
    """Every position's logits: a prompt of `prefill` tokens, then one token a call through
    the decoding runner (with its one-call step where it serves)."""
    run = runner(model)
    cache = run.make_cache(tokens.shape[0], padded=True)
    with torch.no_grad():
        out = [run(tokens[:, :prefill], is_real[:, :prefill], cache=cache)]
        out += [run(tokens[:, t : t + 1], is_real[:, t : t + 1], cache=cache)
                for t in range(prefill, tokens.shape[1])]
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("name", list(REFUSED))
def test_cached_decoding_is_the_float64_full_pass_where_the_step_kernel_stands_aside(name):
    model = make_model(REFUSED[name])
    assert LMStep.of(model.blocks) is None
    tokens, is_real = left_padded()
    got, _ = decode(quantize_model(model, "fp32"), tokens, is_real, prefill=5)
    with torch.no_grad():
        want = make_model(REFUSED[name]).double()(tokens, is_real)
    torch.testing.assert_close(got.double()[is_real], want[is_real], atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")
def test_the_step_kernel_takes_a_query_scale_and_a_partial_rotary(monkeypatch):
    options = MODERN | dict(attn_scale=0.3, rope_fraction=0.75)  # Phi-4-mini's fraction
    calls = []
    original = LMStep.run
    monkeypatch.setattr(LMStep, "run", lambda self, *a: calls.append(1) or original(self, *a))
    tokens, is_real = left_padded()
    got, cache = decode(quantize_model(make_model(options), "fp32"), tokens, is_real, 5)
    assert isinstance(cache.step, LMStep) and len(calls) == tokens.shape[1] - 5
    with torch.no_grad():
        want = make_model(options).double()(tokens, is_real)
    torch.testing.assert_close(got.double()[is_real], want[is_real], atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_the_paged_pool_keeps_what_global_layers_read_behind_the_window():
    model = make_model(GEMMA)
    assert model.cfg.cache_window is None
    assert make_model(MODERN | dict(window=4)).cfg.cache_window == 4
    pool = PagedPool(model, 60, block_size=2)
    g = torch.Generator().manual_seed(2)
    texts, rows = [], []
    for length in (11, 4, 15):
        text = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        row = Row()
        got = torch.cat([pool.read_chunk(row, text[i : i + 3], every_position=True)
                         for i in range(0, length, 3)])
        torch.testing.assert_close(got, model(torch.tensor([text]))[0], atol=1e-5, rtol=1e-5)
        pool.seat(row)
        texts.append(text)
        rows.append(row)
    for _ in range(5):  # the rows decoding together, one token a step
        last = [int(t) for t in torch.randint(0, VOCAB, (3,), generator=g)]
        logits = pool.step(last)
        for i, (text, token) in enumerate(zip(texts, last, strict=True)):
            text.append(token)
            want = model(torch.tensor([text]))[0, -1]
            torch.testing.assert_close(logits[i], want, atol=1e-5, rtol=1e-5)
    for row in rows:  # nothing given back: the global layers read it all
        assert 0 not in row.blocks


@torch.no_grad()
def test_soft_caps_scale_and_offset_norms_as_written_out_in_float64():
    """One Gemma-style block and the logits, computed here from the formulas with the
    model's weights: embeddings times sqrt(d_model), x * rsqrt(mean x^2 + eps) * (1 + w)
    before and after each sublayer, scores q.k * scale soft-capped by c * tanh(s / c),
    a window of 4 on the sliding layer and rotary angles of its own base, GeGLU, and
    capped logits."""
    options = GEMMA | dict(n_layer=2, n_kv_head=4)
    model = make_model(options).double()
    cfg = model.cfg
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))

    def norm(module, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * (
            1 + module.weight)

    def rotate(x, theta):
        d = x.shape[-1]
        inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + half * sin

    x = model.embed(tokens) * math.sqrt(cfg.d_model)
    T, H, d = tokens.shape[1], cfg.n_head, cfg.head_size
    for i, block in enumerate(model.blocks):
        attn = block.attn
        h = norm(block.attn_residual.norm, x)
        q, k, v = attn.qkv_proj(h).split(attn.widths, -1)
        q, k, v = (t.view(1, T, H, d).transpose(1, 2) for t in (q, k, v))
        q, k = norm(attn.q_norm, q) if attn.q_norm else q, norm(attn.k_norm, k) if \
            attn.k_norm else k
        theta = cfg.rope_local_theta if i % 2 == 0 else cfg.rope_theta
        q, k = rotate(q, theta), rotate(k, theta)
        scores = q @ k.transpose(-1, -2) * cfg.attn_scale
        scores = cfg.attn_softcap * torch.tanh(scores / cfg.attn_softcap)
        j = torch.arange(T)
        allowed = (j[None] <= j[:, None]) & ((j[:, None] - j[None] < cfg.window) | (i % 2 == 1))
        out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        out = attn.out_proj(out.transpose(1, 2).reshape(1, T, H * d))
        x = x + norm(block.attn_residual.out_norm, out)
        h = norm(block.ff_residual.norm, x)
        ff = block.ff
        h = ff.down(F.gelu(ff.gate(h), approximate="tanh") * ff.up(h))
        x = x + norm(block.ff_residual.out_norm, h)
    logits = model.lm_head(norm(model.final_norm, x))
    want = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
    # The rotary angles are formed in float32 whatever the model's dtype (layers/rotary.py)
    torch.testing.assert_close(model(tokens), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_soft_capped_loss_is_the_loss_of_the_capped_logits():
    model = make_model(GEMMA)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    logits = model(tokens)
    assert logits.abs().max() < model.cfg.logit_softcap
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model(tokens, targets=Targets(targets)), want)


def test_the_offset_norm_is_rmsnorm_of_one_plus_its_weight():
    norm = OffsetRMSNorm(6, eps=1e-6)
    assert torch.equal(norm.weight, torch.zeros(6))  # a fresh one is a plain RMS norm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 6))
    x = torch.randn(3, 6, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.double())
    torch.testing.assert_close(norm(x.float()).double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("options,message", [
    (dict(sandwich_norm=True, norm="post"), "sandwich_norm = true needs model.norm = 'pre'"),
    (dict(global_every=-1), "model.global_every"),
    (dict(attn_softcap=0.0), "model.attn_softcap"),
    (dict(norm_kind="gemma"), "model.norm_kind"),
])
def test_a_bad_choice_is_a_one_line_error_naming_it(options, message):
    with pytest.raises(TformerError, match=message):
        GPTConfig(vocab_size=VOCAB, **options)


def test_the_pattern_fields_are_unused_without_a_window():
    unused = GPTConfig(vocab_size=VOCAB, rotary=True).unused_fields()
    assert {"global_every", "rope_local_theta"} <= unused
    assert "global_every" not in GPTConfig(vocab_size=VOCAB, rotary=True, window=4
                                           ).unused_fields()


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_soft_capped_attention_over_a_long_prompt_is_the_float64_formula(masked,
                                                                        monkeypatch):
    """Past QUERY_CHUNK queries the capped scores are formed a chunk of queries at a time;
    the result is the formula's, with grouped heads and a scale of its own."""
    from tformer.layers import scaled_dot_product as module
    from tformer.layers.masks import causal_mask
    from tformer.layers.scaled_dot_product import QUERY_CHUNK, scaled_dot_product

    rows = []
    original = module.written_out
    monkeypatch.setattr(module, "written_out",
                        lambda q, *a, **kw: rows.append(q.shape[2]) or original(q, *a, **kw))

    T, g = QUERY_CHUNK + 37, torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, T, 8, generator=g)
    k, v = torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)
    allowed = causal_mask(T, T)
    if masked:  # some keys hidden from every query after the first
        allowed = allowed & ((torch.arange(T) % 7 != 3) | (torch.arange(T)[:, None] == 0))
    got = scaled_dot_product(q, k, v, allowed if masked else None, not masked, dropout_p=0.0,
                             recorded=None, scale=0.4, softcap=2.0)
    kd, vd = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
    scores = 2.0 * torch.tanh(q.double() @ kd.transpose(-1, -2) * 0.4 / 2.0)
    want = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vd
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert rows == [QUERY_CHUNK, 37]
