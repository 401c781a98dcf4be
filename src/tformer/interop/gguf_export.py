"""A tformer GPT checkpoint out as a GGUF file that llama.cpp, Ollama and LM Studio run:
`llama` (or `qwen2`, `qwen3`) for the Llama layout, `gpt2` for GPT-2's, `gemma2`, `gemma3`
and `phi3` for theirs (Gemma's norm weights plus 1, as llama.cpp's converter writes them);
a LoRA run with its
adapters merged; the tokenizer, special ids and chat template in the metadata.

The tensors go the way tformer.interop.gguf brings them in, reversed: Hugging Face's names
(the same mappings interop.llama and interop.gpt2 export with) to llama.cpp's, the query and
key rows of `llama` into pairs order. Matrices are written in the chosen type (f32, f16, or
llama.cpp's q8_0, q4_0, q4_1, q5_0, q5_1, q6_k, iq4_xs blocks, or the q4_k_m and q5_k_m mixtures,
each tensor's type by llama.cpp's rule, kernels.formats.Mix), made by kernels.blocks'
quantizers (byte for byte gguf.quants' where it has one); norms and biases stay f32. A
K type's matrix whose rows are not whole super-blocks takes blocks.FALLBACK's type, as
llama.cpp's quantizer does. A matrix the checkpoint already holds as blocks of the chosen
type (a GGUF file's, brought in) goes out as those bytes, not rounded again; a mixture's
matrices are rounded from the weights they hold.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tformer.errors import TformerError
from tformer.interop.gguf import (
    EXPERT_STACKS,
    GEMMA,
    GPT_OSS_GLU,
    MIXTURES,
    hf_names,
    llama3_factors,
    require_gguf,
)
from tformer.kernels import blocks
from tformer.layers.experts import stack_experts

log = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_k", "iq4_xs",
              "q4_k_m", "q5_k_m")
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9,
              "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "iq4_xs": 30}
"""general.file_type: llama.cpp's enum llama_ftype for a file mostly of that type."""


def permute(rows: Tensor, n_head: int) -> Tensor:
    """Rotate-half rows -> llama.cpp's pairs order (the inverse of gguf.unpermute)."""
    shape = rows.shape
    return rows.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).transpose(1, 2) \
        .reshape(shape)


def _layout(cfg: Any) -> str:
    """The GGUF architecture `cfg` is exactly; an error naming every difference if none."""
    from tformer.interop import gemma, gpt2, llama, llama_moe, phi3

    try:
        model_type = llama.model_type_of(cfg)
    except TformerError as llama_error:
        others = {"gpt2": gpt2.gpt2_config, "gemma": gemma.model_type_of,
                  "phi3": phi3.check_layout, "gpt-oss": _gpt_oss_layout}
        errors = [str(llama_error)]
        for name, check in others.items():
            try:
                found = check(cfg)
            except TformerError as e:
                errors.append(str(e))
                continue
            # llama.cpp names Gemma 3's text model gemma3
            return ({"gpt2": "gpt2", "phi3": "phi3", "gpt-oss": "gpt-oss"}.get(name)
                    or found.removesuffix("_text"))
        raise TformerError("no GGUF architecture expresses this model: "
                           + "; ".join(errors)) from None
    if cfg.rope_scaling == "yarn":
        raise TformerError("GGUF export of yarn rope scaling is not written; export it as a "
                           "Hugging Face folder")
    if model_type == "mixtral":  # llama.cpp's llama architecture, with experts
        if cfg.window is not None and cfg.window < cfg.context:
            raise TformerError(f"GGUF's llama architecture has no sliding window "
                               f"(model.window = {cfg.window})")
        return "llama"
    if model_type in llama_moe.MIXTURES:
        return {hf: arch for arch, hf in MIXTURES.items()}[model_type]
    if model_type == "mistral":
        try:  # Phi-3's architecture has a window (Phi-3-mini-4k's)
            phi3.check_layout(cfg)
            return "phi3"
        except TformerError:
            pass
        raise TformerError(f"GGUF's llama architecture has no sliding window (model.window = "
                           f"{cfg.window})")
    if model_type == "llama" and cfg.attention_bias:
        raise TformerError("GGUF's llama architecture has no attention biases")
    return model_type


def _gpt_oss_layout(cfg: Any) -> None:
    """gpt-oss's Hugging Face layout, narrowed to what llama.cpp's gpt-oss graph computes:
    biased attention, layers sliding and full in turn (sliding first), the clamped gate's
    fixed constants, and YaRN (if any) in the form its metadata can say."""
    from tformer.interop import gpt_oss

    gpt_oss.check_layout(cfg)
    differ = [f"model.{key} = {getattr(cfg, key)} (GGUF gpt-oss: {value})"
              for key, value in GPT_OSS_GLU.items() if getattr(cfg, key) != value]
    if cfg.window is None or cfg.global_every != 2:
        differ.append(f"model.window = {cfg.window}, model.global_every = {cfg.global_every} "
                      f"(GGUF gpt-oss: a window on every other layer, global_every = 2)")
    if not cfg.attention_bias:
        differ.append("model.attn_bias = false (GGUF gpt-oss: biased attention)")
    if cfg.rope_scaling not in ("none", "yarn"):
        differ.append(f"model.rope_scaling = {cfg.rope_scaling!r} (GGUF gpt-oss: none or "
                      f"yarn)")
    if cfg.rope_scaling == "yarn":
        if not cfg.rope_truncate:  # llama.cpp rounds the correction range to whole dims
            differ.append("model.rope_truncate = false (GGUF: yarn's range in whole "
                          "dimensions)")
        if cfg.rope_attention_factor is not None:
            differ.append(f"model.rope_attention_factor = {cfg.rope_attention_factor} "
                          f"(GGUF: 0.1 ln(factor) + 1)")
    if differ:
        raise TformerError("GGUF's gpt-oss cannot express this model: " + "; ".join(differ))


def exported_family(cfg: Any) -> str:
    """The GGUF architecture a run's model is written as (tformer export's `fits`), else a
    TformerError saying why none is."""
    if cfg.family != "gpt":
        raise TformerError(f"GGUF holds gpt models here; this is a {cfg.family} model")
    return f"GGUF {_layout(cfg.model)}"


def _metadata(arch: str, cfg: Any) -> dict[str, Any]:
    """{arch}.* keys, as llama.cpp's converter writes them."""
    keys: dict[str, Any] = {
        "context_length": cfg.context, "embedding_length": cfg.d_model,
        "block_count": cfg.n_layer, "feed_forward_length": cfg.ff_width,
        "attention.head_count": cfg.n_head,
    }
    if arch == "gpt2":
        return keys | {"attention.layer_norm_epsilon": float(cfg.norm_eps)}
    keys |= {
        "attention.head_count_kv": cfg.n_kv_head or cfg.n_head,
        "rope.freq_base": float(cfg.rope_theta),
        "attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        "rope.dimension_count": cfg.head_size, "attention.key_length": cfg.head_size,
        "attention.value_length": cfg.head_size, "vocab_size": cfg.vocab_size,
    }
    if cfg.rope_scaling == "linear":
        keys |= {"rope.scaling.type": "linear", "rope.scaling.factor": float(cfg.rope_factor)}
    if cfg.rope_scaling == "yarn":  # only gpt-oss passes _layout with it
        keys |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(cfg.rope_factor),
                 "rope.scaling.original_context_length": cfg.rope_original_context,
                 "rope.scaling.yarn_beta_fast": float(cfg.rope_beta_fast),
                 "rope.scaling.yarn_beta_slow": float(cfg.rope_beta_slow)}
    if arch == "phi3":  # its rotary dimensions are part of a head
        keys["rope.dimension_count"] = 2 * int(cfg.head_size * cfg.rope_fraction // 2)
    if cfg.window is not None and arch != "llama":  # a Mixtral's window covers the context
        keys["attention.sliding_window"] = cfg.window
    if arch in GEMMA:
        keys |= _gemma_metadata(arch, cfg)
    if cfg.n_expert:
        keys |= {"expert_count": cfg.n_expert, "expert_used_count": cfg.n_expert_active,
                 "expert_feed_forward_length": cfg.ff_width,
                 "expert_weights_norm": cfg.router_renormalise}
    if cfg.d_shared_expert:
        keys["expert_shared_feed_forward_length"] = cfg.d_shared_expert
    return keys


def _gemma_metadata(arch: str, cfg: Any) -> dict[str, Any]:
    """Gemma's keys: the soft caps, the sliding layers' pattern and rotary base, and the
    query scale where it is not 1 / sqrt(head_dim) (which llama.cpp assumes otherwise)."""
    keys: dict[str, Any] = {}
    if cfg.attn_softcap is not None:
        keys["attn_logit_softcapping"] = float(cfg.attn_softcap)
    if cfg.logit_softcap is not None:
        keys["final_logit_softcapping"] = float(cfg.logit_softcap)
    if cfg.window is None:  # no layer slides: a window as long as the context
        keys["attention.sliding_window"] = cfg.context
    every = cfg.global_every if cfg.window is not None else 1
    if every != (6 if arch == "gemma3" else 2):
        if every == 0:  # every layer slides: a period longer than the stack
            every = cfg.n_layer + 1
        keys["attention.sliding_window_pattern"] = every
    if cfg.rope_local_theta is not None:
        keys["rope.freq_base_swa"] = float(cfg.rope_local_theta)
    if cfg.attn_scale is not None:
        keys["attention.scale"] = float(cfg.attn_scale)
    return keys


def gguf_tensors(model: Any, arch: str) -> dict[str, Tensor]:
    """The model's tensors under llama.cpp's names, in the layout a GGUF file has them."""
    from tformer.interop import gemma, gpt2, gpt_oss, llama, llama_moe, phi3

    cfg = model.cfg
    if arch == "gpt2":
        state = model.state_dict()
        hf = {("" if theirs == "lm_head.weight" else "transformer.") + theirs: state[ours]
              for ours, theirs in gpt2._names(cfg.n_layer, cfg.tie_embeddings).items()}
    elif arch in ("gemma2", "gemma3", "phi3", "gpt-oss"):
        hf = {"phi3": phi3.hf_weights, "gpt-oss": gpt_oss.hf_weights}.get(
            arch, gemma.hf_weights)(model)
    else:  # Mixtral's mixture under Qwen-MoE's names, which hf_names maps
        hf = llama_moe.rename_weights(llama.hf_weights(model), llama_moe.MIXTRAL_NAMES)
    back = {theirs: ours for ours, theirs in hf_names_for(arch, cfg.n_layer).items()}
    tensors = {}
    state = model.state_dict()
    for i in range(cfg.n_layer if cfg.n_expert else 0):  # the experts as the model stacks them
        for stack, projection in EXPERT_STACKS.items():
            ours = f"blocks.{i}.ff.experts.{projection.removesuffix('_proj')}"
            tensors[f"blk.{i}.{stack}.weight"] = state[ours].detach().float()
            if cfg.expert_bias:
                tensors[f"blk.{i}.{stack}.bias"] = state[ours + "_bias"].detach().float()
    for name, value in hf.items():
        if ".mlp.experts." in name:
            continue
        ours = back[name]
        value = value.detach().cpu()
        if value.dtype != torch.uint8:  # uint8: blocks, written as they are
            value = value.float()
        if arch in GEMMA and ours.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp's RMSNorm multiplies by the weight itself
        if arch == "llama" and (".attn_q." in ours or ".attn_k." in ours):
            value = permute(value, cfg.n_head if ".attn_q." in ours else
                            cfg.n_kv_head or cfg.n_head)
        if ".ffn_gate_inp_shexp." in ours:  # llama.cpp's is a vector
            value = value.reshape(-1)
        tensors[ours] = value.contiguous()
    if cfg.rope_scaling == "llama3":
        tensors["rope_freqs.weight"] = torch.from_numpy(llama3_factors(
            cfg.rope_theta, cfg.head_size, cfg.rope_factor, cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor, cfg.rope_original_context))
    return tensors


def hf_names_for(arch: str, n_layer: int) -> dict[str, str]:
    class _Named:  # hf_names reads only the architecture
        architecture = arch

    return hf_names(_Named(), n_layer)  # type: ignore[arg-type]


def tensor_type(kind: str, name: str, n_layer: int, tied: bool) -> str:
    """The block format a matrix called `name` (llama.cpp's name) takes in a file of `kind`:
    a mixture's by its rule (the output layer, or the embedding where it is also the output,
    finer), any other kind itself."""
    from tformer.kernels.formats import MIXES

    mix = MIXES.get(kind)
    if mix is None:
        return kind
    output = name == "output.weight" or (tied and name == "token_embd.weight")
    return mix.format_of("lm_head" if output else name, n_layer)


def _stored(name: str, value: Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """(array, raw type or None) for GGUFWriter.add_tensor: matrices in `kind` (a block
    format, or blocks.FALLBACK's where their rows are not whole blocks of it, else f16), the
    rest f32."""
    gguf = require_gguf()
    array = value.numpy()
    if value.dtype == torch.uint8:  # already blocks of `kind`
        return array, gguf.GGMLQuantizationType[kind.upper()]
    # Matrices and stacks of them (a mixture's experts, quantized one row at a time too);
    # a router's scores stay f32, as llama.cpp's quantizer keeps them: rounded, they can
    # change which experts a token goes to.
    if (value.dim() not in (2, 3) or kind == "f32" or name == "rope_freqs.weight"
            or ".ffn_gate_inp" in name or name.endswith(".bias")):
        return array.astype(np.float32), None
    fmt = None if kind == "f16" else blocks.fitting(kind, value.shape[-1])
    if fmt is None:
        return array.astype(np.float16), None
    rows = blocks.quantize(value.reshape(-1, value.shape[-1]), fmt)  # a stack: row by row
    return (rows.reshape(*value.shape[:-1], -1).numpy(),
            gguf.GGMLQuantizationType[fmt.upper()])


def export_gguf(checkpoint: Path, dest: Path, type: str = "f32") -> Path:
    """A tformer GPT checkpoint -> one GGUF file at `dest`."""
    gguf = require_gguf()
    from tformer.interop.gguf_vocab import gguf_vocab
    from tformer.loading import load_checkpoint

    if type not in GGUF_TYPES:
        raise TformerError(f"--type {type!r} is not known; choose one of: "
                           f"{', '.join(GGUF_TYPES)}")
    if dest.exists():
        raise TformerError(f"{dest} exists; choose another file name")
    loaded = load_checkpoint(checkpoint, family="gpt")  # blocks as the checkpoint holds them
    blocks.dequantize_model(loaded.model, keep=type)
    stack_experts(loaded.model)  # written as stacks, quantized again as `type` says
    cfg = loaded.model.cfg
    arch = _layout(cfg)
    vocab = gguf_vocab(loaded.tokenizer)
    if len(vocab["tokenizer.ggml.tokens"]) > cfg.vocab_size:
        raise TformerError(f"the tokenizer has {len(vocab['tokenizer.ggml.tokens'])} tokens, "
                           f"the model {cfg.vocab_size}")
    tokens = vocab["tokenizer.ggml.tokens"]
    for i in range(len(tokens), cfg.vocab_size):  # embedding rows no token uses
        tokens.append(f"[PAD{i}]")
        vocab["tokenizer.ggml.token_type"].append(5)
    tmp = dest.with_name(f".tmp-{dest.name}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(loaded.name or Path(checkpoint).name)
    writer.add_file_type(FILE_TYPES[type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in _metadata(arch, cfg).items():
        _add(writer, f"{arch}.{key}", value)
    for key, value in vocab.items():
        _add(writer, key, value)
    tensors = gguf_tensors(loaded.model, arch)
    tied = "output.weight" not in tensors
    for name, value in tensors.items():
        array, raw = _stored(name, value, tensor_type(type, name, cfg.n_layer, tied))
        writer.add_tensor(name, array, raw_dtype=raw)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        shutil.move(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise TformerError(f"cannot write {dest}: {e}") from None
    return dest


def _add(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:  # a list: of strings, or of ints (int32)
        writer.add_array(key, value)
