"""What the families' models share: the [model] fields every family has, with their checks,
and the parameter count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from tformer.checks import check_choice, check_heads, check_range
from tformer.layers import ACTIVATIONS, FEEDFORWARDS, NORMS, SINUSOID_LAYOUTS, make_norm
from tformer.layers.residual import NORM_POSITIONS


@dataclass(frozen=True)
class ModelConfig:
    """The fields of every family's [model] table; a family redeclares a field to give it
    its own default."""

    norm_positions: ClassVar[tuple[str, ...]] = NORM_POSITIONS
    """The choices of `norm`, the family's default first."""

    vocab_size: int = 0
    """Set from the tokenizer when training starts; 0 in a config file means 'from data'."""
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 0
    """0 means 4 * d_model."""
    d_head: int | None = None
    """Query/key size per head; none means d_model / n_head."""
    dropout: float = 0.0
    activation: str = "gelu"
    norm: str = "pre"
    """pre: the norm before each sublayer, plus a final one per stack (stable with large
    learning rates); post: the original Transformer's Norm(x + sublayer(x))."""
    tie_embeddings: bool = True
    bias: bool = True
    """Biases in the linear layers and norms."""
    output_bias: bool = False
    """A bias on the projection to the vocabulary."""
    sinusoid_layout: str = "interleaved"
    """Sinusoidal positions: interleaved sin/cos (the paper), or halves ([sin | cos]:
    tensor2tensor, fairseq, Marian, Transformer-XL's code)."""

    def __post_init__(self) -> None:
        check_range("model.vocab_size", self.vocab_size, low=0)
        for key in ("n_layer", "n_head", "d_model"):
            check_range(f"model.{key}", getattr(self, key), low=1)
        check_range("model.d_ff", self.d_ff, low=0)
        if self.d_head is not None:
            check_range("model.d_head", self.d_head, low=1)
        check_heads("model", self.d_model, self.n_head, self.d_head)
        check_range("model.dropout", self.dropout, low=0.0, high=1.0)
        check_choice("model.activation", self.activation, tuple(ACTIVATIONS))
        check_choice("model.norm", self.norm, self.norm_positions)
        check_choice("model.sinusoid_layout", self.sinusoid_layout, SINUSOID_LAYOUTS)

    def unused_fields(self) -> frozenset[str]:
        """Fields the config's other choices make moot (a sinusoid layout without sinusoidal
        positions): what `tformer info` leaves out. None here; a family names its own."""
        return frozenset()

    @property
    def ff_width(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_size(self) -> int:
        return self.d_head or self.d_model // self.n_head

    def require_vocab(self) -> None:
        """ValueError unless vocab_size is set, as it must be to build a model."""
        if self.vocab_size < 1:
            raise ValueError(
                f"{type(self).__name__}.vocab_size must be set (from the tokenizer) to build "
                f"a model"
            )


@dataclass(frozen=True)
class StackConfig(ModelConfig):
    """The fields of the families built from layers.MultiHeadAttention stacks (GPT and the
    translation Transformer)."""

    d_value: int | None = None
    """Value size per head; none means d_head."""
    attn_bias: bool | None = None
    """Biases in the attention projections; none means the same as `bias`."""
    scale_embeddings: bool = False
    """Multiply token embeddings by sqrt(d_model) before adding positions (Vaswani et al.
    2017, sec. 3.4)."""
    embed_norm: bool = False
    """A norm right after embeddings + positions (BERT, BLOOM, mBART)."""
    final_norm: bool = True
    """Pre-norm: the norm that closes each stack (GPT-2 has it)."""
    norm_kind: str = "layernorm"
    """layernorm or rmsnorm, for every norm of the model."""
    norm_eps: float = 1e-5
    feedforward: str = "plain"
    """plain: down(act(up(x))); gated: down(act(gate(x)) * up(x)) (SwiGLU with silu)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_value is not None:
            check_range("model.d_value", self.d_value, low=1)
        check_choice("model.norm_kind", self.norm_kind, tuple(NORMS))
        check_range("model.norm_eps", self.norm_eps, low=0.0)
        check_choice("model.feedforward", self.feedforward, FEEDFORWARDS)

    def norm_module(self) -> nn.Module:
        """A norm over d_model, of the kind the config names."""
        return make_norm(self.norm_kind, self.d_model, eps=self.norm_eps, bias=self.bias)

    @property
    def attention_bias(self) -> bool:
        return self.bias if self.attn_bias is None else self.attn_bias


class Model(nn.Module):
    def num_params(self) -> int:
        """Distinct parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())
