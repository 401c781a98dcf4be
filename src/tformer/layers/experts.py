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

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from tformer.kernels import experts as expert_kernel
from tformer.kernels.dropout import Dropout
from tformer.kernels.glu import silu_mul
from tformer.layers.feedforward import ACTIVATIONS

EXPERT_GLUS = ("gated", "clamped")
"""An expert's gate: gated, act(gate) * up (SwiGLU with silu); clamped, gpt-oss's (ClampedGLU)."""
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

    def logits(self, x: Tensor) -> Tensor:
        """(N, D) -> (N, E) scores, in fp32 even under bf16 autocast: two experts'
        probabilities differ in the third digit often enough that bf16 would change which
        one wins."""
        return F.linear(x, self.weight, self.bias).float()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.logits(x)
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
    counts = torch.bincount(flat, minlength=n_expert).tolist()
    groups = x[token].split(counts)  # each expert's rows, one after the other
    outputs = torch.cat([expert(e, rows) for e, rows in enumerate(groups) if len(rows)])
    # One scatter back for all the experts: each token sums its k weighted outputs.
    weighted = (outputs * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add(0, token, weighted)


def balance_loss(probs: Tensor, experts: Tensor) -> Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4-6), as Qwen-MoE and
    Mixtral train with it: E * sum_e f_e * P_e over probs (N, E), the router's softmax over
    every expert, and experts (N, k), the chosen ones: f_e the share of the N * k choices
    that went to e, P_e its mean probability. 1 when the choices and the probabilities are
    spread evenly, up to E when one expert takes them all; its gradient reaches the router
    through P."""
    n_expert = probs.shape[-1]
    share = torch.bincount(experts.reshape(-1), minlength=n_expert) / experts.numel()
    return n_expert * (share.to(probs.dtype) * probs.mean(0)).sum()


class _WithAuxiliaryLoss(torch.autograd.Function):
    """x unchanged forward; backward, x's gradient and 1 for `loss`: the loss joins what the
    backward pass minimises without the value returned changing or the loss travelling
    out of the layer (the pattern of DeepSeek-MoE's training code)."""

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_like = (loss.shape, loss.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype = ctx.loss_like
        return grad, torch.ones(shape, dtype=dtype, device=grad.device)


class GLU(nn.Module):
    """(gate, up) -> act(gate) * up (Shazeer 2020; SwiGLU with silu)."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.activation = ACTIVATIONS[activation]()

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        if isinstance(self.activation, nn.SiLU):  # in one pass (kernels/glu.py)
            return silu_mul(gate, up)
        return self.activation(gate) * up


class ClampedGLU(nn.Module):
    """(gate, up) -> gate * sigmoid(alpha * gate) * (up + 1), the gate clamped to at most
    `limit` and up to [-limit, limit]: gpt-oss's experts (OpenAI 2025). The clamps bound
    what an expert can write, and up + 1 lets an expert pass its gate through where up is
    near 0."""

    def __init__(self, limit: float, alpha: float) -> None:
        super().__init__()
        self.limit, self.alpha = limit, alpha

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(self.alpha * gate) * (up + 1)

    def extra_repr(self) -> str:
        return f"limit={self.limit}, alpha={self.alpha}"


def make_glu(kind: str, activation: str, limit: float, alpha: float) -> nn.Module:
    if kind == "clamped":
        return ClampedGLU(limit, alpha)
    if kind != "gated":
        raise ValueError(f"an expert's gate must be one of {EXPERT_GLUS}, not {kind!r}")
    return GLU(activation)


class Experts(nn.Module):
    """E gated feed-forwards, down_e(glu(gate_e x, up_e x)), their weights stacked: gate
    and up [E, F, D], down [E, D, F] (as nn.Linear holds a weight, output rows first), and
    with `bias` their biases [E, F] and [E, D] (gpt-oss)."""

    def __init__(self, d_model: int, d_ff: int, n_expert: int, *, glu: nn.Module,
                 dropout: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_expert, d_ff, d_model))
        self.up = nn.Parameter(torch.empty(n_expert, d_ff, d_model))
        self.down = nn.Parameter(torch.empty(n_expert, d_model, d_ff))
        self.gate_bias = nn.Parameter(torch.zeros(n_expert, d_ff)) if bias else None
        self.up_bias = nn.Parameter(torch.zeros(n_expert, d_ff)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(n_expert, d_model)) if bias else None
        self.glu = glu
        self.dropout = Dropout(dropout)
        self.reset_parameters()

    @property
    def n_expert(self) -> int:
        return self.gate.shape[0]

    def reset_parameters(self, std: float = 0.02, down_std: float | None = None) -> None:
        nn.init.normal_(self.gate, std=std)
        nn.init.normal_(self.up, std=std)
        nn.init.normal_(self.down, std=std if down_std is None else down_std)
        for bias in (self.gate_bias, self.up_bias, self.down_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def _bias(self, name: str, e: int) -> Tensor | None:
        bias = getattr(self, name)
        return None if bias is None else bias[e]

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e on rows x (n, D): a view of its slice of each stack, nothing copied."""
        gate = F.linear(x, self.gate[e], self._bias("gate_bias", e))
        up = F.linear(x, self.up[e], self._bias("up_bias", e))
        return F.linear(self.dropout(self.glu(gate, up)), self.down[e],
                        self._bias("down_bias", e))

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        return route_tokens(x, experts, weights, self.n_expert, self.expert)

    def as_linears(self, *, share: bool = True) -> ExpertLinears:
        """The same experts as separate nn.Linear layers, for code that converts linear
        layers one by one. share: over views of these weights (kernels.formats.
        quantize_model, which makes each a layer of its own at once); else over new,
        uninitialised tensors of their shapes, for a checkpoint's or a file's weights to
        fill (views of one tensor cannot be saved apart)."""
        return ExpertLinears(self, share=share)


class Projections(nn.ModuleList):
    """ExpertLinears's E layers of one projection, counting the layers set in it
    (`changes`): a binding of them for experts.c (MixtureOfExperts) is stale after one."""

    changes = 0

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, nn.Module):  # ModuleList's item assignment comes here too
            self.__dict__["changes"] = self.changes + 1
        super().__setattr__(name, value)


class ExpertLinears(nn.Module):
    """Experts whose projections are E modules each, `gate[e]`, `up[e]`, `down[e]`, of any
    kind that maps (n, in) -> (n, out): nn.Linear or a weight format's layer."""

    def __init__(self, stacked: Experts, *, share: bool = True) -> None:
        super().__init__()

        def own(t: Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach() if share else torch.empty_like(t),
                                requires_grad=False)

        def layers(weights: Tensor, biases: Tensor | None) -> nn.ModuleList:
            out = Projections()
            for e, w in enumerate(weights):
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                linear.weight = own(w)
                if biases is not None:
                    linear.bias = own(biases[e])
                out.append(linear)
            return out

        self.gate = layers(stacked.gate, stacked.gate_bias)
        self.up = layers(stacked.up, stacked.up_bias)
        self.down = layers(stacked.down, stacked.down_bias)
        self.glu = stacked.glu

    def expert(self, e: int, x: Tensor) -> Tensor:
        return self.down[e](self.glu(self.gate[e](x), self.up[e](x)))

    def stacked(self) -> Experts:
        """The same experts stacked again in fp32, every layer's weight as it computes with
        it (a weight format's layer gives its rounded weight): for code that reads a
        mixture's stacked tensors (export)."""
        first = self.down[0]
        experts = Experts(self.gate[0].in_features, first.in_features, len(self.gate),
                          glu=self.glu, bias=first.bias is not None)
        with torch.no_grad():
            for name in ("gate", "up", "down"):
                layers = getattr(self, name)
                getattr(experts, name).copy_(torch.stack([m.weight.float() for m in layers]))
                if first.bias is not None:
                    getattr(experts, f"{name}_bias").copy_(torch.stack([m.bias for m in layers]))
        return experts

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        return route_tokens(x, experts, weights, len(self.gate), self.expert)


class MixtureOfExperts(nn.Module):
    """(B, T, D) -> (B, T, D): the router's k experts of each token, weighted, plus the
    shared expert (if any) scaled by sigmoid(shared_gate x) (Qwen2-MoE). The parts are
    made by the caller (models.gpt.GPTConfig.feedforward_module) and passed in."""

    def __init__(self, router: Router, experts: Experts, shared: nn.Module | None = None, *,
                 balance: float = 0.0) -> None:
        super().__init__()
        self.router = router
        self.balance = balance
        """The weight of the load-balancing loss (balance_loss) in training; 0: none."""
        self.experts: Experts | ExpertLinears = experts
        self.shared = shared
        # A parameter, not an nn.Linear, as the router's weight is (see Router).
        d_model = router.weight.shape[1]
        self.shared_gate = nn.Parameter(torch.zeros(1, d_model)) if shared is not None else None

    def forward(self, x: Tensor) -> Tensor:
        h = x.reshape(-1, x.shape[-1])
        experts, weights = self.router(h)
        out = self.one_call(h, experts, weights)
        if out is None:
            out = self.through_modules(h, experts, weights)
        return out.view(x.shape)

    def through_modules(self, h: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """(N, D) rows and the router's choices for them -> the experts' weighted outputs
        (and the shared expert's), through the experts' modules."""
        out = self.experts(h, experts, weights)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(h, self.shared_gate)) * self.shared(h)
        if self.balance and self.training and torch.is_grad_enabled():
            probs = self.router.logits(h).softmax(-1)
            out = _WithAuxiliaryLoss.apply(out, self.balance * balance_loss(probs, experts))
        return out

    def one_call(self, h: Tensor, experts: Tensor, weights: Tensor) -> Tensor | None:
        """What `through_modules` computes, in one call into experts.c (kernels/experts.py)
        where it applies: inference (eval mode, no gradient) on up to MAX_ROWS fp32 rows on
        the CPU, experts of a kind the kernel reads (fp32 stacks or nn.Linears, a weight
        format's blocks), a silu or gpt-oss's clamped gate, biases or not, and a shared
        expert that is a silu-gated feed-forward of such layers; else None. Under a mode
        that watches torch's operations (FLOP counting, tracing) the modules run, for it to
        see them."""
        if (h.shape[0] > expert_kernel.MAX_ROWS or self.training or torch.is_grad_enabled()
                or h.dtype != torch.float32 or h.device.type != "cpu"
                or torch.compiler.is_compiling() or is_in_torch_dispatch_mode()):
            return None
        binding = self._binding()
        return None if binding is None else expert_kernel.run(binding, h, experts, weights)

    def tformer_moe(self) -> expert_kernel.MixtureBinding | None:
        """The mixture, router and experts, as step.c's layer step reads it (struct
        tformer_moe), for inference on up to MAX_ROWS rows; None where experts.c cannot run
        it (as `one_call`)."""
        binding = self._binding()
        router = self.router
        if binding is None:
            return None
        return expert_kernel.bind_mixture(binding, router.weight, router.bias, router.k,
                                          after=router.softmax == "after",
                                          renormalise=router.renormalise)

    def _binding(self) -> expert_kernel.Binding | None:
        """The experts' binding for experts.c, made again where the modules or the tensors
        it was made from changed."""
        key = self._binding_key()
        made = _BINDINGS.get(self)
        if made is None or made[0] != key:
            made = (key, self._bind())
            _BINDINGS[self] = made
        return made[1]

    def _binding_key(self) -> tuple:
        """What a binding was made from: the modules, and the tensors a move replaces."""
        experts, shared = self.experts, self.shared
        if isinstance(experts, Experts):
            held = tuple(None if t is None else t.data_ptr()
                         for t in (experts.gate, experts.up, experts.down, experts.gate_bias,
                                   experts.up_bias, experts.down_bias))
        elif isinstance(experts, ExpertLinears):
            held = tuple((id(p), getattr(p, "changes", 0))
                         for p in (experts.gate, experts.up, experts.down))
        else:
            return (id(experts),)
        parts = () if shared is None else (self.shared_gate.data_ptr(), *(
            id(getattr(shared, name, None)) for name in ("gate", "up", "down")))
        return id(experts), id(experts.glu), held, id(shared), parts

    def _bind(self) -> expert_kernel.Binding | None:
        experts = self.experts
        if not isinstance(experts, (Experts, ExpertLinears)):
            return None
        glu = experts.glu
        if isinstance(glu, ClampedGLU):
            clamped = (glu.limit, glu.alpha)
        elif isinstance(glu, GLU) and isinstance(glu.activation, nn.SiLU):
            clamped = None
        else:
            return None
        if isinstance(experts, Experts):
            parts = [expert_kernel.stacked(getattr(experts, name),
                                           getattr(experts, f"{name}_bias"))
                     for name in ("gate", "up", "down")]
        else:
            parts = [[expert_kernel.projection(m) for m in layers]
                     for layers in (experts.gate, experts.up, experts.down)]
        if any(p is None or None in p for p in parts):
            return None
        shared = None
        if self.shared is not None:
            ff = self.shared
            if not (getattr(ff, "gated", False) and isinstance(ff.activation, nn.SiLU)):
                return None
            shared = [expert_kernel.projection(m) for m in (ff.gate, ff.up, ff.down)]
            if None in shared:
                return None
        return expert_kernel.bind(*parts, clamped=clamped, shared=shared,
                                  shared_scale=self.shared_gate)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's)
        _BINDINGS.pop(self, None)  # its tensors may move
        return super()._apply(fn, recurse)


_BINDINGS: weakref.WeakKeyDictionary[MixtureOfExperts, tuple] = weakref.WeakKeyDictionary()
"""Each mixture's binding for experts.c with the key it was made for (_binding_key), kept
apart from the module so that copies and checkpoints of it never carry one."""


def stack_experts(model: nn.Module) -> nn.Module:
    """Make every mixture's experts held one layer an expert (ExpertLinears: a checkpoint
    holding a file's blocks, or a quantized model) stacked again, in place."""
    for module in list(model.modules()):
        if isinstance(module, MixtureOfExperts) and isinstance(module.experts, ExpertLinears):
            module.experts = module.experts.stacked()
    return model
