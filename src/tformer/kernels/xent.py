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

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from tformer.kernels import matvec

REDUCTIONS = ("mean", "sum", "none")


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
    n, v = logits.shape
    real = targets != ignore_index
    if bool(((targets < 0) | (targets >= v)).logical_and_(real).any()):
        bad = targets[real & ((targets < 0) | (targets >= v))][0]
        raise IndexError(f"target {int(bad)} is out of bounds for {v} classes")
    return _CrossEntropy.apply(logits, targets, float(label_smoothing), ignore_index, reduction)


def runs_natively(logits: Tensor, targets: Tensor) -> bool:
    """Whether `cross_entropy` runs the kernel for these (else it is F.cross_entropy)."""
    return (
        logits.dim() == 2 and targets.dim() == 1 and logits.device.type == "cpu"
        and logits.dtype == torch.float32 and targets.dtype == torch.long
        and not torch.compiler.is_compiling() and matvec.load() is not None
    )


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: Tensor, targets: Tensor, eps: float, ignore: int, reduction: str
    ) -> Tensor:
        logits, targets = logits.contiguous(), targets.contiguous()
        n, v = logits.shape
        loss, stats = logits.new_empty(n), logits.new_empty(n, 2)  # max, log-sum-exp - max
        matvec.load().tformer_xent_forward(
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
        matvec.load().tformer_xent_backward(
            logits.data_ptr(), targets.data_ptr(), stats.data_ptr(), per_row.data_ptr(), n, v,
            ctx.eps, ctx.ignore, out.data_ptr(), torch.get_num_threads())
        return out, None, None, None, None
