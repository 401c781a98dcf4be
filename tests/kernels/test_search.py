import pytest
import torch
import torch.nn.functional as F

from tformer.kernels import library, search
from tformer.kernels.search import top_logprobs

native = pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")


def reference(logits, add, k, banned):
    """The same choice written out in float64: log-softmax, banned columns out, + add."""
    logprobs = F.log_softmax(logits.double(), dim=-1)
    logprobs[:, banned] = float("-inf")
    return (logprobs + add.double()[:, None]).topk(k, dim=-1)


@native
@pytest.mark.parametrize(
    "n, v, k",
    [
        (3, 5, 5),  # k = V: every column, the banned ones last
        (4, 13, 8),  # a row shorter than two vectors
        (2, 1000, 1),
        (64, 8003, 10),  # a remainder after the vectors, many rows
        (5, 58101, 8),  # OPUS-MT's vocabulary
    ],
)
def test_kernel_picks_the_best_log_probabilities(n, v, k):
    torch.manual_seed(v)
    logits = torch.randn(n, v) * 4
    logits[:, 2] = float("-inf")  # a token the model rules out
    add = torch.randn(n) * 10
    banned = torch.tensor([0, 1])
    values, tokens = top_logprobs(logits, add, k, banned)
    want_values, want_tokens = reference(logits, add, k, banned)
    finite = want_values.isfinite()
    assert torch.equal(values.isfinite(), finite)
    torch.testing.assert_close(values[finite], want_values[finite].float(), atol=2e-5, rtol=0)
    assert torch.equal(tokens[finite], want_tokens[finite])
    # Within rounding of torch's own log-softmax, which it replaces.
    torch_values, _ = search.torch_top_logprobs(logits, add, k, banned)
    torch.testing.assert_close(values, torch_values, atol=1e-5, rtol=0)


@native
def test_rows_of_minus_infinity_and_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0, 3.0] + [-1.0] * 20, [2.0] * 25])
    add = torch.tensor([0.0, float("-inf")])  # the second row: a dead hypothesis
    values, tokens = top_logprobs(logits, add, 3)
    assert tokens[0].tolist() == [1, 2, 4]  # equal values in the order of their columns
    assert values[1].eq(float("-inf")).all()
    assert len(set(tokens[1].tolist())) == 3  # still three distinct columns
    expected = F.log_softmax(logits[0], dim=-1)[1]
    torch.testing.assert_close(values[0], expected.expand(3), atol=1e-6, rtol=0)


def test_torch_computes_the_same_where_there_is_no_kernel(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert library.load() is None
    torch.manual_seed(0)
    logits, add, banned = torch.randn(6, 300), torch.randn(6), torch.tensor([0, 5])
    values, tokens = top_logprobs(logits, add, 4, banned)
    want_values, want_tokens = reference(logits, add, 4, banned)
    torch.testing.assert_close(values, want_values.float(), atol=1e-5, rtol=0)
    assert torch.equal(tokens, want_tokens)


def test_k_must_fit_the_row():
    with pytest.raises(ValueError, match="k = 6 for rows of 5"):
        top_logprobs(torch.zeros(2, 5), torch.zeros(2), 6)
