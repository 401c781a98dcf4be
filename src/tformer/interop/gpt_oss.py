"""OpenAI's gpt-oss from Hugging Face folders (GptOssForCausalLM) in and out.

Its layout is the Llama one's (pre-norm RMSNorm, rotary embeddings in the rotate-half
layout with YaRN's scaling, grouped-query attention) with these GPTConfig choices on top:
biases on every attention projection, a sink logit per head in each softmax (attn_sinks),
and a mixture of experts in every layer whose router has a bias and a softmax after top-k,
whose experts have biases and gpt-oss's clamped gate (expert_glu = "clamped", with
swiglu_limit and swiglu_alpha).

transformers stores the experts input-first: gate_up_proj [E, D, 2F] with the gate and up
columns interleaved (gate in the even ones), down_proj [E, F, D]; ours are nn.Linear's
[E, out, in], the gate and up apart.

The released checkpoints hold the experts in MXFP4 (the OCP microscaling format: 32 values
of 4 bits, E2M1, sharing a power-of-two scale), as `*_blocks` and `*_scales`; they are
dequantized to fp32 here (`mxfp4`); export writes them in fp32, the layout
transformers' own save_pretrained writes. Every released gpt-oss alternates sliding-window and
full layers (`layer_types`), which is `window` with `global_every = 2`; another pattern of
the two is refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.config import RunConfig
from tformer.errors import TformerError
from tformer.interop import DECODER_KEYS, gpt_of_state, require_ints, take
from tformer.interop.llama import read_tokenizer, rope_fields, rope_parameters, write_hf_gpt
from tformer.layers.experts import stack_experts
from tformer.models.gpt import GPT, GPTConfig

log = logging.getLogger(__name__)


def gpt_oss_config(hf: dict[str, Any], source: Path) -> GPTConfig:
    """A gpt_oss config.json -> GPTConfig; what tformer cannot express is an error."""
    if hf.get("model_type") != "gpt_oss":
        raise TformerError(f"{source}: model_type {hf.get('model_type')!r} is not gpt_oss")
    require_ints(hf, (*DECODER_KEYS, "num_local_experts", "num_experts_per_tok"), source)
    n_layer, context = int(hf["num_hidden_layers"]), int(hf["max_position_embeddings"])
    window, global_every = _layers(hf, n_layer, source)
    quantization = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization not in (None, "mxfp4"):
        raise TformerError(f"{source}: weights quantized as "
                           f"{quantization} cannot be read")
    d_model, n_head = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or d_model // n_head
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]), context=context, n_layer=n_layer, n_head=n_head,
        d_model=d_model, d_ff=int(hf["intermediate_size"]),
        d_head=None if head_dim * n_head == d_model else head_dim,
        n_kv_head=int(hf.get("num_key_value_heads") or n_head), dropout=0.0,
        activation="silu", position="none", norm="pre", norm_kind="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)), feedforward="gated",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bias=False,
        attn_bias=bool(hf.get("attention_bias", True)), attn_sinks=True, window=window,
        global_every=global_every,
        rotary=True, rope_layout="halves", n_expert=int(hf["num_local_experts"]),
        n_expert_active=int(hf["num_experts_per_tok"]), router_softmax="after",
        router_bias=True, expert_bias=True, expert_glu="clamped",
        glu_limit=float(hf.get("swiglu_limit", 7.0)),
        glu_alpha=float(hf.get("swiglu_alpha", 1.702)), **rope_fields(hf, source),
    )


def _layers(hf: dict[str, Any], n_layer: int, source: Path) -> tuple[int | None, int]:
    """(window, global_every) from layer_types: every layer full (no window), every layer
    sliding (global_every 0), or sliding and full alternating from a sliding first layer
    (global_every 2: every released gpt-oss, and GptOssConfig's default where the config
    lists none); any other pattern is an error naming it."""
    kinds = hf.get("layer_types")
    if kinds is None:  # GptOssConfig's default
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(n_layer)]
    kinds = list(kinds)
    if len(kinds) != n_layer or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise TformerError(f"{source}: layer_types {kinds} is not one of sliding_attention "
                           f"and full_attention a layer")
    if "sliding_attention" not in kinds:
        return None, 0
    if not isinstance(hf.get("sliding_window"), int) or hf["sliding_window"] < 1:
        raise TformerError(f"{source}: sliding_attention layers without a sliding_window")
    window = int(hf["sliding_window"])
    if "full_attention" not in kinds:
        return window, 0
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                   for i in range(n_layer)]
    if kinds != alternating:
        raise TformerError(f"{source}: layer_types {kinds} cannot be expressed: sliding-window "
                           f"layers among full ones must alternate, sliding first")
    return window, 2


def _state(cfg: GPTConfig, weights: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """Our state dict from transformers' tensors (as saved, or its state_dict()); each
    tensor taken from `weights` as it is placed."""
    state = {"embed.weight": take(weights, "model.embed_tokens.weight", source),
             "final_norm.weight": take(weights, "model.norm.weight", source)}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = take(weights, "lm_head.weight", source)
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        state |= {
            ours + "attn_residual.norm.weight": take(weights, theirs + "input_layernorm.weight",
                                                     source),
            ours + "ff_residual.norm.weight": take(
                weights, theirs + "post_attention_layernorm.weight", source),
            ours + "attn.qkv_proj.weight": torch.cat(
                [take(weights, f"{attn}{p}_proj.weight", source) for p in "qkv"]),
            ours + "attn.qkv_proj.bias": torch.cat(
                [take(weights, f"{attn}{p}_proj.bias", source) for p in "qkv"]),
            ours + "attn.out_proj.weight": take(weights, attn + "o_proj.weight", source),
            ours + "attn.out_proj.bias": take(weights, attn + "o_proj.bias", source),
            ours + "attn.sinks": take(weights, attn + "sinks", source),
            ours + "ff.router.weight": take(weights, mlp + "router.weight", source),
            ours + "ff.router.bias": take(weights, mlp + "router.bias", source),
        }
        gate_up = take(weights, mlp + "experts.gate_up_proj", source)
        gate_up_bias = take(weights, mlp + "experts.gate_up_proj_bias", source)
        state |= {  # input-first and interleaved -> ours: output rows first, apart
            ours + "ff.experts.gate": gate_up[..., 0::2].transpose(1, 2),
            ours + "ff.experts.up": gate_up[..., 1::2].transpose(1, 2),
            ours + "ff.experts.gate_bias": gate_up_bias[:, 0::2],
            ours + "ff.experts.up_bias": gate_up_bias[:, 1::2],
            ours + "ff.experts.down": take(weights, mlp + "experts.down_proj", source
                                           ).transpose(1, 2),
            ours + "ff.experts.down_bias": take(weights, mlp + "experts.down_proj_bias",
                                                source),
        }
    return {name: t.float().contiguous() for name, t in state.items()}


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit)."""


def mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """MXFP4 -> fp32: blocks (..., G, 16) uint8, two 4-bit codes a byte (the low nibble the
    earlier value), and scales (..., G) uint8, each group's power of two biased by 127 ->
    (..., G * 32) values."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise TformerError(f"MXFP4 blocks {list(blocks.shape)} and scales "
                           f"{list(scales.shape)} do not pair up")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1)[codes]
    values = torch.ldexp(values, scales.long()[..., None] - 127)
    return values.flatten(-2)


def gpt_oss_from_hf(hf: dict[str, Any], weights: dict[str, Any],
                    source: Path | str) -> GPT:
    """A GPT with the weights of a gpt-oss model, from its config and its tensors. `source`
    names it in errors."""
    source = Path(source)
    cfg = gpt_oss_config(hf, source)
    # A GGUF file's tensors (interop.gguf.Deferred) are read when first needed, here.
    weights = {name: t if isinstance(t, Tensor) else t.float() for name, t in weights.items()}
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)
    for name in [k for k in weights if k.endswith("_blocks")]:
        stem = name.removesuffix("_blocks")
        # Stored output rows first ([E, out, in]); transformers' tensor is input-first.
        weights[stem] = mxfp4(weights.pop(name), take(weights, stem + "_scales", source)
                              ).transpose(1, 2)
    state = _state(cfg, weights, source)
    return gpt_of_state(cfg, state, weights, source)


def import_gpt_oss(src: Path, dest: Path) -> Path:
    """A local gpt-oss directory -> a tformer GPT checkpoint."""
    from tformer.config import TrainConfig
    from tformer.data.lm import LMDataConfig
    from tformer.interop import read_hf_config, read_hf_weights
    from tformer.training.checkpoint import save_checkpoint

    hf = read_hf_config(src)
    model = gpt_oss_from_hf(hf, read_hf_weights(src), src)
    tokenizer = read_tokenizer(src, hf)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise TformerError(f"{src}: the tokenizer has {tokenizer.vocab_size} tokens, the model "
                           f"only {model.cfg.vocab_size}")
    save_checkpoint(dest, RunConfig("gpt", model.cfg, LMDataConfig(), TrainConfig()), model,
                    tokenizer)
    log.info("imported %s (gpt_oss) as a %d-layer GPT into %s", src, model.cfg.n_layer, dest)
    return dest


# --- export -------------------------------------------------------------------------------


def check_layout(cfg: GPTConfig) -> None:
    """A TformerError listing every field in which `cfg` is not gpt-oss's layout: the parts
    GptOssForCausalLM always has (sinks, biased router and experts, the clamped gate) are
    required, since it has no switch to leave them out."""
    wanted = {"position": "none", "rotary": True, "norm": "pre", "norm_kind": "rmsnorm",
              "bias": False, "qk_norm": False, "final_norm": True, "output_bias": False,
              "scale_embeddings": False, "embed_norm": False, "rope_layout": "halves",
              "rope_fraction": 1.0, "d_value": None, "sandwich_norm": False,
              "attn_scale": None, "attn_softcap": None, "logit_softcap": None,
              "rope_local_theta": None, "attn_sinks": True, "router_softmax": "after",
              "router_renormalise": False, "d_shared_expert": 0, "expert_glu": "clamped",
              "expert_bias": True, "router_bias": True}
    differ = [f"model.{key} = {getattr(cfg, key)!r} (gpt-oss: {value!r})"
              for key, value in wanted.items() if getattr(cfg, key) != value]
    if not cfg.n_expert:
        differ.append("model.n_expert = 0 (gpt-oss: a mixture of experts in every layer)")
    if cfg.qkv_bias is not None and cfg.qkv_bias != cfg.attention_bias:
        differ.append(f"model.qkv_bias = {cfg.qkv_bias} apart from model.attn_bias = "
                      f"{cfg.attention_bias} (gpt-oss: one attention_bias for all four)")
    if cfg.window is not None and cfg.global_every not in (0, 2):
        differ.append(f"model.global_every = {cfg.global_every} (gpt-oss's layer_types "
                      f"here: 0 or 2)")
    if differ:
        raise TformerError("gpt-oss cannot express this model: " + "; ".join(differ))


def exported_family(cfg: RunConfig) -> str:
    if cfg.family != "gpt":
        raise TformerError(f"gpt-oss models are gpt models; this is a {cfg.family} model")
    check_layout(cfg.model)
    return "gpt_oss"


def layer_types(cfg: GPTConfig) -> list[str]:
    return ["sliding_attention" if cfg.window is not None and cfg.slides(i)
            else "full_attention" for i in range(cfg.n_layer)]


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """GPTConfig -> a gpt_oss config.json in transformers 5's field names."""
    check_layout(cfg)
    rope = rope_parameters(cfg)
    return {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": cfg.head_size, "hidden_act": "silu",
        "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.attention_bias, "sliding_window": cfg.window,
        "layer_types": layer_types(cfg), "num_local_experts": cfg.n_expert,
        "num_experts_per_tok": cfg.n_expert_active, "swiglu_limit": cfg.glu_limit,
        "swiglu_alpha": cfg.glu_alpha, "attention_dropout": 0.0, "torch_dtype": "float32",
    }


def hf_weights(model: GPT) -> dict[str, Tensor]:
    """The model's tensors under transformers' names, the inverse of `_state`: q/k/v split,
    the experts input-first with gate and up interleaved."""
    cfg, state = model.cfg, model.state_dict()
    tensors = {"model.embed_tokens.weight": state["embed.weight"],
               "model.norm.weight": state["final_norm.weight"]}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = state["lm_head.weight"]
    widths = model.blocks[0].attn.widths
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        tensors |= {theirs + "input_layernorm.weight": state[ours + "attn_residual.norm.weight"],
                    theirs + "post_attention_layernorm.weight":
                        state[ours + "ff_residual.norm.weight"],
                    attn + "sinks": state[ours + "attn.sinks"],
                    mlp + "router.weight": state[ours + "ff.router.weight"],
                    mlp + "router.bias": state[ours + "ff.router.bias"]}
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            parts = state[f"{ours}attn.qkv_proj.{kind}"].split(widths)
            tensors |= {f"{attn}{p}_proj.{kind}": t for p, t in zip("qkv", parts, strict=True)}
            tensors[f"{attn}o_proj.{kind}"] = state[f"{ours}attn.out_proj.{kind}"]
        experts = ours + "ff.experts."
        gate, up = state[experts + "gate"], state[experts + "up"]
        tensors |= {  # ours [E, out, in] -> input-first, the gate in the even columns
            mlp + "experts.gate_up_proj": torch.stack(
                [gate.transpose(1, 2), up.transpose(1, 2)], -1).flatten(-2),
            mlp + "experts.gate_up_proj_bias": torch.stack(
                [state[experts + "gate_bias"], state[experts + "up_bias"]], -1).flatten(-2),
            mlp + "experts.down_proj": state[experts + "down"].transpose(1, 2),
            mlp + "experts.down_proj_bias": state[experts + "down_bias"],
        }
    return {name: t.contiguous().clone() for name, t in tensors.items()}


def export_gpt_oss(checkpoint: Path, dest: Path) -> Path:
    """A tformer GPT checkpoint of gpt-oss's layout -> a directory GptOssForCausalLM and
    AutoTokenizer load."""
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(checkpoint, family="gpt", weights="fp32")
    stack_experts(loaded.model)  # a GGUF file's expert blocks are held one expert a layer
    return write_hf_gpt(loaded, hf_config(loaded.model.cfg), hf_weights(loaded.model), dest)
