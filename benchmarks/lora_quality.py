"""LoRA beside full fine-tuning of one checkpoint on the same data and schedule: validation
loss before and after each, and LoRA's gain as a fraction of full fine-tuning's.

    python benchmarks/lora_quality.py [--base RUN] [--steps 300] [--rows NAME ...] [--json]
    python benchmarks/lora_quality.py --tiny         # checks the script in seconds

The base is a character-level GPT trained on tiny Shakespeare with
configs/gpt-shakespeare-char.toml (or the run given as --base). It is fine-tuned on the Penn
Treebank (Mikolov's text: lower-case newswire, numbers as N, rare words as <unk>), a shift
of domain in the same alphabet: <unk> is written `?` (which the treebank does not use) and
the 1.7% of its lines that hold a character the base's tokenizer never saw (digits but 3,
`#`, `*`, `/`, `\\`) are left out, since a fine-tune keeps its base's tokenizer and a
character tokenizer has no id for an unseen character. The derived text goes to the work
folder (--workdir, or a temporary one).

Every row fine-tunes for the same steps on the same schedule (the base config's: linear
decay to lr / 10 after warmup, no weight decay, no clipping), one process on one thread
each; rows differ in their rate and, for LoRA, their adapters (ROWS below: each way of
training at three rates, LoRA's ten times full fine-tuning's, then r = 32, and adapters on
the attention alone). "Before" is the base's loss on the treebank's validation text
(`tformer evaluate BASE FILE`), "after" the fine-tuned run's at its last step, on all of
that text (what `tformer evaluate RUN` reports). The gain is before - after; every row
gives its gain over the best full row's. Wall time is each fine-tune's process, start to
end (its final evaluation included). The default invocation takes about 10 CPU-minutes,
the base's 2000 steps a third of them. Overrides after the options apply to every
fine-tune.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "configs" / "gpt-shakespeare-char.toml"
DATA = next((p for p in (ROOT.parent / "shared" / "data", ROOT.parent.parent / "shared" / "data")
             if p.is_dir()), ROOT.parent / "shared" / "data")
"""../shared/data beside the repository (or beside the folder of worktrees)."""
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
PTB = {"train": DATA / "ptb" / "ptb.train.txt", "valid": DATA / "ptb" / "ptb.valid.txt"}
UNK = ("<unk>", "?")

ATTENTION = ["qkv_proj", "out_proj"]
ROWS = {
    "full-lr3e-4": {"lr": 3e-4},
    "full-lr1e-3": {"lr": 1e-3},
    "full-lr3e-3": {"lr": 3e-3},
    "lora-r8-all-lr3e-3": {"lr": 3e-3, "lora": {"r": 8, "alpha": 16, "targets": "all"}},
    "lora-r8-all-lr1e-2": {"lr": 1e-2, "lora": {"r": 8, "alpha": 16, "targets": "all"}},
    "lora-r8-all-lr3e-2": {"lr": 3e-2, "lora": {"r": 8, "alpha": 16, "targets": "all"}},
    "lora-r8-attn-lr1e-2": {"lr": 1e-2, "lora": {"r": 8, "alpha": 16, "targets": ATTENTION}},
    "lora-r32-all-lr1e-2": {"lr": 1e-2, "lora": {"r": 32, "alpha": 64, "targets": "all"}},
}
"""The fine-tunes, in the order they run: the full rows set the gain LoRA is measured by."""

TINY_MODEL = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=16"]
TINY_BASE = [*TINY_MODEL, "train.steps=6", "train.eval_every=6", "train.checkpoint_every=6",
             "train.warmup_steps=1", "train.eval_batches=2"]


def tformer(*args: str) -> str:
    """`tformer ARGS` in its own process on one thread; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tformer", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"tformer {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def base_facts(base: Path) -> tuple[set[str], int]:
    """The characters the base's tokenizer has ids for, and the base's parameter count."""
    from tformer.api import load
    from tformer.errors import TformerError

    try:
        model = load(base, device="cpu", threads=1)
    except TformerError as e:
        raise SystemExit(f"--base {base}: {e}") from None
    if model.tokenizer.kind != "char":
        raise SystemExit(f"--base {base}: its tokenizer is {model.tokenizer.kind}; this "
                         f"benchmark fine-tunes a character-level base")
    return set(model.tokenizer.stoi), model.parameters


def derive_text(lines: list[str], chars: set[str], out: Path) -> tuple[int, int]:
    """Write the lines with <unk> as one known character, leaving out those that still hold
    a character outside `chars`; (lines kept, lines given)."""
    kept = [line for line in (ln.replace(*UNK) for ln in lines) if set(line) <= chars]
    out.write_text("".join(kept), encoding="utf-8")
    return len(kept), len(lines)


def finetune_config(work: Path, base: Path, texts: dict[str, Path], steps: int) -> Path:
    """The fine-tunes' shared config: data and schedule; the model comes from the base."""
    config = work / "finetune.toml"
    config.write_text(f"""[data]
path = {json.dumps(str(texts["train"]))}
val_path = {json.dumps(str(texts["valid"]))}

[train]
init_from = {json.dumps(str(base))}
steps = {steps}
batch_size = 12
warmup_steps = {max(1, steps // 20)}
schedule = "linear"
weight_decay = 0.0
beta2 = 0.99
grad_clip = 0.0
eval_every = {steps}
checkpoint_every = {steps}
""", encoding="utf-8")
    return config


def row_overrides(row: dict) -> list[str]:
    """A ROWS entry as train.* overrides: its rate (min_lr a tenth of it) and adapters."""
    overrides = [f"train.lr={row['lr']:g}", f"train.min_lr={row['lr'] / 10:g}"]
    for key, value in row.get("lora", {}).items():
        overrides.append(f"train.lora.{key}={json.dumps(value)}")
    return overrides


def trainable(run: Path, base_parameters: int) -> int:
    """The parameters a run trained: its adapters' if it has any, else every weight."""
    from safetensors import safe_open

    adapters = run / "best" / "adapters.safetensors"
    if not adapters.exists():
        return base_parameters
    with safe_open(str(adapters), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def last_val_loss(run: Path) -> float:
    with open(run / "metrics.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "val"][-1]


def finetune(config: Path, out: Path, row: dict, overrides: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    tformer("train", str(config), "--out", str(out), *row_overrides(row), *overrides)
    return {"after": last_val_loss(out), "wall_s": time.perf_counter() - start}


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, int, dict[str, Path]]:
    """The base run (trained here unless given), its parameter count, and the fine-tuning
    texts it can read. --tiny: a base of this file's text, fine-tuned on it lower-cased."""
    base = args.base
    if args.tiny:
        source = work / "source.txt"
        source.write_text(Path(__file__).read_text(encoding="utf-8"), encoding="utf-8")
        lines = source.read_text(encoding="utf-8").lower().splitlines(keepends=True)
        split = len(lines) * 4 // 5
        sources = {"train": lines[:split], "valid": lines[split:]}
    else:
        for path in (*PTB.values(), *([] if base else [SHAKESPEARE])):
            if not path.is_file():
                raise SystemExit(f"{path} not found: the benchmark reads ../shared/data")
        sources = {split: path.read_text(encoding="utf-8").splitlines(keepends=True)
                   for split, path in PTB.items()}
    if base is None:
        base = work / "base"
        data = work / "source.txt" if args.tiny else SHAKESPEARE
        start = time.perf_counter()
        tformer("train", str(BASE_CONFIG), "--out", str(base), f"data.path={data}",
                *(TINY_BASE if args.tiny else []))
        print(f"base trained in {time.perf_counter() - start:.0f} s: {base}", file=sys.stderr)
    chars, parameters = base_facts(base)
    texts = {}
    for split, lines in sources.items():
        texts[split] = work / f"finetune.{split}.txt"
        kept, given = derive_text(lines, chars, texts[split])
        print(f"{split}: {kept:,} of {given:,} lines kept", file=sys.stderr)
    return base, parameters, texts


def measure(args: argparse.Namespace, work: Path) -> dict:
    base, base_parameters, texts = prepare(args, work)
    before = json.loads(tformer("evaluate", str(base), str(texts["valid"]), "--json"))["loss"]
    config = finetune_config(work, base, texts, args.steps)
    rows = {}
    for name in args.rows:
        out = work / name
        rows[name] = {**finetune(config, out, ROWS[name], args.overrides),
                      "trainable": trainable(out, base_parameters)}
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    full = [r["after"] for name, r in rows.items() if "lora" not in ROWS[name]]
    best_full = min(full) if full else None
    for r in rows.values():
        r["gain"] = before - r["after"]
        r["of_full"] = r["gain"] / (before - best_full) if best_full is not None else None
    described = str(base) if args.base else f"{BASE_CONFIG.name} trained here"
    return {"base": described, "steps": args.steps, "before": before,
            "base_parameters": base_parameters, "rows": rows}


def print_table(result: dict) -> None:
    print(f"base {result['base']} ({result['base_parameters']:,} parameters), "
          f"{result['steps']} fine-tuning steps; gain / full: over the best full row")
    print("| run | trainable | val loss before | after | gain | gain / full | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in result["rows"].items():
        of_full = "-" if r["of_full"] is None else f"{r['of_full']:.3f}"
        print(f"| {name} | {r['trainable']:,} | {result['before']:.4f} | {r['after']:.4f} | "
              f"{r['gain']:.4f} | {of_full} | {r['wall_s']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a character-level run to fine-tune "
                        "(default: train one with configs/gpt-shakespeare-char.toml)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        metavar="NAME", help=f"fine-tunes to run, of: {'; '.join(ROWS)}")
    parser.add_argument("--workdir", type=Path,
                        help="keep the runs and derived text here (default: a temporary folder)")
    parser.add_argument("--tiny", action="store_true", help="check the script in seconds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", help="key=value for every fine-tune")
    args = parser.parse_args()
    if args.tiny:
        args.steps = 4
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args, work)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
