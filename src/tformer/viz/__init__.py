"""Seeing what training and models do: loss plots, TensorBoard logs, a model summary and
attention maps. matplotlib and tensorboard come with the `viz` extra."""

from __future__ import annotations

from typing import Any

from tformer.errors import TformerError


def require(module: str, package: str | None = None) -> Any:
    """Import `module`, an optional dependency of the viz extra (from `package`, by default
    the module's top-level name), or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module.split(".")[0]
        raise TformerError(
            f"this needs the {package} package: pip install 'tformer[viz]'"
        ) from None
