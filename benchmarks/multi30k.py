"""Multi30k en -> de: what each choice buys, measured the way a user would, through the CLI.

    # decoding choices on the validation split: checkpoint averaging, beam size, length penalty
    .venv/bin/python benchmarks/multi30k.py decode runs/multi30k [RUN ...] [--searches 5:1.0 ...]
    # training speed of two configs, in target tokens/s, timed in alternation in one run
    .venv/bin/python benchmarks/multi30k.py speed old=OLD.toml new=configs/seq2seq-multi30k.toml
    # seeds of one config, alone and decoding together as one ensemble, on val
    .venv/bin/python benchmarks/multi30k.py ensemble runs/seed2 runs/seed3 --searches 5:1.6
    # the chosen checkpoint and search on test2016, once (--ensemble: with other checkpoints)
    .venv/bin/python benchmarks/multi30k.py test runs/multi30k/averaged --beam 5 --alpha 1.0
    # training choices one at a time, each with several seeds, two runs at a time
    .venv/bin/python benchmarks/multi30k.py ablate --out runs/ablate --seeds 1 2 \
        base dropout-0.1=model.dropout=0.1 noam=train.schedule=noam,train.warmup_steps=4000

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
import time
from pathlib import Path
from typing import IO

from tformer.config import load_config
from tformer.data.parallel import ParallelData
from tformer.loading import step_checkpoints, step_dir

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


def scores(checkpoint: Path, split: str, beam: int, alpha: float, threads: int,
           ensemble: list[Path] = ()) -> dict:
    """`tformer evaluate`'s scores of `checkpoint` (decoding with the `ensemble` checkpoints
    too, when given) on `split`."""
    others = [arg for path in ensemble for arg in ("--ensemble", str(path))]
    result = tformer("evaluate", str(checkpoint), str(DATA / f"{split}.en"),
                     str(DATA / f"{split}.de"), "--beam", str(beam), "--alpha", str(alpha),
                     "--threads", str(threads), "--json", *others, threads=threads)
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
    average of the last 5 or 10), then, on the average of 10, each BEAM:ALPHA of `searches`
    (GNMT's length penalty)."""
    for run in map(Path, args.runs):
        print(f"\n{run} on val (1,014 sentences)\n\n{HEADER}")
        t = args.threads
        checkpoints = {"last": latest(run), "best (greedy val BLEU)": run / "best",
                       "average of last 5": averaged(run, 5, t),
                       "average of last 10": averaged(run, 10, t)}
        for name, checkpoint in checkpoints.items():
            print(row(f"{name}, greedy", scores(checkpoint, "val", 1, 0.0, t)), flush=True)
        chosen = checkpoints["average of last 10"]
        for beam, alpha in args.searches:
            print(row(f"average of last 10, beam {beam}, alpha {alpha}",
                      scores(chosen, "val", beam, alpha, t)), flush=True)


def ensemble(args: argparse.Namespace) -> None:
    """Seeds of one config as an ensemble, on val: each run's average of the last 10 alone,
    then all of them decoding together, at each BEAM:ALPHA of `searches`."""
    chosen = [averaged(Path(run), 10, args.threads) for run in args.runs]
    print(f"\n{len(chosen)} runs' averages of the last 10 on val (1,014 sentences)\n\n{HEADER}")
    for beam, alpha in args.searches:
        for checkpoint in chosen:
            print(row(f"{checkpoint.parent.name} alone, beam {beam}, alpha {alpha}",
                      scores(checkpoint, "val", beam, alpha, args.threads)), flush=True)
        print(row(f"all {len(chosen)} as an ensemble, beam {beam}, alpha {alpha}",
                  scores(chosen[0], "val", beam, alpha, args.threads, chosen[1:])), flush=True)


def test(args: argparse.Namespace) -> None:
    others = [Path(path) for path in args.ensemble or []]
    for split in ("val", "test2016"):
        result = scores(Path(args.checkpoint), split, args.beam, args.alpha, args.threads,
                        others)
        print(f"{split}: BLEU {result['bleu']:.2f}, BLEU (tok, lc) {result['bleu_tok']:.2f}, "
              f"chrF {result['chrf']:.2f}, loss {result['loss']:.4f}")
        if split == "test2016":
            for key in ("bleu_signature", "chrf_signature", "bleu_tok_signature"):
                print(f"  {key}: {result.get(key)}")


def epoch_cost(path: str) -> tuple[int, float]:
    """Target tokens in one training epoch of the config (EOS included, padding not), and
    the seconds it takes to segment the epoch afresh (BPE-dropout; 0 without)."""
    cfg = load_config(path)
    data = ParallelData(cfg.data)
    if data.dropout is None:
        return sum(map(len, data.train_tgt)), 0.0
    start = time.perf_counter()
    _, tgt = data.resegment(cfg.train.seed, 0)
    return sum(map(len, tgt)), time.perf_counter() - start


def speed(args: argparse.Namespace) -> None:
    """Target tokens/s of each config over `steps` steps, in alternation, `rounds` times; the
    first logged window of each run (start-up) is left out. Epochs an hour follow from them
    and each config's tokens an epoch: BPE-dropout cuts the same pairs into more tokens, and
    segments them afresh each epoch, which the steps timed here do not include."""
    configs = dict(spec.split("=", 1) for spec in args.configs)
    costs = {name: epoch_cost(path) for name, path in configs.items()}
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
    print("| config | target tokens/s | rounds | ratio | tokens an epoch | segmenting an "
          "epoch | epochs an hour |\n| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(measured[first])
    for name, values in measured.items():
        median = statistics.median(values)
        tokens, segmenting = costs[name]
        print(f"| {name} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | "
              f"{median / base:.2f}x | {tokens:,} | {segmenting:.1f} s | "
              f"{3600 / (tokens / median + segmenting):.1f} |")


def ablate(args: argparse.Namespace) -> None:
    """Train the config once per variant and seed (each variant: NAME or NAME=KEY=VALUE[,...],
    overrides of the config), `jobs` runs at a time with one thread each, then score each
    run's last checkpoint greedily on val. A run already finished is not trained again; an
    interrupted one resumes."""
    out = Path(args.out)
    variants = {spec.split("=", 1)[0]: spec.split("=", 1)[1].split(",") if "=" in spec else []
                for spec in args.variants}
    runs = {(name, seed): out / f"{name}-seed{seed}" for name in variants for seed in args.seeds}
    overrides = {name: [*args.common, *changes] for name, changes in variants.items()}
    final = {name: load_config(args.config, o).train.steps for name, o in overrides.items()}
    pending = [(name, seed) for (name, seed), run in runs.items()
               if not step_dir(run, final[name]).is_dir()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    active: list[tuple[subprocess.Popen, Path, IO]] = []
    while pending or active:
        while pending and len(active) < args.jobs:
            name, seed = pending.pop(0)
            run = runs[name, seed]
            resume = ["--resume"] if step_checkpoints(run) else []
            cmd = [*TFORMER, "train", args.config, "--out", str(run), *resume,
                   f"train.seed={seed}", *overrides[name]]
            out.mkdir(parents=True, exist_ok=True)
            log = open(out / f"{run.name}.log", "a")
            print(f"training {run.name}: tformer {' '.join(cmd[3:])}", flush=True)
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            active.append((proc, run, log))
        proc, run, log = active.pop(0)
        code = proc.wait()
        log.close()
        if code != 0:
            sys.exit(f"training {run} failed; see {out / (run.name + '.log')}")
    print("\nlast checkpoint of each run, greedy, on val\n\n"
          "| variant | seed | BLEU | BLEU (tok, lc) | chrF | hours |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    bleu: dict[str, list[float]] = {name: [] for name in variants}
    for (name, seed), run in runs.items():
        result = scores(latest(run), "val", 1, 0.0, args.threads)
        with open(run / "metrics.csv", newline="") as f:
            hours = max(float(r["elapsed_s"] or 0) for r in csv.DictReader(f)) / 3600
        bleu[name].append(result["bleu"])
        print(f"| {name} | {seed} | {result['bleu']:.2f} | {result['bleu_tok']:.2f} | "
              f"{result['chrf']:.2f} | {hours:.2f} |", flush=True)
    first = next(iter(bleu))
    print(f"\n| variant | mean BLEU | vs {first} |\n| --- | ---: | ---: |")
    for name, values in bleu.items():
        mean = statistics.mean(values)
        print(f"| {name} | {mean:.2f} | {mean - statistics.mean(bleu[first]):+.2f} |")


def search(text: str) -> tuple[int, float]:
    """BEAM:ALPHA, as --searches takes it."""
    try:
        beam, alpha = text.split(":")
        return int(beam), float(alpha)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BEAM:ALPHA (5:1.0, say)") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode")
    p.add_argument("runs", nargs="+")
    p.add_argument("--searches", nargs="+", type=search, default=[(4, 0.6), (5, 0.6), (5, 1.0)],
                   help="BEAM:ALPHA searches to score the average of the last 10 with")
    p = sub.add_parser("ensemble")
    p.add_argument("runs", nargs="+", help="runs of one config, with different seeds")
    p.add_argument("--searches", nargs="+", type=search, default=[(5, 1.0), (5, 1.6)],
                   help="BEAM:ALPHA searches to score each run and the ensemble with")
    p = sub.add_parser("test")
    p.add_argument("checkpoint")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--ensemble", action="append", metavar="CHECKPOINT",
                   help="decode with this checkpoint too, as an ensemble (repeat for more)")
    p = sub.add_parser("speed")
    p.add_argument("configs", nargs="+", help="NAME=CONFIG.toml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p = sub.add_parser("ablate")
    p.add_argument("variants", nargs="+", help="NAME or NAME=KEY=VALUE[,KEY=VALUE...]")
    p.add_argument("--out", required=True, help="a directory for the runs and their logs")
    p.add_argument("--config", default="configs/seq2seq-multi30k.toml")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337])
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    p.add_argument("--common", nargs="*", default=[],
                   help="KEY=VALUE overrides for every run (a shorter train.steps, say); "
                        "end the list with --")
    args = parser.parse_args()
    {"decode": decode, "ensemble": ensemble, "test": test, "speed": speed,
     "ablate": ablate}[args.command](args)


if __name__ == "__main__":
    main()
