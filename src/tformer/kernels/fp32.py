"""fp32 products of a few rows (fp32.c): the kernel of the fp32 weight format.

At batch 1 a GPT decoding step multiplies one row by every weight matrix, and beam search
at batch 1 multiplies four. The library kernels are built for larger products: oneDNN's
prepacked one (prepack.py) streams the weights slower than a plain sum reads them, and
every call costs it a fixed time however small the matrix. `fp32.c` streams the weights at
about the sum's rate at a few microseconds a call (the figures: benchmarks/README.md, "The
kernels' thresholds"; benchmarks/speed.py and fp32_rows.py measure them).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.kernels import library
from tformer.kernels.library import BoundLinear, Linear

MAX_ROWS = 4
"""PackedLinear sends products of up to this many rows here. The kernel takes any number,
four at a time, but from about eight rows on oneDNN's matrix-matrix kernels catch up."""


def check(lib: ctypes.CDLL) -> bool:
    """fp32.c against F.linear: 1 to 5 rows, a remainder of rows of W, and a remainder of
    the inner dimension (of 8); and the same product through the kinds table."""
    w, b = torch.randn(11, 37), torch.randn(11)
    for m in range(1, 6):
        x = torch.randn(m, 37)
        want = F.linear(x, w, b)
        y = x.new_empty(m, 11)
        struct = Linear(library.KIND_FP32, 11, 37, w.data_ptr(), None, b.data_ptr())
        if (lib.tformer_linear(ctypes.byref(struct), x.data_ptr(), y.data_ptr(), m, 1)
                or not (torch.allclose(_call(lib, x, w, b), want, atol=1e-4)
                        and torch.allclose(y, want, atol=1e-4))):
            return False
    return True


def _library() -> ctypes.CDLL | None:
    return library.checked(check)


def available() -> bool:
    """Whether fp32 products run fp32.c here (else torch's)."""
    return _library() is not None


def _call(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    m, (n, k) = x.shape[0], weight.shape
    y = x.new_empty(m, n)
    lib.tformer_matvec(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                       y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def fits_kernel(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether the kernel can compute this product: it reads raw pointers as fp32 in
    row-major order, so any other dtype, device, layout or shape would give garbage or
    write past the output."""
    n, k = weight.shape if weight.dim() == 2 else (-1, -1)
    return (
        x.dtype == torch.float32
        and x.shape[-1:] == (k,)
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)
                              and bias.is_contiguous()))
        and all(t.device.type == "cpu" for t in (x, weight, bias) if t is not None)
    )


def matvec(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias) through the kernel.

    x: (..., K) fp32; weight: (N, K) fp32, contiguous; bias: (N,) fp32, contiguous, or
    None; all on the CPU. Any number of rows, but fastest for 1 to MAX_ROWS. Inputs the
    kernel cannot read (another dtype, device or layout), or no kernel, get the same product
    from torch instead.
    """
    lib = _library()
    if lib is None or not fits_kernel(x, weight, bias):
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _call(lib, rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def _is_f32_cpu(t: Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                         and t.is_contiguous())


def bound_linear(module: nn.Module, max_rows: int) -> BoundLinear | None:
    """A linear layer with an fp32 weight (nn.Linear, prepack.PackedLinear) as step.c reads
    it, given at most `max_rows` rows; None where its tensors are not fp32, contiguous, on
    the CPU, or there is no kernel."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not (isinstance(weight, Tensor) and weight.dim() == 2 and _is_f32_cpu(weight)
            and _is_f32_cpu(bias) and available()):
        return None
    n, k = weight.shape
    struct = Linear(library.KIND_FP32, n, k, weight.data_ptr(), None,
                    None if bias is None else bias.data_ptr())
    return BoundLinear(struct, max_rows, tuple(t for t in (weight, bias) if t is not None))
