"""Two configs trained on the same data and seeds, one after the other in turn, on one
thread: validation loss beside the wall time each run took.

    python benchmarks/modern_config.py [--seeds 1337 1338] [--json]
    python benchmarks/modern_config.py --configs A.toml B.toml [key=value ...]

By default the pair is configs/gpt-shakespeare-char.toml (nanoGPT's CPU configuration) and
configs/gpt-shakespeare-char-modern.toml (the same size and budget with rotary positions,
RMSNorm and SwiGLU), whose step count is set so that the two take the same wall time. Runs
alternate (A seed 1, B seed 1, A seed 2, ...) so that the machine's drift falls on both
alike; the wall time is the trainer's own (metrics.csv's elapsed_s at the last step, its
evaluations included). The loss is the best validation loss of the run, which `tformer
evaluate RUN` reproduces. Overrides after the configs apply to every run (--tiny uses them
to run in seconds on this file's text, to check the script).
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

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "configs" / "gpt-shakespeare-char.toml",
           ROOT / "configs" / "gpt-shakespeare-char-modern.toml"]
TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "model.context=16", "train.steps=6", "train.eval_every=3", "train.checkpoint_every=6",
        "train.warmup_steps=1", "train.eval_batches=2"]


def train(config: Path, seed: int, out: Path, overrides: list[str]) -> dict[str, float]:
    """One run in its own process on one thread; its wall time, steps and best val loss."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tformer", "train", str(config), "--out",
                           str(out), f"train.seed={seed}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training {config.name} failed:\n{done.stderr[-3000:]}")
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r["split"] == "train"]
    val = [float(r["loss"]) for r in rows if r["split"] == "val"]
    return {"steps": int(train_rows[-1]["step"]), "wall_s": float(train_rows[-1]["elapsed_s"]),
            "val_loss": min(val)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs=2, type=Path, default=CONFIGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1337, 1338])
    parser.add_argument("--tiny", action="store_true", help="check the script in seconds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {c.stem: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = args.overrides
        if args.tiny:
            corpus = Path(tmp) / "corpus.txt"
            corpus.write_text(Path(__file__).read_text(encoding="utf-8"), encoding="utf-8")
            overrides = [*TINY, f"data.path={corpus}", *overrides]
        for seed in args.seeds:
            for config in args.configs:
                run = train(config, seed, Path(tmp) / f"{config.stem}-{seed}", overrides)
                results[config.stem].append({"seed": seed, **run})
                print(f"{config.stem} seed {seed}: {run}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| config | seed | steps | wall s | val loss |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        for r in runs:
            print(f"| {name} | {r['seed']} | {r['steps']} | {r['wall_s']:.0f} | "
                  f"{r['val_loss']:.4f} |")
    (a, ra), (b, rb) = results.items()
    mean = {name: statistics.mean(r["val_loss"] for r in runs) for name, runs in results.items()}
    wall = {name: statistics.mean(r["wall_s"] for r in runs) for name, runs in results.items()}
    print(f"\nmean val loss: {a} {mean[a]:.4f}, {b} {mean[b]:.4f} ({mean[b] - mean[a]:+.4f}); "
          f"wall time {b} / {a}: {wall[b] / wall[a]:.2f}")


if __name__ == "__main__":
    main()
