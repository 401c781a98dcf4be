import math

import pytest
import torch

from tformer.kernels import attend, library
from tformer.kernels.attend import attend_step, attend_step_reference

native = pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")


def naive(q, k, v, length, rows=None, bias=None):
    """The step's attention row by row and head by head, in float64, with plain loops over
    the table of buffer rows."""
    n, heads, d = q.shape
    group, kv_group = n // k.shape[0], heads // k.shape[1]
    out = torch.empty(n, heads, v.shape[-1], dtype=torch.float64)
    for i in range(n):
        source = [int(rows[i, s]) if rows is not None else i // group for s in range(length)]
        for h in range(heads):
            g = h // kv_group  # the key/value head query head h shares
            keys = torch.stack([k[r, g, s] for s, r in enumerate(source)]).double()
            values = torch.stack([v[r, g, s] for s, r in enumerate(source)]).double()
            scores = keys @ q[i, h].double() / math.sqrt(d)
            if bias is not None:
                scores = scores + torch.stack([bias[r, s] for s, r in enumerate(source)]).double()
            out[i, h] = scores.softmax(dim=0) @ values
    return out


@native
@pytest.mark.parametrize(
    "n, r, heads, kv_heads, d, dv, length, positions",
    [
        (4, 4, 8, 8, 64, 64, 30, 40),  # OPUS-MT's heads, beam 4
        (3, 3, 9, 3, 64, 64, 21, 24),  # SmolLM2's: nine query heads share three
        (2, 2, 4, 1, 12, 12, 9, 9),  # multi-query
        (6, 3, 2, 2, 12, 5, 9, 9),  # a vector and a remainder; values narrower than keys
        (5, 5, 1, 1, 5, 7, 1, 3),  # one position, no full vector
        (64, 64, 4, 4, 32, 32, 37, 50),  # many rows: the threaded loop
        (3, 3, 2, 2, 76, 80, 19, 20),  # values over 64 wide: eight registers, then the rest
    ],
)
def test_the_kernel_reads_each_position_from_its_buffer_row(n, r, heads, kv_heads, d, dv,
                                                             length, positions):
    torch.manual_seed(n * d + length)
    q = torch.randn(n, heads, d)
    k, v = torch.randn(r, kv_heads, positions, d), torch.randn(r, kv_heads, positions, dv)
    rows = torch.randint(0, r, (n, positions))
    got = attend_step(q, k, v, length, rows=rows)
    torch.testing.assert_close(got, naive(q, k, v, length, rows).float(), atol=2e-6, rtol=1e-5)


@native
@pytest.mark.parametrize("group", [1, 4])
def test_rows_share_a_buffer_row_under_a_padding_bias(group):
    # Cross-attention: the beams of a sentence read its encoder output; padding is -inf.
    torch.manual_seed(group)
    sentences, heads, d, length = 3, 2, 16, 11
    # Keys and values as cross-attention makes them: views of one (B', S, 2 H d) projection.
    kv = torch.randn(sentences, length, 2 * heads * d)
    k = kv[..., : heads * d].unflatten(-1, (heads, d)).transpose(1, 2)
    v = kv[..., heads * d :].unflatten(-1, (heads, d)).transpose(1, 2)
    # Queries as a slice of a wider projection (the row stride is not heads * d).
    wide = torch.randn(sentences * group, 1, 3 * heads * d)
    q = wide[:, 0, : heads * d].unflatten(-1, (heads, d))
    bias = torch.zeros(sentences, length)
    bias[1, 7:] = float("-inf")
    bias[2, 1:] = float("-inf")
    got = attend_step(q, k, v, length, bias=bias)
    torch.testing.assert_close(got, naive(q, k, v, length, bias=bias).float(), atol=2e-6,
                               rtol=1e-5)
    # Sentence 2 sees its first position only: its rows' output is that value exactly.
    torch.testing.assert_close(got[2 * group :], v[2, :, 0].expand(group, -1, -1), atol=1e-6,
                               rtol=0)


@native
def test_queries_in_any_layout():
    torch.manual_seed(2)
    q = torch.randn(5, 3, 16)[:, :, :8]  # (5, 3, 8), each row contiguous, heads 16 apart
    k, v = torch.randn(5, 3, 6, 8), torch.randn(5, 3, 6, 8)
    torch.testing.assert_close(attend_step(q, k, v, 6), naive(q, k, v, 6).float(), atol=2e-6,
                               rtol=1e-5)


@native
def test_any_thread_count_gives_the_same_bits():
    torch.manual_seed(0)
    q, k, v = torch.randn(64, 8, 64), torch.randn(64, 8, 40, 64), torch.randn(64, 8, 40, 64)
    rows = torch.randint(0, 64, (64, 40))
    outs = []
    for threads in (1, 2, 3):
        with torch.inference_mode():
            torch.set_num_threads(threads)
            outs.append(attend_step(q, k, v, 35, rows=rows))
    torch.set_num_threads(2)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@native
def test_a_nan_score_makes_the_row_nan_as_torch():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 20, 16), torch.randn(2, 1, 20, 16)
    k[0, 0, 3, 5] = float("nan")  # in the vector part of row 0's scores
    k[1, 0, 17, 0] = float("nan")  # in the remainder of row 1's
    got = attend_step(q, k, v, 18)
    assert got.isnan().all()
    assert attend_step_reference(q, k, v, 18).isnan().all()


def test_torch_computes_the_same_where_there_is_no_kernel(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert library.load() is None and not attend.serves(torch.zeros(1))
    torch.manual_seed(1)
    # four query heads sharing two key/value heads
    q, k, v = torch.randn(6, 4, 12), torch.randn(3, 2, 9, 12), torch.randn(3, 2, 9, 5)
    rows = torch.randint(0, 3, (6, 9))
    torch.testing.assert_close(attend_step(q, k, v, 8, rows=rows),
                               naive(q, k, v, 8, rows).float(), atol=2e-6, rtol=1e-5)
    bias = torch.zeros(3, 9)
    bias[0, 4:] = float("-inf")
    torch.testing.assert_close(attend_step(q, k, v, 9, bias=bias),
                               naive(q, k, v, 9, bias=bias).float(), atol=2e-6, rtol=1e-5)


def test_a_gradient_takes_torchs_path():
    q = torch.randn(2, 1, 8, requires_grad=True)
    k, v = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
    assert not attend.serves(q)
    attend_step(q, k, v, 3).sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_bad_shapes_are_clear_errors():
    q, k, v = torch.randn(5, 1, 8), torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="5 query rows cannot share 2 buffer rows"):
        attend_step(q, k, v, 4)
    with pytest.raises(ValueError, match="5 positions of a cache of 4"):
        attend_step(q[:4], k, v, 5)
    with pytest.raises(ValueError, match="a bias is for shared buffer rows"):
        attend_step(q, k, v, 4, rows=torch.zeros(5, 4, dtype=torch.long), bias=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"rows \(5, 3\) for 5 rows of 4"):
        attend_step(q, k, v, 4, rows=torch.zeros(5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"bias \(1, 4\) for 2 rows of 4"):
        attend_step(q[:4], k, v, 4, bias=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="over keys"):
        attend_step(q, k, v[:, :, :, :5].repeat(1, 2, 1, 1), 4, rows=torch.zeros(5, 4).long())
    with pytest.raises(ValueError, match="over keys"):  # 3 query heads cannot share 2
        attend_step(torch.randn(5, 3, 8), k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), 4,
                    rows=torch.zeros(5, 4).long())


@native
def test_a_row_outside_the_buffer_is_an_index_error_not_a_stray_read():
    q, k, v = torch.randn(2, 1, 8), torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)
    for bad in (2, -1):
        rows = torch.zeros(2, 4, dtype=torch.long)
        rows[1, 3] = bad
        with pytest.raises(IndexError, match="not among the 2 buffer rows"):
            attend_step(q, k, v, 4, rows=rows)


def naive_paged(q, k, v, tables, lengths, window, scale=None, softcap=None, sinks=None):
    """Paged attention row by row, head by head and query by query in float64, each
    position's key found by hand: block tables[i, s // bs], slot s % bs. q (N, H, d) one
    query per row, or (N, H, T, d): the row's last T positions, each reading up to its own.
    A soft cap bounds the scores by cap * tanh(s / cap); a sink is one more score per head
    whose probability has no value."""
    queries = q if q.dim() == 4 else q[:, :, None]
    n, heads, tokens, d = queries.shape
    bs, kv_group = k.shape[2], heads // k.shape[1]
    out = torch.empty(n, heads, tokens, v.shape[-1], dtype=torch.float64)
    for i in range(n):
        for t in range(tokens):
            length = int(lengths[i]) - tokens + 1 + t  # the positions query t reads
            seen = range(max(0, length - window) if window else 0, length)
            for h in range(heads):
                g = h // kv_group
                keys = torch.stack([k[int(tables[i, s // bs]), g, s % bs] for s in seen])
                values = torch.stack([v[int(tables[i, s // bs]), g, s % bs] for s in seen])
                scores = keys.double() @ queries[i, h, t].double() * (scale or d**-0.5)
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double()])
                out[i, h, t] = scores.softmax(dim=0)[: len(seen)] @ values.double()
    return out if q.dim() == 4 else out[:, :, 0]


LAYOUTS = [(4, False), (4, True), (16, True)]
"""(positions a block, keys turned): position-major keys and turned keys in blocks of four
(copied into the turned shape a span at a time), and the pool's layout, turned keys in
blocks of 16 (read where they lie: a block holds whole vectors of 8 and 16 positions)."""


def pool_keys(blocks, kv_heads, block, d, generator, turned):
    """(blocks, H_kv, block, d) random keys, laid out turned as PagedPool keeps them (a view
    of (blocks, H_kv, d, block)) or position-major."""
    k = torch.randn(blocks, kv_heads, block, d, generator=generator)
    return k.transpose(2, 3).contiguous().transpose(2, 3) if turned else k


@native
@pytest.mark.parametrize("block, turned", LAYOUTS)
@pytest.mark.parametrize("heads, kv_heads, d, dv, window",
                         [(4, 4, 16, 16, None), (9, 3, 64, 64, None), (4, 1, 12, 5, None),
                          (4, 2, 16, 16, 7)])
def test_paged_attention_reads_each_position_in_its_block(heads, kv_heads, d, dv, window,
                                                         block, turned):
    """Rows of different lengths whose blocks lie scattered through the pool (block 0
    standing for blocks behind a window), against float64 attention found by hand."""
    g = torch.Generator().manual_seed(3)
    k = pool_keys(12, kv_heads, block, d, g, turned)
    v = torch.randn(12, kv_heads, block, dv, generator=g)
    q = torch.randn(3, heads, d, generator=g)
    tables = torch.tensor([[5, 2, 9, 0, 0], [7, 0, 0, 0, 0], [0, 0, 1, 11, 3]])
    lengths = torch.tensor([11, 3, 18])
    if window is None:
        tables[2, :2] = torch.tensor([4, 8])
    out = attend.attend_paged(q, k, v, tables, lengths, window=window)
    want = naive_paged(q, k, v, tables, lengths, window)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    reference = attend.attend_paged_reference(q, k, v, tables, lengths, window=window)
    torch.testing.assert_close(reference.double(), want, atol=1e-5, rtol=1e-5)


@native
@pytest.mark.parametrize("block, turned", LAYOUTS)
@pytest.mark.parametrize("tokens, window, heads, kv_heads, dv",
                         [(5, None, 9, 3, 64), (12, None, 9, 3, 64), (6, 7, 9, 3, 64),
                          (13, 4, 9, 3, 64), (3, None, 40, 1, 300)])
def test_paged_attention_of_several_new_tokens_a_row_is_causal(tokens, window, heads,
                                                               kv_heads, dv, block, turned):
    """A chunk of T new tokens a row (a prompt read a piece at a time, a speculative round),
    the blocks scattered through the pool: each query reads the positions up to its own (and
    within the window), against float64 attention found by hand; the result is laid out as
    attention's (N, H, T, d_value). The last case's 40 query heads of one key/value head take
    two tiles (its 300-wide values allow 32 queries a tile), the second part-full, and its
    values two passes of columns."""
    g = torch.Generator().manual_seed(4)
    k = pool_keys(12, kv_heads, block, 64, g, turned)
    v = torch.randn(12, kv_heads, block, dv, generator=g)
    q = torch.randn(2, heads, tokens, 64, generator=g)
    tables = torch.tensor([[5, 2, 9, 6, 1, 0, 0], [7, 3, 10, 11, 4, 8, 0]])
    lengths = torch.tensor([max(tokens, 17), 24])
    out = attend.attend_paged(q, k, v, tables, lengths, window=window)
    assert out.shape == (2, heads, tokens, dv)
    want = naive_paged(q, k, v, tables, lengths, window)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    reference = attend.attend_paged_reference(q, k, v, tables, lengths, window=window)
    torch.testing.assert_close(reference.double(), want, atol=1e-5, rtol=1e-5)


@native
@pytest.mark.parametrize("block, turned", LAYOUTS)
@pytest.mark.parametrize("heads, kv_heads, d, dv, window",
                         [(9, 3, 64, 64, None), (4, 1, 20, 37, None), (6, 2, 16, 16, 9)])
def test_paged_attention_of_chunks_of_different_lengths(heads, kv_heads, d, dv, window, block,
                                                        turned):
    """Rows of one pass reading chunks of different lengths (a prompt's chunk beside
    decoding rows): row i's first counts[i] columns are its new tokens, its last counts[i]
    positions; each reads causally up to its own, against float64 attention found by hand
    over that row's real tokens alone, and the columns past them come back zeros. Key and
    value sizes off the vector widths take the kernel's masked loads."""
    g = torch.Generator().manual_seed(6)
    k = pool_keys(16, kv_heads, block, d, g, turned)
    v = torch.randn(16, kv_heads, block, dv, generator=g)
    tokens = 11
    q = torch.randn(3, heads, tokens, d, generator=g)
    tables = torch.tensor([[5, 2, 9, 6, 1, 0, 0, 0], [7, 3, 10, 11, 4, 8, 0, 0],
                           [12, 13, 14, 15, 0, 0, 0, 0]])
    lengths, counts = torch.tensor([20, 24, 13]), torch.tensor([11, 1, 6])
    out = attend.attend_paged(q, k, v, tables, lengths, window=window, counts=counts)
    for i, (length, real) in enumerate(zip(lengths.tolist(), counts.tolist(), strict=True)):
        want = naive_paged(q[i : i + 1, :, :real], k, v, tables[i : i + 1],
                           torch.tensor([length]), window)
        torch.testing.assert_close(out[i : i + 1, :, :real].double(), want, atol=1e-5,
                                   rtol=1e-5)
        assert not out[i, :, real:].any()
    reference = attend.attend_paged_reference(q, k, v, tables, lengths, window=window,
                                              counts=counts)
    torch.testing.assert_close(reference, out, atol=1e-5, rtol=1e-5)


@native
@pytest.mark.parametrize("turned", [False, True])
@pytest.mark.parametrize("window", [None, 40])
def test_a_query_s_paged_attention_has_the_same_bits_in_any_company(window, turned):
    """A query's result does not depend on the tile, the register block or the pass it is
    computed in: each token of a 70-token chunk read in one pass (beside a row of another
    length), read a token at a time, and read as a 3-token chunk, gives the same bits (what
    makes a prompt read alone, beside others or in other chunks decode the same text)."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d = 9, 3, 64
    k = pool_keys(40, kv_heads, 16, d, g, turned)
    v = torch.randn(40, kv_heads, 16, d, generator=g)
    tables = torch.randperm(39, generator=g)[:16].add(1).reshape(2, 8)
    q = torch.randn(2, heads, 70, d, generator=g)
    lengths, counts = torch.tensor([100, 90]), torch.tensor([70, 20])
    whole = attend.attend_paged(q, k, v, tables, lengths, window=window, counts=counts)
    for t in range(70):
        one = attend.attend_paged(q[:1, :, t], k, v, tables[:1], torch.tensor([31 + t]),
                                  window=window)
        assert torch.equal(one, whole[:1, :, t]), t
    three = attend.attend_paged(q[1:, :, 17:20], k, v, tables[1:], torch.tensor([90]),
                                window=window)
    assert torch.equal(three, whole[1:, :, 17:20])


@native
@pytest.mark.parametrize("block, turned", LAYOUTS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_positions_no_query_reads_may_hold_anything(block, turned, softcap):
    """A block's slots past a row's length (not yet written, or left by a rollback) and the
    positions behind every query's window (their blocks given back, taken by another row)
    may hold NaN: no query reads them, so none reaches a result (a masked NaN would spread
    through 0 * NaN, and a soft cap turns a masked score into a finite one)."""
    g = torch.Generator().manual_seed(10)
    length, tokens, window, d = 45, 3, 20, 32
    used = -(-length // block)
    k = pool_keys(used + 2, 2, block, d, g, turned)
    v = torch.randn(used + 2, 2, block, d, generator=g)
    tables = torch.arange(1, used + 1)[None]
    first = length - tokens + 1 - window  # the earliest position a query reads
    tables[0, : first // block] = used + 1  # a block given back, NaN from its new row
    for t in (k, v):
        t[used + 1] = float("nan")
        t[tables[0, first // block], :, : first % block] = float("nan")
        t[tables[0, -1], :, length - (used - 1) * block :] = float("nan")
    q = torch.randn(1, 4, tokens, d, generator=g)
    out = attend.attend_paged(q, k, v, tables, torch.tensor([length]), window=window,
                              softcap=softcap)
    want = naive_paged(q, k, v, tables, torch.tensor([length]), window, softcap=softcap)
    assert not want.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@native
def test_paged_attention_reads_histories_past_the_step_kernel_s_bound(monkeypatch):
    """attend_step keeps a row's scores on the stack (MAX_POSITIONS); the paged kernel takes
    a span at a time, so a history longer than that (a 32k-context model's) is read in place
    by the kernel, not by torch, against float64 attention found by hand."""
    monkeypatch.setattr(attend, "attend_paged_reference", None)  # the kernel's call only
    g = torch.Generator().manual_seed(8)
    length = attend.MAX_POSITIONS + 900
    blocks = -(-length // 16)
    k = pool_keys(blocks + 1, 1, 16, 8, g, turned=True)
    v = torch.randn(blocks + 1, 1, 16, 8, generator=g)
    q = torch.randn(1, 2, 8, generator=g) * 3
    tables = (torch.randperm(blocks, generator=g) + 1)[None]
    out = attend.attend_paged(q, k, v, tables, torch.tensor([length]))
    keys = k[tables[0]].transpose(0, 1).flatten(1, 2)[0, :length].double()
    values = v[tables[0]].transpose(0, 1).flatten(1, 2)[0, :length].double()
    want = (q[0].double() @ keys.T / math.sqrt(8)).softmax(dim=-1) @ values
    torch.testing.assert_close(out[0].double(), want, atol=1e-5, rtol=1e-5)


@native
@pytest.mark.parametrize("block, turned", LAYOUTS)
@pytest.mark.parametrize("scale, softcap, sinks", [(0.3, 2.0, False), (None, None, True),
                                                   (0.2, 1.5, True)])
def test_paged_attention_with_a_scale_a_soft_cap_and_sinks(scale, softcap, sinks, block,
                                                           turned):
    """Gemma 2's scale and soft cap on the scores, gpt-oss's sink logit per head (one large
    enough that a head attends to almost nothing, one well below its scores), over a chunk
    and a window, against float64 attention found by hand."""
    g = torch.Generator().manual_seed(9)
    k = pool_keys(12, 3, block, 64, g, turned)
    v = torch.randn(12, 3, block, 64, generator=g)
    q = torch.randn(2, 9, 5, 64, generator=g) * 2
    tables = torch.tensor([[5, 2, 9, 6, 1, 0, 0], [7, 3, 10, 11, 4, 8, 0]])
    lengths = torch.tensor([17, 24])
    logits = torch.linspace(-6.0, 9.0, 9) if sinks else None
    for window in (None, 6):
        out = attend.attend_paged(q, k, v, tables, lengths, window=window, scale=scale,
                                  softcap=softcap, sinks=logits)
        want = naive_paged(q, k, v, tables, lengths, window, scale, softcap, logits)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        reference = attend.attend_paged_reference(q, k, v, tables, lengths, window=window,
                                                  scale=scale, softcap=softcap, sinks=logits)
        torch.testing.assert_close(reference.double(), want, atol=1e-5, rtol=1e-5)


@native
def test_paged_attention_refuses_a_table_outside_the_pool():
    k = v = torch.zeros(4, 1, 4, 8)
    with pytest.raises(IndexError, match="outside"):
        attend.attend_paged(torch.zeros(1, 1, 8), k, v, torch.tensor([[0, 4]]),
                            torch.tensor([6]))
