import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.decoding.lm import generate
from tformer.kernels import matvec
from tformer.kernels.quantize import Int8Linear, quantize_int8
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.transformer_xl import Memory, TransformerXL, TransformerXLConfig

native = pytest.mark.skipif(matvec.load() is None, reason="the int8 kernel is not built here")


@pytest.fixture
def model() -> GPT:
    return GPT(GPTConfig(vocab_size=61, context=24, n_layer=2, n_head=4, d_model=64)).eval()


@pytest.fixture
def without_kernel(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_NATIVE", "0")


def test_int8_logits_stay_close_and_the_original_is_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    int8 = quantize_int8(model)
    tokens = torch.randint(0, 61, (3, 20))
    full, quantized = model(tokens), int8(tokens)
    assert not torch.equal(full, quantized), "the weights really are int8"
    # Per-row int8 weights: errors well below the logits' spread.
    assert (full - quantized).abs().max() < 0.2 * full.std()
    assert full.argmax(-1).eq(quantized.argmax(-1)).float().mean() > 0.9
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@native
def test_with_the_kernel_every_linear_layer_is_weight_only_int8(model):
    int8 = quantize_int8(model)
    linears = [m for m in int8.modules() if isinstance(m, (nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert int8.lm_head.qweight.dtype == torch.int8
    # The bias is shared, not copied.
    assert int8.blocks[0].attn.qkv_proj.bias is model.blocks[0].attn.qkv_proj.bias


@native
@pytest.mark.parametrize("shape", [(1, 40), (3, 40), (2, 3, 40), (37, 40)])
def test_an_int8_linear_computes_the_product_with_its_rounded_weights(shape):
    linear = nn.Linear(40, 27)
    int8 = Int8Linear(linear)
    # Rounding to the nearest of 255 levels moves a weight by at most half a level.
    error = (int8.weight - linear.weight).abs()
    assert (error <= int8.scale[:, None] / 2 + 1e-7).all()
    assert int8.qweight.abs().amax(1).eq(127).all()  # each row's largest weight maps to 127
    x = torch.randn(*shape)
    with torch.no_grad():
        got = int8(x)
    want = F.linear(x.double(), int8.weight.double(), linear.bias.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_an_all_zero_row_stays_zero():
    linear = nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        linear.weight[2] = 0.0
    int8 = Int8Linear(linear)
    assert int8.qweight[2].eq(0).all() and torch.isfinite(int8.scale).all()
    with torch.no_grad():
        assert int8(torch.randn(1, 16))[0, 2] == 0.0


def test_int8_cached_generation_equals_uncached(model):
    int8 = quantize_int8(model)
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
    assert transformer_xl_loss(quantize_int8(model), tokens) == pytest.approx(full, rel=0.02)


def test_without_the_kernel_int8_falls_back_to_dynamic_quantization(model, without_kernel):
    int8 = quantize_int8(model)
    assert "quantized" in type(int8.blocks[0].attn.qkv_proj).__module__
    tokens = torch.randint(0, 61, (3, 20))
    assert (model(tokens) - int8(tokens)).abs().max() < 0.2 * model(tokens).std()
    cfg = TransformerXLConfig(vocab_size=23, context=4, mem_len=8, n_layer=2, n_head=2,
                              d_model=16)
    xl = TransformerXL(cfg).eval()
    tokens = torch.randint(0, 23, (2, 13))
    # The fallback leaves the projection whose weight Transformer-XL slices in fp32.
    assert transformer_xl_loss(quantize_int8(xl), tokens) == pytest.approx(
        transformer_xl_loss(xl, tokens), rel=0.02
    )
