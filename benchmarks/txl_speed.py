"""Transformer-XL speed beside the GPT of the same size, measured side by side.

Both models are the 4 x 128 of configs/{gpt,txl}-shakespeare-char.toml (vocabulary 65,
segment / context 64), randomly initialised: speed does not depend on the weights. Each
measurement alternates the models round by round and reports the median round, so that a
machine shared with other work slows both alike; the ratios are the figures to read.

  - training: forward, backward and AdamW step on batches of 12 x 64 tokens (Transformer-XL
    carrying its memory from step to step);
  - generation: one sequence, a 64-token prompt, then new tokens one at a time with the
    cache (GPT: its KV cache, re-read over the last 64 tokens once full; Transformer-XL: its
    memory), also split into early and late tokens to show whether a token's cost grows;
  - relative attention: tformer's, written out with the terms summed in place, against the
    position term handed to SDPA as a float mask, forward and backward.

    python benchmarks/txl_speed.py [--threads 1] [--rounds 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tformer.decoding.lm import generate
from tformer.decoding.transformer_xl import generate_with_memory
from tformer.layers import attention_bias
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.transformer_xl import (
    Memory,
    RelativeAttention,
    TransformerXL,
    TransformerXLConfig,
    relative_shift,
)

VOCAB, CONTEXT, BATCH = 65, 64, 12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def side_by_side(tasks: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median rate (units per second, as each task measures it) of each task, the tasks
    taking turns round by round."""
    rates: dict[str, list[float]] = {name: [] for name in tasks}
    for task in tasks.values():  # warm-up
        task()
    for _ in range(rounds):
        for name, task in tasks.items():
            rates[name].append(task())
    return {name: statistics.median(r) for name, r in rates.items()}


def timed(device: torch.device, fn: Callable[[], int]) -> float:
    """fn() units per second."""
    sync(device)
    start = time.perf_counter()
    units = fn()
    sync(device)
    return units / (time.perf_counter() - start)


def training_step(model, device: torch.device, steps: int, memory: Memory | None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
    generator = torch.Generator().manual_seed(0)

    def steps_() -> int:
        for _ in range(steps):
            tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator)
            tokens = tokens.to(device)
            if memory is None:
                logits = model(tokens[:, :-1])
            else:
                logits = model(tokens[:, :-1], memory=memory)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return steps * BATCH * CONTEXT

    return lambda: timed(device, steps_)


def generation(model, device: torch.device, new_tokens: int, skip: int = 0):
    """Tokens per second over the new tokens after the first `skip` ones."""
    decode = generate_with_memory if isinstance(model, TransformerXL) else generate
    prompt = torch.randint(0, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)

    def run() -> float:
        stream = decode(model, prompt, max_new_tokens=skip + new_tokens, temperature=0.0)
        for _ in range(skip):
            next(stream)
        return timed(device, lambda: sum(1 for _ in stream))

    return run


def sdpa_attention(attn: RelativeAttention, x, memory, pos_k, bias, u, v):
    """RelativeAttention.forward with the position term handed to torch's
    scaled_dot_product_attention as a float mask, for comparison."""
    width = attn.n_head * attn.d_head
    q, k, values = attn.qkv_proj(x).split(width, dim=-1)
    k_mem, v_mem = F.linear(memory, attn.qkv_proj.weight[width:]).split(width, dim=-1)
    k, values = torch.cat([k_mem, k], dim=1), torch.cat([v_mem, values], dim=1)
    q, k, values = attn._heads(q), attn._heads(k), attn._heads(values)
    scale = 1.0 / math.sqrt(attn.d_head)
    position = relative_shift((q + v[:, None]) @ pos_k.transpose(-1, -2)) * scale + bias
    out = F.scaled_dot_product_attention(q + u[:, None], k, values, attn_mask=position)
    return attn.out_proj(out.transpose(1, 2).flatten(2)), (k, values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=5, help="steps per round")
    parser.add_argument("--new-tokens", type=int, default=256, help="generated per round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)

    gpt = GPT(GPTConfig(vocab_size=VOCAB, context=CONTEXT, d_ff=512)).to(device)
    txl_cfg = TransformerXLConfig(vocab_size=VOCAB, context=CONTEXT, mem_len=64, d_ff=512)
    txl = TransformerXL(txl_cfg).to(device)
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"parameters: GPT {gpt.num_params():,}, Transformer-XL {txl.num_params():,}\n")

    # --- training -----------------------------------------------------------------------
    gpt.train()
    txl.train()
    train = side_by_side({
        "GPT": training_step(gpt, device, args.train_steps, None),
        "TXL mem 0": training_step(txl, device, args.train_steps, Memory(0)),
        "TXL mem 64": training_step(txl, device, args.train_steps, Memory(64)),
    }, args.rounds)
    print("| training, batch 12 x 64 | tokens/s | vs GPT |")
    print("| --- | --- | --- |")
    for name, rate in train.items():
        print(f"| {name} | {rate:,.0f} | {rate / train['GPT']:.2f} |")

    # --- generation ---------------------------------------------------------------------
    gpt.eval()
    txl.eval()
    n = args.new_tokens
    tasks = {"GPT (KV cache, window 64)": generation(gpt, device, n)}
    for mem_len in (64, 256):
        model = TransformerXL(
            TransformerXLConfig(vocab_size=VOCAB, context=CONTEXT, mem_len=64,
                                eval_mem_len=mem_len, d_ff=512)
        ).to(device).eval()
        model.load_state_dict(txl.state_dict())
        tasks[f"TXL memory {mem_len}"] = generation(model, device, n)
        tasks[f"TXL memory {mem_len}, tokens {3 * n}..{4 * n}"] = generation(
            model, device, n, skip=3 * n)
    with torch.no_grad():
        gen = side_by_side(tasks, args.rounds)
    print(f"\n| generation, batch 1, prompt 64, {n} new tokens | tokens/s | vs GPT |")
    print("| --- | --- | --- |")
    base = gen["GPT (KV cache, window 64)"]
    for name, rate in gen.items():
        print(f"| {name} | {rate:,.1f} | {rate / base:.2f} |")

    # --- the attention itself -----------------------------------------------------------
    attn = txl.blocks[0].attn.train()
    x = torch.randn(BATCH, CONTEXT, 128, device=device)
    memory = torch.randn(BATCH, 64, 128, device=device)
    positions = txl.relative_positions(128, device)
    mask = torch.ones(CONTEXT, 128, dtype=torch.bool, device=device).tril(64)[None, None]
    bias = attention_bias(mask, x.dtype)
    u, v = txl.u[0], txl.v[0]

    def attention(fn):
        def run() -> int:
            for _ in range(10):
                pos_k = attn.position_keys(positions)
                fn(attn, x, memory, pos_k, bias, u, v)[0].sum().backward()
            return 10 * BATCH * CONTEXT
        return lambda: timed(device, run)

    att = side_by_side({
        "tformer: written out, terms summed in place": attention(RelativeAttention.forward),
        "SDPA, position term as float mask": attention(sdpa_attention),
    }, args.rounds)
    print("\n| relative attention fwd+bwd, 12 x 64 over 128 keys | tokens/s | ratio |")
    print("| --- | --- | --- |")
    first = next(iter(att.values()))
    for name, rate in att.items():
        print(f"| {name} | {rate:,.0f} | {rate / first:.2f} |")


if __name__ == "__main__":
    main()
