"""Checkpoints: a directory per checkpoint, written atomically and verified on load.

    RUN_DIR/
      config.json            the run's resolved config (what --resume continues)
      metrics.csv            one row per logged step or evaluation
      checkpoints/step-000250/
        config.json          family, hyperparameters, tokenizer kind
        model.safetensors    weights (tied tensors stored once)
        tokenizer.json
        trainer_state.pt     optimizer, step, RNG states, data cursor (training only)
        manifest.json        size and sha256 of every file above
      best/                  a checkpoint with the lowest validation loss so far

A checkpoint is written into a temporary sibling directory, every file fsynced, and then
renamed into place, so a crash at any moment leaves either the old checkpoint or the new
one, never half of one. The manifest catches a checkpoint damaged later (truncated, bytes
flipped, a file deleted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from tformer.config import RunConfig, config_from_dict
from tformer.data.tokenizers import Tokenizer, load_tokenizer, save_tokenizer
from tformer.errors import TformerError
from tformer.registry import get_family

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
BEST = "best"
STEP_DIR = re.compile(r"^step-(\d+)$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename, fsynced."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    dest: Path,
    cfg: RunConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory at `dest`, replacing any existing one atomically."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    config = cfg.to_dict()
    config["tokenizer"] = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_model(model, str(tmp / WEIGHTS))
    save_tokenizer(tokenizer, tmp / TOKENIZER)
    if trainer_state is not None:
        torch.save(trainer_state, tmp / TRAINER_STATE)

    manifest = {}
    for path in sorted(tmp.iterdir()):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        manifest[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    write_json(tmp / MANIFEST, manifest)
    _fsync_dir(tmp)

    old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    if old.exists():
        shutil.rmtree(old)
    return dest


def verify_checkpoint(path: Path) -> None:
    """Raise TformerError naming the damaged file if the checkpoint is not as written."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TformerError(f"checkpoint {path} is incomplete: {MANIFEST} is missing") from None
    except (OSError, ValueError) as e:
        raise TformerError(f"checkpoint file {manifest_path} is damaged: {e}") from None
    for name in (CONFIG, WEIGHTS, TOKENIZER):
        if name not in manifest:
            raise TformerError(f"checkpoint {path} is incomplete: {name} is not in its manifest")
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise TformerError(f"checkpoint file {file} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise TformerError(
                f"checkpoint file {file} is damaged: {file.stat().st_size} bytes, "
                f"{expected['bytes']} expected (truncated?)"
            )
        if _sha256(file) != expected["sha256"]:
            raise TformerError(f"checkpoint file {file} is damaged: its checksum does not match")


def step_checkpoints(run_dir: Path) -> list[Path]:
    """A run's step checkpoints, oldest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MANIFEST).exists() or (Path(path) / WEIGHTS).exists()


def latest_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest step checkpoint that verifies; damaged ones are skipped with a warning."""
    for path in reversed(step_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except TformerError as e:
            log.warning("skipping damaged checkpoint: %s", e)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """CKPT as the CLI takes it: a checkpoint directory, or a run directory (its best
    checkpoint if it has a good one, else its newest good step checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise TformerError(f"checkpoint or run directory not found: {path}")
    if not path.is_dir():
        raise TformerError(f"{path} is not a directory (expected a run or checkpoint directory)")
    if is_checkpoint(path):
        return path
    best = path / BEST
    if best.is_dir():
        try:
            verify_checkpoint(best)
            return best
        except TformerError as e:
            log.warning("best checkpoint unusable, using the latest: %s", e)
    latest = latest_good_checkpoint(path)
    if latest is None:
        raise TformerError(f"{path} holds no usable checkpoint")
    return latest


@dataclass
class Checkpoint:
    path: Path
    cfg: RunConfig
    model: nn.Module
    tokenizer: Tokenizer


def read_config(path: Path) -> RunConfig:
    raw = json.loads((Path(path) / CONFIG).read_text(encoding="utf-8"))
    raw.pop("tokenizer", None)
    return config_from_dict(raw)


def load_checkpoint(
    path: str | Path, *, device: torch.device | str = "cpu", family: str | None = None
) -> Checkpoint:
    """Load a checkpoint (or a run's best/latest) as a model in eval mode.

    family: the family the caller needs; another one is a clear error, not a shape mismatch.
    """
    path = resolve_checkpoint(path)
    verify_checkpoint(path)
    cfg = read_config(path)
    if family is not None and cfg.family != family:
        raise TformerError(
            f"checkpoint {path} is a {cfg.family} model; this command needs a {family} model"
        )
    tokenizer = load_tokenizer(path / TOKENIZER)
    model = get_family(cfg.family).model(cfg.model)
    load_model(model, str(path / WEIGHTS), device=str(device))
    model.to(device).eval()
    return Checkpoint(path, cfg, model, tokenizer)


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=True)


def recover_run_dir(run_dir: Path) -> None:
    """Tidy up after a process killed while saving: drop half-written temporaries, and put
    back a checkpoint that was moved aside but not yet replaced."""
    for folder in (Path(run_dir), Path(run_dir) / CHECKPOINTS):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.name.startswith(".tmp-") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.startswith(".old-") and path.is_dir():
                name = path.name[len(".old-") :].rsplit("-", 1)[0]
                if (folder / name).exists():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.replace(path, folder / name)
                    log.warning("restored %s, left aside by an interrupted save", folder / name)


def resume_point(run_dir: Path) -> Path | None:
    """The checkpoint `--resume` continues from: the newest good step checkpoint, after
    tidying up what a killed process may have left."""
    recover_run_dir(run_dir)
    return latest_good_checkpoint(run_dir)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints."""
    for path in step_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
