"""Transformer-XL: segment-level recurrence and relative positional attention
(Dai et al. 2019, "Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context").

Each layer attends over [memory; segment]: the memory holds that layer's inputs for the
last `mem_len` positions of the previous segments, detached from the graph (sec. 3.2). Where
a key sits is given by its distance to the query, not by an absolute position (sec. 3.3), so
the same states can be reused when the next segment arrives.

Shapes: B batch, T segment (new tokens), M memory length, K = M + T keys, D d_model,
H heads, d d_head, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.checks import check_range
from tformer.evaluation.loss import Targets
from tformer.layers import (
    Dropout,
    FeedForward,
    Residual,
    attention_bias,
    dropout,
    lm_mask,
    sinusoids,
)
from tformer.models.base import Model, ModelConfig


@dataclass(frozen=True)
class TransformerXLConfig(ModelConfig):
    weight_free: ClassVar[frozenset[str]] = frozenset(
        {"dropout", "attn_dropout", "mem_len", "eval_mem_len", "clamp_len"}
    )
    """Fields a run that starts from a checkpoint's weights may change (train.init_from)."""
    norm_positions: ClassVar[tuple[str, ...]] = ("post", "pre")

    d_head: int | None = None
    """Size per head; none means d_model / n_head."""
    activation: str = "relu"
    norm: str = "post"
    """post, as in the paper's code; pre for deeper stacks."""
    bias: bool = True
    """Biases in the feed-forward layers and the layer norms."""
    sinusoid_layout: str = "interleaved"
    """interleaved sin/cos, or halves ([sin | cos], the layout of the paper's own code)."""
    output_bias: bool = False
    """A bias on the projection to the vocabulary (the paper's code has one)."""
    context: int = 64
    """Segment length: tokens per training step and per evaluation step."""
    mem_len: int = 64
    """Positions of memory kept per layer while training."""
    eval_mem_len: int | None = None
    """Memory for evaluation and generation; none means mem_len."""
    clamp_len: int = 0
    """Relative distances beyond this share its encoding; 0 is off."""
    attn_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    share_biases: bool = True
    """One pair of global biases u, v for all layers (the paper's code); false: per layer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("model.context", self.context, low=1)
        for key in ("mem_len", "clamp_len"):
            check_range(f"model.{key}", getattr(self, key), low=0)
        if self.eval_mem_len is not None:
            check_range("model.eval_mem_len", self.eval_mem_len, low=0)
        check_range("model.attn_dropout", self.attn_dropout, low=0.0, high=1.0)

    @property
    def memory_for_eval(self) -> int:
        return self.mem_len if self.eval_mem_len is None else self.eval_mem_len


# --- the memory ---------------------------------------------------------------------------


class Memory:
    """The recurrence state: for each layer, its inputs at the last `mem_len` positions.

    An object that a caller creates, hands to every forward pass of one ordered stream, and
    drops (or clears) when the stream starts over; the forward pass updates it in place. It
    is the model's KV cache when generating: a token's cost stops growing once it is full.

    cache_keys: keep each layer's projected keys and values instead of its inputs, so that
        they are not projected again at every segment. Only while the weights stay fixed
        (evaluation, generation); training needs the inputs, since its keys change with
        every step and their weights learn from the memory too.
    """

    def __init__(self, mem_len: int, *, cache_keys: bool = False) -> None:
        self.mem_len = mem_len
        self.cache_keys = cache_keys
        self.states: list[Tensor] = []
        """Per layer (B, M, D) inputs, detached; empty before the first segment."""
        self.keys_values: list[tuple[Tensor, Tensor]] = []
        """With cache_keys, per layer (B, H, M, d) keys and values instead of the inputs."""
        self.is_real: Tensor | None = None
        """(B, M) False at padding, or None when every remembered position is real."""
        self.position_keys: dict[tuple[int, int], Tensor] = {}
        """With cache_keys, W_R R per (layer, number of keys): once the memory is full, every
        segment of the same length reuses them."""

    @property
    def length(self) -> int:
        if self.keys_values:
            return self.keys_values[0][0].shape[2]
        return self.states[0].shape[1] if self.states else 0

    @property
    def rows(self) -> int:
        if self.keys_values:
            return self.keys_values[0][0].shape[0]
        return self.states[0].shape[0] if self.states else 0

    def clear(self) -> None:
        self.states, self.keys_values, self.is_real = [], [], None
        self.position_keys = {}

    def copy(self) -> Memory:
        """A memory with the same contents that changes on its own: `update` replaces the
        remembered tensors and never writes into them, so sharing them is safe."""
        twin = Memory(self.mem_len, cache_keys=self.cache_keys)
        twin.states, twin.keys_values = list(self.states), list(self.keys_values)
        twin.is_real, twin.position_keys = self.is_real, dict(self.position_keys)
        return twin

    def update(
        self, layer_inputs: list[Tensor], keys_values: list[tuple[Tensor, Tensor]],
        is_real: Tensor | None,
    ) -> None:
        """Append one segment's (B, T, D) layer inputs (or, with cache_keys, its layers' keys
        and values over [memory; segment]) and keep the last mem_len positions: the
        stop-gradient SG(h^{n-1}_{tau}) of sec. 3.2, reused by the next segment."""
        if self.mem_len == 0:
            return
        B, T = layer_inputs[0].shape[:2]
        M = self.length
        L = self.mem_len
        with torch.no_grad():
            if self.cache_keys:
                self.keys_values = [(k[:, :, -L:].detach(), v[:, :, -L:].detach())
                                    for k, v in keys_values]
            else:
                if self.states and T < L:  # (a segment of L or more replaces it whole)
                    layer_inputs = [
                        torch.cat([m, h], dim=1)
                        for m, h in zip(self.states, layer_inputs, strict=True)
                    ]
                self.states = [h[:, -L:].detach() for h in layer_inputs]
            if is_real is not None or self.is_real is not None:
                device = layer_inputs[0].device
                past = self.is_real
                if past is None:
                    past = torch.ones(B, M, dtype=torch.bool, device=device)
                if is_real is None:
                    is_real = torch.ones(B, T, dtype=torch.bool, device=device)
                self.is_real = torch.cat([past, is_real], dim=1)[:, -L:]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index`."""
        self.states = [m.index_select(0, index) for m in self.states]
        self.keys_values = [(k.index_select(0, index), v.index_select(0, index))
                            for k, v in self.keys_values]
        if self.is_real is not None:
            self.is_real = self.is_real.index_select(0, index)

    def state_dict(self) -> dict[str, Any]:
        return {"mem_len": self.mem_len, "cache_keys": self.cache_keys,
                "states": list(self.states), "keys_values": list(self.keys_values),
                "is_real": self.is_real}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mem_len = int(state["mem_len"])
        self.cache_keys = bool(state.get("cache_keys", False))
        self.states = list(state["states"])
        self.keys_values = [tuple(kv) for kv in state.get("keys_values", [])]
        self.is_real = state["is_real"]


# --- relative attention -------------------------------------------------------------------


def relative_shift(scores: Tensor) -> Tensor:
    """(B, H, T, K) scores against distances K-1, K-2, ..., 0 (column c: distance K-1-c)
    -> (B, H, T, K) scores of query i against key j, at distance M + i - j.

    Entry [i, j] moves from column j + T-1-i of row i. Padding one zero column on the left
    and reading the buffer with rows one element shorter shifts row i left by T-1-i in a
    single copy (the paper's appendix B). Entries with j > M + i (future keys) hold values
    from the next row: the causal mask removes them.
    """
    B, H, T, K = scores.shape
    padded = F.pad(scores, (1, 0))
    return padded.flatten(2)[..., T:].view(B, H, T, K)


class RelativeAttention(nn.Module):
    """Multi-head attention with relative positions (sec. 3.3, the terms (a)-(d) of A^rel):

        score(i, j) = (q_i + u) . k_j  +  (q_i + v) . W_R R_{i-j}
                       (a) + (c)            (b) + (d)

    q, k, values and W_R are per layer; u and v (global content and position biases) are
    passed in, so that the model may share them across layers.

    The attention is written out rather than handed to scaled_dot_product_attention: with
    the position term as a float mask that needs a gradient, SDPA takes its unfused math
    path anyway, and spelled out here the position term is one matmul per head over the
    whole batch and the two terms and the mask are summed in place. Training runs 15%
    faster that way (benchmarks/speed.py, the txl rows).
    """

    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.d_head = cfg.head_size
        width = self.n_head * self.d_head
        # No projection biases, as in the paper's code: u and v are the only biases.
        self.qkv_proj = nn.Linear(cfg.d_model, 3 * width, bias=False)
        self.pos_proj = nn.Linear(cfg.d_model, width, bias=False)
        self.out_proj = nn.Linear(width, cfg.d_model, bias=False)
        self.attn_dropout = cfg.attn_dropout
        self.recorded: list[Tensor] | None = None
        """A list to append each forward pass's (B, H, T, K) attention probabilities to,
        or None (see tformer.viz.attention.recording_attention)."""

    def _heads(self, x: Tensor) -> Tensor:
        """(B, T, H*d) -> (B, H, T, d)."""
        return x.unflatten(-1, (self.n_head, self.d_head)).transpose(1, 2)

    def position_keys(self, positions: Tensor) -> Tensor:
        """(K, D) encodings of the distances K-1 ... 0 -> (H, K, d) W_R R, per head."""
        return self.pos_proj(positions).unflatten(-1, (self.n_head, self.d_head)).transpose(0, 1)

    def forward(
        self, x: Tensor, memory: Tensor | None, pos_k: Tensor, bias: Tensor,
        u: Tensor, v: Tensor, *, memory_kv: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (B, T, D) -> (B, T, D), and the (B, H, K, d) keys and values over
        [memory; segment].

        memory: (B, M, D) the memory's states (already normalised for pre-norm), or None.
        memory_kv: (B, H, M, d) keys and values of the memory, projected before; used
            instead of `memory`.
        pos_k: (H, K, d) position_keys of the distances K-1 ... 0.
        bias: attention_bias of the may-attend mask, broadcastable to (B, H, T, K): 0 where
            a query may attend, -inf where not.
        u, v: (H, d) the content and position biases.
        """
        width = self.n_head * self.d_head
        q, k, values = self.qkv_proj(x).split(width, dim=-1)
        q = q.unflatten(-1, (self.n_head, self.d_head))  # (B, T, H, d)
        k, values = self._heads(k), self._heads(values)
        # Keys and values over [memory; segment]; queries only for the segment.
        if memory_kv is not None:
            k_mem, v_mem = memory_kv
        elif memory is not None:
            k_mem, v_mem = output_rows(self.qkv_proj, memory, width).split(width, dim=-1)
            k_mem, v_mem = self._heads(k_mem), self._heads(v_mem)
        if memory_kv is not None or memory is not None:
            k, values = torch.cat([k_mem, k], dim=2), torch.cat([v_mem, values], dim=2)
        # The 1/sqrt(d) scale goes on the (B, T, H, d) queries, not on the (B, H, T, K) scores.
        scale = 1.0 / math.sqrt(self.d_head)
        q = q * scale
        scores = (q + u * scale).transpose(1, 2) @ k.transpose(-1, -2)
        position = torch.einsum("bthd,hkd->bhtk", q + v * scale, pos_k)
        # Summed in place: the matmul's backward needs its inputs, not its output.
        scores = scores.add_(relative_shift(position)).add_(bias)
        probs = scores.softmax(dim=-1)
        if self.recorded is not None:
            self.recorded.append(probs.detach())
        probs = dropout(probs, self.attn_dropout, self.training)
        return self.out_proj((probs @ values).transpose(1, 2).flatten(2)), (k, values)


def output_rows(linear: nn.Module, x: Tensor, start: int) -> Tensor:
    """linear(x)[..., start:] of a bias-free linear layer without computing the outputs
    before `start` (the memory needs keys and values, not queries). A layer that changes
    its outputs beyond its weight (a LoRA adapter, training.lora.LoRALinear) says how
    through its own `output_rows`."""
    own = getattr(linear, "output_rows", None)
    return own(x, start) if own is not None else F.linear(x, linear.weight[start:])


class TransformerXLBlock(nn.Module):
    """Relative attention over [memory; segment], then feed-forward, each in a residual."""

    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        self.attn = RelativeAttention(cfg)
        self.ff = FeedForward(
            cfg.d_model, cfg.ff_width, activation=cfg.activation, dropout=cfg.dropout,
            bias=cfg.bias,
        )
        self.attn_residual = Residual(
            cfg.d_model, norm=cfg.norm, dropout=cfg.dropout, bias=cfg.bias
        )
        self.ff_residual = Residual(cfg.d_model, norm=cfg.norm, dropout=cfg.dropout, bias=cfg.bias)
        self.pre_norm = cfg.norm == "pre"

    def forward(
        self, x: Tensor, memory: Tensor | None, memory_kv: tuple[Tensor, Tensor] | None,
        positions: Tensor | None, pos_k: Tensor | None, bias: Tensor, u: Tensor, v: Tensor,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor]:
        """As RelativeAttention.forward: the block's output, its keys and values, and its
        position keys: `pos_k` if given, else computed from the (K, D) `positions` here, in
        the block's own forward, where FSDP has gathered its weights."""
        if pos_k is None:
            assert positions is not None
            pos_k = self.attn.position_keys(positions.to(x.dtype))
        if memory is not None and self.pre_norm:
            # The memory holds un-normalised layer inputs; pre-norm normalises the keys'
            # inputs the same way as the queries' (the paper's code, pre_lnorm).
            memory = self.attn_residual.norm(memory)
        keys_values = None

        def attend(h: Tensor) -> Tensor:
            nonlocal keys_values
            out, keys_values = self.attn(h, memory, pos_k, bias, u, v, memory_kv=memory_kv)
            return out

        x = self.attn_residual(x, attend)
        assert keys_values is not None
        return self.ff_residual(x, self.ff), keys_values, pos_k


class TransformerXL(Model):
    """A Transformer-XL language model: tied embeddings, relative attention, memory."""

    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        cfg.require_vocab()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_scale = math.sqrt(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)
        n_biases = 1 if cfg.share_biases else cfg.n_layer
        self.u = nn.Parameter(torch.empty(n_biases, cfg.n_head, cfg.head_size))
        self.v = nn.Parameter(torch.empty(n_biases, cfg.n_head, cfg.head_size))
        self.blocks = nn.ModuleList(TransformerXLBlock(cfg) for _ in range(cfg.n_layer))
        self.final_norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias) if cfg.norm == "pre" else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.output_bias)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self) -> None:
        """N(0, 0.02) for every matrix and for u, v; zero biases (the paper's code)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.u, mean=0.0, std=0.02)
        nn.init.normal_(self.v, mean=0.0, std=0.02)

    def relative_positions(self, k_len: int, device: torch.device) -> Tensor:
        """(K, D) sinusoidal encodings of the distances K-1 ... 0 (oldest key first), with
        distances beyond clamp_len clamped to it."""
        distances = torch.arange(k_len - 1, -1, -1, device=device)
        if self.cfg.clamp_len > 0:
            distances = distances.clamp(max=self.cfg.clamp_len)
        return sinusoids(distances, self.cfg.d_model, self.cfg.sinusoid_layout)

    def forward(
        self,
        tokens: Tensor,
        is_real: Tensor | None = None,
        *,
        memory: Memory | None = None,
        last_only: bool = False,
        targets: Targets | None = None,
    ) -> Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) with `last_only`.

        memory: the stream's Memory; the segment attends over it, then it is updated in place
            with this segment's layer inputs. None: the segment alone, and nothing is kept.
        is_real: (B, T) False at padding. Padding keys are never attended to; a left-padded
            row gives the same outputs as the row alone, since only distances matter.
        targets: (evaluation/loss.py) return their loss instead of the logits, never holding
            all of these at once.
        """
        B, T = tokens.shape
        if memory is not None and memory.cache_keys and self.training:
            raise ValueError("Memory(cache_keys=True) needs fixed weights; call model.eval()")
        n_layer = self.cfg.n_layer
        states: list[Tensor | None] = [None] * n_layer
        keys_values: list[tuple[Tensor, Tensor] | None] = [None] * n_layer
        M = memory.length if memory is not None else 0
        if memory is not None and M:
            if memory.rows != B:
                raise ValueError(f"memory holds {memory.rows} rows; the batch has {B}")
            if memory.keys_values:
                keys_values = list(memory.keys_values)
            else:
                states = list(memory.states)

        keys_real = None
        if is_real is not None or (memory is not None and memory.is_real is not None):
            past = memory.is_real if memory is not None and memory.is_real is not None else (
                torch.ones(B, M, dtype=torch.bool, device=tokens.device))
            new = is_real if is_real is not None else torch.ones_like(tokens, dtype=torch.bool)
            keys_real = torch.cat([past, new], dim=1)
        x = self.dropout(self.embed(tokens) * self.embed_scale)
        # Causal over [memory; segment]: query i sits at key position M + i. Made into the
        # additive bias once here, for every layer.
        bias = attention_bias(lm_mask(keys_real, T, M + T, tokens.device), x.dtype)
        positions = None
        cached = memory.position_keys if memory is not None and memory.cache_keys else None
        layer_inputs, new_keys_values = [], []
        for i, block in enumerate(self.blocks):
            pos_k = cached.get((i, M + T)) if cached is not None else None
            if pos_k is None and positions is None:
                positions = self.dropout(self.relative_positions(M + T, tokens.device))
            layer_inputs.append(x)
            b = 0 if self.cfg.share_biases else i
            x, kv, pos_k = block(x, states[i], keys_values[i], positions, pos_k, bias,
                                 self.u[b], self.v[b])
            if cached is not None:
                cached[(i, M + T)] = pos_k
            new_keys_values.append(kv)
        if memory is not None:
            memory.update(layer_inputs, new_keys_values, is_real)

        if last_only:
            x = x[:, -1:]
        if self.final_norm is not None:
            x = self.final_norm(x)
        if targets is not None:
            return targets.of_states(self.dropout(x), self.lm_head)
        return self.lm_head(self.dropout(x))
