"""The position-wise feed-forward network: Linear -> activation -> dropout -> Linear."""

from __future__ import annotations

from torch import Tensor, nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


class FeedForward(nn.Module):
    """(B, T, D) -> (B, T, D), applied to each position alone (Vaswani et al. 2017, eq. 2)."""

    def __init__(
        self, d_model: int, d_ff: int, *, activation: str = "gelu", dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(self.activation(self.up(x))))
