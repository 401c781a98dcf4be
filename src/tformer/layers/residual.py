"""The residual connection around every sublayer, with the norm before or after it.

post-norm (Vaswani et al. 2017): x = Norm(x + Dropout(f(x)))
pre-norm  (GPT-2, Xiong et al. 2020): x = x + Dropout(f(Norm(x))); the stack then needs a
final norm, which the model owns.
sandwich  (pre-norm with `out_norm`, Gemma 2 and 3): x = x + Dropout(Norm'(f(Norm(x)))), the
sublayer's output normalised too before it joins the residual stream.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from tformer.kernels.dropout import Dropout
from tformer.layers.norm import make_norm

NORM_POSITIONS = ("pre", "post")


class Residual(nn.Module):
    def __init__(
        self, d_model: int, *, norm: str, dropout: float, bias: bool = True,
        kind: str = "layernorm", eps: float = 1e-5, out_norm: bool = False,
    ) -> None:
        super().__init__()
        if norm not in NORM_POSITIONS:
            raise ValueError(f"norm must be one of {NORM_POSITIONS}, not {norm!r}")
        self.pre = norm == "pre"
        self.norm = make_norm(kind, d_model, eps=eps, bias=bias)
        self.dropout = Dropout(dropout)
        if out_norm and not self.pre:
            raise ValueError("a norm on the sublayer's output goes with norm = 'pre'")
        self.out_norm = make_norm(kind, d_model, eps=eps, bias=bias) if out_norm else None

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.out_norm is not None:
            return x + self.dropout(self.out_norm(sublayer(self.norm(x))))
        if self.pre:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))
