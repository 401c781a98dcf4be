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
output layer is the same for both models and would hide the difference.

    python benchmarks/moe_speed.py [--layers 2] [--weights fp32 q8_0] [--new 32]
    python benchmarks/moe_speed.py --tiny     # a check that it runs, in seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = TINY if args.tiny else QWEN3_30B_A3B
    built = {name: GPT(cfg).eval() for name, cfg in configs(shape, args.layers,
                                                             args.vocab).items()}
    prompt = torch.randint(0, args.vocab, (1, args.prompt))
    rows = []
    for fmt in args.weights:
        models = {name: quantize_model(model, fmt) for name, model in built.items()}
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats + 1):  # the first round warms up, untimed
            for name, model in models.items():
                start = time.perf_counter()
                with torch.no_grad():
                    list(generate(model, prompt, max_new_tokens=args.new, temperature=0.0))
                times[name].append(time.perf_counter() - start)
        for name in models:
            seconds = statistics.median(times[name][1:])
            rows.append((name, fmt, built[name].num_params() / 1e6,
                         active_params(built[name]) / 1e6, args.new / seconds))
        del models

    print(f"\nbatch 1, greedy, {args.new} tokens after a prompt of {args.prompt}, "
          f"{args.layers} layers, vocabulary {args.vocab}, {args.threads} threads")
    print("| model | weights | parameters (M) | active (M) | tokens/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, fmt, params, read, speed in rows:
        print(f"| {name} | {fmt} | {params:,.1f} | {read:,.1f} | {speed:,.1f} |")


if __name__ == "__main__":
    main()
