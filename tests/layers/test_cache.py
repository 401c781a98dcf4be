"""The caches decide how a step attends: the attention kernel where it computes the same
thing from their layout, torch's attention (over the keys gathered in the rows' order)
where it cannot, e.g. for grouped-query heads."""

from __future__ import annotations

import pytest
import torch

from tformer.kernels.attend import serves
from tformer.layers import MultiHeadAttention
from tformer.layers import cache as cache_module
from tformer.layers.cache import DecoderCache, KVCache, Lineage

CPU = torch.device("cpu")


def caches(rows: int, heads: int, positions: int = 8) -> tuple[DecoderCache, DecoderCache]:
    copying = DecoderCache([KVCache(rows, heads, positions, 4, 3, dtype=torch.float32,
                                    device=CPU)])
    lineage = Lineage(rows, positions, CPU)
    following = DecoderCache([KVCache(rows, heads, positions, 4, 3, dtype=torch.float32,
                                      device=CPU, lineage=lineage)])
    return copying, following


def steps(attn: MultiHeadAttention, copying: DecoderCache, following: DecoderCache) -> None:
    """Beam search's steps, with reorders; the two caches must attend alike throughout."""
    torch.manual_seed(1)
    rows = 6
    for index in ([5, 0, 0, 2, 3, 1], [1, 1, 4, 0, 0, 2], [3, 0, 2, 2], [1, 0, 3]):
        x = torch.randn(rows, 1, 16)
        want = attn(x, cache=copying.self_attn[0])
        got = attn(x, cache=following.self_attn[0])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        copying.reorder(torch.tensor(index))
        following.reorder(torch.tensor(index))
        rows = len(index)


@torch.no_grad()
def test_grouped_query_heads_take_torchs_path_over_a_lineage(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the attention kernel reads one key head per query head")

    monkeypatch.setattr(cache_module, "attend_step", refuse)
    attn = MultiHeadAttention(16, 4, d_head=4, d_value=3, n_kv_head=2).eval()
    steps(attn, *caches(6, 2))


@pytest.mark.skipif(not serves(torch.zeros(1)), reason="the attention kernel is not built")
@torch.no_grad()
def test_one_head_per_query_head_runs_the_kernel(monkeypatch):
    calls = []
    kernel = cache_module.attend_step

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cache_module, "attend_step", counted)
    attn = MultiHeadAttention(16, 2, d_head=4, d_value=3).eval()
    steps(attn, *caches(6, 2))
    assert len(calls) == 4  # one a step, on the lineage cache only
    attn.recorded = []  # recording: the probabilities are wanted, so no kernel
    steps(attn, *caches(6, 2))
    assert len(calls) == 4 and len(attn.recorded) == 8


def test_truncate_forgets_positions_and_the_next_step_writes_over_them():
    """Speculative decoding's rollback of one row: a cut-back cache reads as if the cut
    positions had never been stored."""
    torch.manual_seed(0)
    caches = [KVCache(1, 2, 8, 4, 4, dtype=torch.float32, device=torch.device("cpu"))
              for _ in range(2)]
    cache = DecoderCache(caches)
    kept, rejected, after = (torch.randn(1, 2, n, 4) for n in (3, 2, 1))
    for c in caches:
        c.store(kept, kept)
        c.store(rejected, rejected)
    cache.truncate(3)
    assert cache.length == 3
    for c in caches:
        c.store(after, after)
        k, v = c.stored()
        assert torch.equal(k, torch.cat([kept, after], dim=2)) and torch.equal(v, k)
    with pytest.raises(ValueError, match="cannot cut"):
        cache.truncate(5)


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_a_cache_grows_with_its_sequence_and_decodes_as_an_uncached_pass(n_kv_head):
    """generate's cache starts small and grows (past the prompt, then step by step, on the
    one-call step path and torch's alike): every step's logits equal a full pass's."""
    from tformer.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=31, context=200, n_layer=2, n_head=2, n_kv_head=n_kv_head,
                          d_model=16, rotary=True, position="none")).eval()
    tokens = torch.randint(0, 31, (2, 150))
    cache = model.make_cache(2)
    widths = []
    with torch.no_grad():
        logits = [model(tokens[:, :70], cache=cache, last_only=True)[:, -1]]
        widths.append(cache.self_attn[0].k.shape[2])
        for t in range(70, 150):
            logits.append(model(tokens[:, t : t + 1], cache=cache)[:, -1])
            widths.append(cache.self_attn[-1].k.shape[2])
        full = model(tokens)[:, 69:]
    assert widths[0] < 200 and len(set(widths)) >= 2 and widths[-1] >= 150
    assert cache.max_len == 200
    torch.testing.assert_close(torch.stack(logits, 1), full, atol=1e-5, rtol=1e-5)
