"""What a model costs: FLOPs per token for training and decoding, and the memory its
activations take, per family. The registry's family entries point here.

FLOPs count the multiply-adds of matrix products as 2 each (Kaplan et al. 2020, sec. 2.1),
and they are counted from the model itself, built on the meta device (shapes, no storage):
every linear layer costs 2 * in * out per token it sees, and every attention layer, per
query, 2 * H * (dh + dv) per key it reads (scores and weighted sum), from the layer's own
head count and sizes. So grouped-query attention's narrower k/v projection, a gated
feed-forward's third matrix or a decoupled head size change the figures with no formula
to update. Elementwise work (norms, softmax, activations, rotary) is left out.

Which keys a query reads: in training, every key of the sequence, as a dense kernel scores
them all (a causal or sliding-window mask saves no work there); while decoding with a
cache, the t-th token reads the t keys cached so far, or with a sliding window at most
`window` of them (Beltagy et al. 2020; Jiang et al. 2023, sec. 2).

A backward pass costs two forward passes (one product for the input's gradient, one for
the weight's), except where the input needs no gradient.

Notation: D d_model, F d_ff, H heads, H_kv key/value heads, dh / dv query-key / value size
per head, V vocabulary, T tokens of a sequence (or segment), M memory, W window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.layers import MixtureOfExperts, MultiHeadAttention
from tformer.models.gpt import GPT
from tformer.models.seq2seq import Seq2Seq
from tformer.models.transformer_xl import Memory, RelativeAttention, TransformerXL


@dataclass(frozen=True)
class Cost:
    train_flops: float
    """Per target token of a training step (forward and backward)."""
    decode_flops: float
    """Per generated token (see each family's function for the decoding it assumes)."""
    length: int
    """The sequence length the figures are for (tokens)."""
    batch: int
    """Sequences of that length in one training batch."""
    example: Callable[[nn.Module, torch.device], Tensor]
    """Runs one training-like forward pass of one sequence and returns its loss."""
    assumes: str
    """The shapes behind the figures, in words."""


# --- counting from the modules ------------------------------------------------------------


def on_meta(build: Callable[[Any], nn.Module], model_config: Any) -> nn.Module:
    """The model a config describes, with shapes and no storage: free to build even at
    billions of parameters."""
    with torch.device("meta"):
        return build(model_config)


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, and tformer's prepacked and int8 linears (kernels/): whatever declares
    in_features and out_features."""
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int)


def linear_flops(module: nn.Module) -> int:
    """Forward FLOPs per token of the linear layers in `module`, each once: 2 * in * out.
    (An output layer tied to the embedding is still a product of its own.)"""
    return sum(2 * m.in_features * m.out_features for m in module.modules() if is_linear(m))


def mixture_flops(module: nn.Module) -> int:
    """Forward FLOPs per token of the mixtures of experts in `module` beyond their linear
    layers (a shared expert's are): the router's scores over every expert, the shared
    expert's gate, and the products of the k experts a token goes through, not of all E
    (their weights are stacked tensors, no linear layers)."""
    total = 0
    for m in module.modules():
        if isinstance(m, MixtureOfExperts):
            n_expert, d_model = m.router.weight.shape
            one_expert = sum(p[0].numel() for p in (m.experts.gate, m.experts.up,
                                                    m.experts.down))
            total += 2 * n_expert * d_model + 2 * m.router.k * one_expert
            if m.shared_gate is not None:
                total += 2 * d_model
    return total


def key_flops(attention: nn.Module) -> int:
    """Forward FLOPs of one query against one key: its score and its part of the weighted
    sum over the values, in every head. Key/value heads shared by groups of query heads
    (grouped-query attention) save projection work, not this: each query head still reads
    every key."""
    if isinstance(attention, RelativeAttention):
        # Two scores per key, content (a) + (c) and position (b) + (d) (Dai et al. 2019,
        # sec. 3.3), then the values: three products of the head size.
        return 2 * attention.n_head * 3 * attention.d_head
    return 2 * attention.n_head * (attention.d_head + attention.d_value)


def attention_flops(module: nn.Module, keys: float) -> float:
    """Forward FLOPs per query of the attention layers in `module`, each query reading
    `keys` keys."""
    return keys * sum(key_flops(m) for m in module.modules()
                      if isinstance(m, (MultiHeadAttention, RelativeAttention)))


def decoded_keys(T: int, window: int | None) -> float:
    """Keys a token reads on average when T tokens are decoded one at a time with a cache:
    the t-th reads t, or at most W with a window: (sum over t of min(t, W)) / T."""
    W = T if window is None else min(window, T)
    return (W * (W + 1) / 2 + (T - W) * W) / T


# --- the families ---------------------------------------------------------------------------


def _lm_example(length: int, loss_of: Callable[[nn.Module, Tensor], Tensor]):
    def example(model: nn.Module, device: torch.device) -> Tensor:
        tokens = torch.randint(0, model.cfg.vocab_size, (1, length + 1), device=device)
        return loss_of(model, tokens)

    return example


def gpt_cost(cfg: Any) -> Cost:
    """At the full context T: every linear layer sees each token once, and in training each
    query reads all T keys. Decoding: the mean per token over generating T tokens with the
    KV cache (decoded_keys). With a window, that is the work of a cache that keeps only the
    last W keys (Mistral's rolling buffer); tformer's KV cache keeps them all and masks the
    older ones, which the same dense product still reads."""
    m = cfg.model
    model = on_meta(GPT, m)
    T = m.context

    def per_token(keys: float) -> float:
        return linear_flops(model) + mixture_flops(model) + attention_flops(model, keys)

    def loss(model: nn.Module, tokens: Tensor) -> Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    assumes = f"{cfg.train.batch_size} sequences of {T} tokens"
    if m.window is not None and m.window < T:
        assumes += f", each attending to at most {m.window}"
    return Cost(3 * per_token(T), per_token(decoded_keys(T, m.window)), T, cfg.train.batch_size,
                _lm_example(T, loss), assumes)


def transformer_xl_cost(cfg: Any) -> Cost:
    """A segment of T tokens over a full memory of M positions (K = M + T keys). The memory's
    keys and values (the k/v rows of each layer's qkv projection, applied to the M memory
    states) and the relative position keys (pos_proj over the K distances) are projected per
    segment, and need no input gradient. Decoding: one token at a time over a full memory
    whose keys, values and position keys are cached."""
    m = cfg.model
    model = on_meta(TransformerXL, m)
    T, M = m.context, m.mem_len
    attentions = [block.attn for block in model.blocks]
    positions = sum(linear_flops(a.pos_proj) for a in attentions)  # per distance
    # Per memory state: its keys and values, from the k/v rows of each qkv projection.
    memory_kv = sum(2 * a.qkv_proj.in_features * 2 * a.n_head * a.d_head for a in attentions)
    per_token = linear_flops(model) - positions  # what each new token passes through
    no_input_grad = (memory_kv * M + positions * (M + T)) / T
    forward = per_token + attention_flops(model, M + T) + no_input_grad
    train = 3 * forward - no_input_grad  # a weight gradient for those, no input gradient
    decode = per_token + attention_flops(model, M + 1)

    def example(model: nn.Module, device: torch.device) -> Tensor:
        memory = Memory(M)
        tokens = torch.randint(0, m.vocab_size, (1, 2 * T + 1), device=device)
        with torch.no_grad():  # fill the memory, as every segment after the first finds it
            model(tokens[:, :T], memory=memory)
        logits = model(tokens[:, T : 2 * T], memory=memory)
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, T + 1 :].flatten())

    return Cost(train, decode, T, cfg.train.batch_size, example,
                f"{cfg.train.batch_size} segments of {T} tokens over {M} memory positions")


def seq2seq_cost(cfg: Any) -> Cost:
    """Sources and targets of L = data.max_len tokens, as many as data.max_tokens allows
    in a batch; per target token, the work on one source token counted in: the encoder's,
    and the cross-attention keys and values the decoder's layers project from it. Decoding:
    greedy, L tokens for an L-token source, the mean per token (the encoder and the
    cross-attention keys shared by all of them)."""
    m = cfg.model
    model = on_meta(Seq2Seq, m)
    L = min(cfg.data.max_len, m.max_len)
    cross_kv = sum(linear_flops(layer.cross_attn.kv_proj) for layer in model.decoder)
    per_source = linear_flops(model.encoder) + attention_flops(model.encoder, L) + cross_kv
    target_linears = linear_flops(model.decoder) - cross_kv + linear_flops(model.out_proj)

    def per_target(self_keys: float) -> float:
        attention = sum(attention_flops(layer.self_attn, self_keys)
                        + attention_flops(layer.cross_attn, L) for layer in model.decoder)
        return per_source + target_linears + attention

    def example(model: nn.Module, device: torch.device) -> Tensor:
        src = torch.randint(0, m.vocab_size, (1, L), device=device)
        tgt = torch.randint(0, m.vocab_size, (1, L + 1), device=device)
        logits = model(src, torch.ones_like(src, dtype=torch.bool), tgt[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())

    batch = max(1, cfg.data.max_tokens // L)
    return Cost(3 * per_target(L), per_target(decoded_keys(L, None)), L, batch, example,
                f"{batch} pairs of {L}-token sources and targets (data.max_tokens)")


def activation_bytes(model: nn.Module, example: Callable[[nn.Module, torch.device], Tensor],
                     device: torch.device) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one example sequence
    (measured, not estimated: every saved tensor's storage, once, weights left out)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    was_training = model.training
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        example(model, device)
    model.train(was_training)
    return sum(saved.values())
