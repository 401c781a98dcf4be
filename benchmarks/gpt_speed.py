"""GPT speed: training tokens/s, and generation tokens/s with and without the KV cache.

    .venv/bin/python benchmarks/gpt_speed.py [--repeats 5] [--json] [--tiny]

Two model sizes: nanoGPT's CPU shape (4 layers x 128, context 64, batch 12) and a larger
one (6 x 384, context 256, batch 8). Measurements of one size are interleaved (train,
cached, uncached, train, ...) and the table gives medians, so the machine's drift hits all
columns alike; compare the ratios, not the absolute numbers across runs. --tiny times one
tiny model instead, to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tformer.decoding.lm import generate
from tformer.evaluation.loss import Targets
from tformer.models.gpt import GPT, GPTConfig

SIZES = {
    "4x128 ctx64 b12": dict(n_layer=4, n_head=4, d_model=128, context=64, batch=12),
    "6x384 ctx256 b8": dict(n_layer=6, n_head=6, d_model=384, context=256, batch=8),
}
TINY = {"2x32 ctx24 b2": dict(n_layer=2, n_head=2, d_model=32, context=24, batch=2)}
VOCAB = 65
PROMPT = 16


def training_rate(model: GPT, batch: int, steps: int = 5) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the trainer runs it
    ctx = model.cfg.context
    data = torch.randint(0, VOCAB, (steps, batch, ctx + 1))
    model.train()
    start = time.perf_counter()
    for s in range(steps):
        loss = model(data[s, :, :-1], targets=Targets(data[s, :, 1:]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * batch * ctx / (time.perf_counter() - start)


def generation_rate(model: GPT, use_cache: bool) -> float:
    model.eval()
    new = model.cfg.context - PROMPT
    prompt = torch.randint(0, VOCAB, (1, PROMPT))
    start = time.perf_counter()
    for _ in generate(model, prompt, max_new_tokens=new, temperature=0.0, use_cache=use_cache):
        pass
    return new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--tiny", action="store_true", help="one tiny model, to check the script")
    args = parser.parse_args()
    torch.manual_seed(0)

    rows = []
    for name, size in (TINY if args.tiny else SIZES).items():
        size = dict(size)
        batch = size.pop("batch")
        model = GPT(GPTConfig(vocab_size=VOCAB, d_ff=4 * size["d_model"], **size))
        training_rate(model, batch, steps=2)  # warm-up
        generation_rate(model, True)
        train, cached, uncached = [], [], []
        for _ in range(args.repeats):
            train.append(training_rate(model, batch))
            cached.append(generation_rate(model, True))
            uncached.append(generation_rate(model, False))
        rows.append({
            "model": name,
            "params_m": round(model.num_params() / 1e6, 2),
            "train_tok_s": statistics.median(train),
            "gen_cached_tok_s": statistics.median(cached),
            "gen_uncached_tok_s": statistics.median(uncached),
        })
        rows[-1]["cache_speedup"] = rows[-1]["gen_cached_tok_s"] / rows[-1]["gen_uncached_tok_s"]

    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"medians of {args.repeats}; generation: batch 1, {PROMPT}-token prompt, greedy, "
          f"up to the context")
    header = f"{'model':<18}{'params':>8}{'train tok/s':>13}{'gen cached':>12}"
    header += f"{'gen uncached':>14}{'cache x':>9}"
    print(header)
    for r in rows:
        print(f"{r['model']:<18}{r['params_m']:>7.2f}M{r['train_tok_s']:>13,.0f}"
              f"{r['gen_cached_tok_s']:>12,.0f}{r['gen_uncached_tok_s']:>14,.0f}"
              f"{r['cache_speedup']:>8.2f}x")


if __name__ == "__main__":
    main()
