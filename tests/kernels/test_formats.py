"""The weight formats' registry (kernels/formats.py) against the C table (kinds.c) and the
modules it makes: every format's layer computes, through step.c's one entry
(tformer_linear), what its own forward computes, and what the fp32 layer it came from
computes within the format's rounding."""

import ctypes
from dataclasses import replace

import pytest
import torch
from torch import nn

from tformer.errors import TformerError
from tformer.kernels import fp32, library
from tformer.kernels.formats import FORMATS, quantize_model, register, weight_format
from tformer.kernels.step import _linear

native = pytest.mark.skipif(library.load() is None, reason="the kernels are not built here")


@native
def test_the_registry_and_the_c_table_give_each_kind_the_same_name():
    lib = library.load()
    for fmt in FORMATS.values():
        assert lib.tformer_kind_name(fmt.kind).decode() == fmt.name
    assert lib.tformer_kind_name(99) == b""


def test_a_name_or_kind_registered_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register(FORMATS["int8"])
    with pytest.raises(ValueError, match="kind 1 is already taken"):
        register(replace(FORMATS["int8"], name="int8-again"))
    assert "int8-again" not in FORMATS


def test_an_unknown_format_is_one_line_naming_the_known_ones():
    with pytest.raises(TformerError, match="unknown weight format 'int4': use one of fp32, int8"):
        weight_format("int4")
    with pytest.raises(TformerError, match="unknown weight format"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "int4")


def through_the_table(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module` run by step.c's entry for any linear layer: its structure and its kind's row
    of kinds.c's table."""
    bound = _linear(module, f32_rows=1 << 30)
    assert bound is not None
    y = x.new_empty(x.shape[0], bound.struct.n_out)
    status = library.load().tformer_linear(ctypes.byref(bound.struct), x.data_ptr(),
                                           y.data_ptr(), x.shape[0], 1)
    assert status == 0
    return y


@native
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 9, 20])
def test_every_format_computes_through_the_table_what_its_layer_computes(name, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(70, 37)  # remainders of every vector width, and of W's rows
    fmt = FORMATS[name]
    assert fmt.check()
    layer = linear if fmt.quantize is None else fmt.quantize(linear)
    x = torch.randn(rows, 70)
    with torch.no_grad():
        got, own = through_the_table(layer, x), layer(x)
        want = x.double() @ linear.weight.double().T + linear.bias.double()
    if fmt.quantize is None:
        torch.testing.assert_close(got, fp32.matvec(x, linear.weight, linear.bias))
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    else:
        # The layer's own forward runs the same products (or torch's, summing in another
        # order); how close the format comes to fp32 is its own test file's business, here
        # only a bound that a wrong layout or scale would break.
        torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-5 * own.abs().max().item())
        assert (got.double() - want).abs().max().item() < 0.2 * want.abs().max().item()


@native
def test_a_kind_without_a_row_in_the_table_is_refused():
    lib = library.load()
    x, y = torch.zeros(1, 32), torch.zeros(1, 2)
    for kind in (-1, 99, *(k for k in range(8) if lib.tformer_kind_name(k) == b"")):
        struct = library.Linear(kind, 2, 32)
        assert lib.tformer_linear(ctypes.byref(struct), x.data_ptr(), y.data_ptr(), 1, 1) == -3
