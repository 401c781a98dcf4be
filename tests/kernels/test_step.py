import pytest
import torch
from torch import nn

from tformer.decoding.runner import runner
from tformer.kernels import library
from tformer.kernels import step as step_module
from tformer.kernels.attend import gather_positions
from tformer.kernels.formats import quantize_model
from tformer.kernels.step import DecoderStep
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

native = pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")

VOCAB = 50


def make_model(norm="pre", activation="silu", bias=True, **kw):
    torch.manual_seed(0)
    shape = dict(n_head=4, d_model=32, d_ff=48) | kw
    cfg = Seq2SeqConfig(vocab_size=VOCAB, n_layer=2, norm=norm, activation=activation, bias=bias,
                        dropout=0.0, **shape)
    return Seq2Seq(cfg).eval()


def sources(sentences=2, length=7):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, VOCAB, (sentences, length), generator=g)
    real = torch.ones(sentences, length, dtype=torch.bool)
    real[-1, length - 2:] = False  # padding on the last sentence
    return src, real


def run_steps(model, src, real, beams, steps, fused, cache_model=None):
    """`steps` decoding steps of beams x sentences rows, reordered after each step in a fixed
    random way; at step 3 the first sentence finishes and leaves (fewer rows, the ones that
    stay may read buffer rows past the new count). Returns each step's logits and the final
    caches. `cache_model` makes the cache (default: the model itself)."""
    sentences = src.shape[0]
    g = torch.Generator().manual_seed(7)
    model = runner(model)
    with torch.no_grad():
        memory = model.encode(src, real)
        cache = runner(cache_model or model).make_cache(sentences * beams, steps + 1)
        if not fused:
            cache.step = None
        tokens = torch.randint(3, VOCAB, (sentences * beams, 1), generator=g)
        logits = []
        for t in range(steps):
            logits.append(model.decode(tokens, memory, real, cache=cache))
            rows = sentences * beams
            index = torch.randint(0, rows, (rows,), generator=g)
            if t == 3 and sentences > 1:  # the first sentence finished: its beams leave
                keep = torch.arange(1, sentences)
                index = torch.randint(beams, rows, ((sentences - 1) * beams,), generator=g)
                cache.reorder(index, keep)
                memory, real, sentences = memory[keep], real[keep], sentences - 1
            else:
                cache.reorder(index)
            tokens = torch.randint(3, VOCAB, (sentences * beams, 1), generator=g)
    return logits, cache


@native
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_one_call_per_layer_computes_what_the_layers_compute_in_float64(norm, activation,
                                                                        monkeypatch):
    # Independent of every kernel: the same model in float64 runs torch's modules only.
    model = quantize_model(make_model(norm, activation), "fp32")
    src, real = sources(sentences=1)
    calls = []
    original = DecoderStep.run
    monkeypatch.setattr(DecoderStep, "run",
                        lambda self, *a: calls.append(1) or original(self, *a))
    got, _ = run_steps(model, src, real, beams=4, steps=6, fused=True)
    assert len(calls) == 5  # every step after the first (which fills the cross-attention)
    want, _ = run_steps(make_model(norm, activation).double(), src, real, beams=4, steps=6,
                        fused=False)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)


@native
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "silu"])
def test_widths_that_leave_a_remainder_after_the_vector_lanes(norm, activation):
    # d_model 34 and d_ff 51: the layer norm's and the activation's scalar tails, and heads
    # of 17 (the attention kernel's).
    shape = dict(n_head=2, d_model=34, d_ff=51)
    model = quantize_model(make_model(norm, activation, **shape), "fp32")
    src, real = sources(sentences=1)
    got, _ = run_steps(model, src, real, beams=3, steps=5, fused=True)
    want, _ = run_steps(make_model(norm, activation, **shape).double(), src, real, beams=3,
                        steps=5, fused=False)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)


@native
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "silu"])
def test_activations_hold_far_from_zero(activation):
    # The vector activations take exp of -|u| only; inputs of +-100s (the FFN's input
    # weights scaled up) must give v, 0 and -0 where they should, not inf or NaN.
    def scaled(model):
        with torch.no_grad():
            for layer in model.decoder:
                layer.ff.up.weight.mul_(60.0)
        return model

    model = quantize_model(scaled(make_model(activation=activation)), "fp32")
    src, real = sources(sentences=1)
    got, _ = run_steps(model, src, real, beams=4, steps=4, fused=True)
    want, _ = run_steps(scaled(make_model(activation=activation)).double(), src, real, beams=4,
                        steps=4, fused=False)
    for a, b in zip(got, want, strict=True):
        assert a.isfinite().all()
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-5)


@native
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_steps_match_the_int8_layers_and_store_the_same_keys(norm, bias, kernel_isa):
    # Two sentences of four beams (eight rows: the packed product of AVX-512 VNNI or AVX2),
    # a sentence leaving mid-way (four rows: AVX2's few-row kernel). The products and
    # attention are the modules' kernels; only the layer norms and activations round
    # differently, which can move an input across an int8 rounding step now and then.
    model = quantize_model(make_model(norm, bias=bias), "int8")
    src, real = sources(sentences=2)
    got, got_cache = run_steps(model, src, real, beams=4, steps=7, fused=True)
    want, want_cache = run_steps(model, src, real, beams=4, steps=7, fused=False)
    assert got_cache.step is not None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Each hypothesis' keys and values, read through the lineage (buffer rows that no
    # hypothesis reaches any more hold whatever was there).
    for a, b in zip(got_cache.self_attn, want_cache.self_attn, strict=True):
        assert a.length == b.length == 7
        for buffer in ("k", "v"):
            torch.testing.assert_close(
                gather_positions(getattr(a, buffer), got_cache.lineage.rows, 7),
                gather_positions(getattr(b, buffer), want_cache.lineage.rows, 7),
                atol=1e-4, rtol=1e-4)


@native
def test_the_step_runs_only_where_it_computes_the_same(monkeypatch):
    model = quantize_model(make_model(), "fp32")
    src, real = sources(sentences=1)
    with torch.no_grad():
        memory = model.encode(src, real)
        cache = runner(model).make_cache(4, 8)
        x = torch.zeros(4, 1, 32)
        model.decode(torch.full((4, 1), 3), memory, real, cache=cache)  # fills cross-attention
        step = cache.step
        bias = torch.zeros(1, 1, 1, src.shape[1])
        assert step.serves(x, bias)
        # fp32 products of more rows than fp32.c's kernel takes are oneDNN's
        assert not step.serves(torch.zeros(8, 1, 32), bias)
        assert not step.serves(x.double(), bias)
        assert not step.serves(x, bias.bool())
        model.decoder[1].cross_attn.recorded = []
        assert not step.serves(x, bias)
        model.decoder[1].cross_attn.recorded = None
        model.train()
        assert not step.serves(x, bias)
        model.eval()
        # a source longer than the attention kernel keeps scores for (7 tokens here)
        monkeypatch.setattr(step_module, "MAX_POSITIONS", 6)
        assert not step.serves(x, bias)
        monkeypatch.setattr(step_module, "MAX_POSITIONS", 7)
        assert step.serves(x, bias)
    # gradients are torch's
    assert not step.serves(x.requires_grad_(), bias)


def test_layers_it_cannot_read_keep_the_modules():
    model = make_model()
    model.decoder[0].ff.activation = nn.Tanh()
    assert runner(model).make_cache(4, 8).step is None
    assert runner(make_model().double()).make_cache(4, 8).step is None


@native
def test_a_lineage_naming_a_row_outside_the_cache_is_an_error():
    model = runner(quantize_model(make_model(), "int8"))
    src, real = sources(sentences=1)
    with torch.no_grad():
        memory = model.encode(src, real)
        cache = model.make_cache(4, 3)
        model.decode(torch.full((4, 1), 3), memory, real, cache=cache)
        cache.lineage.rows[2, 0] = 9
        with pytest.raises(IndexError, match="outside the cache"):
            model.decode(torch.full((4, 1), 3), memory, real, cache=cache)
        cache.lineage.rows[2, 0] = 2
        model.decode(torch.full((4, 1), 3), memory, real, cache=cache)
        model.decode(torch.full((4, 1), 3), memory, real, cache=cache)
        with pytest.raises(RuntimeError, match="holds 3 positions"):
            model.decode(torch.full((4, 1), 3), memory, real, cache=cache)


@native
@pytest.mark.parametrize("int8", [False, True])
def test_heads_whose_values_are_wider_than_their_keys(int8):
    # q and k of 6 per head, v of 10: the fused projection's three parts and the output
    # projection's input all have other widths.
    model = quantize_model(make_model("post", "gelu", d_head=6, d_value=10),
                           "int8" if int8 else "fp32")
    src, real = sources(sentences=1)
    got, _ = run_steps(model, src, real, beams=4, steps=5, fused=True)
    assert runner(model).make_cache(4, 6).step is not None
    # fp32 against the model in float64; int8 against its own layers run as modules
    reference = model if int8 else make_model("post", "gelu", d_head=6, d_value=10).double()
    want, _ = run_steps(reference, src, real, beams=4, steps=5, fused=False)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.to(b.dtype), b, atol=1e-4 if int8 else 2e-5,
                                   rtol=1e-4 if int8 else 1e-5)


def cross_caches(model, memory):
    """Each decoder layer's cross-attention keys and values of `memory`, as StaticKVs."""
    from tformer.layers.cache import StaticKV

    caches = []
    for layer in model.decoder:
        cache = StaticKV()
        cache.k, cache.v = layer.cross_attn.memory_kv(memory)
        caches.append(cache)
    return caches


@native
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_a_step_over_a_paged_pool_computes_what_the_layers_compute_in_float64(norm, activation):
    # Rows of different lengths over blocks of 4 positions, two of them sharing their first
    # blocks (a fork, as beam search's hypotheses do) and then a copy of the last one, each
    # step's logits against the float64 model reading the row's whole target at once.
    from tformer.decoding.paged import PagedPool, Row
    from tformer.layers.masks import attention_bias, padding_mask

    model = quantize_model(make_model(norm, activation), "fp32")
    reference = make_model(norm, activation).double()
    step = DecoderStep.paged(model.decoder)
    assert step is not None
    src, real = sources(sentences=2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        memory = model.encode(src, real)
        memory64 = reference.encode(src, real)
        cross = cross_caches(model, memory)
        bias = attention_bias(padding_mask(real), torch.float32)
        pool = PagedPool(model, 24, block_size=4, prefix_cache=False)
        rows = [Row(), Row()]  # one row a sentence at first: n = 2 rows of 2 sentences
        targets = [[1], [1]]

        def step_all(tokens):
            pool.own_last([row for row in rows if row.length % pool.block_size])
            pool.allocate(rows, [1] * len(rows))
            positions = torch.tensor([[row.length] for row in rows])
            x = model.embed_targets(torch.tensor(tokens)[:, None], positions)
            lengths = torch.tensor([row.length + 1 for row in rows])
            x = step.run_paged(x, pool.k, pool.v, pool.block_tables(rows), lengths, cross,
                               bias)
            for row in rows:
                row.length += 1
            return model.decoder_outputs(x)[:, -1]

        for t in range(11):
            if t == 5:  # each sentence's row forks: two hypotheses a sentence from here
                rows = [rows[0], pool.fork(rows[0]), rows[1], pool.fork(rows[1])]
                targets = [targets[0], list(targets[0]), targets[1], list(targets[1])]
            got = step_all([target[-1] for target in targets])
            group = len(rows) // 2
            for i, target in enumerate(targets):
                sentence = slice(i // group, i // group + 1)
                want = reference.decode(torch.tensor([target]), memory64[sentence],
                                        real[sentence])[0, -1]
                torch.testing.assert_close(got[i].double(), want, atol=2e-5, rtol=1e-5)
                target.append(int(torch.randint(3, VOCAB, (), generator=g)))
        assert pool.used < sum(len(row.blocks) for row in rows)  # the forks share blocks


@native
def test_a_paged_table_naming_a_block_outside_the_pool_is_an_error():
    from tformer.decoding.paged import PagedPool

    model = quantize_model(make_model(), "fp32")
    step = DecoderStep.paged(model.decoder)
    src, real = sources(sentences=1)
    with torch.no_grad():
        memory = model.encode(src, real)
        cross = cross_caches(model, memory)
        pool = PagedPool(model, 4, block_size=4, prefix_cache=False)
        for buf in pool.k:
            buf.fill_(0.5)  # (new blocks hold whatever memory held: NaN, maybe)
        before = [buf.clone() for buf in pool.k]
        x = model.embed_targets(torch.tensor([[5]]), torch.tensor([[4]]))
        bias = torch.zeros(1, 1, 1, src.shape[1])
        with pytest.raises(IndexError, match="outside the pool"):
            step.run_paged(x, pool.k, pool.v, torch.tensor([[1, 4]]), torch.tensor([5]),
                           cross, bias)
        assert all(torch.equal(a, b) for a, b in zip(before, pool.k, strict=True))
