"""Hugging Face's Llama-layout decoders in: LlamaForCausalLM (SmolLM2 and Llama 3.x are
`llama`), Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM, and the mixtures of
experts Qwen2MoeForCausalLM and Qwen3MoeForCausalLM.

They share one layout, and every piece of it is a GPTConfig field: pre-norm RMSNorm, no
absolute positions, rotary embeddings in the rotate-half layout, SwiGLU feed-forward,
grouped-query attention, no biases. They differ in a few fields: Qwen2 has biases on the
q/k/v projections (not on the output one), Qwen3 a per-head RMSNorm on queries and keys and
a head size of its own, Mistral a sliding window, Llama 3 its rope scaling. The separate
q/k/v projections become our fused one, stacked in [q | k | v] order.
Qwen2-MoE, Qwen3-MoE and Mixtral are Qwen2, Qwen3 and Mistral whose feed-forward is a
mixture of experts: interop.llama_moe maps that part.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.config import RunConfig, TrainConfig
from tformer.data.lm import LMDataConfig
from tformer.data.tokenizers import PretrainedBPETokenizer
from tformer.errors import TformerError
from tformer.interop import (
    DECODER_KEYS,
    adds_bos,
    export_token_ids,
    gpt_of_state,
    read_chat_template,
    read_hf_config,
    read_hf_weights,
    read_json,
    require_ints,
    special_ids,
    take,
    with_bos_template,
    write_chat_template,
)
from tformer.interop.llama_moe import (
    MIXTRAL_NAMES,
    MIXTURES,
    Stacked,
    as_saved,
    feedforward_names,
    mixture_config,
    mixture_fields,
    mixture_type,
    rename_weights,
)
from tformer.layers.experts import stack_experts
from tformer.models.gpt import GPT, GPTConfig

log = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}


def rope_fields(hf: dict[str, Any], source: Path) -> dict[str, Any]:
    """The rotary fields, from transformers 4.x's rope_theta + rope_scaling or 5.x's
    rope_parameters."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise TformerError(f"{source}: rope type {kind!r} cannot be expressed; "
                           f"tformer has {', '.join(ROPE_TYPES)}")
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": ROPE_TYPES[kind]}
    if kind != "default":
        fields["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        fields.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                      rope_high_freq_factor=float(params["high_freq_factor"]),
                      rope_original_context=int(params["original_max_position_embeddings"]))
    if kind == "yarn":
        fields |= _yarn(params, source)
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    fields["rope_fraction"] = float(fraction)
    return fields


def _yarn(params: dict[str, Any], source: Path) -> dict[str, Any]:
    """YaRN's fields; DeepSeek's mscale form of its attention factor is refused."""
    if params.get("attention_factor") is None and (params.get("mscale")
                                                   or params.get("mscale_all_dim")):
        raise TformerError(f"{source}: yarn's mscale / mscale_all_dim cannot be expressed")
    if not params.get("original_max_position_embeddings"):
        raise TformerError(f"{source}: yarn rope scaling without "
                           f"original_max_position_embeddings cannot be expressed")
    factor = params.get("attention_factor")
    return {"rope_original_context": int(params["original_max_position_embeddings"]),
            "rope_beta_fast": float(params.get("beta_fast") or 32.0),
            "rope_beta_slow": float(params.get("beta_slow") or 1.0),
            "rope_truncate": bool(params.get("truncate", True)),
            "rope_attention_factor": None if factor is None else float(factor)}


def llama_config(hf: dict[str, Any], source: Path) -> GPTConfig:
    """A Llama-layout config.json -> GPTConfig; what tformer cannot express is an error."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise TformerError(f"{source}: model_type {model_type!r} is not one of "
                           f"{', '.join(MODEL_TYPES)}")
    refused = [key for key in ("attn_logit_softcapping", "final_logit_softcapping")
               if hf.get(key)]
    if model_type not in MIXTURES:
        refused += [key for key in ("num_local_experts", "num_experts") if hf.get(key)]
    if hf.get("mlp_bias"):
        refused.append("mlp_bias")
    if hf.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act = {hf['hidden_act']}")
    if refused:
        raise TformerError(f"{source}: tformer cannot express {', '.join(refused)}")
    require_ints(hf, DECODER_KEYS, source)
    d_model, n_head = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or d_model // n_head
    window = None
    if model_type in ("mistral", "mixtral") or hf.get("use_sliding_window"):
        window = hf.get("sliding_window")
    if window is not None and model_type in ("qwen2", "qwen2_moe") and (
            hf.get("max_window_layers", hf["num_hidden_layers"]) < hf["num_hidden_layers"]):
        raise TformerError(f"{source}: a sliding window on some layers only cannot be expressed")
    attention_bias = bool(hf.get("attention_bias", False))
    experts = mixture_fields(hf, source) if model_type in MIXTURES else {}
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]), context=int(hf["max_position_embeddings"]),
        n_layer=int(hf["num_hidden_layers"]), n_head=n_head, d_model=d_model,
        **({"d_ff": int(hf["intermediate_size"])} | experts),
        d_head=None if head_dim * n_head == d_model else head_dim,
        n_kv_head=int(hf.get("num_key_value_heads") or n_head), dropout=0.0,
        activation="silu", position="none", norm="pre", norm_kind="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), feedforward="gated",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bias=False,
        attn_bias=attention_bias,
        qkv_bias=True if model_type in ("qwen2", "qwen2_moe") else None,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), window=window, rotary=True,
        rope_layout="halves",
        **rope_fields(hf, source),
    )


def _names(cfg: GPTConfig) -> dict[str, str | tuple[str, ...]]:
    """Ours -> theirs (several of theirs concatenated into one of ours: the q/k/v
    projections; or stacked, a Stacked: the experts)."""
    names: dict[str, str | tuple[str, ...]] = {
        "embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
    }
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn = theirs + "self_attn."
        names |= {
            ours + "attn_residual.norm.weight": theirs + "input_layernorm.weight",
            ours + "ff_residual.norm.weight": theirs + "post_attention_layernorm.weight",
            ours + "attn.qkv_proj.weight": tuple(attn + f"{p}_proj.weight" for p in "qkv"),
            ours + "attn.out_proj.weight": attn + "o_proj.weight",
        }
        names |= feedforward_names(cfg, ours + "ff.", theirs + "mlp.")
        if cfg.qkv_bias or cfg.attn_bias:
            names[ours + "attn.qkv_proj.bias"] = tuple(attn + f"{p}_proj.bias" for p in "qkv")
        if cfg.attn_bias:
            names[ours + "attn.out_proj.bias"] = attn + "o_proj.bias"
        if cfg.qk_norm:
            names[ours + "attn.q_norm.weight"] = attn + "q_norm.weight"
            names[ours + "attn.k_norm.weight"] = attn + "k_norm.weight"
    return names


def llama_from_hf(hf: dict[str, Any], weights: dict[str, Tensor], source: Path | str) -> GPT:
    """A GPT with the weights of a Llama-layout model, from its config and its tensors (as
    saved, or its state_dict()). `source` names it in errors."""
    source = Path(source)
    cfg = llama_config(hf, source)
    return build_gpt(cfg, _names(cfg), as_saved(weights, hf["model_type"]), source)


def build_gpt(cfg: GPTConfig, names: dict[str, str | tuple[str, ...]],
              weights: dict[str, Tensor], source: Path) -> GPT:
    """A GPT of `cfg` holding `weights` (Hugging Face's names), placed by `names` (ours ->
    theirs, several of theirs concatenated into one of ours, or stacked where a Stacked
    names them: the experts); a tensor left over is an error."""
    weights = dict(weights)
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)  # state_dict() lists the tied copy too
    for name in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[name]  # a buffer older versions saved
    state = {}
    for ours, theirs in names.items():
        parts = (theirs,) if isinstance(theirs, str) else theirs
        join = torch.stack if isinstance(theirs, Stacked) else torch.cat
        state[ours] = join([take(weights, p, source).float() for p in parts])
    return gpt_of_state(cfg, state, weights, source)


def read_tokenizer(src: Path, hf: dict[str, Any]) -> PretrainedBPETokenizer:
    """tokenizer.json through the tokenizers library, its special and added tokens with it;
    bos and eos named by tokenizer_config.json, else by generation_config.json's or
    config.json's ids. Every end-of-text id those two list ends a text, and the chat
    template comes along."""
    from tokenizers import Tokenizer

    if not (src / "tokenizer.json").is_file():
        raise TformerError(f"{src} has no tokenizer.json")
    text = (src / "tokenizer.json").read_text(encoding="utf-8")
    tok = Tokenizer.from_str(text)
    config: dict[str, Any] = {}
    if (src / "tokenizer_config.json").is_file():
        config = read_json(src / "tokenizer_config.json")
    ids = {key: special_ids(src, hf, key) for key in ("bos", "eos", "pad")}

    def special(key: str) -> str | None:
        value = config.get(f"{key}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if value is None and ids[key]:
            value = tok.id_to_token(ids[key][0])
        return value

    try:
        tokenizer = PretrainedBPETokenizer(tok, bos=special("bos"), eos=special("eos"),
                                           pad=special("pad"), more_eos=ids["eos"],
                                           add_bos=adds_bos(json.loads(text), special("bos")))
    except TformerError as e:
        raise TformerError(f"{src}: {e}") from None
    tokenizer.chat_template = read_chat_template(src, config)
    return tokenizer


def import_llama(src: Path, dest: Path) -> Path:
    """A local Llama / Qwen2 / Qwen3 / Mistral directory -> a tformer GPT checkpoint."""
    return import_hf_gpt(src, dest, llama_from_hf)


def import_hf_gpt(src: Path, dest: Path, build: Any) -> Path:
    """A local Hugging Face directory -> a tformer GPT checkpoint, the model made by
    build(config.json, weights, src)."""
    from tformer.training.checkpoint import save_checkpoint

    hf = read_hf_config(src)
    model = build(hf, read_hf_weights(src), src)
    tokenizer = read_tokenizer(src, hf)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise TformerError(f"{src}: the tokenizer has {tokenizer.vocab_size} tokens, the model "
                           f"only {model.cfg.vocab_size}")
    save_checkpoint(dest, RunConfig("gpt", model.cfg, LMDataConfig(), TrainConfig()), model,
                    tokenizer)
    log.info("imported %s (%s) as a %d-layer GPT into %s", src, hf["model_type"],
             model.cfg.n_layer, dest)
    return dest


# --- export -------------------------------------------------------------------------------

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}


def model_type_of(cfg: GPTConfig) -> str:
    """The Hugging Face family whose layout `cfg` is exactly; an error listing every field
    that differs where none is."""
    wanted = {"position": "none", "rotary": True, "norm": "pre", "norm_kind": "rmsnorm",
              "feedforward": "gated", "activation": "silu", "bias": False, "final_norm": True,
              "output_bias": False, "scale_embeddings": False, "embed_norm": False,
              "rope_layout": "halves", "rope_fraction": 1.0, "d_value": None,
              "sandwich_norm": False, "attn_scale": None, "attn_softcap": None,
              "logit_softcap": None, "attn_sinks": False}
    differ = [f"model.{key} = {getattr(cfg, key)!r} (Llama: {value!r})"
              for key, value in wanted.items() if getattr(cfg, key) != value]
    if cfg.qk_norm:
        model_type = "qwen3"
    elif cfg.qkv_bias and not cfg.attention_bias:
        model_type = "qwen2"
    elif cfg.window is not None:
        model_type = "mistral"
    else:
        model_type = "llama"
    if model_type != "llama" and cfg.attention_bias:
        differ.append(f"model.attn_bias = true ({model_type}: no bias on o_proj)")
    if cfg.window is not None and cfg.global_every:
        differ.append(f"model.global_every = {cfg.global_every} ({model_type}: every layer "
                      f"slides or none)")
    if model_type in ("qwen3", "qwen2") and cfg.window is not None:
        differ.append(f"model.window = {cfg.window} ({model_type} with q/k norms or biases "
                      f"has no window here)")
    if model_type == "qwen3" and cfg.qkv_bias:
        differ.append("model.qkv_bias = true (Qwen3: none)")
    if cfg.n_expert:
        model_type, mixture_differ = mixture_type(cfg, model_type)
        differ += mixture_differ
    if differ:
        raise TformerError("no Llama-layout family expresses this model: " + "; ".join(differ))
    return model_type


def exported_family(cfg: RunConfig) -> str:
    """The Hugging Face family (llama, qwen2, qwen3, mistral, qwen2_moe, qwen3_moe, mixtral)
    whose layout the run's model is exactly, else a TformerError saying why none is."""
    if cfg.family != "gpt":
        raise TformerError(f"the Llama families are gpt models; this is a {cfg.family} model")
    return model_type_of(cfg.model)


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """GPTConfig -> the config.json of its Hugging Face family (transformers 5.x form, which
    4.x reads too through its rope_theta and rope_scaling keys, written as well)."""
    model_type = model_type_of(cfg)
    rope = rope_parameters(cfg)
    hf = {
        "model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_width, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": cfg.head_size, "hidden_act": "silu",
        "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.attention_bias, "torch_dtype": "float32",
    }
    if cfg.rope_scaling != "none":
        hf["rope_scaling"] = rope
    if model_type in ("mistral", "mixtral"):
        hf["sliding_window"] = cfg.window
    if model_type in ("qwen2", "qwen2_moe"):
        hf |= {"use_sliding_window": False, "sliding_window": None}
    if cfg.n_expert:
        hf |= mixture_config(cfg, model_type)
    return hf


def rope_parameters(cfg: GPTConfig) -> dict[str, Any]:
    """The rotary scaling as transformers' rope_parameters hold it (without rope_theta), the
    inverse of rope_fields."""
    rope: dict[str, Any] = {"rope_type": {"none": "default"}.get(cfg.rope_scaling,
                                                                  cfg.rope_scaling)}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope |= {"low_freq_factor": cfg.rope_low_freq_factor,
                 "high_freq_factor": cfg.rope_high_freq_factor,
                 "original_max_position_embeddings": cfg.rope_original_context}
    if cfg.rope_scaling == "yarn":
        rope |= {"original_max_position_embeddings": cfg.rope_original_context,
                 "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                 "truncate": cfg.rope_truncate}
        if cfg.rope_attention_factor is not None:
            rope["attention_factor"] = cfg.rope_attention_factor
    return rope


def hf_weights(model: GPT) -> dict[str, Tensor]:
    """The model's tensors under their Hugging Face names, the fused q/k/v split apart and
    the stacked experts unbound."""
    cfg = model.cfg
    tensors = hf_tensors(model, _names(cfg))
    if cfg.n_expert and model_type_of(cfg) == "mixtral":
        tensors = rename_weights(tensors, {ours: theirs for theirs, ours in MIXTRAL_NAMES.items()})
    return tensors


def hf_tensors(model: GPT, names: dict[str, str | tuple[str, ...]]) -> dict[str, Tensor]:
    """The model's tensors under the names `names` gives (ours -> theirs), a tensor of
    ours that joins several of theirs split apart (the q/k/v projections) or unbound (a
    Stacked: the experts)."""
    state = model.state_dict()
    attn = model.blocks[0].attn
    q, k, v = attn.widths
    tensors: dict[str, Tensor] = {}
    for ours, theirs in names.items():
        tensor = state[ours]
        if isinstance(theirs, str):
            tensors[theirs] = tensor.contiguous().clone()
        elif isinstance(theirs, Stacked):
            for name, part in zip(theirs, tensor.unbind(0), strict=True):
                tensors[name] = part.contiguous().clone()
        else:
            for name, part in zip(theirs, tensor.split([q, k, v]), strict=True):
                tensors[name] = part.contiguous().clone()
    return tensors


def export_llama(checkpoint: Path, dest: Path) -> Path:
    """A tformer GPT checkpoint of a Llama layout -> a directory its Hugging Face family's
    from_pretrained and AutoTokenizer.from_pretrained load."""
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(checkpoint, family="gpt", weights="fp32")
    stack_experts(loaded.model)  # a file's expert blocks were held one layer an expert
    return write_hf_gpt(loaded, hf_config(loaded.model.cfg), hf_weights(loaded.model), dest)


def write_hf_gpt(loaded: Any, hf: dict[str, Any], weights: dict[str, Tensor],
                 dest: Path) -> Path:
    """A loaded checkpoint (tformer.loading) -> a Hugging Face directory at `dest` with
    config.json `hf` and `weights`, its tokenizer, chat template and generation config."""
    import shutil

    from safetensors.torch import save_file

    tokenizer = loaded.tokenizer
    if getattr(tokenizer, "tok", None) is None:
        raise TformerError(f"a Hugging Face tokenizer.json needs a BPE tokenizer; this "
                           f"checkpoint's is {tokenizer.kind!r}")
    if dest.exists() and any(dest.iterdir()):
        raise TformerError(f"{dest} exists and is not empty; choose another directory")
    tmp = dest.with_name(f".tmp-{dest.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = getattr(tokenizer, "names", {"bos": "<s>", "eos": "</s>", "pad": "<pad>"})
    specials = {f"{k}_token": v for k, v in names.items() if v is not None}
    ids = export_token_ids(tokenizer, names)
    hf |= ids
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "tokenizer.json").write_text(with_bos_template(tokenizer), encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                        "model_max_length": hf["max_position_embeddings"], **specials}
    write_chat_template(tokenizer, tmp, tokenizer_config)
    files = {"config.json": hf, "tokenizer_config.json": tokenizer_config,
             "generation_config.json": ids}
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    if dest.exists():
        dest.rmdir()
    tmp.rename(dest)
    return dest
