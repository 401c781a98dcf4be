"""llama.cpp's K super-blocks and IQ4_XS (kernels/kquants.py, kquants.c): the layouts against
the gguf package's dequantizers, the products on every path against the super-block
arithmetic in float64 with the activations rounded to Q8_K as written out here, the
quantizers' quality, and the q4_k_m mix's rule."""

import ctypes

import numpy as np
import pytest
import torch
from torch import nn

from tformer.kernels import blocks, library
from tformer.kernels.formats import MIXES, more_bits, quantize_model

gguf = pytest.importorskip("gguf")
from gguf import quants as gguf_quants  # noqa: E402

K_FORMATS = [name for name, layout in blocks.LAYOUTS.items() if layout.values == 256]
PATHS = {"generic": blocks.ISA_GENERIC, "avx2": blocks.ISA_AVX2,
         "avxvnni": blocks.ISA_AVX_VNNI, "avx512": blocks.ISA_AVX512_VNNI}


def awkward_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of every size, an all-zero super-block, a lone outlier, constant and all-negative
    groups."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 2, n)[:, None]
    w[min(3, n - 1), :256] = 0.0
    w[0, 5] = 40.0
    w[n - 1, 32:64] = 0.25
    w[n - 2, 64:96] = -torch.rand(32, generator=g)
    return w


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_decoding_equals_gguf_s_dequantizer(fmt):
    raw = blocks.quantize(awkward_weight(12, 512), fmt)
    qtype = gguf.GGMLQuantizationType(blocks.GGML_TYPES[fmt])
    assert raw.shape == (12, 2 * blocks.LAYOUTS[fmt].size)
    assert np.array_equal(blocks.dequantize(raw, fmt).numpy(),
                          gguf_quants.dequantize(raw.numpy(), qtype))
    # and any bytes a file may hold, not only those the quantizer makes
    noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator()
                          .manual_seed(1))
    halves = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}[fmt]
    b = noise.view(12, 2, -1)
    for at in halves:  # finite fp16 scales
        b[..., at:at + 2] = torch.rand(12, 2, 1).half().view(torch.uint8)
    assert np.array_equal(blocks.dequantize(noise, fmt).numpy(),
                          gguf_quants.dequantize(noise.numpy(), qtype))


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_the_c_quantizer_writes_the_torch_one_s_bytes(fmt):
    if library.load() is None:
        pytest.skip("no C kernels here")
    w = awkward_weight(24, 512, seed=3)
    w[7, 256:] = 1e-20 * torch.randn(256)  # a super-block of tiny values
    w[9, :] = w[9, :].abs() + 1  # all above zero: the minimums are 0
    assert torch.equal(blocks.quantize(w, fmt), blocks.quantize(w, fmt, native=False))


def test_the_quality_of_each_format_in_order():
    w = torch.randn(64, 1024)
    err = {fmt: ((blocks.dequantize(blocks.quantize(w, fmt), fmt) - w).norm() / w.norm()).item()
           for fmt in [*K_FORMATS, "q4_0", "q5_0", "q8_0"]}
    # the searches for scales beat the 32-value formats of as many bits, and more bits help
    assert err["q6_k"] < err["q5_k"] < err["q4_k"] < 0.1
    assert err["q4_k"] < err["q4_0"] and err["q5_k"] < err["q5_0"]
    # iq4_xs's 16 non-linear levels beat q4_0's 16 even ones in fewer bits (4.25 against 4.5)
    assert err["iq4_xs"] < err["q4_0"] and err["iq4_xs"] < 0.1
    assert err["q8_0"] < err["q6_k"] < 0.03


def q8_k(x: torch.Tensor) -> np.ndarray:
    """x rounded as the K products round it, in float64: per 256 values d = max|x| / 127 in
    fp32, q = roundf(x * (1/d)) in fp32, halves away from zero; q * d."""
    m, k = x.shape
    xs = x.numpy().astype(np.float32).reshape(m, k // 256, 256)
    d = np.abs(xs).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = (xs * inv).astype(np.float32)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return (q * d.astype(np.float64)).reshape(m, k)


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


@pytest.mark.parametrize("path", list(PATHS), indirect=True)
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_products_match_the_super_block_arithmetic_in_float64(path, fmt):
    """The few-row product (no repacked weight) on every path: 1 to 8 rows of x (tiles of
    one to four rows, and two of them), 70 (more than a chunk of 64); 37 outputs (two
    threads' tiles of 16 and a tail not a multiple of the four rows a tile of W takes);
    three super-blocks a row."""
    n, k = 37, 768
    raw = blocks.quantize(awkward_weight(n, k, seed=2), fmt)
    qtype = gguf.GGMLQuantizationType(blocks.GGML_TYPES[fmt])
    w = gguf_quants.dequantize(raw.numpy(), qtype).astype(np.float64)
    bias = torch.randn(n)
    for m in (*range(1, 9), 70):
        x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
        x[0, 256:512] = 0.0
        x[-1, 7] = 30.0
        for b in (bias, None) if m in (1, 4, 7, 70) else (bias if m % 2 else None,):
            got = blocks.call(path, fmt, x, raw, n, k, b).double().numpy()
            xq = q8_k(x)
            want = xq @ w.T + (0 if b is None else b.double().numpy())
            scale = np.abs(xq) @ np.abs(w).T + 1
            assert (np.abs(got - want) <= 1e-5 * scale).all(), (fmt, m)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_every_path_gives_the_plain_c_results_bit_for_bit(fmt):
    """The few-row products read the file's bytes in registers, 32 or 64 values at a time,
    tiles of rows of x and W together; their integer sums are exact and their fp32
    operations the plain C product's, so the results are the same bits on every path,
    whatever the rows batched together (1 to 8, 70) or the threads."""
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    n, k = 37, 1280  # five super-blocks a row
    raw = blocks.quantize(awkward_weight(n, k, seed=4), fmt)
    x = torch.randn(70, k) * torch.logspace(-2, 2, 70)[:, None]
    x[3, 256:512] = 0.0
    bias = torch.randn(n)
    chosen, threads = lib.tformer_blocks_isa(-1), torch.get_num_threads()
    try:
        lib.tformer_blocks_isa(blocks.ISA_GENERIC)
        torch.set_num_threads(1)
        want = blocks.call(lib, fmt, x, raw, n, k, bias)
        for level in PATHS.values():
            if lib.tformer_blocks_isa(level) != level:
                continue
            for m in range(1, 9):
                torch.set_num_threads(1 + m % 2)
                assert torch.equal(blocks.call(lib, fmt, x[:m], raw, n, k, bias), want[:m]), \
                    (fmt, level, m)
            assert torch.equal(blocks.call(lib, fmt, x, raw, n, k, bias), want), (fmt, level)
    finally:
        lib.tformer_blocks_isa(chosen)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_a_row_s_result_does_not_depend_on_its_batch_or_the_threads(fmt):
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    n, k = 9, 512
    raw, x = blocks.quantize(awkward_weight(n, k), fmt), torch.randn(70, k)
    batch = blocks.call(lib, fmt, x, raw, n, k, None)
    alone = torch.cat([blocks.call(lib, fmt, x[i:i + 1], raw, n, k, None) for i in range(70)])
    assert torch.equal(batch, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(blocks.call(lib, fmt, x, raw, n, k, None), batch)
    finally:
        torch.set_num_threads(threads)


def plain_unrepack(packed: torch.Tensor, n: int, k: int) -> np.ndarray:
    """kquants.c's struct krepacked read back as its text writes it, into W (n x k) in
    float64: per group of eight rows and super-block, fp32 d[8], dmin[8], int16 sc[16][8][2]
    (the scale twice), int16 mn[8][8][2] (group g's minimum at [g / 2][o][g % 2]), then
    u[32][8][2][4], value 8c + 4h + b of row o at [c][o][h][b]; w = d sc u - dmin mn for each
    group of 16."""
    nb, groups = k // 256, (n + 7) // 8
    rec = packed.view(groups, nb, 2880).numpy()
    d = rec[..., :32].copy().view(np.float32).astype(np.float64)  # [group, sb, o]
    dmin = rec[..., 32:64].copy().view(np.float32).astype(np.float64)
    sc2 = rec[..., 64:576].copy().view(np.int16).reshape(groups, nb, 16, 8, 2)
    assert (sc2[..., 0] == sc2[..., 1]).all()
    sc = sc2[..., 0]
    mn = rec[..., 576:832].copy().view(np.int16).reshape(groups, nb, 8, 8, 2)
    mn = mn.transpose(0, 1, 3, 2, 4).reshape(groups, nb, 8, 16)  # [group, sb, o, g]
    u = rec[..., 832:].reshape(groups, nb, 32, 8, 2, 4).transpose(0, 3, 1, 2, 4, 5)
    u = u.reshape(groups, 8, nb, 16, 16).astype(np.float64)  # [group, o, sb, g, j]
    scale = (d[..., None] * sc.transpose(0, 1, 3, 2)).transpose(0, 2, 1, 3)  # [group, o, sb, g]
    low = (dmin[..., None] * mn).transpose(0, 2, 1, 3)
    w = u * scale[..., None] - low[..., None]
    return w.reshape(groups * 8, k)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_repacking_keeps_every_value_and_fills_the_last_group_with_zeros(fmt):
    lib = blocks._lib()
    if lib is None:
        pytest.skip("no C kernels here")
    n, k = 11, 512
    raw = blocks.quantize(awkward_weight(n, k, seed=3), fmt)
    qtype = gguf.GGMLQuantizationType(blocks.GGML_TYPES[fmt])
    want = gguf_quants.dequantize(raw.numpy(), qtype).astype(np.float64)
    w = plain_unrepack(blocks.repack(lib, fmt, raw, k), n, k)
    # d sc u - dmin mn in float64 against gguf's fp32 dequantization: fp32's rounding apart
    assert np.allclose(w[:n], want, rtol=1e-6, atol=1e-7)
    assert not w[n:].any()


@pytest.mark.parametrize("path", list(PATHS), indirect=True)
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_repacked_products_are_the_few_row_products_bit_for_bit(path, fmt):
    """Over repacked weights, on every path: the super-block arithmetic in float64 within
    fp32 rounding, and the few-row product's results exactly (the same integer sums, the
    same fp32 operations in the same order); 5, 7 and 70 rows (not multiples of the tiles of
    2 and 4, more than a chunk of 64), 11 outputs (not a multiple of the group of 8), threads 1
    and 2."""
    n, k = 11, 512
    raw = blocks.quantize(awkward_weight(n, k, seed=2), fmt)
    packed = blocks.repack(path, fmt, raw, k)
    qtype = gguf.GGMLQuantizationType(blocks.GGML_TYPES[fmt])
    w = gguf_quants.dequantize(raw.numpy(), qtype).astype(np.float64)
    bias = torch.randn(n)
    x = torch.randn(70, k) * torch.logspace(-2, 2, 70)[:, None]
    x[0, 256:512] = 0.0
    x[5, 7] = 30.0
    xq = q8_k(x)
    want, scale = xq @ w.T, np.abs(xq) @ np.abs(w).T + 1
    threads = torch.get_num_threads()
    try:
        for m in (5, 7, 70):
            for b in (bias, None):
                torch.set_num_threads(1)
                got = blocks.call(path, fmt, x[:m], raw, n, k, b, packed)
                exact = want[:m] + (0 if b is None else b.double().numpy())
                assert (np.abs(got.double().numpy() - exact) <= 1e-5 * scale[:m]).all()
                alone = torch.cat([blocks.call(path, fmt, x[i:i + 1], raw, n, k, b)
                                   for i in range(m)])
                assert torch.equal(got, alone), (fmt, m)
        torch.set_num_threads(2)
        assert torch.equal(blocks.call(path, fmt, x, raw, n, k, None, packed), got)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", list(PATHS), indirect=True)
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_the_largest_sums_a_super_block_can_hold_are_exact(path, fmt):
    """Every value at its kind's top (q4_k 15, q5_k 31, q6_k 63, iq4_xs 113, repacked as
    241), every scale and minimum at its largest (q6_k's +127 and -128), and x at +-127 in
    every place: the sums the repacked product keeps in 16 bits before scaling reach their
    bounds (8 * 31 * 127 and 4 * 63 * 127), iq4_xs's in 32 bits 8 * 241 * 127, and stay
    exact, over repacked W and the file's bytes alike."""
    n, k = 8, 512
    size = blocks.LAYOUTS[fmt].size
    raw = torch.full((n, k // 256, size), 0xFF, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    # d (and dmin): 1.0, where fp16's 0xFFFF is NaN
    at = {"q6_k": [208], "iq4_xs": [0]}.get(fmt, [0, 2])
    for a in at:
        raw[..., a:a + 2] = one
    if fmt == "q6_k":
        raw[::2, :, 192:208] = 0x80  # scale -128 in every other row
    raw = raw.reshape(n, -1)
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, 256:] = -1.0
    qtype = gguf.GGMLQuantizationType(blocks.GGML_TYPES[fmt])
    w = gguf_quants.dequantize(raw.numpy(), qtype).astype(np.float64)
    want = q8_k(x) @ w.T
    packed = blocks.repack(path, fmt, raw, k)
    few = blocks.call(path, fmt, x, raw, n, k, None)
    assert np.allclose(few.double().numpy(), want, rtol=1e-6, atol=0)
    for m in (5, 6, 7, 8):  # the kernels' last tile of x 1 to 4 rows
        rows = torch.arange(m) % 4
        got = blocks.call(path, fmt, x[rows], raw, n, k, None, packed)
        assert torch.equal(got, few[rows]), (fmt, m)


@pytest.mark.parametrize("path", list(PATHS), indirect=True)
def test_iq4_xs_s_largest_products_are_exact_on_every_path(path):
    """iq4_xs at its extremes: every value -127 at scale -32 (bytes 0), then every value 113
    at scale +31 (bytes 0xFF), x at +-127 in every place: the byte products taken as the
    values' sizes against x's signed bytes reach 2 * 127 * 127 a pair, and the results are
    the float64 arithmetic's and the plain C path's."""
    n, k = 8, 512
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, 256:] = -1.0
    lib, chosen = path, path.tformer_blocks_isa(-1)
    for fill in (0x00, 0xFF):
        raw = torch.full((n, k // 256, 136), fill, dtype=torch.uint8)
        raw[..., 0:2] = one
        raw = raw.reshape(n, -1)
        w = gguf_quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.IQ4_XS)
        assert np.abs(w).max() == (127 * 32 if fill == 0 else 113 * 31)
        got = blocks.call(lib, "iq4_xs", x, raw, n, k, None)
        want = q8_k(x) @ w.astype(np.float64).T
        assert np.allclose(got.double().numpy(), want, rtol=1e-6, atol=0), fill
        lib.tformer_blocks_isa(blocks.ISA_GENERIC)
        assert torch.equal(blocks.call(lib, "iq4_xs", x, raw, n, k, None), got)
        lib.tformer_blocks_isa(chosen)


def test_the_c_table_gives_each_kind_the_layout_s_geometry():
    lib = library.load()
    if lib is None:
        pytest.skip("no C kernels here")
    for fmt, layout in blocks.LAYOUTS.items():
        geometry = (ctypes.c_int32 * 3)()
        assert lib.tformer_kind_geometry(layout.kind, geometry) == 0
        assert list(geometry) == [layout.values, layout.size,
                                  {"q8_0": 1, "q8_k": 2}[layout.activation]], fmt
    assert lib.tformer_kind_geometry(99, (ctypes.c_int32 * 3)()) == -3


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_block_linear_native_and_fallback(fmt, monkeypatch):
    linear = nn.Linear(512, 24)
    layer = blocks.BlockLinear.from_linear(linear, fmt)
    x = torch.randn(2, 3, 512)
    with torch.no_grad():
        dense = torch.nn.functional.linear(x, layer.weight, linear.bias)
        assert torch.allclose(layer(x), dense, rtol=0.05, atol=0.05)
        monkeypatch.setattr(blocks, "_lib", lambda: None)
        assert torch.allclose(layer(x), dense, atol=1e-5)


def test_rows_not_whole_super_blocks_fall_back_as_llama_cpp_does():
    # SmolLM2's 576 inputs: q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0; 40 fits no block
    for fmt, fallback in blocks.FALLBACK.items():
        layer = blocks.quantizer(fmt)(nn.Linear(576, 8))
        assert layer.fmt == fallback
        assert blocks.quantizer(fmt)(nn.Linear(512, 8)).fmt == fmt
        assert type(blocks.quantizer(fmt)(nn.Linear(40, 8))) is nn.Linear


def test_more_bits_is_llama_cpp_s_rule():
    # use_more_bits(i, n): i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2
    assert [i for i in range(8) if more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(16) if more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(30) if more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23,
                                                          26, 27, 28, 29]


def test_q4_k_m_gives_the_output_and_half_the_v_and_down_layers_q6_k():
    from tformer.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, context=16, n_layer=8, n_head=2, d_model=256,
                          d_ff=256, tie_embeddings=False)).eval()
    held = blocks.formats_of(quantize_model(model, "q4_k_m"))
    finer = {0, 3, 6, 7}
    for i in range(8):
        want = "q6_k" if i in finer else "q4_k"
        assert held[f"blocks.{i}.attn.qkv_proj.weight"] == want
        assert held[f"blocks.{i}.ff.down.weight"] == want
        assert held[f"blocks.{i}.ff.up.weight"] == "q4_k"
        assert held[f"blocks.{i}.attn.out_proj.weight"] == "q4_k"
    assert held["lm_head.weight"] == "q6_k"
    q5 = MIXES["q5_k_m"]
    assert [q5.format_of(f"blocks.{i}.ff.down", 8) for i in (0, 1, 3)] == ["q6_k", "q5_k", "q6_k"]
    assert q5.format_of("lm_head", 8) == "q6_k" and q5.format_of("blocks.0.ff.up", 8) == "q5_k"


@pytest.mark.parametrize("fmt", ["q4_k_m", "q6_k", "iq4_xs"])
def test_a_language_model_decodes_with_k_weights(fmt):
    from tformer.decoding.lm import generate
    from tformer.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, context=40, n_layer=2, n_head=4, d_model=256,
                          d_ff=512)).eval()
    quantized = quantize_model(model, fmt)
    tokens = torch.randint(0, 61, (3, 20))
    with torch.no_grad():
        full, got = model(tokens), quantized(tokens)
    assert (full - got).abs().max() < {"q4_k_m": 0.5, "q6_k": 0.2, "iq4_xs": 0.5}[fmt] * full.std()
    prompt = torch.randint(0, 61, (2, 5))
    run = lambda cache: torch.stack(  # noqa: E731
        list(generate(quantized, prompt, max_new_tokens=12, temperature=0.0, use_cache=cache)))
    assert torch.equal(run(True), run(False))
