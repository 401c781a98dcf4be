"""Decoding speed of a mixture of experts against a dense model of the same active size, at
batch 1, greedy, with random weights: the layer shape of Qwen3-30B-A3B (d_model 2048, 32
query and 4 key/value heads of 128, q/k norms, 128 experts of width 768, 8 chosen a token)
with fewer layers, beside a dense model whose gated feed-forward is 8 x 768 = 6144 wide, the
same weights read per token. Only the chosen experts' weights are read, so the mixture
should decode near the dense model's speed although it holds 16 times its feed-forward
weights; the gap is the routing (a top-k and k small products where the dense model has
one large one).

Models are timed in alternation, the median of --repeats runs each, so a busy machine slows
them alike; compare ratios within a run. The vocabulary is small by default (--vocab): the
output layer is the same for both models and would hide the difference. Each run is timed
twice over: its generation alone, from the first new token to the last (as llama-bench's
generation test, which does not time the prompt it decodes after), and the whole run with
the prompt's pass (`with prompt`): a mixture's prompt reads most of its experts, several
times the bytes of its dense twin's, which a short run's figure then carries.

    python benchmarks/moe_speed.py [--layers 2] [--weights fp32 q8_0] [--new 32]
    python benchmarks/moe_speed.py --tiny     # a check that it runs, in seconds

With --gguf TYPE both models are GGUF files instead (benchmarks/kquant_model.py writes them
in TYPE, Qwen3-MoE's and Qwen3's layouts), `tformer import`ed with their blocks kept and
timed on each of --threads-list, beside llama.cpp's `llama-bench` on the same two files
(`make bench` builds it): generation after a --prompt-token prompt, the median of its
--repeats samples.

    python benchmarks/moe_speed.py --gguf q4_0 [--threads-list 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tformer.decoding.lm import generate
from tformer.kernels.formats import quantize_model
from tformer.layers import MixtureOfExperts
from tformer.models.gpt import GPT, GPTConfig

QWEN3_30B_A3B = {"d_model": 2048, "n_head": 32, "n_kv_head": 4, "d_head": 128,
                 "n_expert": 128, "n_expert_active": 8, "d_expert": 768}
TINY = {"d_model": 64, "n_head": 4, "n_kv_head": 2, "d_head": 16, "n_expert": 8,
        "n_expert_active": 2, "d_expert": 32}


def configs(shape: dict, layers: int, vocab: int) -> dict[str, GPTConfig]:
    """The mixture and its dense twin (the same attention, a feed-forward as wide as the
    chosen experts together)."""
    common = {"vocab_size": vocab, "n_layer": layers, "n_head": shape["n_head"],
              "n_kv_head": shape["n_kv_head"], "d_head": shape["d_head"],
              "d_model": shape["d_model"], "context": 512, "position": "none",
              "rotary": True, "qk_norm": True, "norm_kind": "rmsnorm", "bias": False,
              "feedforward": "gated", "activation": "silu", "tie_embeddings": False}
    active = shape["n_expert_active"] * shape["d_expert"]
    return {
        f"{shape['n_expert']} experts, {shape['n_expert_active']} active": GPTConfig(
            **common, d_ff=shape["d_expert"], n_expert=shape["n_expert"],
            n_expert_active=shape["n_expert_active"], router_renormalise=True),
        f"dense, d_ff {active}": GPTConfig(**common, d_ff=active),
    }


def active_params(model: GPT) -> int:
    """The parameters a token uses: all but the stacked experts, and of those the chosen."""
    total = model.num_params()
    for block in model.blocks:
        ff = block.ff
        if isinstance(ff, MixtureOfExperts):
            stacked = sum(p.numel() for p in ff.experts.parameters())
            total -= stacked - stacked * ff.router.k // ff.router.weight.shape[0]
    return total


def write_files(shape: dict, args: argparse.Namespace, folder: Path) -> dict[str, Path]:
    """The mixture and its dense twin as GGUF files of type args.gguf (kquant_model.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kquant_model import write

    common = {"type": args.gguf, "layers": args.layers, "d_model": shape["d_model"],
              "heads": shape["n_head"], "kv_heads": shape["n_kv_head"],
              "head_dim": shape["d_head"], "vocab": args.vocab, "context": 4096, "seed": 0,
              "experts": shape["n_expert"], "active": shape["n_expert_active"],
              "d_expert": shape["d_expert"]}
    active = shape["n_expert_active"] * shape["d_expert"]
    files = {f"{shape['n_expert']} experts, {shape['n_expert_active']} active":
             {"arch": "qwen3moe", "ff": active},
             f"dense, d_ff {active}": {"arch": "qwen3", "ff": active}}
    paths = {}
    for name, extra in files.items():
        paths[name] = folder / f"{extra['arch']}-{args.gguf}.gguf"
        write(argparse.Namespace(out=paths[name], **common, **extra))
    return paths


def timed_run(model: GPT, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    """One greedy run of `new` tokens: (seconds for all of it, seconds from the first new
    token to the last)."""
    start = time.perf_counter()
    with torch.no_grad():
        tokens = generate(model, prompt, max_new_tokens=new, temperature=0.0)
        next(tokens)
        first = time.perf_counter()
        for _ in tokens:
            pass
    end = time.perf_counter()
    return end - start, end - first


def rates(times: list[tuple[float, float]], new: int) -> tuple[float, float]:
    """Tokens a second over the timed runs (the first, a warm-up, left out): generation
    alone (new - 1 tokens after the first), and the whole run with its prompt."""
    whole = statistics.median(t[0] for t in times[1:])
    generation = statistics.median(t[1] for t in times[1:])
    return (new - 1) / max(generation, 1e-9), new / whole


def gguf_rows(shape: dict, args: argparse.Namespace) -> None:
    """--gguf: both files through tformer (alternating) and llama-bench, per thread count."""
    import llama_cpp

    import tformer
    from tformer.interop.gguf import import_gguf

    have_peer = llama_cpp.available() and not args.tiny
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(shape, args, Path(tmp))
        models = {name: tformer.load(import_gguf(path, Path(tmp) / f"run{i}")).module
                  for i, (name, path) in enumerate(paths.items())}
        prompt = torch.randint(0, args.vocab, (1, args.prompt),
                               generator=torch.Generator().manual_seed(0))
        print(f"\nbatch 1, greedy, {args.new} tokens after a prompt of {args.prompt}, "
              f"{args.layers} layers, vocabulary {args.vocab}, GGUF {args.gguf}"
              + (f"; llama.cpp: {llama_cpp.isa_summary()}" if have_peer else ""))
        print("| model | threads | file (MiB) | tformer tokens/s | with prompt | "
              "llama.cpp tokens/s | tformer ÷ llama.cpp |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for threads in args.threads_list:
            torch.set_num_threads(threads)
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
            for _ in range(args.repeats + 1):  # the first round warms up, untimed
                for name, model in models.items():
                    times[name].append(timed_run(model, prompt, args.new))
            for name, path in paths.items():
                ours, whole = rates(times[name], args.new)
                peer = "-"
                if have_peer:
                    rows = llama_cpp.bench(path, threads, n_gen=args.new, depth=args.prompt,
                                           repetitions=args.repeats)
                    theirs = statistics.median(rows[0].samples or (rows[0].tokens_per_s,))
                    peer = f"{theirs:,.1f} | {ours / theirs:.2f}"
                else:
                    peer = "- | -"
                print(f"| {name} | {threads} | {path.stat().st_size / 2**20:,.0f} | "
                      f"{ours:,.1f} | {whole:,.1f} | {peer} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--weights", nargs="+", default=["fp32", "q8_0"])
    parser.add_argument("--new", type=int, default=32, help="tokens generated a run")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, to check it runs")
    parser.add_argument("--gguf", default=None, metavar="TYPE",
                        help="GGUF files of this type (q4_0, q8_0, q4_k_m, ...) through tformer "
                             "and llama.cpp instead")
    parser.add_argument("--threads-list", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = TINY if args.tiny else QWEN3_30B_A3B
    if args.gguf:
        gguf_rows(shape, args)
        return
    built = {name: GPT(cfg).eval() for name, cfg in configs(shape, args.layers,
                                                             args.vocab).items()}
    prompt = torch.randint(0, args.vocab, (1, args.prompt))
    rows = []
    for fmt in args.weights:
        models = {name: quantize_model(model, fmt) for name, model in built.items()}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
        for _ in range(args.repeats + 1):  # the first round warms up, untimed
            for name, model in models.items():
                times[name].append(timed_run(model, prompt, args.new))
        for name in models:
            rows.append((name, fmt, built[name].num_params() / 1e6,
                         active_params(built[name]) / 1e6, *rates(times[name], args.new)))
        del models

    print(f"\nbatch 1, greedy, {args.new} tokens after a prompt of {args.prompt}, "
          f"{args.layers} layers, vocabulary {args.vocab}, {args.threads} threads")
    print("| model | weights | parameters (M) | active (M) | tokens/s | with prompt |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, fmt, params, read, speed, whole in rows:
        print(f"| {name} | {fmt} | {params:,.1f} | {read:,.1f} | {speed:,.1f} | "
              f"{whole:,.1f} |")


if __name__ == "__main__":
    main()
