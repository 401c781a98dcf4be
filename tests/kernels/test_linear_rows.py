"""kinds.c's products of row ranges (tformer_linear_rows) over activations rounded once:
each kind's outputs for any rows of x and any range of W's rows are tformer_linear's, bit
for bit, on every block path."""

import ctypes

import pytest
import torch

from tformer.kernels import blocks, library

lib = library.load()
pytestmark = pytest.mark.skipif(lib is None or not blocks.available(), reason="no C kernels")

KINDS = ["fp32", "q8_0", "q4_0", "q5_1", "q4_k", "q6_k"]
PATHS = [blocks.ISA_GENERIC, blocks.ISA_AVX2, blocks.ISA_AVX_VNNI, blocks.ISA_AVX512_VNNI]


def layer(kind: str, w: torch.Tensor, bias: torch.Tensor):
    n, k = w.shape
    if kind == "fp32":
        return library.Linear(library.KIND_FP32, n, k, w.data_ptr(), None, bias.data_ptr()), w
    data = blocks.quantize(w, kind)
    return library.Linear(blocks.KINDS[kind], n, k, data.data_ptr(), None, bias.data_ptr(),
                          None, None, 0, 1 << 30), data


@pytest.mark.parametrize("kind", KINDS)
def test_row_ranges_are_the_whole_product_s_outputs(kind):
    g = torch.Generator().manual_seed(0)
    n, k, m = 42, 512, 6
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    struct, held = layer(kind, w, bias)
    geometry = (ctypes.c_int32 * 3)()
    lib.tformer_kind_geometry(struct.kind, geometry)
    was = lib.tformer_blocks_isa(-1)
    try:
        for path in PATHS:
            if lib.tformer_blocks_isa(path) != path:
                continue
            for rows in range(1, m + 1):
                whole = torch.empty(rows, n)
                assert lib.tformer_linear(ctypes.byref(struct), x.data_ptr(), whole.data_ptr(),
                                          rows, 1) == 0
                rounded = library.Activations()
                assert lib.tformer_round_activations(ctypes.byref(rounded), geometry[2],
                                                     x.data_ptr(), m, k, 1) == 0
                try:
                    for i0 in range(m - rows + 1):
                        # rows i0 .. of x: the product of those rows alone
                        alone = torch.empty(rows, n)
                        lib.tformer_linear(ctypes.byref(struct), x[i0:].data_ptr(),
                                           alone.data_ptr(), rows, 1)
                        for r0, r1 in ((0, n), (3, 17), (17, n), (5, 6)):
                            y = torch.full((rows, 50), float("nan"))
                            assert lib.tformer_linear_rows(
                                ctypes.byref(struct), ctypes.byref(rounded), i0, rows,
                                y.data_ptr(), 50, r0, r1) == 0
                            assert torch.equal(y[:, :r1 - r0], alone[:, r0:r1]), (path, rows)
                            assert y[:, r1 - r0:].isnan().all()
                        if i0 == 0:
                            assert torch.equal(alone, whole)
                finally:
                    lib.tformer_free_activations(ctypes.byref(rounded))
    finally:
        lib.tformer_blocks_isa(was)
    del held


def test_a_stack_has_no_row_ranges():
    stack = library.Linear(library.KIND_STACK, 4, 32)
    rounded = library.Activations()
    assert lib.tformer_linear_rows(ctypes.byref(stack), ctypes.byref(rounded), 0, 1, None, 4,
                                   0, 4) == -3
