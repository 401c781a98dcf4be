"""The int8 product of many rows (int8_packed.c): over a copy of the weight packed once for
the instruction set the process uses, from PACKED_MIN_ROWS rows on (beam search over a
batch, scoring whole sequences), where the few-row product (int8.py) stops streaming the
weights well. Never torch._int_mm, which on CPUs without VNNI can be many times slower than
fp32's product. int8.py packs the weights (pack_int8) and calls these products.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
from torch import Tensor

from tformer.kernels import library
from tformer.kernels.rounding import int8_reference, torch_quantize_rows

LAYOUT_AVX2, LAYOUT_VNNI, LAYOUT_AVX2_BYTES = library.ISA_AVX2, library.ISA_AVX512_VNNI, 3
"""tformer.h's TFORMER_ISA_AVX2, TFORMER_ISA_AVX512_VNNI and TFORMER_AVX2_BYTES as packed
layouts: the 16-bit panels of AVX2, the byte groups of AVX-512 VNNI, and AVX2's byte
panels (AVX-VNNI's, and AVX2's where int8.py chose the byte method)."""
PACKED_MIN_ROWS = {LAYOUT_VNNI: 2, LAYOUT_AVX2: 8, LAYOUT_AVX2_BYTES: 2}
"""linear_int8 sends products of this many rows and more to the product over packed weights
(by their layout): one row reads the weights at about the memory's rate through either
kernel; with VNNI the packed product is the faster from two rows on, as is AVX2's over
packed bytes; AVX2's 16-bit packed weights are twice the bytes the few-row kernel streams,
and that product catches up at about eight (benchmarks/int8_rows.py; the figures:
benchmarks/README.md, "The kernels' thresholds")."""


def packs_right(lib: ctypes.CDLL) -> bool:
    """The product over packed weights in the layout of the instruction set set now against
    int8_reference: blocks of rows and a remainder, a part panel, and k not a multiple of
    four. Part of int8.py's check."""
    w, b = torch.randn(45, 37), torch.randn(45)
    q, wscale = torch_quantize_rows(w)
    packed = call_pack(lib, q, lib.tformer_pack_layout())
    for m in (1, 13):
        x = torch.randn(m, 37)
        xq, xscale = torch_quantize_rows(x)
        for bias in (b, None):
            want = int8_reference(xq, xscale, q, wscale, bias)
            if not (torch.equal(call_gemm_int8(lib, xq, xscale, packed, wscale, bias), want)
                    and torch.equal(call_linear_int8_packed(lib, x, packed, wscale, bias),
                                    want)):
                return False
    return True


class PackedInt8(NamedTuple):
    """An int8 weight (N x K) in the layout of the many-row product (tformer_pack_int8) for
    an instruction set (LAYOUT_AVX2 or LAYOUT_VNNI), with the sum of each of its rows, and
    the fewest rows linear_int8 gives that product."""

    data: Tensor
    row_sums: Tensor
    layout: int
    min_rows: int


def call_pack(lib: ctypes.CDLL, q: Tensor, layout: int) -> PackedInt8:
    n, k = q.shape
    packed = PackedInt8(
        torch.empty(lib.tformer_packed_int8_size(n, k, layout), dtype=torch.int8),
        torch.empty(n, dtype=torch.int32), layout, PACKED_MIN_ROWS[layout])
    lib.tformer_pack_int8(q.data_ptr(), n, k, packed.data.data_ptr(), packed.row_sums.data_ptr(),
                          layout)
    return packed


def call_gemm_int8(
    lib: ctypes.CDLL, xq: Tensor, xscale: Tensor, packed: PackedInt8, wscale: Tensor,
    bias: Tensor | None,
) -> Tensor:
    (m, k), n = xq.shape, wscale.shape[0]
    y = xscale.new_empty(m, n)
    if lib.tformer_gemm_int8(xq.data_ptr(), xscale.data_ptr(), packed.data.data_ptr(),
                             packed.row_sums.data_ptr(), wscale.data_ptr(),
                             None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                             packed.layout, torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y


def call_linear_int8_packed(
    lib: ctypes.CDLL, x: Tensor, packed: PackedInt8, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """call_gemm_int8 over x's rows rounded by the kernel: one call, as int8.py's
    call_linear_int8."""
    (m, k), n = x.shape, wscale.shape[0]
    y = x.new_empty(m, n)
    if lib.tformer_linear_int8_packed(x.data_ptr(), packed.data.data_ptr(),
                                      packed.row_sums.data_ptr(), wscale.data_ptr(),
                                      None if bias is None else bias.data_ptr(), y.data_ptr(), m,
                                      n, k, packed.layout, torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y
