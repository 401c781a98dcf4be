import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.kernels import dropout as kd
from tformer.kernels import library
from tformer.layers import Dropout, MultiHeadAttention, dropout

native = pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")

# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter, key, output.
KNOWN_ANSWERS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]
MASK32 = 0xFFFFFFFF


def philox(counter, key):
    """Philox4x32-10 as Salmon et al. (2011) define it, in plain Python integers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return [c0, c1, c2, c3]


def reference_mask(n, seed, p):
    """1 where element i is kept: element 32 b + 8 w + l takes word w of the counter 8 b + l
    (dropout.c's layout), kept where the word is >= floor(p * 2^32)."""
    key = [seed & MASK32, seed >> 32]
    words = {}
    keep = []
    for i in range(n):
        counter = 8 * (i // 32) + i % 8
        if counter not in words:
            words[counter] = philox([counter & MASK32, counter >> 32, 0, 0], key)
        keep.append(words[counter][(i % 32) // 8] >= math.floor(p * 2**32))
    return torch.tensor(keep, dtype=torch.float32)


@pytest.mark.parametrize("counter, key, want", KNOWN_ANSWERS)
def test_the_reference_generator_gives_the_known_answers(counter, key, want):
    assert philox(counter, key) == want


@native
@pytest.mark.parametrize("counter, key, want", KNOWN_ANSWERS)
def test_the_kernels_generator_gives_the_known_answers(counter, key, want):
    assert kd.philox4x32(library.load(), counter, key) == want


@native
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 64, 1000])
@pytest.mark.parametrize("seed", [0, 12345, 0xFEDCBA9876543210 >> 1])
def test_the_mask_is_philox_of_each_element_and_forward_and_backward_share_it(n, seed):
    p = 0.3
    keep = reference_mask(n, seed, p)
    x = torch.randn(n, requires_grad=True)
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    y = kd._PhiloxDropout.apply(x, p, seed)
    assert torch.equal(y, x.detach() * (keep * scale))
    grad = torch.randn(n)
    y.backward(grad)
    assert torch.equal(x.grad, grad * (keep * scale))


@native
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_elements_are_dropped_with_probability_p_and_the_mean_is_kept(p):
    torch.manual_seed(0)
    n = 1 << 20
    y = dropout(torch.ones(n), p)
    dropped = (y == 0).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped - p) < 5 * sigma
    kept = y[y != 0]
    assert torch.all(kept == torch.tensor(1 / (1 - p), dtype=torch.float32))
    assert abs(y.double().mean().item() - 1.0) < 5 * sigma / (1 - p)
    # Neighbouring elements, and the same element across the eight lanes and four words of a
    # block, are not correlated.
    d = (y == 0).double().view(-1, 32)
    for a, b in [(0, 1), (0, 8), (0, 16), (7, 31)]:
        corr = torch.corrcoef(torch.stack([d[:, a], d[:, b]]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(d.shape[0])


@native
def test_any_number_of_threads_draws_the_same_mask():
    x = torch.randn(3, 1000, 37)
    lib = library.load()
    results = []
    for threads in (1, 2, 3):
        y = torch.empty_like(x)
        lib.tformer_dropout(x.data_ptr(), y.data_ptr(), x.numel(), 99, kd.threshold(0.25),
                            1 / 0.75, threads)
        results.append(y)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@native
def test_repeatable_under_manual_seed_and_fresh_at_every_call():
    x = torch.randn(64, 33)
    torch.manual_seed(5)
    a, b = dropout(x, 0.5), dropout(x, 0.5)
    torch.manual_seed(5)
    assert torch.equal(dropout(x, 0.5), a)
    assert not torch.equal(a, b)


@native
def test_strided_input_and_non_finite_values():
    x = torch.randn(40, 50).t()  # not contiguous
    x[0, 0], x[1, 0] = float("nan"), float("inf")
    torch.manual_seed(1)
    y = dropout(x, 0.4)
    torch.manual_seed(1)
    want = dropout(x.contiguous(), 0.4)
    assert y.shape == x.shape and torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y.nan_to_num(), want.nan_to_num())
    # A dropped NaN or infinity stays NaN (x * 0), as with torch's dropout.
    assert y[0, 0].isnan() and (y[1, 0].isnan() or y[1, 0].isinf())


def test_where_the_kernel_does_not_apply_it_is_torchs_dropout(monkeypatch, reload_kernel):
    x = torch.randn(10, 10)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    for tensor in (x.double(), x.to(torch.bfloat16)):
        assert not kd.runs_natively(tensor, 0.5)
        torch.manual_seed(3)
        got = dropout(tensor, 0.5)
        torch.manual_seed(3)
        assert torch.equal(got, F.dropout(tensor, 0.5))
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert not kd.runs_natively(x, 0.5)
    torch.manual_seed(3)
    got = dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(got, F.dropout(x, 0.5))


def test_loading_the_kernel_leaves_torchs_random_numbers_alone(reload_kernel):
    torch.manual_seed(0)
    library.load()
    after_load = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(4), after_load)


def test_the_module_is_nn_dropout_with_the_kernel():
    module = Dropout(0.2)
    assert isinstance(module, nn.Dropout) and repr(module) == repr(nn.Dropout(0.2))
    assert module.state_dict() == {}
    x = torch.randn(8, 8)
    assert module.eval()(x) is x
    module.train()
    torch.manual_seed(2)
    got = module(x)
    torch.manual_seed(2)
    assert torch.equal(got, dropout(x, 0.2))


@native
def test_attention_dropout_in_training_drops_the_probabilities():
    """Training with attention dropout writes attention out: softmax, the kernel's dropout
    on the probabilities, then the values, checked against the same steps by hand."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, dropout=0.3).train()
    x = torch.randn(3, 5, 16)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    mask[0, ..., 3:] = False
    torch.manual_seed(7)
    got = attn(x, mask=mask)

    q, k, v = attn.qkv_proj(x).split(16, dim=-1)
    q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**63 - 1, ()))
    dropped = kd.apply_mask(probs, 0.3, seed)
    want = attn.out_proj((dropped @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # In evaluation the fused kernel runs, without dropout.
    attn.eval()
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(
        attn(x, mask=mask), attn.out_proj(plain.transpose(1, 2).flatten(2)), atol=1e-6, rtol=0
    )
