"""The mixtures of experts of the Llama-layout families (interop.llama): Qwen2-MoE and
Qwen3-MoE (Qwen2 and Qwen3 whose feed-forward is a mixture) and Mixtral (Mistral's).

Their feed-forward is a router (`mlp.gate`), experts saved one by one (`mlp.experts.{e}.
gate_proj`, ...; transformers 5's state_dict() fuses them, `experts.gate_up_proj`) that
become our stacked [E, ...] tensors, and in Qwen2-MoE a shared expert with a sigmoid gate.
Mixtral names the same parts `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1`
(gate), `w3` (up), `w2` (down), and always renormalises its chosen experts' weights.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from tformer.errors import TformerError
from tformer.models.gpt import GPTConfig

MIXTURES = ("qwen2_moe", "qwen3_moe", "mixtral")
"""The model types whose feed-forward is a mixture of experts."""


def mixture_fields(hf: dict[str, Any], source: Path) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen2-MoE, Qwen3-MoE or Mixtral config.json
    (every layer's feed-forward a mixture: dense layers among them cannot be expressed)."""
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise TformerError(f"{source}: dense feed-forward layers among the experts' "
                           f"(mlp_only_layers = {hf.get('mlp_only_layers')}, "
                           f"decoder_sparse_step = {hf.get('decoder_sparse_step')}) cannot be "
                           f"expressed")
    mixtral = hf["model_type"] == "mixtral"
    n_expert = hf.get("num_experts", hf.get("num_local_experts"))
    width = "intermediate_size" if mixtral else "moe_intermediate_size"
    needed = {"num_experts": n_expert, "num_experts_per_tok": hf.get("num_experts_per_tok"),
              width: hf.get(width)}
    missing = [key for key, value in needed.items() if not isinstance(value, int)]
    if missing:
        raise TformerError(f"{source}: config.json of a {hf['model_type']} model has no "
                           f"{', '.join(missing)}")
    return {"n_expert": n_expert, "n_expert_active": int(hf["num_experts_per_tok"]),
            "d_ff": int(hf[width]), "router_softmax": "before",
            "router_renormalise": mixtral or bool(hf.get("norm_topk_prob", False)),
            "d_shared_expert": int(hf.get("shared_expert_intermediate_size") or 0)}


class Stacked(tuple):
    """Names of tensors of one shape stacked along a new first dimension (the experts'),
    where a plain tuple's are concatenated along the existing one (the q/k/v rows)."""


def feedforward_names(cfg: GPTConfig, ours: str, theirs: str) -> dict[str, Any]:
    """A block's feed-forward: dense, or the router, the experts one by one (stacked), and
    Qwen2-MoE's shared expert."""
    dense = {f"{ours}{p}.weight": f"{theirs}{p}_proj.weight" for p in ("gate", "up", "down")}
    if not cfg.n_expert:
        return dense
    names: dict[str, Any] = {ours + "router.weight": theirs + "gate.weight"}
    for p in ("gate", "up", "down"):
        names[f"{ours}experts.{p}"] = Stacked(f"{theirs}experts.{e}.{p}_proj.weight"
                                              for e in range(cfg.n_expert))
    if cfg.d_shared_expert:
        names |= feedforward_names(replace(cfg, n_expert=0), ours + "shared.",
                                    theirs + "shared_expert.")
        names[ours + "shared_gate"] = theirs + "shared_expert_gate.weight"
    return names


MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                 ".w2.": ".down_proj."}
"""Mixtral's names of the mixture's parts -> Qwen-MoE's, which the mapping reads."""


def rename_weights(weights: dict[str, Tensor], table: dict[str, str]) -> dict[str, Tensor]:
    """The tensors with every part of their names that `table` lists replaced."""
    out = {}
    for name, tensor in weights.items():
        for theirs, ours in table.items():
            name = name.replace(theirs, ours)
        out[name] = tensor
    return out


def _one_by_one(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5's fused experts (a model's state_dict(): `experts.gate_up_proj` [E, 2F,
    D] and `experts.down_proj` [E, D, F]) as the one-by-one tensors its files hold."""
    out = dict(weights)
    for name in [k for k in weights if k.endswith("experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate, up = out.pop(name).chunk(2, dim=1)
        down = out.pop(prefix + "down_proj")
        for e in range(gate.shape[0]):
            for p, t in (("gate", gate), ("up", up), ("down", down)):
                out[f"{prefix}{e}.{p}_proj.weight"] = t[e]
    return out


def as_saved(weights: dict[str, Tensor], model_type: str) -> dict[str, Tensor]:
    """A model's tensors (as saved, or its state_dict()) under the names feedforward_names
    reads: experts one by one, Mixtral's renamed as Qwen-MoE's."""
    weights = _one_by_one(weights)
    return rename_weights(weights, MIXTRAL_NAMES) if model_type == "mixtral" else weights


def mixture_type(cfg: GPTConfig, dense_type: str) -> tuple[str, list[str]]:
    """The mixture-of-experts family of a model whose attention is `dense_type`'s, and the
    fields that keep it from being one."""
    model_type = {"qwen2": "qwen2_moe", "qwen3": "qwen3_moe", "llama": "mixtral",
                  "mistral": "mixtral"}[dense_type]
    differ = [f"model.{key} = {getattr(cfg, key)!r} ({model_type}: {value!r})"
              for key, value in (("expert_glu", "gated"), ("expert_bias", False),
                                 ("router_bias", False)) if getattr(cfg, key) != value]
    if cfg.router_softmax != "before":
        differ.append(f"model.router_softmax = {cfg.router_softmax!r} ({model_type}: "
                      f"'before')")
    if model_type == "mixtral":
        if not cfg.router_renormalise:
            differ.append("model.router_renormalise = false (Mixtral renormalises)")
        if cfg.attention_bias:
            differ.append("model.attn_bias = true (Mixtral: none)")
    if model_type in ("qwen3_moe", "mixtral") and cfg.d_shared_expert:
        differ.append(f"model.d_shared_expert = {cfg.d_shared_expert} ({model_type}: none)")
    if model_type == "qwen2_moe" and not cfg.d_shared_expert:
        differ.append("model.d_shared_expert = 0 (Qwen2-MoE has a shared expert)")
    return model_type, differ


def mixture_config(cfg: GPTConfig, model_type: str) -> dict[str, Any]:
    """The config.json keys of a mixture of `model_type`."""
    if model_type == "mixtral":  # its experts are intermediate_size wide
        return {"num_local_experts": cfg.n_expert, "num_experts_per_tok": cfg.n_expert_active,
                "router_jitter_noise": 0.0}
    hf = {"num_experts": cfg.n_expert, "num_experts_per_tok": cfg.n_expert_active,
          "moe_intermediate_size": cfg.ff_width, "norm_topk_prob": cfg.router_renormalise,
          "decoder_sparse_step": 1, "mlp_only_layers": []}
    if model_type == "qwen2_moe":
        hf |= {"shared_expert_intermediate_size": cfg.d_shared_expert, "qkv_bias": True}
    return hf
