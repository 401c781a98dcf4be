"""Does Transformer-XL's memory help? Validation bits per character on a char-level corpus.

Trains, one after the other and with the same steps, seed, segment length 64 and training
choices (cosine schedule, weight decay 0.1, gradient clipping at 1):
  - the GPT of configs/gpt-shakespeare-char.toml (4 x 128, context 64),
  - the Transformer-XL of configs/txl-shakespeare-char.toml with mem_len 0,
  - the same Transformer-XL with mem_len 64,
then evaluates each on the validation split (`tformer evaluate --json`), the mem_len-64
model also with memories of 0, 128 and 256, and prints a table.

    python benchmarks/txl_memory.py                      # 2000 steps each, as the configs say
    python benchmarks/txl_memory.py --steps 200 --out runs/txl-memory-quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TFORMER = [sys.executable, "-m", "tformer"]


def sh(args: list[str]) -> str:
    print("$", " ".join(args[2:] if args[:2] == TFORMER[:2] else args), flush=True)
    done = subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    return done.stdout


def train(config: str, out: Path, overrides: list[str]) -> float:
    if (out / "best").is_dir():
        print(f"(reusing {out})", flush=True)
        return float("nan")
    start = time.perf_counter()
    sh([*TFORMER, "train", config, "--out", str(out), *overrides])
    return time.perf_counter() - start


def evaluate(run: Path, *options: str) -> dict[str, float]:
    return json.loads(sh([*TFORMER, "evaluate", str(run), "--json", *options]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="runs/txl-memory")
    parser.add_argument("--seed", type=int, default=None, help="train.seed override")
    parser.add_argument("--data", default=None, help="data.path override (default: the configs')")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args()

    out = Path(args.out)
    common = [f"train.steps={args.steps}", "train.eval_every=500", "train.checkpoint_every=500"]
    # The same training choices for all three, whatever each config says (these are the
    # Transformer-XL config's, and those the results in txl_results.md were measured with).
    common += ["train.schedule=cosine", "train.weight_decay=0.1", "train.grad_clip=1.0"]
    if args.data:
        common.append(f"data.path={args.data}")
    if args.seed is not None:
        common.append(f"train.seed={args.seed}")
    runs = {
        "gpt": ("configs/gpt-shakespeare-char.toml", []),
        "txl-mem0": ("configs/txl-shakespeare-char.toml", ["model.mem_len=0"]),
        "txl-mem64": ("configs/txl-shakespeare-char.toml", ["model.mem_len=64"]),
    }
    seconds = {}
    for name, (config, extra) in runs.items():
        seconds[name] = train(config, out / name, [*common, *extra])

    rows = [
        ("GPT, context 64", "gpt", "-", []),
        ("Transformer-XL, mem_len 0", "txl-mem0", "0", []),
        ("Transformer-XL, mem_len 64", "txl-mem64", "64", []),
        ("  same model, evaluated with mem_len 0", "txl-mem64", "0", ["--mem-len", "0"]),
        ("  same model, evaluated with mem_len 128", "txl-mem64", "128", ["--mem-len", "128"]),
        ("  same model, evaluated with mem_len 256", "txl-mem64", "256", ["--mem-len", "256"]),
    ]
    lines = [
        f"Validation split, segment length 64, {args.steps} training steps each"
        + (f", seed {args.seed}." if args.seed is not None else "."),
        "",
        "| model | eval memory | val loss (nats) | val bpc | train time (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, run, memory, options in rows:
        result = evaluate(out / run, *options)
        took = f"{seconds[run]:.0f}" if not options else ""
        lines.append(
            f"| {label} | {memory} | {result['loss']:.4f} | {result['bpc']:.4f} | {took} |"
        )
    table = "\n".join(lines)
    print()
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
