"""Position encodings: sinusoidal (Vaswani et al. 2017, sec. 3.5) and learned (GPT)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

SINUSOID_LAYOUTS = ("interleaved", "halves")


def sinusoids(
    positions: Tensor, d_model: int, layout: str = "interleaved", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Sinusoidal encodings of (possibly negative or fractional) positions: (N,) -> (N, D).

    interleaved (the paper's): dimension 2i holds sin(pos / 10000^(2i/D)) and 2i+1 holds
    cos(...). halves: the same values with all sines first, then all cosines, as in
    Transformer-XL's original code, tensor2tensor, fairseq and Marian; a model trained with
    one layout reads garbage positions through the other. Transformer-XL feeds relative
    distances through the same formula. Computed in `dtype` throughout.
    """
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=dtype, device=positions.device)
        * (-math.log(10000.0) / d_model)
    )
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    enc = torch.zeros(positions.shape[0], d_model, dtype=dtype, device=positions.device)
    if layout == "halves":
        half = (d_model + 1) // 2
        enc[:, :half] = torch.sin(angles)
        enc[:, half:] = torch.cos(angles[:, : d_model // 2])
        return enc
    if layout != "interleaved":
        raise ValueError(f"sinusoid layout must be one of {SINUSOID_LAYOUTS}, not {layout!r}")
    enc[:, 0::2] = torch.sin(angles)
    enc[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return enc


class SinusoidalPositions(nn.Module):
    """Fixed encodings for positions 0..max_len-1, kept as a non-persistent buffer."""

    def __init__(self, max_len: int, d_model: int, layout: str = "interleaved") -> None:
        super().__init__()
        self.register_buffer(
            # In float64, as the table is made once: at position 500 a float32 angle is off
            # by ~3e-5, which reference implementations (built in float64) do not share.
            "table",
            sinusoids(torch.arange(max_len), d_model, layout, torch.float64).float(),
            persistent=False,
        )

    def forward(self, positions: Tensor) -> Tensor:
        """Integer positions (any shape) -> their encodings (..., D)."""
        return self.table[positions]


class LearnedPositions(nn.Module):
    """A trained embedding per position (GPT)."""

    def __init__(self, max_len: int, d_model: int, layout: str = "interleaved") -> None:
        # `layout` is for the sinusoids' sake: both kinds are built with the same arguments.
        super().__init__()
        self.table = nn.Embedding(max_len, d_model)

    def forward(self, positions: Tensor) -> Tensor:
        return self.table(positions)


class NoPositions(nn.Module):
    """No absolute positions: a model whose attention places tokens itself (rotary)."""

    def __init__(self, max_len: int, d_model: int, layout: str = "interleaved") -> None:
        super().__init__()

    def forward(self, positions: Tensor) -> None:
        return None


POSITIONS = {"sinusoidal": SinusoidalPositions, "learned": LearnedPositions,
             "none": NoPositions}
