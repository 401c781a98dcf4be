"""The checks every config dataclass runs in its __post_init__: each raises a TformerError
that names the key, the bad value and what is allowed.

A leaf module: it imports nothing of tformer but its errors, so models, data and configs
can all use it without importing each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from tformer.errors import TformerError


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        allowed = " | ".join(str(c) for c in choices)
        raise TformerError(f"{key} = {value!r} is not allowed; choose one of: {allowed}")


def check_range(
    key: str, value: float | int, low: float | None = None, high: float | None = None
) -> None:
    """low <= value <= high, and finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise TformerError(f"{key} = {value} must be a finite number")
    if low is not None and value < low:
        raise TformerError(f"{key} = {value} must be at least {low}")
    if high is not None and value > high:
        raise TformerError(f"{key} = {value} must be at most {high}")


def check_heads(prefix: str, d_model: int, n_head: int, d_head: int | None) -> None:
    """Without an explicit head size, the width must split evenly across the heads."""
    if d_head is None and d_model % n_head != 0:
        raise TformerError(
            f"{prefix}.d_model = {d_model} is not divisible by {prefix}.n_head = {n_head}; "
            f"pick sizes that divide, or set {prefix}.d_head"
        )
