import pytest
import torch

from tformer.decoding.lm import generate
from tformer.decoding.quantize import quantize_int8
from tformer.models.gpt import GPT, GPTConfig


@pytest.fixture
def model() -> GPT:
    return GPT(GPTConfig(vocab_size=61, context=24, n_layer=2, n_head=4, d_model=64)).eval()


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
    assert type(int8.blocks[0].attn.qkv_proj).__name__ == "Linear"
    assert "quantized" in type(int8.blocks[0].attn.qkv_proj).__module__


def test_int8_cached_generation_equals_uncached(model):
    int8 = quantize_int8(model)
    prompt = torch.randint(0, 61, (2, 5))
    run = lambda cache: torch.stack(  # noqa: E731
        list(generate(int8, prompt, max_new_tokens=30, temperature=0.0, use_cache=cache))
    )
    assert torch.equal(run(True), run(False))
