"""Training's kernels, dropout (tformer/kernels/dropout.c) and the label-smoothed
cross-entropy (xent.c), against torch's, on their own and in training, timed side by side in
one run.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/training_kernels.py [--repeats 7] \
        [--config configs/seq2seq-multi30k.toml --steps 60 --rounds 2] [--tiny]

The first table times each operation forward and backward on the shapes one step of the
Multi30k config makes (its batches of ~2,000 target tokens): dropout (p = 0.3) on the
residual branches and embeddings, the FFN's hidden layer and attention probabilities, and
the loss over the 8,000-token vocabulary (label smoothing 0.1); and the loss over GPT-2's
vocabulary, 2,048 tokens a batch. The second trains the config through the CLI with the
kernels and without them (`TFORMER_NATIVE=0`: torch's dropout and F.cross_entropy), in
alternation, and compares target tokens/s (the median over each run's logged windows after
the first). --steps 0 leaves training out; --tiny times the operations on tiny shapes, to
check the script.
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
from tformer.kernels import library
from tformer.kernels.xent import cross_entropy

ROOT = Path(__file__).resolve().parent.parent
DROPOUT = {  # name: (shape, calls in one step of the Multi30k config)
    "dropout: residual / embeddings (2000 x 128)": ((2000, 128), 22),
    "dropout: FFN hidden (2000 x 512)": ((2000, 512), 8),
    "dropout: attention probabilities (150 x 4 x 16 x 16)": ((150, 4, 16, 16), 12),
}
LOSS = {  # name: (tokens, vocabulary, calls a step)
    "loss: Multi30k (2000 x 8000)": (2000, 8000, 1),
    "loss: GPT-2's vocabulary (2048 x 50257)": (2048, 50257, 1),
}

TINY_DROPOUT = {"dropout: tiny (64 x 16)": ((64, 16), 1)}
TINY_LOSS = {"loss: tiny (32 x 100)": (32, 100, 1)}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dropout_step(drop, shape: tuple[int, ...]):
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)

    def step() -> None:
        drop(x, 0.3, True).backward(grad)
        x.grad = None

    return step


def loss_step(loss, tokens: int, vocab: int):
    x = torch.randn(tokens, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))

    def step() -> None:
        loss(x, targets, ignore_index=-100, label_smoothing=0.1).backward()
        x.grad = None

    return step


def op_table(repeats: int, dropouts: dict, losses: dict) -> None:
    print(f"\nforward + backward, {torch.get_num_threads()} thread(s), median of {repeats} in "
          f"alternation\n")
    print("| operation | calls a step | torch (ms) | tformer (ms) | ratio |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    cases = {name: (calls, dropout_step(F.dropout, shape), dropout_step(kd.dropout, shape))
             for name, (shape, calls) in dropouts.items()}
    cases.update({name: (calls, loss_step(F.cross_entropy, n, v), loss_step(cross_entropy, n, v))
                  for name, (n, v, calls) in losses.items()})
    for name, (calls, theirs, ours) in cases.items():
        theirs(), ours()  # warm-up
        times: dict[str, list[float]] = {"torch": [], "tformer": []}
        for _ in range(repeats):
            times["torch"].append(seconds(theirs))
            times["tformer"].append(seconds(ours))
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
    rates: dict[str, list[float]] = {"torch": [], "tformer's kernels": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for side, native in (("torch", False), ("tformer's kernels", True)):
                rates[side].append(train_rate(config, steps, native, Path(tmp) / f"{r}-{native}"))
    print(f"\ntraining {config}, {steps} steps a run, {rounds} rounds in alternation, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n")
    print("| dropout and loss | target tokens/s | rounds | ratio |\n| --- | ---: | --- | ---: |")
    base = statistics.median(rates["torch"])
    for side, values in rates.items():
        median = statistics.median(values)
        print(f"| {side} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | "
              f"{median / base:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--config", default="configs/seq2seq-multi30k.toml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tiny", action="store_true",
                   help="the operations on tiny shapes, to check the script")
    args = p.parse_args()
    if library.load() is None:
        sys.exit("the kernel is not built here (tformer/kernels/library.py): nothing to compare")
    if args.tiny:
        op_table(args.repeats, TINY_DROPOUT, TINY_LOSS)
    else:
        op_table(args.repeats, DROPOUT, LOSS)
    if args.steps:
        training_table(args.config, args.steps, args.rounds)


if __name__ == "__main__":
    main()
