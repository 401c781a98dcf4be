"""Greedy text of the real SmolLM2-135M-Instruct's GGUF file in tformer (its own Q4_1
blocks, `tformer import`ed) and in llama.cpp (its llama-server, which `make bench` builds;
benchmarks/llama_cpp.py), from the same token ids: per chat prompt, how many tokens agree
before they part.

Both round activations to 8-bit blocks for Q4_1 products, so they should agree for a while;
llama.cpp keeps its KV cache in f16 and reads prompts through other kernels, so a near tie
may part them. The fp32 reading of the same file equals transformers' (tests/interop/
test_gguf_real.py); this compares the quantized paths, which no test can pin.

    cd benchmarks && python greedy_llama_cpp.py [--tokens 40]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path

import torch

import tformer
from tformer.data.chat import encode_text, template_of
from tformer.decoding.lm import generate
from tformer.interop.gguf import import_gguf

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain what a transformer is in one sentence."]


def llama_greedy(url: str, ids: list[int], tokens: int) -> list[int]:
    """llama-server's greedy continuation of these token ids (its /completion endpoint takes
    ids as they are, adding no BOS), up to `tokens` of them, stopping at an end token."""
    body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "top_k": 1,
            "return_tokens": True, "cache_prompt": False}
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return [int(t) for t in json.load(answer)["tokens"]]


def main() -> None:
    # (sibling scripts: importable where this one runs as a script)
    import llama_cpp
    from blocks_quality import gguf_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    llama_cpp.binary("llama-server")  # the one-line error if the tools are not built
    path = gguf_path()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        model = tformer.load(import_gguf(path, Path(tmp) / "run"))
    tok = model.tokenizer
    print(f"greedy tokens of {path.name}, tformer's blocks against llama.cpp's "
          f"({llama_cpp.isa_summary()}), {args.tokens} at most")
    print("| prompt | tformer | llama.cpp | the same for |")
    print("| --- | ---: | ---: | ---: |")
    with llama_cpp.server(path, threads, context=512) as url:
        for question in PROMPTS[: args.prompts]:
            compare(model, tok, url, question, args.tokens)


def compare(model, tok, url: str, question: str, tokens: int) -> None:
    ends = set(tok.eos_ids)
    ids = encode_text(tok, template_of(tok).render([{"role": "user", "content": question}]))
    with torch.no_grad():
        ours = [int(t[0]) for t in generate(model.module, torch.tensor([ids]),
                                           max_new_tokens=tokens, temperature=0.0,
                                           eos_id=list(ends))]
    ours = [t for t in ours if t not in ends]
    theirs = [t for t in llama_greedy(url, ids, tokens) if t not in ends]
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                min(len(ours), len(theirs)))
    print(f"| {question} | {len(ours)} | {len(theirs)} | "
          f"{'all' if ours == theirs else same} |", flush=True)
    print(f"  tformer:   {tok.decode(ours)!r}\n  llama.cpp: {tok.decode(theirs)!r}")


if __name__ == "__main__":
    main()
