"""The `tformer` command: train, generate, translate, evaluate, average.

Each subcommand is a plain function taking typed arguments. This module owns the terminal
(progress bars, tables, streamed text), the seeds and the device; the library only logs.
A TformerError becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from tformer import __version__
from tformer.config import RunConfig, load_config
from tformer.errors import TformerError

log = logging.getLogger("tformer")


# --- train ------------------------------------------------------------------------------


def train_command(
    config: str | None, out: str, overrides: list[str], *, resume: bool = False
) -> int:
    from tqdm import tqdm

    from tformer.config import config_from_dict
    from tformer.training import checkpoint as ckpt
    from tformer.training.distributed import from_environment
    from tformer.training.trainer import train

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
        resume_from = ckpt.resume_point(run_dir)
        if resume_from is None:
            raise TformerError(f"--resume: {run_dir} holds no usable checkpoint")
        saved = ckpt.read_config(resume_from).to_dict()
        cfg = config_from_dict(saved, overrides)
    else:
        if config is None:
            raise TformerError("train needs a CONFIG.toml (or --resume to continue RUN_DIR)")
        cfg = load_config(config, overrides)
        if ckpt.step_checkpoints(run_dir) or (run_dir / ckpt.BEST).exists():
            raise TformerError(
                f"{run_dir} already holds a training run; add --resume to continue it, "
                f"or choose another --out"
            )

    # Under torchrun, rank 0 speaks for all.
    quiet = not from_environment().is_main
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
    if quiet:
        return 0
    status = "stopped early" if result.interrupted else "done"
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "-"
    print(f"{status} at step {result.step}: best validation loss {best}; run in {run_dir}")
    if result.skipped_steps:
        print(f"{result.skipped_steps} steps were skipped for non-finite loss or gradients")
    return 0


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
    from tformer.decoding.lm import generate
    from tformer.registry import get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    check_generation_args(max_new_tokens, temperature, top_k, top_p, num_samples)
    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    if get_family(loaded.cfg.family).kind != "lm":
        raise TformerError(
            f"checkpoint {loaded.path} is a {loaded.cfg.family} model; generate needs a "
            f"language model (gpt or transformer-xl); use `tformer translate`"
        )
    model, tokenizer = inference_model(loaded.model, int8), loaded.tokenizer
    ids = tokenizer.encode(prompt)
    if not ids:
        if tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id]
        else:
            ids = tokenizer.encode("\n")
    context = model.cfg.context
    if len(ids) > context and loaded.cfg.family == "gpt":
        print(
            f"note: the prompt is {len(ids)} tokens and the model's context is {context}; "
            f"it reads the last {context}",
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
        for token in generate(
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
        from tformer.decoding.quantize import quantize_int8

        return quantize_int8(model)
    from tformer.decoding.prepack import prepack

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
    mem_len: int | None = None,
    segment_len: int | None = None,
    beam: int = 4,
    alpha: float = 0.6,
    int8: bool = False,
) -> int:
    from tformer.data.corpus import cached_token_ids, read_corpus
    from tformer.registry import get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    loaded.model = inference_model(loaded.model, int8)
    cfg, family = loaded.cfg, get_family(loaded.cfg.family)
    if batch_size < 0:
        raise TformerError(f"--batch-size {batch_size} must be positive")
    if batch_size:
        cfg = cfg.replace("train", batch_size=batch_size)
    cfg = memory_overrides(cfg, loaded.path, mem_len, segment_len)
    if family.kind == "seq2seq":
        return evaluate_translation_command(
            loaded, data, as_json=as_json, beam=beam, alpha=alpha, batch_size=batch_size or 32
        )
    if family.kind != "lm":
        raise TformerError(f"evaluate does not know the {cfg.family} family yet")
    if len(data) > 1:
        raise TformerError("a language model is evaluated on one DATA path (or none)")
    if data:
        ids = cached_token_ids(read_corpus(data[0]), loaded.tokenizer)
        result = family.evaluate_text(loaded.model, ids, loaded.tokenizer, cfg)
    else:
        task = family.task(cfg, loaded.tokenizer)
        result = task.evaluate(loaded.model)
    print_metrics(result, as_json)
    return 0


def memory_overrides(
    cfg: RunConfig, path: Path, mem_len: int | None, segment_len: int | None
) -> RunConfig:
    """--mem-len and --segment-len: the memory and segment length a Transformer-XL is
    evaluated with (they need not be the trained ones)."""
    if mem_len is None and segment_len is None:
        return cfg
    if not hasattr(cfg.model, "mem_len"):
        raise TformerError(
            f"--mem-len and --segment-len apply to transformer-xl checkpoints; {path} is a "
            f"{cfg.family} model"
        )
    if mem_len is not None:
        if mem_len < 0:
            raise TformerError(f"--mem-len {mem_len} must be 0 (no memory) or more")
        cfg = cfg.replace("model", eval_mem_len=mem_len)
    if segment_len is not None:
        if segment_len < 1:
            raise TformerError(f"--segment-len {segment_len} must be at least 1")
        cfg = cfg.replace("model", context=segment_len)
    return cfg


def print_metrics(result: dict[str, float], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


# --- translation: translate, evaluate, average -----------------------------------------


def check_search_args(beam: int, alpha: float, n_best: int, batch_size: int,
                      max_len_a: float, max_len_b: int) -> None:
    if beam < 1:
        raise TformerError(f"--beam {beam} must be at least 1 (1 is greedy search)")
    if not alpha >= 0:
        raise TformerError(f"--alpha {alpha} must be 0 (no length penalty) or more")
    if not 1 <= n_best <= beam:
        raise TformerError(f"--n-best {n_best} must be between 1 and --beam {beam}")
    if batch_size < 1:
        raise TformerError(f"--batch-size {batch_size} must be at least 1")
    if not max_len_a >= 0 or max_len_b < 0 or (max_len_a == 0 and max_len_b == 0):
        raise TformerError(
            f"--max-len-a {max_len_a} and --max-len-b {max_len_b} must be 0 or more, and not "
            f"both 0"
        )


def load_translation_model(checkpoint: str, device: str):
    from tformer.registry import get_family
    from tformer.training.checkpoint import load_checkpoint
    from tformer.training.device import pick_device

    loaded = load_checkpoint(checkpoint, device=pick_device(device))
    if get_family(loaded.cfg.family).kind != "seq2seq":
        raise TformerError(
            f"checkpoint {loaded.path} is a {loaded.cfg.family} model; translate needs a "
            f"seq2seq model (use `tformer generate` for language models)"
        )
    return loaded


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
    from tformer.decoding.translate import SearchOptions, translate

    loaded = load_translation_model(checkpoint, device)
    loaded.model = inference_model(loaded.model, int8)
    # By default an output may be as long, relative to its source, as training pairs were.
    if max_len_a is None:
        max_len_a = loaded.cfg.data.max_ratio
    check_search_args(beam, alpha, n_best, batch_size, max_len_a, max_len_b)
    if input is not None:
        lines = read_lines(input)
    else:
        lines = sys.stdin.read().split("\n")
        if lines[-1] == "":
            lines.pop()
    options = SearchOptions(beam=beam, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b,
                            n_best=n_best, early_stopping=early_stopping)
    bar = tqdm(total=len(lines), unit="line", disable=input is None, file=sys.stderr)
    try:
        results = translate(loaded.model, loaded.tokenizer, lines, options,
                            batch_size=batch_size, progress=bar.update)
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


def evaluate_translation_command(
    loaded: Any, data: list[str], *, as_json: bool, beam: int, alpha: float, batch_size: int
) -> int:
    from tqdm import tqdm

    from tformer.data.parallel import read_pairs
    from tformer.decoding.translate import SearchOptions
    from tformer.evaluation.translation import evaluate_translation
    from tformer.registry import get_family

    max_len_a = loaded.cfg.data.max_ratio
    check_search_args(beam, alpha, 1, batch_size, max_len_a, 10)
    if len(data) not in (0, 2):
        raise TformerError(
            "a translation model is evaluated on SRC REF (two line-aligned files), or with "
            "no DATA on its run's validation pairs"
        )
    if data:
        sources, references = read_pairs(data[0], data[1])
    else:
        task = get_family(loaded.cfg.family).task(loaded.cfg, loaded.tokenizer)
        sources, references = task.data.val_text
    bar = tqdm(total=len(sources), unit="line", file=sys.stderr, leave=False)
    try:
        result, _ = evaluate_translation(
            loaded.model, loaded.tokenizer, sources, references,
            SearchOptions(beam=beam, alpha=alpha, max_len_a=max_len_a), batch_size=batch_size,
            max_tokens=loaded.cfg.data.max_tokens, progress=bar.update,
        )
    finally:
        bar.close()
    print_metrics(result, as_json)
    return 0


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
    p.add_argument(
        "--mem-len",
        type=int,
        default=None,
        help="transformer-xl: memory positions per layer (default: the trained one)",
    )
    p.add_argument(
        "--segment-len",
        type=int,
        default=None,
        help="transformer-xl: tokens per segment (default: model.context)",
    )
    p.add_argument("--beam", type=int, default=4, help="seq2seq: beam size (1 is greedy)")
    p.add_argument("--alpha", type=float, default=0.6, help="seq2seq: length penalty")

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

    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-style completions, "
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
        return evaluate_command(
            args.checkpoint,
            args.data,
            as_json=args.json,
            batch_size=args.batch_size,
            device=args.device,
            mem_len=args.mem_len,
            segment_len=args.segment_len,
            beam=args.beam,
            alpha=args.alpha,
            int8=args.int8,
        )
    if args.command == "translate":
        return translate_command(
            args.checkpoint, input=args.input, output=args.output, beam=args.beam,
            alpha=args.alpha, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
            n_best=args.n_best, early_stopping=args.early_stopping,
            batch_size=args.batch_size, device=args.device, int8=args.int8,
        )
    if args.command == "serve":
        from tformer.serving.command import serve_command

        return serve_command(
            args.checkpoint, host=args.host, port=args.port, api_key=args.api_key,
            int8=args.int8, device=args.device, name=args.name, max_batch=args.max_batch,
            max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
            batch_window_ms=args.batch_window_ms,
        )
    if args.command == "average":
        return average_command(args.checkpoints, args.out, last=args.last)
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
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
    except KeyboardInterrupt:
        print("tformer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
