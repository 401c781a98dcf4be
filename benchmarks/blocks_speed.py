"""Decoding speed of the real SmolLM2-135M-Instruct with each weight format, side by side
in one run: greedy tokens/s at batch 1 on 1 and 2 threads and at batch 8, and prompt
processing of 2,048 tokens (tokens/s), for fp32, per-row int8, the block formats
quantized at load, and the GGUF file's own blocks (blocks_quality.py loads them).

Formats are timed in alternation, the median of --repeats runs each, so a busy machine
slows them alike; compare ratios within a run.

    python benchmarks/blocks_speed.py [--repeats 3] [--new 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from blocks_quality import FORMATS, in_format, smollm2

from tformer.decoding.lm import generate
from tformer.kernels.build import ISA_NAMES
from tformer.kernels.matvec import isa


def decode(model, batch: int, new: int):
    prompt = torch.randint(100, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    return lambda: list(generate(model, prompt, max_new_tokens=new, temperature=0.0))


def prefill(model, length: int):
    ids = torch.randint(100, 1000, (1, length), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.no_grad():
            model(ids, last_only=True)

    return run


def rates(fns: dict, work: float, repeats: int) -> dict[str, float]:
    """Median work/second of each callable, timed in alternation after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: work / statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    args = ap.parse_args()
    model, _ = smollm2()
    models = {fmt: in_format(model, fmt) for fmt in args.formats}
    cases = [("greedy b1, 1 thread", 1, lambda m: decode(m, 1, args.new), args.new),
             ("greedy b1, 2 threads", 2, lambda m: decode(m, 1, args.new), args.new),
             ("greedy b8, 2 threads", 2, lambda m: decode(m, 8, args.new), 8 * args.new),
             (f"prompt {args.prompt}, 2 threads", 2, lambda m: prefill(m, args.prompt),
              args.prompt)]
    print(f"SmolLM2-135M-Instruct, tokens/s (median of {args.repeats}); kernels: "
          f"{ISA_NAMES[isa()]}")
    print("| case | " + " | ".join(args.formats) + " |")
    print("|---|" + "---|" * len(args.formats))
    for label, threads, make, work in cases:
        torch.set_num_threads(threads)
        got = rates({fmt: make(m) for fmt, m in models.items()}, work, args.repeats)
        print(f"| {label} | " + " | ".join(f"{got[f]:.1f}" for f in args.formats) + " |",
              flush=True)


if __name__ == "__main__":
    main()
