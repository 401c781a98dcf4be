import pytest
import torch
import torch.nn.functional as F

from tformer.kernels import matvec, xent
from tformer.kernels.xent import cross_entropy

native = pytest.mark.skipif(matvec.load() is None, reason="the kernel is not built here")
IGNORE = -100


def reference(logits, targets, eps, reduction):
    """F.cross_entropy in float64, its loss and the gradient of the loss's sum."""
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x, targets, ignore_index=IGNORE, label_smoothing=eps,
                           reduction=reduction)
    loss.sum().backward()
    return loss.detach(), x.grad


@native
@pytest.mark.parametrize("n, v", [(1, 1), (5, 7), (9, 37), (64, 8000), (3, 50257)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_and_gradient_match_torchs_cross_entropy(n, v, eps, reduction):
    torch.manual_seed(n * v)
    logits = torch.randn(n, v) * 4
    targets = torch.randint(0, v, (n,))
    if n > 2:
        targets[1] = IGNORE  # padding
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, ignore_index=IGNORE, label_smoothing=eps,
                         reduction=reduction)
    loss.sum().backward()
    want, want_grad = reference(logits, targets, eps, reduction)
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    # A float32 softmax over thousands of columns is good to ~1e-6 near a probability of 1
    # (torch's own float32 gradient is 1.0e-6 off the float64 one at 64 x 8000).
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=0, atol=4e-6)


@native
def test_large_logits_and_an_upstream_gradient_per_row():
    logits = torch.tensor([[80.0, -80.0, 0.0] * 5, [-1e4] * 14 + [1e4]])
    targets = torch.tensor([1, 14])
    upstream = torch.tensor([0.5, -2.0])
    x = logits.clone().requires_grad_()
    cross_entropy(x, targets, ignore_index=IGNORE, label_smoothing=0.2,
                  reduction="none").backward(upstream)
    want_x = logits.double().requires_grad_()
    want = F.cross_entropy(want_x, targets, label_smoothing=0.2, reduction="none")
    want.backward(upstream.double())
    assert x.grad.isfinite().all()
    torch.testing.assert_close(x.grad.double(), want_x.grad, rtol=0, atol=1e-6)


@native
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_a_nan_or_infinite_logit_gives_the_loss_torch_gives(eps):
    x = torch.randn(4, 20)
    x[0, 3], x[1, 7], x[2, 0] = float("nan"), float("inf"), float("-inf")
    targets = torch.tensor([1, 2, 5, 6])
    got = cross_entropy(x, targets, ignore_index=IGNORE, label_smoothing=eps, reduction="none")
    want = F.cross_entropy(x, targets, label_smoothing=eps, reduction="none")
    assert got[:2].isnan().all() and want[:2].isnan().all()
    torch.testing.assert_close(got[2:], want[2:])  # -inf: +inf with smoothing, else finite


@native
def test_only_padding_gives_nan_as_torch_does_and_a_zero_gradient():
    x = torch.randn(4, 10, requires_grad=True)
    targets = torch.full((4,), IGNORE)
    loss = cross_entropy(x, targets, ignore_index=IGNORE)
    assert loss.isnan() and F.cross_entropy(x, targets, ignore_index=IGNORE).isnan()
    total = cross_entropy(x, targets, ignore_index=IGNORE, reduction="sum")
    total.backward()
    assert total.item() == 0.0 and torch.equal(x.grad, torch.zeros(4, 10))


@native
def test_a_target_out_of_range_is_an_error_not_a_read_past_the_row():
    x = torch.randn(3, 10)
    for bad in (10, -1):
        with pytest.raises(IndexError, match=f"target {bad} is out of bounds for 10 classes"):
            cross_entropy(x, torch.tensor([0, bad, IGNORE]), ignore_index=IGNORE)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, torch.tensor([0, 1, 2]), ignore_index=IGNORE, reduction="max")


def test_where_the_kernel_does_not_apply_it_is_torchs(monkeypatch, reload_kernel):
    logits, targets = torch.randn(6, 11), torch.tensor([0, 3, IGNORE, 10, 4, 4])
    for x in (logits.double(), logits.to(torch.bfloat16)):
        assert not xent.runs_natively(x, targets)
        assert torch.equal(cross_entropy(x, targets, ignore_index=IGNORE, label_smoothing=0.1),
                           F.cross_entropy(x, targets, ignore_index=IGNORE, label_smoothing=0.1))
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert not xent.runs_natively(logits, targets)
    assert torch.equal(cross_entropy(logits, targets, ignore_index=IGNORE),
                       F.cross_entropy(logits, targets, ignore_index=IGNORE))
