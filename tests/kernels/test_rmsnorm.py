import pytest
import torch

from tformer.kernels import rmsnorm
from tformer.layers.norm import RMSNorm

native = pytest.mark.skipif(rmsnorm._library() is None, reason="the kernel is not built here")


def reference(x, weight, eps, upstream):
    """The norm in float64, written out, and the gradients of its product with `upstream`."""
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    y = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    y.backward(upstream.double())
    return y.detach(), x64.grad, w64.grad


def norm(d: int, seed: int) -> RMSNorm:
    torch.manual_seed(seed)
    layer = RMSNorm(d, eps=1e-5)
    with torch.no_grad():
        layer.weight.uniform_(-2, 2)  # not ones: a weight mix-up cannot hide
    return layer


@native
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 64), (4, 130), (2, 33, 576)])
def test_the_norm_and_its_gradients_match_float64(shape):
    # widths with a scalar rest, and with a narrower last column block of the weight's
    # gradient (130 = 2 x 64 + 2)
    layer = norm(shape[-1], len(shape))
    x = (torch.randn(shape) * 3).requires_grad_()
    upstream = torch.randn(shape)
    assert rmsnorm.runs_natively(x, layer.weight)
    layer(x).backward(upstream)
    want, want_x, want_w = reference(x.detach(), layer.weight.detach(), 1e-5, upstream)
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), want_x, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), want_w, rtol=1e-4, atol=1e-4)


@native
def test_the_weights_gradient_has_the_same_bits_on_any_number_of_threads():
    layer, x = norm(200, 0), torch.randn(64, 200, requires_grad=True)
    upstream = torch.randn(64, 200)
    threads = torch.get_num_threads()
    grads = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            layer.weight.grad = x.grad = None
            layer(x).backward(upstream)
            grads.append((x.grad.clone(), layer.weight.grad.clone()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@native
def test_a_frozen_weight_and_a_non_contiguous_input():
    layer = norm(16, 1)
    layer.weight.requires_grad_(False)
    base = torch.randn(4, 16, 3, requires_grad=True)
    x = base.transpose(1, 2)  # (4, 3, 16), not contiguous
    layer(x).sum().backward()
    want, want_x, _ = reference(x.detach(), layer.weight, 1e-5, torch.ones(4, 3, 16))
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(base.grad.transpose(1, 2).double(), want_x, rtol=1e-4,
                               atol=1e-5)
    assert layer.weight.grad is None


def test_where_the_kernel_does_not_apply_the_layer_is_torchs(monkeypatch, reload_kernel):
    layer, x = norm(8, 2), torch.randn(3, 8)
    assert not rmsnorm.runs_natively(x.double(), layer.weight.double())
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert not rmsnorm.runs_natively(x, layer.weight)
    want, _, _ = reference(x, layer.weight.detach(), 1e-5, torch.ones(3, 8))
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-6)
