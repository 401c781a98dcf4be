"""SwiGLU's gate, silu(gate) * up, for training on the CPU in one pass forward and one back.

As torch operations the gate is silu and a product, forward, and three passes backward,
with silu's output kept between them; `glu.c` reads the two inputs once and writes the
output, and backward writes both gradients from the inputs and the upstream gradient,
keeping nothing else. Same values as F.silu(gate) * up up to float rounding (its own exp).
Where the kernel does not apply (not float32 CPU tensors of one shape, no compiled kernel,
under torch.compile) this is F.silu(gate) * up.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from tformer.kernels import library


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """F.silu(gate) * up for tensors of one shape."""
    if not runs_natively(gate, up):
        return F.silu(gate) * up
    return _SiluMul.apply(gate, up)


def runs_natively(gate: Tensor, up: Tensor) -> bool:
    """Whether `silu_mul(gate, up)` runs the kernel (else it is torch's)."""
    return (
        gate.shape == up.shape and gate.device.type == up.device.type == "cpu"
        and gate.dtype == up.dtype == torch.float32 and not torch.compiler.is_compiling()
        and _library() is not None
    )


def _library() -> ctypes.CDLL | None:
    """The kernels' library (library.load)."""
    return library.load()


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        _library().tformer_silu_mul_forward(gate.data_ptr(), up.data_ptr(), out.data_ptr(),
                                            gate.numel(), torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        _library().tformer_silu_mul_backward(gate.data_ptr(), up.data_ptr(), grad.data_ptr(),
                                             d_gate.data_ptr(), d_up.data_ptr(), gate.numel(),
                                             torch.get_num_threads())
        return d_gate, d_up
