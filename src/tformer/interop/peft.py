"""LoRA adapters in PEFT's format (Hugging Face `peft`), in and out, for GPT-2 models.

A PEFT LoRA directory is adapter_config.json and adapter_model.safetensors, whose tensors
are named after the Hugging Face model's modules with PEFT's prefix:
`base_model.model.transformer.h.0.attn.c_attn.lora_A.weight`. GPT-2's Conv1D layers keep
their weight transposed, but PEFT's lora_A (r x in) and lora_B (out x r) are plain linear
maps either way (its `fan_in_fan_out` transposes only the merged update), so the adapter
tensors are ours as they are: only the names change (tformer.interop.gpt2's table).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from tformer.config import LoRAConfig, TrainConfig
from tformer.errors import TformerError
from tformer.interop import gpt2

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.transformer."


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _module_names(n_layer: int) -> dict[str, str]:
    """Our adapted layers' names -> GPT-2's module names (the Conv1D layers)."""
    return {
        ours.removesuffix(".weight"): theirs.removesuffix(".weight")
        for ours, theirs in gpt2._names(n_layer, tied=True).items()
        if gpt2._transposed(theirs)
    }


def export_adapter(checkpoint: Path, dest: Path) -> Path:
    """A LoRA run of a GPT-2-shaped model -> a PEFT adapter directory, for the base that
    `tformer export` writes of the checkpoint the run adapted."""
    from safetensors.torch import save_file

    from tformer.loading import ADAPTERS, read_config, resolve_checkpoint, verify_checkpoint
    from tformer.training.lora import read_adapters

    path = resolve_checkpoint(checkpoint)
    verify_checkpoint(path)
    cfg = read_config(path)
    lora = cfg.train.lora
    if lora is None:
        raise TformerError(f"--adapter: {checkpoint} is not a LoRA run (it has no "
                           f"train.lora); export its weights without --adapter")
    if cfg.family != "gpt":
        raise TformerError(f"--adapter: PEFT export is for GPT-2 models; {checkpoint} is a "
                           f"{cfg.family} model")
    gpt2.gpt2_config(cfg.model)  # an error listing what GPT-2 cannot express
    names = _module_names(cfg.model.n_layer)
    tensors: dict[str, Tensor] = {}
    for name, tensor in read_adapters(path / ADAPTERS).items():
        layer, _, part = name.partition(".lora_")
        tensors[f"{PREFIX}{names[layer]}.lora_{part}"] = tensor.contiguous()
    # Module-name suffixes PEFT matches: attn.c_proj and mlp.c_proj are told apart.
    targets = sorted({names[n.partition(".lora_")[0]].split(".", 2)[2]
                      for n in read_adapters(path / ADAPTERS)})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": targets, "fan_in_fan_out": True, "bias": "none",
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "use_rslora": False, "use_dora": False, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    if dest.exists() and any(dest.iterdir()):
        raise TformerError(f"{dest} exists and is not empty; choose another directory")
    tmp = dest.with_name(f".tmp-{dest.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if dest.exists():
        dest.rmdir()
    tmp.rename(dest)
    return dest


def check_supported(peft: dict[str, Any], source: Path) -> None:
    """What tformer's LoRA cannot express in an adapter_config.json is an error naming it."""
    if peft.get("peft_type") != "LORA":
        raise TformerError(f"{source}: peft_type {peft.get('peft_type')!r} is not LORA")
    unsupported = {"use_dora": False, "use_rslora": False, "bias": "none"}
    problems = [f"{k} = {peft[k]!r}" for k, v in unsupported.items() if peft.get(k, v) != v]
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if peft.get(key):
            problems.append(f"{key} = {peft[key]!r}")
    if problems:
        raise TformerError(f"{source}: tformer's LoRA cannot express {', '.join(problems)}")


def lora_config(peft: dict[str, Any], targets: list[str]) -> LoRAConfig:
    return LoRAConfig(r=int(peft["r"]), alpha=float(peft.get("lora_alpha", 8)),
                      dropout=float(peft.get("lora_dropout", 0.0)), targets=targets)


def import_adapter(src: Path, base: str | Path, dest: Path) -> Path:
    """A PEFT LoRA directory for a GPT-2 model, and the tformer checkpoint imported from that
    model -> a LoRA checkpoint at `dest` that adapts `base`."""
    from safetensors.torch import load_file

    from tformer.data.tokenizers import load_tokenizer
    from tformer.loading import (
        TOKENIZER,
        base_reference,
        read_config,
        resolve_checkpoint,
        verify_checkpoint,
    )
    from tformer.registry import get_family
    from tformer.training import lora
    from tformer.training.checkpoint import save_checkpoint

    src = Path(src)
    try:
        peft = json.loads((src / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TformerError(f"cannot read {src / ADAPTER_CONFIG}: {e}") from None
    check_supported(peft, src)
    if not (src / ADAPTER_WEIGHTS).is_file():
        raise TformerError(f"{src} has no {ADAPTER_WEIGHTS}")
    base_path = resolve_checkpoint(base)
    verify_checkpoint(base_path)
    cfg = read_config(base_path)
    if cfg.family != "gpt":
        raise TformerError(f"--base {base} is a {cfg.family} model; a GPT-2 adapter needs "
                           f"a GPT-2 model imported with tformer import")
    ours = {theirs: mine for mine, theirs in _module_names(cfg.model.n_layer).items()}
    tensors = {}
    for name, tensor in load_file(str(src / ADAPTER_WEIGHTS)).items():
        layer, _, part = name.removeprefix(PREFIX).partition(".lora_")
        if layer not in ours or part.removeprefix("A").removeprefix("B") not in (
            ".weight", ".default.weight"
        ):
            raise TformerError(f"{src / ADAPTER_WEIGHTS}: {name!r} is not a LoRA tensor of "
                               f"a GPT-2 layer tformer knows")
        tensors[f"{ours[layer]}.lora_{part[0]}.weight"] = tensor.float()
    targets = sorted({name.partition(".lora_")[0].rsplit(".", 1)[1] for name in tensors})
    run = replace(cfg, train=TrainConfig(init_from=str(base_path.absolute()),
                                         lora=lora_config(peft, targets)))
    model = get_family("gpt").model(run.model)
    lora.add_adapters(model, run.train.lora)
    lora.load_adapters(model, tensors, src / ADAPTER_WEIGHTS)
    tokenizer = load_tokenizer(base_path / TOKENIZER)
    save_checkpoint(dest, run, model, tokenizer, lora_base=base_reference(base_path))
    log.info("imported the LoRA adapter %s on %s into %s", src, base_path, dest)
    return dest
