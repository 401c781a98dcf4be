"""What a model costs: FLOPs per token for training and decoding, and the memory its
activations take, per family. The registry's family entries point here.

FLOPs count the multiply-adds of matrix products as 2 each (Kaplan et al. 2020, sec. 2.1),
including attention's scores and weighted sums over all keys (a causal mask saves no work in
a dense kernel); elementwise work (norms, softmax, activations) is left out. A backward pass
costs two forward passes (one product for the input's gradient, one for the weight's),
except where the input needs no gradient.

Notation: D d_model, F d_ff, H heads, dh / dv query-key / value size per head, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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


def _self_attention(D: int, H: int, dh: int, dv: int, keys: float) -> float:
    """Forward FLOPs per query token: q, k, v and output projections, and the attention
    over `keys` keys."""
    return 2 * D * H * (2 * dh + dv) + 2 * H * dv * D + 2 * keys * H * (dh + dv)


def _lm_example(length: int, loss_of: Callable[[nn.Module, Tensor], Tensor]):
    def example(model: nn.Module, device: torch.device) -> Tensor:
        tokens = torch.randint(0, model.cfg.vocab_size, (1, length + 1), device=device)
        return loss_of(model, tokens)

    return example


def gpt_cost(cfg: Any) -> Cost:
    """At the full context T. Decoding: the mean per token over generating T tokens with
    the KV cache (the t-th token attends over t keys)."""
    m = cfg.model
    D, F_, H, V, T = m.d_model, m.ff_width, m.n_head, m.vocab_size, m.context
    dh = m.d_head or D // H
    dv = m.d_value or dh

    def per_token(keys: float) -> float:
        return m.n_layer * (_self_attention(D, H, dh, dv, keys) + 4 * D * F_) + 2 * D * V

    def loss(model: nn.Module, tokens: Tensor) -> Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return Cost(3 * per_token(T), per_token((T + 1) / 2), T, cfg.train.batch_size,
                _lm_example(T, loss), f"{cfg.train.batch_size} sequences of {T} tokens")


def transformer_xl_cost(cfg: Any) -> Cost:
    """A segment of T tokens over a full memory of M positions (K = M + T keys). The memory's
    keys and values and the relative position keys are projected per segment, and need no
    input gradient. Decoding: one token at a time over a full memory whose keys, values and
    position keys are cached."""
    m = cfg.model
    D, F_, H, V, T, M = m.d_model, m.ff_width, m.n_head, m.vocab_size, m.context, m.mem_len
    W = H * m.head_size
    K = M + T
    segment = 2 * D * 3 * W + 3 * 2 * K * W + 2 * W * D + 4 * D * F_  # per layer and token
    no_input_grad = (2 * D * 2 * W * M + 2 * D * W * K) / T
    forward = m.n_layer * (segment + no_input_grad) + 2 * D * V
    train = 3 * forward - m.n_layer * no_input_grad
    decode = m.n_layer * (2 * D * 3 * W + 3 * 2 * (M + 1) * W + 2 * W * D + 4 * D * F_)
    decode += 2 * D * V

    def example(model: nn.Module, device: torch.device) -> Tensor:
        from tformer.models.transformer_xl import Memory

        memory = Memory(M)
        tokens = torch.randint(0, V, (1, 2 * T + 1), device=device)
        with torch.no_grad():  # fill the memory, as every segment after the first finds it
            model(tokens[:, :T], memory=memory)
        logits = model(tokens[:, T : 2 * T], memory=memory)
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, T + 1 :].flatten())

    return Cost(train, decode, T, cfg.train.batch_size, example,
                f"{cfg.train.batch_size} segments of {T} tokens over {M} memory positions")


def seq2seq_cost(cfg: Any) -> Cost:
    """Sources and targets of L = data.max_len tokens, as many as data.max_tokens allows
    in a batch; per target token, the encoder's work on the source counted in. Decoding:
    greedy, L tokens for an L-token source, the mean per token (the encoder and the
    cross-attention keys shared by all of them)."""
    m = cfg.model
    D, F_, H, V = m.d_model, m.ff_width, m.n_head, m.vocab_size
    L = min(cfg.data.max_len, m.max_len)
    dh = m.d_head or D // H
    dv = m.d_value or dh
    encoder = m.n_layer * (_self_attention(D, H, dh, dv, L) + 4 * D * F_)
    cross_kv = 2 * D * H * (dh + dv)  # per source token and decoder layer

    def decoder(self_keys: float) -> float:
        cross = 2 * D * H * dh + 2 * H * dv * D + 2 * L * H * (dh + dv)
        return m.decoder_layers * (
            _self_attention(D, H, dh, dv, self_keys) + cross + cross_kv + 4 * D * F_
        ) + 2 * D * V

    def example(model: nn.Module, device: torch.device) -> Tensor:
        src = torch.randint(0, V, (1, L), device=device)
        tgt = torch.randint(0, V, (1, L + 1), device=device)
        logits = model(src, torch.ones_like(src, dtype=torch.bool), tgt[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())

    batch = max(1, cfg.data.max_tokens // L)
    return Cost(3 * (encoder + decoder(L)), encoder + decoder((L + 1) / 2), L, batch, example,
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
