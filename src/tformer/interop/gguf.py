"""GGUF files (llama.cpp's format, which Ollama and LM Studio read too) in: a .gguf file ->
a tformer GPT checkpoint. Export is tformer.interop.gguf_export; the tokenizer is
tformer.interop.gguf_vocab.

A GGUF file holds its config as metadata under llama.cpp's key names and its tensors under
llama.cpp's names, some in quantized blocks. The metadata becomes the config.json that
Hugging Face would have written, and the tensors get Hugging Face's names, so that the
importers of those directories (interop.llama, interop.gpt2) map both into tformer's GPT:
one mapping of each layout, not two. Two things llama.cpp's converter changed come back
here: the rows of the query and key projections of `llama` files (put in pairs order for
its interleaved rotary; ours is rotate-half), and GPT-2's Conv1D weights (stored
transposed, as nn.Linear has them).

The file is read with the `gguf` package, llama.cpp's own Python reader, and quantized
tensors are dequantized with its numpy dequantizers (gguf.quants), but those of the types
tformer holds as blocks (kept_types): a linear layer whose tensors all are, and the
embedding table, hold the file's bytes as they are (views of the file, mapped
copy-on-write, which the checkpoint is written from), and the model is made around
stand-ins for them, so that an import never holds them in fp32.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tformer.errors import TformerError

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3", "phi3", "gpt-oss")
MIXTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
"""The mixture-of-experts architectures read, and their Hugging Face model types."""
GEMMA = ("gemma2", "gemma3")
"""llama.cpp's converter stores Gemma's norm weights plus 1 (its RMSNorm multiplies by the
weight itself); they come back as Gemma's offsets from 1."""
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_XS", "IQ4_NL", "MXFP4")
"""The tensor types read; every one is dequantized to fp32 unless kept (see `kept_types`,
`REENCODED`). MXFP4 is how llama.cpp's converter keeps gpt-oss's released experts."""
REENCODED = {20: "q8_0"}
"""GGUF tensor types a linear layer holds in a format that says their values exactly:
IQ4_NL (IQ4_XS's 32-value form, which llama.cpp's quantizer gives rows that are not whole
super-blocks) as q8_0 blocks of the same d and its values as int8, which is also how
llama.cpp multiplies it (against q8_0 activations). Its embedding table is read into fp32."""
LLAMA_LINEARS = {  # our linear layers -> the file's tensors they are made of, in order
    "attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "attn.out_proj": ("attn_output",),
    "ff.gate": ("ffn_gate",), "ff.up": ("ffn_up",), "ff.down": ("ffn_down",),
    # Qwen2-MoE's shared expert (the experts themselves: keep_expert_blocks)
    "ff.shared.gate": ("ffn_gate_shexp",), "ff.shared.up": ("ffn_up_shexp",),
    "ff.shared.down": ("ffn_down_shexp",),
}
GPT2_LINEARS = {"attn.qkv_proj": ("attn_qkv",), "attn.out_proj": ("attn_output",),
                "ff.up": ("ffn_up",), "ff.down": ("ffn_down",)}

LLAMA_NAMES = {  # llama.cpp's tensor names -> Hugging Face's (Llama, Qwen2, Qwen3)
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}
LLAMA_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures: the router, and Qwen2-MoE's shared expert with its gate (a vector here).
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
GEMMA_BLOCK = LLAMA_BLOCK | {  # Gemma's sandwich: a norm after each sublayer too
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
PHI3_BLOCK = {  # fused projections, split by interop.phi3
    "attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
}
PHI3_LINEARS = {"attn.qkv_proj": ("attn_qkv",), "attn.out_proj": ("attn_output",),
                "ff.down": ("ffn_down",)}
"""Phi-3's ffn_up holds gate and up: those two are dequantized, the others kept as blocks."""
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
"""A mixture's experts, one [E, rows, columns] tensor a projection; Hugging Face's files
hold them one by one (`mlp.experts.{e}.gate_proj.weight`)."""
GPT_OSS_BLOCK = {  # the experts, with their biases: gpt_oss_experts
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router",
}
GPT_OSS_GLU = {"glu_limit": 7.0, "glu_alpha": 1.702}
"""The clamped gate's constants, which llama.cpp's gpt-oss graph fixes rather than reads."""
GPT2_NAMES = {
    "token_embd": "wte", "position_embd": "wpe", "output_norm": "ln_f", "output": "lm_head",
}
GPT2_BLOCK = {
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}


def require_gguf():
    try:
        import gguf
    except ImportError:
        raise TformerError("GGUF files need the gguf package: pip install 'tformer[interop]'"
                           ) from None
    return gguf


@dataclass
class GGUFTensor:
    name: str
    type: str
    """llama.cpp's type name: F32, Q4_1, ..."""
    ggml_type: int
    shape: tuple[int, ...]
    """Rows first, as torch has it (the file lists its dimensions the other way round)."""
    data: np.ndarray
    """As stored: float arrays for F32/F16, uint8 rows of blocks for the others (a view of
    the file)."""

    def dequantize(self) -> Tensor:
        """fp32 values, shaped `shape`."""
        gguf = require_gguf()
        values = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)
                                ).reshape(self.shape)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture key (`block_count` -> llama.block_count) or a full one."""
        return self.metadata.get(f"{self.architecture}.{key}",
                                 self.metadata.get(key, default))

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise TformerError(f"{self.path}: the metadata has no "
                               f"{self.architecture}.{key}")
        return value


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensors of a GGUF file (the data stays in the file until read).
    Anything but a whole GGUF file of tensor types tformer reads is a one-line error."""
    gguf = require_gguf()
    path = Path(path)
    if not path.is_file():
        raise TformerError(f"{path} is not a file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise TformerError(f"{path} is not a GGUF file (it does not begin with 'GGUF')")
    try:
        # copy-on-write: the tensors' data are writable views of the file, so that blocks
        # kept as they are become tensors without a copy (nothing writes to them)
        reader = _naming_reader(gguf)(path, "c")
    except TformerError as e:
        raise TformerError(f"{path}: {e}") from None
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError, ...
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "GGMLQuantizationType" in detail:
            detail = f"a tensor type llama.cpp's reader does not know ({detail})"
        elif "cannot reshape" in detail or "offset" in detail or "mmap" in detail:
            detail = f"the file is shorter than its tensors ({detail}): truncated?"
        raise TformerError(f"cannot read {path}: {detail}") from None
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            metadata[name] = field.contents()
        except Exception as e:
            raise TformerError(f"cannot read {path}: metadata {name}: {e}") from None
    tensors = {t.name: _tensor(path, t) for t in reader.tensors}
    return GGUFFile(path, metadata, tensors)


def _naming_reader(gguf: Any) -> type:
    """gguf.GGUFReader, checking each tensor's type, rows and data before the reader maps it:
    where the reader would fail with a message naming neither (a type it does not know, rows
    of part blocks, data past the end of a truncated file), a TformerError names the tensor
    and its type."""

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any], *args: Any,
                           **kwargs: Any) -> None:
            try:
                for field in fields:
                    _check_tensor_info(gguf, field.parts, int(start_offs), len(self.data))
            except TformerError:
                raise
            except Exception:  # noqa: BLE001, S110 (a reader laid out otherwise: its errors)
                pass
            super()._build_tensors(start_offs, fields, *args, **kwargs)

    return Reader


def _check_tensor_info(gguf: Any, parts: Any, start: int, file_size: int) -> None:
    """A TformerError naming the tensor and its type where its info (gguf's reader's field
    parts: name length, name, dimensions' count, dimensions, type, offset) gives a type
    gguf does not know, rows of part blocks, or data past the end of the file."""
    _, name, _, dims, raw, offset = parts
    name = bytes(name).decode("utf-8", "replace")
    try:
        kind = gguf.GGMLQuantizationType(int(raw[0]))
    except ValueError:
        raise TformerError(f"tensor {name} is of type {int(raw[0])}, a tensor type llama.cpp's "
                           f"reader does not know") from None
    block, size = gguf.GGML_QUANT_SIZES[kind]
    shape = [int(d) for d in dims]
    if shape and shape[0] % block:
        raise TformerError(f"tensor {name} has rows of {shape[0]} values, not whole "
                           f"{kind.name} blocks of {block}")
    end = start + int(offset[0]) + math.prod(shape) // block * size
    if end > file_size:
        raise TformerError(f"tensor {name} ({kind.name}) needs {end - file_size} bytes more "
                           f"than the file holds: truncated?")


def _tensor(path: Path, t: Any) -> GGUFTensor:
    from gguf import GGML_QUANT_SIZES

    kind = t.tensor_type.name
    if kind not in TYPES:
        raise TformerError(f"{path}: tensor {t.name} is of type {kind}, which tformer does not "
                           f"read; it reads {', '.join(TYPES)}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    block, size = GGML_QUANT_SIZES[t.tensor_type]
    if shape[-1] % block:
        raise TformerError(f"{path}: tensor {t.name} has rows of {shape[-1]} values, not whole "
                           f"{kind} blocks of {block}")
    wanted = math.prod(shape) // block * size
    if t.data.nbytes != wanted:
        raise TformerError(f"{path}: tensor {t.name} ({kind}, shape {list(shape)}) needs "
                           f"{wanted} bytes; the file holds {t.data.nbytes}")
    return GGUFTensor(t.name, kind, int(t.tensor_type), shape, t.data)


# --- config -------------------------------------------------------------------------------


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The Hugging Face config.json the file's metadata describes."""
    arch = file.architecture
    if arch not in ARCHITECTURES and arch not in MIXTURES:
        raise TformerError(f"{file.path}: architecture {arch!r} cannot be imported; tformer "
                           f"reads {', '.join([*ARCHITECTURES, *MIXTURES])}")
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    vocab = file.get("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        embed = file.tensors.get("token_embd.weight")
        vocab = embed.shape[0] if embed is not None else None
    if vocab is None:
        raise TformerError(f"{file.path}: neither the metadata nor the embedding gives the "
                           f"vocabulary size")
    tied = "output.weight" not in file.tensors
    if arch == "gpt2":
        eps = float(file.get("attention.layer_norm_epsilon", 1e-5))
        return {
            "model_type": "gpt2", "vocab_size": int(vocab),
            "n_positions": int(file.need("context_length")),
            "n_embd": int(file.need("embedding_length")),
            "n_layer": int(file.need("block_count")),
            "n_head": int(file.need("attention.head_count")),
            "n_inner": int(file.need("feed_forward_length")), "resid_pdrop": 0.0,
            "activation_function": "gelu_new", "tie_word_embeddings": tied,
            # GPT-2's own epsilon, within float32 rounding of the file's
            "layer_norm_epsilon": 1e-5 if math.isclose(eps, 1e-5, rel_tol=1e-6) else eps,
        }
    d_model, n_head = int(file.need("embedding_length")), int(file.need("attention.head_count"))
    kv_heads = file.get("attention.head_count_kv", n_head)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise TformerError(f"{file.path}: a different number of key/value heads per layer "
                               f"({sorted(set(kv_heads))}) cannot be expressed")
        kv_heads = kv_heads[0]
    # Phi-3's rotary dimensions are part of its head (Phi-4-mini's three quarters)
    rotated_dims = None if arch == "phi3" else file.get("rope.dimension_count")
    head_dim = file.get("attention.key_length") or rotated_dims or d_model // n_head
    if file.get("attention.value_length", head_dim) != head_dim:
        raise TformerError(f"{file.path}: value heads of another size than key heads cannot be "
                           f"expressed")
    hf = {
        "model_type": arch, "vocab_size": int(vocab),
        "hidden_size": d_model, "intermediate_size": int(file.need("feed_forward_length")),
        "num_hidden_layers": int(file.need("block_count")), "num_attention_heads": n_head,
        "num_key_value_heads": int(kv_heads), "head_dim": int(head_dim),
        "max_position_embeddings": int(file.need("context_length")),
        "rms_norm_eps": float(file.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": tied, "hidden_act": "silu",
        "rope_theta": float(file.get("rope.freq_base", 10000.0)),
        "attention_bias": False,
    }
    rotated = file.get("rope.dimension_count")
    if rotated is not None and int(rotated) != int(head_dim):
        hf["partial_rotary_factor"] = int(rotated) / int(head_dim)
    hf["rope_scaling"] = _rope_scaling(file, hf)
    if arch == "llama" and "blk.0.attn_output.bias" in file.tensors:
        hf["attention_bias"] = True
    if arch in GEMMA:
        hf |= _gemma_config(file, hf)
    if arch == "phi3":
        if "rope_factors_long.weight" in file.tensors:
            raise TformerError(f"{file.path}: LongRoPE (rope_factors_long) cannot be expressed")
        hf["sliding_window"] = file.get("attention.sliding_window")
    if arch == "gpt-oss":
        hf |= _gpt_oss_config(file, hf)
    elif arch in MIXTURES:
        hf |= _mixture_config(file)
    elif arch == "llama" and file.get("expert_count"):  # Mixtral, as llama.cpp writes it
        hf |= {"model_type": "mixtral", "num_local_experts": int(file.need("expert_count")),
               "num_experts_per_tok": int(file.need("expert_used_count")),
               "intermediate_size": int(file.get("expert_feed_forward_length")
                                        or hf["intermediate_size"])}
    elif file.get("expert_count"):
        raise TformerError(f"{file.path}: mixture-of-experts layers in a {arch} file cannot "
                           f"be expressed")
    return hf


def _mixture_config(file: GGUFFile) -> dict[str, Any]:
    """The expert keys of a qwen2moe / qwen3moe file as config.json has them. Whether the
    chosen experts' weights are renormalised: the file's expert_weights_norm, else what
    llama.cpp does for the architecture (Qwen3-MoE: yes, Qwen2-MoE: no)."""
    arch = file.architecture
    hf = {"model_type": MIXTURES[arch], "num_experts": int(file.need("expert_count")),
          "num_experts_per_tok": int(file.need("expert_used_count")),
          "moe_intermediate_size": int(file.need("expert_feed_forward_length")),
          "norm_topk_prob": bool(file.get("expert_weights_norm", arch == "qwen3moe"))}
    if arch == "qwen2moe":
        hf["shared_expert_intermediate_size"] = int(
            file.need("expert_shared_feed_forward_length"))
    return hf


def _gpt_oss_config(file: GGUFFile, hf: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss file's config.json fields: llama.cpp's graph for it fixes what the
    metadata does not say (layers sliding and full in turn, sliding first; the clamped gate's
    GPT_OSS_GLU constants)."""
    n_layer = hf["num_hidden_layers"]
    return {"model_type": "gpt_oss", "num_local_experts": int(file.need("expert_count")),
            "num_experts_per_tok": int(file.need("expert_used_count")),
            "intermediate_size": int(file.get("expert_feed_forward_length")
                                     or hf["intermediate_size"]),
            "sliding_window": int(file.need("attention.sliding_window")),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(n_layer)],
            "attention_bias": "blk.0.attn_q.bias" in file.tensors,
            "swiglu_limit": GPT_OSS_GLU["glu_limit"], "swiglu_alpha": GPT_OSS_GLU["glu_alpha"]}


def gpt_oss_experts(file: GGUFFile, n_layer: int) -> dict[str, Tensor]:
    """A gpt-oss file's expert stacks (gate, up, down: [E, out, in], their biases [E, out])
    -> transformers' tensors, input-first with the gate and up columns interleaved."""
    experts = {}
    for i in range(n_layer):
        def stack(name: str, kind: str, i: int = i) -> Tensor:
            return _need_tensor(file, f"blk.{i}.ffn_{name}_exps.{kind}").dequantize()

        theirs = f"model.layers.{i}.mlp.experts."
        experts |= {
            theirs + "gate_up_proj": torch.stack([stack("gate", "weight").transpose(1, 2),
                                                  stack("up", "weight").transpose(1, 2)],
                                                 -1).flatten(-2),
            theirs + "gate_up_proj_bias": torch.stack([stack("gate", "bias"),
                                                       stack("up", "bias")], -1).flatten(-2),
            theirs + "down_proj": stack("down", "weight").transpose(1, 2).contiguous(),
            theirs + "down_proj_bias": stack("down", "bias"),
        }
    return experts


def _need_tensor(file: GGUFFile, name: str) -> GGUFTensor:
    if name not in file.tensors:
        raise TformerError(f"{file.path}: a {file.architecture} file without {name}")
    return file.tensors[name]


def _gemma_config(file: GGUFFile, hf: dict[str, Any]) -> dict[str, Any]:
    """The keys of a Gemma 2 / Gemma 3 text config.json the file gives: its window, where
    the global layers are (llama.cpp's rule, every second for Gemma 2 and every sixth for
    Gemma 3, unless sliding_window_pattern says), soft caps, the sliding layers' rotary base
    and the query scale: attention.scale where the file has it, else llama.cpp's rule,
    1 / sqrt(d_model / n_head) for the 27B models (known by their layer count, 46 and 62:
    their query_pre_attn_scalar is not their head size) and 1 / sqrt(head_dim) for the
    others."""
    from tformer.interop import gemma

    gemma3 = file.architecture == "gemma3"
    every = int(file.get("attention.sliding_window_pattern") or (6 if gemma3 else 2))
    n_layer, head = hf["num_hidden_layers"], hf["head_dim"]
    scale = file.get("attention.scale")
    if scale is None and n_layer == (62 if gemma3 else 46):
        scale = (hf["hidden_size"] / hf["num_attention_heads"]) ** -0.5
    fields: dict[str, Any] = {
        "model_type": "gemma3_text" if gemma3 else "gemma2",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": None,
        "sliding_window": file.get("attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                        for i in range(n_layer)],
        "attn_logit_softcapping": file.get("attn_logit_softcapping"),
        "final_logit_softcapping": file.get("final_logit_softcapping"),
        "query_pre_attn_scalar": head if scale is None else gemma.query_scalar(float(scale)),
    }
    if gemma3:
        full = {"rope_type": "default", "rope_theta": hf["rope_theta"]}
        full |= hf.get("rope_scaling") or {}
        fields["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default",
            "rope_theta": float(file.get("rope.freq_base_swa", 10000.0))}}
    return fields


def _rope_scaling(file: GGUFFile, hf: dict[str, Any]) -> dict[str, Any] | None:
    """llama.cpp keeps linear scaling in the metadata, and Llama 3's as a per-frequency
    factor tensor (rope_freqs) the converter computed from the four llama3 parameters;
    those are found again by computing the tensor from them."""
    kind = file.get("rope.scaling.type", "none")
    if "rope_freqs.weight" in file.tensors:
        return _llama3_scaling(file, hf)
    if kind in ("none", None) or (kind == "linear" and file.get("rope.scaling.factor") == 1):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(file.need("rope.scaling.factor"))}
    if kind == "yarn":
        return _yarn_scaling(file)
    raise TformerError(f"{file.path}: rope scaling {kind!r} cannot be expressed; tformer has "
                       f"none, linear, llama3 and yarn")


def _yarn_scaling(file: GGUFFile) -> dict[str, Any]:
    """YaRN as llama.cpp computes it from the file: its correction range rounded out to
    whole dimensions (transformers' truncate), the attention factor 0.1 ln(factor) + 1; a
    log multiplier or a further attention factor (DeepSeek's mscale forms) has no field here
    and is refused."""
    log_multiplier = file.get("rope.scaling.yarn_log_multiplier")
    if log_multiplier not in (None, 0.0):
        raise TformerError(f"{file.path}: yarn's log multiplier {log_multiplier} cannot be "
                           f"expressed")
    scaling = {"rope_type": "yarn", "factor": float(file.need("rope.scaling.factor")),
               "original_max_position_embeddings":
                   int(file.need("rope.scaling.original_context_length")),
               "beta_fast": float(file.get("rope.scaling.yarn_beta_fast", 32.0)),
               "beta_slow": float(file.get("rope.scaling.yarn_beta_slow", 1.0)),
               "truncate": True}
    factor = file.get("rope.scaling.yarn_attn_factor") or file.get("rope.scaling.attn_factor")
    if factor is not None and factor != 1.0:
        raise TformerError(f"{file.path}: yarn's attention factor scaled by {factor} cannot "
                           f"be expressed")
    return scaling


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                   original: int) -> np.ndarray:
    """The per-frequency divisors of Llama 3's rope scaling, as llama.cpp stores them."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, mid)).astype(np.float32)


def _llama3_scaling(file: GGUFFile, hf: dict[str, Any]) -> dict[str, Any] | None:
    """The llama3 parameters whose divisors are the file's rope_freqs: the converter's
    low/high frequency factors and original context (1, 4, 8192: every Llama 3.x release's),
    and the factor read off a divisor of the low-frequency band (where it is the divisor)
    or of the band between (where it is 1 / ((1 - s) / factor + s))."""
    low, high, original = 1.0, 4.0, 8192
    stored = file.tensors["rope_freqs.weight"].dequantize().numpy().astype(np.float64)
    head = int(hf["head_dim"])
    freqs = 1.0 / hf["rope_theta"] ** (np.arange(0, head, 2, dtype=np.float32) / head)
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    low_band, high_band = wavelen > original / low, wavelen < original / high
    middle = ~low_band & ~high_band
    if low_band.any():
        factor = float(stored[low_band][0])
    elif middle.any():
        smooth = float((original / wavelen[middle][0] - low) / (high - low))
        factor = (1 - smooth) / (1 / float(stored[middle][0]) - smooth)
    else:
        factor = 1.0
    factor = round(factor, 4)
    computed = llama3_factors(hf["rope_theta"], head, factor, low, high, original)
    if computed.shape != stored.shape or not np.allclose(computed, stored, rtol=1e-5):
        raise TformerError(f"{file.path}: its rope_freqs tensor is not Llama 3's scaling with "
                           f"low/high frequency factors 1 and 4 and an original context of "
                           f"8192 (nearest factor {factor:g}): it cannot be expressed")
    if factor == 1.0:
        return None
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


# --- tensors ------------------------------------------------------------------------------


def unpermute(rows: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's converter: within each head it stored the rows of the query and key
    projections as the pairs (0, d/2), (1, d/2 + 1), ... for its interleaved rotary; the
    rotate-half layout wants the first half of each head, then the second."""
    shape = rows.shape
    return rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2) \
        .reshape(shape)


def expert_names(name: str, n_expert: int) -> list[str] | None:
    """Hugging Face's names of the experts stacked in the file's tensor `name`, or None where
    it holds no experts."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in EXPERT_STACKS:
        return None
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERT_STACKS[parts[2]]}.weight"
            for e in range(n_expert)]


def hf_names(file: GGUFFile, n_layer: int) -> dict[str, str]:
    """llama.cpp's tensor names -> Hugging Face's, for every name the layout has."""
    blocks = {"gpt2": GPT2_BLOCK, "gemma2": GEMMA_BLOCK, "gemma3": GEMMA_BLOCK,
              "phi3": PHI3_BLOCK, "gpt-oss": GPT_OSS_BLOCK}
    block = blocks.get(file.architecture, LLAMA_BLOCK)
    top = GPT2_NAMES if file.architecture == "gpt2" else LLAMA_NAMES
    prefix = "transformer." if file.architecture == "gpt2" else ""
    names = {}
    for ours, theirs in top.items():
        for kind in ("weight", "bias"):
            names[f"{ours}.{kind}"] = (prefix if ours != "output" else "") + f"{theirs}.{kind}"
    layer = "transformer.h" if file.architecture == "gpt2" else "model.layers"
    for i in range(n_layer):
        for ours, theirs in block.items():
            for kind in ("weight", "bias"):
                names[f"blk.{i}.{ours}.{kind}"] = f"{layer}.{i}.{theirs}.{kind}"
        if file.architecture == "gpt-oss":  # a parameter of attention itself, not a layer's
            names[f"blk.{i}.attn_sinks.weight"] = f"{layer}.{i}.self_attn.sinks"
    return names


@dataclass
class Deferred:
    """A file tensor that the model builders (interop.llama, interop.gpt2) read once, with
    `.float()`: dequantized and put in Hugging Face's layout only then, so that the import
    never holds a second fp32 copy of every weight."""

    tensor: GGUFTensor
    heads: int | None = None
    """Query or key rows of a llama file: put back from pairs order, over this many heads."""
    transpose: bool = False
    """A GPT-2 matrix: back to Conv1D's (in, out)."""
    offset: float = 0.0
    """Subtracted from every value: 1 from a Gemma norm's weight (GEMMA)."""
    shape: tuple[int, ...] | None = None
    """Hugging Face's shape, where it differs (a shared expert's gate: a row, not a vector)."""
    held: bool = False
    """Held as the file's blocks (keep_blocks puts them in its place): read as a tensor of
    its shape on the meta device, no values, so that the import never holds it in fp32."""

    def float(self) -> Tensor:
        if self.held:
            value = torch.empty(self.tensor.shape, device="meta")
        else:
            value = self.tensor.dequantize() - self.offset
        if self.heads is not None:
            value = unpermute(value, self.heads)
        if self.shape is not None:
            value = value.reshape(self.shape)
        return value.t().contiguous() if self.transpose else value


def hf_weights(file: GGUFFile, hf: dict[str, Any],
               held: frozenset[str] = frozenset()) -> dict[str, Deferred]:
    """Every tensor under its Hugging Face name, in Hugging Face's layout once read; a
    tensor the layout has no place for is an error naming it. `held`: the file's tensors
    the import holds as blocks (held_tensors), which read as stand-ins (Deferred.held)."""
    arch = file.architecture
    n_layer = hf["n_layer"] if arch == "gpt2" else hf["num_hidden_layers"]
    names = hf_names(file, n_layer)
    n_expert = hf.get("num_experts") or hf.get("num_local_experts", 0)
    if arch == "gpt-oss":  # stacks with biases, which transformers keeps stacked too
        names |= {f"blk.{i}.ffn_{p}_exps.{kind}": "" for i in range(n_layer)
                  for p in ("gate", "up", "down") for kind in ("weight", "bias")}
    unknown = [n for n in file.tensors if n not in names and n != "rope_freqs.weight"
               and expert_names(n, n_expert) is None]
    if unknown:
        raise TformerError(f"{file.path}: tensors a {arch} model has no place for: "
                           f"{', '.join(unknown[:5])}")
    weights: dict[str, Deferred] = {}
    for name, tensor in file.tensors.items():
        if name == "rope_freqs.weight" or names.get(name) == "":
            continue
        experts = expert_names(name, n_expert)
        if experts is not None:
            # One view of the file's bytes an expert: each is dequantized on its own.
            if tensor.shape[0] != n_expert:
                raise TformerError(f"{file.path}: {name} stacks {tensor.shape[0]} experts, "
                                   f"the metadata says {n_expert}")
            for e, expert in enumerate(experts):
                weights[expert] = Deferred(GGUFTensor(f"{name}[{e}]", tensor.type,
                                                      tensor.ggml_type, tensor.shape[1:],
                                                      tensor.data[e]), held=name in held)
            continue
        heads = None
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = hf["num_attention_heads"] if ".attn_q." in name else \
                hf["num_key_value_heads"]
        transpose = arch == "gpt2" and name.startswith("blk.") and name.endswith(".weight") \
            and len(tensor.shape) == 2
        offset = 1.0 if arch in GEMMA and name.endswith("norm.weight") else 0.0
        shape = (1, -1) if ".ffn_gate_inp_shexp." in name else None
        weights[names[name]] = Deferred(tensor, heads, transpose, offset, shape,
                                        held=name in held)
    return weights


def kept_types() -> dict[int, str]:
    """GGUF tensor type -> the weight format that holds its blocks as they are: every entry
    of the weight-format registry with a ggml_type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
    Q5_K, Q6_K, IQ4_XS)."""
    from tformer.kernels.formats import FORMATS

    return {fmt.ggml_type: name for name, fmt in FORMATS.items() if fmt.ggml_type is not None}


def linear_sources(file: GGUFFile, cfg: Any) -> dict[str, tuple[str, ...]]:
    """Our linear layers' weights -> the file's tensors stacked into each (in row order)."""
    table = {"gpt2": GPT2_LINEARS, "phi3": PHI3_LINEARS}.get(file.architecture, LLAMA_LINEARS)
    sources = {f"blocks.{i}.{ours}.weight": tuple(f"blk.{i}.{t}.weight" for t in theirs)
               for i in range(cfg.n_layer) for ours, theirs in table.items()}
    if not cfg.tie_embeddings:
        sources["lm_head.weight"] = ("output.weight",)
    return sources


def held_format(formats: list[str]) -> str | None:
    """The one format a layer made of file tensors in `formats` is held in: theirs where they
    agree; where they differ, one of them that says the others' values exactly
    (blocks.EXACTLY_AS); else None (keep_blocks holds the tensors' own, side by side)."""
    from tformer.kernels.blocks import EXACTLY_AS

    for fmt in dict.fromkeys(formats):
        if all(f == fmt or (f, fmt) in EXACTLY_AS for f in formats):
            return fmt
    return None


def linear_types() -> dict[int, str]:
    """GGUF tensor type -> the format a linear layer holds its tensors in: kept_types, and
    REENCODED's."""
    return kept_types() | REENCODED


def held_linears(file: GGUFFile, cfg: Any) -> dict[str, tuple[str, ...]]:
    """linear_sources' layers whose file tensors are all of kept (or REENCODED) types: those
    keep_blocks holds as blocks."""
    kept = linear_types()
    return {param: names for param, names in linear_sources(file, cfg).items()
            if all(n in file.tensors and file.tensors[n].ggml_type in kept for n in names)}


EMBEDDING = "token_embd.weight"
"""The file's embedding table, every architecture's."""


def held_embedding(file: GGUFFile) -> str | None:
    """The format the file's embedding table is held in (a BlockEmbedding of its blocks, as
    they are), or None where its type is not kept (it is read into fp32)."""
    tensor = file.tensors.get(EMBEDDING)
    if tensor is None or len(tensor.shape) != 2:
        return None
    return kept_types().get(tensor.ggml_type)


def held_tensors(file: GGUFFile, cfg: Any) -> frozenset[str]:
    """The file's tensors the import holds as blocks (keep_blocks, keep_expert_blocks): the
    ones never read into fp32. `cfg` needs n_layer, tie_embeddings and n_expert alone
    (held_config gives them before the model is made)."""
    kept = kept_types()
    names = {n for sources in held_linears(file, cfg).values() for n in sources}
    names |= {n for n in expert_sources(cfg).values()
              if n in file.tensors and file.tensors[n].ggml_type in kept}
    if held_embedding(file) is not None:
        names.add(EMBEDDING)
    return frozenset(names)


@dataclass(frozen=True)
class HeldConfig:
    """What held_tensors reads of a model's config, known from the file's config.json
    before the model is made."""

    n_layer: int
    tie_embeddings: bool
    n_expert: int


def held_config(file: GGUFFile, hf: dict[str, Any]) -> HeldConfig:
    """held_tensors' view of the model the file's config.json (hf_config's) describes."""
    n_layer = hf["n_layer"] if file.architecture == "gpt2" else hf["num_hidden_layers"]
    n_expert = hf.get("num_experts") or hf.get("num_local_experts") or 0
    return HeldConfig(int(n_layer), bool(hf["tie_word_embeddings"]), int(n_expert))


def file_bytes(tensor: GGUFTensor) -> Tensor:
    """A file tensor's bytes as a uint8 tensor: a view of the file where read_gguf mapped it
    writable (copy-on-write), else a copy."""
    data = tensor.data
    if not data.flags.writeable:
        data = np.array(data, copy=True)
    return torch.from_numpy(data.view(np.uint8))


def keep_blocks(model: Any, file: GGUFFile) -> dict[str, str]:
    """Make the model's linear layers whose file tensors are all of kept types hold the
    file's blocks (query and key rows put back in rotate-half order, as whole rows): byte
    for byte where the tensors share a type; in held_format's where one type says the
    others' values exactly; else as a StackedLinear of the tensors' own blocks, byte for
    byte (Q4_K_M's q4_k attn_q and attn_k beside a q6_k attn_v). The embedding table, where
    its type is kept, becomes a BlockEmbedding of its blocks, and a tied output layer a
    BlockLinear over the same bytes. The blocks are views of the file wherever they are
    held as it stores them. Returns {parameter: format} of those."""
    kept = linear_types()
    if not kept_types():
        return {}
    from tformer.kernels.blocks import (
        BlockEmbedding,
        BlockLinear,
        StackedLinear,
        iq4_nl_as_q8_0,
        reencode,
    )

    cfg, held = model.cfg, {}
    for param, names in held_linears(file, cfg).items():
        tensors = [file.tensors[n] for n in names]
        formats = [kept[t.ggml_type] for t in tensors]
        fmt = held_format(formats)
        parts: list[tuple[str, Tensor]] = []  # (format, rows), neighbours of a format joined
        for name, tensor, own in zip(names, tensors, formats, strict=True):
            data = file_bytes(tensor)
            if tensor.ggml_type in REENCODED:
                data = iq4_nl_as_q8_0(data)
            if fmt is not None and own != fmt:
                data = reencode(data, own, fmt)
            if file.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
                heads = cfg.n_head if ".attn_q." in name else cfg.n_kv_head or cfg.n_head
                data = unpermute(data, heads)
            own = fmt or own
            if parts and parts[-1][0] == own:
                parts[-1] = (own, torch.cat([parts[-1][1], data]))
            else:
                parts.append((own, data))
        path = param.removesuffix(".weight")
        parent, _, attr = path.rpartition(".")
        owner = model.get_submodule(parent)
        linear = getattr(owner, attr)
        layer = BlockLinear(parts[0][1], parts[0][0], linear.in_features, linear.bias) \
            if len(parts) == 1 else StackedLinear(parts, linear.in_features, linear.bias)
        setattr(owner, attr, layer)
        held[param] = layer.fmt
    fmt = held_embedding(file)
    if fmt is not None:
        table = BlockEmbedding(file_bytes(file.tensors[EMBEDDING]), fmt,
                               model.embed.embedding_dim)
        model.embed = table
        held["embed.weight"] = fmt
        if cfg.tie_embeddings:  # the output layer reads the same bytes
            model.lm_head = table.tied_output(model.lm_head.bias)
            held["lm_head.weight"] = fmt
    return held | keep_expert_blocks(model, file)


def expert_sources(cfg: Any) -> dict[str, str]:
    """A mixture's experts of one projection (our `blocks.{i}.ff.experts.{p}`) -> the
    file's stack of them."""
    return {f"blocks.{i}.ff.experts.{p.removesuffix('_proj')}": f"blk.{i}.{stack}.weight"
            for i in range(cfg.n_layer if cfg.n_expert else 0)
            for stack, p in EXPERT_STACKS.items()}


def keep_expert_blocks(model: Any, file: GGUFFile) -> dict[str, str]:
    """Make each mixture whose file stacks are of a kept type hold them as blocks, one
    BlockLinear an expert over its slice of the stack (layers.experts.ExpertLinears);
    returns {parameter: format} of those (`blocks.0.ff.experts.gate.3.weight`)."""
    from tformer.kernels.blocks import BlockLinear
    from tformer.layers.experts import Experts

    kept, held = kept_types(), {}
    for ours, name in expert_sources(model.cfg).items():
        tensor = file.tensors.get(name)
        if tensor is None or tensor.ggml_type not in kept:
            continue
        fmt = kept[tensor.ggml_type]
        owner_path, _, projection = ours.rpartition(".")
        mixture = model.get_submodule(owner_path.removesuffix(".experts"))
        if isinstance(mixture.experts, Experts):  # still stacked: one layer an expert
            stacked, mixture.experts = mixture.experts, mixture.experts.as_linears(share=False)
            with torch.no_grad():  # the weights, for the projections not held as blocks
                for name, layers in mixture.experts.named_children():
                    if isinstance(layers, nn.ModuleList):
                        for e, layer in enumerate(layers):
                            layer.weight.copy_(getattr(stacked, name)[e])
                            if layer.bias is not None:
                                layer.bias.copy_(getattr(stacked, f"{name}_bias")[e])
        layers = getattr(mixture.experts, projection)
        for e in range(len(layers)):
            data = file_bytes(GGUFTensor(name, tensor.type, tensor.ggml_type,
                                         tensor.shape[1:], tensor.data[e]))
            layers[e] = BlockLinear(data, fmt, layers[e].in_features, layers[e].bias)
            held[f"{ours}.{e}.weight"] = fmt
    return held


def model_from_gguf(file: GGUFFile, held: frozenset[str] = frozenset()):
    """A GPT holding the file's weights in fp32, and the config.json it was built from.
    `held`: file tensors (held_tensors) left as stand-ins on the meta device, for
    keep_blocks to put the file's blocks in their place."""
    from tformer.interop import gemma, gpt2, gpt_oss, llama, phi3

    hf = hf_config(file)
    builders = {"gpt2": gpt2.gpt_from_hf, "gemma2": gemma.gemma_from_hf,
                "gemma3": gemma.gemma_from_hf, "phi3": phi3.phi3_from_hf,
                "gpt-oss": gpt_oss.gpt_oss_from_hf}
    build = builders.get(file.architecture, llama.llama_from_hf)
    weights: dict[str, Any] = hf_weights(file, hf, held)
    if file.architecture == "gpt-oss":
        weights |= gpt_oss_experts(file, hf["num_hidden_layers"])
    return build(hf, weights, file.path), hf


def import_gguf(src: Path, dest: Path) -> Path:
    """A GGUF file -> a tformer GPT checkpoint at `dest`: config, fp32 weights, the tokenizer
    and chat template from the file's metadata."""
    convert_gguf(src, dest)
    return dest


def convert_gguf(src: Path, dest: Path) -> tuple[Counter[str], Counter[str]]:
    """import_gguf's work; returns the quantized types held as blocks and those read into
    fp32 (with how many of the file's tensors each), for the lines that say so."""
    return save_imported(read_gguf(src), dest)


def save_imported(file: GGUFFile, dest: Path) -> tuple[Counter[str], Counter[str]]:
    """A GGUF file already read -> a checkpoint at `dest` (as convert_gguf)."""
    from tformer.config import RunConfig, TrainConfig
    from tformer.data.lm import LMDataConfig
    from tformer.interop.gguf_vocab import tokenizer_from_gguf
    from tformer.training.checkpoint import save_checkpoint

    src = file.path
    # The tensors held as blocks are never read into fp32: the model is made around
    # stand-ins for them, and keep_blocks puts the file's bytes (views of it) in their
    # place, which the checkpoint is written from.
    model, _ = model_from_gguf(file, held_tensors(file, held_config(file, hf_config(file))))
    tokenizer = tokenizer_from_gguf(file)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise TformerError(f"{src}: the tokenizer has {tokenizer.vocab_size} tokens, the model "
                           f"only {model.cfg.vocab_size}")
    held = keep_blocks(model, file)
    unread = [name for name, t in (*model.named_parameters(), *model.named_buffers())
              if t.device.type == "meta"]
    if unread:
        raise AssertionError(f"stand-ins left without the file's blocks: {unread[:5]}")
    save_checkpoint(dest, RunConfig("gpt", model.cfg, LMDataConfig(), TrainConfig()), model,
                    tokenizer)
    names = {n for p, names in linear_sources(file, model.cfg).items() if p in held
             for n in names}
    names |= {n for p, n in expert_sources(model.cfg).items() if f"{p}.0.weight" in held}
    if "embed.weight" in held:
        names.add(EMBEDDING)
    kept = Counter(file.tensors[n].type for n in names)
    return kept, Counter(t.type for t in file.tensors.values()
                         if t.type != "F32" and t.name not in names)
