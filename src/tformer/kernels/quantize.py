"""Int8 linear layers for CPU inference, and frozen ones for training beside them.

Every nn.Linear becomes an int8 one. Its weight is rounded to int8 once, with one fp32
scale per output row (symmetric: the largest weight of a row maps to 127). At each call the
input is rounded the same way, one scale per row (per token), and the product of the two
int8 matrices is summed exactly in 32-bit integers, then scaled back to fp32:

    y[i, j] = (sum_k xq[i, k] q[j, k]) * (xscale[i] * wscale[j]) + b[j]

At batch 1 a decoding step reads every weight once, so a quarter of the bytes is most of
the speed-up; with many rows (beam search over a batch, scoring whole sequences) the
integer product does twice the work of fp32's per instruction. Embedding tables stay fp32
(a step reads only one row of them).

A row's result depends on that row alone (its scale is its own and the sums are exact),
bit for bit, whichever kernel computes the product: int8.py's for the few rows of a
decoding step, and for more its product over a copy of the weight packed once (with AVX-512
VNNI where the CPU has it, else AVX2), and torch's integer product wherever the
kernel cannot be built. kernels/rounding.py does the rounding, int8.py the products.
Batched decoding can still differ from one sentence at a time where attention over padding
rounds differently and that moves an input across a rounding step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from tformer.kernels import int8, library
from tformer.kernels.library import BoundLinear
from tformer.kernels.rounding import quantize_rows, scaled_integer_product


class Int8Linear(nn.Module):
    """y = x W^T + b with W and, at each call, x rounded to int8 (see the module's text),
    for inference on the CPU.

    x: (..., in_features) fp32 -> (..., out_features). Made from an nn.Linear, whose weight
    it rounds and stores; the bias is shared with it.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = quantize_rows(linear.weight.detach().float().contiguous())
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        # The same weight in the layout of the product of many rows, where the kernel is
        # built (not a buffer: derived from qweight, so not saved).
        self.packed = int8.pack_int8(qweight)
        # Checked once here rather than at every call (the weight side does not change).
        self.native = int8.fits_int8_kernel(qweight, scale, self.bias)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's)
        # .to(), .double() and the like replace the tensors: check them again.
        super()._apply(fn, recurse)
        self.native = int8.fits_int8_kernel(self.qweight, self.scale, self.bias)
        return self

    @property
    def weight(self) -> Tensor:
        """The weight as the products see it, in fp32: for code that reads a linear's weight
        (Transformer-XL projects its memory with a slice of it)."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if not self.native or x.dtype != torch.float32 or x.device.type != "cpu":
            # Not what inference runs (the int8 products are for fp32 on the CPU), but correct.
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        rows = x.reshape(-1, self.in_features).contiguous()
        y = int8.linear_int8_unchecked(rows, self.qweight, self.scale, self.bias, self.packed)
        return y.view(*x.shape[:-1], self.out_features)

    def tformer_linear(self) -> BoundLinear | None:
        """The layer as step.c reads it (tformer.h's TFORMER_INT8), or None where the kernels
        cannot read its tensors: as many rows as a step has where the weight is packed, else
        up to int8.INT8_MAX_ROWS (beyond, torch's product of many rows is the faster)."""
        if not (self.native and int8.available()):
            return None
        packed, bias = self.packed, self.bias
        struct = library.Linear(
            library.KIND_INT8, self.out_features, self.in_features, self.qweight.data_ptr(),
            self.scale.data_ptr(), None if bias is None else bias.data_ptr(),
            None if packed is None else packed.data.data_ptr(),
            None if packed is None else packed.row_sums.data_ptr(),
            0 if packed is None else packed.layout, 1 << 30 if packed is None else packed.min_rows)
        tensors = [self.qweight, self.scale, *([] if bias is None else [bias]),
                   *([] if packed is None else [packed.data, packed.row_sums])]
        rows = 1 << 30 if packed is not None else int8.INT8_MAX_ROWS
        return BoundLinear(struct, rows, tuple(tensors))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class _FrozenInt8Product(torch.autograd.Function):
    """y = x W^T + b and its input gradient grad_x = grad_y W, both as int8 products summed
    exactly: the rows of x, and those of grad_y, rounded to int8 with one scale each, as
    SwitchBack does for the same two products (Wortsman et al. 2023, "Stable and low-precision
    training for large-scale vision-language models"). W (as q and its row scales) and b are
    frozen: the weight gets no gradient, and the product that would make it never runs.

    x: (M, in) fp32, contiguous -> (M, out).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
    ) -> Tensor:
        ctx.save_for_backward(q, wscale)
        ctx.has_bias = bias is not None
        return scaled_integer_product(*quantize_rows(x), q, wscale, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, wscale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            # grad_x[i, k] = sum_j grad_y[i, j] wscale[j] q[j, k]: W's scale varies along the
            # sum, so it goes into grad_y's rows before they are rounded.
            gq, gscale = quantize_rows((grad_y * wscale).contiguous())
            ones = wscale.new_ones(q.shape[1])
            grad_x = scaled_integer_product(gq, gscale, q.t(), ones, None)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad_y.sum(0)
        return grad_x, None, None, grad_bias


class FrozenInt8Linear(nn.Module):
    """A frozen nn.Linear kept as int8 rows, a quarter of its weight's bytes, for training
    the layers around it on the CPU (LoRA's base, train.lora.int8): y = x W^T + b, and the
    gradient to x, as int8 products (_FrozenInt8Product); W gets no gradient.

    x: (..., in_features) -> (..., out_features). Made from an nn.Linear, whose weight it
    rounds as Int8Linear does (one fp32 scale per output row); the bias is shared with it.
    Rows that are not fp32 on the CPU go through the dequantized weight instead.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Plain tensors, not buffers: rounded again from the fp32 weight whenever a run
        # starts, so never saved, and not broadcast by DDP at every step as buffers are.
        self.qweight, self.scale = quantize_rows(linear.weight.detach().float().contiguous())
        self.bias = linear.bias

    @property
    def weight(self) -> Tensor:
        """The weight as the products see it, in fp32 (Int8Linear.weight's)."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight.to(x), None if self.bias is None else self.bias.to(x))
        rows = x.reshape(-1, self.in_features).contiguous()
        y = _FrozenInt8Product.apply(rows, self.qweight, self.scale, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, frozen"
