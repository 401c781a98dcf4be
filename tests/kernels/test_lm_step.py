"""The language model's one-call decoding step (kernels/step.py's LMStep, step.c's
tformer_lm_layer_step) against the same model's modules in float64."""

import pytest
import torch
from torch import nn

from tformer.decoding.runner import runner
from tformer.kernels import fp32, library
from tformer.kernels import step as step_module
from tformer.kernels.formats import quantize_model
from tformer.kernels.step import LM_F32_ROWS, LMStep
from tformer.models.gpt import GPT, GPTConfig

native = pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")

VOCAB = 61
MODERN = dict(position="none", rotary=True, norm_kind="rmsnorm", feedforward="gated",
              activation="silu", bias=False)
LAYOUTS = {
    "gpt2": dict(activation="gelu_tanh"),
    "post-norm, relu": dict(norm="post", activation="relu"),
    "llama, grouped-query": MODERN | dict(n_kv_head=2, rope_theta=500000.0),
    # Qwen3: query/key norms, heads wider than d_model / n_head; here multi-query, with the
    # interleaved layout rotating half of each head
    "qwen3, multi-query": MODERN | dict(n_kv_head=1, qk_norm=True, d_head=20,
                                        rope_layout="interleaved", rope_fraction=0.5),
    "qwen2, q/k/v biases": MODERN | dict(n_kv_head=2, qkv_bias=True),
    # a window shorter than the sequence: the steps past it see the last 5 positions only
    "mistral, sliding window": MODERN | dict(n_kv_head=2, window=5),
    "layer-norm heads, exact gelu": dict(qk_norm=True, activation="gelu", rotary=True),
    # heads of 17 and a width of 34: every vector loop's scalar rest
    "odd widths": MODERN | dict(d_model=34, n_head=2, d_ff=51),
}


def make_model(layout: dict) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(**(dict(vocab_size=VOCAB, d_model=48, n_head=4, n_layer=2, context=24,
                            dropout=0.0) | layout))
    model = GPT(cfg).eval()
    with torch.no_grad():  # every weight away from its initial value, norms included
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def prompts(rows: int, length: int = 14):
    """Token ids and a left-padded is_real mask (the other rows shorter by 0, 3, 6, ...)."""
    g = torch.Generator().manual_seed(rows)
    tokens = torch.randint(0, VOCAB, (rows, length), generator=g)
    is_real = torch.ones(rows, length, dtype=torch.bool)
    for i in range(rows):
        is_real[i, : 3 * i % 8] = False
    return tokens, is_real


def decode(model, tokens, is_real, *, prefill: int, step: bool = True):
    """Logits of every position: the first `prefill` in one pass, then one step a token,
    through the decoding runner (step: with its one-call step where it serves)."""
    model = runner(model)
    padded = is_real is not None
    cache = model.make_cache(tokens.shape[0], padded=padded)
    if not step:
        cache.step = None

    def part(a, b):
        return tokens[:, a:b], is_real[:, a:b] if padded else None

    with torch.no_grad():
        logits = [model(*part(0, prefill), cache=cache)]
        for t in range(prefill, tokens.shape[1]):
            logits.append(model(*part(t, t + 1), cache=cache))
    return torch.cat(logits, dim=1), cache


def count_runs(monkeypatch) -> list:
    calls = []
    original = LMStep.run
    monkeypatch.setattr(LMStep, "run", lambda self, *a: calls.append(1) or original(self, *a))
    return calls


@native
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("padded", [False, True])
def test_one_call_per_layer_computes_what_the_blocks_compute_in_float64(layout, padded,
                                                                        monkeypatch):
    # Independent of every kernel: the same weights in float64, the whole sequence in one
    # pass through torch's modules.
    rows = 3
    tokens, is_real = prompts(rows)
    is_real = is_real if padded else None
    calls = count_runs(monkeypatch)
    got, cache = decode(quantize_model(make_model(LAYOUTS[layout]), "fp32"), tokens,
                        is_real, prefill=6)
    assert isinstance(cache.step, LMStep) and len(calls) == tokens.shape[1] - 6
    with torch.no_grad():
        want = make_model(LAYOUTS[layout]).double()(tokens, is_real)
    real = slice(None) if is_real is None else is_real
    torch.testing.assert_close(got.double()[real], want[real], atol=2e-5, rtol=1e-5)


def decode_in_chunks(model, tokens, is_real, *, prefill: int, chunk: int):
    """Logits of every position: the first `prefill` in one pass, then `chunk` at a time
    (as speculative decoding verifies its drafts)."""
    padded = is_real is not None
    model = runner(model)
    cache = model.make_cache(tokens.shape[0], padded=padded)
    with torch.no_grad():
        logits = []
        for a in [0, *range(prefill, tokens.shape[1], chunk)]:
            b = prefill if a == 0 else min(a + chunk, tokens.shape[1])
            logits.append(model(tokens[:, a:b], is_real[:, a:b] if padded else None,
                                cache=cache))
    return torch.cat(logits, dim=1)


@native
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows, chunk, padded", [(1, 3, False), (1, LM_F32_ROWS, False),
                                                 (2, 4, True), (1, 5, True)])
def test_several_tokens_a_call_attend_causally_as_the_blocks_do_in_float64(
        layout, rows, chunk, padded, monkeypatch):
    tokens, is_real = prompts(rows, length=20)
    is_real = is_real if padded else None
    calls = count_runs(monkeypatch)
    prefill = 6 if padded else 2  # the padding within the prompt: a padding query sees itself
    got = decode_in_chunks(quantize_model(make_model(LAYOUTS[layout]), "fp32"), tokens,
                           is_real, prefill=prefill, chunk=chunk)
    if LAYOUTS[layout].get("window") is None:  # a window sliding between them: the modules
        # The prompt too where it is short and unpadded.
        prompt = rows * prefill <= LM_F32_ROWS and (not padded or is_real[:, :prefill].all())
        assert len(calls) == -(-(20 - prefill) // chunk) + int(prompt)
    with torch.no_grad():
        want = make_model(LAYOUTS[layout]).double()(tokens, is_real)
    real = slice(None) if is_real is None else is_real
    torch.testing.assert_close(got.double()[real], want[real], atol=2e-5, rtol=1e-5)


@native
@pytest.mark.parametrize("rows", [1, 4, LM_F32_ROWS])
def test_batched_steps_equal_one_row_at_a_time(rows):
    # Every token through the step (a prompt's pass would take oneDNN's products for many
    # rows): each output of fp32.c's products is summed in the same order at any number of
    # rows, and attention is per row, so the bits are the same.
    # (The output projection is outside the step: past fp32.MAX_ROWS rows its logits are
    # oneDNN's, so there the keys and values tell.)
    model = quantize_model(make_model(LAYOUTS["llama, grouped-query"]), "fp32")
    tokens, _ = prompts(rows)
    together, cache = decode(model, tokens, None, prefill=1)
    alone = [decode(model, tokens[i : i + 1], None, prefill=1) for i in range(rows)]
    for layer, c in enumerate(cache.self_attn):
        for buffer in ("k", "v"):
            stored = [getattr(a.self_attn[layer], buffer)[:, :, : c.length] for _, a in alone]
            assert torch.equal(getattr(c, buffer)[:, :, : c.length], torch.cat(stored))
    if rows <= fp32.MAX_ROWS:
        assert torch.equal(together, torch.cat([logits for logits, _ in alone]))


@native
@pytest.mark.parametrize("layout", ["gpt2", "llama, grouped-query", "qwen3, multi-query"])
def test_int8_steps_match_the_int8_blocks_and_store_the_same_keys(layout, kernel_isa):
    # Eight rows: AVX-512 VNNI's packed product, AVX2's few-row kernel. The products and
    # attention are the modules' kernels; only norms and activations round differently,
    # which can move an input across an int8 rounding step now and then.
    model = quantize_model(make_model(LAYOUTS[layout]), "int8")
    tokens, is_real = prompts(8)
    got, got_cache = decode(model, tokens, is_real, prefill=5)
    modules = quantize_model(make_model(LAYOUTS[layout]), "int8")
    want, want_cache = decode(modules, tokens, is_real, prefill=5, step=False)
    assert isinstance(got_cache.step, LMStep) and want_cache.step is None
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(got_cache.self_attn, want_cache.self_attn, strict=True):
        assert a.length == b.length == tokens.shape[1]
        torch.testing.assert_close(a.k[:, :, : a.length], b.k[:, :, : b.length], atol=1e-4,
                                   rtol=1e-4)
        torch.testing.assert_close(a.v[:, :, : a.length], b.v[:, :, : b.length], atol=1e-4,
                                   rtol=1e-4)


@native
@pytest.mark.parametrize("chunk", [3, LM_F32_ROWS])
def test_int8_tokens_a_few_at_a_time_match_the_int8_blocks(chunk, kernel_isa, monkeypatch):
    # As speculative decoding verifies with --int8: the products are the modules' kernels
    # (a row's product does not depend on the rows beside it); the norms, activations and
    # attention round differently, and where that moves an input across an int8 rounding
    # step, a logit moves by up to ~1e-2. A token misplaced in the cache would move them all.
    layout = LAYOUTS["llama, grouped-query"]
    tokens, _ = prompts(1, length=20)
    calls = count_runs(monkeypatch)
    got = decode_in_chunks(quantize_model(make_model(layout), "int8"), tokens, None,
                           prefill=4, chunk=chunk)
    assert len(calls) == 1 + -(-16 // chunk)
    modules = quantize_model(make_model(layout), "int8")
    with torch.no_grad():
        want = modules(tokens)  # the whole sequence at once, through the modules
    gap = (got - want).abs()
    assert gap.max() < 3e-2 and gap.mean() < 1e-3, (gap.max(), gap.mean())


def stack_qkv(model: GPT) -> GPT:
    """Every qkv projection as a GGUF import of Q4_K_M holds it: q and k in q4_k, v in q6_k."""
    from tformer.kernels import blocks

    for block in model.blocks:
        w, v = block.attn.qkv_proj.weight.detach(), block.attn.n_kv_head * block.attn.d_value
        parts = [("q4_k", blocks.quantize(w[:-v], "q4_k")),
                 ("q6_k", blocks.quantize(w[-v:], "q6_k"))]
        block.attn.qkv_proj = blocks.StackedLinear(parts, w.shape[1])
    return model


@native
@pytest.mark.parametrize("fmt", ["fp32", "int8", "q4_1", "q4_k_m", "stacked"])
def test_any_number_of_threads_gives_the_bits_of_one(fmt):
    # With several threads step.c runs every layer in one parallel region, each product cut
    # into pieces of W's rows (a stack's in each of its parts) and the attention into heads,
    # each piece on whichever thread takes it: the same kernel on the same data, so the
    # logits and the cache have one thread's bits, for one row or three.
    shape = LAYOUTS["llama, grouped-query"] | dict(d_model=256, d_ff=512, n_head=4)
    model = make_model(shape)
    model = quantize_model(stack_qkv(model) if fmt == "stacked" else model,
                           "q4_k_m" if fmt == "stacked" else fmt)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 3):
            tokens, is_real = prompts(rows, length=8)
            got = {}
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                logits, cache = decode(model, tokens, is_real, prefill=4)
                assert isinstance(cache.step, LMStep)
                got[n] = [logits, *(t[:, :, : c.length] for c in cache.self_attn
                                    for t in (c.k, c.v))]
            for n in (2, 3):
                assert all(torch.equal(a, b) for a, b in zip(got[n], got[1], strict=True))
    finally:
        torch.set_num_threads(threads)


@native
def test_greedy_generation_gives_the_modules_tokens():
    from tformer.decoding.lm import generate

    model = quantize_model(make_model(LAYOUTS["mistral, sliding window"]), "fp32")
    tokens, is_real = prompts(2, length=6)

    def greedy(m):
        return torch.stack(list(generate(m, tokens, is_real=is_real, max_new_tokens=30,
                                         temperature=0.0)), dim=1)

    with torch.no_grad():
        want = greedy(make_model(LAYOUTS["mistral, sliding window"]).double())
    # 30 new tokens after 6: past the context of 24, where generation slides its window
    assert torch.equal(greedy(model), want)


@native
def test_the_step_runs_only_where_it_computes_the_same(monkeypatch):
    model = quantize_model(make_model(LAYOUTS["llama, grouped-query"]), "fp32")
    cache = runner(model).make_cache(4)
    step = cache.step
    x = torch.zeros(4, 1, 48)
    assert step.serves(x, cache)
    assert step.serves(torch.zeros(4, 2, 48), cache)  # a few tokens each: 8 rows
    assert not step.serves(torch.zeros(4, 3, 48), cache)  # a prompt: the modules
    assert not step.serves(x.double(), cache)
    assert not step.serves(torch.zeros(3, 1, 48), cache)  # rows other than the cache's
    assert not step.serves(torch.zeros(9, 1, 48), runner(model).make_cache(9))  # past LM_F32_ROWS
    model.blocks[1].attn.recorded = []
    assert not step.serves(x, cache)
    model.blocks[1].attn.recorded = None
    model.train()
    assert not step.serves(x, cache)
    model.eval()
    monkeypatch.setattr(step_module, "MAX_POSITIONS", 0)  # longer than the kernel keeps
    assert not step.serves(x, cache)
    monkeypatch.undo()
    assert step.serves(x, cache)
    assert not step.serves(x.requires_grad_(), cache)  # gradients are torch's


def test_blocks_it_cannot_read_keep_the_modules():
    model = make_model(LAYOUTS["gpt2"])
    model.blocks[0].ff.activation = nn.Tanh()
    assert runner(model).make_cache(2).step is None
    assert runner(make_model(LAYOUTS["gpt2"]).double()).make_cache(2).step is None
    assert model.make_cache(2).step is None  # a model's own cache never carries one


@native
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("layout", ["gpt2", "llama, grouped-query"])
def test_block_steps_match_the_block_modules(fmt, layout):
    # Weights held as blocks (kernels/blocks.py): the step calls the modules' product, so
    # only norms, activations and attention round differently (and can move an activation
    # across a rounding step of its block now and then).
    from tformer.kernels import blocks
    from tformer.kernels.prepack import swap_linears

    shape = LAYOUTS[layout] | dict(d_model=64, d_ff=128)

    def model():
        make = blocks.quantizer(fmt)
        return swap_linears(make_model(shape), lambda name, linear: make(linear))

    quantized = model()
    assert isinstance(quantized.lm_head, blocks.BlockLinear)
    tokens, is_real = prompts(3)
    got, got_cache = decode(quantized, tokens, is_real, prefill=5)
    want, want_cache = decode(model(), tokens, is_real, prefill=5, step=False)
    assert isinstance(got_cache.step, LMStep) and want_cache.step is None
    gap = (got - want).abs()
    assert gap.max() < 3e-2 and gap.mean() < 1e-3, (gap.max(), gap.mean())
