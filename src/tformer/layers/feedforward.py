"""The position-wise feed-forward network, plain (Vaswani et al. 2017, eq. 2) or gated
(Shazeer 2020, "GLU Variants Improve Transformer": SwiGLU with silu)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from torch import Tensor, nn

from tformer.kernels.dropout import Dropout
from tformer.kernels.glu import silu_mul

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    # GPT-2's tanh approximation of GELU (Hendrycks & Gimpel 2016, sec. 2), which its
    # weights were trained with: the exact erf form moves logits by ~1e-3.
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    # SiLU / swish, x * sigmoid(x) (Ramachandran et al. 2017): Marian's activation, and
    # SwiGLU's gate.
    "silu": nn.SiLU,
}
FEEDFORWARDS = ("plain", "gated")


class FeedForward(nn.Module):
    """(B, T, D) -> (B, T, D), applied to each position alone: down(act(up(x)))."""

    gated: ClassVar[bool] = False
    """Which of the two a one-call decoding step computes (kernels/step.py)."""

    def __init__(
        self, d_model: int, d_ff: int, *, activation: str = "gelu", dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = Dropout(dropout)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(self.activation(self.up(x))))


class GatedFeedForward(nn.Module):
    """(B, T, D) -> (B, T, D): down(act(gate(x)) * up(x)) (Shazeer 2020, eq. 5-6)."""

    gated: ClassVar[bool] = True

    def __init__(
        self, d_model: int, d_ff: int, *, activation: str = "silu", dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=bias)
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = Dropout(dropout)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.activation, nn.SiLU):  # SwiGLU: the gate in one pass (glu.py)
            return self.down(self.dropout(silu_mul(self.gate(x), self.up(x))))
        return self.down(self.dropout(self.activation(self.gate(x)) * self.up(x)))


def make_feedforward(
    kind: str, d_model: int, d_ff: int, *, activation: str, dropout: float, bias: bool
) -> nn.Module:
    if kind == "gated":
        return GatedFeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
    if kind != "plain":
        raise ValueError(f"feed-forward kind must be one of {FEEDFORWARDS}, not {kind!r}")
    return FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
