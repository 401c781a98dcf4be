import torch

from tformer.decoding.sampling import filter_top_k, filter_top_p, next_token


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    kept = torch.isfinite(filter_top_k(logits, 2))
    assert kept.sum() == 2
    assert not kept[0, [0, 4]].any()


def test_top_k_off_and_oversized():
    logits = torch.randn(2, 5)
    assert torch.equal(filter_top_k(logits, 0), logits)
    assert torch.equal(filter_top_k(logits, 9), logits)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = torch.isfinite(filter_top_p(logits, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_top_p(logits, 0.81))
    assert kept.tolist() == [[True, True, True, False]]
    # The most likely token survives any p.
    assert torch.isfinite(filter_top_p(logits, 1e-6)).tolist() == [[True, False, False, False]]


def test_top_p_works_on_unsorted_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [5.0, 0.0, 1.0]])
    kept = torch.isfinite(filter_top_p(logits, 0.5))
    assert kept.tolist() == [[False, True, False], [True, False, False]]


def test_temperature_zero_is_argmax_and_sampling_is_seeded():
    logits = torch.randn(4, 10)
    assert torch.equal(next_token(logits, temperature=0), logits.argmax(-1))
    draw = lambda: next_token(logits, generator=torch.Generator().manual_seed(3))  # noqa: E731
    assert torch.equal(draw(), draw())


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3)
    counts = torch.bincount(
        next_token(logits, generator=torch.Generator().manual_seed(0)), minlength=3
    )
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0) * 20000
    assert torch.allclose(counts.float(), expected, rtol=0.05)
