import math

import pytest
import torch

from tformer.models.gpt import GPT, GPTConfig

VARIANTS = [
    {},
    {"norm": "post", "position": "sinusoidal", "activation": "relu", "bias": False},
    {"d_head": 6, "d_value": 10, "tie_embeddings": False},
]


def tiny(**overrides) -> GPT:
    cfg = GPTConfig(vocab_size=37, context=16, n_layer=2, n_head=2, d_model=16, **overrides)
    return GPT(cfg).eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_changing_a_future_token_never_changes_earlier_logits(variant):
    model = tiny(**variant)
    tokens = torch.randint(0, 37, (2, 12))
    base = model(tokens)
    for t in range(12):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 37
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0)
        assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_never_changes_real_positions(variant):
    model = tiny(**variant)
    row = torch.randint(0, 37, (1, 7))
    alone = model(row)
    # The same row left-padded by 3 and right-padded by 3, in one batch; pad ids are arbitrary.
    left = torch.cat([torch.full((1, 3), 5), row], dim=1)
    right = torch.cat([row, torch.full((1, 3), 9)], dim=1)
    is_real = torch.tensor([[False] * 3 + [True] * 7, [True] * 7 + [False] * 3])
    out = model(torch.cat([left, right]), is_real)
    torch.testing.assert_close(out[0, 3:], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :7], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_steps_equal_the_full_pass(variant):
    model = tiny(**variant)
    tokens = torch.randint(0, 37, (3, 16))
    full = model(tokens)
    cache = model.make_cache(3)
    pieces = [model(tokens[:, :5], cache=cache), model(tokens[:, 5:6], cache=cache),
              model(tokens[:, 6:11], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(11, 16)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_are_one_tensor():
    model = tiny()
    assert model.lm_head.weight is model.embed.weight
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.embed.weight
    # Counted by hand for V 37, context 16, D 16, 2 layers, d_ff 64, biases, pre-norm.
    V, T, D, F = 37, 16, 16, 64
    layer = 2 * (2 * D) + (D * 3 * D + 3 * D) + (D * D + D) + (D * F + F) + (F * D + D)
    tied = V * D + T * D + 2 * layer + 2 * D
    assert (tied, layer) == (7440, 3280)
    assert model.num_params() == tied
    assert untied.num_params() == tied + V * D


def test_residual_projections_are_scaled_at_init():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, context=8, n_layer=8, n_head=4, d_model=256)
    model = GPT(cfg)
    expected = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert model.blocks[0].ff.down.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.blocks[0].ff.up.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_longer_than_context_is_refused():
    model = tiny()
    with pytest.raises(ValueError, match="exceed the model's context of 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_last_only_returns_the_last_position():
    model = tiny()
    tokens = torch.randint(0, 37, (2, 9))
    torch.testing.assert_close(model(tokens, last_only=True), model(tokens)[:, -1:])
