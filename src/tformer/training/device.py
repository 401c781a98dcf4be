"""The one place that picks the device and the autocast precision."""

from __future__ import annotations

import contextlib

import torch

from tformer.errors import TformerError


def pick_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TformerError(
            f"device {name!r} is not a device; choose auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TformerError(f"device {name!r} was asked for, but no CUDA device is available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise TformerError(f"device {name!r} was asked for, but MPS is not available")
    return device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bfloat16 autocast when asked for, or by default ('auto') on a GPU that has it; fp32
    otherwise (a CPU without bf16 units runs bf16 matmuls many times slower than fp32)."""
    if precision == "auto":
        bf16_gpu = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16_gpu else "fp32"
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
