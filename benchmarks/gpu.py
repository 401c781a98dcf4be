"""GPU figures: training MFU against the device's bf16 peak, and decoding tokens/s.

    python benchmarks/gpu.py                    # GPT-2 small shapes on the first CUDA device
    python benchmarks/gpu.py --compile          # the training step through torch.compile
    python benchmarks/gpu.py --device cpu --tiny --peak-tflops 1   # a smoke run of the code

Training: bf16 autocast, fused AdamW, a batch of B sequences of T tokens. Model FLOPs per
token are 6N for the weights (forward 2N, backward 4N) plus 12 L T D for attention's
scores and weighted sums (Chowdhery et al. 2022, "PaLM", appendix B); MFU is the achieved
model FLOP/s over the device's dense bf16 peak, from the table below or --peak-tflops.

Decoding: batch-1 greedy generation with the KV cache, in fp32 and with bf16 weights,
tokens/s over the new tokens after a warm-up. Prints one table; medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tformer.decoding.lm import generate
from tformer.evaluation.loss import Targets
from tformer.models.gpt import GPT, GPTConfig
from tformer.training.device import autocast

# Dense bf16 tensor-core peaks in TFLOP/s from the vendors' data sheets (no sparsity).
# A name without "PCIe" is taken for the SXM part.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H100 PCIe": 756.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
}


def peak_tflops(device: torch.device, given: float | None) -> float:
    if given is not None:
        return given
    name = torch.cuda.get_device_name(device)
    # The longest matching key: "H100 PCIe" before "H100".
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if all(part in name for part in key.split()):
            return PEAK_BF16_TFLOPS[key]
    sys.exit(f"no bf16 peak known for {name!r}; pass --peak-tflops")


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def training(cfg: GPTConfig, device: torch.device, batch: int, steps: int, compile: bool,
             repeats: int) -> tuple[float, float]:
    """(tokens/s, model FLOPs per token) of bf16 training steps."""
    model = GPT(cfg).to(device)
    step_model = torch.compile(model) if compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), device=device)

    def run() -> None:
        for _ in range(steps):
            with autocast(device, "bf16"):
                loss = step_model(data[:, :-1], targets=Targets(data[:, 1:]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    run()  # warm-up: kernels chosen, compiled, memory pooled
    seconds = statistics.median(timed(device, run) for _ in range(repeats))
    n = model.num_params() - cfg.context * cfg.d_model  # position table: a lookup, no FLOPs
    flops_per_token = 6 * n + 12 * cfg.n_layer * cfg.context * cfg.d_model
    return steps * batch * cfg.context / seconds, flops_per_token


def decoding(cfg: GPTConfig, device: torch.device, dtype: torch.dtype, new: int,
             repeats: int) -> float:
    """Tokens/s of batch-1 greedy generation after a 16-token prompt."""
    model = GPT(cfg).to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), device=device)

    def run() -> None:
        for _ in generate(model, prompt, max_new_tokens=new, temperature=0.0):
            pass

    run()
    return new / statistics.median(timed(device, run) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="training steps per timing")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the training step")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: from the table)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, to check the script")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark is for GPUs (see --device cpu --tiny)")
    if device.type != "cuda" and args.peak_tflops is None:
        sys.exit("pass --peak-tflops for a device other than CUDA")
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 decoding as GPUs usually run it
    if args.tiny:
        cfg = GPTConfig(vocab_size=512, context=64, n_layer=2, n_head=2, d_model=64)
    else:  # GPT-2 small
        cfg = GPTConfig(vocab_size=50304, context=1024, n_layer=12, n_head=12, d_model=768)
    peak = peak_tflops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)

    tokens_s, flops = training(cfg, device, args.batch, args.steps, args.compile, args.repeats)
    mfu = tokens_s * flops / (peak * 1e12)
    fp32 = decoding(cfg, device, torch.float32, args.new_tokens, args.repeats)
    bf16 = decoding(cfg, device, torch.bfloat16, args.new_tokens, args.repeats)

    print(f"{name}, bf16 peak {peak:g} TFLOP/s; GPT {cfg.n_layer}x{cfg.d_model}, "
          f"context {cfg.context}, vocab {cfg.vocab_size}")
    print(f"{'measure':<44} {'value':>12}")
    compiled = ", compiled" if args.compile else ""
    print(f"{f'training tokens/s (batch {args.batch}, bf16{compiled})':<44} {tokens_s:>12,.0f}")
    print(f"{'training MFU':<44} {mfu:>11.1%}")
    print(f"{'decoding tokens/s, batch 1, fp32 weights':<44} {fp32:>12,.1f}")
    print(f"{'decoding tokens/s, batch 1, bf16 weights':<44} {bf16:>12,.1f}")


if __name__ == "__main__":
    main()
