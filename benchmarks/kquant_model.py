"""A GGUF file of a Llama-3.2-1B-shaped model with random weights, in llama.cpp's Q4_K_M (or
another type tformer exports), for speed runs of the K formats: `tformer import` then
`tformer generate --weights ...` beside llama.cpp on the same file. No download: the
weights are random draws, the vocabulary a made-up byte-level one of the model's size.

Shapes by default: Llama 3.2 1B's (16 layers, d 2048, feed-forward 8192, 32 query and 8
key/value heads of 64, 128,256 tokens, tied embeddings, rope theta 500,000; its llama3 rope
scaling left out). Each matrix takes the type tformer's export gives it
(interop/gguf_export.tensor_type: for q4_k_m, q6_k for the embedding, which is also the
output, and for attn_v and ffn_down in the layers llama.cpp's use_more_bits picks; q4_k
elsewhere; rows not whole super-blocks in blocks.FALLBACK's type), quantized by
kernels/blocks.py's C quantizers on every thread torch has.

    python benchmarks/kquant_model.py /tmp/llama-1b-q4_k_m.gguf [--type q4_k_m]
        [--layers 16 --d-model 2048 --ff 8192 --heads 32 --kv-heads 8 --vocab 128256]

Writing the default shape quantizes 1.2 billion weights and holds the file's ~0.8 GB in
memory until it is written; --layers 2 --d-model 256 --ff 512 --vocab 1024 makes a small
one in a second.

--arch qwen2 writes Qwen2's layout (q, k and v biases, rope theta 1,000,000, tied embeddings);
Qwen2.5-1.5B's shape:

    python benchmarks/kquant_model.py /tmp/qwen-1.5b-q4_k_m.gguf --arch qwen2 --layers 28 \
        --d-model 1536 --ff 8960 --heads 12 --kv-heads 2 --vocab 151936

--arch qwen3 writes Qwen3's layout instead (q/k norms, --head-dim apart from d_model, rope
theta 1,000,000, an output layer of its own), and --arch qwen3moe a mixture of experts in
Qwen3-MoE's (--experts stacked experts of width --d-expert, --active chosen a token, the
router's weights in f32 as llama.cpp's quantizer keeps them); e.g. Qwen3-30B-A3B's layer
shape with two layers:

    python benchmarks/kquant_model.py /tmp/moe.gguf --arch qwen3moe --type q4_0 --layers 2 \
        --d-model 2048 --heads 32 --kv-heads 4 --head-dim 128 --experts 128 --active 8 \
        --d-expert 768 --vocab 4096
"""

from __future__ import annotations

import argparse
import string
import time
from pathlib import Path

import torch

from tformer.interop.gguf_export import FILE_TYPES, GGUF_TYPES, _stored, tensor_type


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order (a byte-level vocabulary's
    first 256 tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the 256 bytes, every pair of lowercase letters merged,
    Llama 3's two text markers, and unused tokens up to `size`."""
    tokens, merges = byte_chars(), []
    for a in string.ascii_lowercase:
        for b in string.ascii_lowercase:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    tokens += ["<|begin_of_text|>", "<|end_of_text|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    if size < len(tokens):
        raise SystemExit(f"--vocab must be at least {len(tokens)}")
    tokens += [f"<|unused_{i}|>" for i in range(size - len(tokens))]
    types += [5] * (size - len(types))
    return tokens, types, merges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="q4_k_m", choices=GGUF_TYPES)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "qwen3moe"), default="llama")
    ap.add_argument("--head-dim", type=int, default=None, help="default d_model / heads")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--active", type=int, default=8)
    ap.add_argument("--d-expert", type=int, default=768)
    args = ap.parse_args()
    write(args)


def write(args: argparse.Namespace) -> None:
    """The file `args` describe (main's options)."""

    import gguf

    if args.out.exists():
        raise SystemExit(f"{args.out} exists")
    d, head = args.d_model, args.head_dim or args.d_model // args.heads
    qwen, moe = args.arch != "llama", args.arch == "qwen3moe"
    qk_norm, tied = args.arch.startswith("qwen3"), args.arch in ("llama", "qwen2")
    tokens, types, merges = vocabulary(args.vocab)
    writer = gguf.GGUFWriter(args.out, args.arch)
    writer.add_name(f"random {args.arch} model")
    writer.add_file_type(FILE_TYPES[args.type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(args.ff)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(1e6 if qwen else 500000.0)
    writer.add_layer_norm_rms_eps(1e-6 if qwen else 1e-5)
    if moe:
        writer.add_expert_count(args.experts)
        writer.add_expert_used_count(args.active)
        writer.add_expert_feed_forward_length(args.d_expert)
    writer.add_rope_dimension_count(head)
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_vocab_size(args.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|end_of_text|>"))

    g = torch.Generator().manual_seed(args.seed)
    started, weights = time.perf_counter(), 0

    def add(name: str, *shape: int) -> None:
        nonlocal weights
        if name.endswith(".bias"):  # Qwen2's q, k and v biases: f32
            value = 0.1 * torch.randn(shape, generator=g)
        elif len(shape) == 1:  # a norm's weights: near one, f32
            value = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            value = torch.randn(shape, generator=g) * 0.02
        # Llama's embedding is also its output layer (tied), as Llama 3.2 1B's and
        # Qwen2.5-1.5B's are
        kind = tensor_type(args.type, name, args.layers, tied=tied)
        array, raw = _stored(name, value, kind)
        writer.add_tensor(name, array, raw_dtype=raw)
        weights += value.numel()

    add("token_embd.weight", args.vocab, d)
    for i in range(args.layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", d)
        add(b + "attn_q.weight", args.heads * head, d)
        add(b + "attn_k.weight", args.kv_heads * head, d)
        add(b + "attn_v.weight", args.kv_heads * head, d)
        if args.arch == "qwen2":
            add(b + "attn_q.bias", args.heads * head)
            add(b + "attn_k.bias", args.kv_heads * head)
            add(b + "attn_v.bias", args.kv_heads * head)
        add(b + "attn_output.weight", d, args.heads * head)
        if qk_norm:
            add(b + "attn_q_norm.weight", head)
            add(b + "attn_k_norm.weight", head)
        add(b + "ffn_norm.weight", d)
        if moe:
            add(b + "ffn_gate_inp.weight", args.experts, d)
            add(b + "ffn_gate_exps.weight", args.experts, args.d_expert, d)
            add(b + "ffn_up_exps.weight", args.experts, args.d_expert, d)
            add(b + "ffn_down_exps.weight", args.experts, d, args.d_expert)
        else:
            add(b + "ffn_gate.weight", args.ff, d)
            add(b + "ffn_up.weight", args.ff, d)
            add(b + "ffn_down.weight", d, args.ff)
    add("output_norm.weight", d)
    if not tied:
        add("output.weight", args.vocab, d)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(args.out)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    size = args.out.stat().st_size
    print(f"{args.out}: {weights / 1e9:.3f} billion weights, {size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - started:.1f} s; tensors: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"bits per weight: {8 * size / weights:.2f}")


if __name__ == "__main__":
    main()
