"""The `tformer` command: train, generate, translate, evaluate, average, import, export.

Each subcommand is a plain function taking typed arguments. This module owns the terminal
(progress bars, tables, streamed text), the seeds and the device; the library only logs.
A TformerError becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tformer import __version__
from tformer.config import load_config
from tformer.decoding.beam import PENALTIES
from tformer.errors import TformerError
from tformer.viz.plot import X_AXES

if TYPE_CHECKING:
    import torch

    from tformer.config import RunConfig

log = logging.getLogger("tformer")


# --- train ------------------------------------------------------------------------------


def train_command(
    config: str | None, out: str, overrides: list[str], *, resume: bool = False
) -> int:
    from tformer.config import config_from_dict
    from tformer.training import checkpoint as ckpt
    from tformer.training.distributed import from_environment

    run_dir = Path(out)
    resume_from = None
    if resume:
        if config is not None:
            raise TformerError(
                "--resume continues RUN_DIR with its own config; pass changes as key=value "
                "overrides, not a config file"
            )
        if not run_dir.is_dir():
            raise TformerError(f"--resume: run directory not found: {run_dir}")
    else:
        if config is None:
            raise TformerError("train needs a CONFIG.toml (or --resume to continue RUN_DIR)")
        cfg = load_config(config, overrides, inherit=ckpt.inherit_model)
    if run_dir.exists() and not run_dir.is_dir():
        raise TformerError(f"--out {run_dir} is a file; a run directory is needed")
    # Under torchrun, rank 0 speaks for all and owns the run directory.
    quiet = not from_environment().is_main
    with nullcontext() if quiet else ckpt.run_lock(run_dir):
        if resume:
            resume_from = ckpt.resume_point(run_dir, tidy=not quiet)
            if resume_from is None:
                raise TformerError(f"--resume: {run_dir} holds no usable checkpoint")
            saved = ckpt.read_config(resume_from)
            cfg = config_from_dict(saved.to_dict(), overrides)
            check_same_shapes(saved, cfg, resume_from)
            ckpt.check_resumable(run_dir, resume_from, cfg)
        else:
            if ckpt.step_checkpoints(run_dir) or os.path.lexists(run_dir / ckpt.BEST):
                raise TformerError(
                    f"{run_dir} already holds a training run; add --resume to continue it, "
                    f"or choose another --out"
                )
            if not quiet:
                ckpt.recover_run_dir(run_dir)
        return _train_and_report(cfg, run_dir, resume_from, quiet)


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


def check_same_shapes(saved: RunConfig, cfg: RunConfig, checkpoint: Path) -> None:
    """A resumed model keeps its weights' shapes: overrides may change how it trains
    (dropout, steps, rates), not what it is."""
    import torch

    from tformer.registry import get_family
    from tformer.training import checkpoint as ckpt

    changed = [
        f"model.{key} {old!r} -> {new!r}"
        for key, (old, new) in _model_changes(saved, cfg).items()
    ]
    if not changed:
        return
    with torch.device("meta"):
        model = get_family(cfg.family).model(cfg.model)
    fits = saved.family == cfg.family
    if fits:
        try:
            ckpt.check_weight_shapes(checkpoint, model)
        except TformerError:
            fits = False
    if not fits:
        raise TformerError(
            f"--resume cannot change the model's shape ({', '.join(changed)}): the checkpoint's "
            f"weights have the saved shapes; start a new run (another --out) to train that model"
        )


def _model_changes(saved: RunConfig, cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    old, new = saved.to_dict()["model"], cfg.to_dict()["model"]
    keys = old.keys() | new.keys()
    return {k: (old.get(k), new.get(k)) for k in sorted(keys) if old.get(k) != new.get(k)}


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


# --- generate ---------------------------------------------------------------------------


def generate_command(
    checkpoint: str,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 1337,
    num_samples: int = 1,
    use_cache: bool = True,
    device: str = "auto",
    int8: bool = False,
    threads: int | None = None,
) -> int:
    import torch

    from tformer.data.corpus import check_utf8
    from tformer.registry import families_with, get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    check_generation_args(max_new_tokens, temperature, top_k, top_p, num_samples)
    check_utf8(prompt, "--prompt")
    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    family = get_family(loaded.cfg.family)
    if family.generate is None:
        hint = "; use `tformer translate`" if family.translate is not None else ""
        raise TformerError(
            f"checkpoint {loaded.path} is a {family.name} model; generate needs a language "
            f"model ({' or '.join(families_with('generate'))}){hint}"
        )
    threads = use_threads(threads, loaded.model, loaded.path)
    description = (
        f"{loaded.cfg.family}, {describe_model(loaded.model)}{', int8' if int8 else ''}; "
        f"{describe_device(loaded.model, threads)}"
    )
    from tformer.kernels.quantize import inference_model

    model, tokenizer = inference_model(loaded.model, int8), loaded.tokenizer
    ids = tokenizer.encode(prompt)
    print(f"generating with {loaded.path} ({description})", file=sys.stderr)
    if not ids:
        if tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id]
        else:
            ids = tokenizer.encode("\n")
    window = family.window(model)
    if window is not None and len(ids) > window:
        print(
            f"note: the prompt is {len(ids)} tokens and the model's context is {window}; "
            f"it reads the last {window}",
            file=sys.stderr,
        )
    generator = torch.Generator(device=dev).manual_seed(seed)
    prompt_ids = torch.tensor([ids], device=dev)
    for sample in range(num_samples):
        if num_samples > 1:
            print(f"--- sample {sample + 1} ---")
        sys.stdout.write(prompt)
        new: list[int] = []
        shown = ""
        for token in family.generate(
            model,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            use_cache=use_cache,
            eos_id=tokenizer.eos_id,
        ):
            new.append(int(token[0]))
            text = tokenizer.decode(new)
            # A byte-level token may end inside a character: wait for the rest of it.
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text
        sys.stdout.write(tokenizer.decode(new)[len(shown) :] + "\n")
        sys.stdout.flush()
    return 0


def use_threads(requested: int | None, model: torch.nn.Module, path: Path) -> int:
    """Set torch's CPU threads for decoding or evaluation (training.device's rule, or
    --threads) and return the count."""
    import torch

    from tformer.training.device import decoding_threads

    threads = decoding_threads(requested)
    torch.set_num_threads(threads)
    return threads


def describe_model(model: torch.nn.Module) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e6:.1f}M parameters" if n >= 1e5 else f"{n:,} parameters"


def describe_device(model: torch.nn.Module, threads: int) -> str:
    device = next(model.parameters()).device
    if device.type != "cpu":
        return str(device)
    return f"cpu, {threads} thread{'s' if threads != 1 else ''}"


def check_generation_args(
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, num_samples: int
) -> None:
    if max_new_tokens < 1:
        raise TformerError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if not temperature >= 0:
        raise TformerError(f"--temperature {temperature} must be 0 (greedy) or more")
    if top_k < 0:
        raise TformerError(f"--top-k {top_k} must be 0 (off) or more")
    if not 0 < top_p <= 1:
        raise TformerError(f"--top-p {top_p} must be in (0, 1]")
    if num_samples < 1:
        raise TformerError(f"--num-samples {num_samples} must be at least 1")


# --- evaluate ---------------------------------------------------------------------------


def evaluate_command(
    checkpoint: str,
    data: list[str],
    *,
    as_json: bool = False,
    batch_size: int = 0,
    device: str = "auto",
    int8: bool = False,
    options: dict[str, Any] | None = None,
    threads: int | None = None,
    ensemble: list[str] | None = None,
) -> int:
    """options: the family's own evaluate options that were given (--mem-len as mem_len);
    ensemble: translation checkpoints to decode together with `checkpoint`."""
    from tqdm import tqdm

    from tformer.registry import get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    options = options or {}
    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    family = get_family(loaded.cfg.family)
    check_evaluate_options(options, family.name, loaded.path)
    join_ensemble(loaded, ensemble, dev)
    threads = use_threads(threads, loaded.model, loaded.path)
    where = f"{describe_model(loaded.model)}{', int8' if int8 else ''}; " + describe_device(
        loaded.model, threads
    )
    from tformer.kernels.quantize import inference_model

    loaded.model = inference_model(loaded.model, int8)
    source = " and ".join(data) if data else "the run's validation split"
    said: list[str] = []

    def say_what_runs() -> None:
        """Once the data has been read (bad data is an error line of its own)."""
        if not said:
            said.append(source)
            print(f"evaluating {loaded.path}{ensemble_note(ensemble)} ({family.name}, {where}) "
                  f"on {source}", file=sys.stderr)

    # A bar on a terminal only; the family says what its evaluate counts (tokens, lines).
    bar = tqdm(unit=family.progress_unit, unit_scale=True, file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())

    def progress(n: int) -> None:
        say_what_runs()
        bar.update(n)

    try:
        result = family.evaluate(loaded, data, options, batch_size=batch_size,
                                 progress=progress)
    finally:
        bar.close()
    check_finite_loss(result, loaded.path)
    say_what_runs()
    print_metrics(result, as_json, first=family.metrics)
    return 0


def check_evaluate_options(options: dict[str, Any], family: str, path: Path) -> None:
    """Refuse options the checkpoint's family does not take, naming those that do."""
    from tformer.registry import FAMILIES, evaluate_options, get_family

    taken = {o.name for o in get_family(family).eval_options}
    unknown = sorted(set(options) - {o.name for o in evaluate_options()})
    if unknown:
        raise TformerError(f"evaluate takes no option {unknown[0]!r}")
    for option in evaluate_options():
        if option.name in options and option.name not in taken:
            takers = [f.name for f in FAMILIES.values()
                      if option.name in {o.name for o in f.eval_options}]
            raise TformerError(
                f"{option.flag} applies to {' and '.join(takers)} checkpoints; {path} is a "
                f"{family} model"
            )


def check_finite_loss(result: dict[str, Any], path: Path) -> None:
    loss = result.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        raise TformerError(
            f"the model in {path} gives non-finite outputs on this data (loss = {loss}); "
            f"its figures would mean nothing"
        )


def print_metrics(
    result: dict[str, Any], as_json: bool, *, first: tuple[str, ...] = ()
) -> None:
    """A table with the keys in `first` at its top, or one strict JSON object: a figure that
    is not a finite number (a perplexity too large for a float) is null, and "non_finite"
    says why."""
    order = [k for k in first if k in result] + [k for k in result if k not in first]
    result = {k: result[k] for k in order}
    if as_json:
        clean: dict[str, Any] = dict(result)
        reasons = {}
        for key, value in result.items():
            if isinstance(value, float) and not math.isfinite(value):
                clean[key] = None
                reasons[key] = "too large for a float (inf)" if value > 0 else str(value)
        if reasons:
            clean["non_finite"] = reasons
        print(json.dumps(clean, allow_nan=False))
        return
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


# --- translate, average ----------------------------------------------------------------


def join_ensemble(loaded: Any, others: list[str] | None, device: Any) -> None:
    """Make `loaded` decode together with the checkpoints `others`, as one ensemble (the
    mean of their next-token distributions, tformer.decoding.ensemble). They must be
    translation models with the same tokenizer; `loaded` gives the run's settings. No
    others: nothing changes."""
    if not others:
        return
    from tformer.decoding.ensemble import Ensemble
    from tformer.registry import get_family
    from tformer.training.checkpoint import load_checkpoint

    if get_family(loaded.cfg.family).translate is None:
        raise TformerError(f"--ensemble needs translation models; {loaded.path} is a "
                           f"{loaded.cfg.family} model")
    members = [loaded.model]
    for path in others:
        other = load_checkpoint(path, device=device, family=loaded.cfg.family)
        if other.tokenizer.to_json() != loaded.tokenizer.to_json():
            raise TformerError(f"--ensemble {path}: its tokenizer is not {loaded.path}'s; the "
                               f"models of an ensemble must share one")
        members.append(other.model)
    loaded.model = Ensemble(members)


def ensemble_note(others: list[str] | None) -> str:
    return f" + {len(others)} more as an ensemble" if others else ""


def translate_command(
    checkpoint: str,
    *,
    input: str | None = None,
    output: str | None = None,
    beam: int = 4,
    alpha: float = 0.6,
    max_len_a: float | None = None,
    max_len_b: int = 10,
    n_best: int = 1,
    early_stopping: bool = False,
    batch_size: int = 32,
    device: str = "auto",
    int8: bool = False,
    threads: int | None = None,
    length_penalty: str = "gnmt",
    ensemble: list[str] | None = None,
) -> int:
    from tqdm import tqdm

    from tformer.data.parallel import read_lines
    from tformer.decoding.translate import check_search_args
    from tformer.registry import families_with, get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    # Everything that can fail on the user's arguments fails before any translating (the
    # default --max-len-a comes from the checkpoint, and is valid).
    check_search_args(beam, alpha, n_best, batch_size,
                      1.0 if max_len_a is None else max_len_a, max_len_b)
    if output is not None:
        check_output_file(output, "-o", input)
    lines: Any = read_lines(input) if input is not None else stdin_lines()
    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    family = get_family(loaded.cfg.family)
    if family.translate is None:
        raise TformerError(
            f"checkpoint {loaded.path} is a {family.name} model; translate needs a "
            f"sequence-to-sequence model ({' or '.join(families_with('translate'))}); use "
            f"`tformer generate` for language models"
        )
    join_ensemble(loaded, ensemble, dev)
    threads = use_threads(threads, loaded.model, loaded.path)
    from tformer.kernels.quantize import inference_model

    loaded.model = inference_model(loaded.model, int8)
    check_search_args(beam, alpha, n_best, batch_size, max_len_a, max_len_b)
    at_terminal = input is None and sys.stdin.isatty()
    print(
        f"translating with {loaded.path}{ensemble_note(ensemble)} "
        f"({describe_model(loaded.model)}; beam {beam}"
        f"{', int8' if int8 else ''}; {describe_device(loaded.model, threads)})"
        + ("; type a line and Enter, Ctrl-D to end" if at_terminal else ""),
        file=sys.stderr,
    )
    # At a terminal each line as it is typed; otherwise a few batches at a time, so output
    # flows while input still arrives and a long file shows its progress.
    chunk = 1 if at_terminal else 4 * batch_size
    # A bar for a file on a terminal; none for stdin (a pipe, or a person typing).
    bar = tqdm(total=len(lines) if input is not None else None, unit="line",
               disable=input is None or not sys.stderr.isatty(), file=sys.stderr)
    out = open(output, "w", encoding="utf-8") if output else sys.stdout
    try:
        index, pending = 0, iter(lines)
        for block in iter(lambda: list(itertools.islice(pending, chunk)), []):
            results = family.translate(
                loaded, block, beam=beam, alpha=alpha, max_len_a=max_len_a,
                max_len_b=max_len_b, n_best=n_best, early_stopping=early_stopping,
                batch_size=batch_size, progress=bar.update, length_penalty=length_penalty,
            )
            for hyps in results:
                for hyp in hyps:
                    # One line per translation, whatever the model produced.
                    text = hyp.text.replace("\n", " ")
                    out.write(f"{index}\t{hyp.score:.4f}\t{text}\n" if n_best > 1
                              else text + "\n")
                index += 1
            out.flush()
    finally:
        bar.close()
        if output:
            out.close()
    return 0


def stdin_lines() -> Iterator[str]:
    """Standard input line by line as it arrives, without line ends; bytes that are not
    UTF-8 are a one-line error naming the line."""
    from tformer.data.corpus import decode_utf8

    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # already text, e.g. a StringIO put there by a caller
        yield from (line.rstrip("\n").removesuffix("\r") for line in sys.stdin)
        return
    for number, raw in enumerate(buffer, 1):
        line = decode_utf8(raw, f"standard input (line {number})")
        yield line.rstrip("\n").removesuffix("\r")


def check_output_file(path: str, option: str, *inputs: str | None) -> None:
    """An output file must be creatable, and not one of the inputs, before work starts."""
    target = Path(path)
    if target.is_dir():
        raise TformerError(f"{option} {path} is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir():
        raise TformerError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise TformerError(f"{option} {path}: not writable")
    for given in inputs:
        if given is not None and Path(given).exists() and target.exists():
            if os.path.samefile(given, target):
                raise TformerError(f"{option} {path} is the input file; it would be overwritten")


def average_command(checkpoints: list[str], out: str, *, last: int = 0) -> int:
    from tformer.training.average import average_checkpoints, checkpoints_to_average
    from tformer.training.checkpoint import is_checkpoint

    if last < 0:
        raise TformerError(f"--last {last} must be at least 1")
    paths = checkpoints_to_average(checkpoints, last)
    dest = Path(out)
    if dest.exists() and not dest.is_dir():
        raise TformerError(f"--out {dest} is a file; the averaged checkpoint is a directory")
    if dest.exists() and not is_checkpoint(dest) and any(dest.iterdir()):
        raise TformerError(f"--out {dest} exists and is not a checkpoint; choose another --out")
    average_checkpoints(paths, dest)
    print(f"averaged {len(paths)} checkpoints into {dest}: " + ", ".join(p.name for p in paths))
    return 0


# --- argument parsing -------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line and exit code 2 (argparse's default code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class CommandParser(Parser):
    """A subcommand's parser: options and file arguments in any order (`translate CKPT
    --int8 input.en -o out`), which plain argparse stops reading at the first option that
    follows a positional. argparse calls parse_known_args for a subcommand; it becomes the
    intermixed parse, which itself calls parse_known_args twice (hence the guard)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


class DefaultsFormatter(argparse.HelpFormatter):
    """--help gives each option's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and not any(default is v for v in (None, False, "", argparse.SUPPRESS))
        ):
            text += f" (default: {default})"
        return text


def build_parser() -> argparse.ArgumentParser:
    from tformer.registry import evaluate_options

    parser = Parser(prog="tformer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tformer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for_help = {"formatter_class": DefaultsFormatter}

    p = sub.add_parser("train", **for_help, help="train a model from a TOML config")
    p.add_argument("config", nargs="?", help="CONFIG.toml (omit with --resume)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. train.lr=3e-4 model.n_layer=6",
    )
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument(
        "--resume", action="store_true", help="continue RUN_DIR from its last checkpoint"
    )

    p = sub.add_parser("generate", **for_help, help="sample text from a language model")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument("--prompt", default="", help="text to continue (default: none)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to add")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest; 0 is off")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens of this total probability; 1 is off")
    p.add_argument("--seed", type=int, default=1337, help="random seed of the sampling")
    p.add_argument("--num-samples", type=int, default=1, help="samples from the same prompt")
    p.add_argument("--no-cache", action="store_true", help="recompute every step (slow)")
    p.add_argument("--int8", action="store_true", help="int8 weights (CPU): faster, ~same text")
    add_device_options(p)

    p = sub.add_parser("evaluate", **for_help, help="loss, perplexity and bits per character")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument(
        "data", nargs="*",
        help="LM: a text file or folder; seq2seq: SRC REF (default: the run's validation split)",
    )
    p.add_argument("--int8", action="store_true", help="int8 weights (CPU), to see their cost")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--batch-size", type=int, default=0,
                   help="sequences at once (default: the run's; seq2seq: 32 sentences)")
    add_ensemble_option(p)
    add_device_options(p)
    for option in evaluate_options():  # the families' own options
        p.add_argument(option.flag, dest=option.name, type=option.type, default=None,
                       choices=option.choices, help=option.help)

    p = sub.add_parser("translate", **for_help, help="translate lines with a seq2seq model")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument("input", nargs="?", help="a file of lines (default: stdin)")
    p.add_argument("-o", "--output", help="write here (default: stdout)")
    p.add_argument("--beam", type=int, default=4, help="beam size; 1 is greedy search")
    p.add_argument("--alpha", type=float, default=0.6,
                   help="GNMT length penalty ((5 + length) / 6) ** alpha; 0 is off")
    p.add_argument("--length-penalty", choices=PENALTIES, default="gnmt",
                   help="hf: length ** alpha and Hugging Face's stopping rule, to reproduce "
                   "MarianMTModel.generate (with --alpha 1.0)")
    p.add_argument("--max-len-a", type=float, default=None,
                   help="at most a * source tokens + b output tokens (default a: the "
                   "training data's data.max_ratio)")
    p.add_argument("--max-len-b", type=int, default=10, help="see --max-len-a")
    p.add_argument("--n-best", type=int, default=1,
                   help="write the N best as 'line<TAB>score<TAB>text'")
    p.add_argument("--early-stopping", action="store_true",
                   help="end a sentence once it has --beam finished hypotheses (faster)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences decoded at once")
    p.add_argument("--int8", action="store_true", help="int8 weights (CPU): faster, ~same text")
    add_ensemble_option(p)
    add_device_options(p)

    p = sub.add_parser("serve", **for_help,
                       help="serve a model over HTTP (OpenAI-style completions, "
                       "translations)")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--int8", action="store_true", help="int8 weights (CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--name", default=None, help="the model's name in the API (default: the run)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="sequences queued; past it requests get 503")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--batch-window-ms", type=float, default=10.0,
                   help="translations arriving this close together share a batch")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template FILE")

    p = sub.add_parser("average", **for_help, help="average the weights of several checkpoints")
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories, or one run with --last")
    p.add_argument("--last", type=int, default=0,
                   help="the run's newest N step checkpoints (0: the CHECKPOINTS given)")
    p.add_argument("--out", required=True, help="the averaged checkpoint's directory")

    p = sub.add_parser("plot", **for_help, help="plot the loss, learning rate and speed of runs")
    p.add_argument("runs", nargs="+", help="run directories (each with its metrics.csv)")
    p.add_argument("-o", "--output", required=True, help="FILE.png (or .pdf, .svg)")
    p.add_argument("--x", choices=tuple(X_AXES), default="step",
                   help="horizontal axis: the step, or hours since the run started")

    p = sub.add_parser("info", **for_help,
                       help="a checkpoint's config, parameters, FLOPs and memory")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")

    p = sub.add_parser("attention", **for_help,
                       help="draw attention maps (layers x heads) for one text")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="language models: the text to read")
    text.add_argument("--source", help="translation: the sentence to translate")
    p.add_argument("-o", "--output", required=True, help="FILE.png (or .pdf, .svg)")

    p = sub.add_parser("import", **for_help,
                       help="a local Hugging Face model directory -> a checkpoint")
    p.add_argument("source", help="directory with config.json and the weights (GPT-2, Marian)")
    p.add_argument("--out", required=True, help="the new checkpoint's directory")

    p = sub.add_parser("export", **for_help, help="a checkpoint -> a Hugging Face model directory")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument("--out", required=True, help="the new model directory")
    p.add_argument("--format", default="gpt2", help="gpt2 (GPT2LMHeadModel)")
    return parser


def add_ensemble_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ensemble", action="append", metavar="CHECKPOINT", default=None,
                   help="translation: decode with this checkpoint too, the mean of the models' "
                   "distributions (repeat for more)")


def add_device_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA if present) | cpu | cuda:N")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the decoding rule, see README)")


def split_train_args(args: argparse.Namespace, extra: list[str]) -> tuple[str | None, list[str]]:
    """Config path and overrides, wherever they stood among the options: argparse leaves
    overrides after `--out R` in `extra`, and takes the first override for the config when
    there is none (`tformer train --resume --out R train.steps=9`)."""
    config, overrides = args.config, list(args.overrides) + extra
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None
    return config, overrides


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.command == "train":
        config, overrides = split_train_args(args, extra)
        return train_command(config, args.out, overrides, resume=args.resume)
    if args.command == "generate":
        return generate_command(
            args.checkpoint,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=0.0 if args.greedy else args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            num_samples=args.num_samples,
            use_cache=not args.no_cache,
            device=args.device,
            int8=args.int8,
            threads=args.threads,
        )
    if args.command == "evaluate":
        from tformer.registry import evaluate_options

        return evaluate_command(
            args.checkpoint,
            args.data,
            as_json=args.json,
            batch_size=args.batch_size,
            device=args.device,
            int8=args.int8,
            options={
                o.name: getattr(args, o.name)
                for o in evaluate_options()
                if getattr(args, o.name) is not None
            },
            threads=args.threads,
            ensemble=args.ensemble,
        )
    if args.command == "translate":
        return translate_command(
            args.checkpoint, input=args.input, output=args.output, beam=args.beam,
            alpha=args.alpha, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
            n_best=args.n_best, early_stopping=args.early_stopping,
            batch_size=args.batch_size, device=args.device, int8=args.int8,
            threads=args.threads,
            length_penalty=args.length_penalty,
            ensemble=args.ensemble,
        )
    if args.command == "serve":
        from tformer.serving.command import serve_command

        return serve_command(
            args.checkpoint, host=args.host, port=args.port, api_key=args.api_key,
            int8=args.int8, device=args.device, name=args.name, max_batch=args.max_batch,
            max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
            batch_window_ms=args.batch_window_ms, chat_template=args.chat_template,
        )
    if args.command == "average":
        return average_command(args.checkpoints, args.out, last=args.last)
    if args.command == "plot":
        from tformer.viz.command import plot_command

        return plot_command(args.runs, args.output, args.x)
    if args.command == "info":
        from tformer.viz.command import info_command

        return info_command(args.checkpoint, as_json=args.json)
    if args.command == "attention":
        from tformer.viz.command import attention_command

        return attention_command(args.checkpoint, args.output, text=args.text,
                                 source=args.source)
    if args.command in ("import", "export"):
        from tformer.interop import command

        if args.command == "import":
            return command.import_command(args.source, args.out)
        return command.export_command(args.checkpoint, args.out, format=args.format)
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before training's own handler is in place
        print("tformer: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # usage errors (code 2), --help and --version (code 0)
        return e.code if isinstance(e.code, int) else 0
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s: %(message)s",
    )
    try:
        return run(args, extra)
    except TformerError as e:
        print(f"tformer: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
