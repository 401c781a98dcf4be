"""Many-row speed of the real SmolLM2-135M-Instruct with each weight format, side by side in
one run: prompt processing of 512 and 2,048 tokens and greedy decoding at batch 8
(tokens/s), for fp32, per-row int8 and the block formats as they run by default (no
repacked copy kept: products of blocks.REPACK_CALL_ROWS rows and more repack the weights
for the call, fewer read the file's layout); and, for comparison, the block formats named
FORMAT:kept with the repacked copy kept (blocks.keep_repacked: products of five rows and
more over it) and FORMAT:file with repacking turned off, every product over the file's own
layout.

Formats are timed in alternation, the median of --repeats runs each, so a busy machine
slows them alike; compare the ratios within a run (each row also gives them to fp32 and
to int8).

    python benchmarks/block_rows.py [--repeats 3] [--threads 2] [--prompts 512 2048]
                                    [--formats fp32 int8 q4_1 ...]
"""

from __future__ import annotations

import argparse

import torch

from tformer.kernels import blocks

DEFAULT = ("fp32", "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "file", "q4_1:kept",
           "q4_1:file", "file:kept", "file:file")


def unrepacked(model):
    """`model` with every block layer's repacking turned off, in place: its products of
    many rows go through the file's layout."""
    blocks.keep_repacked(model, False)
    for m in model.modules():
        if isinstance(m, blocks.BlockLinear):
            m.repack_rows = blocks.NEVER
        if isinstance(m, blocks.StackedLinear):
            for part in m.parts:
                part.repack_rows = blocks.NEVER
    return model


def kept(model):
    """`model` with every block layer keeping its weights repacked, in place."""
    blocks.keep_repacked(model)
    return model


def variant(model, fmt: str):
    base, _, how = fmt.partition(":")
    return {"": lambda m: m, "kept": kept, "file": unrepacked}[how](model(base))


def main() -> None:
    # (sibling scripts: importable where this one runs as a script)
    from blocks_quality import in_format, smollm2, tiny_model
    from blocks_speed import decode, prefill, rates

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32, help="tokens each of batch 8's rows decodes")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--formats", nargs="+", default=list(DEFAULT))
    ap.add_argument("--tiny", action="store_true",
                    help="a random tiny model and short prompts, to try the script")
    args = ap.parse_args()
    if args.tiny:
        model, prompts, args.new = tiny_model(), (16, 32), 2
        args.formats = [f for f in args.formats if not f.startswith("file")]
    else:
        model, _ = smollm2()
        prompts = args.prompts
    models = {fmt: variant(lambda base: in_format(model, base), fmt) for fmt in args.formats}
    torch.set_num_threads(args.threads)
    name = "a random tiny model" if args.tiny else "SmolLM2-135M-Instruct"
    print(f"{name}, tokens/s (median of {args.repeats}), {args.threads} threads; "
          f"block kernels: {blocks.path()}; X: no repacked copy (repacked for a call of "
          f"{blocks.REPACK_CALL_ROWS} rows and more); X:kept = the copy kept; X:file = every "
          f"product over the file's layout (no repacking)")
    cases = [*((f"prompt {n}", lambda m, n=n: prefill(m, n), n) for n in prompts),
             ("greedy b8", lambda m: decode(m, 8, args.new), 8 * args.new)]
    print("| case | format | tokens/s | x fp32 | x int8 |")
    print("|---|---|---|---|---|")
    for label, make, work in cases:
        got = rates({fmt: make(m) for fmt, m in models.items()}, work, args.repeats)
        for fmt, rate in got.items():
            ratio = {base: f"{rate / got[base]:.2f}" if base in got else "-"
                     for base in ("fp32", "int8")}
            print(f"| {label} | {fmt} | {rate:.1f} | {ratio['fp32']} | {ratio['int8']} |",
                  flush=True)


if __name__ == "__main__":
    main()
