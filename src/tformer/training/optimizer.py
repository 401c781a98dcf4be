"""The optimizer a run trains with, as `train.optimizer` names it.

adamw: AdamW over every weight that trains.
muon:  Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
       networks"; torch.optim.Muon) for the weight matrices of the blocks, AdamW for the
       rest: embeddings, the output head, norms and biases, as modded-nanogpt and nanochat
       split them. Muon replaces each matrix's momentum by its nearest semi-orthogonal
       matrix, an update of the same size in every direction: right for a map between
       hidden states, while an embedding row moves only when its token is seen; Muon's
       authors keep the input and output layers on AdamW.

The trainer sets one learning rate per step (training.schedule) and each parameter group
scales it by its "lr_scale" (absent: 1): Muon's groups follow the same schedule at
train.muon_lr / train.lr times the rate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tformer.config import TrainConfig
from tformer.errors import TformerError
from tformer.training.lora import block_linears


def decay_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed): weight decay pulls the weights of linear maps and embeddings
    towards zero, and nothing else. Biases, norms' gains and shifts, and free-standing
    parameters such as Transformer-XL's global u and v biases keep theirs (they are biases,
    whatever their number of dimensions). Decided by the module that owns the parameter."""
    decayed: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.requires_grad:
            decayed[id(module.weight)] = module.weight
    kept = [p for p in model.parameters() if p.requires_grad and id(p) not in decayed]
    return list(decayed.values()), kept


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable weight matrices of the linear layers inside the model's stacks of
    blocks: the attention and feed-forward projections (lora.block_linears), never the
    embeddings or the output head."""
    weights = [layer.weight for layer in block_linears(model).values()]
    return [w for w in weights if w.requires_grad and w.dim() == 2]


def make_optimizer(
    model: nn.Module, cfg: TrainConfig, device: torch.device
) -> torch.optim.AdamW | MuonWithAdamW:
    """The optimizer `cfg.optimizer` names over the model's trainable weights."""
    decay, no_decay = decay_groups(model)
    if cfg.optimizer == "adamw":
        return adamw(decay, no_decay, cfg, device)
    matrices = muon_parameters(model)
    if not matrices:
        raise TformerError(
            "train.optimizer = muon: the model has no trainable weight matrices in its blocks "
            "for Muon; choose train.optimizer = adamw"
        )
    taken = {id(p) for p in matrices}
    rest = adamw([p for p in decay if id(p) not in taken], no_decay, cfg, device)
    # lr = 0 trains nothing; Muon then trains nothing either.
    scale = cfg.muon_lr / cfg.lr if cfg.lr > 0 else 0.0
    muon = torch.optim.Muon(
        [{"params": matrices, "lr_scale": scale}], lr=cfg.muon_lr, weight_decay=cfg.weight_decay
    )
    return MuonWithAdamW(muon, rest)


def adamw(
    decay: list[nn.Parameter], no_decay: list[nn.Parameter], cfg: TrainConfig,
    device: torch.device,
) -> torch.optim.AdamW:
    """AdamW with weight decay on `decay` only (`decay_groups`).

    The fused implementation (one kernel over all parameters) on CPU as on GPUs: on CPU it
    updates a 0.8M-parameter model in a sixth of the time of the default per-op one, a tenth
    of a small model's training step (benchmarks/speed.py).
    """
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type in ("cpu", "cuda")
    )


class MuonWithAdamW:
    """Muon and AdamW over disjoint parameters, stepped as one optimizer: what the trainer
    asks of an optimizer (param_groups, step, zero_grad, state_dict, load_state_dict).

    Its state dict holds both: {"muon": ..., "adamw": ...}. Loading one keeps the lr_scale
    this optimizer was built with, so that a run resumed with another train.muon_lr (or
    train.lr) takes the new ratio.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scales = [g["lr_scale"] for g in self.muon.param_groups]
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        for group, scale in zip(self.muon.param_groups, scales, strict=True):
            group["lr_scale"] = scale
