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
      best -> .best-<version>  the checkpoint with the lowest validation loss so far
      .lock                  held (flock) by the one process that writes the run

A checkpoint is written into a temporary sibling directory, every file fsynced, and then
renamed into place, so a crash at any moment leaves either the old checkpoint or the new
one, never half of one. The manifest catches a checkpoint damaged later (truncated, bytes
flipped, a file deleted).

Readers may load a run while it trains. A checkpoint directory never changes once it is in
place; best/ is a symbolic link switched atomically to a new directory, and pruned step
checkpoints are renamed away before they are deleted. A reader resolves the link once, and
retries when what it resolved disappears under it, so it sees the old best or the new one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from tformer.config import RunConfig, config_from_dict
from tformer.data.tokenizers import Tokenizer, load_tokenizer, save_tokenizer
from tformer.errors import TformerError, shown
from tformer.registry import get_family

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
BEST = "best"
LOCK = ".lock"
STEP_DIR = re.compile(r"^step-(\d+)$")
READ_ATTEMPTS = 5
"""How often a reader tries again when a checkpoint is switched or pruned under it."""


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
) -> Path:
    """Write a checkpoint directory at `dest`, replacing any existing one atomically.

    A full disk, a read-only disk or a file size limit is a TformerError naming the path and
    the cause; the temporary directory is removed and the earlier checkpoints are untouched.
    `best` (replaced again and again while readers may load it) is published as a link to a
    new directory, switched in one rename.
    """
    dest = Path(dest)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_checkpoint_files(tmp, cfg, model, tokenizer, trainer_state)
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
) -> None:
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


def verify_checkpoint(path: Path) -> None:
    """Raise TformerError naming the damaged file if the checkpoint is not as written."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TformerError(f"checkpoint {path} is incomplete: {MANIFEST} is missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise TformerError(f"checkpoint file {manifest_path} is damaged: {e}") from None
    if not _manifest_is_well_formed(manifest):
        raise TformerError(
            f"checkpoint file {manifest_path} is damaged: expected an object mapping file "
            f'names to {{"bytes": integer, "sha256": string}}'
        )
    for name in (CONFIG, WEIGHTS, TOKENIZER):
        if name not in manifest:
            raise TformerError(f"checkpoint {path} is incomplete: {name} is not in its manifest")
    for name, expected in manifest.items():
        file = path / name
        try:
            size = file.stat().st_size
            if not file.is_file():
                raise FileNotFoundError
            if size != expected["bytes"]:
                raise TformerError(
                    f"checkpoint file {file} is damaged: {size} bytes, "
                    f"{expected['bytes']} expected (truncated?)"
                )
            if _sha256(file) != expected["sha256"]:
                raise TformerError(
                    f"checkpoint file {file} is damaged: its checksum does not match"
                )
        except FileNotFoundError:
            raise TformerError(f"checkpoint file {file} is missing") from None
        except OSError as e:
            raise TformerError(f"cannot read checkpoint file {file}: {e.strerror}") from None


def _manifest_is_well_formed(manifest: Any) -> bool:
    if not isinstance(manifest, dict):
        return False
    for name, entry in manifest.items():
        if "/" in name or name in ("", ".", "..") or not isinstance(entry, dict):
            return False
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or not isinstance(digest, str):
            return False
    return True


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
    """The newest step checkpoint that verifies; damaged ones are skipped with a warning
    (one pruned while we looked is skipped quietly)."""
    for path in reversed(step_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except TformerError as e:
            if path.exists():
                log.warning("skipping damaged checkpoint: %s", e)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """CKPT as the CLI takes it: a checkpoint directory, or a run directory (its best
    checkpoint if it has a good one, else its newest good step checkpoint). Links are
    resolved, so that what is read is one directory even if best/ switches meanwhile."""
    path = Path(path)
    if not path.exists():
        raise TformerError(f"checkpoint or run directory not found: {path}")
    if not path.is_dir():
        raise TformerError(f"{path} is not a directory (expected a run or checkpoint directory)")
    if is_checkpoint(path):
        return path.resolve() if path.is_symlink() else path
    best = path / BEST
    for _ in range(READ_ATTEMPTS):
        if not best.is_dir():
            break
        target = best.resolve()
        try:
            verify_checkpoint(target)
            return target
        except TformerError as e:
            if best.resolve() != target or not target.exists():
                continue  # training switched best/ while we read it
            log.warning("best checkpoint unusable, using the latest: %s", e)
            break
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
    file = Path(path) / CONFIG
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TformerError(f"checkpoint file {file} is missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise TformerError(f"checkpoint file {file} is damaged: {e}") from None
    if not isinstance(raw, dict):
        raise TformerError(f"checkpoint file {file} is damaged: it is not a JSON object")
    raw.pop("tokenizer", None)
    return config_from_dict(raw)


def load_checkpoint(
    path: str | Path, *, device: torch.device | str = "cpu", family: str | None = None
) -> Checkpoint:
    """Load a checkpoint (or a run's best/latest) as a model in eval mode.

    family: the family the caller needs; another one is a clear error, not a shape mismatch.
    A checkpoint that training switched or pruned while it was read is looked up again.
    """
    for attempt in range(READ_ATTEMPTS):
        resolved = resolve_checkpoint(path)
        try:
            return _load(resolved, device, family)
        except (TformerError, OSError, RuntimeError):
            moved = not resolved.exists() or _points_to(Path(path)) not in (resolved, None)
            if not moved or attempt == READ_ATTEMPTS - 1:
                raise
        time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def _points_to(path: Path) -> Path | None:
    """Where `path` leads now, cheaply (no verification): itself or its link's target for
    a checkpoint, best/'s target for a run; None when that is not known."""
    if is_checkpoint(path):
        return path.resolve() if path.is_symlink() else path
    if (path / BEST).is_symlink():
        return (path / BEST).resolve()
    return None


def _load(path: Path, device: torch.device | str, family: str | None) -> Checkpoint:
    verify_checkpoint(path)
    cfg = read_config(path)
    if family is not None and cfg.family != family:
        raise TformerError(
            f"checkpoint {path} is a {cfg.family} model; this command needs a {family} model"
        )
    tokenizer = load_tokenizer(path / TOKENIZER)
    model = get_family(cfg.family).model(cfg.model)
    check_weight_shapes(path, model)
    try:
        load_model(model, str(path / WEIGHTS), device=str(device))
    except (RuntimeError, SafetensorError, OSError) as e:
        raise TformerError(f"checkpoint file {path / WEIGHTS} does not load: {e}") from None
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise TformerError(
                f"checkpoint {path} holds non-finite weights ({name} has NaN or inf); "
                f"its outputs would not be finite"
            )
    model.to(device).eval()
    return Checkpoint(path, cfg, model, tokenizer)


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors in a checkpoint's model.safetensors by name, read from its header."""
    file = Path(path) / WEIGHTS
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise TformerError(f"checkpoint file {file} is damaged: {e}") from None


def check_weight_shapes(path: Path, model: nn.Module) -> None:
    """Every stored tensor must be one the model has, with its shape, and every tensor of
    the model must be stored (tied weights once, under any of their names)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    stored = weight_shapes(path)
    for name, shape in stored.items():
        if name not in expected:
            raise TformerError(
                f"checkpoint file {Path(path) / WEIGHTS} holds a tensor {shown(name)} that "
                f"its config's model does not have"
            )
        if shape != expected[name]:
            raise TformerError(
                f"checkpoint file {Path(path) / WEIGHTS}: {name} has shape {list(shape)}, "
                f"its config says {list(expected[name])}"
            )
    for names in shared_groups(model):
        if not names & stored.keys():
            raise TformerError(
                f"checkpoint file {Path(path) / WEIGHTS} lacks {shown(min(names))}, a tensor "
                f"of its config's model"
            )


def shared_groups(model: nn.Module) -> list[set[str]]:
    """The model's state-dict names, grouped by the tensor they name (tied weights)."""
    groups: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), set()).add(name)
    return list(groups.values())


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


def resume_point(run_dir: Path, *, tidy: bool = True) -> Path | None:
    """The checkpoint `--resume` continues from: the newest step checkpoint that verifies
    and whose trainer state loads, after tidying up what a killed process may have left."""
    if tidy:
        recover_run_dir(run_dir)
    for path in reversed(step_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            if not (path / TRAINER_STATE).is_file():
                raise TformerError(f"checkpoint {path} has no {TRAINER_STATE} to resume from")
            try:  # mmap: a check that the state loads, without reading it all
                torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise TformerError(
                    f"checkpoint file {path / TRAINER_STATE} does not load: {e}"
                ) from None
            return path
        except TformerError as e:
            log.warning("skipping checkpoint: %s", e)
    return None


def check_resumable(run_dir: Path, checkpoint: Path, cfg: RunConfig) -> None:
    """Refuse to resume `run_dir` from a checkpoint its own config contradicts (another
    family, other tensor shapes), before anything in the run is written."""
    run_config = Path(run_dir) / CONFIG
    if run_config.is_file():
        run_cfg = read_config(run_dir)
        if run_cfg.family != cfg.family:
            raise TformerError(
                f"--resume: {checkpoint} is a {cfg.family} checkpoint but {run_dir} trains a "
                f"{run_cfg.family} model ({run_config}); it is not this run's checkpoint. "
                f"Nothing was changed; move it out of the run and resume again"
            )
        with torch.device("meta"):  # shapes only, no memory
            model = get_family(run_cfg.family).model(run_cfg.model)
        try:
            check_weight_shapes(checkpoint, model)
        except TformerError as e:
            raise TformerError(
                f"--resume: {checkpoint} does not fit the run's config {run_config} ({e}); "
                f"nothing was changed"
            ) from None


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
