"""Decoding speed of the real SmolLM2-135M-Instruct with each weight format, side by side
in one run: greedy tokens/s at batch 1 on 1 and 2 threads and at batch 8, and prompt
processing of 2,048 tokens (tokens/s), for fp32, per-row int8, the block formats
quantized at load, and the GGUF file's own blocks (blocks_quality.py loads them); and
llama.cpp on the same file where its tools are built (`make bench`, benchmarks/llama_cpp.py):
llama-bench's generation after a 16-token prompt (`-n NEW -d 16`) and prompt processing
(`-p PROMPT`), the median of its --repeats samples; not the batch-8 row (llama-bench times
one sequence).

Formats are timed in alternation, the median of --repeats runs each, so a busy machine
slows them alike; llama-bench runs right after them in each case. Compare ratios within a
run.

    python benchmarks/blocks_speed.py [--repeats 3] [--new 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tformer.decoding.lm import generate
from tformer.kernels import blocks


def ids(model, shape: tuple[int, ...]) -> torch.Tensor:
    """Token ids away from the special ones, the same for every model."""
    top = min(1000, model.cfg.vocab_size)
    return torch.randint(top // 3, top, shape, generator=torch.Generator().manual_seed(0))


def decode(model, batch: int, new: int):
    prompt = ids(model, (batch, 16))
    return lambda: list(generate(model, prompt, max_new_tokens=new, temperature=0.0))


def prefill(model, length: int):
    prompt = ids(model, (1, length))

    def run():
        with torch.no_grad():
            model(prompt, last_only=True)

    return run


def llama_cpp_rate(threads: int, label: str, new: int, prompt: int, repeats: int) -> float:
    """llama-bench's median tokens/s on the GGUF file for one case of the table."""
    import llama_cpp
    from blocks_quality import gguf_path

    if label.startswith("prompt"):
        rows = llama_cpp.bench(gguf_path(), threads, n_prompt=prompt, repetitions=repeats)
    else:
        rows = llama_cpp.bench(gguf_path(), threads, n_gen=new, depth=16, repetitions=repeats)
    return statistics.median(rows[0].samples or (rows[0].tokens_per_s,))


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
    # (a sibling script: importable where this one runs as a script)
    from blocks_quality import FORMATS, in_format, smollm2, tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--formats", nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="every case on this many threads (default: 1 and 2 as labelled)")
    ap.add_argument("--tiny", action="store_true",
                    help="a random tiny model, 2 new tokens, a 16-token prompt, no llama.cpp")
    args = ap.parse_args()
    if args.tiny:
        model, args.new, args.prompt = tiny_model(), 2, 16
        args.formats = args.formats or [f for f in FORMATS if f != "file"]
    else:
        model, _ = smollm2()
        args.formats = args.formats or list(FORMATS)
    models = {fmt: in_format(model, fmt) for fmt in args.formats}
    cases = [("greedy b1", 1, lambda m: decode(m, 1, args.new), args.new),
             ("greedy b1", 2, lambda m: decode(m, 1, args.new), args.new),
             ("greedy b8", 2, lambda m: decode(m, 8, args.new), 8 * args.new),
             (f"prompt {args.prompt}", 2, lambda m: prefill(m, args.prompt), args.prompt)]
    if args.threads is not None:
        cases = [(label, args.threads, make, work) for label, threads, make, work in cases
                 if (label, threads) != ("greedy b1", 2)]
    name = "a random tiny model" if args.tiny else "SmolLM2-135M-Instruct"
    print(f"{name}, tokens/s (median of {args.repeats}); block kernels: {blocks.path()}")
    import llama_cpp  # a sibling script

    have_peer = not args.tiny and llama_cpp.available()
    columns = list(args.formats) + (["llama.cpp"] if have_peer else [])
    if have_peer:
        print(f"llama.cpp: {llama_cpp.isa_summary()}")
    elif not args.tiny:
        print("(llama.cpp's rows need its tools: `make bench` or "
              "`python benchmarks/llama_cpp.py build`)")
    print("| case | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label, threads, make, work in cases:
        torch.set_num_threads(threads)
        label = f"{label}, {threads} thread{'s' if threads > 1 else ''}"
        fns = {fmt: make(m) for fmt, m in models.items()}
        got = rates(fns, work, args.repeats)
        if have_peer and "b8" not in label:
            got["llama.cpp"] = llama_cpp_rate(threads, label, args.new, args.prompt,
                                              args.repeats)
        print(f"| {label} | " + " | ".join(f"{got[f]:.1f}" if f in got else "-"
                                          for f in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
