"""Batch-1 GPT decoding: torch.compile (Inductor, frozen weights) against tformer's
hand-written kernel path, and plain eager PyTorch.

    python benchmarks/compile_decoding.py [--size small|gpt2] [--new-tokens 64] [--rounds 5]

Three ways to run the same model's greedy generation with the KV cache:
  eager     the model as it is: nn.Linear through F.linear (MKL's sgemm on this build)
  kernel    what `tformer generate` runs: prepack() (the AVX2 matvec kernel for 1-4 rows,
            oneDNN on reordered weights above)
  compiled  torch.compile(model, dynamic=True) with torch._inductor.config.freezing: the
            weights are constants of the graph, which Inductor may reorder for oneDNN
            itself, and the step's small operations are fused into generated C++
The three are timed in alternation, round after round, in one run (this machine is
shared), and the table gives medians and ratios; compile time is reported apart.
The tokens of all three are checked equal before timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tformer.decoding.lm import generate
from tformer.kernels.prepack import prepack
from tformer.models.gpt import GPT, GPTConfig

SIZES = {
    "small": GPTConfig(vocab_size=512, context=256, n_layer=4, n_head=4, d_model=128),
    "gpt2": GPTConfig(vocab_size=50257, context=1024, n_layer=12, n_head=12, d_model=768),
}


def tokens(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    return torch.stack(list(generate(model, prompt, max_new_tokens=new, temperature=0.0)), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="gpt2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(SIZES[args.size]).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 16))
    import torch._inductor.config as inductor

    inductor.freezing = True
    candidates = {"eager": model, "kernel": prepack(model)}
    start = time.perf_counter()
    with torch.no_grad():  # freezing applies to inference graphs
        candidates["compiled"] = torch.compile(model, dynamic=True)
        reference = tokens(model, prompt, args.new_tokens)
        for name, candidate in candidates.items():
            began = time.perf_counter()
            got = tokens(candidate, prompt, args.new_tokens)
            if name == "compiled":
                compile_s = time.perf_counter() - began
            assert torch.equal(got, reference), f"{name} decoded other tokens"
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(args.rounds):
            for name, candidate in candidates.items():
                began = time.perf_counter()
                tokens(candidate, prompt, args.new_tokens)
                times[name].append(time.perf_counter() - began)
    total = time.perf_counter() - start

    cfg = model.cfg
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GPT "
          f"{cfg.n_layer}x{cfg.d_model} vocab {cfg.vocab_size}, batch 1, 16-token prompt, "
          f"{args.new_tokens} new tokens greedy; medians of {args.rounds} interleaved rounds")
    kernel = statistics.median(times["kernel"])
    print(f"{'path':<10} {'tokens/s':>10} {'ms/token':>10} {'vs kernel':>10}")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"{name:<10} {args.new_tokens / median:>10.1f} "
              f"{1000 * median / args.new_tokens:>10.2f} {kernel / median:>9.2f}x")
    print(f"first compiled generation (compiling included): {compile_s:.1f} s; "
          f"whole run {total:.0f} s")


if __name__ == "__main__":
    main()
