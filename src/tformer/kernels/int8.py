"""int8 products of a few rows (int8.c), and the entry every int8 product goes through
(linear_int8): the kernels of the int8 weight format (quantize.py's modules).

The int8 product reads a quarter of fp32's bytes and sums in exact 32-bit integers. On
CPUs with AVX-512 VNNI, products of two to eight rows use its 8-bit dot-product
instruction, with the same sums. With AVX2 alone there are two exact ways, timed once per
process (AVX2_WIDEN, AVX2_SIGN): 16-bit multiply-adds over widened bytes, or the byte
multiply-add with x's sign moved onto the weights. Products of more rows run over a copy
of the weight packed once (pack_int8, int8_packed.py). Every instruction set and method
gives the same bits; `check` makes sure of it, once per process, and keeps the fastest
that does.
"""

from __future__ import annotations

import ctypes
import logging
import time

import torch
from torch import Tensor

from tformer.kernels import library
from tformer.kernels.int8_packed import (
    PackedInt8,
    call_linear_int8_packed,
    call_pack,
    packs_right,
)
from tformer.kernels.rounding import int8_reference, torch_quantize_rows

log = logging.getLogger(__name__)

INT8_MAX_ROWS = 8
"""The few-row int8 kernel is the fast one up to about this many rows; from there the
product over packed weights (pack_int8, PACKED_MIN_ROWS) or oneDNN's int8 matrix product
(torch._int_mm, with VNNI) is faster (benchmarks/int8_rows.py). step.py gives int8 layers
without packed weights no more rows than this."""
AVX2_WIDEN, AVX2_SIGN = 0, 1
"""int8.c's two AVX2 products of a few int8 rows (i8_rows_of_w; rows_of_w_sign in
int8_bytes.h): the same exact sums, by 16-bit multiply-adds over widened bytes or by the
byte multiply-add with x's sign moved onto w. Which is faster depends on the CPU's
execution ports (benchmarks/README.md, "The kernels' thresholds"): check() times both once
(_faster_avx2_method) and keeps the faster."""


def check(lib: ctypes.CDLL) -> bool:
    """The int8 products against int8_reference, bit for bit, under every instruction set
    and AVX2 method this CPU has, the AVX2 path first, as it is the one left if another's
    fails: a method or level that computes wrong is not used (with a warning), and of the
    two AVX2 methods the faster on this CPU is kept. False where even AVX2's widening
    product is wrong."""
    best = lib.tformer_isa(-1)
    lib.tformer_isa(library.ISA_AVX2)
    lib.tformer_avx2_method(AVX2_SIGN)
    sign_right = _computes_right(lib) and packs_right(lib)
    lib.tformer_avx2_method(AVX2_WIDEN)
    if not (_computes_right(lib) and packs_right(lib)):
        return False
    if sign_right:
        lib.tformer_avx2_method(_faster_avx2_method(lib))
    else:
        log.warning("the int8 products' AVX2 byte path computed a wrong product; not using it")
    if best != library.ISA_AVX2:
        lib.tformer_isa(best)
        if not (_computes_right(lib) and packs_right(lib)):
            lib.tformer_isa(library.ISA_AVX2)
            log.warning("the int8 products' %s path computed a wrong product; using AVX2",
                        library.ISA_NAMES[_isa_name(best)])
    log.info("tformer's int8 kernels use %s",
             library.ISA_NAMES[_isa_name(lib.tformer_isa(-1))])
    return True


def _isa_name(level: int) -> str:
    return next(name for name, value in library.ISA_LEVELS.items() if value == level)


def _library() -> ctypes.CDLL | None:
    return library.checked(check)


def available() -> bool:
    """Whether int8 products run the kernels here (else torch's integer product)."""
    return _library() is not None


def isa() -> str:
    """The instruction set this process's int8 kernels use, one of library.ISAS: the best
    load() found, unless check() found it wrong."""
    lib = _library()
    return "torch" if lib is None else _isa_name(lib.tformer_isa(-1))


def _computes_right(lib: ctypes.CDLL) -> bool:
    """The few-row products on every path: 1 to 5 rows (one of them all zero), a remainder
    of rows of W, and a remainder of the inner dimension (of 16 or 32), against
    int8_reference bit for bit, from int8 rows and from fp32 ones."""
    w, b = torch.randn(11, 37), torch.randn(11)
    q, wscale = torch_quantize_rows(w)
    for m in range(1, 6):
        rows = torch.randn(m, 37) * torch.logspace(-3, 3, m)[:, None]
        rows[m // 2] = 0.0
        xq, xscale = torch_quantize_rows(rows)
        int8 = _call_int8(lib, xq, xscale, q, wscale, b)
        if not (torch.equal(int8, int8_reference(xq, xscale, q, wscale, b))
                and torch.equal(call_linear_int8(lib, rows, q, wscale, b), int8)):
            return False
    return True


def _faster_avx2_method(lib: ctypes.CDLL) -> int:
    """The faster of the AVX2 few-row int8 products on this CPU (AVX2_WIDEN or AVX2_SIGN),
    timed in alternation on what beam search at batch 1 multiplies: four rows, here by a
    1024 x 512 matrix that stays in the L2 cache. About 5 ms, once per process."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (1024, 512), dtype=torch.int8, generator=g)
    xq = torch.randint(-127, 128, (4, 512), dtype=torch.int8, generator=g)
    xscale, wscale = torch.rand(4, generator=g), torch.rand(1024, generator=g)
    best = {AVX2_WIDEN: float("inf"), AVX2_SIGN: float("inf")}
    for _ in range(5):
        for method in best:
            lib.tformer_avx2_method(method)
            start = time.perf_counter()
            for _ in range(10):
                _call_int8(lib, xq, xscale, q, wscale, None)
            best[method] = min(best[method], time.perf_counter() - start)
    faster = min(best, key=best.get)
    log.info("AVX2 int8 products of a few rows: %s (%.2f against %.2f ms)",
             "bytes with the sign moved" if faster == AVX2_SIGN else "16-bit widening",
             best[faster] * 1e3, max(best.values()) * 1e3)
    return faster


def _call_int8(
    lib: ctypes.CDLL, xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    m, (n, k) = xq.shape[0], q.shape
    y = xscale.new_empty(m, n)
    if lib.tformer_matvec_int8(xq.data_ptr(), xscale.data_ptr(), q.data_ptr(), wscale.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                               torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y


def call_linear_int8(
    lib: ctypes.CDLL, x: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    m, (n, k) = x.shape[0], q.shape
    y = x.new_empty(m, n)
    if lib.tformer_linear_int8(x.data_ptr(), q.data_ptr(), wscale.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                               torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y


def pack_int8(q: Tensor) -> PackedInt8 | None:
    """q (N x K int8, contiguous, on the CPU) packed for linear_int8's products of many rows
    with this process's instruction set, or None where there is no kernel."""
    lib = _library()
    if lib is None:
        return None
    return call_pack(lib, q.contiguous(), lib.tformer_pack_layout())


def fits_int8_kernel(q: Tensor, wscale: Tensor, bias: Tensor | None) -> bool:
    """Whether linear_int8's kernels can read this weight side: q (N, K) int8, wscale (N,)
    fp32, bias (N,) fp32 or None, contiguous and on the CPU."""
    n = q.shape[0]
    return (q.dtype == torch.int8 and wscale.dtype == torch.float32 and wscale.shape == (n,)
            and q.is_contiguous() and wscale.is_contiguous() and q.device.type == "cpu"
            and wscale.device.type == "cpu"
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)
                                  and bias.is_contiguous() and bias.device.type == "cpu")))


def linear_int8(
    x: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None, packed: PackedInt8 | None = None
) -> Tensor:
    """y = x W^T + b with x's rows and W rounded to int8 (rounding.quantize_rows; W as q and
    wscale):
    (xq q^T) * (xscale wscale^T) + bias, summed exactly. From `packed.min_rows` rows on
    (PACKED_MIN_ROWS), through the product over `packed` (pack_int8(q)) where it is given;
    else through the few-row kernel, rounding included (fast up to INT8_MAX_ROWS rows, a
    decoding step's); where there is no kernel, through torch (int8_reference). All give the
    same bits.

    x: (M, K) fp32; q: (N, K) int8 in [-127, 127] (as quantize_rows rounds) and wscale: (N,)
    fp32, contiguous; bias: (N,) fp32 or None; all on the CPU (Int8Linear holds its tensors
    so).
    """
    (m, k), k_q = x.shape, q.shape[1]
    # Checked on every call, so kept to a few comparisons: the kernel reads raw pointers.
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and k == k_q
            and fits_int8_kernel(q, wscale, bias)):
        raise ValueError(f"linear_int8 takes fp32 {m} x K rows and an int8 N x K matrix with "
                         f"fp32 scales and bias on the CPU; got {x.dtype} {tuple(x.shape)} and "
                         f"{q.dtype} {tuple(q.shape)}")
    return linear_int8_unchecked(x.contiguous(), q, wscale, bias, packed)


def linear_int8_unchecked(
    x: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None, packed: PackedInt8 | None
) -> Tensor:
    """linear_int8 with x (M, K) fp32, contiguous, on the CPU, and the rest already checked
    (fits_int8_kernel): for Int8Linear, which checks its own tensors once, when it is made.
    A decoding step makes ~40 products of a few rows, each a few microseconds of work, and
    Python's checks cost a noticeable part of that."""
    lib, m = _library(), x.shape[0]
    if lib is None:
        return int8_reference(*torch_quantize_rows(x), q, wscale, bias)
    if packed is not None and m >= packed.min_rows:
        return call_linear_int8_packed(lib, x, packed, wscale, bias)
    return call_linear_int8(lib, x, q, wscale, bias)
