"""The `tformer` command: train, generate, translate, evaluate, average.

Each subcommand is a plain function taking typed arguments. This module owns the terminal
(progress bars, tables, streamed text), the seeds and the device; the library only logs.
A TformerError becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tformer import __version__
from tformer.config import load_config
from tformer.errors import TformerError

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
        cfg = load_config(config, overrides)
    # Under torchrun, rank 0 speaks for all and owns the run directory.
    quiet = not from_environment().is_main
    with nullcontext() if quiet else ckpt.run_lock(run_dir):
        if resume:
            resume_from = ckpt.resume_point(run_dir, tidy=not quiet)
            if resume_from is None:
                raise TformerError(f"--resume: {run_dir} holds no usable checkpoint")
            cfg = config_from_dict(ckpt.read_config(resume_from).to_dict(), overrides)
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

    bar = tqdm(total=cfg.train.steps, unit="step", dynamic_ncols=True, leave=True, disable=quiet)
    shown: dict[str, str] = {}

    def progress(info: dict[str, Any]) -> None:
        bar.update(info["step"] - bar.n)
        if "loss" in info:
            shown.update(
                loss=f"{info['loss']:.4f}",
                lr=f"{info['lr']:.2e}",
                tok_s=f"{info['tokens_per_s']:,.0f}",
            )
        if "val" in info:
            shown["val"] = f"{info['val']['loss']:.4f}"
        bar.set_postfix(shown, refresh=True)

    try:
        result = train(cfg, run_dir, resume_from=resume_from, progress=progress)
    finally:
        bar.close()
    # A run stopped by a signal exits as shells expect of one (130 for Ctrl-C, 143 for
    # SIGTERM), after its checkpoint is saved.
    code = 128 + result.stop_signal if result.stop_signal else 0
    if quiet:
        return code
    status = "stopped early" if result.interrupted else "done"
    if result.stop_signal:
        status = f"stopped by {signal.Signals(result.stop_signal).name}"
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "-"
    print(f"{status} at step {result.step}: best validation loss {best}; run in {run_dir}")
    if result.interrupted:
        print(f"checkpoint saved; continue with: tformer train --resume --out {run_dir}")
    if result.skipped_steps:
        print(f"{result.skipped_steps} steps were skipped for non-finite loss or gradients")
    return code


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
    model, tokenizer = inference_model(loaded.model, int8), loaded.tokenizer
    ids = tokenizer.encode(prompt)
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


def inference_model(model: torch.nn.Module, int8: bool) -> torch.nn.Module:
    """The model as decoding runs it: int8 weights if asked, else (fp32 on the CPU) linear
    layers with weights prepacked for the small matmuls of decoding."""
    if int8:
        from tformer.kernels.quantize import quantize_int8

        return quantize_int8(model)
    from tformer.kernels.prepack import prepack

    return prepack(model)


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
) -> int:
    """options: the family's own evaluate options that were given (--mem-len as mem_len)."""
    from tqdm import tqdm

    from tformer.registry import get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    options = options or {}
    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    family = get_family(loaded.cfg.family)
    check_evaluate_options(options, family.name, loaded.path)
    loaded.model = inference_model(loaded.model, int8)
    bar = tqdm(unit="item", file=sys.stderr, leave=False, disable=None)
    try:
        result = family.evaluate(loaded, data, options, batch_size=batch_size,
                                 progress=bar.update)
    finally:
        bar.close()
    check_finite_loss(result, loaded.path)
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
) -> int:
    from tqdm import tqdm

    from tformer.data.parallel import read_lines
    from tformer.decoding.translate import check_search_args
    from tformer.registry import families_with, get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    loaded = load_checkpoint(checkpoint, device=pick_device(device))
    family = get_family(loaded.cfg.family)
    if family.translate is None:
        raise TformerError(
            f"checkpoint {loaded.path} is a {family.name} model; translate needs a "
            f"sequence-to-sequence model ({' or '.join(families_with('translate'))}); use "
            f"`tformer generate` for language models"
        )
    loaded.model = inference_model(loaded.model, int8)
    check_search_args(beam, alpha, n_best, batch_size, max_len_a, max_len_b)
    if input is not None:
        lines = read_lines(input)
    else:
        lines = read_stdin().split("\n")
        if lines[-1] == "":
            lines.pop()
    bar = tqdm(total=len(lines), unit="line", disable=input is None, file=sys.stderr)
    try:
        results = family.translate(
            loaded, lines, beam=beam, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b,
            n_best=n_best, early_stopping=early_stopping, batch_size=batch_size,
            progress=bar.update,
        )
    finally:
        bar.close()
    out = open(output, "w", encoding="utf-8") if output else sys.stdout
    try:
        for i, hyps in enumerate(results):
            for hyp in hyps:
                # One line per translation, whatever the model produced.
                text = hyp.text.replace("\n", " ")
                out.write(f"{i}\t{hyp.score:.4f}\t{text}\n" if n_best > 1 else text + "\n")
    finally:
        if output:
            out.close()
    return 0


def read_stdin() -> str:
    """Standard input as text; bytes that are not UTF-8 are a one-line error."""
    from tformer.data.corpus import decode_utf8

    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # already text, e.g. a StringIO put there by a caller
        return sys.stdin.read()
    return decode_utf8(buffer.read(), "standard input")


def average_command(checkpoints: list[str], out: str, *, last: int = 0) -> int:
    from tformer.training.average import average_checkpoints, checkpoints_to_average
    from tformer.training.checkpoint import is_checkpoint

    if last < 0:
        raise TformerError(f"--last {last} must be at least 1")
    paths = checkpoints_to_average(checkpoints, last)
    dest = Path(out)
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


def build_parser() -> argparse.ArgumentParser:
    from tformer.registry import evaluate_options

    parser = Parser(prog="tformer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tformer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("train", help="train a model from a TOML config")
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

    p = sub.add_parser("generate", help="sample text from a language model")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    p.add_argument("--top-k", type=int, default=0, help="0 is off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 is off")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--no-cache", action="store_true", help="recompute every step (slow)")
    p.add_argument("--int8", action="store_true", help="int8 weights (CPU): faster, ~same text")
    p.add_argument("--device", default="auto")

    p = sub.add_parser("evaluate", help="loss, perplexity and bits per character")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument(
        "data", nargs="*", help="LM: a text file or folder (default: the run's validation split)"
    )
    p.add_argument("--int8", action="store_true", help="int8 weights (CPU), to see their cost")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--batch-size", type=int, default=0)
    p.add_argument("--device", default="auto")
    for option in evaluate_options():  # the families' own options
        p.add_argument(option.flag, dest=option.name, type=option.type, default=None,
                       help=option.help)

    p = sub.add_parser("translate", help="translate lines with a seq2seq model")
    p.add_argument("checkpoint", help="run or checkpoint directory")
    p.add_argument("input", nargs="?", help="a file of lines (default: stdin)")
    p.add_argument("-o", "--output", help="write here (default: stdout)")
    p.add_argument("--beam", type=int, default=4, help="beam size; 1 is greedy search")
    p.add_argument("--alpha", type=float, default=0.6,
                   help="GNMT length penalty ((5 + length) / 6) ** alpha; 0 is off")
    p.add_argument("--max-len-a", type=float, default=None,
                   help="at most a * source tokens + b output tokens (default a: the "
                   "training data's data.max_ratio)")
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--n-best", type=int, default=1,
                   help="write the N best as 'line<TAB>score<TAB>text'")
    p.add_argument("--early-stopping", action="store_true",
                   help="end a sentence once it has --beam finished hypotheses (faster)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences decoded at once")
    p.add_argument("--int8", action="store_true", help="int8 weights (CPU): faster, ~same text")
    p.add_argument("--device", default="auto")

    p = sub.add_parser("average", help="average the weights of several checkpoints")
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories, or one run with --last")
    p.add_argument("--last", type=int, default=0, help="the run's newest N step checkpoints")
    p.add_argument("--out", required=True, help="the averaged checkpoint's directory")
    return parser


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
        )
    if args.command == "translate":
        return translate_command(
            args.checkpoint, input=args.input, output=args.output, beam=args.beam,
            alpha=args.alpha, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
            n_best=args.n_best, early_stopping=args.early_stopping,
            batch_size=args.batch_size, device=args.device, int8=args.int8,
        )
    if args.command == "average":
        return average_command(args.checkpoints, args.out, last=args.last)
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
        unknown = [a for a in extra if args.command != "train" or a.startswith("-") or "=" not in a]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
