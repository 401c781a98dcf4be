"""Rotary position embeddings (Su et al. 2021, "RoFormer", sec. 3.4): queries and keys
rotated by angles proportional to their position, so that q . k depends on positions only
through their difference.

Shapes: B batch, H heads, T positions, d size per head.

Pairs of dimensions rotate together, by angle position * theta^(-2i / r) for pair i (r the
rotated size). Which dimensions pair up is the layout: `halves` pairs i with i + r/2 (the
rotate-half form of Hugging Face's Llama code and GPT-NeoX), `interleaved` pairs 2i with
2i + 1 (the original RoFormer and GPT-J). A fraction below 1 rotates only the first r
dimensions of each head and leaves the rest as they are (GPT-NeoX's rotary_pct).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

ROTARY_LAYOUTS = ("halves", "interleaved")
ROTARY_SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RotaryScaling:
    """How the frequencies stretch for contexts longer than the training one.

    linear (position interpolation, Chen et al. 2023): every frequency divided by `factor`.
    llama3: low frequencies (wavelengths above original_context / low_freq_factor) divided
    by `factor`, high ones (below original_context / high_freq_factor) kept, and those in
    between interpolated smoothly (Meta's Llama 3.1 code).
    yarn (Peng et al. 2023, "YaRN", sec. 3.2-3.4): pairs that turn fewer than beta_slow
    times over original_context divided by `factor`, those that turn more than beta_fast
    times kept, a linear ramp over the pairs between (its ends rounded outwards where
    `truncate`); and the angles' cos and sin scaled by attention_factor (None: 0.1 ln(factor)
    + 1), which sharpens the softmax as the longer context flattens it.
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    @property
    def cos_sin_factor(self) -> float:
        """What the cosines and sines are multiplied by (YaRN's attention factor), else 1."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def inverse_frequencies(rotated: int, theta: float, scaling: RotaryScaling) -> Tensor:
    """(rotated / 2,) angles per position of each pair, in float64."""
    inv_freq = theta ** (-torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = scaling.original_context / scaling.low_freq_factor
        high_wavelen = scaling.original_context / scaling.high_freq_factor
        smooth = ((scaling.original_context / wavelen - scaling.low_freq_factor)
                  / (scaling.high_freq_factor - scaling.low_freq_factor))
        between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(middle, between, scaled)
    if scaling.kind == "yarn":
        return _yarn(inv_freq, rotated, theta, scaling)
    if scaling.kind != "none":
        raise ValueError(f"rotary scaling must be one of {ROTARY_SCALINGS}, not {scaling.kind!r}")
    return inv_freq


def _yarn(inv_freq: Tensor, rotated: int, theta: float, scaling: RotaryScaling) -> Tensor:
    """YaRN's frequencies: pair i turns original_context * inv_freq[i] / 2 pi times over the
    original context; the pair at which that count is r turns is (rotated / 2) * ln(C / (2 pi
    r)) / ln(theta), fractional, which the ramp runs between for r = beta_fast .. beta_slow."""

    def pair_turning(turns: float) -> float:
        return (rotated * math.log(scaling.original_context / (turns * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotated - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = ((torch.arange(rotated // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp 0: the pair turns often enough to keep its frequency; 1: divided by the factor.
    return inv_freq * (1 - ramp) + inv_freq / scaling.factor * ramp


class Rotary(nn.Module):
    """x (B, H, T, d) and positions (B, T) or (T,) -> x rotated by its positions."""

    def __init__(
        self, d_head: int, *, theta: float = 10000.0, fraction: float = 1.0,
        layout: str = "halves", scaling: RotaryScaling = RotaryScaling(),
    ) -> None:
        super().__init__()
        if layout not in ROTARY_LAYOUTS:
            raise ValueError(f"rotary layout must be one of {ROTARY_LAYOUTS}, not {layout!r}")
        self.rotated = 2 * int(d_head * fraction // 2)
        if self.rotated < 2:
            raise ValueError(f"a rotary fraction of {fraction} rotates no pair of {d_head}")
        self.interleaved = layout == "interleaved"
        # Not a buffer: model.to(bfloat16) would round the frequencies to 3 digits (and a
        # bfloat16 position is exact only up to 256). The angles are formed in float32, as
        # the reference implementations form them, whatever the model's dtype.
        self._frequencies = inverse_frequencies(self.rotated, theta, scaling).float()
        self._cos_sin_factor = scaling.cos_sin_factor
        self._last: tuple[Tensor, torch.dtype, Tensor, Tensor] | None = None
        """The positions of the latest call and their cos and sin: every layer's queries and
        keys of one forward pass are rotated by the same positions."""

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The cosines and sines of the angles at `positions`: (B, 1, T, r/2) for (B, T)
        positions, (T, r/2) for (T,)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        if self._frequencies.device != positions.device:
            self._frequencies = self._frequencies.to(positions.device)
        angles = positions.float()[..., None] * self._frequencies
        if angles.dim() == 3:  # (B, T, r/2): one row of positions a sequence
            angles = angles[:, None]
        cos, sin = angles.cos(), angles.sin()
        if self._cos_sin_factor != 1.0:
            cos, sin = cos * self._cos_sin_factor, sin * self._cos_sin_factor
        cos, sin = cos.to(dtype), sin.to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        cos, sin = self.cos_sin(positions, x.dtype)
        rot, rest = x[..., : self.rotated], x[..., self.rotated :]
        if self.interleaved:
            even, odd = rot[..., 0::2], rot[..., 1::2]
            turned = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
            rot = turned.flatten(-2)
        else:
            first, second = rot.chunk(2, dim=-1)
            rot = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot
