"""Linear layers with prepacked weights, for fp32 decoding on the CPU.

A decoding step multiplies a few rows (one per sequence or beam) by every weight matrix.
At that shape the generic matmul (`F.linear`, which calls MKL's sgemm here) is far from the
machine's limit: it reads a 768 x 3072 matrix at about 14 GB/s for one row and about 7 GB/s
for eight, against some 28 GB/s that a plain sum reads. oneDNN can reorder a weight once
into the blocked layout its kernels stream best; with that layout the same products run
1.3x (one row) to 2x (eight rows) faster, and a 4-row, 8000-word output projection 4x
(benchmarks/speed.py measures the effect end to end). For one to four rows a hand-written
kernel (fp32.py) is faster still, and PackedLinear uses it where it is available.

The reordered copy is made once, when decoding starts: `prepack(model)` returns a model
whose nn.Linear layers hold their weight in both layouts (the original stays, shared, for
code that reads `.weight`). It is for inference only: the reordered weight has no
gradient. A change to the original weight (an optimizer step, load_state_dict) is seen at
the next call, which packs again: one to four rows read the live weight, more rows the
reordered copy, and both must give the same product.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.kernels import fp32


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout. Same results as the nn.Linear
    it came from, up to float rounding (the kernels sum in another order). One to four rows
    go through fp32.c's kernel where it is available."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The original parameters, shared and not copied: tied embeddings and code that
        # slices `.weight` (Transformer-XL's memory keys and values) keep working.
        self.weight = linear.weight
        self.bias = linear.bias
        # The second argument is the number of rows oneDNN should expect; any number works.
        # Packed for 64, the kernels ran as fast at 1 to 8 rows as packed for exactly those,
        # and packed for 1 they lost half their speed at 4 rows and more.
        self._pack()
        self.native = fp32.available()

    def _pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        self.packed_from = self._weight_version()

    def _weight_version(self) -> tuple[int, int]:
        """Changes whenever the weight does: torch counts in-place writes to a tensor, and a
        new tensor has another address."""
        return self.weight.data_ptr(), self.weight._version

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            # The reordered copy has no autograd: computing a gradient through it would be
            # silently wrong, so training code gets the plain product instead.
            return F.linear(x, self.weight, self.bias)
        if self.native and 0 < x.numel() <= fp32.MAX_ROWS * self.in_features:
            return fp32.matvec(x, self.weight, self.bias)
        if self.packed_from != self._weight_version():
            self._pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


@functools.cache
def prepack_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 builds do) and it agrees
    with F.linear on a small product."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        linear = nn.Linear(16, 8)
        x = torch.randn(3, 16)
        with torch.no_grad():
            return torch.allclose(PackedLinear(linear)(x), linear(x), atol=1e-5)
    except (RuntimeError, AttributeError):
        return False


def prepack(model: nn.Module) -> nn.Module:
    """A copy of `model` for fp32 CPU inference whose nn.Linear layers are PackedLinear
    and whose dropout layers are gone.

    The copy shares every parameter with `model` (only the module objects are new), so it
    costs one extra copy of the linear weights. A model on another device or in another
    dtype, or a torch without oneDNN, gets `model` itself back.
    """
    param = next(model.parameters(), None)
    if (
        param is None
        or param.device.type != "cpu"
        or param.dtype != torch.float32
        or not prepack_available()
    ):
        return model
    return swap_linears(model, lambda name, linear: PackedLinear(linear))


def swap_linears(model: nn.Module, swap: Callable[[str, nn.Linear], nn.Module], *,
                 split: bool = False) -> nn.Module:
    """A copy of `model` in eval mode in which every nn.Linear `child`, an attribute `name`
    of its parent, becomes `swap(name, child)` and every dropout layer is gone. The copy
    shares every parameter and buffer with `model`: only the module objects are new.

    `split`: a module that holds several linear layers' weights stacked (a mixture's
    experts, [E, out, in]) and offers them as nn.Linears over views of them (its
    `as_linears()`) is first replaced by those, so that each is swapped on its own."""
    # Copy the module tree but not its tensors: the memo maps every parameter and buffer
    # to itself.
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    swapped = copy.deepcopy(model, memo)
    for parent in list(swapped.modules()) if split else ():
        for name, child in list(parent.named_children()):
            if callable(getattr(child, "as_linears", None)):
                setattr(parent, name, child.as_linears())
    for parent in list(swapped.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, swap(name, child))
            elif isinstance(child, nn.Dropout):
                # The identity at inference; a decoding step makes a dozen such calls, and
                # dropping them made beam search at batch 1 5-10% faster.
                setattr(parent, name, nn.Identity())
    return swapped.eval()
