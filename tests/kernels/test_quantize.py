import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.decoding.lm import generate
from tformer.kernels import int8 as kint8
from tformer.kernels import int8_packed, library, rounding
from tformer.kernels.formats import quantize_model
from tformer.kernels.quantize import FrozenInt8Linear, Int8Linear
from tformer.kernels.rounding import quantize_rows
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.transformer_xl import Memory, TransformerXL, TransformerXLConfig

BUILT = library.load() is not None


@pytest.fixture
def model() -> GPT:
    return GPT(GPTConfig(vocab_size=61, context=24, n_layer=2, n_head=4, d_model=64)).eval()


@pytest.fixture
def without_kernel(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_NATIVE", "0")


def test_int8_logits_stay_close_and_the_original_is_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    int8 = quantize_model(model, "int8")
    tokens = torch.randint(0, 61, (3, 20))
    full, quantized = model(tokens), int8(tokens)
    assert not torch.equal(full, quantized), "the weights really are int8"
    # Int8 weights and activations, one scale per row: errors well below the logits' spread.
    assert (full - quantized).abs().max() < 0.2 * full.std()
    assert full.argmax(-1).eq(quantized.argmax(-1)).float().mean() > 0.9
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_every_linear_layer_becomes_int8(model):
    int8 = quantize_model(model, "int8")
    linears = [m for m in int8.modules() if isinstance(m, (nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert int8.lm_head.qweight.dtype == torch.int8
    # The bias is shared, not copied.
    assert int8.blocks[0].attn.qkv_proj.bias is model.blocks[0].attn.qkv_proj.bias


def test_rows_are_rounded_to_int8_with_one_scale_each():
    x = torch.randn(5, 40) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None]
    x[3] = 0.0
    xq, scale = quantize_rows(x)
    assert xq.dtype == torch.int8 and scale.shape == (5,)
    assert xq[[0, 1, 2, 4]].abs().amax(1).eq(127).all()  # each row's largest maps to 127
    assert xq[3].eq(0).all() and scale[3] == 1.0  # an all-zero row
    # Rounding to the nearest level moves a value by at most half a level.
    assert ((xq.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("shape", [(1, 40), (3, 40), (2, 3, 40), (37, 40)])
def test_an_int8_linear_computes_the_product_of_its_rounded_inputs_and_weights(shape, isa):
    linear = nn.Linear(40, 27)
    int8 = Int8Linear(linear)
    error = (int8.weight - linear.weight).abs()
    assert (error <= int8.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(*shape)
    with torch.no_grad():
        got = int8(x)
    assert got.shape == (*shape[:-1], 27)
    xq, xscale = quantize_rows(x.reshape(-1, 40))
    rounded = (xq.double() * xscale.double()[:, None]).view(shape)
    want = F.linear(rounded, int8.weight.double(), linear.bias.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [16, 40, 300])
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(k, isa):
    # One row, a decoding step's few (the few-row kernel) and many (the packed product, or
    # torch's) give the same bits: batched and one-at-a-time decoding agree exactly.
    int8 = Int8Linear(nn.Linear(k, 131))
    x = torch.randn(40, k)
    with torch.no_grad():
        alone = torch.cat([int8(x[i : i + 1]) for i in range(40)])
        for rows in (2, 3, 4, 5, kint8.INT8_MAX_ROWS, kint8.INT8_MAX_ROWS + 1, 40):
            assert torch.equal(int8(x[:rows]), alone[:rows]), rows
        assert torch.equal(int8(x.flip(0)), alone.flip(0))


def exact_product(xq, xscale, q, wscale, bias):
    """int8_reference's numbers by another route: the integer sums in int64 (exact by
    construction), then the same fp32 operations."""
    sums = (xq.long()[:, None, :] * q.long()[None, :, :]).sum(-1)
    y = sums.float() * (xscale[:, None] * wscale)
    return y if bias is None else y + bias


# 2100: four rows widened to 16 bits outgrow the kernel's stack buffer and are allocated.
@pytest.mark.parametrize("k", [37, 64, 512, 1000, 2100])
def test_the_few_row_products_are_exact_on_every_instruction_set(k, kernel_isa, avx2_method):
    lib = library.load()
    q = torch.randint(-127, 128, (203, k), dtype=torch.int8)  # 203: a remainder of W's rows
    q[0], q[1], q[2, ::2] = 127, -127, -127  # pairs of products as large as int8 makes them
    wscale, bias = torch.rand(203), torch.randn(203)
    for rows in range(1, 10):
        # The extremes too: sums of products as large as int8 makes them, of both signs.
        xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        xq[0], xscale = 127, torch.rand(rows)
        if rows > 1:
            xq[1] = -127
        want = exact_product(xq, xscale, q, wscale, bias)
        assert torch.equal(kint8._call_int8(lib, xq, xscale, q, wscale, bias), want), rows
        assert torch.equal(rounding.int8_reference(xq, xscale, q, wscale, bias), want), rows


@pytest.mark.parametrize("n, k", [(45, 37), (203, 64), (64, 1000), (33, 4), (17, 3)])
def test_the_packed_product_gives_the_exact_products_bits(n, k, kernel_isa, avx2_method):
    # The product over packed weights (AVX-512 VNNI's, or AVX2's of 16-bit or of 8-bit
    # weights) against exact integer sums: part panels (n not a multiple of 32 or 16), k
    # not a multiple of 4 or 2, blocks of rows and remainders, the largest products int8
    # makes, with a bias and without.
    lib = library.load()
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    q[0], q[1] = -127, 127
    wscale, bias = torch.rand(n), torch.randn(n)
    packed = kint8.pack_int8(q)
    assert packed.layout == (
        int8_packed.LAYOUT_VNNI if kernel_isa == "avx512" else
        int8_packed.LAYOUT_AVX2_BYTES if kernel_isa == "avxvnni" or avx2_method == kint8.AVX2_SIGN
        else int8_packed.LAYOUT_AVX2)
    torch.testing.assert_close(packed.row_sums, q.sum(dim=1, dtype=torch.int32))
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64):
        xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        xq[0], xscale = 127, torch.rand(rows)
        if rows > 1:
            xq[1] = -127  # against q[0]: the largest positive products, 127 * 127 a term
        for b in (bias, None):
            got = int8_packed.call_gemm_int8(lib, xq, xscale, packed, wscale, b)
            assert torch.equal(got, exact_product(xq, xscale, q, wscale, b)), rows
        # From fp32 rows, rounded by the kernel in the same call (what linear_int8 runs).
        x = torch.randn(rows, k) * 3
        want = exact_product(*rounding.torch_quantize_rows(x), q, wscale, bias)
        assert torch.equal(kint8.linear_int8(x, q, wscale, bias, packed), want), rows


def test_int8_linear_gives_the_same_bits_with_and_without_packed_weights(kernel_isa):
    int8 = Int8Linear(nn.Linear(96, 70))
    x = torch.randn(20, 96)
    with torch.no_grad():
        packed = int8(x)
        int8.packed = None  # the few-row kernel, and torch._int_mm with VNNI, instead
        assert torch.equal(int8(x), packed)


def instruction_sets(monkeypatch):
    """Each instruction set this CPU runs, with the kernels loaded for it in turn."""
    for name in library.ISAS:
        monkeypatch.setenv("TFORMER_ISA", name)
        library.load.cache_clear()
        if kint8.isa() == name:
            yield name


def test_every_instruction_set_gives_the_same_bits(monkeypatch, reload_kernel):
    # The same layer and rows under each instruction set this CPU runs, from one row to
    # many: AVX-512 VNNI, AVX-VNNI, AVX2 and torch agree bit for bit.
    linear = nn.Linear(70, 45)
    x = torch.randn(33, 70)
    results = {}
    for name in instruction_sets(monkeypatch):
        int8 = Int8Linear(linear)
        with torch.no_grad():
            results[name] = [int8(x[:rows]) for rows in (1, 3, 8, 33)]
    assert "torch" in results and ("avx2" in results or not BUILT)
    first = next(iter(results.values()))
    for name, got in results.items():
        assert all(map(torch.equal, got, first)), name


def test_int8_rounding_and_products_get_the_same_bits_without_the_kernel(
    monkeypatch, reload_kernel
):
    int8 = Int8Linear(nn.Linear(40, 27))
    x = torch.randn(3, 40) * torch.tensor([1e-4, 1.0, 1e4])[:, None]
    with torch.no_grad():
        with_kernel, rounded = int8(x), quantize_rows(x)
        monkeypatch.setenv("TFORMER_NATIVE", "0")
        library.load.cache_clear()
        assert library.load() is None
        assert torch.equal(int8(x), with_kernel)
        assert all(map(torch.equal, quantize_rows(x), rounded))


def test_the_int8_product_refuses_what_it_cannot_read():
    q, scale = torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8)
    x = torch.randn(2, 16)
    for args in [(x.double(), q, scale, None), (x, q.float(), scale, None),
                 (x, q[:, :8], scale, None), (x, q.t(), scale, None),
                 (x, q, scale.double(), None), (x, q, scale, torch.rand(7))]:
        with pytest.raises(ValueError, match="linear_int8 takes"):
            kint8.linear_int8(*args)


def test_an_all_zero_row_stays_zero():
    linear = nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        linear.weight[2] = 0.0
    int8 = Int8Linear(linear)
    assert int8.qweight[2].eq(0).all() and torch.isfinite(int8.scale).all()
    with torch.no_grad():
        assert int8(torch.randn(1, 16))[0, 2] == 0.0


def test_int8_cached_generation_equals_uncached(model):
    int8 = quantize_model(model, "int8")
    prompt = torch.randint(0, 61, (2, 5))
    run = lambda cache: torch.stack(  # noqa: E731
        list(generate(int8, prompt, max_new_tokens=30, temperature=0.0, use_cache=cache))
    )
    assert torch.equal(run(True), run(False))


def transformer_xl_loss(model, tokens):
    memory = Memory(model.cfg.mem_len)
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(tokens[:, i : i + 4], memory=memory).flatten(0, 1),
                            tokens[:, i + 1 : i + 5].flatten())
            for i in range(0, 12, 4)
        ]
    return sum(loss.item() for loss in losses)


def test_an_int8_transformer_xl_evaluates_with_its_memory():
    cfg = TransformerXLConfig(vocab_size=23, context=4, mem_len=8, n_layer=2, n_head=2,
                              d_model=16)
    model = TransformerXL(cfg).eval()
    tokens = torch.randint(0, 23, (2, 13))
    full = transformer_xl_loss(model, tokens)
    int8 = quantize_model(model, "int8")
    assert transformer_xl_loss(int8, tokens) == pytest.approx(full, rel=0.02)


def test_without_the_kernel_int8_models_still_run(model, without_kernel):
    int8 = quantize_model(model, "int8")
    assert isinstance(int8.blocks[0].attn.qkv_proj, Int8Linear)
    tokens = torch.randint(0, 61, (3, 20))
    assert (model(tokens) - int8(tokens)).abs().max() < 0.2 * model(tokens).std()
    cfg = TransformerXLConfig(vocab_size=23, context=4, mem_len=8, n_layer=2, n_head=2,
                              d_model=16)
    xl = TransformerXL(cfg).eval()
    tokens = torch.randint(0, 23, (2, 13))
    assert transformer_xl_loss(quantize_model(xl, "int8"), tokens) == pytest.approx(
        transformer_xl_loss(xl, tokens), rel=0.02
    )


def test_an_int8_layer_converted_after_it_was_made_checks_its_tensors_again():
    # The layer checks its tensors once, not at every call: a conversion must renew that.
    layer = Int8Linear(nn.Linear(16, 8))
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = layer(x)
        # native: the kernel can read the layer's tensors (where no kernel is built, the
        # same call takes torch's integer product, bit for bit the same)
        assert layer.native
        dequantized = F.linear(x, layer.weight, layer.bias)
        layer.double()  # scale and bias become float64: the kernel cannot read them
        assert not layer.native
        # torch's product over the rounded weight (x itself is not rounded on this path)
        torch.testing.assert_close(layer(x.double()).float(), dequantized, atol=1e-5, rtol=1e-5)
        layer.float()
        assert layer.native
        assert torch.equal(layer(x), want)


def test_without_vnni_many_rows_never_reach_torch_int_mm(monkeypatch, reload_kernel, model):
    # Where the CPU lacks VNNI, torch._int_mm can be many times slower than fp32's product:
    # under TFORMER_ISA=avx2 the int8 layers and the model never call it, whatever the rows.
    monkeypatch.setenv("TFORMER_ISA", "avx2")
    if kint8.isa() != "avx2":
        pytest.skip("the kernel is not built here")
    int8 = quantize_model(model, "int8")

    def refuse(*args):
        raise AssertionError("torch._int_mm called")

    monkeypatch.setattr(torch, "_int_mm", refuse)
    with torch.no_grad():
        int8(torch.randint(0, 61, (4, 20)))  # 80 rows a product
        kint8.linear_int8(torch.randn(64, 40), *quantize_rows(torch.randn(27, 40)), None)


@pytest.mark.parametrize("k", [5, 1040, 2100])
def test_torchs_integer_product_is_exact_whichever_route_it_takes(k):
    # torch._int_mm where it sums exactly (not every oneDNN build does without VNNI), else
    # fp32 products of slices short enough to be exact: both against int64 sums, with the
    # largest terms int8 makes (past 2^24 in all, where one fp32 sum would round).
    xq = torch.randint(-127, 128, (9, k), dtype=torch.int8)
    q = torch.randint(-127, 128, (6, k), dtype=torch.int8)
    xq[0], xq[1], q[0] = 127, -127, 127
    want = xq.long() @ q.long().t()
    assert torch.equal(rounding._float_integer_product(xq, q).long(), want)
    assert torch.equal(rounding.integer_product(xq, q).long(), want)


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the int8 products see them (quantize_rows), in float64."""
    xq, scale = quantize_rows(x.contiguous())
    return xq.double() * scale.double()[:, None]


@pytest.mark.parametrize("shape", [(1, 40), (2, 3, 40), (37, 40)])
def test_a_frozen_int8_linear_and_its_input_gradient_are_products_of_rounded_rows(shape, isa):
    # Forward: x's rows rounded times the rounded weight. Backward: grad_x = grad_y W, with
    # W's row scales folded into grad_y's rows before they are rounded (W = diag(scale) q).
    # Both against float64 products of the same rounded values, under every instruction set.
    linear = nn.Linear(40, 27)
    frozen = FrozenInt8Linear(linear)
    x = torch.randn(*shape, requires_grad=True)
    y = frozen(x)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    rows, grads = x.detach().reshape(-1, 40), grad_y.reshape(-1, 27)
    weight = frozen.qweight.double() * frozen.scale.double()[:, None]
    want_y = rounded_rows(rows) @ weight.T + linear.bias.double()
    want_grad = rounded_rows(grads * frozen.scale) @ frozen.qweight.double()
    torch.testing.assert_close(y.detach().reshape(-1, 27).double(), want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 40).double(), want_grad, atol=1e-5, rtol=1e-5)
    assert frozen.weight.grad is None and linear.weight.grad is None

    # And against the fp32 layer it was made from, within what rounding to int8 moves.
    x32 = x.detach().clone().requires_grad_()
    y32 = linear(x32)
    y32.backward(grad_y)
    assert (y - y32).abs().max() < 0.02 * y32.abs().max()
    assert (x.grad - x32.grad).abs().max() < 0.02 * x32.grad.abs().max()


def test_a_frozen_int8_linear_gets_the_same_bits_on_every_instruction_set(monkeypatch,
                                                                          reload_kernel):
    linear = nn.Linear(70, 45)
    x, grad_y = torch.randn(33, 70), torch.randn(33, 45)
    results = {}
    for name in instruction_sets(monkeypatch):
        rows = x.clone().requires_grad_()
        y = FrozenInt8Linear(linear)(rows)
        y.backward(grad_y)
        results[name] = (y.detach(), rows.grad)
    assert "torch" in results
    first = next(iter(results.values()))
    for name, got in results.items():
        assert all(map(torch.equal, got, first)), name


def test_a_frozen_int8_linear_gives_its_bias_a_gradient_only_where_it_trains():
    linear = nn.Linear(8, 5)
    frozen = FrozenInt8Linear(linear)
    x, grad_y = torch.randn(3, 8), torch.randn(3, 5)
    frozen(x).backward(grad_y)
    torch.testing.assert_close(linear.bias.grad, grad_y.sum(0))
    linear.bias.grad = None
    linear.bias.requires_grad_(False)
    out = frozen(x.requires_grad_())
    out.backward(grad_y)
    assert linear.bias.grad is None and x.grad is not None
    # Other dtypes go through the dequantized weight, with autograd's own gradient.
    x64 = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    frozen(x64).sum().backward()
    torch.testing.assert_close(x64.grad, frozen.weight.double().sum(0).expand(3, 8))
