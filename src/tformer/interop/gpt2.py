"""Hugging Face GPT-2 (GPT2LMHeadModel) in and out.

GPT-2 is a pre-norm GPT with learned positions, biases everywhere, tied embeddings, GELU's
tanh approximation and a final LayerNorm: every piece has a GPTConfig field, so the
conversion only renames tensors. GPT-2 stores its linear layers as `Conv1D`, whose weight
is the transpose of nn.Linear's; the fused query/key/value projection has the same
[q | k | v] column order as ours.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.config import RunConfig, TrainConfig
from tformer.data.lm import LMDataConfig
from tformer.data.tokenizers import PretrainedBPETokenizer
from tformer.errors import TformerError
from tformer.interop import (
    export_token_ids,
    gpt_of_state,
    read_chat_template,
    read_hf_config,
    read_hf_weights,
    take,
    write_chat_template,
)
from tformer.models.gpt import GPT, GPTConfig

log = logging.getLogger(__name__)

# Hugging Face's activation names -> ours. "gelu_new" is GPT-2's tanh approximation.
ACTIVATIONS_IN = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": None,  # another approximation, close but not equal to ours
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
ACTIVATIONS_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
ENDOFTEXT = "<|endoftext|>"


def _transposed(name: str) -> bool:
    """Conv1D weights (stored in x out): the attention and MLP matrices."""
    return name.endswith(".weight") and (".attn." in name or ".mlp." in name)


def _names(n_layer: int, tied: bool) -> dict[str, str]:
    """Ours -> GPT-2's (without the `transformer.` prefix of GPT2LMHeadModel)."""
    names = {
        "embed.weight": "wte.weight",
        "positions.table.weight": "wpe.weight",
        "final_norm.weight": "ln_f.weight",
        "final_norm.bias": "ln_f.bias",
    }
    parts = {
        "attn_residual.norm": "ln_1",
        "attn.qkv_proj": "attn.c_attn",
        "attn.out_proj": "attn.c_proj",
        "ff_residual.norm": "ln_2",
        "ff.up": "mlp.c_fc",
        "ff.down": "mlp.c_proj",
    }
    for i in range(n_layer):
        for ours, theirs in parts.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"h.{i}.{theirs}.{kind}"
    if not tied:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def gpt_config(hf: dict[str, Any], source: Path) -> GPTConfig:
    """GPT2Config's fields -> GPTConfig; what tformer cannot express is an error naming it."""
    problems = []
    activation = ACTIVATIONS_IN.get(hf.get("activation_function", "gelu_new"))
    if activation is None:
        problems.append(f"activation_function = {hf.get('activation_function')!r}")
    checks = {
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False,
    }
    for key, wanted in checks.items():
        if key in hf and hf[key] != wanted:
            problems.append(f"{key} = {hf[key]!r}")
    if problems:
        raise TformerError(
            f"{source}: tformer's GPT cannot express {', '.join(problems)}"
        )
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        context=hf.get("n_positions", 1024),
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        d_model=hf.get("n_embd", 768),
        d_ff=hf.get("n_inner") or 0,
        dropout=float(hf.get("resid_pdrop", 0.1)),
        activation=activation,
        position="learned",
        norm="pre",
        tie_embeddings=hf.get("tie_word_embeddings", True),
        bias=True,
    )


def _special(config: dict[str, Any], key: str, default: str | None) -> str | None:
    value = config.get(key, default)
    if isinstance(value, dict):  # an AddedToken, as older tokenizer configs store it
        value = value.get("content")
    return value


def read_tokenizer(src: Path) -> PretrainedBPETokenizer:
    """GPT-2's byte-level BPE from tokenizer.json, or built from vocab.json + merges.txt the
    way Hugging Face's GPT2Tokenizer builds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (src / name).is_file():
            config.update(json.loads((src / name).read_text(encoding="utf-8")))
    if (src / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    elif (src / "vocab.json").is_file() and (src / "merges.txt").is_file():
        vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
        lines = (src / "merges.txt").read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#")]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=bool(config.get("add_prefix_space", False))
        )
        tok.decoder = decoders.ByteLevel()
        specials = {_special(config, k, ENDOFTEXT) for k in ("bos_token", "eos_token")}
        tok.add_special_tokens([AddedToken(t, special=True) for t in sorted(specials - {None})])
    else:
        raise TformerError(f"{src} has no tokenizer.json, nor vocab.json and merges.txt")
    tokenizer = PretrainedBPETokenizer(
        tok,
        bos=_special(config, "bos_token", ENDOFTEXT),
        eos=_special(config, "eos_token", ENDOFTEXT),
        pad=_special(config, "pad_token", None),
    )
    tokenizer.chat_template = read_chat_template(src, config)
    return tokenizer


def gpt_from_hf(hf: dict[str, Any], weights: dict[str, Tensor], source: Path | str) -> GPT:
    """A GPT with the weights of a GPT2LMHeadModel, from its config and its tensors (as
    saved, or its state_dict()). `source` names it in errors."""
    cfg = gpt_config(hf, Path(source))
    weights = {k.removeprefix("transformer."): v for k, v in weights.items()}
    # Causal-mask buffers that older versions saved with the weights.
    for name in [k for k in weights if k.endswith((".attn.bias", ".attn.masked_bias"))]:
        if weights[name].dtype == torch.bool or weights[name].dim() != 1:
            del weights[name]
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)  # state_dict() lists the tied copy too
    state = {}
    for ours, theirs in _names(cfg.n_layer, cfg.tie_embeddings).items():
        tensor = take(weights, theirs, Path(source)).float()
        state[ours] = tensor.t().contiguous() if _transposed(theirs) else tensor
    return gpt_of_state(cfg, state, weights, source)


def import_gpt2(src: Path, dest: Path) -> Path:
    """A local GPT2LMHeadModel directory -> a tformer GPT checkpoint at `dest`."""
    from tformer.training.checkpoint import save_checkpoint

    hf = read_hf_config(src)
    model = gpt_from_hf(hf, read_hf_weights(src), src)
    tokenizer = read_tokenizer(src)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise TformerError(
            f"{src}: the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{model.cfg.vocab_size}"
        )
    run = RunConfig("gpt", model.cfg, LMDataConfig(), TrainConfig())
    save_checkpoint(dest, run, model, tokenizer)
    log.info("imported %s as a %d-layer GPT into %s", src, model.cfg.n_layer, dest)
    return dest


# --- export -------------------------------------------------------------------------------


def gpt2_config(cfg: GPTConfig) -> dict[str, Any]:
    """GPTConfig -> GPT2Config's fields; a config GPT-2 cannot express is an error listing
    every field that differs."""
    differ = []
    wanted = {
        "position": "learned", "norm": "pre", "final_norm": True, "bias": True,
        "output_bias": False, "scale_embeddings": False, "embed_norm": False,
        "norm_kind": "layernorm", "norm_eps": 1e-5, "feedforward": "plain", "rotary": False,
        "qk_norm": False, "window": None, "sandwich_norm": False, "attn_scale": None,
        "attn_softcap": None, "logit_softcap": None, "n_expert": 0, "attn_sinks": False,
    }
    for key, value in wanted.items():
        if getattr(cfg, key) != value:
            differ.append(f"model.{key} = {getattr(cfg, key)!r} (GPT-2: {value!r})")
    if cfg.attn_bias is False or cfg.qkv_bias is False:
        differ.append("model.attn_bias / qkv_bias = False (GPT-2: true)")
    if cfg.n_kv_head not in (None, cfg.n_head):
        differ.append(f"model.n_kv_head = {cfg.n_kv_head} (GPT-2: n_head)")
    if cfg.d_head not in (None, cfg.d_model // cfg.n_head) or cfg.d_model % cfg.n_head:
        differ.append(f"model.d_head = {cfg.d_head} (GPT-2: d_model / n_head)")
    if cfg.d_value not in (None, cfg.d_head or cfg.d_model // cfg.n_head):
        differ.append(f"model.d_value = {cfg.d_value} (GPT-2: d_head)")
    if cfg.activation not in ACTIVATIONS_OUT:
        differ.append(f"model.activation = {cfg.activation!r}")
    if differ:
        raise TformerError("GPT-2 cannot express this model: " + "; ".join(differ))
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff or None,
        "activation_function": ACTIVATIONS_OUT[cfg.activation],
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def exported_family(cfg: RunConfig) -> str:
    """"gpt2" where GPT-2 expresses the run's model exactly, else a TformerError saying why."""
    if cfg.family != "gpt":
        raise TformerError(f"GPT-2 is a gpt model; this is a {cfg.family} model")
    gpt2_config(cfg.model)
    return "gpt2"


def _write_tokenizer(tokenizer: Any, dest: Path) -> dict[str, Any]:
    """tokenizer.json, vocab.json and merges.txt, and the special tokens for the configs."""
    if tokenizer.kind == "gpt2":
        names = tokenizer.names
    elif tokenizer.kind == "bpe":  # trained here: the same byte-level BPE, our specials
        names = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}
    else:
        raise TformerError(
            f"GPT-2 needs a byte-level BPE tokenizer; this checkpoint's is {tokenizer.kind!r}"
        )
    text = tokenizer.tok.to_str()
    (dest / "tokenizer.json").write_text(text, encoding="utf-8")
    model = json.loads(text)["model"]
    (dest / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False),
                                     encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (dest / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                     encoding="utf-8")
    specials = {f"{k}_token": v for k, v in names.items() if v is not None}
    specials.setdefault("unk_token", names["eos"])
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
                        "model_max_length": None, **specials}
    return tokenizer_config


def export_gpt2(checkpoint: Path, dest: Path) -> Path:
    """A tformer GPT checkpoint -> a directory GPT2LMHeadModel.from_pretrained and
    AutoTokenizer.from_pretrained load."""
    from safetensors.torch import save_file

    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(checkpoint, family="gpt", weights="fp32")
    cfg: GPTConfig = loaded.model.cfg
    hf = gpt2_config(cfg)
    if dest.exists() and any(dest.iterdir()):
        raise TformerError(f"{dest} exists and is not empty; choose another directory")
    tmp = dest.with_name(f".tmp-{dest.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer_config = _write_tokenizer(loaded.tokenizer, tmp)
    tokenizer_config["model_max_length"] = cfg.context
    write_chat_template(loaded.tokenizer, tmp, tokenizer_config)
    ids = export_token_ids(loaded.tokenizer, {
        key: tokenizer_config.get(f"{key}_token") for key in ("bos", "eos", "pad")})
    hf.update(ids)
    state = loaded.model.state_dict()
    tensors: dict[str, Tensor] = {}
    for ours, theirs in _names(cfg.n_layer, cfg.tie_embeddings).items():
        tensor = state[ours]
        tensor = tensor.t() if _transposed(theirs) else tensor
        prefix = "" if theirs == "lm_head.weight" else "transformer."
        tensors[prefix + theirs] = tensor.contiguous().clone()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n",
                                               encoding="utf-8")
    (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n",
                                                encoding="utf-8")
    if dest.exists():
        dest.rmdir()
    tmp.rename(dest)
    return dest
