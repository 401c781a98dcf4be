"""Dropout: tformer's kernel (tformer/kernels/dropout.c) against torch's, on its own and in
training, timed side by side in one run.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/dropout.py [--repeats 7] \
        [--config configs/seq2seq-multi30k.toml --steps 40 --rounds 2]

The first table times dropout forward and backward (p = 0.3) on the shapes the Multi30k
config drops in one step (its batches of ~2,000 target tokens): the residual branches and
embeddings, the FFN's hidden layer, and attention probabilities. The second trains the config
through the CLI with the kernel and with torch's dropout (`TFORMER_NATIVE=0`), in
alternation, and compares target tokens/s (the median over each run's logged windows after
the first). --steps 0 leaves training out.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tformer.kernels import dropout as kd
from tformer.kernels import matvec

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (shape, calls in one step of the Multi30k config)
    "residual / embeddings (2000 x 128)": ((2000, 128), 22),
    "FFN hidden (2000 x 512)": ((2000, 512), 8),
    "attention probabilities (150 x 4 x 16 x 16)": ((150, 4, 16, 16), 12),
}


def time_call(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls, after one to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def forward_backward(drop, shape: tuple[int, ...]):
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)

    def step() -> None:
        drop(x, 0.3, True).backward(grad)
        x.grad = None

    return step


def op_table(repeats: int) -> None:
    print(f"\ndropout p = 0.3, forward + backward, {torch.get_num_threads()} thread(s), "
          f"median of {repeats} in alternation\n")
    print("| shape | calls a step | torch (ms) | tformer (ms) | ratio |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for name, (shape, calls) in SHAPES.items():
        sides = {"torch": forward_backward(F.dropout, shape),
                 "tformer": forward_backward(kd.dropout, shape)}
        times: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(repeats):
            for side, fn in sides.items():
                times[side] += time_call(fn, 1)
        ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
        print(f"| {name} | {calls} | {ms['torch']:.2f} | {ms['tformer']:.2f} | "
              f"{ms['torch'] / ms['tformer']:.1f}x |")


def train_rate(config: str, steps: int, native: bool, out: Path) -> float:
    """Median target tokens/s of `steps` training steps through the CLI."""
    env = {**os.environ, "TFORMER_NATIVE": "1" if native else "0"}
    args = [sys.executable, "-m", "tformer", "train", config, "--out", str(out),
            f"train.steps={steps}", "train.log_every=10", f"train.eval_every={steps}",
            f"train.checkpoint_every={steps}", "train.eval_batches=1", "data.val_bleu_every=0",
            "train.best_metric=loss"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr.strip()}")
    with open(out / "metrics.csv", newline="") as f:
        rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f) if r["split"] == "train"]
    return statistics.median(rates[1:])


def training_table(config: str, steps: int, rounds: int) -> None:
    rates: dict[str, list[float]] = {"torch's dropout": [], "tformer's kernel": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for side, native in (("torch's dropout", False), ("tformer's kernel", True)):
                rates[side].append(train_rate(config, steps, native, Path(tmp) / f"{r}-{native}"))
    print(f"\ntraining {config}, {steps} steps a run, {rounds} rounds in alternation, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n")
    print("| dropout | target tokens/s | rounds | ratio |\n| --- | ---: | --- | ---: |")
    base = statistics.median(rates["torch's dropout"])
    for side, values in rates.items():
        median = statistics.median(values)
        print(f"| {side} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | "
              f"{median / base:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--config", default="configs/seq2seq-multi30k.toml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if matvec.load() is None:
        sys.exit("the kernel is not built here (see tformer/kernels/matvec.py): nothing to compare")
    op_table(args.repeats)
    if args.steps:
        training_table(args.config, args.steps, args.rounds)


if __name__ == "__main__":
    main()
