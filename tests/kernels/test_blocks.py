"""Block-quantized weights (kernels/blocks.py, blocks.c): the layouts byte for byte against
the gguf package's quantizers, and the products on every path against the block arithmetic
written out in float64."""

import copy
import struct

import numpy as np
import pytest
import torch
from torch import nn

from tformer.errors import TformerError
from tformer.kernels import blocks, library

gguf = pytest.importorskip("gguf")
from gguf import quants as gguf_quants  # noqa: E402

GGML = {name: gguf.GGMLQuantizationType(t) for name, t in blocks.GGML_TYPES.items()}
FORMATS = [name for name, layout in blocks.LAYOUTS.items() if layout.values == 32]
"""The 32-value formats (the K ones: test_kquants.py)."""
PATHS = {"generic": blocks.ISA_GENERIC, "avx2": blocks.ISA_AVX2,
         "avxvnni": blocks.ISA_AVX_VNNI, "avx512": blocks.ISA_AVX512_VNNI}


def awkward_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of every size, an all-zero block, a lone outlier, a constant block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 2, n)[:, None]
    w[min(3, n - 1), :32] = 0.0
    w[0, 5] = 40.0
    w[n - 1, 32:64] = 0.25
    return w


def plain_dequantize(raw: bytes, fmt: str, k: int) -> list[float]:
    """One row's blocks decoded a byte at a time, in float64, from the layouts' text."""
    size, out = blocks.BLOCK_BYTES[fmt], []
    for at in range(0, k // 32 * size, size):
        blk = raw[at:at + size]
        d = struct.unpack("<e", blk[:2])[0]
        if fmt == "q8_0":
            out += [d * q for q in struct.unpack("32b", blk[2:])]
            continue
        qs = blk[size - 16:]
        q = [b & 15 for b in qs] + [b >> 4 for b in qs]
        if fmt in ("q5_0", "q5_1"):  # qh: the 4 bytes before qs, bit j value j's fifth
            qh = struct.unpack("<I", blk[size - 20:size - 16])[0]
            q = [v + 16 * (qh >> j & 1) for j, v in enumerate(q)]
        if fmt in ("q4_0", "q5_0"):
            out += [d * (v - (8 if fmt == "q4_0" else 16)) for v in q]
        else:
            m = struct.unpack("<e", blk[2:4])[0]
            out += [d * v + m for v in q]
    return out


def plain_product(x: torch.Tensor, raw: torch.Tensor, fmt: str, bias, absolute: bool = False
                  ) -> torch.Tensor:
    """y = x W^T + b in float64 with x rounded to blocks of 32 as the kernels round it
    (d = max|x| / 127 in fp32; q = roundf(x * (1/d)) in fp32, halves away from zero).
    absolute: the sums of the terms' sizes instead, |x| |W|^T."""
    m, k = x.shape
    xs = x.numpy().astype(np.float32).reshape(m, k // 32, 32)
    d = np.abs(xs).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = (xs * inv).astype(np.float32)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)  # exact for |v| <= 127.5 in float64
    xq = (q * d.astype(np.float64)).reshape(m, k)
    w = np.array([plain_dequantize(bytes(row.numpy()), fmt, k) for row in raw])
    y = np.abs(xq) @ np.abs(w).T if absolute else xq @ w.T
    return torch.from_numpy(y if bias is None else y + bias.double().numpy())


@pytest.mark.parametrize("native", [True, False], ids=["c", "torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_writes_gguf_s_bytes(fmt, native):
    w = awkward_weight(40, 256)
    w[5, 64:96] = -3.0  # a constant block below zero
    want = gguf_quants.quantize(w.numpy(), GGML[fmt])
    assert np.array_equal(blocks.quantize(w, fmt, native=native).numpy(), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_reads_the_layout(fmt):
    raw = blocks.quantize(awkward_weight(9, 96), fmt)
    want = torch.tensor([plain_dequantize(bytes(r.numpy()), fmt, 96) for r in raw])
    assert torch.equal(blocks.dequantize(raw, fmt).double(), want)
    assert np.array_equal(blocks.dequantize(raw, fmt).numpy(),
                          gguf_quants.dequantize(raw.numpy(), GGML[fmt]))


def test_roundf_rounds_halves_away_from_zero():
    v = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5, 0.49999997, 126.5, -3.2])
    assert blocks.roundf(v).tolist() == [1, -1, 2, 3, -3, 0, 127, -3]


@pytest.fixture
def path(request):
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    chosen = lib.tformer_blocks_isa(-1)
    if lib.tformer_blocks_isa(PATHS[request.param]) != PATHS[request.param]:
        lib.tformer_blocks_isa(chosen)
        pytest.skip(f"this CPU lacks {request.param}")
    yield lib
    lib.tformer_blocks_isa(chosen)


def file_weight(fmt: str, n: int, k: int) -> torch.Tensor:
    """Blocks as a file may hold them: q8_0's includes -128, which no quantizer here makes."""
    raw = blocks.quantize(awkward_weight(n, k, seed=2), fmt)
    if fmt == "q8_0":
        raw.view(n, -1, 34)[1, 0, 2:] = 128  # int8 -128 throughout one block
    return raw


@pytest.mark.parametrize("path", list(PATHS), indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
def test_products_match_the_block_arithmetic_in_float64(path, fmt):
    n, k = 21, 160
    raw = file_weight(fmt, n, k)
    bias = torch.randn(n)
    for m in (1, 2, 3, 4, 5, 9, 70):  # few-row tiles, many-row tiles, several chunks of x
        x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
        x[0, 32:64] = 0.0
        x[-1, 7] = 30.0
        for b in (bias, None):
            got = blocks.call(path, fmt, x, raw, n, k, b).double()
            want = plain_product(x, raw, fmt, b)
            scale = plain_product(x, raw, fmt, None, absolute=True) + 1
            # fp32 sums of the blocks' exact integer sums: within fp32 rounding of the terms
            assert ((got - want).abs() <= 1e-5 * scale).all(), (fmt, m)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_s_result_does_not_depend_on_its_batch_or_the_threads(fmt):
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    n, k = 37, 576
    raw, x = file_weight(fmt, n, k), torch.randn(70, k)
    never = blocks.NEVER  # the product over the file's blocks alone, however many rows
    batch = blocks.call(lib, fmt, x, raw, n, k, None, repack_rows=never)
    alone = torch.cat([blocks.call(lib, fmt, x[i:i + 1], raw, n, k, None) for i in range(70)])
    assert torch.equal(batch, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(blocks.call(lib, fmt, x, raw, n, k, None, repack_rows=never), batch)
        assert torch.equal(blocks.call(lib, fmt, x[:3], raw, n, k, None), batch[:3])
    finally:
        torch.set_num_threads(threads)


def plain_unrepack(packed: torch.Tensor, fmt: str, n: int, k: int) -> torch.Tensor:
    """blocks.c's struct repacked read back as written in its text, into W (n x k) in
    float64: per group of eight rows and block, fp32 d[8], m[8] (q8_0: int32 start[8],
    -128 times the sum of the block's values, checked here), then u[c][o][h][b], value
    8c + 4h + b of row o, a byte (q8_0's signed; the others less their offset)."""
    nb, groups = k // 32, (n + 7) // 8
    rec = packed.view(groups, nb, 320)
    d = rec[..., :32].contiguous().view(torch.float32).double()  # [groups, nb, 8]
    m = rec[..., 32:64].contiguous().view(torch.float32).double()
    u = rec[..., 64:].reshape(groups, nb, 4, 8, 2, 4).transpose(3, 4)  # [group, block, c, h, o, b]
    u = u.reshape(groups, nb, 8, 8, 4)  # [group, block, t = 2c + h, o, b]
    v = (u.view(torch.int8) if fmt == "q8_0" else u).double()
    if fmt == "q8_0":
        start = rec[..., 32:64].contiguous().view(torch.int32)
        assert torch.equal(start.double(), -128 * v.sum(dim=(2, 4)))
        m = torch.zeros_like(m)
    v = v - {"q4_0": 8, "q5_0": 16}.get(fmt, 0)
    values = v.permute(0, 3, 1, 2, 4).reshape(groups, 8, nb, 32)  # [group, o, block, j]
    w = values * d.permute(0, 2, 1)[..., None] + m.permute(0, 2, 1)[..., None]
    return w.reshape(groups * 8, k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_repacking_keeps_every_value_and_fills_the_last_group_with_zeros(fmt):
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    n, k = 13, 96
    raw = file_weight(fmt, n, k)
    w = plain_unrepack(blocks.repack(lib, fmt, raw, k), fmt, n, k)
    want = torch.tensor([plain_dequantize(bytes(r.numpy()), fmt, k) for r in raw])
    assert torch.equal(w[:n], want)
    assert not w[n:].any()


def few_rows_bound(x: torch.Tensor, raw: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """How far an fp32 product of the blocks' exact integer sums can be from the float64
    value: each of the k / 32 blocks' terms rounded at most three times (d_w d_x, times the
    sum, into the sum), the few-row paths' eight lanes added in three more steps, q4_1's and
    q5_1's minimums and the bias in two: (k / 32 + 8) units of fp32 rounding (2^-24) of the
    terms' sizes, with 1 for the bias. The sizes are |x| |d q|^T and |x| |m|^T apart where
    the format has a minimum m: d q + m may cancel, the kernels' separate sums do not."""
    if fmt not in ("q4_1", "q5_1"):
        sizes = plain_product(x, raw, fmt, None, absolute=True)
    else:
        by_block = raw.view(raw.shape[0], -1, blocks.BLOCK_BYTES[fmt])
        no_min, no_d = raw.clone(), raw.clone()
        no_min.view_as(by_block)[..., 2:4] = 0
        no_d.view_as(by_block)[..., 0:2] = 0
        sizes = (plain_product(x, no_min, fmt, None, absolute=True)
                 + plain_product(x, no_d, fmt, None, absolute=True))
    return (k // 32 + 8) * 2.0**-24 * (sizes + 1)


@pytest.mark.parametrize("path", list(PATHS), indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
def test_repacked_products_are_the_plain_c_products_bit_for_bit(path, fmt):
    """Over repacked weights, on every path: the block arithmetic in float64 within fp32
    rounding, and the plain C product over the file's blocks exactly (the same integer sums,
    the same fp32 operations in the same order); row counts not a multiple of the tile (4)
    nor of the chunk of x (64), outputs not a multiple of the group (8), threads 1 and 2."""
    n, k = 21, 160
    raw = file_weight(fmt, n, k)
    packed = blocks.repack(path, fmt, raw, k)
    bias = torch.randn(n)
    chosen = path.tformer_blocks_isa(-1)
    threads = torch.get_num_threads()
    rows = torch.randn(70, k) * torch.logspace(-2, 2, 70)[:, None]
    rows[0, 32:64] = 0.0
    rows[5, 7] = 30.0
    exact, bound = plain_product(rows, raw, fmt, None), few_rows_bound(rows, raw, fmt, k)
    try:
        for m in (5, 7, 70):
            x = rows[:m]
            for b in (bias, None):
                torch.set_num_threads(1)
                got = blocks.call(path, fmt, x, raw, n, k, b, packed)
                want = exact[:m] + (0 if b is None else b.double())
                assert ((got.double() - want).abs() <= bound[:m]).all()
                if m == 70 and b is None:
                    torch.set_num_threads(2)
                    assert torch.equal(blocks.call(path, fmt, x, raw, n, k, b, packed), got)
                path.tformer_blocks_isa(blocks.ISA_GENERIC)
                plain = blocks.call(path, fmt, x, raw, n, k, b, repack_rows=blocks.NEVER)
                path.tformer_blocks_isa(chosen)
                assert torch.equal(got, plain), (fmt, m)
    finally:
        torch.set_num_threads(threads)
        path.tformer_blocks_isa(chosen)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_layer_s_row_is_the_same_in_any_batch_of_five_rows_or_more(fmt):
    """A BlockLinear that keeps its weights repacked sends REPACK_MIN_ROWS rows and more
    through them: a row's result is then the same in any such batch, whatever the threads.
    Alone (the few-row product over the file's blocks, whose fp32 sums run in eight lanes on
    the SIMD paths) it may differ in the last bits: by at most both products' fp32
    rounding."""
    if blocks._lib() is None:
        pytest.skip("no C kernels here")
    n, k = 37, 576
    raw = file_weight(fmt, n, k)
    layer = blocks.BlockLinear(raw, fmt, k, torch.randn(n))
    layer.keep_repacked = True
    x = torch.randn(70, k)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            batch = layer(x)
            fives = torch.cat([layer(x[i:i + 5]) for i in range(0, 70, 5)])
            torch.set_num_threads(2)
            assert torch.equal(layer(x), batch)
            alone = torch.cat([layer(x[i:i + 1]) for i in range(70)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fives, batch)
    bound = 2 * few_rows_bound(x, raw, fmt, k)
    assert ((alone.double() - batch.double()).abs() <= bound).all()
    # the repacked copy is the layer's own: the checkpoint holds the file's blocks alone
    assert set(layer.state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_layer_without_a_repacked_copy_repacks_many_rows_for_the_call(fmt):
    """By default a layer keeps no repacked copy: from REPACK_CALL_ROWS rows kinds.c repacks
    W for the call, a slice of rows at a time, and the product is the kept copy's bit for
    bit (slices of 8 and of 16 rows here, the last one partial); fewer rows read the file's
    blocks alone. Nothing is left behind on the layer."""
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    assert lib.tformer_repack_call_rows() == blocks.REPACK_CALL_ROWS
    n, k = 37, 512
    raw, bias = file_weight(fmt, n, k), torch.randn(n)
    layer = blocks.BlockLinear(raw, fmt, k, bias)
    assert not layer.keep_repacked  # (TFORMER_KEEP_REPACKED unset)
    x = torch.randn(blocks.REPACK_CALL_ROWS + 3, k)
    kept = blocks.call(lib, fmt, x, raw, n, k, bias, blocks.repack(lib, fmt, raw, k))
    group = lib.tformer_repacked_size(blocks.KINDS[fmt], 8, k)
    whole = lib.tformer_repack_slice_bytes(0)
    try:
        with torch.no_grad():
            assert torch.equal(layer(x), kept)
            for groups in (1, 2):
                lib.tformer_repack_slice_bytes(groups * group)
                assert torch.equal(layer(x), kept), groups
    finally:
        lib.tformer_repack_slice_bytes(whole)
    few = x[:blocks.REPACK_CALL_ROWS - 1]
    with torch.no_grad():
        plain = blocks.call(lib, fmt, few, raw, n, k, bias, repack_rows=blocks.NEVER)
        assert torch.equal(layer(few), plain)
    assert layer.__dict__["_repacked"] is None


def test_a_layer_repacks_its_blocks_anew_when_a_checkpoint_loads():
    if blocks._lib() is None:
        pytest.skip("no C kernels here")
    first, second = nn.Linear(64, 12), nn.Linear(64, 12)
    layer = blocks.BlockLinear.from_linear(first, "q4_1")
    layer.keep_repacked = True
    x = torch.randn(9, 64)
    with torch.no_grad():
        layer(x)  # repacks the first weights
        layer.load_state_dict(blocks.BlockLinear.from_linear(second, "q4_1").state_dict())
        got = layer(x)
        fresh = blocks.BlockLinear.from_linear(second, "q4_1")
        fresh.keep_repacked = True
        want = fresh(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_linear_native_and_fallback(fmt, monkeypatch):
    linear = nn.Linear(64, 24)
    layer = blocks.BlockLinear.from_linear(linear, fmt)
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        dense = torch.nn.functional.linear(x, layer.weight, linear.bias)
        y = layer(x)
        assert y.shape == (2, 3, 24)
        # The rounded activations cost a little; the weights are the same.
        assert torch.allclose(y, dense, rtol=0.05, atol=0.05)
        monkeypatch.setattr(blocks, "_lib", lambda: None)
        assert torch.allclose(layer(x), dense, atol=1e-6)
        assert torch.allclose(layer(x.double()), dense.double(), atol=1e-5)
    assert torch.equal(layer.state_dict()["weight"], blocks.quantize(linear.weight, fmt))
    assert fmt in repr(layer)


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_rows_give_no_rows(fmt):
    layer = blocks.BlockLinear.from_linear(nn.Linear(64, 8), fmt)
    with torch.no_grad():
        assert layer(torch.zeros(0, 64)).shape == (0, 8)
        assert layer(torch.zeros(2, 0, 64)).shape == (2, 0, 8)


def test_the_quality_of_each_format_in_order():
    # Finer formats reproduce a weight more closely: q8_0 within 1%, the 4-bit ones ~10%.
    w = torch.randn(64, 512)
    err = {fmt: ((blocks.dequantize(blocks.quantize(w, fmt), fmt) - w).norm() / w.norm()).item()
           for fmt in FORMATS}
    assert err["q8_0"] < 0.01 < err["q5_1"] < err["q5_0"] < err["q4_1"] < err["q4_0"] < 0.15


def test_bad_shapes_are_one_line_errors():
    with pytest.raises(TformerError, match="K a multiple of 32"):
        blocks.quantize(torch.randn(4, 40), "q4_0")
    with pytest.raises(TformerError, match="unknown block format 'q3'"):
        blocks.quantize(torch.randn(4, 64), "q3")
    with pytest.raises(TformerError, match=r"uint8 \(4, 36\)"):
        blocks.BlockLinear(torch.zeros(4, 30, dtype=torch.uint8), "q4_0", 64)


def test_every_path_passes_the_load_time_check():
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    chosen = lib.tformer_blocks_isa(-1)
    try:
        for level in PATHS.values():
            if lib.tformer_blocks_isa(level) == level:
                assert blocks.computes_right(lib)
    finally:
        lib.tformer_blocks_isa(chosen)
    names = {value: name for name, value in library.ISA_LEVELS.items()}
    assert chosen == blocks.ISA_FOR[names[lib.tformer_isa(-1)]]


# --- the three families decode with block weights -------------------------------------------


def through_format(model: nn.Module, fmt: str) -> nn.Module:
    from tformer.kernels.formats import quantize_model

    quantized = quantize_model(model, fmt)
    assert any(isinstance(m, blocks.BlockLinear) for m in quantized.modules())
    return quantized


def test_the_4_bit_formats_keep_the_output_layer_in_q8_0():
    from tformer.models.gpt import GPT, GPTConfig
    from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

    gpt = GPT(GPTConfig(vocab_size=61, context=8, n_layer=1, n_head=2, d_model=64))
    s2s = Seq2Seq(Seq2SeqConfig(vocab_size=23, max_len=8, n_layer=1, n_head=2, d_model=64,
                                d_ff=64))
    for fmt, output in (("q4_0", "q8_0"), ("q4_1", "q8_0"), ("q8_0", "q8_0"), ("q5_0", "q8_0")):
        held = blocks.formats_of(through_format(gpt, fmt))
        # the tied table: a lookup in the output layer's blocks, one copy of them
        assert held.pop("lm_head.weight") == held.pop("embed.weight") == output
        assert set(held.values()) == {fmt}
        held = blocks.formats_of(through_format(s2s, fmt))
        assert held.pop("out_proj.weight") == output and set(held.values()) == {fmt}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_language_model_decodes_with_block_weights(fmt):
    from tformer.decoding.lm import generate
    from tformer.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, context=40, n_layer=2, n_head=4, d_model=64)).eval()
    quantized = through_format(model, fmt)
    tokens = torch.randint(0, 61, (3, 20))
    with torch.no_grad():
        full, got = model(tokens), quantized(tokens)
    # 4 bits a weight cost more than 8 (random weights: no outliers for blocks to absorb)
    bound = {"q8_0": 0.05, "q4_0": 0.5, "q4_1": 0.5, "q5_0": 0.3, "q5_1": 0.3}[fmt]
    assert (full - got).abs().max() < bound * full.std()
    prompt = torch.randint(0, 61, (2, 5))
    run = lambda cache: torch.stack(  # noqa: E731
        list(generate(quantized, prompt, max_new_tokens=20, temperature=0.0, use_cache=cache)))
    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_translation_model_decodes_with_block_weights(fmt):
    from tformer.decoding.beam import greedy_search
    from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=23, max_len=40, n_layer=2, n_head=2, d_model=64,
                                  d_ff=64, dropout=0.0)).eval()
    quantized = through_format(model, fmt)
    src = torch.randint(3, 23, (4, 9))
    real = torch.ones_like(src, dtype=torch.bool)
    special = dict(bos_id=1, eos_id=2, pad_id=0)
    cached = greedy_search(quantized, src, real, **special)
    uncached = greedy_search(quantized, src, real, use_cache=False, **special)
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    # What "cached equals uncached" can mean once activations are rounded to 8-bit blocks:
    # the two passes compute attention over different shapes, so their activations differ
    # in the last bits (by how much depends on the CPU's kernels), and any of them may then
    # round to the neighbouring 8-bit step. Such flips move a log-probability by at most
    # the order of rounding every activation, which the same weights with unrounded
    # activations (the blocks dequantized to fp32) measure on this model and these inputs.
    # A cache that feeds a step the wrong keys moves it by far more.
    unrounded = copy.deepcopy(quantized)
    blocks.dequantize_model(unrounded)
    exact = greedy_search(unrounded, src, real, use_cache=False, **special)
    assert [h.tokens for h in exact] == [h.tokens for h in uncached]
    rounding = max(abs(a.logprob - b.logprob) for a, b in zip(uncached, exact, strict=True))
    assert [h.logprob for h in cached] == pytest.approx([h.logprob for h in uncached],
                                                        abs=rounding + 1e-4)
    # With the rounding taken out, caching changes nothing but float summation order.
    assert [h.logprob for h in greedy_search(unrounded, src, real, **special)] == \
        pytest.approx([h.logprob for h in exact], abs=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_transformer_xl_evaluates_with_block_weights(fmt):
    import torch.nn.functional as F

    from tformer.models.transformer_xl import Memory, TransformerXL, TransformerXLConfig

    torch.manual_seed(0)
    model = TransformerXL(TransformerXLConfig(vocab_size=23, context=4, mem_len=8, n_layer=2,
                                              n_head=2, d_model=32)).eval()
    tokens = torch.randint(0, 23, (2, 13))

    def loss(m):
        memory = Memory(m.cfg.mem_len)
        with torch.no_grad():
            return sum(F.cross_entropy(m(tokens[:, i:i + 4], memory=memory).flatten(0, 1),
                                       tokens[:, i + 1:i + 5].flatten()).item()
                       for i in range(0, 12, 4))

    assert loss(through_format(model, fmt)) == pytest.approx(loss(model), rel=0.05)


def test_keeping_repacked_copies_skips_the_k_formats():
    """keep_repacked gives a copy to the 32-value formats' layers and to none of the K
    formats' (pays_to_keep), in a stack of parts as in a layer of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(
        blocks.BlockLinear(blocks.quantize(torch.randn(8, 256), "q4_1"), "q4_1", 256),
        blocks.BlockLinear(blocks.quantize(torch.randn(8, 256), "q4_k"), "q4_k", 256),
        blocks.StackedLinear([("q4_k", blocks.quantize(torch.randn(8, 256), "q4_k")),
                              ("q8_0", blocks.quantize(torch.randn(8, 256), "q8_0"))], 256))
    blocks.keep_repacked(model)
    assert [model[0].keep_repacked, model[1].keep_repacked] == [True, False]
    assert [part.keep_repacked for part in model[2].parts] == [False, True]
    blocks.keep_repacked(model, False)
    assert not any([model[0].keep_repacked, model[1].keep_repacked,
                    *(part.keep_repacked for part in model[2].parts)])
