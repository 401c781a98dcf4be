"""`tformer info`: what a checkpoint holds and what it costs to train and run.

The summary is a plain dict (what `--json` prints): the config, parameters per top-level
module (a tensor shared by several modules, like a tied embedding, is counted once, under
the first module that owns it), FLOPs per token, memory, the checkpoint's step and
validation metrics, and its tokenizer.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tformer import loading
from tformer.data.tokenizers import special_names
from tformer.registry import get_family
from tformer.training import checkpoint as ckpt

FP32 = 4
ADAM_MOMENTS = 2
"""AdamW keeps two fp32 moments per parameter (Loshchilov & Hutter 2019)."""


def parameters_by_module(model: nn.Module) -> dict[str, int]:
    """Parameters per top-level module, each tensor once; model.named_parameters() yields a
    shared tensor under its first name only."""
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        counts[name.split(".")[0]] = counts.get(name.split(".")[0], 0) + p.numel()
    return counts


def flat_config(cfg: Any) -> dict[str, Any]:
    """The config as dotted keys, those that apply: the model's fields but the ones its own
    choices make moot (unused_fields), and the [data] and [train] fields the run set (an
    imported model has none). The tokenizer is shown from the checkpoint's own, so the
    data table's tokenizer fields are left out."""
    unused = cfg.model.unused_fields()
    flat = {f"model.{key}": value for key, value in cfg.to_dict()["model"].items()
            if key not in unused}
    for section in ("data", "train"):
        table = getattr(cfg, section)
        flat |= {f"{section}.{f.name}": value
                 for f in dataclasses.fields(table)
                 if (value := getattr(table, f.name)) != default_of(f)
                 and (section, f.name) not in TOKENIZER_FIELDS}
    return {key: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
            for key, v in flat.items()}


TOKENIZER_FIELDS = {("data", "tokenizer"), ("data", "vocab_size")}


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


TOKENIZER_KINDS = {"char": "characters", "word": "words", "bpe": "byte-level BPE",
                   "gpt2": "byte-level BPE, pretrained", "sentencepiece": "SentencePiece"}


def tokenizer_summary(tokenizer: Any) -> dict[str, Any]:
    """What the checkpoint's tokenizer is: its kind, vocabulary, special tokens (name and
    id), end-of-text ids, and whether it holds a chat template."""
    specials = {key: {"name": name, "id": getattr(tokenizer, f"{key}_id", None)}
                for key, name in special_names(tokenizer).items() if name is not None}
    return {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "special": specials,
            "eos_ids": list(tokenizer.eos_ids),
            "chat_template": tokenizer.chat_template is not None}


def validation_metrics(path: Path, step: int | None) -> dict[str, float]:
    """The validation row of the run's metrics.csv at the checkpoint's step, if the
    checkpoint still sits in its run (RUN/best or RUN/checkpoints/step-N)."""
    if step is None:
        return {}
    for run_dir in (path.parent, path.parent.parent):
        metrics = run_dir / "metrics.csv"
        if metrics.is_file():
            with open(metrics, newline="", encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f)
                        if r.get("split") == "val" and r.get("step") == str(step)]
            if rows:
                return {k: float(v) for k, v in rows[-1].items()
                        if k in ("loss", "bleu", "chrf") and v}
    return {}


def summarize(checkpoint: str | Path) -> dict[str, Any]:
    loaded = loading.load_checkpoint(checkpoint)
    model, cfg = loaded.model, loaded.cfg
    family = get_family(cfg.family)
    by_module = parameters_by_module(model)
    n_params = sum(by_module.values())

    cost = family.cost(cfg)
    activations = cost.batch * ckpt_activation_bytes(model, cost)
    weights = n_params * FP32
    memory = {
        "weights": weights,
        "gradients": weights,
        "optimizer_state": ADAM_MOMENTS * weights,
        "activations": activations,
    }
    memory["training_total"] = sum(memory.values())

    step = ckpt.trained_steps(loaded.path)
    return {
        "checkpoint": loaded.label,
        "path": str(loaded.path),
        "family": cfg.family,
        "config": flat_config(cfg),
        "parameters": {"total": n_params, "by_module": by_module},
        "flops_per_token": {
            "training": cost.train_flops,
            "decoding": cost.decode_flops,
            "assumes": cost.assumes,
        },
        "memory_bytes": {**memory, "assumes": f"fp32, AdamW, {cost.assumes}"},
        "step": step,
        "validation": validation_metrics(loaded.path, step),
        "tokenizer": tokenizer_summary(loaded.tokenizer),
    }


def ckpt_activation_bytes(model: nn.Module, cost: Any) -> int:
    """One sequence's saved activations, measured on the CPU with the loaded weights."""
    from tformer.viz.cost import activation_bytes

    torch.manual_seed(0)
    return activation_bytes(model, cost.example, torch.device("cpu"))


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (and bytes as KiB, MiB, GiB)."""
    if unit == "B":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or suffix == "TiB":
                return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.2f} {suffix}"
            n /= 1024
    if n == 0 or not math.isfinite(n):
        return str(n)
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:g}"


def format_summary(info: dict[str, Any]) -> str:
    """The summary as aligned tables for a terminal."""
    lines: list[str] = []

    def table(title: str, rows: list[tuple[str, str]]) -> None:
        lines.append(title)
        width = max((len(k) for k, _ in rows), default=0)
        lines.extend(f"  {k:<{width}}  {v}" for k, v in rows)
        lines.append("")

    table(f"{info['checkpoint']} ({info['family']}): the fields that apply; [data] and "
          f"[train] where the run set them",
          [(k, str(v)) for k, v in info["config"].items()])
    params = info["parameters"]
    table("parameters (shared tensors once)",
          [(k, f"{v:,}") for k, v in params["by_module"].items()]
          + [("total", f"{params['total']:,}")])
    flops = info["flops_per_token"]
    table(f"FLOPs per token ({flops['assumes']})",
          [("training", human(flops["training"])), ("decoding", human(flops["decoding"]))])
    memory = info["memory_bytes"]
    table(f"memory ({memory['assumes']})",
          [(k.replace("_", " "), human(v, "B")) for k, v in memory.items() if k != "assumes"])
    checkpoint_rows = [("step", str(info["step"]) if info["step"] is not None else "-")]
    checkpoint_rows += [(f"validation {k}", f"{v:.4f}") for k, v in info["validation"].items()]
    tok = info["tokenizer"]
    table("checkpoint", checkpoint_rows)
    kind = TOKENIZER_KINDS.get(tok["kind"], tok["kind"])
    tokenizer_rows = [("kind", f"{tok['kind']} ({kind})" if kind != tok["kind"] else kind),
                      ("vocabulary", f"{tok['vocab_size']:,} tokens")]
    tokenizer_rows += [(key, f"{special['name']} ({special['id']})")
                       for key, special in tok["special"].items()]
    if len(tok["eos_ids"]) > 1:
        tokenizer_rows += [("end-of-text ids", ", ".join(map(str, tok["eos_ids"])))]
    tokenizer_rows += [("chat template", "chat_template.jinja" if tok["chat_template"]
                        else "none")]
    table("tokenizer (the checkpoint's tokenizer.json)", tokenizer_rows)
    return "\n".join(lines).rstrip() + "\n"
