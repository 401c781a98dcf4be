"""A mixture-of-experts feed-forward (Shazeer et al. 2017, "Outrageously Large Neural
Networks"; Fedus et al. 2021, Switch Transformer): a router scores every expert for each
token, the token goes through the k best, and their outputs are summed with the router's
weights. Qwen2-MoE adds a shared expert that every token goes through, scaled by a sigmoid
gate of its own.

Shapes: N tokens (B * T, flattened), D d_model, E experts, F an expert's width, k experts a
token is routed to.

The experts' weights are stacked, one tensor [E, F, D] per projection, as Hugging Face's
fused experts and GGUF's `ffn_*_exps` hold them. Only the chosen experts are read: a token
touches k of the E experts' weights, which is why a model with many experts decodes at the
speed of its active parameters, not of all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.kernels.dropout import Dropout
from tformer.kernels.glu import silu_mul
from tformer.layers.feedforward import ACTIVATIONS, GatedFeedForward

ROUTER_SOFTMAX = ("before", "after")
"""Where the router's softmax sits: before top-k, over every expert, its chosen
probabilities then summing to less than 1 unless renormalised (Qwen2-MoE, Qwen3-MoE); or
after top-k, over the k chosen logits alone (Mixtral, gpt-oss)."""


class Router(nn.Module):
    """(N, D) -> the k experts of each token (N, k) and their weights (N, k)."""

    def __init__(self, d_model: int, n_expert: int, k: int, *, softmax: str = "before",
                 renormalise: bool = False, bias: bool = False) -> None:
        super().__init__()
        if softmax not in ROUTER_SOFTMAX:
            raise ValueError(f"router softmax must be one of {ROUTER_SOFTMAX}, not {softmax!r}")
        # A parameter, not an nn.Linear: weight formats and LoRA convert linear layers, and
        # the router's few rows stay as they are (llama.cpp keeps them in F32 too), since a
        # rounded score can change which experts a token goes to.
        self.weight = nn.Parameter(torch.empty(n_expert, d_model))
        self.bias = nn.Parameter(torch.zeros(n_expert)) if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.k, self.softmax, self.renormalise = k, softmax, renormalise

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        # The softmax in fp32 even under bf16 autocast: two experts' probabilities differ in
        # the third digit often enough that bf16 would change which one wins.
        logits = F.linear(x, self.weight, self.bias).float()
        if self.softmax == "before":
            weights, experts = logits.softmax(-1).topk(self.k, dim=-1)
            if self.renormalise:
                weights = weights / weights.sum(-1, keepdim=True)
        else:
            top, experts = logits.topk(self.k, dim=-1)
            weights = top.softmax(-1)
        return experts, weights.to(x.dtype)


def route_tokens(x: Tensor, experts: Tensor, weights: Tensor, n_expert: int,
                 expert: Callable[[int, Tensor], Tensor]) -> Tensor:
    """sum_j weights[:, j] * expert(experts[:, j], x) for x (N, D), each expert called once
    with the rows of the tokens routed to it: `expert(e, rows)` -> its outputs.

    One token (decoding) calls its k experts in turn; many (a prompt, training) are sorted
    by expert so that each runs one product over its group, not one per token."""
    if x.shape[0] == 1:
        out = torch.zeros_like(x)
        for j, e in enumerate(experts[0].tolist()):
            out = out + weights[0, j] * expert(e, x)
        return out
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k  # the token of each (token, choice) pair, in expert order
    weight = weights.reshape(-1)[order, None]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=n_expert).tolist()):
        if count:
            rows = token[start : start + count]
            out = out.index_add(0, rows, expert(e, x[rows]) * weight[start : start + count])
            start += count
    return out


class Experts(nn.Module):
    """E gated feed-forwards, down_e(act(gate_e x) * up_e x), their weights stacked:
    gate and up [E, F, D], down [E, D, F] (as nn.Linear holds a weight, output rows first)."""

    def __init__(self, d_model: int, d_ff: int, n_expert: int, *, activation: str = "silu",
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_expert, d_ff, d_model))
        self.up = nn.Parameter(torch.empty(n_expert, d_ff, d_model))
        self.down = nn.Parameter(torch.empty(n_expert, d_model, d_ff))
        self.activation = ACTIVATIONS[activation]()
        self.dropout = Dropout(dropout)
        self.reset_parameters()

    @property
    def n_expert(self) -> int:
        return self.gate.shape[0]

    def reset_parameters(self, std: float = 0.02, down_std: float | None = None) -> None:
        nn.init.normal_(self.gate, std=std)
        nn.init.normal_(self.up, std=std)
        nn.init.normal_(self.down, std=std if down_std is None else down_std)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e on rows x (n, D): a view of its slice of each stack, nothing copied."""
        gate, up = F.linear(x, self.gate[e]), F.linear(x, self.up[e])
        hidden = (silu_mul(gate, up) if isinstance(self.activation, nn.SiLU)
                  else self.activation(gate) * up)
        return F.linear(self.dropout(hidden), self.down[e])

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        return route_tokens(x, experts, weights, self.n_expert, self.expert)

    def as_linears(self) -> ExpertLinears:
        """The same experts as separate nn.Linear layers over views of these weights, for
        code that converts linear layers one by one (kernels.formats.quantize_model: each
        expert's weight becomes blocks of its own)."""
        return ExpertLinears(self)


class ExpertLinears(nn.Module):
    """Experts whose projections are E modules each, `gate[e]`, `up[e]`, `down[e]`, of any
    kind that maps (n, in) -> (n, out): nn.Linear or a weight format's layer."""

    def __init__(self, stacked: Experts) -> None:
        super().__init__()

        def layers(weights: Tensor) -> nn.ModuleList:
            out = nn.ModuleList()
            for w in weights:
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
                linear.weight = nn.Parameter(w.detach(), requires_grad=False)
                out.append(linear)
            return out

        self.gate, self.up, self.down = (layers(w) for w in (stacked.gate, stacked.up,
                                                                stacked.down))
        self.activation = stacked.activation

    def expert(self, e: int, x: Tensor) -> Tensor:
        gate, up = self.gate[e](x), self.up[e](x)
        hidden = (silu_mul(gate, up) if isinstance(self.activation, nn.SiLU)
                  else self.activation(gate) * up)
        return self.down[e](hidden)

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        return route_tokens(x, experts, weights, len(self.gate), self.expert)


class MixtureOfExperts(nn.Module):
    """(B, T, D) -> (B, T, D): the router's k experts of each token, weighted, plus the
    shared expert (if any) scaled by sigmoid(shared_gate(x)) (Qwen2-MoE)."""

    def __init__(self, d_model: int, d_ff: int, n_expert: int, k: int, *,
                 activation: str = "silu", dropout: float = 0.0, softmax: str = "before",
                 renormalise: bool = False, d_shared: int = 0) -> None:
        super().__init__()
        self.router = Router(d_model, n_expert, k, softmax=softmax, renormalise=renormalise)
        self.experts: Experts | ExpertLinears = Experts(d_model, d_ff, n_expert,
                                                        activation=activation, dropout=dropout)
        self.shared = (GatedFeedForward(d_model, d_shared, activation=activation,
                                        dropout=dropout, bias=False) if d_shared else None)
        # A parameter, not an nn.Linear, as the router's weight is (see Router).
        self.shared_gate = nn.Parameter(torch.zeros(1, d_model)) if d_shared else None

    def forward(self, x: Tensor) -> Tensor:
        h = x.reshape(-1, x.shape[-1])
        experts, weights = self.router(h)
        out = self.experts(h, experts, weights)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(h, self.shared_gate)) * self.shared(h)
        return out.view(x.shape)
