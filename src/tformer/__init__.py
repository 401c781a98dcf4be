"""tformer: the translation Transformer, GPT and Transformer-XL, from one set of parts.

    import tformer
    model = tformer.load("runs/shakespeare")        # a run, or one checkpoint directory
    model.generate("ROMEO:", max_new_tokens=100)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tformer.errors import TformerError

if TYPE_CHECKING:
    from tformer.api import Model

__version__ = "0.1.0"
__all__ = ["TformerError", "__version__", "load"]


def load(path: str, *, weights: str | None = None, device: str = "auto",
         threads: int | None = None) -> Model:
    """A checkpoint ready to generate, translate or score (tformer.api.load); importing
    tformer itself stays light: torch loads here."""
    from tformer.api import load as load_model

    return load_model(path, weights=weights, device=device, threads=threads)
