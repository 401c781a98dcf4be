"""Hugging Face's Gemma 2 and Gemma 3 (text) decoders in and out: Gemma2ForCausalLM
(`gemma2`) and Gemma3ForCausalLM (`gemma3_text`).

Every piece of their layout is a GPTConfig field: token embeddings scaled by sqrt(d_model),
RMSNorm with its weight stored as an offset from 1 (norm_kind rmsnorm_plus1), a norm before
and after each sublayer (sandwich_norm), GeGLU with tanh GELU, queries scaled by
query_pre_attn_scalar^-1/2 (attn_scale), a head size of its own, sliding-window layers
between global ones (window, global_every), tied embeddings. Gemma 2 soft-caps attention
scores and logits (attn_softcap, logit_softcap); Gemma 3 instead normalises each query and
key head (qk_norm) and rotates its sliding layers by a base of their own (rope_local_theta),
with rope scaling on its global layers only.

Gemma 3's multimodal checkpoints (`gemma3`, Gemma3ForConditionalGeneration: every Gemma 3
from 4B up) carry a vision tower that tformer has no place for: they come in as their text
model, the vision tower and its projector left out (a warning says so), which reads text as
the whole model does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import Tensor

from tformer.config import RunConfig
from tformer.errors import TformerError
from tformer.interop import DECODER_KEYS, llama, require_ints
from tformer.models.gpt import GPT, GPTConfig

log = logging.getLogger(__name__)

MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
LAYER_TYPES = ("sliding_attention", "full_attention")


TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
"""Gemma3TextConfig's defaults, which the text_config of a multimodal Gemma 3 leaves out
(its published configs name a few fields only); its rotary defaults are _rope's."""
TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                 "language_model.lm_head.": "lm_head."}
"""Where a multimodal checkpoint keeps its text model's tensors (as saved; as
state_dict() names them) -> where a Gemma3ForCausalLM keeps them."""
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                  "model.multi_modal_projector.")


def text_config(hf: dict[str, Any], source: Path) -> dict[str, Any]:
    """A multimodal Gemma 3's text model's config.json: its text_config over
    Gemma3TextConfig's defaults."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise TformerError(f"{source}: a multimodal Gemma 3 config.json without a text_config")
    return {**TEXT_DEFAULTS, "tie_word_embeddings": hf.get("tie_word_embeddings", True),
            **text, "model_type": "gemma3_text"}


def text_weights(weights: dict[str, Any], source: Path) -> dict[str, Any]:
    """A multimodal Gemma 3's text model's tensors under Gemma3ForCausalLM's names, the
    vision tower's and projector's left out (a warning counts them)."""
    tensors: dict[str, Any] = {}
    left_out = 0
    for name, tensor in weights.items():
        if name.startswith(IMAGE_PREFIXES):
            left_out += 1
            continue
        prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
        tensors[name if prefix is None else TEXT_PREFIXES[prefix] + name[len(prefix):]] = tensor
    log.warning("%s: a multimodal Gemma 3; its text model is imported, its vision tower and "
                "projector (%d tensors) left out", source, left_out)
    return tensors


def _rope(hf: dict[str, Any], source: Path) -> dict[str, Any]:
    """The rotary fields: Gemma 3's rope_parameters hold one table per kind of layer (the
    sliding layers' theta, the global layers' theta and scaling), Gemma 2's one for all;
    transformers 4.x wrote Gemma 3's as rope_theta and rope_scaling (the global layers')
    and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if hf["model_type"] == "gemma3_text" and "full_attention" not in params:
        params = {"full_attention": params or {
            **(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)},
            "sliding_attention": {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}}
    if "full_attention" not in params:
        return llama.rope_fields(hf, source)
    fields = llama.rope_fields({"rope_parameters": params["full_attention"]}, source)
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise TformerError(f"{source}: rope scaling on the sliding layers "
                           f"({local['rope_type']!r}) cannot be expressed")
    fields["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
    return fields


def global_every(hf: dict[str, Any], source: Path) -> int:
    """The period of the global layers among sliding ones (0: none is global): layer_types,
    else the older sliding_window_pattern (by default every second layer of Gemma 2, every
    sixth of Gemma 3); a pattern of no period is an error."""
    n_layer = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        default = 6 if hf["model_type"] == "gemma3_text" else 2
        every = int(hf.get("sliding_window_pattern") or default)
        types = [LAYER_TYPES[(i + 1) % every == 0] for i in range(n_layer)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n_layer:
        raise TformerError(f"{source}: layer_types {types} are not {n_layer} of "
                           f"{', '.join(LAYER_TYPES)}")
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    every = full[0] + 1 if full else 0
    if [i for i in range(n_layer) if every and (i + 1) % every == 0] != full:
        raise TformerError(f"{source}: global layers at {full} are not every n-th layer: "
                           f"cannot be expressed")
    return every


def gemma_config(hf: dict[str, Any], source: Path) -> GPTConfig:
    """A Gemma 2 / Gemma 3 text config.json -> GPTConfig; what tformer cannot express is an
    error naming it; a multimodal Gemma 3's, its text model's."""
    if hf.get("model_type") == "gemma3":
        hf = text_config(hf, source)
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise TformerError(f"{source}: model_type {model_type!r} is not one of "
                           f"{', '.join(MODEL_TYPES)}")
    refused = [key for key in ("use_bidirectional_attention", "attention_bias") if hf.get(key)]
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        refused.append(f"hidden_activation = {activation}")
    if refused:
        raise TformerError(f"{source}: tformer cannot express {', '.join(refused)}")
    require_ints(hf, DECODER_KEYS, source)
    d_model, n_head = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or d_model // n_head)
    every = global_every(hf, source)
    window = hf.get("sliding_window")
    rope = _rope(hf, source)
    if window is None or (every == 1):  # every layer global: no window anywhere
        window, every = None, 0
        rope.pop("rope_local_theta", None)
    scalar = float(hf.get("query_pre_attn_scalar") or head_dim)
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]), context=int(hf["max_position_embeddings"]),
        n_layer=int(hf["num_hidden_layers"]), n_head=n_head, d_model=d_model,
        d_ff=int(hf["intermediate_size"]),
        d_head=None if head_dim * n_head == d_model else head_dim,
        n_kv_head=int(hf.get("num_key_value_heads") or n_head), dropout=0.0,
        activation="gelu_tanh", position="none", norm="pre", norm_kind="rmsnorm_plus1",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), feedforward="gated",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), bias=False,
        scale_embeddings=True, sandwich_norm=True, qk_norm=model_type == "gemma3_text",
        window=None if window is None else int(window), global_every=every, rotary=True,
        rope_layout="halves", attn_scale=None if scalar == head_dim else scalar**-0.5,
        attn_softcap=hf.get("attn_logit_softcapping"),
        logit_softcap=hf.get("final_logit_softcapping"), **rope,
    )


def _names(cfg: GPTConfig) -> dict[str, str | tuple[str, ...]]:
    """Ours -> theirs: Llama's names, and the two norms on the sublayers' outputs (the
    pre-feed-forward norm is Gemma's name for Llama's post-attention one)."""
    names = llama._names(cfg)
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        names |= {
            ours + "ff_residual.norm.weight": theirs + "pre_feedforward_layernorm.weight",
            ours + "attn_residual.out_norm.weight": theirs + "post_attention_layernorm.weight",
            ours + "ff_residual.out_norm.weight": theirs + "post_feedforward_layernorm.weight",
        }
    return names


def gemma_from_hf(hf: dict[str, Any], weights: dict[str, Tensor], source: Path | str) -> GPT:
    """A GPT with the weights of a Gemma 2 / Gemma 3 text model, from its config and its
    tensors (as saved, or its state_dict())."""
    source = Path(source)
    if hf.get("model_type") == "gemma3":
        weights = text_weights(weights, source)
    cfg = gemma_config(hf, source)
    return llama.build_gpt(cfg, _names(cfg), weights, source)


def import_gemma(src: Path, dest: Path) -> Path:
    """A local Gemma 2 / Gemma 3 directory -> a tformer GPT checkpoint (of the text model)."""
    return llama.import_hf_gpt(src, dest, gemma_from_hf)


# --- export -------------------------------------------------------------------------------


def model_type_of(cfg: GPTConfig) -> str:
    """gemma2 or gemma3_text, whichever `cfg` is exactly; an error listing every field that
    differs where neither is."""
    wanted = {"position": "none", "rotary": True, "norm": "pre", "norm_kind": "rmsnorm_plus1",
              "feedforward": "gated", "activation": "gelu_tanh", "bias": False,
              "final_norm": True, "output_bias": False,
              "scale_embeddings": True, "embed_norm": False, "sandwich_norm": True,
              "rope_layout": "halves", "rope_fraction": 1.0, "d_value": None,
              "n_expert": 0, "attn_sinks": False}
    differ = [f"model.{key} = {getattr(cfg, key)!r} (Gemma: {value!r})"
              for key, value in wanted.items() if getattr(cfg, key) != value]
    if cfg.attention_bias or cfg.qkv_bias:
        differ.append("model.attn_bias / qkv_bias = true (Gemma: no biases)")
    model_type = "gemma3_text" if cfg.qk_norm else "gemma2"
    if model_type == "gemma2" and cfg.rope_local_theta is not None:
        differ.append("model.rope_local_theta (Gemma 2: one base for every layer)")
    if cfg.rope_scaling not in ("none", "linear"):
        differ.append(f"model.rope_scaling = {cfg.rope_scaling!r} (Gemma: none or linear)")
    if differ:
        raise TformerError("neither Gemma 2 nor Gemma 3 expresses this model: "
                           + "; ".join(differ))
    return model_type


def exported_family(cfg: RunConfig) -> str:
    if cfg.family != "gpt":
        raise TformerError(f"Gemma models are gpt models; this is a {cfg.family} model")
    return model_type_of(cfg.model)


def layer_types(cfg: GPTConfig) -> list[str]:
    return [LAYER_TYPES[not cfg.slides(i)] for i in range(cfg.n_layer)]


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """GPTConfig -> the config.json of Gemma2ForCausalLM or Gemma3ForCausalLM."""
    model_type = model_type_of(cfg)
    rope: dict[str, Any] = {"rope_type": {"none": "default"}.get(cfg.rope_scaling,
                                                                  cfg.rope_scaling),
                            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope["factor"] = cfg.rope_factor
    if model_type == "gemma3_text":
        local = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
        rope = {"full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    head = cfg.head_size
    return {
        "model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_width, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": head, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope,
        "attention_bias": False, "torch_dtype": "float32",
        # query_pre_attn_scalar is the number whose -1/2 power scales q . k
        "query_pre_attn_scalar": head if cfg.attn_scale is None else query_scalar(cfg.attn_scale),
        # No window anywhere: one as long as the context slides past nothing.
        "sliding_window": cfg.window or cfg.context, "layer_types": layer_types(cfg),
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.logit_softcap,
    }


def query_scalar(scale: float) -> float | int:
    """The query_pre_attn_scalar whose -1/2 power is `scale`: a whole number where it is
    one up to rounding (a float32 of GGUF's metadata), as the configs give it."""
    scalar = scale**-2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar


def hf_weights(model: GPT) -> dict[str, Tensor]:
    return llama.hf_tensors(model, _names(model.cfg))


def export_gemma(checkpoint: Path, dest: Path) -> Path:
    """A tformer GPT checkpoint of a Gemma layout -> a directory Gemma2ForCausalLM or
    Gemma3ForCausalLM and AutoTokenizer load."""
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(checkpoint, family="gpt", weights="fp32")
    return llama.write_hf_gpt(loaded, hf_config(loaded.model.cfg),
                              hf_weights(loaded.model), dest)
