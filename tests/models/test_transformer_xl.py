import math

import pytest
import torch

from tformer.errors import TformerError
from tformer.layers import attention_bias, sinusoids
from tformer.models.transformer_xl import (
    Memory,
    RelativeAttention,
    TransformerXL,
    TransformerXLConfig,
    relative_shift,
)

V = 29
VARIANTS = [
    {},
    {"norm": "pre", "share_biases": False, "activation": "gelu", "bias": False},
    {"clamp_len": 3, "d_head": 5, "tie_embeddings": False},
]


def tiny_config(**overrides) -> TransformerXLConfig:
    values = {"vocab_size": V, "context": 6, "mem_len": 8, "n_layer": 2, "n_head": 2,
              "d_model": 16, **overrides}
    return TransformerXLConfig(**values)


def tiny(**overrides) -> TransformerXL:
    return TransformerXL(tiny_config(**overrides)).eval()


# --- the relative shift and the attention, against per-position loops -------------------


def test_relative_shift_matches_an_index_loop():
    B, H, T, M = 2, 3, 5, 4
    K = M + T
    scores = torch.randn(B, H, T, K)
    shifted = relative_shift(scores)
    for i in range(T):
        for j in range(M + i + 1):
            # Column c of the input holds distance K-1-c; key j is at distance M+i-j.
            torch.testing.assert_close(shifted[..., i, j], scores[..., i, K - 1 - (M + i - j)])


def naive_relative_attention(attn: RelativeAttention, x, memory, u, v, clamp_len: int):
    """Sec. 3.3 of the paper (the A^rel terms (a)-(d)), one query and one key at a time."""
    H, d = attn.n_head, attn.d_head
    B, T, D = x.shape
    context = torch.cat([memory, x], dim=1) if memory is not None else x
    M = context.shape[1] - T
    W_q, W_k, W_v = attn.qkv_proj.weight.split(H * d)
    q = (x @ W_q.T).view(B, T, H, d)
    k = (context @ W_k.T).view(B, M + T, H, d)
    values = (context @ W_v.T).view(B, M + T, H, d)
    out = torch.zeros(B, T, H, d)
    for i in range(T):
        scores = torch.full((B, H, M + T), float("-inf"))
        for j in range(M + i + 1):
            distance = M + i - j
            if clamp_len:
                distance = min(distance, clamp_len)
            r = sinusoids(torch.tensor([distance]), D)[0]
            pos_k = (r @ attn.pos_proj.weight.T).view(H, d)
            content = ((q[:, i] + u) * k[:, j]).sum(-1)  # (a) + (c)
            position = ((q[:, i] + v) * pos_k).sum(-1)  # (b) + (d)
            scores[:, :, j] = (content + position) / math.sqrt(d)
        probs = scores.softmax(-1)
        out[:, i] = torch.einsum("bhj,bjhd->bhd", probs, values)
    return attn.out_proj(out.flatten(2))


@pytest.mark.parametrize("clamp_len", [0, 2])
@pytest.mark.parametrize("mem", [0, 4])
def test_relative_attention_matches_the_per_position_formula(clamp_len, mem):
    cfg = tiny_config(clamp_len=clamp_len)
    model = TransformerXL(cfg).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 5, 16)
    memory = torch.randn(2, mem, 16) if mem else None
    K = mem + 5
    positions = model.relative_positions(K, x.device)
    mask = torch.ones(5, K, dtype=torch.bool).tril(mem)[None, None]
    u, v = torch.randn(2, 8), torch.randn(2, 8)
    bias = attention_bias(mask, x.dtype)
    fast, (keys, values) = attn(x, memory, attn.position_keys(positions), bias, u, v)
    assert keys.shape == values.shape == (2, 2, K, 8)
    slow = naive_relative_attention(attn, x, memory, u, v, clamp_len)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


# --- exactness of the recurrence -----------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_segments_with_memory_equal_one_causal_pass(variant):
    """[A][B] with mem_len >= len(A) gives B the same logits as one pass over A then B."""
    model = tiny(**variant)
    a, b = torch.randint(0, V, (3, 7)), torch.randint(0, V, (3, 5))
    whole = model(torch.cat([a, b], dim=1))
    memory = Memory(mem_len=7)
    first = model(a, memory=memory)
    second = model(b, memory=memory)
    torch.testing.assert_close(first, whole[:, :7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, whole[:, 7:], atol=1e-5, rtol=1e-5)


def test_many_short_segments_equal_one_pass_while_memory_holds_everything():
    model = tiny(norm="pre")
    tokens = torch.randint(0, V, (2, 12))
    whole = model(tokens)
    memory = Memory(mem_len=12)
    pieces = [model(tokens[:, s : s + n], memory=memory) for s, n in ((0, 4), (4, 1), (5, 7))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_a_short_memory_differs_from_the_full_pass():
    model = tiny()
    a, b = torch.randint(0, V, (2, 7)), torch.randint(0, V, (2, 5))
    whole = model(torch.cat([a, b], dim=1))
    memory = Memory(mem_len=3)
    model(a, memory=memory)
    assert not torch.allclose(model(b, memory=memory), whole[:, 7:], atol=1e-4)


def test_memory_holds_each_layers_input_for_the_last_positions():
    model = tiny(n_layer=3)
    tokens = torch.randint(0, V, (2, 10))
    inputs = []
    hooks = [block.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
             for block in model.blocks]
    memory = Memory(mem_len=4)
    model(tokens, memory=memory)
    for hook in hooks:
        hook.remove()
    assert memory.length == 4 and len(memory.states) == 3
    embeddings = model.embed(tokens) * model.embed_scale
    torch.testing.assert_close(memory.states[0], embeddings[:, -4:])
    for state, layer_input in zip(memory.states, inputs, strict=True):
        torch.testing.assert_close(state, layer_input[:, -4:])
        assert not state.requires_grad


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_keys_and_values_equal_the_remembered_inputs(variant):
    """With fixed weights the memory may keep keys and values instead of layer inputs."""
    model = tiny(**variant)
    inputs, keys = Memory(mem_len=5), Memory(mem_len=5, cache_keys=True)
    for n in (4, 1, 6, 1, 1):
        tokens = torch.randint(0, V, (2, n))
        torch.testing.assert_close(model(tokens, memory=keys), model(tokens, memory=inputs),
                                   atol=1e-5, rtol=1e-5)
        assert keys.length == inputs.length and not keys.states
    assert keys.keys_values[0][0].shape == (2, 2, 5, model.cfg.head_size)


def test_cached_keys_refuse_a_training_model():
    model = tiny()
    model.train()
    with pytest.raises(ValueError, match="needs fixed weights"):
        model(torch.randint(0, V, (1, 4)), memory=Memory(4, cache_keys=True))


def test_memory_slides_and_mem_len_zero_keeps_nothing():
    model = tiny()
    memory, empty = Memory(mem_len=5), Memory(mem_len=0)
    for n in (3, 4, 6):
        model(torch.randint(0, V, (2, n)), memory=memory)
        model(torch.randint(0, V, (2, n)), memory=empty)
    assert memory.length == 5 and empty.length == 0


def test_no_gradient_flows_into_the_memory():
    model = tiny()
    model.train()
    memory = Memory(mem_len=6)
    model(torch.randint(0, V, (2, 6)), memory=memory).sum().backward()
    model.zero_grad()
    logits = model(torch.randint(0, V, (2, 6)), memory=memory)
    logits.sum().backward()
    assert all(not m.requires_grad and m.grad_fn is None for m in memory.states)
    assert model.u.grad is not None and model.blocks[0].attn.pos_proj.weight.grad is not None


@pytest.mark.parametrize("variant", VARIANTS)
def test_changing_a_future_token_never_changes_earlier_logits(variant):
    model = tiny(**variant)
    memory = Memory(mem_len=8)
    model(torch.randint(0, V, (2, 6)), memory=memory)
    saved = memory.state_dict()
    tokens = torch.randint(0, V, (2, 6))
    base = model(tokens, memory=memory)
    for t in range(6):
        memory.load_state_dict(saved)
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % V
        out = model(changed, memory=memory)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0)


def test_left_padding_never_changes_real_positions():
    """Only distances matter, so a left-padded row needs no renumbering of positions."""
    model = tiny()
    row = torch.randint(0, V, (1, 9))
    alone = model(row)
    padded = torch.cat([torch.full((1, 3), 4), row], dim=1)
    is_real = torch.tensor([[False] * 3 + [True] * 9])
    memory = Memory(mem_len=12)
    out = torch.cat([model(padded[:, :6], is_real[:, :6], memory=memory),
                     model(padded[:, 6:], is_real[:, 6:], memory=memory)], dim=1)
    torch.testing.assert_close(out[0, 3:], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_last_only_and_shapes():
    model = tiny()
    tokens = torch.randint(0, V, (3, 6))
    assert model(tokens).shape == (3, 6, V)
    last = model(tokens, last_only=True)
    assert last.shape == (3, 1, V)
    torch.testing.assert_close(last[:, 0], model(tokens)[:, -1])


def test_biases_are_shared_or_per_layer_and_embeddings_tied():
    assert tiny().u.shape == (1, 2, 8)
    assert tiny(share_biases=False).v.shape == (2, 2, 8)
    model = tiny()
    assert model.lm_head.weight is model.embed.weight


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("mem_len", -1, "model.mem_len = -1 must be at least 0"),
        ("eval_mem_len", -2, "model.eval_mem_len = -2 must be at least 0"),
        ("norm", "middle", "model.norm = 'middle' is not allowed; choose one of: post | pre"),
        ("n_head", 3, "model.d_model = 16 is not divisible by model.n_head = 3"),
        ("attn_dropout", 1.5, "model.attn_dropout = 1.5 must be at most 1.0"),
        ("clamp_len", -1, "model.clamp_len = -1 must be at least 0"),
    ],
)
def test_bad_config_values_are_named(key, value, words):
    with pytest.raises(TformerError, match=words.replace("(", r"\(").replace("|", r"\|")):
        tiny_config(**{key: value})


def test_eval_memory_defaults_to_the_training_one():
    assert tiny_config(mem_len=8).memory_for_eval == 8
    assert tiny_config(mem_len=8, eval_mem_len=0).memory_for_eval == 0
