"""The position-wise feed-forward network: Linear -> activation -> dropout -> Linear."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from tformer.kernels.dropout import Dropout

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    # GPT-2's tanh approximation of GELU (Hendrycks & Gimpel 2016, sec. 2), which its
    # weights were trained with: the exact erf form moves logits by ~1e-3.
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    # SiLU / swish, x * sigmoid(x) (Ramachandran et al. 2017): Marian's activation.
    "silu": nn.SiLU,
}


class FeedForward(nn.Module):
    """(B, T, D) -> (B, T, D), applied to each position alone (Vaswani et al. 2017, eq. 2)."""

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
