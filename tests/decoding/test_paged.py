"""The paged KV pool against full passes of the model over each text: rows of different
lengths join, read their prompts a chunk at a time, decode together and leave, on the GPT
layouts (GPT-2, grouped-query Llama, Qwen3's q/k norm, Mistral's sliding window)."""

from __future__ import annotations

import pytest
import torch

from tformer.decoding.lm import generate
from tformer.decoding.paged import PagedPool, PoolFull, Row
from tformer.models.gpt import GPT, GPTConfig

LLAMA = {"position": "none", "rotary": True, "norm_kind": "rmsnorm", "norm_eps": 1e-6,
         "feedforward": "gated", "activation": "silu", "bias": False}
LAYOUTS = [{}, {**LLAMA, "n_kv_head": 2}, {**LLAMA, "n_kv_head": 1, "qk_norm": True},
           {**LLAMA, "window": 5, "n_kv_head": 2}]


def model_of(options: dict, context: int = 40) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, context=context, n_layer=2, n_head=4, d_model=16,
                          tie_embeddings=False, **options)).eval()
    with torch.no_grad():  # decisive logits: greedy texts compare tokens, not rounding
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            elif name.endswith("sinks"):  # gpt-oss's sink logits: some heads attend little
                p.normal_(0.0, 2.0)
    return model


def read(pool: PagedPool, row: Row, text: list[int], chunk: int) -> torch.Tensor:
    """Read a text a chunk at a time; its every-position logits."""
    return torch.cat([pool.read_chunk(row, text[i : i + chunk], every_position=True)
                      for i in range(0, len(text), chunk)])


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "per-layer"])
@pytest.mark.parametrize("options", LAYOUTS, ids=str)
@torch.no_grad()
def test_rows_joining_and_leaving_decode_as_a_full_pass_over_each_text(options, in_place):
    """Steps read every row's blocks in place through the one-call step kernel, or attend
    layer by layer over the gathered blocks: both as a full pass."""
    from tformer.kernels.attend import native

    model = model_of(options)
    pool = PagedPool(model, 64, block_size=4)
    if not in_place:
        pool._step, pool.in_place = None, False
    elif native() is None:
        pytest.skip("the kernels are not built here")
    assert (pool._step is not None) == in_place
    g = torch.Generator().manual_seed(1)
    texts: list[list[int]] = []
    for length in (9, 3, 14):
        text = torch.randint(0, 37, (length,), generator=g).tolist()
        row = Row()
        got = read(pool, row, text, chunk=4)
        torch.testing.assert_close(got, model(torch.tensor([text]))[0], atol=1e-5, rtol=1e-5)
        pool.seat(row)
        texts.append(text)
    for step in range(12):
        if step == 4:  # the second row leaves; the last takes its place
            pool.remove(1)
            texts[1] = texts.pop()
        if step == 6:  # a new row joins mid-flight
            text = torch.randint(0, 37, (7,), generator=g).tolist()
            row = Row()
            read(pool, row, text, chunk=3)
            pool.seat(row)
            texts.append(text)
        new = torch.randint(0, 37, (len(texts),), generator=g).tolist()
        logits = pool.step(new)
        for i, token in enumerate(new):
            texts[i].append(token)
            want = model(torch.tensor([texts[i]]))[0, -1]
            torch.testing.assert_close(logits[i], want, atol=1e-5, rtol=1e-5)
    if "window" not in options:
        assert pool.used == sum(-(-len(t) // 4) for t in texts)
    else:  # the blocks behind the window (5 positions: 2 blocks at most) went back
        held = [len([b for b in row.blocks if b]) for row in pool.active]
        assert max(held) <= 2 and pool.used == sum(held) < sum(-(-len(t) // 4) for t in texts)
    pool.clear()
    assert pool.used == 0


@pytest.mark.parametrize("options", LAYOUTS, ids=str)
@torch.no_grad()
def test_steps_in_place_give_the_gathered_path_s_logits_through_preemption(options):
    """Two pools driven alike, one stepping in place (the paged step kernel) and one over
    gathered blocks (the model's modules): rows join, leave, are preempted (their blocks
    given back) and resumed (their text read again, into other blocks), and every step's
    logits agree within 1e-5, with prefix-cache blocks shared among rows and a speculative
    round's verification (a few tokens a row, then a rollback) among the steps."""
    from tformer.kernels.attend import native

    if native() is None:
        pytest.skip("the kernels are not built here")
    model = model_of(options)
    pools = [PagedPool(model, 40, block_size=4), PagedPool(model, 40, block_size=4)]
    pools[1]._step, pools[1].in_place = None, False
    for pool in pools:
        pool.reach = 2
    g = torch.Generator().manual_seed(7)
    texts = [torch.randint(0, 37, (n,), generator=g).tolist() for n in (6, 11, 2)]
    texts.append(texts[1][:8] + [5, 6])  # shares two full blocks with the second text

    def seat(text):
        for pool in pools:
            row = Row()
            pool.reuse(row, text)
            read(pool, row, text[row.length :], chunk=5)
            pool.seat(row)

    for text in texts:
        seat(text)
    for step in range(14):
        if step == 3:  # the second row is preempted; the last takes its place
            for pool in pools:
                pool.remove(1)
            preempted, texts[1] = texts[1], texts.pop()
        if step == 6:  # ... and resumed with the text it had
            seat(preempted)
            texts.append(preempted)
        if step == 9:  # a row leaves
            for pool in pools:
                pool.remove(0)
            texts[0] = texts.pop()
        if step == 11:  # a speculative round's verification: 2 tokens a row, some kept
            drafts = torch.randint(0, 37, (len(texts), 2), generator=g)
            real = torch.ones_like(drafts, dtype=torch.bool)
            in_place, gathered = (pool.extend(drafts, real) for pool in pools)
            torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)
            kept = torch.tensor([1, 2, 0])
            for pool in pools:
                pool.truncate(kept, 2)
            for text, row, keep in zip(texts, drafts.tolist(), kept.tolist(), strict=True):
                text += row[:keep]
        new = torch.randint(0, 37, (len(texts),), generator=g).tolist()
        in_place, gathered = (pool.step(new) for pool in pools)
        torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)
        for text, token in zip(texts, new, strict=True):
            text.append(token)
    want = torch.stack([model(torch.tensor([t]))[0, -1] for t in texts])
    torch.testing.assert_close(in_place, want, atol=1e-5, rtol=1e-5)
    assert pools[0].found == pools[1].found > 0


GEMMA_LIKE = {**LLAMA, "window": 5, "global_every": 2, "n_kv_head": 2}
"""Sliding layers between global ones: each layer reads the blocks through its own window."""
GEMMA2_LIKE = {**GEMMA_LIKE, "attn_softcap": 5.0, "attn_scale": 0.3}
"""Gemma 2's scores: a scale of their own, bounded by a soft cap."""
SINKS = {**LLAMA, "n_kv_head": 2, "attn_sinks": True}
"""gpt-oss's sink logit per head."""


def kernel_and_layer_pools(options, monkeypatch):
    """The kernel's calls as they come (their keyword arguments), and a model with two pools
    whose passes go through the layers (the one-call step off): one reading the blocks in
    place, one whose every layer gathers."""
    from tformer.kernels.attend import native

    if native() is None:
        pytest.skip("the kernels are not built here")
    from tformer.decoding import paged

    calls = []
    kernel = paged.attend_paged
    monkeypatch.setattr(paged, "attend_paged",
                        lambda *args, **kw: calls.append(kw) or kernel(*args, **kw))
    model = model_of(options, context=64)
    pools = [PagedPool(model, 64, block_size=4), PagedPool(model, 64, block_size=4)]
    pools[1].in_place = False
    for pool in pools:
        pool._step = None  # the layers' path at every pass
    return calls, model, pools


@pytest.mark.parametrize("options", [*LAYOUTS, GEMMA_LIKE, GEMMA2_LIKE, SINKS], ids=str)
@torch.no_grad()
def test_chunks_read_in_place_give_the_gathered_path_s_logits(options, monkeypatch):
    """Prompts read in chunks through the layers (the one-call step off), one row at a time
    and rows in step: the layers attend over
    the blocks in place (kernels/attend.py's paged attention, causal within the chunk, each
    layer its own window) with the logits of a pool whose every layer gathers, and of a full
    pass over each text; Gemma 2's scale and soft cap and gpt-oss's sinks in the kernel
    too."""
    kernel_calls, model, pools = kernel_and_layer_pools(options, monkeypatch)
    g = torch.Generator().manual_seed(2)
    texts = [torch.randint(0, 37, (37,), generator=g).tolist() for _ in range(2)]
    rows = [[Row(), Row()] for _ in pools]
    got = [[], []]
    for start, width in [(0, 7), (7, 8), (15, 8), (23, 8), (31, 6)]:
        ids = torch.tensor([t[start : start + width] for t in texts])
        for pool, pair, out in zip(pools, rows, got, strict=True):
            if start == 0:  # one row at a time
                out.append(torch.cat([pool.forward([row], ids[i : i + 1]) for i, row
                                      in enumerate(pair)]))
            else:  # both rows in one pass
                out.append(pool.forward(pair, ids))
    in_place, gathered = (torch.cat(out, dim=1) for out in got)
    assert kernel_calls
    torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(in_place, model(torch.tensor(texts)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [*LAYOUTS, GEMMA_LIKE, GEMMA2_LIKE, SINKS], ids=str)
@torch.no_grad()
def test_chunks_of_different_lengths_in_one_pass_read_the_blocks_in_place(options,
                                                                           monkeypatch):
    """Rows that hold different numbers of positions reading chunks of different lengths in
    one pass (a prompt's chunk beside decoding rows, padded after each row's last): the
    layers attend in place, each row over its own real tokens (kernels/attend.py's counts),
    with the logits of a pool whose every layer gathers and of a full pass over each text."""
    calls, model, pools = kernel_and_layer_pools(options, monkeypatch)
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(0, 37, (n,), generator=g).tolist() for n in (30, 21, 12)]
    chunks = [(7, 3, 1), (5, 9, 1), (1, 1, 6), (12, 8, 4), (5, 0, 0)]
    got = [[[] for _ in texts] for _ in pools]
    for pool, out in zip(pools, got, strict=True):
        rows, read = [Row() for _ in texts], [0] * len(texts)
        for widths in chunks:
            ids = torch.zeros(len(texts), max(widths), dtype=torch.long)
            real = torch.zeros_like(ids, dtype=torch.bool)
            for i, (text, width) in enumerate(zip(texts, widths, strict=True)):
                ids[i, :width] = torch.tensor(text[read[i] : read[i] + width], dtype=torch.long)
                real[i, :width] = True
            logits = pool.forward(rows, ids, real)
            for i, width in enumerate(widths):
                out[i].append(logits[i, :width])
                read[i] += width
    assert any(kw["counts"] is not None for kw in calls), \
        "no pass read the blocks in place with rows of other lengths"
    for text, in_place, gathered in zip(texts, *got, strict=True):
        in_place, gathered = torch.cat(in_place), torch.cat(gathered)
        torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(in_place, model(torch.tensor([text]))[0], atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("options", LAYOUTS[:2], ids=str)
@torch.no_grad()
def test_greedy_text_equals_generate_token_for_token(options):
    model = model_of(options)
    pool = PagedPool(model, 32, block_size=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    outs = [[] for _ in prompts]
    last = []
    for prompt, out in zip(prompts, outs, strict=True):
        row = Row()
        logits = read(pool, row, prompt, chunk=3)[-1]
        pool.seat(row)
        out.append(int(logits.argmax()))
        last.append(out[-1])
    for _ in range(15):
        logits = pool.step(last)
        last = [int(t) for t in logits.argmax(-1)]
        for out, token in zip(outs, last, strict=True):
            out.append(token)
    for prompt, out in zip(prompts, outs, strict=True):
        alone = [int(t[0]) for t in generate(model, torch.tensor([prompt]), max_new_tokens=16,
                                             temperature=0.0)]
        assert out == alone


@torch.no_grad()
def test_a_pass_that_does_not_fit_stores_nothing_and_rollback_frees_blocks():
    model = model_of({})
    pool = PagedPool(model, 5, block_size=4)  # 4 usable blocks: 16 positions
    text = list(range(10))
    row = Row()
    pool.read_chunk(row, text)
    pool.seat(row)
    other = Row()
    with pytest.raises(PoolFull):
        pool.read_chunk(other, [1, 2, 3, 4, 5])
    assert other.length == 0 and other.blocks == [] and pool.used == 3
    # Speculation's verification and rollback: of 3 positions one kept, the fourth block
    # given back, and the next step continues the kept text.
    pool.extend(torch.tensor([[11, 12, 13]]), torch.tensor([[True, True, True]]))
    assert pool.used == 4 and row.length == 13
    pool.truncate(torch.tensor([1]), 3)
    assert pool.used == 3 and row.length == 11
    logits = pool.step([20])
    want = model(torch.tensor([text + [11, 20]]))[0, -1]
    torch.testing.assert_close(logits[0], want, atol=1e-5, rtol=1e-5)


def close(got, model, text, start):
    torch.testing.assert_close(got, model(torch.tensor([text]))[0, start:], atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("options", LAYOUTS[1:3], ids=str)
@torch.no_grad()
def test_a_prefix_found_in_the_cache_gives_the_logits_of_a_cold_read(options):
    """A second text sharing the first's first 13 tokens takes its 3 full blocks of 4 and
    reads the rest; its logits equal a full pass's. After the first text leaves, its
    named blocks stay (idle) and serve a third text."""
    model = model_of(options)
    pool = PagedPool(model, 32, block_size=4)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 37, (13,), generator=g).tolist()
    first = shared + [1, 2]
    row = Row()
    pool.read_chunk(row, first)
    pool.seat(row)
    second = shared + [5, 6, 7]
    other = Row()
    assert pool.reuse(other, second) == 12 and other.blocks == row.blocks[:3]
    close(pool.read_chunk(other, second[12:], every_position=True), model, second, 12)
    assert pool.found == 12 and pool.looked_up == len(second)
    pool.seat(other)
    pool.remove(0)  # the first text leaves: its blocks shared or idle, none free again
    assert pool.used == len(other.blocks)
    third = Row()
    assert pool.reuse(third, first + [9]) == 12
    close(pool.read_chunk(third, (first + [9])[12:], every_position=True), model, first + [9], 12)


@torch.no_grad()
def test_a_rollback_into_a_shared_block_copies_it_first():
    """Text A's verified drafts fill a block that text B then takes; A rejects them and
    writes another token where they were: A's copy changes, B's block does not."""
    model = model_of({**LLAMA, "n_kv_head": 2})
    pool = PagedPool(model, 32, block_size=4)
    first = list(range(3, 18))  # 15 tokens
    a = Row()
    pool.read_chunk(a, first)
    pool.seat(a)
    pool.extend(torch.tensor([[30, 31, 32]]), torch.tensor([[True, True, True]]))
    b_text = first + [30, 7, 8]
    b = Row()
    assert pool.reuse(b, b_text) == 16 and b.blocks == a.blocks[:4]
    pool.truncate(torch.tensor([0]), 3)  # A keeps its 15 tokens: back inside block 3
    assert a.length == 15 and a.blocks[3] != b.blocks[3]
    close(pool.step([9]), model, first + [9], 15)
    close(pool.read_chunk(b, [7, 8], every_position=True), model, b_text, 16)


@torch.no_grad()
def test_idle_named_blocks_are_taken_back_least_recently_used_first():
    model = model_of({})
    pool = PagedPool(model, 4, block_size=4)  # 3 usable blocks
    a, b = Row(), Row()
    pool.read_chunk(a, list(range(9)))  # 2 full blocks named, 1 partial
    pool.release(a)
    assert pool.available == 3 and pool.blocks.idle == 2
    pool.read_chunk(b, list(range(20, 30)))  # needs 3 blocks: the free one, then idle ones
    assert pool.blocks.idle == 0 and pool.reuse(Row(), list(range(9))) == 0


@torch.no_grad()
def test_a_rollback_over_several_one_token_passes_as_a_drafter_makes_them():
    """A drafter's round: three one-token passes, then the first of the three kept. A row
    that wrote nothing in them (it did not draft) keeps its text; both then step as a full
    pass over what they kept."""
    model = model_of({**LLAMA, "n_kv_head": 2})
    pool = PagedPool(model, 20, block_size=4)
    pool.reach = 3
    texts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    for text in texts:
        pool.join(text)
    drafting = torch.tensor([[True], [False]])
    for token in (9, 10, 11):
        pool.extend(torch.tensor([[token], [0]]), drafting)
    assert pool.read == [8, 3]
    pool.truncate(torch.tensor([1, 3]), 3)
    assert pool.read == [6, 3] and len(pool.active[0].blocks) == 2  # the third went back
    logits = pool.step([12, 13])
    for i, text in enumerate([texts[0] + [9, 12], texts[1] + [13]]):
        torch.testing.assert_close(logits[i], model(torch.tensor([text]))[0, -1], atol=1e-5,
                                   rtol=1e-5)
    with pytest.raises(ValueError, match="rollback of 4 columns"):
        pool.truncate(torch.tensor([0, 0]), 4)


@torch.no_grad()
def test_a_text_longer_than_the_context_is_read_from_its_last_tokens():
    model = model_of({}, context=8)
    pool = PagedPool(model, 10, block_size=4)
    text = list(range(1, 12))
    pool.join(text)
    assert pool.read == [11] and pool.held() == 8
