"""The residual connection around every sublayer, with the norm before or after it.

post-norm (Vaswani et al. 2017): x = Norm(x + Dropout(f(x)))
pre-norm  (GPT-2, Xiong et al. 2020): x = x + Dropout(f(Norm(x))); the stack then needs a
final norm, which the model owns.
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
        kind: str = "layernorm", eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if norm not in NORM_POSITIONS:
            raise ValueError(f"norm must be one of {NORM_POSITIONS}, not {norm!r}")
        self.pre = norm == "pre"
        self.norm = make_norm(kind, d_model, eps=eps, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))
