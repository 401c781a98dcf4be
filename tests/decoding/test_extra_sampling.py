"""The sampling settings beyond OpenAI's (decoding/sampling.py): min-p's kept set against
the plain rule in float64, the repetition penalty against a table worked out by hand, and
their checks."""

from __future__ import annotations

import pytest
import torch

from tformer.decoding.sampling import (
    ExtraSampling,
    filter_min_p,
    hold_back,
    next_token,
    penalize_repetition,
    sampling_probs,
)
from tformer.errors import TformerError


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_likeliest(min_p, temperature):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 3
    # The rule as min-p states it, in float64 probabilities.
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ratio = probs / probs.max(dim=-1, keepdim=True).values
    clear = (ratio - min_p).abs() > 1e-5  # no token on the boundary, where float32 may round
    assert bool(clear.all())
    expected = ratio >= min_p
    kept = sampling_probs(logits, temperature, top_k=0, top_p=1.0, min_p=min_p) > 0
    assert torch.equal(kept, expected)
    # What is kept keeps its share: the kept probabilities renormalised.
    drawn = sampling_probs(logits, temperature, 0, 1.0, min_p).double()
    want = torch.where(expected, probs, 0.0)
    assert torch.allclose(drawn, want / want.sum(-1, keepdim=True), atol=1e-6)


def test_min_p_draws_only_kept_tokens_and_one_keeps_only_the_likeliest():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    # p_i / p_max = exp(l_i - 2): 1, 0.905, 0.135, 0.050, 0.368.
    draws = {int(next_token(logits, min_p=0.3, generator=g)) for _ in range(200)}
    assert draws == {0, 1, 4}
    assert torch.equal(filter_min_p(logits, 1.0).isfinite(), torch.tensor([[1, 0, 0, 0, 0]]).bool())
    assert torch.equal(filter_min_p(logits, 0.0), logits)


def test_the_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0, 4.0]])
    seen = torch.tensor([[True, True, False, True, False, True]])
    # By hand, penalty 2: seen 2 -> 1, -1 -> -2, 0 -> 0, 4 -> 2; unseen as they were.
    assert penalize_repetition(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 0.0, -3.0, 2.0]]
    # Below 1 it rewards repetition: 2 / 0.5 = 4, -1 * 0.5 = -0.5.
    assert penalize_repetition(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, 0.0, -3.0, 8.0]]
    assert penalize_repetition(logits, seen, 1.0) is logits


def test_min_tokens_holds_the_ends_back_unless_only_an_end_may_come():
    inf = float("-inf")
    logits = torch.tensor([[1.0, 5.0, 2.0, 4.0],
                           [inf, 3.0, inf, 0.5],    # a row that may only end
                           [0.0, 1.0, 2.0, 3.0]])
    held = hold_back(logits, [1, 3, 99])  # an id past the vocabulary is no token here
    assert held.tolist() == [[1.0, inf, 2.0, inf], [inf, 3.0, inf, 0.5], [0.0, inf, 2.0, inf]]
    assert hold_back(logits, []) is logits


@pytest.mark.parametrize(("field", "value", "says"), [
    ("min_p", 1.5, "min_p 1.5 must be between 0 and 1"),
    ("min_p", -0.1, "min_p -0.1"),
    ("repetition_penalty", 0.0, "repetition_penalty 0.0 must be more than 0"),
    ("repetition_penalty", float("nan"), "repetition_penalty nan"),
    ("min_tokens", -1, "min_tokens -1 must be 0 or more"),
])
def test_bad_settings_are_refused_naming_the_field(field, value, says):
    with pytest.raises(TformerError, match=says):
        ExtraSampling(**{field: value})
