"""Int8 weights for CPU decoding.

Every nn.Linear becomes an int8 one: weights rounded to int8 with one fp32 scale per output
row (symmetric, the largest weight of a row maps to 127), activations kept in fp32. At
batch 1 a decoding step reads every weight once, so a quarter of the bytes is most of the
speed-up. Embedding tables stay fp32 (a step reads only one row of them).

The products run in matvec's kernel, which widens the int8 weights to floats in registers.
Where that kernel cannot be built (see matvec.py), PyTorch's dynamic quantization does the
job instead: the same int8 weights per row, but it also rounds the activations to 8 bits
for each product, so its results differ a little more from fp32.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.errors import TformerError
from tformer.kernels import matvec
from tformer.kernels.prepack import PackedLinear, prepack_available, swap_linears


class Int8Linear(nn.Module):
    """y = x (diag(scale) W_int8)^T + b: weight-only int8, for inference on the CPU.

    x: (..., in_features) fp32 -> (..., out_features). Made from an nn.Linear, whose weight
    it rounds and stores; the bias is shared with it. Products of any number of rows go
    through matvec's kernel, which reads the int8 weights as they are: with many rows it
    runs at ~90 GFLOP/s here, ahead of widening the weight to fp32 for F.linear up to at
    least 256 rows (GPT-2 small's matrices).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    @property
    def weight(self) -> Tensor:
        """The weight as the products see it, in fp32: for code that reads a linear's weight
        (Transformer-XL projects its memory with a slice of it)."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or matvec.load() is None:
            # Not what decoding runs (the kernel takes fp32, and is switched off only by
            # tests), but correct.
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        return matvec.matvec(x, self.qweight, self.bias, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """An int8 copy of `model` for inference on the CPU; the original is left as it is.

    Linear layers named in the model's `int8_skip` stay fp32 (prepacked where oneDNN is
    available).
    """
    if next(model.parameters()).device.type != "cpu":
        raise TformerError("--int8 runs on the CPU; pass --device cpu")
    skip = set(getattr(model, "int8_skip", ()))
    if matvec.load() is None:
        return _dynamic_int8(model, skip)
    fp32 = PackedLinear if prepack_available() else (lambda linear: linear)
    return swap_linears(
        model, lambda name, linear: fp32(linear) if name in skip else Int8Linear(linear)
    )


def _dynamic_int8(model: nn.Module, skip: set[str]) -> nn.Module:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    # Its quantized layers have no `weight` tensor: leave alone those whose weight the
    # model reads itself.
    skip = skip | set(getattr(model, "reads_linear_weights", ()))
    spec = {
        name: per_channel_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in skip
    }
    with warnings.catch_warnings():
        # torch.ao.quantization announces its move to torchao; it still does this job well.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(copy.deepcopy(model).eval(), spec, dtype=torch.qint8)
