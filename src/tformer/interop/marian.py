"""Hugging Face MarianMTModel (OPUS-MT) import.

A Marian model is the seq2seq Transformer with post-norm layers, embeddings scaled by
sqrt(d_model), sinusoidal positions with all sines before all cosines, SiLU ("swish"), one
embedding matrix shared by the encoder, the decoder and the output projection, a bias on
the output (`final_logits_bias`), and the padding token as the decoder's first input: each
of these is a Seq2SeqConfig field. Attention projections are separate q, k, v matrices in
Marian; ours fuse them (q | k | v for self-attention, k | v for cross-attention).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.config import RunConfig, TrainConfig
from tformer.data.parallel import ParallelDataConfig
from tformer.data.tokenizers import SentencePieceTokenizer, require_sentencepiece
from tformer.errors import TformerError
from tformer.interop import read_hf_config, read_hf_weights, take
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

log = logging.getLogger(__name__)

ACTIVATIONS_IN = {"swish": "silu", "silu": "silu", "gelu": "gelu", "relu": "relu",
                  "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def seq2seq_config(hf: dict[str, Any], source: Path) -> Seq2SeqConfig:
    """MarianConfig's fields -> Seq2SeqConfig; what tformer cannot express is an error."""
    problems = []
    activation = ACTIVATIONS_IN.get(hf.get("activation_function", "gelu"))
    if activation is None:
        problems.append(f"activation_function = {hf.get('activation_function')!r}")
    pairs = [("encoder_attention_heads", "decoder_attention_heads"),
             ("encoder_ffn_dim", "decoder_ffn_dim")]
    for a, b in pairs:
        if hf.get(a) != hf.get(b):
            problems.append(f"{a} = {hf.get(a)} with {b} = {hf.get(b)} (they must be equal)")
    wanted = {"share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
              "separate_vocabs": False, "normalize_before": False,
              "add_final_layer_norm": False, "normalize_embedding": False}
    for key, value in wanted.items():
        if key in hf and hf[key] != value:
            problems.append(f"{key} = {hf[key]!r}")
    if hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]):
        problems.append(f"decoder_vocab_size = {hf['decoder_vocab_size']} (a second vocabulary)")
    if problems:
        raise TformerError(f"{source}: tformer's seq2seq model cannot express "
                           f"{', '.join(problems)}")
    return Seq2SeqConfig(
        vocab_size=hf["vocab_size"],
        max_len=hf.get("max_position_embeddings", 512),
        n_layer=hf["encoder_layers"],
        n_decoder_layer=hf["decoder_layers"],
        n_head=hf["encoder_attention_heads"],
        d_model=hf["d_model"],
        d_ff=hf["encoder_ffn_dim"],
        dropout=float(hf.get("dropout", 0.1)),
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        ff_dropout=float(hf.get("activation_dropout", 0.0)),
        activation=activation,
        norm="post",
        tie_embeddings=True,
        bias=True,
        output_bias=True,
        scale_embeddings=bool(hf.get("scale_embedding", True)),
        sinusoid_layout="halves",
    )


def _attention(weights: dict[str, Tensor], theirs: str, source: Path, *, cross: bool
               ) -> dict[str, Tensor]:
    """Marian's q, k, v, out projections -> ours (fused)."""
    get = {f"{p}.{kind}": take(weights, f"{theirs}.{p}_proj.{kind}", source)
           for p in ("q", "k", "v", "out") for kind in ("weight", "bias")}
    out = {"out_proj.weight": get["out.weight"], "out_proj.bias": get["out.bias"]}
    for kind in ("weight", "bias"):
        if cross:
            out[f"q_proj.{kind}"] = get[f"q.{kind}"]
            out[f"kv_proj.{kind}"] = torch.cat([get[f"k.{kind}"], get[f"v.{kind}"]])
        else:
            out[f"qkv_proj.{kind}"] = torch.cat([get[f"q.{kind}"], get[f"k.{kind}"],
                                                 get[f"v.{kind}"]])
    return out


def seq2seq_from_hf(hf: dict[str, Any], weights: dict[str, Tensor], source: Path | str
                    ) -> Seq2Seq:
    """A Seq2Seq with the weights of a MarianMTModel, from its config and tensors."""
    source = Path(source)
    cfg = seq2seq_config(hf, source)
    weights = {k.removeprefix("model."): v.float() for k, v in weights.items()}
    state: dict[str, Tensor] = {"src_embed.weight": take(weights, "shared.weight", source)}
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight",
                 "encoder.embed_positions.weight", "decoder.embed_positions.weight"):
        weights.pop(name, None)  # tied copies of the shared matrix, and fixed sinusoids
    state["out_proj.bias"] = take(weights, "final_logits_bias", source).reshape(-1)

    def norm(ours: str, theirs: str) -> None:
        for kind in ("weight", "bias"):
            state[f"{ours}.{kind}"] = take(weights, f"{theirs}.{kind}", source)

    def feedforward(ours: str, theirs: str) -> None:
        for a, b in (("up", "fc1"), ("down", "fc2")):
            for kind in ("weight", "bias"):
                state[f"{ours}.{a}.{kind}"] = take(weights, f"{theirs}.{b}.{kind}", source)

    for i in range(cfg.n_layer):
        ours, theirs = f"encoder.{i}", f"encoder.layers.{i}"
        for k, v in _attention(weights, f"{theirs}.self_attn", source, cross=False).items():
            state[f"{ours}.attn.{k}"] = v
        norm(f"{ours}.attn_residual.norm", f"{theirs}.self_attn_layer_norm")
        feedforward(f"{ours}.ff", theirs)
        norm(f"{ours}.ff_residual.norm", f"{theirs}.final_layer_norm")
    for i in range(cfg.decoder_layers):
        ours, theirs = f"decoder.{i}", f"decoder.layers.{i}"
        for k, v in _attention(weights, f"{theirs}.self_attn", source, cross=False).items():
            state[f"{ours}.self_attn.{k}"] = v
        norm(f"{ours}.self_residual.norm", f"{theirs}.self_attn_layer_norm")
        for k, v in _attention(weights, f"{theirs}.encoder_attn", source, cross=True).items():
            state[f"{ours}.cross_attn.{k}"] = v
        norm(f"{ours}.cross_residual.norm", f"{theirs}.encoder_attn_layer_norm")
        feedforward(f"{ours}.ff", theirs)
        norm(f"{ours}.ff_residual.norm", f"{theirs}.final_layer_norm")
    if weights:
        raise TformerError(f"{source}: tensors tformer's seq2seq model has no place for: "
                           f"{', '.join(sorted(weights)[:5])}")
    model = Seq2Seq(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"tgt_embed.weight", "out_proj.weight"}:
        raise AssertionError(f"mapping mismatch: {missing} {unexpected}")
    return model.eval()


def read_tokenizer(src: Path, hf: dict[str, Any]) -> SentencePieceTokenizer:
    require_sentencepiece()
    config: dict[str, Any] = {}
    if (src / "tokenizer_config.json").is_file():
        config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("separate_vocabs"):
        raise TformerError(f"{src}: separate source and target vocabularies are not supported")
    for name in ("source.spm", "target.spm", "vocab.json"):
        if not (src / name).is_file():
            raise TformerError(f"{src} has no {name}: it is not a Marian model directory")

    def special(key: str, default: str) -> str:
        value = config.get(key, default)
        return value.get("content", default) if isinstance(value, dict) else value

    vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
    start = hf.get("decoder_start_token_id", hf.get("pad_token_id"))
    return SentencePieceTokenizer(
        (src / "source.spm").read_bytes(), (src / "target.spm").read_bytes(), vocab,
        eos=special("eos_token", "</s>"), unk=special("unk_token", "<unk>"),
        pad=special("pad_token", "<pad>"), bos_id=int(start),
    )


def import_marian(src: Path, dest: Path) -> Path:
    """A local MarianMTModel directory -> a tformer seq2seq checkpoint at `dest`."""
    from tformer.training.checkpoint import save_checkpoint

    hf = read_hf_config(src)
    tokenizer = read_tokenizer(src, hf)
    model = seq2seq_from_hf(hf, read_hf_weights(src), src)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise TformerError(f"{src}: vocab.json has {tokenizer.vocab_size} entries, the model "
                           f"only {model.cfg.vocab_size}")
    data = ParallelDataConfig(max_len=model.cfg.max_len)
    save_checkpoint(dest, RunConfig("seq2seq", model.cfg, data, TrainConfig()), model, tokenizer)
    log.info("imported %s as a %d+%d-layer seq2seq model into %s", src, model.cfg.n_layer,
             model.cfg.decoder_layers, dest)
    return dest
