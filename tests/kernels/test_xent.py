import pytest
import torch
import torch.nn.functional as F

from tformer.kernels import library, xent
from tformer.kernels.xent import cross_entropy

native = pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")
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


# --- the output layer and the loss together ------------------------------------------------


def linear_reference(x, weight, bias, targets, eps, reduction):
    """The loss of F.linear in float64 through F.cross_entropy, and its input gradients."""
    inputs = [t.double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    logits = F.linear(*inputs)
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE, label_smoothing=eps,
                           reduction=reduction)
    (loss * 0.75).backward()  # an upstream gradient other than 1
    return loss.detach(), [t.grad if t is not None else None for t in inputs]


@native
@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 64])
@pytest.mark.parametrize("eps, reduction, bias", [(0.0, "mean", False), (0.1, "mean", True),
                                                  (0.1, "sum", False), (0.0, "sum", True)])
def test_the_fused_output_layer_and_loss_match_float64_linear_then_cross_entropy(
        chunk_rows, eps, reduction, bias, monkeypatch):
    n, d, v = 19, 12, 300
    monkeypatch.setattr(xent, "CHUNK_BYTES", chunk_rows * v * 4)  # 19 rows: several chunks
    torch.manual_seed(chunk_rows)
    x, weight = torch.randn(n, d), torch.randn(v, d) / 2
    b = torch.randn(v) if bias else None
    targets = torch.randint(0, v, (n,))
    targets[[2, 11]] = IGNORE
    inputs = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, b)]
    loss = xent.linear_cross_entropy(*inputs, targets, ignore_index=IGNORE,
                                     label_smoothing=eps, reduction=reduction)
    (loss * 0.75).backward()
    want, want_grads = linear_reference(x, weight, b, targets, eps, reduction)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(inputs, want_grads, strict=True):
        if got is not None:
            torch.testing.assert_close(got.grad.double(), ref, rtol=1e-4, atol=1e-5)


@native
def test_the_fused_loss_takes_the_gradients_asked_for_and_none_without_autograd():
    x, weight = torch.randn(5, 8), torch.randn(30, 8)
    targets = torch.tensor([1, 2, IGNORE, 29, 0])
    want = F.cross_entropy(F.linear(x, weight), targets, ignore_index=IGNORE)
    frozen = x.clone().requires_grad_()  # a frozen output layer: only the states' gradient
    loss = xent.linear_cross_entropy(frozen, weight, None, targets, ignore_index=IGNORE)
    loss.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(frozen.grad, torch.func.grad(
        lambda s: F.cross_entropy(F.linear(s, weight), targets, ignore_index=IGNORE))(x))
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(
            xent.linear_cross_entropy(x, weight, None, targets, ignore_index=IGNORE), want)
    total = xent.linear_cross_entropy(x, weight, None, torch.full((5,), IGNORE),
                                      ignore_index=IGNORE)
    assert total.isnan()  # only padding: NaN, as torch gives


def test_the_fused_loss_falls_back_to_the_unfused_one(monkeypatch, reload_kernel):
    x, weight = torch.randn(6, 4), torch.randn(11, 4)
    targets = torch.tensor([0, 3, IGNORE, 10, 4, 4])
    for args in ((x.double(), weight.double()), (x.to(torch.bfloat16), weight.to(torch.bfloat16))):
        got = xent.linear_cross_entropy(*args, None, targets, ignore_index=IGNORE)
        want = F.cross_entropy(F.linear(*args).float(), targets, ignore_index=IGNORE)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    none = xent.linear_cross_entropy(x, weight, None, targets, ignore_index=IGNORE,
                                     reduction="none")
    assert none.shape == (6,)
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    torch.testing.assert_close(
        xent.linear_cross_entropy(x, weight, None, targets, ignore_index=IGNORE),
        F.cross_entropy(F.linear(x, weight), targets, ignore_index=IGNORE))
    with pytest.raises(ValueError, match="reduction"):
        xent.linear_cross_entropy(x, weight, None, targets, ignore_index=IGNORE, reduction="max")


@native
def test_a_target_out_of_range_is_an_error_for_the_fused_loss_too():
    x, weight = torch.randn(3, 4), torch.randn(10, 4)
    with pytest.raises(IndexError, match="target 10 is out of bounds for 10 classes"):
        xent.linear_cross_entropy(x, weight, None, torch.tensor([0, 10, IGNORE]),
                                  ignore_index=IGNORE)
