"""Getting a run directory ready to train: a new run from its config, or `--resume` from the
run's newest good checkpoint, with the run's lock held throughout.

What `tformer train` and `tformer train --resume` promise, decided here before any step:
- a new run never writes into a directory that already holds one;
- `--resume` continues the newest step checkpoint that is whole and agrees with itself (its
  manifest, its config, its weights' shapes, its trainer state); a damaged one is skipped
  with a warning naming it and why, and the next older one is tried;
- a run stopped before its first checkpoint (preempted in its first minutes) starts again
  from step 0 under `--resume`, from the resolved config it wrote, with one warning;
- `train CONFIG --resume` is the one command a requeued job runs again and again: it
  continues the run where there is a checkpoint to continue (CONFIG must agree with the
  run's own config), and otherwise starts CONFIG afresh, discarding what an interrupted
  start left (its config, metrics, a best/ with no step checkpoint beside it);
- overrides may change how a resumed run trains, never the shapes of what it trains.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tformer.config import RunConfig, config_from_dict, load_config, tomllib
from tformer.errors import TformerError
from tformer.loading import (
    BEST,
    CHECKPOINTS,
    CONFIG,
    TRAINER_STATE,
    check_weight_shapes,
    is_checkpoint,
    read_config,
    step_checkpoints,
    verify_checkpoint,
)
from tformer.registry import get_family
from tformer.training import checkpoint as ckpt
from tformer.training.metrics import METRICS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRun:
    cfg: RunConfig
    run_dir: Path
    resume_from: Path | None
    """The checkpoint to continue; None for a run that starts at step 0."""


@contextmanager
def prepare_run(
    config: str | None,
    run_dir: str | Path,
    overrides: list[str],
    *,
    resume: bool = False,
    is_main: bool = True,
) -> Iterator[PreparedRun]:
    """Hold the run's lock (the main process of a distributed run holds it for all) and
    yield what to train: `config` with `overrides` for a new run, or the run's own config
    with `overrides` where `resume` continues it. Errors are TformerErrors saying what to do.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TformerError(f"--out {run_dir} is a file; a run directory is needed")
    if resume and is_checkpoint(run_dir):
        raise TformerError(not_a_run(run_dir))
    if config is None and not resume:
        raise TformerError("train needs a CONFIG.toml (or --resume to continue RUN_DIR)")
    if config is None and not run_dir.is_dir():
        raise TformerError(f"--resume: run directory not found: {run_dir}")
    cfg = None if config is None else load_config(config, overrides, inherit=ckpt.inherit_model)
    with ckpt.run_lock(run_dir) if is_main else nullcontext():
        if is_main:
            if not resume and (step_checkpoints(run_dir) or os.path.lexists(run_dir / BEST)):
                raise TformerError(
                    f"{run_dir} already holds a training run; add --resume to continue it, "
                    f"or choose another --out"
                )
            ckpt.recover_run_dir(run_dir)
        if cfg is not None and not resume:
            yield PreparedRun(cfg, run_dir, None)
            return
        resume_from = resume_point(run_dir)
        if resume_from is None and step_checkpoints(run_dir):
            raise TformerError(
                f"--resume: none of the checkpoints in {run_dir / CHECKPOINTS} can be "
                f"continued (each is named above with why); nothing was changed"
            )
        if resume_from is None and cfg is not None:
            if is_main:
                discard_interrupted_start(run_dir)
            yield PreparedRun(cfg, run_dir, None)
            return
        if resume_from is None:
            yield PreparedRun(restart_config(run_dir, overrides), run_dir, None)
            return
        saved = read_config(resume_from)
        resumed = config_from_dict(saved.to_dict(), overrides)
        if cfg is not None:
            check_config_agrees(Path(config), cfg, resumed, resume_from)
        check_same_model(saved, resumed, resume_from, run_dir)
        yield PreparedRun(resumed, run_dir, resume_from)


def not_a_run(path: Path) -> str:
    """Why `--resume --out PATH` refuses a checkpoint directory (a shipped model, best/)."""
    held = ("" if (path / TRAINER_STATE).is_file()
            else f" holding no {TRAINER_STATE} (the optimizer and data state training needs)")
    return (f"--resume continues a run directory; {path} is a checkpoint{held}: to train on "
            f"from its weights, start a new run with train.init_from={path}")


def discard_interrupted_start(run_dir: Path) -> None:
    """What a start stopped before its first step checkpoint leaves behind (the resolved
    config, metrics, TensorBoard events, a best/ of its first evaluation), removed so that
    the run starts afresh as if it never had; anything else in the directory stays."""
    left = [run_dir / name for name in (CONFIG, METRICS, "tensorboard", CHECKPOINTS)]
    left += [p for p in run_dir.iterdir()
             if p.name == BEST or p.name.startswith((f".{BEST}-", f".{CONFIG}.", f".{METRICS}."))]
    found = [p for p in left if os.path.lexists(p)]
    if found:
        log.warning("%s holds no checkpoint to continue: starting the run from its config, "
                    "discarding %s", run_dir, ", ".join(sorted(p.name for p in found)))
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def check_config_agrees(config: Path, cfg: RunConfig, resumed: RunConfig,
                        checkpoint: Path) -> None:
    """`train CONFIG --resume` continues the run only if each key CONFIG sets has the value
    the run trains with (overrides count on both sides): a changed CONFIG is a new run."""
    text = config.read_text(encoding="utf-8")
    raw = json.loads(text) if config.suffix == ".json" else tomllib.loads(text)
    given, have = cfg.to_dict(), resumed.to_dict()
    differ = [f"{key} = {mine!r} (the run: {theirs!r})"
              for key in sorted(dotted_keys(raw))
              if (mine := lookup(given, key)) != (theirs := lookup(have, key))]
    if differ:
        raise TformerError(
            f"--resume: {config} contradicts the config {checkpoint} was trained with: "
            f"{', '.join(differ)}; change how it trains with key=value overrides, or start "
            f"that config in another --out"
        )


def dotted_keys(tables: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in tables.items():
        if isinstance(value, dict):
            keys += dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def lookup(tables: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tables = tables.get(part) if isinstance(tables, dict) else None
    return tables


def resume_point(run_dir: Path) -> Path | None:
    """The newest step checkpoint that can be continued (damaged ones are skipped, each
    with a warning saying why); None if there is none."""
    for path in reversed(step_checkpoints(run_dir)):
        try:
            check_resumable(path)
            return path
        except TformerError as e:
            log.warning("skipping checkpoint %s: %s", path.name, e)
    return None


def check_resumable(path: Path) -> None:
    """A checkpoint continues a run only if it is whole (its manifest), its weights fit its
    own config, and its trainer state loads."""
    verify_checkpoint(path)
    saved = read_config(path)
    check_weight_shapes(path, shapes_only(saved))
    if not (path / TRAINER_STATE).is_file():
        raise TformerError(f"checkpoint {path} has no {TRAINER_STATE} to resume from")
    try:  # mmap: a check that the state loads, without reading it all
        torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise TformerError(f"checkpoint file {path / TRAINER_STATE} does not load: {e}") from None


def restart_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The config of a run that was stopped before it wrote any checkpoint: the resolved
    config it saved at its start, so `--resume` starts it again from step 0."""
    if not (run_dir / CONFIG).is_file():
        raise TformerError(
            f"--resume: {run_dir} holds no usable checkpoint; to start its run, or continue "
            f"it whichever it needs, give its config too: tformer train CONFIG --out "
            f"{run_dir} --resume"
        )
    saved = read_config(run_dir)
    log.warning("%s holds no usable checkpoint yet: starting its run again from step 0",
                run_dir)
    return config_from_dict(saved.to_dict(), overrides)


def check_same_model(saved: RunConfig, cfg: RunConfig, checkpoint: Path, run_dir: Path) -> None:
    """A resumed model keeps its weights' shapes: overrides may change how it trains
    (dropout, steps, rates), not what it is; and the checkpoint must be one of this run's
    (the run's config.json names the same family and shapes)."""
    run_config = run_dir / CONFIG
    if run_config.is_file():
        run_cfg = read_config(run_dir)
        if run_cfg.family != saved.family:
            raise TformerError(
                f"--resume: {checkpoint} is a {saved.family} checkpoint but {run_dir} trains a "
                f"{run_cfg.family} model ({run_config}); it is not this run's checkpoint. "
                f"Nothing was changed; move it out of the run and resume again"
            )
        if model_changes(saved, run_cfg):
            try:
                check_weight_shapes(checkpoint, shapes_only(run_cfg))
            except TformerError as e:
                raise TformerError(
                    f"--resume: {checkpoint} does not fit the run's config {run_config} ({e}); "
                    f"nothing was changed"
                ) from None
    changed = [f"model.{key} {old!r} -> {new!r}"
               for key, (old, new) in model_changes(saved, cfg).items()]
    if not changed:
        return
    try:
        check_weight_shapes(checkpoint, shapes_only(cfg))
    except TformerError:
        raise TformerError(
            f"--resume cannot change the model's shape ({', '.join(changed)}): the checkpoint's "
            f"weights have the saved shapes; start a new run (another --out) to train that model"
        ) from None


def model_changes(old: RunConfig, new: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The [model] keys whose values differ, as key -> (old, new)."""
    a, b = old.to_dict()["model"], new.to_dict()["model"]
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def shapes_only(cfg: RunConfig) -> torch.nn.Module:
    """The config's model on the meta device: its tensors' shapes, no memory."""
    with torch.device("meta"):
        return get_family(cfg.family).model(cfg.model)
