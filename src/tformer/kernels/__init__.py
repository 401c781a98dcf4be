"""CPU fast paths for inference: a hand-written kernel for products of a few rows
(matvec.py, matvec.c), linear layers with prepacked weights (prepack.py) and int8 linear
layers (quantize.py). Each is optional and checked against the plain torch path."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing the package (as the CLI does at start-up) does not import torch
    from torch import nn


def inference_model(model: nn.Module, int8: bool) -> nn.Module:
    """The model as decoding, evaluation and serving run it: int8 linear layers if asked,
    else (fp32 on the CPU) linear layers with weights prepacked for the small matmuls of
    decoding; unchanged elsewhere."""
    if int8:
        from tformer.kernels.quantize import quantize_int8

        return quantize_int8(model)
    from tformer.kernels.prepack import prepack

    return prepack(model)
