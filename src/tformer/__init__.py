"""tformer: the translation Transformer, GPT and Transformer-XL, from one set of parts."""

from tformer.errors import TformerError

__version__ = "0.1.0"
__all__ = ["TformerError", "__version__"]
