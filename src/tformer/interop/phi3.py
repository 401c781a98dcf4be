"""Hugging Face's Phi3ForCausalLM in and out: Phi-3 and Phi-4 (and Phi-4-mini, whose rotary
embeddings turn part of each head).

Its layout is Llama's (pre-norm RMSNorm, rotate-half rotary embeddings, SwiGLU, grouped-query
attention, no biases), with two of its projections stored fused: qkv_proj ([q | k | v] rows,
the order of tformer's own fused projection) and gate_up_proj ([gate | up] rows). They are
split into Llama's names at import, so that one mapping (interop.llama's) places them, and
fused again at export. A partial rotary factor and a sliding window are GPTConfig fields;
LongRoPE ("longrope", formerly "su"), which switches between two tables of frequency factors
by the length of the text, is not one, and is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.config import RunConfig
from tformer.errors import TformerError
from tformer.interop import llama, take
from tformer.models.gpt import GPT, GPTConfig

MODEL_TYPES = ("phi3",)


def phi3_config(hf: dict[str, Any], source: Path) -> GPTConfig:
    """A Phi-3 config.json -> GPTConfig (the Llama layout's fields, a window where it has
    one); what tformer cannot express is an error naming it."""
    if hf.get("model_type") != "phi3":
        raise TformerError(f"{source}: model_type {hf.get('model_type')!r} is not phi3")
    window = hf.get("sliding_window")
    return llama.llama_config({**hf, "model_type": "llama",
                               "use_sliding_window": window is not None}, source)


def llama_weights(weights: dict[str, Any], cfg: GPTConfig, source: Path) -> dict[str, Any]:
    """Phi-3's tensors under Llama's names: each layer's fused projections split apart."""
    weights = dict(weights)
    head = cfg.head_size
    widths = [cfg.n_head * head, *[(cfg.n_kv_head or cfg.n_head) * head] * 2]
    for i in range(cfg.n_layer):
        layer = f"model.layers.{i}."
        qkv = take(weights, layer + "self_attn.qkv_proj.weight", source).float()
        gate_up = take(weights, layer + "mlp.gate_up_proj.weight", source).float()
        if qkv.shape[0] != sum(widths) or gate_up.shape[0] != 2 * cfg.ff_width:
            raise TformerError(f"{source}: layer {i}'s qkv_proj ({qkv.shape[0]} rows) or "
                               f"gate_up_proj ({gate_up.shape[0]}) does not fit the config")
        for name, part in zip("qkv", qkv.split(widths), strict=True):
            weights[layer + f"self_attn.{name}_proj.weight"] = part
        gate, up = gate_up.chunk(2)
        weights[layer + "mlp.gate_proj.weight"], weights[layer + "mlp.up_proj.weight"] = gate, up
    return weights


def phi3_from_hf(hf: dict[str, Any], weights: dict[str, Any], source: Path | str) -> GPT:
    """A GPT with the weights of a Phi3ForCausalLM, from its config and its tensors."""
    source = Path(source)
    cfg = phi3_config(hf, source)
    return llama.build_gpt(cfg, llama._names(cfg), llama_weights(weights, cfg, source), source)


def import_phi3(src: Path, dest: Path) -> Path:
    """A local Phi-3 / Phi-4 directory -> a tformer GPT checkpoint."""
    return llama.import_hf_gpt(src, dest, phi3_from_hf)


# --- export -------------------------------------------------------------------------------


def check_layout(cfg: GPTConfig) -> None:
    """A TformerError listing every field in which `cfg` is not Phi-3's layout."""
    wanted = {"position": "none", "rotary": True, "norm": "pre", "norm_kind": "rmsnorm",
              "feedforward": "gated", "activation": "silu", "bias": False, "qk_norm": False,
              "final_norm": True, "output_bias": False,
              "scale_embeddings": False, "embed_norm": False, "rope_layout": "halves",
              "d_value": None, "sandwich_norm": False, "attn_scale": None,
              "attn_softcap": None, "logit_softcap": None, "global_every": 0,
              "n_expert": 0, "attn_sinks": False}
    differ = [f"model.{key} = {getattr(cfg, key)!r} (Phi-3: {value!r})"
              for key, value in wanted.items() if getattr(cfg, key) != value]
    if cfg.attention_bias or cfg.qkv_bias:
        differ.append("model.attn_bias / qkv_bias = true (Phi-3: no biases)")
    if cfg.rope_scaling != "none":
        differ.append(f"model.rope_scaling = {cfg.rope_scaling!r} (Phi-3 here: none)")
    if differ:
        raise TformerError("Phi-3 cannot express this model: " + "; ".join(differ))


def exported_family(cfg: RunConfig) -> str:
    if cfg.family != "gpt":
        raise TformerError(f"Phi-3 models are gpt models; this is a {cfg.family} model")
    check_layout(cfg.model)
    return "phi3"


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    check_layout(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rope_fraction}
    return {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_width, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "hidden_act": "silu", "max_position_embeddings": cfg.context,
        "original_max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
        "rope_parameters": rope, "partial_rotary_factor": cfg.rope_fraction,
        "sliding_window": cfg.window, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attention_dropout": 0.0, "torch_dtype": "float32",
    }


def hf_weights(model: GPT) -> dict[str, Tensor]:
    """The model's tensors under Phi-3's names: Llama's, with q/k/v and gate/up fused."""
    tensors = llama.hf_tensors(model, llama._names(model.cfg))
    for i in range(model.cfg.n_layer):
        layer = f"model.layers.{i}."
        tensors[layer + "self_attn.qkv_proj.weight"] = torch.cat(
            [tensors.pop(layer + f"self_attn.{p}_proj.weight") for p in "qkv"])
        tensors[layer + "mlp.gate_up_proj.weight"] = torch.cat(
            [tensors.pop(layer + f"mlp.{p}_proj.weight") for p in ("gate", "up")])
    return tensors


def export_phi3(checkpoint: Path, dest: Path) -> Path:
    """A tformer GPT checkpoint of Phi-3's layout -> a directory Phi3ForCausalLM and
    AutoTokenizer load."""
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(checkpoint, family="gpt", weights="fp32")
    return llama.write_hf_gpt(loaded, hf_config(loaded.model.cfg), hf_weights(loaded.model),
                              dest)
