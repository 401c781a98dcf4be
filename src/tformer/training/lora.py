"""LoRA: low-rank adapters beside frozen weights (Hu et al. 2021, "LoRA: Low-Rank Adaptation
of Large Language Models").

An adapted linear layer computes W x + b + (alpha / r) B A dropout(x), with W and b frozen,
A (r x in) drawn like PEFT's (Kaiming-uniform) and B (out x r) zero, so that training starts
from the base model's outputs exactly. Only A and B train and get optimizer state.

Adapters are put on a model by module name, the same way for every family: the layers
adapted are the nn.Linear modules inside its stacks of blocks (modules under an
nn.ModuleList), never the embeddings or the output head, picked by their last name
(`qkv_proj`, `out_proj`, `up`, `down`, ...) or all of them. An adapted layer keeps its
weight's and bias's names, so a model's base weights load into it unchanged; the adapters
are `<layer>.lora_A.weight` and `<layer>.lora_B.weight`, PEFT's names.

With train.lora.int8 the frozen weights of the blocks' linear layers, adapted or not, are
kept as int8 rows while the adapters train (kernels/quantize.py's FrozenInt8Linear: a
quarter of their fp32 bytes, and the products int8 ones), as QLoRA keeps its base in four
bits (Dettmers et al. 2023). They are rounded again from the fp32 base whenever a run starts
or resumes, the same way every time, so checkpoints still hold the adapters alone.

For inference the adapters are merged into the weights (W + (alpha / r) B A): the merged
model is a plain one, and every decoding fast path that reads a layer's weight applies.
Adapters trained over int8 weights are merged into the fp32 ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tformer.config import LoRAConfig
from tformer.errors import TformerError, did_you_mean
from tformer.kernels.quantize import FrozenInt8Linear

ADAPTER_MODULES = ("lora_A", "lora_B", "lora_dropout")


class LoRALinear(nn.Linear):
    """An nn.Linear whose weight and bias (those of `base`, shared, frozen) are joined by a
    trainable low-rank update. x (..., in) -> (..., out)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)  # the base's parameters are taken over, not made anew
        self.weight = base.weight
        self.bias = base.bias
        self._add_adapter(base, r, alpha, dropout)

    def _add_adapter(self, base: nn.Linear, r: int, alpha: float, dropout: float) -> None:
        self.in_features, self.out_features = base.in_features, base.out_features
        kind = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **kind)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **kind)
        # PEFT's initialisation: A as nn.Linear draws it, B zero, so B A = 0 at the start.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / r

    def frozen(self, x: Tensor) -> Tensor:
        """W x + b, the part that does not train."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return self.frozen(x) + update * self.scaling

    def output_rows(self, x: Tensor, start: int) -> Tensor:
        """self(x)[..., start:] without the outputs before `start`, the adapter's update
        included (for a bias-free layer: Transformer-XL projects its memory so)."""
        update = F.linear(self.lora_A(self.lora_dropout(x)), self.lora_B.weight[start:])
        return F.linear(x, self.weight[start:]) + update * self.scaling

    def delta(self) -> Tensor:
        """(alpha / r) B A: what merging adds to the weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


class Int8LoRALinear(LoRALinear):
    """A LoRALinear whose frozen weight is kept as int8 rows (quantize.FrozenInt8Linear, a
    quarter of its fp32 bytes) for training on the CPU: train.lora.int8. Its `weight` is the
    rounded one, in fp32; the adapters are a LoRALinear's."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.base_int8 = FrozenInt8Linear(base)
        self._add_adapter(base, r, alpha, dropout)

    @property
    def weight(self) -> Tensor:
        return self.base_int8.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base_int8.bias

    def frozen(self, x: Tensor) -> Tensor:
        return self.base_int8(x)


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The nn.Linear modules inside the model's stacks of blocks, by qualified name: those
    with a list index in their name (`blocks.0.attn.qkv_proj`), which leaves out the
    embeddings and the output head whatever a family calls them."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not isinstance(module, LoRALinear)
        and any(part.isdigit() for part in name.split("."))
        and name.rsplit(".", 1)[-1] not in ADAPTER_MODULES
    }


def target_modules(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """The qualified names of the layers `cfg.targets` picks; an unknown name is an error
    listing the names the model's blocks have."""
    linears = block_linears(model)
    if cfg.targets == "all":
        return list(linears)
    known = sorted({name.rsplit(".", 1)[-1] for name in linears})
    for target in cfg.targets:
        if target not in known:
            raise TformerError(
                f"train.lora.targets: the model's blocks have no linear layer {target!r}"
                f"{did_you_mean(target, known)}; they have: {', '.join(known)}"
            )
    return [name for name in linears if name.rsplit(".", 1)[-1] in cfg.targets]


def add_adapters(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze every weight of `model` and put an adapter on each target layer, in place;
    the names of the adapted layers. With cfg.int8 every linear layer of the blocks, adapted
    or not, keeps its weight as int8 rows from then on (the model must be on the CPU)."""
    names = target_modules(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.int8:
        check_int8_device(model)
    adapted = Int8LoRALinear if cfg.int8 else LoRALinear
    for name, linear in block_linears(model).items():
        if name in names:
            layer = adapted(linear, cfg.r, cfg.alpha, cfg.dropout)
        elif cfg.int8:
            layer = FrozenInt8Linear(linear)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    return names


def check_int8_device(model: nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise TformerError(f"train.lora.int8 trains on the CPU (its int8 products take fp32 "
                           f"rows there), and this run is on {device}; set train.device=cpu")


def adapted_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors by state-dict name (`<layer>.lora_A.weight`, ...)."""
    return {
        f"{name}.{part}.weight": getattr(layer, part).weight.detach()
        for name, layer in adapted_layers(model).items()
        for part in ("lora_A", "lora_B")
    }


def parameter_count(model: nn.Module) -> int:
    """Every weight of the model, those kept as int8 rows (train.lora.int8) included."""
    int8 = sum(m.qweight.numel() for m in model.modules() if isinstance(m, FrozenInt8Linear))
    return int8 + sum(p.numel() for p in model.parameters())


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def save_adapters(model: nn.Module, file: Path) -> None:
    tensors = {k: v.contiguous() for k, v in adapter_state(model).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})


def read_adapters(file: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise TformerError(f"adapter file {file} does not load: {e}") from None


def load_adapters(model: nn.Module, tensors: dict[str, Tensor], source: Path | str) -> None:
    """Copy adapter tensors into a model's adapters: every adapter must be given, with its
    shape, and nothing else."""
    expected = adapter_state(model)
    for name, tensor in tensors.items():
        if name not in expected:
            raise TformerError(f"{source}: the adapters hold {name!r}, which the model's "
                               f"LoRA layers do not have")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise TformerError(f"{source}: {name} has shape {list(tensor.shape)}, the "
                               f"model's LoRA config says {list(expected[name].shape)}")
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise TformerError(f"{source}: no adapter tensor {missing[0]!r} (and "
                           f"{len(missing) - 1} more missing)")
    with torch.no_grad():
        for name, tensor in tensors.items():
            expected[name].copy_(tensor)


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight and put the plain nn.Linear back, in place:
    the same function, without the adapters' extra work."""
    with torch.no_grad():
        for name, layer in adapted_layers(model).items():
            plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                              device="meta")
            plain.weight = nn.Parameter(layer.weight + layer.delta().to(layer.weight.dtype),
                                        requires_grad=False)
            plain.bias = layer.bias
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, plain)
    return model


def merge_adapters(model: nn.Module, file: Path, cfg: LoRAConfig) -> None:
    """Add the adapters saved in `file` (trained with `cfg`) to a plain model's weights;
    which weights train stays as it was."""
    trains = {name: p.requires_grad for name, p in model.named_parameters()}
    # Into the fp32 weights, also for adapters trained over their int8 copy (cfg.int8).
    add_adapters(model, dataclasses.replace(cfg, int8=False))
    load_adapters(model, read_adapters(file), file)
    merge(model)
    for name, p in model.named_parameters():
        p.requires_grad_(trains[name])


@contextmanager
def adapters_removed(model: nn.Module) -> Iterator[nn.Module]:
    """The model as its base alone for the life of the block (its state dict without the
    adapters), to save the frozen base of a LoRA run trained from scratch."""
    held = [(layer, {k: layer._modules.pop(k) for k in ADAPTER_MODULES})
            for layer in adapted_layers(model).values()]
    try:
        yield model
    finally:
        for layer, modules in held:
            layer._modules.update(modules)
