"""How far a block file's perplexity moves with the activations' rounding alone.

The block products round x to 8-bit blocks of 32 values before they multiply (llama.cpp's
Q8_0 / Q8_1 activations; blocks.py's quantize_activations). Two programs that read the same
file with the same weights round x the same way up to details: a scale multiplied or
divided, a half rounded up or to even, the scale kept in fp32 or in fp16 as ggml's blocks
store it, the products summed in fp32 in one order or another. Each detail flips a few
values by one step, every layer re-rounds what the last one changed, and each variant draws
its own sample of the rounding noise. This script scores the real SmolLM2 file under such
variants, written out plainly in float64 beside the C kernels' own run, in llama-perplexity's
protocol (blocks_quality.py's windowed), and gives the paired standard error of each one's
mean log-likelihood against the kernels': the spread between equally right variants is the
floor under any comparison of two programs' perplexity on one file.

    python benchmarks/activation_rounding.py [--tokens 4096] [--context 512]
    python benchmarks/activation_rounding.py --tiny      # a random model: checks it runs
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tformer.kernels import blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import blocks_quality as bq  # noqa: E402 (a sibling script)

VARIANTS = {
    "kernels": "the C kernels as a model runs them (x * (1/d) rounded half away, d fp32)",
    "float64": "the kernels' rounding, every product and sum in float64",
    "ggml": "x * (127/max) rounded half to even, d fp32 (ggml's quantize_row_q8_0/q8_1)",
    "ggml, fp16 d": "the same, d stored in fp16 as a block_q8_0 holds it",
    "ggml, fp16 d and s": "the same, q4_1's d * sum(q) in fp16 too (block_q8_1's s)",
}


def rounded(x: torch.Tensor, variant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> (q, d, s) in float64, blocks of 32: q the rounded values (M, K/32,
    32), d each block's scale and s = d * sum(q) as `variant` keeps them (M, K/32, 1)."""
    m, k = x.shape
    v = x.float().reshape(m, k // 32, 32)
    amax = v.abs().amax(-1, keepdim=True)
    d = amax / 127
    if variant == "float64":
        q = blocks.roundf(v * torch.where(d == 0, 0.0, 1 / d))
    else:
        q = torch.round(v * torch.where(amax == 0, 0.0, 127 / amax))
    s = d * q.sum(-1, keepdim=True)
    if "fp16 d" in variant:
        d = d.half()
    if "and s" in variant:
        s = s.half()
    return q.double(), d.double(), s.double()


def plain_forward(layer: blocks.BlockLinear, x: torch.Tensor, variant: str) -> torch.Tensor:
    """y = x W^T + b as a 32-value block product computes it, in float64: sum over blocks
    of d_w d_x sum(q_w q_x), and for the formats with a minimum m_w s_x."""
    if layer.fmt not in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        raise SystemExit(f"{layer.fmt}: this script knows the 32-value formats only")
    lead, k = x.shape[:-1], x.shape[-1]
    q, d, s = rounded(x.reshape(-1, k), variant)
    w = blocks.dequantize(layer.blocks, layer.fmt).double().reshape(layer.out_features, -1, 32)
    y = torch.einsum("mbv,nbv->mn", q * d, w)
    if layer.fmt in ("q4_1", "q5_1"):  # w = d_w q_w + m_w: the m_w term through s
        size = blocks.LAYOUTS[layer.fmt].size
        m_w = layer.blocks.reshape(layer.out_features, -1, size)[..., 2:4].contiguous()
        m_w = m_w.view(torch.float16).double()[..., 0]
        y = y - torch.einsum("mb,nb->mn", (q * d).sum(-1), m_w)
        y = y + torch.einsum("mb,nb->mn", s[..., 0], m_w)
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.float().reshape(*lead, -1)


def in_variant(model, fmt: str, variant: str):
    copy = bq.in_format(model, fmt)
    if variant != "kernels":
        for layer in copy.modules():
            if isinstance(layer, blocks.BlockLinear):
                layer.forward = lambda x, layer=layer: plain_forward(layer, x, variant)
    return copy


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, context: int) -> torch.Tensor:
    """Each scored token's negative log-likelihood in llama-perplexity's protocol: windows
    of `context` tokens, the second half of each scored."""
    first, out = context // 2, []
    for start in range(0, len(ids) - context + 1, context):
        window = ids[start: start + context]
        logp = F.log_softmax(model(window[None, :-1])[0, first:].double(), -1)
        out.append(-logp.gather(1, window[first + 1:, None])[:, 0])
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.tiny:
        model, fmt, context = bq.tiny_model(), "q4_1", 32
        ids = torch.randint(0, 300, (128,), generator=torch.Generator().manual_seed(0))
        print("a random tiny model in q4_1, 128 random ids")
    else:
        model, tokenizer = bq.smollm2()
        fmt, context = "file", args.context
        text = bq.WIKITEXT.read_text()[: 60 * args.tokens]
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        ids = ids[: args.tokens // context * context]
        print(f"SmolLM2-135M-Instruct ({bq.gguf_path().name}, its own blocks), WikiText-2 "
              f"validation, {len(ids) // context} windows of {context} tokens, second "
              f"halves scored; block kernels: {blocks.path()}")
    base = token_nll(bq.in_format(model, "fp32"), ids, context)
    print(f"\nfp32 (the file's weights dequantized): perplexity "
          f"{math.exp(base.mean().item()):.4f}, {len(base)} tokens scored\n")
    print("| activations rounded | perplexity | vs the kernels | paired standard error |")
    print("|---|---|---|---|")
    reference = None
    for variant, what in VARIANTS.items():
        nll = token_nll(in_variant(model, fmt, variant), ids, context)
        reference = nll if reference is None else reference
        diff = nll - reference
        se = diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
        print(f"| {variant}: {what} | {math.exp(nll.mean().item()):.4f} | "
              f"{100 * math.expm1(diff.mean().item()):+.2f}% | {100 * se:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
