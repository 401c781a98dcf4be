"""Cross-entropy with label smoothing, forward and backward, without the log-probabilities.

torch's F.cross_entropy writes log_softmax(logits) into a new tensor as large as the logits
(tokens x vocabulary), reads it back for the loss and again in the backward pass. On a CPU,
where memory traffic sets the pace of these passes, `xent.c` reads the logits twice in the
forward pass, keeping two floats a row (its maximum and log-sum-exp), and once in the
backward pass, which writes the gradient. Where the kernel is not built, or the logits are
not float32 on a CPU, or under torch.compile, this is F.cross_entropy; both give the same
values up to float rounding (the kernel sums the exponentials in another order).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from tformer.kernels import library

REDUCTIONS = ("mean", "sum", "none")


def check(lib: ctypes.CDLL) -> bool:
    """The same for xent.c: the loss and gradient of three rows of 37 logits (a vector's
    worth and a remainder), one of them ignored, against F.cross_entropy's."""
    x, target = torch.randn(3, 37), torch.tensor([5, -100, 36])
    loss, stats = x.new_empty(3), x.new_empty(3, 2)
    lib.tformer_xent_forward(x.data_ptr(), target.data_ptr(), 3, 37, 0.1, -100, loss.data_ptr(),
                             stats.data_ptr(), 1)
    g, grad = torch.ones(3), torch.empty(3, 37)
    lib.tformer_xent_backward(x.data_ptr(), target.data_ptr(), stats.data_ptr(), g.data_ptr(), 3,
                              37, 0.1, -100, grad.data_ptr(), 1)
    want = F.cross_entropy(x, target, label_smoothing=0.1, reduction="none")
    # The gradient written out (the check may run where autograd is off).
    want_grad = x.softmax(dim=-1) - 0.1 / 37
    want_grad[[0, 2], [5, 36]] -= 0.9
    want_grad[1] = 0.0
    return torch.allclose(loss, want, atol=1e-5) and torch.allclose(grad, want_grad, atol=1e-6)


def native() -> ctypes.CDLL | None:
    """The kernels' library, where this module's kernels passed their check; else None."""
    return library.checked(check)


def cross_entropy(
    logits: Tensor, targets: Tensor, *, ignore_index: int, label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """F.cross_entropy(logits, targets, ...) for (N, V) logits and (N,) targets: "mean"
    averages over the rows whose target is not ignore_index (NaN if there are none), "none"
    gives each row's loss (0 where ignored)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction = {reduction!r}: one of {', '.join(REDUCTIONS)}")
    if not runs_natively(logits, targets):
        return F.cross_entropy(logits, targets, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)
    check_targets(targets, logits.shape[1], ignore_index)
    return _CrossEntropy.apply(logits, targets, float(label_smoothing), ignore_index, reduction)


def check_targets(targets: Tensor, v: int, ignore_index: int) -> None:
    """IndexError unless every target but ignore_index is in [0, v): the kernel would read
    outside its row."""
    real = targets != ignore_index
    if bool(((targets < 0) | (targets >= v)).logical_and_(real).any()):
        bad = targets[real & ((targets < 0) | (targets >= v))][0]
        raise IndexError(f"target {int(bad)} is out of bounds for {v} classes")


def runs_natively(logits: Tensor, targets: Tensor) -> bool:
    """Whether `cross_entropy` runs the kernel for these (else it is F.cross_entropy)."""
    return (
        logits.dim() == 2 and targets.dim() == 1 and logits.device.type == "cpu"
        and logits.dtype == torch.float32 and targets.dtype == torch.long
        and not torch.compiler.is_compiling() and native() is not None
    )


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: Tensor, targets: Tensor, eps: float, ignore: int, reduction: str
    ) -> Tensor:
        logits, targets = logits.contiguous(), targets.contiguous()
        n, v = logits.shape
        loss, stats = logits.new_empty(n), logits.new_empty(n, 2)  # max, log-sum-exp - max
        native().tformer_xent_forward(
            logits.data_ptr(), targets.data_ptr(), n, v, eps, ignore, loss.data_ptr(),
            stats.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(logits, targets, stats)
        ctx.eps, ctx.ignore, ctx.reduction = eps, ignore, reduction
        if reduction == "none":
            return loss
        # Summed in float64, as the rows' losses are many and of one sign.
        total = loss.sum(dtype=torch.float64)
        if reduction == "mean":
            ctx.count = int((targets != ignore).sum())
            total = total / ctx.count if ctx.count else total.new_tensor(float("nan"))
        return total.float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, targets, stats = ctx.saved_tensors
        n, v = logits.shape
        if ctx.reduction == "none":
            per_row = grad.float().contiguous()
        else:
            scale = grad.float() / ctx.count if ctx.reduction == "mean" else grad.float()
            per_row = scale.expand(n).contiguous()
        out = torch.empty_like(logits)
        native().tformer_xent_backward(
            logits.data_ptr(), targets.data_ptr(), stats.data_ptr(), per_row.data_ptr(), n, v,
            ctx.eps, ctx.ignore, out.data_ptr(), torch.get_num_threads())
        return out, None, None, None, None


# --- the output layer and the loss together --------------------------------------------

CHUNK_BYTES = 128 << 20
"""The size of the logits `linear_cross_entropy` holds at once: 682 rows of a vocabulary of
49,152 in float32."""


def linear_cross_entropy(
    x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, *, ignore_index: int,
    label_smoothing: float = 0.0, reduction: str = "mean",
) -> Tensor:
    """cross_entropy(F.linear(x, weight, bias), targets, ...) for (N, D) states and a (V, D)
    output layer, without ever holding the (N, V) logits.

    The rows are taken a chunk at a time (CHUNK_BYTES of logits) into one buffer that is
    kept from call to call: each chunk's logits are formed, scored, turned in place into
    their gradient, and multiplied out into the gradients of x, weight and bias. Where a
    gradient is wanted they are all computed here, in the forward pass, and the backward pass
    only scales them. The logits of a large vocabulary are the largest tensor of a step
    (tokens x 49,152 floats for SmolLM2, 151,936 for Qwen): here they are neither kept for
    the backward pass nor written to fresh memory, whose first touch costs more than the
    arithmetic on some machines. Same values as the unfused loss up to float rounding: the
    weight's gradient is summed chunk by chunk.

    Reduction "none", and wherever `cross_entropy` would not run the kernel, is the unfused
    computation.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction = {reduction!r}: one of {', '.join(REDUCTIONS)}")
    fused = (
        reduction != "none" and x.dim() == 2 and weight.dim() == 2
        and x.dtype == weight.dtype == torch.float32 and weight.device.type == "cpu"
        and (bias is None or bias.dtype == torch.float32) and runs_natively(x, targets)
    )
    if not fused:  # in float32 whatever the layer's dtype, as the training losses are taken
        return cross_entropy(F.linear(x, weight, bias).float(), targets,
                             ignore_index=ignore_index,
                             label_smoothing=label_smoothing, reduction=reduction)
    check_targets(targets, weight.shape[0], ignore_index)
    return _LinearCrossEntropy.apply(x, weight, bias, targets, float(label_smoothing),
                                     ignore_index, reduction)


_buffers: list[Tensor] = []
"""Chunk buffers of earlier calls, for the next to take (one a call; a second caller at the
same time makes its own)."""


def _take_buffer(floats: int) -> Tensor:
    buffer = _buffers.pop() if _buffers else None
    if buffer is None or buffer.numel() < floats:
        buffer = torch.empty(floats)
    return buffer


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, eps: float,
        ignore: int, reduction: str,
    ) -> Tensor:
        x, targets = x.contiguous(), targets.contiguous()
        n, v = x.shape[0], weight.shape[0]
        lib, threads = native(), torch.get_num_threads()
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        count = int((targets != ignore).sum())
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.empty_like(weight) if want_w else None
        grad_b = torch.empty_like(bias) if want_b else None
        # As few chunks as CHUNK_BYTES allows, of equal size (no sliver of a last chunk).
        chunks = -(-n * v * 4 // CHUNK_BYTES)
        rows = -(-n // chunks)
        buffer = _take_buffer(rows * v)
        loss, stats = x.new_empty(n), x.new_empty(n, 2)
        # The gradients of the rows' summed loss; the mean's 1 / count is the backward
        # pass's, with the upstream gradient: a trainer that multiplies the mean by its count
        # again (tformer's does) gets a factor of exactly 1 and no rounding of its own, as
        # the unfused loss's gradient does. (Rounding it twice moved the weights of a
        # two-process run by 1e-4 from a one-process one under Muon.)
        per_row = x.new_ones(rows)
        w_t = weight.t()
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            m = stop - start
            xs, ts, logits = x[start:stop], targets[start:stop], buffer[: m * v].view(m, v)
            if bias is None:
                torch.mm(xs, w_t, out=logits)
            else:
                torch.addmm(bias, xs, w_t, out=logits)
            lib.tformer_xent_forward(logits.data_ptr(), ts.data_ptr(), m, v, eps, ignore,
                                     loss[start].data_ptr(), stats[start].data_ptr(), threads)
            if not (want_x or want_w or want_b):
                continue
            # The logits become their gradient (the kernel reads each float before it
            # writes it), which multiplies out into the inputs' gradients.
            lib.tformer_xent_backward(logits.data_ptr(), ts.data_ptr(), stats[start].data_ptr(),
                                      per_row.data_ptr(), m, v, eps, ignore, logits.data_ptr(),
                                      threads)
            if grad_x is not None:
                torch.mm(logits, weight, out=grad_x[start:stop])
            if grad_w is not None:  # the first chunk sets the gradients, the others add
                grad_w.addmm_(logits.t(), xs, beta=1.0 if start else 0.0)
            if grad_b is not None and start == 0:
                torch.sum(logits, 0, out=grad_b)
            elif grad_b is not None:
                grad_b += logits.sum(0)
        _buffers.append(buffer)
        ctx.save_for_backward(*(g for g in (grad_x, grad_w, grad_b) if g is not None))
        ctx.wanted = (want_x, want_w, want_b)
        ctx.count = count if reduction == "mean" else 1
        total = loss.sum(dtype=torch.float64)  # in float64, as cross_entropy sums
        if reduction == "mean":
            total = total / count if count else total.new_tensor(float("nan"))
        return total.float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if wanted else None for wanted in ctx.wanted]
        factor = grad.float() / ctx.count
        if ctx.count and float(factor) != 1.0:  # no padding-only batch, nothing to scale
            grads = [g.mul_(factor) if g is not None else None for g in grads]
        return *grads, None, None, None, None
