import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.decoding.beam import beam_search
from tformer.decoding.lm import generate
from tformer.decoding.transformer_xl import generate_with_memory
from tformer.kernels.prepack import PackedLinear, prepack, prepack_available
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from tformer.models.transformer_xl import TransformerXL, TransformerXLConfig

pytestmark = pytest.mark.skipif(not prepack_available(), reason="torch built without oneDNN")

V = 61


def gpt() -> GPT:
    model = GPT(GPTConfig(vocab_size=V, context=24, n_layer=2, n_head=4, d_model=64)).eval()
    with torch.no_grad():  # sharper distributions than at initialisation: fewer near-ties
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 3, 48), (70, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_the_linear_product(shape, bias):
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape, dtype=torch.float64).float()
    with torch.no_grad():
        got = PackedLinear(linear)(x)
        # The reference in float64: both float32 products must sit within rounding of it.
        bias = None if linear.bias is None else linear.bias.double()
        want = F.linear(x.double(), linear.weight.double(), bias)
    assert got.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_packed_linear_reads_strided_inputs():
    linear = nn.Linear(48, 80)
    x = torch.randn(6, 5, 48)
    with torch.no_grad():
        for view in (x.transpose(0, 1), x[:, -1:], x[:, ::2]):
            assert not view.is_contiguous()
            want = F.linear(view.contiguous(), linear.weight, linear.bias)
            torch.testing.assert_close(PackedLinear(linear)(view), want, atol=1e-5, rtol=1e-5)


def test_prepack_shares_the_parameters_and_leaves_the_original_alone():
    model = gpt()
    packed = prepack(model)
    assert type(model.blocks[0].attn.qkv_proj) is nn.Linear
    assert isinstance(packed.blocks[0].attn.qkv_proj, PackedLinear)
    ours = dict(model.named_parameters())
    for name, param in packed.named_parameters():
        assert param is ours[name], name
    # Tied embeddings stay tied.
    assert packed.lm_head.weight is packed.embed.weight
    assert not any(isinstance(m, nn.Dropout) for m in packed.modules())
    assert any(isinstance(m, nn.Dropout) for m in model.modules())


def test_prepacked_gpt_logits_and_greedy_tokens_match_the_original():
    model = gpt()
    packed = prepack(model)
    tokens = torch.randint(0, V, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(packed(tokens), model(tokens), atol=1e-4, rtol=1e-4)
    prompt = torch.randint(0, V, (2, 5))
    run = lambda m, cache: torch.stack(  # noqa: E731
        list(generate(m, prompt, max_new_tokens=40, temperature=0.0, use_cache=cache))
    )
    assert torch.equal(run(packed, True), run(model, True))
    assert torch.equal(run(packed, True), run(packed, False))


def test_prepacked_beam_search_finds_the_same_translations():
    cfg = Seq2SeqConfig(vocab_size=23, max_len=40, n_layer=2, n_head=2, d_model=16, d_ff=32,
                        dropout=0.0)
    model = Seq2Seq(cfg).eval()
    with torch.no_grad():
        model.out_proj.weight.mul_(4.0)
    src = torch.randint(3, 23, (6, 9))
    real = torch.ones_like(src, dtype=torch.bool)
    special = dict(bos_id=1, eos_id=2, pad_id=0)
    want = beam_search(model, src, real, beam=4, n_best=2, **special)
    got = beam_search(prepack(model), src, real, beam=4, n_best=2, **special)
    for a, b in zip(got, want, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_prepacked_transformer_xl_samples_the_same_text():
    cfg = TransformerXLConfig(vocab_size=23, context=4, mem_len=8, n_layer=2, n_head=2,
                              d_model=16)
    model = TransformerXL(cfg).eval()
    prompt = torch.randint(0, 23, (2, 7))
    run = lambda m: torch.stack(  # noqa: E731
        list(generate_with_memory(m, prompt, max_new_tokens=20, temperature=0.0)), 1
    )
    assert torch.equal(run(prepack(model)), run(model))


def test_training_through_a_packed_linear_falls_back_to_a_correct_gradient():
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    PackedLinear(linear)(x).sum().backward()
    assert torch.allclose(linear.weight.grad, x.sum(0).expand(4, 8))


def test_models_the_packed_kernels_do_not_cover_come_back_unchanged():
    model = gpt().double()
    assert prepack(model) is model
