"""RMSNorm over the last axis on the CPU in one C pass forward and two back (`rmsnorm.c`).

torch runs the norm as five operations forward and about ten backward, each writing a
tensor as large as the input; the kernel keeps one float a row, 1 / rms, for the backward
pass. Same values as tformer.layers.norm.RMSNorm's torch form up to float rounding (its own
order of summation), the weight's gradient summed over the rows in order whatever the
number of threads. Where the kernel does not apply (not float32 CPU tensors, no compiled
kernel, under torch.compile) the layer keeps its torch form.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from tformer.kernels import library


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, through the kernel (see `runs_natively`)."""
    return _RMSNorm.apply(x, weight, float(eps))


def runs_natively(x: Tensor, weight: Tensor) -> bool:
    """Whether `rms_norm` may run for these (else the layer's torch form)."""
    return (
        x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
        and x.dim() >= 1 and x.shape[-1] == weight.shape[0] and x.numel() > 0
        and not torch.compiler.is_compiling() and _library() is not None
    )


def _library() -> ctypes.CDLL | None:
    """The kernels' library (library.load)."""
    return library.load()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        x, weight = x.contiguous(), weight.contiguous()
        d = x.shape[-1]
        rows = x.numel() // d
        y, r = torch.empty_like(x), x.new_empty(rows)
        _library().tformer_rms_norm_forward(x.data_ptr(), weight.data_ptr(), rows, d, eps,
                                            y.data_ptr(), r.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, r = ctx.saved_tensors
        grad = grad.contiguous()
        d = x.shape[-1]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        out = dx if dx is not None else torch.empty_like(x)  # the kernel writes dx regardless
        _library().tformer_rms_norm_backward(
            x.data_ptr(), weight.data_ptr(), r.data_ptr(), grad.data_ptr(), x.numel() // d, d,
            out.data_ptr(), dw.data_ptr() if dw is not None else None, torch.get_num_threads())
        return dx, dw, None
