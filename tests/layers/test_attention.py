import math

import pytest
import torch
import torch.nn.functional as F

from tformer.layers import (
    DecoderCache,
    KVCache,
    Lineage,
    MultiHeadAttention,
    attention_bias,
    causal_mask,
    lm_mask,
)


def naive_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v, one (batch, head, query) at a time."""
    B, H, T, _ = q.shape
    out = torch.zeros(B, H, T, v.shape[-1])
    for b in range(B):
        for h in range(H):
            for i in range(T):
                scores = [
                    (q[b, h, i] @ k[b, h, j]) / math.sqrt(q.shape[-1])
                    if mask[b if mask.shape[0] > 1 else 0, 0, i, j]
                    else -math.inf
                    for j in range(k.shape[2])
                ]
                weights = torch.softmax(torch.tensor(scores), dim=0)
                out[b, h, i] = weights @ v[b, h]
    return out


@pytest.mark.parametrize("d_head,d_value", [(None, None), (8, 12)])
@torch.no_grad()
def test_self_attention_matches_naive(d_head, d_value):
    attn = MultiHeadAttention(16, 2, d_head=d_head, d_value=d_value).eval()
    x = torch.randn(2, 5, 16)
    is_real = torch.tensor([[True] * 5, [False, False, True, True, True]])
    mask = lm_mask(is_real, 5, 5, x.device)
    got = attn(x, mask=mask)

    q, k, v = attn.qkv_proj(x).split([2 * attn.d_head, 2 * attn.d_head, 2 * attn.d_value], dim=-1)
    heads = lambda t, d: t.unflatten(-1, (2, d)).transpose(1, 2)  # noqa: E731
    ref = naive_attention(
        heads(q, attn.d_head), heads(k, attn.d_head), heads(v, attn.d_value), mask
    )
    ref = attn.out_proj(ref.transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_causal_fast_path_equals_explicit_mask():
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(3, 7, 16)
    torch.testing.assert_close(
        attn(x, is_causal=True), attn(x, mask=causal_mask(7, 7)), atol=1e-6, rtol=1e-6
    )


def test_causal_mask_with_earlier_keys():
    # 2 new queries after 3 cached keys: query 0 is position 3, query 1 is position 4.
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 5), expected)


def test_an_attention_bias_gives_sdpa_the_same_result_as_its_mask():
    mask = lm_mask(torch.tensor([[False, True, True, True]]), 4, 4, torch.device("cpu"))
    bias = attention_bias(mask, torch.float32)
    assert set(bias.unique().tolist()) == {0.0, float("-inf")}
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    )


def test_lm_mask_keeps_the_diagonal_for_padding_queries():
    is_real = torch.tensor([[False, False, True]])
    mask = lm_mask(is_real, 3, 3, torch.device("cpu"))[0, 0]
    assert mask.any(dim=-1).all(), "every query must see at least one key"
    assert not mask[2, :2].any(), "a real query never sees padding"


@pytest.mark.parametrize("d_value", [None, 12])
def test_cross_attention_shares_memory_across_beams(d_value):
    attn = MultiHeadAttention(16, 2, d_value=d_value, cross=True).eval()
    x = torch.randn(6, 3, 16)
    memory = torch.randn(2, 4, 16)
    is_real = torch.tensor([[True, True, True, True], [True, True, False, False]])
    mask = is_real[:, None, None, :]
    shared = attn(x, memory, mask=mask)
    copied = attn(
        x, memory.repeat_interleave(3, dim=0), mask=mask.repeat_interleave(3, dim=0)
    )
    torch.testing.assert_close(shared, copied, atol=1e-6, rtol=1e-5)


def test_kv_cache_appends_and_reorders():
    cache = KVCache(2, 1, 4, 3, 3, dtype=torch.float32, device=torch.device("cpu"))
    k1, v1 = torch.randn(2, 1, 2, 3), torch.randn(2, 1, 2, 3)
    cache.append(k1, v1)
    k2, v2 = torch.randn(2, 1, 1, 3), torch.randn(2, 1, 1, 3)
    k, v = cache.append(k2, v2)
    assert torch.equal(k, torch.cat([k1, k2], dim=2)) and cache.length == 3
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.k[0, :, :3], torch.cat([k1, k2], dim=2)[1])
    with pytest.raises(RuntimeError, match="holds 4 positions"):
        cache.append(torch.randn(2, 1, 2, 3), torch.randn(2, 1, 2, 3))


def test_kv_cache_reorders_step_after_step_into_fewer_rows():
    # Each reorder copies the filled positions into the cache's second buffer and the two
    # swap: over several steps, shrinking the batch, the cache must hold what copying the
    # rows out of a plain list of every step's keys would give.
    torch.manual_seed(0)
    cache = KVCache(6, 2, 8, 3, 5, dtype=torch.float32, device=torch.device("cpu"))
    keys, values = torch.empty(6, 2, 0, 3), torch.empty(6, 2, 0, 5)
    for index in ([5, 0, 0, 2, 3, 1], [1, 1, 4, 0], [3, 0, 2, 2], [1, 0]):
        k, v = torch.randn(len(keys), 2, 1, 3), torch.randn(len(keys), 2, 1, 5)
        got_k, got_v = cache.append(k, v)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
        index = torch.tensor(index)
        cache.reorder(index)
        keys, values = keys[index], values[index]
        assert cache.k.shape[0] == len(index)
        assert torch.equal(cache.k[:, :, : cache.length], keys)
        assert torch.equal(cache.v[:, :, : cache.length], values)


def test_a_cache_over_borrowed_buffers_never_reorders_into_them():
    pool_k, pool_v = torch.randn(4, 1, 6, 3), torch.randn(4, 1, 6, 3)
    before = pool_k.clone(), pool_v.clone()
    cache = KVCache.over(pool_k[1:3], pool_v[1:3], 2)
    for index in ([1, 0], [0, 0], [1, 1]):
        cache.reorder(torch.tensor(index))
    assert torch.equal(pool_k, before[0]) and torch.equal(pool_v, before[1])
    assert torch.equal(cache.k[:, :, :2], before[0][[2, 2]][:, :, :2])


def test_decoder_cache_reorders_padding_too():
    layers = [KVCache(2, 1, 4, 3, 3, dtype=torch.float32, device=torch.device("cpu"))]
    cache = DecoderCache(layers, track_padding=True)
    cache.is_real[0, 0] = False
    cache.reorder(torch.tensor([1, 0]))
    assert cache.is_real[1, 0].item() is False and cache.is_real[0, 0].item() is True


def _decoder_caches(rows, positions):
    """A copying cache and a lineage cache of one layer (2 heads, d_head 4, d_value 3)."""
    cpu = torch.device("cpu")
    copying = DecoderCache([KVCache(rows, 2, positions, 4, 3, dtype=torch.float32, device=cpu)])
    lineage = Lineage(rows, positions, cpu)
    following = DecoderCache(
        [KVCache(rows, 2, positions, 4, 3, dtype=torch.float32, device=cpu, lineage=lineage)]
    )
    return copying, following


@torch.no_grad()
def test_a_lineage_cache_attends_as_a_copied_one_step_after_step():
    # Beam search's steps: one query per row, then the surviving rows' parents (fewer rows as
    # sentences finish). The lineage cache never copies; its attention (the kernel where it
    # is built) must match attention over the copied cache, and what it gathers must equal
    # the copied keys exactly.
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, 2, d_head=4, d_value=3).eval()
    copying, following = _decoder_caches(6, 8)
    rows = 6
    for index in ([5, 0, 0, 2, 3, 1], [1, 1, 4, 0, 0, 2], [3, 0, 2, 2], [1, 0, 3], [2, 2]):
        x = torch.randn(rows, 1, 8)
        want = attn(x, cache=copying.self_attn[0])
        got = attn(x, cache=following.self_attn[0])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        keys, values = following.self_attn[0].append(torch.empty(len(x), 2, 0, 4),
                                                     torch.empty(len(x), 2, 0, 3))
        assert torch.equal(keys, copying.self_attn[0].k[:, :, : copying.length])
        assert torch.equal(values, copying.self_attn[0].v[:, :, : copying.length])
        copying.reorder(torch.tensor(index))
        following.reorder(torch.tensor(index))
        rows = len(index)
    assert following.self_attn[0].k.shape[0] == 6  # the buffers were never copied


def test_a_lineage_is_reordered_once_for_all_layers():
    copying, following = _decoder_caches(2, 4)
    with pytest.raises(RuntimeError, match="reordered through its lineage"):
        following.self_attn[0].reorder(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="cannot be narrowed"):
        following.narrow(slice(0, 1), 0)
    with pytest.raises(ValueError, match="share one lineage, or none"):
        DecoderCache([following.self_attn[0], copying.self_attn[0]])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_masked_attention_in_query_chunks_equals_the_whole_score_matrix(monkeypatch, kv_heads):
    """A long masked prompt is attended a few queries at a time; the result is the plain
    softmax(q k^T / sqrt(d) + mask) v over the whole matrix, computed here in float64."""
    from tformer.layers import scaled_dot_product as sdp

    monkeypatch.setattr(sdp, "QUERY_CHUNK", 4)
    g = torch.Generator().manual_seed(0)
    B, H, T, past, d = 2, 4, 11, 3, 8
    q = torch.randn(B, H, T, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, past + T, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, past + T, d, generator=g, dtype=torch.float64)
    is_real = torch.ones(B, past + T, dtype=torch.bool)
    is_real[1, :5] = False  # a left-padded row
    mask = lm_mask(is_real, T, past + T, q.device)
    mask = mask & (torch.arange(T)[:, None] + past - torch.arange(past + T)[None] < 6)  # window
    got = sdp.scaled_dot_product(q, k, v, mask, False, dropout_p=0.0, recorded=None)

    group = H // kv_heads
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ kk.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~mask, -math.inf)
    torch.testing.assert_close(got, scores.softmax(-1) @ vv, atol=1e-12, rtol=1e-12)
