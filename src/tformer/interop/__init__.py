"""Import and export of other libraries' checkpoints, one file per source format; this
module holds what they share (reading a Hugging Face directory), tformer.interop.command
the entry points.

`import_checkpoint` (tformer.interop.command) reads a local Hugging Face model directory,
finds its format from config.json's `model_type`, and writes a tformer checkpoint
directory; `export_checkpoint` writes a tformer checkpoint back out in a format another
library loads. Nothing is
downloaded: every source is a path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.errors import TformerError

log = logging.getLogger(__name__)


def read_hf_config(src: Path) -> dict[str, Any]:
    path = Path(src) / "config.json"
    if not Path(src).is_dir():
        raise TformerError(f"{src} is not a directory (expected a Hugging Face model directory)")
    if not path.is_file():
        raise TformerError(f"{src} has no config.json: it is not a Hugging Face model directory")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TformerError(f"cannot read {path}: {e}") from None


def read_hf_weights(src: Path) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face model directory: model.safetensors (or its shards), or
    pytorch_model.bin read with weights_only=True (no code in a pickle runs)."""
    from safetensors.torch import load_file

    src = Path(src)
    if (src / "model.safetensors").is_file():
        return load_file(src / "model.safetensors")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        weights: dict[str, Tensor] = {}
        for shard in shards:
            weights.update(load_file(src / shard))
        return weights
    if (src / "pytorch_model.bin").is_file():
        try:
            return torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # an unpickling error names what it refused
            raise TformerError(f"cannot read {src / 'pytorch_model.bin'}: {e}") from None
    raise TformerError(f"{src} has no model.safetensors or pytorch_model.bin")


def take(weights: dict[str, Tensor], name: str, source: Path) -> Tensor:
    """weights[name], removed from `weights` (so that what is left over can be reported)."""
    try:
        return weights.pop(name)
    except KeyError:
        raise TformerError(f"{source}: the weights have no tensor {name!r}") from None
