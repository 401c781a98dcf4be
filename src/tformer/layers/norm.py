"""The norms a config may name: `layernorm` (Ba et al. 2016), `rmsnorm` (Zhang & Sennrich
2019, the norm of Llama, Qwen and Mistral) and `rmsnorm_plus1` (RMSNorm whose weight is
stored as its difference from 1: Gemma's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from tformer.kernels import rmsnorm


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis.

    The statistic and the division are computed in float32 whatever x's dtype, and the
    result cast back before the weight multiplies it, as the Llama reference code does: in
    bfloat16, the mean of squares loses most of its digits. In float32 on a CPU, one C pass
    forward and two back (kernels/rmsnorm.py).
    """

    rms: ClassVar[bool] = True
    """What a one-call decoding step reads it as (kernels/step.py: not a LayerNorm)."""

    def __init__(self, d: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        if rmsnorm.runs_natively(x, self.weight):
            return rmsnorm.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + weight), in float32 whatever x's dtype.

    The same function as RMSNorm, with the weight stored as its offset from 1, so that a
    weight decayed towards zero leaves the norm a plain RMS normalisation (Gemma's code);
    its checkpoints hold the offsets, which is why it is a kind of its own rather than a
    conversion at import. The scale multiplies before the cast back, as Gemma's code does.
    """

    rms: ClassVar[bool] = False
    """kernels/step.py's RMSNorm multiplies by the weight itself: it must not take this."""

    def __init__(self, d: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def layer_norm(d: int, *, eps: float, bias: bool) -> nn.Module:
    return nn.LayerNorm(d, eps=eps, bias=bias)


def rms_norm(d: int, *, eps: float, bias: bool) -> nn.Module:
    # RMSNorm has no bias, whatever the other layers have (Zhang & Sennrich 2019, eq. 4).
    return RMSNorm(d, eps=eps)


NormFactory = Callable[..., nn.Module]
def offset_rms_norm(d: int, *, eps: float, bias: bool) -> nn.Module:
    return OffsetRMSNorm(d, eps=eps)


NORMS: dict[str, NormFactory] = {"layernorm": layer_norm, "rmsnorm": rms_norm,
                                 "rmsnorm_plus1": offset_rms_norm}
"""(d, *, eps, bias) -> the norm over d features."""


def make_norm(kind: str, d: int, *, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    if kind not in NORMS:
        raise ValueError(f"norm kind must be one of {tuple(NORMS)}, not {kind!r}")
    return NORMS[kind](d, eps=eps, bias=bias)
