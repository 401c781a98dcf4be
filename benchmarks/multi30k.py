"""Multi30k en -> de: what each choice buys, measured the way a user would, through the CLI.

    # decoding choices on the validation split: checkpoint averaging, beam size, length penalty
    .venv/bin/python benchmarks/multi30k.py decode runs/multi30k [RUN ...]
    # training speed of two configs, in target tokens/s, timed in alternation in one run
    .venv/bin/python benchmarks/multi30k.py speed old=OLD.toml new=configs/seq2seq-multi30k.toml
    # the chosen checkpoint and search on test2016, once
    .venv/bin/python benchmarks/multi30k.py test runs/multi30k/averaged --beam 5 --alpha 1.0

Every choice is made on val.{en,de}; test2016 is read only by `test`. Scores are sacreBLEU's
defaults (cased, detokenized, 13a), chrF, and the Multi30k literature's BLEU (Moses-tokenized,
lowercased: `bleu_tok`). Results: benchmarks/translation.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tformer.training.checkpoint import step_checkpoints

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "multi30k"
TFORMER = [sys.executable, "-m", "tformer"]


def tformer(*args: str, threads: int) -> str:
    """Run one tformer command and return its stdout; a failure stops the benchmark."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([*TFORMER, *args], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"tformer {' '.join(args)} failed:\n{done.stderr.strip()}")
    return done.stdout


def scores(checkpoint: Path, split: str, beam: int, alpha: float, threads: int) -> dict:
    result = tformer("evaluate", str(checkpoint), str(DATA / f"{split}.en"),
                     str(DATA / f"{split}.de"), "--beam", str(beam), "--alpha", str(alpha),
                     "--threads", str(threads), "--json", threads=threads)
    return json.loads(result)


def row(name: str, result: dict) -> str:
    return (f"| {name} | {result['bleu']:.2f} | {result['bleu_tok']:.2f} | "
            f"{result['chrf']:.2f} |")


HEADER = "| checkpoint, search | BLEU | BLEU (tok, lc) | chrF |\n| --- | ---: | ---: | ---: |"


def averaged(run: Path, last: int, threads: int) -> Path:
    out = run / f"averaged-{last}"
    if not out.exists():
        tformer("average", str(run), "--last", str(last), "--out", str(out), threads=threads)
    return out


def latest(run: Path) -> Path:
    steps = step_checkpoints(run)
    if not steps:
        sys.exit(f"{run} has no step checkpoints")
    return steps[-1]


def decode(args: argparse.Namespace) -> None:
    """One change at a time on val: which checkpoint (last, best by validation BLEU, the
    average of the last 5 or 10), then the beam size, then the length penalty (GNMT's)."""
    for run in map(Path, args.runs):
        print(f"\n{run} on val (1,014 sentences)\n\n{HEADER}")
        t = args.threads
        checkpoints = {"last": latest(run), "best (greedy val BLEU)": run / "best",
                       "average of last 5": averaged(run, 5, t),
                       "average of last 10": averaged(run, 10, t)}
        for name, checkpoint in checkpoints.items():
            print(row(f"{name}, greedy", scores(checkpoint, "val", 1, 0.0, t)), flush=True)
        chosen = checkpoints["average of last 10"]
        for beam, alpha in ((4, 0.6), (5, 0.6), (5, 1.0)):
            print(row(f"average of last 10, beam {beam}, alpha {alpha}",
                      scores(chosen, "val", beam, alpha, t)), flush=True)


def test(args: argparse.Namespace) -> None:
    for split in ("val", "test2016"):
        result = scores(Path(args.checkpoint), split, args.beam, args.alpha, args.threads)
        print(f"{split}: BLEU {result['bleu']:.2f}, BLEU (tok, lc) {result['bleu_tok']:.2f}, "
              f"chrF {result['chrf']:.2f}, loss {result['loss']:.4f}")
        if split == "test2016":
            for key in ("bleu_signature", "chrf_signature", "bleu_tok_signature"):
                print(f"  {key}: {result.get(key)}")


def speed(args: argparse.Namespace) -> None:
    """Target tokens/s of each config over `steps` steps, in alternation, `rounds` times; the
    first logged window of each run (start-up) is left out."""
    configs = dict(spec.split("=", 1) for spec in args.configs)
    measured: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, path in configs.items():
                out = Path(tmp) / f"{name}-{r}"
                tformer("train", path, "--out", str(out), f"train.steps={args.steps}",
                        "train.log_every=10", f"train.eval_every={args.steps}",
                        f"train.checkpoint_every={args.steps}", "train.eval_batches=1",
                        "data.val_bleu_every=0", "train.best_metric=loss",
                        threads=args.threads)
                with open(out / "metrics.csv", newline="") as f:
                    rows = [float(x["tokens_per_s"]) for x in csv.DictReader(f)
                            if x["split"] == "train"]
                measured[name].append(statistics.median(rows[1:]))
    first = next(iter(measured))
    print(f"\n{args.steps} steps a run, {args.rounds} rounds in alternation, "
          f"{args.threads} thread(s); median target tokens/s\n")
    print("| config | target tokens/s | rounds | ratio |\n| --- | ---: | --- | ---: |")
    base = statistics.median(measured[first])
    for name, values in measured.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | "
              f"{median / base:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode")
    p.add_argument("runs", nargs="+")
    p = sub.add_parser("test")
    p.add_argument("checkpoint")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--alpha", type=float, default=1.0)
    p = sub.add_parser("speed")
    p.add_argument("configs", nargs="+", help="NAME=CONFIG.toml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    {"decode": decode, "test": test, "speed": speed}[args.command](args)


if __name__ == "__main__":
    main()
