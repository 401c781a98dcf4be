"""Rounding fp32 rows to int8, one scale a row, and the exact integer products of such rows
through torch: the two ends of every int8 product (quantize.c's kernels where the library
is built, else torch's formula, with the same bits) and the reference the kernels are
checked against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.kernels import library

log = logging.getLogger(__name__)


def check(lib: ctypes.CDLL) -> bool:
    """quantize.c against torch: rows of every size (one of them all zero) and a remainder
    of the inner dimension, rounded to the same bits; the scaling of integer sums the same
    bits as int8_reference's."""
    w = torch.randn(11, 37)
    q, wscale = torch_quantize_rows(w)
    for m in range(1, 6):
        rows = torch.randn(m, 37) * torch.logspace(-3, 3, m)[:, None]
        rows[m // 2] = 0.0
        xq, xscale = _call_quantize(lib, rows)
        want_q, want_scale = torch_quantize_rows(rows)
        b = torch.randn(11)
        if not (torch.equal(xq, want_q) and torch.equal(xscale, want_scale)
                and torch.equal(_int_mm_scaled(lib, xq, xscale, q, wscale, b),
                                int8_reference(xq, xscale, q, wscale, b))
                and torch.equal(_int_mm_scaled(lib, xq, xscale, q, wscale, None),
                                int8_reference(xq, xscale, q, wscale, None))):
            return False
    return True


def _library() -> ctypes.CDLL | None:
    return library.checked(check)


def _call_quantize(lib: ctypes.CDLL, x: Tensor) -> tuple[Tensor, Tensor]:
    m, k = x.shape
    xq, xscale = x.new_empty(m, k, dtype=torch.int8), x.new_empty(m)
    lib.tformer_quantize_rows(x.data_ptr(), xq.data_ptr(), xscale.data_ptr(), m, k)
    return xq, xscale


def _int_mm_scaled(
    lib: ctypes.CDLL, xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """int8_reference's product, the scaling done by the kernel: one pass over the sums,
    in place, instead of torch's four."""
    acc = integer_product(xq, q).contiguous()
    m, n = acc.shape
    lib.tformer_scale_int8(acc.data_ptr(), xscale.data_ptr(), wscale.data_ptr(),
                           None if bias is None else bias.data_ptr(), m, n,
                           torch.get_num_threads())
    return acc.view(torch.float32)


def torch_quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_rows's formula in torch."""
    scale = x.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) fp32 as int8 rows with one fp32 scale per row, x[i] ~ xq[i] * scale[i]:
    scale = max |x[i]| / 127 (1 for an all-zero row), xq[i] = x[i] / scale rounded half to
    even. Through the kernel where it is built (one call instead of five torch operations),
    with the same bits as torch's formula."""
    lib = _library()
    if lib is None or not (x.dtype == torch.float32 and x.device.type == "cpu"
                           and x.dim() == 2 and x.is_contiguous()):
        return torch_quantize_rows(x)
    return _call_quantize(lib, x)


def int8_reference(
    xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """(xq q^T) * (xscale wscale^T) + bias through torch: the integer product exact
    (integer_product), then the same fp32 operations, in the same order, as the kernel's."""
    y = integer_product(xq, q).float().mul_(xscale[:, None] * wscale)
    return y if bias is None else y.add_(bias)


def scaled_integer_product(
    xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """int8_reference's result, bit for bit, for q (N x K) int8 or a transposed view of
    one, the scaling done in place by the kernel where it is built (Int8Linear's training
    twin, quantize.FrozenInt8Linear, multiplies by W and by W^T)."""
    lib = _library()
    if lib is None:
        return int8_reference(xq, xscale, q, wscale, bias)
    return _int_mm_scaled(lib, xq, xscale, q, wscale, bias)


EXACT_K = 1040
"""fp32 sums of this many int8 products are exact: every partial sum is an integer below
1040 * 127^2 < 2^24, which fp32 holds exactly, whatever order a matmul adds them in."""


def integer_product(xq: Tensor, q: Tensor) -> Tensor:
    """xq q^T (M x N int32) for int8 xq (M x K) and q (N x K), summed exactly, through torch:
    torch._int_mm where it is exact and the faster (_int_mm_serves), else fp32 products of
    slices of EXACT_K columns, each exact, added as integers."""
    if _int_mm_serves():
        return torch._int_mm(xq, q.t())
    return _float_integer_product(xq, q)


def _float_integer_product(xq: Tensor, q: Tensor) -> Tensor:
    k = xq.shape[1]
    total = None
    for start in range(0, max(k, 1), EXACT_K):
        part = F.linear(xq[:, start:start + EXACT_K].float(), q[:, start:start + EXACT_K].float())
        part = part.to(torch.int32)
        total = part if total is None else total.add_(part)
    return total


@functools.cache
def _int_mm_serves() -> bool:
    """Whether torch._int_mm sums exactly, and no slower than _float_integer_product, on
    this CPU: decided once, on a product of 64 rows with the largest terms int8 makes. Where
    the CPU lacks VNNI, oneDNN's int8 product can sum pairs of unsigned-by-signed products
    in saturating 16-bit lanes (vpmaddubsw), and off by millions; or be exact but many
    times slower than fp32's product."""
    g = torch.Generator().manual_seed(0)
    xq = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=g)
    q = torch.randint(-127, 128, (256, 256), dtype=torch.int8, generator=g)
    xq[0], xq[1], q[0] = 127, -127, 127
    try:
        if not torch.equal(torch._int_mm(xq, q.t()).long(), xq.long() @ q.long().t()):
            log.info("torch._int_mm does not sum exactly here: int8 products through fp32")
            return False
    except RuntimeError:
        return False

    def fastest(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn(xq, q)
            times.append(time.perf_counter() - start)
        return min(times)

    return fastest(lambda a, b: torch._int_mm(a, b.t())) <= fastest(_float_integer_product)
