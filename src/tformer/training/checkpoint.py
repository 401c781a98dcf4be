"""Writing checkpoints, in training: each written atomically, best/ published as a link,
old step checkpoints pruned, a run owned by one writer, and the run tidied before it resumes.
The layout, and everything that reads checkpoints, is in tformer/loading.py.

A checkpoint is written into a temporary sibling directory, every file fsynced, and then
renamed into place, so a crash at any moment leaves either the old checkpoint or the new
one, never half of one. The manifest catches a checkpoint damaged later (truncated, bytes
flipped, a file deleted).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import resource
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_model
from torch import nn

from tformer.config import RunConfig
from tformer.data.tokenizers import Tokenizer, save_tokenizer
from tformer.errors import TformerError
from tformer.kernels import blocks
from tformer.loading import (
    ADAPTERS,
    BEST,
    CHECKPOINTS,
    CONFIG,
    LORA_BASE,
    MANIFEST,
    TOKENIZER,
    TRAINER_STATE,
    WEIGHTS,
    load_checkpoint,
    read_config,
    read_config_json,
    resolve_checkpoint,
    sha256_of,
    step_checkpoints,
    verify_checkpoint,
)
from tformer.registry import get_family
from tformer.training import lora

log = logging.getLogger(__name__)

LOCK = ".lock"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write strict JSON through a temporary file and a rename, fsynced."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def write_text(path: Path, text: str) -> None:
    """Replace a file's text atomically: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from None


def write_error(path: Path, error: BaseException) -> TformerError:
    """A failed write as one line naming the path and the cause. torch.save reports a full
    disk or a file size limit only as "enforce fail at inline_container.cc", so when the
    error does not name its cause, the file system and the limits are asked."""
    return TformerError(f"cannot write {path}: {_write_failure_cause(path, error)}")


def _write_failure_cause(path: Path, error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if m := re.search(r"os error (\d+)", str(error)):
        return os.strerror(int(m.group(1)))
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        fs = os.statvfs(folder)
        if fs.f_flag & os.ST_RDONLY:
            return os.strerror(errno.EROFS)
        if fs.f_bavail * fs.f_frsize < 1 << 20:
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    if not os.access(folder, os.W_OK):
        return os.strerror(errno.EACCES)
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"{os.strerror(errno.EFBIG)} (the file size limit, ulimit -f, is {soft} bytes)"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


# --- one writer per run ------------------------------------------------------------------


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Own `run_dir` for the life of the block: an exclusive flock on RUN_DIR/.lock, which
    the OS releases when the process ends however it ends. A second process (a second
    `train`, or a `--resume` while the run trains) gets a one-line error with the holder's
    pid instead of mixing its checkpoints into the run or deleting the other's files."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise TformerError(
                f"{run_dir} is in use by another tformer process (pid {holder}); wait for it "
                f"to finish, stop it, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def save_checkpoint(
    dest: Path,
    cfg: RunConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    trainer_state: dict[str, Any] | None = None,
    *,
    lora_base: dict[str, str] | None = None,
    step: int | None = None,
) -> Path:
    """Write a checkpoint directory at `dest`, replacing any existing one atomically.

    A LoRA model (cfg.train.lora) is saved as its adapters and either `lora_base`, the
    reference to the checkpoint it was trained on (loading.base_reference), or, when it has
    none (trained from scratch), its frozen base weights.

    A full disk, a read-only disk or a file size limit is a TformerError naming the path and
    the cause; the temporary directory is removed and the earlier checkpoints are untouched.
    `best` (replaced again and again while readers may load it) is published as a link to a
    new directory, switched in one rename. `step`: the steps the weights were trained for,
    where no trainer state says it.
    """
    dest = Path(dest)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_checkpoint_files(tmp, cfg, model, tokenizer, trainer_state, lora_base, step)
        if dest.name == BEST:
            _publish_version(tmp, dest)
        else:
            _replace_dir(tmp, dest)
    except (OSError, RuntimeError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _write_failure_cause(tmp, e)
        raise TformerError(
            f"cannot save checkpoint {dest}: {cause}; the checkpoints saved before are intact"
        ) from None
    return dest


def _write_checkpoint_files(
    tmp: Path,
    cfg: RunConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    trainer_state: dict[str, Any] | None,
    lora_base: dict[str, str] | None,
    step: int | None,
) -> None:
    config = cfg.to_dict()
    config["tokenizer"] = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size}
    if trainer_state is not None:
        step = trainer_state["step"]
    if step is not None:
        config["step"] = int(step)  # what readers show; the trainer state is --resume's
    (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if cfg.train.lora is None:
        held = blocks.formats_of(model)  # weights held as blocks: named in the header
        metadata = {"format": "pt", blocks.FORMATS_KEY: json.dumps(held)} if held else None
        save_weights(model, tmp / WEIGHTS, metadata=metadata)
    else:
        lora.save_adapters(model, tmp / ADAPTERS)
        if lora_base is not None:
            (tmp / LORA_BASE).write_text(json.dumps(lora_base, indent=2) + "\n",
                                         encoding="utf-8")
        else:
            with lora.adapters_removed(model):
                save_weights(model, tmp / WEIGHTS)
    save_tokenizer(tokenizer, tmp / TOKENIZER)
    if trainer_state is not None:
        torch.save(trainer_state, tmp / TRAINER_STATE)

    manifest = {}
    for path in sorted(tmp.iterdir()):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        manifest[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    write_json(tmp / MANIFEST, manifest)
    _fsync_dir(tmp)


def save_weights(model: nn.Module, file: Path, metadata: dict[str, str] | None = None) -> None:
    """The model's tensors as a safetensors file (tied tensors once), the same bytes for the
    same weights in every process. safetensors writes the header's metadata (the names of the
    tied tensors it leaves out, and `metadata`) from a Rust HashMap, whose order changes from
    process to process; the header is written again with those keys sorted."""
    save_model(model, str(file), metadata=metadata)
    with open(file, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # as safetensors does, padded with spaces
            f.seek(8)
            f.write(text.ljust(size))
            return
        rest = file.with_name(f".{file.name}.sorted")
        with open(rest, "wb") as out:
            padded = text.ljust(-(-len(text) // 8) * 8)
            out.write(len(padded).to_bytes(8, "little") + padded)
            f.seek(8 + size)
            shutil.copyfileobj(f, out)
    os.replace(rest, file)


def _replace_dir(tmp: Path, dest: Path) -> None:
    old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    if old.exists():
        shutil.rmtree(old)


def _publish_version(tmp: Path, dest: Path) -> None:
    """dest becomes a relative symlink to a new hidden directory, in one rename; the
    directory it pointed to before is deleted after the switch."""
    version = dest.with_name(f".{dest.name}-{time.time_ns():x}")
    os.replace(tmp, version)
    link = dest.with_name(f".tmp-{dest.name}-{os.getpid()}.link")
    link.unlink(missing_ok=True)
    os.symlink(version.name, link)
    previous = _version_of(dest)
    if dest.is_dir() and not dest.is_symlink():  # a run from before best/ was a link
        os.replace(dest, dest.with_name(f".{dest.name}-0"))
        previous = dest.with_name(f".{dest.name}-0")
    os.replace(link, dest)
    _fsync_dir(dest.parent)
    if previous is not None and previous != version:
        shutil.rmtree(previous, ignore_errors=True)


def _version_of(link: Path) -> Path | None:
    """The directory a published link points to (None if it is not a link)."""
    if not link.is_symlink():
        return None
    return link.parent / os.readlink(link)


def ship_checkpoint(checkpoint: Path, dest: Path) -> Path:
    """`checkpoint` (a run: its best, else its newest) in the form a model is shipped in:
    config, weights, tokenizer and chat template, with their manifest, and no trainer state
    (only --resume reads it; it is twice the weights' size). A LoRA run's adapters are merged,
    so the result stands alone."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise TformerError(f"{dest} exists and is not empty; choose another directory")
    loaded = load_checkpoint(checkpoint)
    return save_checkpoint(dest, loaded.cfg, loaded.model, loaded.tokenizer,
                           step=trained_steps(loaded.path))


def trained_steps(path: Path) -> int | None:
    """The steps a checkpoint's weights were trained for: config.json's `step`, else its
    trainer state's (checkpoints written before the config held it); None for weights
    brought in from elsewhere."""
    config = read_config_json(path)
    if "step" in config:
        return int(config["step"])
    if (Path(path) / TRAINER_STATE).is_file():
        return int(load_trainer_state(path)["step"])
    return None


def inherit_model(
    init_from: str, family: Any, given: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The [model] table of a run that starts from checkpoint `init_from`: the checkpoint's
    own, with the keys the run gives. A key that would change what the weights mean (or
    their shapes) must agree with the checkpoint; dropout and the like may change."""
    path = resolve_checkpoint(init_from)
    saved = read_config(path)
    if family is not None and family != saved.family:
        raise TformerError(
            f"train.init_from = {init_from}: the checkpoint is a {saved.family} model, the "
            f"config says model.family = {family!r}"
        )
    model = asdict(saved.model)
    free = get_family(saved.family).model_config.weight_free
    contradictions = [
        f"model.{key} = {value!r} (checkpoint: {model[key]!r})"
        for key, value in given.items()
        if key in model and key not in free and value != model[key]
    ]
    if contradictions:
        raise TformerError(
            f"train.init_from = {init_from}: these model fields contradict the checkpoint: "
            + ", ".join(contradictions)
        )
    return saved.family, {**model, **given}


def initial_weights(init_from: str | None) -> Path | None:
    """train.init_from as a verified checkpoint directory (none: train from scratch)."""
    if init_from is None:
        return None
    path = resolve_checkpoint(init_from)
    verify_checkpoint(path)
    return path


def load_trainer_state(path: Path) -> dict[str, Any]:
    file = Path(path) / TRAINER_STATE
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise TformerError(f"checkpoint file {file} does not load: {e}") from None


def recover_run_dir(run_dir: Path) -> None:
    """Tidy up after a process killed while saving: drop half-written temporaries and
    directories left from switching best/ or pruning, and put back a checkpoint that was
    moved aside but not yet replaced. Only the process holding the run's lock may call it."""
    run_dir = Path(run_dir)
    folders = [f for f in (run_dir, run_dir / CHECKPOINTS) if f.is_dir()]
    for folder in folders:
        for path in folder.iterdir():
            if path.name.startswith(".old-") and path.is_dir():
                original = path.name[len(".old-") :].rsplit("-", 1)[0]
                if os.path.lexists(folder / original):
                    _remove(path)
                else:
                    os.replace(path, folder / original)
                    log.warning("restored %s, left aside by an interrupted save", folder / original)
    current = _version_of(run_dir / BEST)  # only after best/ itself is back in place
    for folder in folders:
        for path in folder.iterdir():
            if path.name.startswith((".tmp-", ".trash-")) or (
                path.name.startswith(f".{BEST}-") and path != current
            ):
                _remove(path)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints. Each is renamed away first, so a
    reader sees it whole or not at all."""
    for path in step_checkpoints(run_dir)[:-keep]:
        trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
        try:
            os.replace(path, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
