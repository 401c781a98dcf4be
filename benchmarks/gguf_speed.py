"""One GGUF file through tformer and through llama.cpp, side by side in one run: greedy
tokens/s at batch 1 on each thread count, greedy batch 8, and prompts (by default 512 and
2,048 tokens); beside each batch-1 rate, the share of the machine's read bandwidth it
reaches.

    python benchmarks/gguf_speed.py [--file F.gguf] [--repeats 3] [--new 64]
        [--threads 1 2] [--prompts 512 2048] [--fp32]

The file (default: the real SmolLM2-135M-Instruct's, Q4_1) is `tformer import`ed, its
blocks kept as they are; --fp32 times the same model with every product in fp32 beside it
(the prompts' goal is stated against it). llama.cpp's side is its own `llama-bench` on the
same file (`make bench` builds it; benchmarks/llama_cpp.py): generation after a 16-token
prompt (`-n NEW -d 16`) and prompt processing (`-p N`), the median of --repeats samples;
it times one sequence, so the batch-8 row has no peer. tformer's formats are timed in
alternation (median of --repeats), llama-bench right after them in each case: compare the
ratios within a run.

Bandwidth: bytes a batch-1 token reads (every weight a product reads once a token, the
output layer included, the embedding's one row and the KV cache left out) × tokens/s ÷ a
streaming read of 1 GiB (torch's sum, the best of five, on the same threads, measured in
the same case). llama.cpp's bytes are the file's tensors (less token_embd where the file
has its own output layer).

--tiny writes a small random Q4_K_M file (benchmarks/kquant_model.py's shape at 2 layers)
and runs 2 tokens of it, without llama.cpp, its read bandwidth over 16 MiB rather than 1 GiB:
a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def stream_read_gbs(threads: int, gib: float = 1.0, tries: int = 5) -> float:
    """The machine's read bandwidth as torch's sum over `gib` GiB of fp32 sees it (GB/s), the
    best of `tries`."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(tries))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights a batch-1 step reads: each product's weight (its blocks, or its fp32
    or int8 matrix) once, norms and biases too; not the embedding table (one row of it)."""
    from tformer.kernels.blocks import BlockLinear, StackedLinear

    total, seen = 0, set()
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            tensors = []
        elif isinstance(m, (BlockLinear, StackedLinear)):  # (their .weight decodes blocks)
            tensors = [m.blocks, m.bias]
        else:
            tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def file_bytes_per_token(path: Path) -> int:
    """llama.cpp's batch-1 reads: every tensor of the file, less token_embd where an output
    tensor of its own exists."""
    import gguf

    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def tiny_file(folder: Path) -> Path:
    """kquant_model.py's file at 2 layers, d_model 256, written in this process (a
    subprocess spent its 2-3 s starting Python and torch again; its lines are not shown)."""
    from kquant_model import write

    out = folder / "tiny-q4_k_m.gguf"
    with contextlib.redirect_stdout(io.StringIO()):
        write(argparse.Namespace(out=out, type="q4_k_m", layers=2, d_model=256, ff=512, heads=4,
                                 kv_heads=2, vocab=1024, context=4096, seed=0, arch="llama",
                                 head_dim=None, experts=128, active=8, d_expert=768))
    return out


def main() -> None:
    # (sibling scripts: importable where this one runs as a script)
    import llama_cpp
    from blocks_quality import gguf_path
    from blocks_speed import decode, prefill, rates

    import tformer
    from tformer.interop.gguf import import_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--fp32", action="store_true",
                    help="time the same model in fp32 beside the file's blocks")
    ap.add_argument("--tiny", action="store_true", help="a small random file, to try it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            args.file, args.new, args.prompts, args.repeats = tiny_file(Path(tmp)), 2, [16], 1
        path = args.file or gguf_path()
        run = import_gguf(path, Path(tmp) / "run")
        models = {"tformer": tformer.load(run, threads=max(args.threads)).module}
        if args.fp32:
            models["tformer fp32"] = tformer.load(run, weights="fp32",
                                                  threads=max(args.threads)).module
        have_peer = not args.tiny and llama_cpp.available()
        top = max(args.threads)
        on_top = f"{top} thread{'s' * (top > 1)}"
        cases = [*((f"greedy b1, {t} thread{'s' * (t > 1)}", t,
                    lambda m: decode(m, 1, args.new), args.new) for t in args.threads),
                 (f"greedy b{args.batch}, {on_top}", top,
                  lambda m: decode(m, args.batch, args.new), args.batch * args.new),
                 *((f"prompt {n}, {on_top}", top, lambda m, n=n: prefill(m, n), n)
                   for n in args.prompts)]
        ours = bytes_per_token(models["tformer"])
        theirs = file_bytes_per_token(path)
        print(f"{path.name} ({path.stat().st_size / 2**20:,.0f} MiB), tokens/s, median of "
              f"{args.repeats}; a batch-1 token reads {ours / 1e6:,.0f} MB in tformer, "
              f"{theirs / 1e6:,.0f} MB in llama.cpp")
        if have_peer:
            print(f"llama.cpp: {llama_cpp.isa_summary()}")
        elif not args.tiny:
            print("(llama.cpp's rows need its tools: `make bench` or "
                  "`python benchmarks/llama_cpp.py build`)")
        columns = [*models, *(["llama.cpp", "tformer ÷ llama.cpp"] if have_peer else []),
                   "read GB/s", "tformer's share", *(["llama.cpp's share"] if have_peer else [])]
        print("| case | " + " | ".join(columns) + " |")
        print("|---|" + "---|" * len(columns))
        for label, threads, make, work in cases:
            torch.set_num_threads(threads)
            got = rates({name: make(m) for name, m in models.items()}, work, args.repeats)
            cells = {name: f"{rate:.1f}" for name, rate in got.items()}
            peer = None
            if have_peer and ("b1," in label or label.startswith("prompt")):
                prompt = int(label.split()[1].rstrip(",")) if label.startswith("prompt") else 0
                rows = (llama_cpp.bench(path, threads, n_prompt=prompt, repetitions=args.repeats)
                        if prompt else
                        llama_cpp.bench(path, threads, n_gen=args.new, depth=16,
                                        repetitions=args.repeats))
                peer = statistics.median(rows[0].samples or (rows[0].tokens_per_s,))
                cells["llama.cpp"] = f"{peer:.1f}"
                cells["tformer ÷ llama.cpp"] = f"{got['tformer'] / peer:.2f}"
            if "b1," in label:
                gbs = stream_read_gbs(threads, gib=1 / 64 if args.tiny else 1.0)
                cells["read GB/s"] = f"{gbs:.1f}"
                cells["tformer's share"] = f"{got['tformer'] * ours / 1e9 / gbs:.0%}"
                if peer is not None:
                    cells["llama.cpp's share"] = f"{peer * theirs / 1e9 / gbs:.0%}"
            print(f"| {label} | " + " | ".join(cells.get(c, "-") for c in columns) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
