"""`tformer train CONFIG --out RUN`, `tformer train --resume --out RUN`, and the one line a
requeued job runs, `tformer train CONFIG --out RUN --resume` (start or continue, whichever
RUN needs): the run is prepared by tformer.training.run (config or resume point, the lock),
trained by tformer.training.trainer; this module shows its progress."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from tformer.arguments import Help

if TYPE_CHECKING:
    from tformer.config import RunConfig


def train(
    config: Annotated[str | None, Help("CONFIG.toml (optional with --resume: with it, a run "
                                       "with nothing to continue starts from it)",
                                       nargs="?")] = None,
    overrides: Annotated[
        list[str] | None,
        Help("config overrides, e.g. train.lr=3e-4 model.n_layer=6", nargs="*",
             metavar="key=value"),
    ] = None,
    *,
    out: Annotated[str, Help("run directory")],
    resume: Annotated[bool, Help("continue RUN_DIR from its newest usable checkpoint; with "
                                 "CONFIG, start it when it has none (also --resume auto)")
                      ] = False,
) -> int:
    from tformer.training.distributed import from_environment
    from tformer.training.run import prepare_run

    overrides = list(overrides or [])
    # `--resume auto` (litgpt's spelling) is --resume: the word lands among the positionals.
    if resume and "auto" in [config, *overrides] and not Path("auto").exists():
        words = [w for w in [config, *overrides] if w is not None and w != "auto"]
        config, overrides = (words[0], words[1:]) if words else (None, [])
    # `train --resume --out R train.steps=9`: the first override lands where the config goes.
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]
    # Under torchrun, rank 0 speaks for all and owns the run directory.
    is_main = from_environment().is_main
    with prepare_run(config, out, overrides, resume=resume, is_main=is_main) as run:
        return _train_and_report(run.cfg, run.run_dir, run.resume_from, not is_main)


def _train_and_report(cfg: RunConfig, run_dir: Path, resume_from: Path | None, quiet: bool) -> int:
    from tqdm import tqdm

    from tformer.training.trainer import train

    bars: list[Any] = []  # made after the summary, so that the summary comes first
    shown: dict[str, str] = {}
    first_step: dict[str, float] = {}

    def progress(info: dict[str, Any]) -> None:
        if "start" in info:
            for line in training_summary(cfg, info["start"], run_dir, info["step"]):
                print(line, file=sys.stderr)
        if not bars:
            # On resume the bar and its clock go on from where the run stopped.
            bars.append(tqdm(total=cfg.train.steps, initial=info["step"], unit="step",
                             dynamic_ncols=True, leave=True, disable=quiet))
            if resume_from is not None:
                bars[0].start_t -= previous_elapsed(run_dir)
            first_step.update(step=info["step"], t=time.perf_counter())
        bar = bars[0]
        bar.update(info["step"] - bar.n)
        if "loss" in info:
            shown.update(
                train_loss=f"{info['loss']:.4f}",
                lr=f"{info['lr']:.2e}",
                tok_s=f"{info['tokens_per_s']:,.0f}",
            )
            if "estimated" not in first_step and info["step"] < cfg.train.steps:
                done = info["step"] - first_step["step"]
                per_step = (time.perf_counter() - first_step["t"]) / max(done, 1)
                left = per_step * (cfg.train.steps - info["step"])
                bar.write(f"  time    about {format_seconds(left)} more for "
                          f"{cfg.train.steps - info['step']:,} steps (at {per_step:.2f} s a "
                          f"step over the first {done}; evaluations and checkpoints add to it)",
                          file=sys.stderr)
                first_step["estimated"] = 1
        if "val" in info:
            shown["val_loss"] = f"{info['val']['loss']:.4f}"
        bar.set_postfix(shown, refresh=True)

    try:
        result = train(cfg, run_dir, resume_from=resume_from, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    # A run stopped by a signal exits as shells expect of one (130 for Ctrl-C, 143 for
    # SIGTERM), after its checkpoint is saved.
    code = 128 + result.stop_signal if result.stop_signal else 0
    if quiet:
        return code
    status = "stopped early" if result.interrupted or result.stopped_early else "done"
    if result.stop_signal:
        status = f"stopped by {signal.Signals(result.stop_signal).name}"
    best = f"{result.best_val:.4f}" if result.best_val is not None else "-"
    print(f"{status} at step {result.step}: best validation {cfg.train.best_metric} {best}; "
          f"run in {run_dir}")
    if result.interrupted:
        print(f"checkpoint saved; continue with: tformer train --resume --out {run_dir}")
    if result.skipped_steps:
        print(f"{result.skipped_steps} steps were skipped for non-finite loss or gradients")
    return code


def training_summary(cfg: RunConfig, start: dict[str, Any], run_dir: Path, step: int) -> list[str]:
    """One screen on what is about to train, before the first step."""
    n = start["parameters"]
    threads = start["threads"]
    where = start["device"] + (
        f", {threads} thread{'s' if threads != 1 else ''}" if start["device"] == "cpu" else ""
    )
    if start["processes"] > 1:
        where += f", {start['processes']} processes"
    t = cfg.train
    lines = [
        f"training {cfg.family} into {run_dir}" + (f", resumed at step {step}" if step else ""),
        f"  model   {n / 1e6:.2f}M parameters, vocabulary {start['vocabulary']:,}",
        f"  device  {where}",
    ]
    if t.lora is not None:
        targets = t.lora.targets if t.lora.targets == "all" else ", ".join(t.lora.targets)
        lines.append(f"  lora    {start['trainable']:,} of {n:,} parameters train "
                     f"({100 * start['trainable'] / n:.2f}%): r {t.lora.r}, alpha "
                     f"{t.lora.alpha:g}, targets {targets}"
                     + (", the blocks' frozen weights in int8" if t.lora.int8 else ""))
    if "data" in start:
        lines.append(f"  data    {start['data']}")
    lines.append(
        f"  steps   {t.steps:,} ({t.schedule} schedule, lr {t.lr:g}), evaluating every "
        f"{t.eval_every:,}, checkpoint every {t.checkpoint_every:,}"
    )
    if "loss" in start:
        lines.append(f"  loss    {start['loss']}")
    lines.append("  time    estimated after the first logged steps; metrics in metrics.csv")
    return lines


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def previous_elapsed(run_dir: Path) -> float:
    """The training time a run's metrics.csv has recorded (its last elapsed_s), 0 if none."""
    import csv

    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            times = [row.get("elapsed_s") for row in csv.DictReader(f)]
        return max((float(t) for t in times if t), default=0.0)
    except (OSError, ValueError, csv.Error):
        return 0.0
