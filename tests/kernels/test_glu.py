import pytest
import torch
import torch.nn.functional as F

from tformer.kernels import glu
from tformer.kernels.glu import silu_mul
from tformer.layers.feedforward import GatedFeedForward

native = pytest.mark.skipif(glu._library() is None, reason="the kernel is not built here")


def reference(gate, up, upstream):
    """silu(gate) * up in float64, and the gradients of its product with `upstream`."""
    g, u = gate.double().requires_grad_(), up.double().requires_grad_()
    out = g * torch.sigmoid(g) * u
    out.backward(upstream.double())
    return out.detach(), g.grad, u.grad


@native
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 11), (2, 4099), (4, 256, 96)])
def test_the_gate_and_its_gradients_match_float64(shape):
    # sizes with a scalar rest, and past one thread's block of 4096
    torch.manual_seed(len(shape))
    gate, up, upstream = torch.randn(shape) * 4, torch.randn(shape), torch.randn(shape)
    gate.view(-1)[0] = 0.0
    if gate.numel() > 3:
        gate.view(-1)[1:3] = torch.tensor([-100.0, 100.0])  # e = exp(-|g|) underflows to 0
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = silu_mul(g, u)
    out.backward(upstream)
    want, want_g, want_u = reference(gate, up, upstream)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g.grad.double(), want_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u.grad.double(), want_u, rtol=1e-6, atol=1e-6)


@native
def test_non_contiguous_inputs_and_a_nan_are_torchs_too():
    both = torch.randn(6, 10)
    gate, up = both[:, :5], both[:, 5:]  # halves of one tensor, as a fused projection gives
    gate[0, 0] = float("nan")
    out = silu_mul(gate, up)
    want = F.silu(gate) * up
    assert out[0, 0].isnan() and want[0, 0].isnan()
    torch.testing.assert_close(out[1:], want[1:])


def test_where_the_kernel_does_not_apply_it_is_torchs(monkeypatch, reload_kernel):
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    for g, u in ((gate.double(), up.double()), (gate, up[:1])):
        assert not glu.runs_natively(g, u)
        assert torch.equal(silu_mul(g, u), F.silu(g) * u)
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert not glu.runs_natively(gate, up)
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)


@native
def test_a_swiglu_layer_trains_to_the_gradients_of_its_torch_form():
    torch.manual_seed(0)
    ff = GatedFeedForward(12, 20, activation="silu", dropout=0.0)
    x = torch.randn(2, 5, 12, requires_grad=True)
    ff(x).square().sum().backward()
    got = [x.grad, *(p.grad for p in ff.parameters())]
    x.grad = None
    ff.zero_grad()
    ff.down(F.silu(ff.gate(x)) * ff.up(x)).square().sum().backward()
    for a, b in zip(got, [x.grad, *(p.grad for p in ff.parameters())], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
