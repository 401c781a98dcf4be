"""FLOPs per token counted from the modules: equal to the formulas the families had before
the count (on the shapes those formulas covered), to a count written out by hand for
grouped-query attention with a gated feed-forward, and to torch's own counter
(torch.utils.flop_counter, with the math attention kernel so that attention's products are
counted too, and without tformer's decoding-step attention kernel and one-call decoder
layers, which torch cannot see into); activation memory against the allocator's view of
saved tensors."""

from unittest import mock

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tformer.config import config_from_dict
from tformer.kernels import library
from tformer.kernels.formats import quantize_model
from tformer.kernels.prepack import prepack
from tformer.kernels.quantize import Int8Linear
from tformer.kernels.step import DecoderStep
from tformer.layers import cache as decoding_cache
from tformer.models.transformer_xl import Memory
from tformer.registry import get_family
from tformer.viz.cost import activation_bytes, linear_flops


def counted(fn) -> int:
    library.check_all()  # the kernels' checks run products of their own: not inside the count
    with (sdpa_kernel(SDPBackend.MATH),
          mock.patch.object(decoding_cache, "serves", lambda q: False),
          mock.patch.object(DecoderStep, "of", lambda *a: None),
          FlopCounterMode(display=False) as counter):
        fn()
    return counter.get_total_flops()


def run_config(family, model, data=(), train=()):
    return config_from_dict({"model": {"family": family, **model}, "data": dict(data),
                             "train": dict(train)})


def build(family, model, data=(), train=()):
    cfg = run_config(family, model, data, train)
    return cfg, get_family(family).model(cfg.model)


def test_gpt_flops_match_torchs_count():
    cfg, model = build("gpt", {"vocab_size": 40, "context": 12, "n_layer": 2, "n_head": 2,
                               "d_model": 16, "d_ff": 24, "d_value": 5})
    cost = get_family("gpt").cost(cfg)
    T = 12
    tokens = torch.randint(0, 40, (1, T))
    assert counted(lambda: model(tokens).sum().backward()) == pytest.approx(
        T * cost.train_flops)

    def decode():  # generate T tokens one at a time with the KV cache
        model.eval()
        cache = model.make_cache(1)
        cache.step = None  # the counter sees torch's operations, not step.c's
        with torch.no_grad():
            for t in range(T):
                model(tokens[:, t : t + 1], cache=cache, last_only=True)

    assert counted(decode) == pytest.approx(T * cost.decode_flops)


def test_a_mixture_of_experts_costs_its_chosen_experts_as_torch_counts():
    """A token pays for the router and its k experts, in training (grouped by expert) and
    decoding (one token, its k experts), not for all of them."""
    cfg, model = build("gpt", {"vocab_size": 40, "context": 12, "n_layer": 2, "n_head": 2,
                               "d_model": 16, "d_ff": 24, "feedforward": "gated",
                               "activation": "silu", "n_expert": 6, "n_expert_active": 2,
                               "d_shared_expert": 8})
    cost = get_family("gpt").cost(cfg)
    T = 12
    tokens = torch.randint(0, 40, (1, T))
    assert counted(lambda: model(tokens).sum().backward()) == pytest.approx(
        T * cost.train_flops)

    def decode():
        model.eval()
        cache = model.make_cache(1)
        with torch.no_grad():
            for t in range(T):
                model(tokens[:, t : t + 1], cache=cache, last_only=True)

    assert counted(decode) == pytest.approx(T * cost.decode_flops)
    dense = get_family("gpt").cost(run_config("gpt", {
        "vocab_size": 40, "context": 12, "n_layer": 2, "n_head": 2, "d_model": 16,
        "d_ff": 24, "feedforward": "gated", "activation": "silu"}))
    # Two experts of 24 and a shared one of 8 are 56 wide; the router 6 scores of 16.
    per_layer = 2 * 3 * 16 * (56 - 24) + 2 * 6 * 16 + 2 * 16  # and the shared gate's row
    assert cost.decode_flops - dense.decode_flops == 2 * per_layer


def test_seq2seq_flops_match_torchs_count():
    cfg, model = build("seq2seq", {"vocab_size": 30, "max_len": 20, "n_layer": 2,
                                   "n_decoder_layer": 1, "n_head": 2, "d_model": 16,
                                   "d_ff": 24}, {"max_len": 10, "max_tokens": 100})
    cost = get_family("seq2seq").cost(cfg)
    L = 10
    assert cost.length == L and cost.batch == 10
    src, tgt = torch.randint(0, 30, (1, L)), torch.randint(0, 30, (1, L))
    real = torch.ones_like(src, dtype=torch.bool)
    assert counted(lambda: model(src, real, tgt).sum().backward()) == pytest.approx(
        L * cost.train_flops)

    def greedy():  # encode once, then L steps with the cache
        model.eval()
        with torch.no_grad():
            memory = model.encode(src, real)
            cache = model.make_cache(1, L)
            for t in range(L):
                model.decode(tgt[:, t : t + 1], memory, real, cache=cache)

    assert counted(greedy) == pytest.approx(L * cost.decode_flops)


def test_transformer_xl_training_flops_match_torchs_count():
    cfg, model = build("transformer-xl", {"vocab_size": 30, "context": 6, "mem_len": 9,
                                          "n_layer": 2, "n_head": 2, "d_model": 16,
                                          "d_ff": 24})
    cost = get_family("transformer-xl").cost(cfg)
    memory = Memory(9)
    tokens = torch.randint(0, 30, (1, 12))
    with torch.no_grad():
        model(tokens[:, :6], memory=memory)
        model(tokens[:, :6], memory=memory)  # 12 positions seen: the memory is full
    assert memory.length == 9
    flops = counted(lambda: model(tokens[:, 6:], memory=memory).sum().backward())
    assert flops == pytest.approx(6 * cost.train_flops)


def test_transformer_xl_decoding_flops_match_torchs_count():
    cfg, model = build("transformer-xl", {"vocab_size": 30, "context": 6, "mem_len": 9,
                                          "n_layer": 2, "n_head": 2, "d_model": 16,
                                          "d_ff": 24})
    cost = get_family("transformer-xl").cost(cfg)
    model.eval()
    memory = Memory(9, cache_keys=True)
    tokens = torch.randint(0, 30, (1, 14))
    with torch.no_grad():
        for start in range(0, 12, 6):  # fill the memory
            model(tokens[:, start : start + 6], memory=memory)
        model(tokens[:, 12:13], memory=memory, last_only=True)  # position keys now cached
    assert memory.length == 9
    # Frozen weights rather than no_grad: the flop counter's module tracker trips over
    # views of parameters (u[b], v[b]) made under no_grad.
    model.requires_grad_(False)
    flops = counted(lambda: model(tokens[:, 13:14], memory=memory, last_only=True))
    assert flops == pytest.approx(cost.decode_flops)


def test_activation_bytes_are_what_the_allocator_holds_for_backward():
    """Independent check: the memory the CPU allocator still holds after the forward pass,
    beyond the weights, once the loss is dropped and only autograd's saved tensors keep
    memory alive."""
    cfg, model = build("gpt", {"vocab_size": 40, "context": 32, "n_layer": 2, "n_head": 2,
                               "d_model": 64, "d_ff": 128}, train={"batch_size": 3})
    cost = get_family("gpt").cost(cfg)
    measured = activation_bytes(model, cost.example, torch.device("cpu"))
    # The loss's graph holds every saved tensor: their sizes, by their storages.
    loss = cost.example(model, torch.device("cpu"))
    storages, stack = {}, [loss.grad_fn]
    seen = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name)
                if isinstance(value, torch.Tensor):
                    s = value.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    independent = sum(n for ptr, n in storages.items() if ptr not in weights)
    assert measured == independent
    assert measured > 2 * 32 * 64 * 4  # at least a few (T, D) fp32 activations per layer




# --- the formulas the families had, for the shapes they covered -------------------------


def formula_gpt(m):
    """Every head as wide as d_head (no grouped keys and values), a two-matrix
    feed-forward, every cached key read while decoding."""
    D, F, H, V, T = m.d_model, m.ff_width, m.n_head, m.vocab_size, m.context
    dh = m.d_head or D // H
    dv = m.d_value or dh

    def per_token(keys):
        attention = 2 * D * H * (2 * dh + dv) + 2 * H * dv * D + 2 * keys * H * (dh + dv)
        return m.n_layer * (attention + 4 * D * F) + 2 * D * V

    return 3 * per_token(T), per_token((T + 1) / 2)


def formula_seq2seq(m, L):
    D, F, H, V = m.d_model, m.ff_width, m.n_head, m.vocab_size
    dh = m.d_head or D // H
    dv = m.d_value or dh

    def self_attention(keys):
        return 2 * D * H * (2 * dh + dv) + 2 * H * dv * D + 2 * keys * H * (dh + dv)

    encoder = m.n_layer * (self_attention(L) + 4 * D * F)
    cross = 2 * D * H * dh + 2 * H * dv * D + 2 * L * H * (dh + dv) + 2 * D * H * (dh + dv)

    def decoder(keys):
        return m.decoder_layers * (self_attention(keys) + cross + 4 * D * F) + 2 * D * V

    return 3 * (encoder + decoder(L)), encoder + decoder((L + 1) / 2)


def formula_transformer_xl(m):
    D, F, H, V, T, M = m.d_model, m.ff_width, m.n_head, m.vocab_size, m.context, m.mem_len
    W = H * m.head_size
    K = M + T
    segment = 2 * D * 3 * W + 3 * 2 * K * W + 2 * W * D + 4 * D * F
    no_input_grad = (2 * D * 2 * W * M + 2 * D * W * K) / T
    train = 3 * (m.n_layer * (segment + no_input_grad) + 2 * D * V) - m.n_layer * no_input_grad
    decode = m.n_layer * (2 * D * 3 * W + 3 * 2 * (M + 1) * W + 2 * W * D + 4 * D * F)
    return train, decode + 2 * D * V


GPT2 = {"vocab_size": 50257, "context": 1024, "n_layer": 12, "n_head": 12, "d_model": 768}


@pytest.mark.parametrize("shape", [
    GPT2,
    {**GPT2, "n_layer": 2, "d_head": 40, "d_value": 24, "d_ff": 1000, "tie_embeddings": False},
])
def test_gpt_counts_equal_the_formula_it_had(shape):
    cfg = run_config("gpt", shape)
    cost = get_family("gpt").cost(cfg)
    assert (cost.train_flops, cost.decode_flops) == pytest.approx(formula_gpt(cfg.model))


@pytest.mark.parametrize("shape", [
    {"n_layer": 6, "n_head": 8, "d_model": 512, "d_ff": 2048},  # Vaswani et al.'s base
    {"n_layer": 3, "n_decoder_layer": 1, "n_head": 4, "d_model": 256, "d_value": 32},
])
def test_seq2seq_counts_equal_the_formula_it_had(shape):
    cfg = run_config("seq2seq", {"vocab_size": 37000, "max_len": 256, **shape},
                     {"max_len": 100, "max_tokens": 4096})
    cost = get_family("seq2seq").cost(cfg)
    assert cost.length == 100 and cost.batch == 40
    assert (cost.train_flops, cost.decode_flops) == pytest.approx(
        formula_seq2seq(cfg.model, 100))


def test_transformer_xl_counts_equal_the_formula_it_had():
    # The paper's WikiText-103 base model (Dai et al. 2019, its code's run_wt103_base.sh).
    cfg = run_config("transformer-xl", {
        "vocab_size": 267735, "context": 150, "mem_len": 150, "n_layer": 16, "n_head": 10,
        "d_model": 410, "d_head": 41, "d_ff": 2100})
    cost = get_family("transformer-xl").cost(cfg)
    assert (cost.train_flops, cost.decode_flops) == pytest.approx(
        formula_transformer_xl(cfg.model))


# --- what the formulas missed ------------------------------------------------------------

LLAMA = {"vocab_size": 100, "context": 32, "n_layer": 2, "n_head": 8, "n_kv_head": 2,
         "d_model": 64, "d_head": 16, "d_ff": 96, "feedforward": "gated",
         "activation": "silu", "norm_kind": "rmsnorm", "bias": False, "qkv_bias": True,
         "qk_norm": True, "rotary": True, "position": "none"}
"""Grouped-query attention over 8 query and 2 key/value heads of 16 (8 * 16 != 64), a
SwiGLU feed-forward, q/k norms and rotary positions (which cost no matrix product)."""


def test_grouped_query_attention_and_a_gated_feed_forward_as_counted_by_hand():
    V, T, L, D, H, H_kv, dh, F = 100, 32, 2, 64, 8, 2, 16, 96
    q = 2 * D * H * dh  # per token, and per layer
    k = v = 2 * D * H_kv * dh
    out = 2 * H * dh * D
    feed_forward = 3 * 2 * D * F  # gate, up and down
    per_key = H * (2 * dh + 2 * dh)  # a score and a weighted value, in each query head
    lm_head = 2 * D * V

    def per_token(keys):
        return L * (q + k + v + out + feed_forward + keys * per_key) + lm_head

    cost = get_family("gpt").cost(run_config("gpt", LLAMA))
    assert cost.train_flops == 3 * per_token(T)
    assert cost.decode_flops == pytest.approx(per_token(sum(range(1, T + 1)) / T))


def test_a_sliding_window_lowers_decoding_by_the_keys_it_leaves_out():
    T, W = 32, 8
    full = get_family("gpt").cost(run_config("gpt", LLAMA))
    windowed = get_family("gpt").cost(run_config("gpt", {**LLAMA, "window": W}))
    assert windowed.train_flops == full.train_flops  # a dense kernel reads every key
    assert "at most 8" in windowed.assumes and "at most" not in full.assumes
    keys_left_out = (sum(range(1, T + 1)) - sum(min(t, W) for t in range(1, T + 1))) / T
    per_key = LLAMA["n_layer"] * 8 * (16 + 16) * 2
    assert full.decode_flops - windowed.decode_flops == pytest.approx(per_key * keys_left_out)
    wide = get_family("gpt").cost(run_config("gpt", {**LLAMA, "window": T}))
    assert wide.decode_flops == full.decode_flops


@pytest.mark.parametrize("shape", [
    LLAMA,
    {**LLAMA, "window": 8, "n_kv_head": 1, "tie_embeddings": False},
    {"vocab_size": 40, "context": 16, "n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 24,
     "d_value": 5},
])
def test_a_forward_pass_by_torchs_count_is_a_third_of_training(shape):
    cfg, model = build("gpt", shape)
    T = cfg.model.context
    tokens = torch.randint(0, cfg.model.vocab_size, (1, T))
    with torch.no_grad():
        flops = counted(lambda: model(tokens))
    assert flops == pytest.approx(T * get_family("gpt").cost(cfg).train_flops / 3, rel=1e-6)


def test_grouped_query_decoding_by_torchs_count():
    cfg, model = build("gpt", {**LLAMA, "context": 12})
    model.eval()
    tokens = torch.randint(0, 100, (1, 12))

    def decode():
        cache = model.make_cache(1)
        cache.step = None  # the counter sees torch's operations, not step.c's
        with torch.no_grad():
            for t in range(12):
                model(tokens[:, t : t + 1], cache=cache, last_only=True)

    assert counted(decode) == pytest.approx(12 * get_family("gpt").cost(cfg).decode_flops)


def test_a_gated_seq2seq_forward_pass_by_torchs_count():
    cfg, model = build("seq2seq", {"vocab_size": 30, "max_len": 20, "n_layer": 2,
                                   "n_decoder_layer": 1, "n_head": 2, "d_model": 16,
                                   "d_head": 6, "d_value": 10, "d_ff": 24,
                                   "feedforward": "gated", "activation": "silu"},
                       {"max_len": 10, "max_tokens": 100})
    src, tgt = torch.randint(0, 30, (1, 10)), torch.randint(0, 30, (1, 10))
    with torch.no_grad():
        flops = counted(lambda: model(src, torch.ones_like(src, dtype=torch.bool), tgt))
    assert flops == pytest.approx(10 * get_family("seq2seq").cost(cfg).train_flops / 3)


def test_int8_and_prepacked_linears_count_as_the_linears_they_replace():
    _, model = build("gpt", LLAMA)
    model.eval()
    int8 = quantize_model(model, "int8")
    assert any(isinstance(m, Int8Linear) for m in int8.modules())
    assert not any(isinstance(m, nn.Linear) for m in int8.blocks.modules())
    assert linear_flops(int8) == linear_flops(prepack(model)) == linear_flops(model)
