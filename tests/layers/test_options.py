"""The activations and sinusoid layouts that reference architectures need, against the
formulas computed another way (Python's math on floats)."""

from __future__ import annotations

import math

import pytest
import torch

from tformer.layers import ACTIVATIONS, sinusoids


def gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


@pytest.mark.parametrize("name,formula", [
    ("gelu_tanh", gelu_tanh),
    ("gelu", gelu_erf),
    ("silu", lambda x: x / (1.0 + math.exp(-x))),
    ("relu", lambda x: max(x, 0.0)),
])
def test_activations_match_their_formulas(name, formula):
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    got = ACTIVATIONS[name]()(x)
    expected = torch.tensor([formula(float(v)) for v in x], dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)


def test_tanh_and_erf_gelu_are_different_functions():
    x = torch.tensor([1.5], dtype=torch.float64)
    assert abs(float(ACTIVATIONS["gelu_tanh"]()(x) - ACTIVATIONS["gelu"]()(x))) > 1e-5


@pytest.mark.parametrize("d_model", [8, 6])
def test_sinusoid_layouts_against_a_loop(d_model):
    positions = torch.arange(0, 50, 7)
    halves = sinusoids(positions, d_model, "halves")
    interleaved = sinusoids(positions, d_model, "interleaved")
    for row, pos in enumerate(positions.tolist()):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert halves[row, i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert halves[row, d_model // 2 + i] == pytest.approx(math.cos(angle), abs=1e-5)
            assert interleaved[row, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert interleaved[row, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)


def test_unknown_sinusoid_layout_is_refused():
    with pytest.raises(ValueError, match="halves"):
        sinusoids(torch.arange(3), 4, "diagonal")


def float64_sinusoid(pos: int, dim: int, d_model: int) -> float:
    """Dimension `dim` of the paper's encoding of `pos` (sec. 3.5), in Python floats."""
    angle = pos / 10000 ** ((dim - dim % 2) / d_model)
    return math.sin(angle) if dim % 2 == 0 else math.cos(angle)


@pytest.mark.parametrize("d_model", [16, 15])
def test_sinusoids_are_computed_in_the_dtype_asked_for(d_model):
    positions = torch.tensor([0, 1, 7, 250, 500, 999])
    table = sinusoids(positions, d_model, "interleaved", torch.float64)
    assert table.dtype == torch.float64
    want = torch.tensor([[float64_sinusoid(p, i, d_model) for i in range(d_model)]
                         for p in positions.tolist()], dtype=torch.float64)
    torch.testing.assert_close(table, want, atol=1e-12, rtol=0)
    # halves: the same values, sines first.
    halves = sinusoids(positions, d_model, "halves", torch.float64)
    torch.testing.assert_close(
        halves, torch.cat([want[:, 0::2], want[:, 1::2]], dim=1), atol=1e-12, rtol=0
    )
    assert sinusoids(positions, d_model).dtype == torch.float32


def test_the_position_table_is_the_float64_table_rounded_once():
    from tformer.layers import SinusoidalPositions

    table = SinusoidalPositions(600, 32).table
    want = torch.tensor([[float64_sinusoid(p, i, 32) for i in range(32)] for p in range(600)],
                        dtype=torch.float64)
    assert table.dtype == torch.float32
    # float32 rounding of each value, not of the angles (which is ~1.6e-5 off at 500).
    assert (table.double() - want).abs().max() < 1e-7
