"""Greedy text of the real SmolLM2-135M-Instruct's GGUF file in tformer (its own Q4_1
blocks, `tformer import`ed) and in llama.cpp (llama-cpp-python, which `make bench`
installs), from the same token ids: per chat prompt, how many tokens agree before they part.

Both round activations to 8-bit blocks for Q4_1 products, so they should agree for a while;
llama.cpp keeps its KV cache in f16 and reads prompts through other kernels, so a near tie
may part them. The fp32 reading of the same file equals transformers' (tests/interop/
test_gguf_real.py); this compares the quantized paths, which no test can pin.

    cd benchmarks && python greedy_llama_cpp.py [--tokens 40]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import tformer
from tformer.data.chat import encode_text, template_of
from tformer.decoding.lm import generate
from tformer.interop.gguf import import_gguf

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain what a transformer is in one sentence."]


def main() -> None:
    from blocks_quality import gguf_path  # a sibling script: run from benchmarks/

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit("this needs llama-cpp-python (make bench installs it)") from None
    path = gguf_path()
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=torch.get_num_threads(),
                verbose=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = tformer.load(import_gguf(path, Path(tmp) / "run"))
    tok = model.tokenizer
    ends = set(tok.eos_ids)
    print(f"greedy tokens of {path.name}, tformer's blocks against llama.cpp's, "
          f"{args.tokens} at most")
    print("| prompt | tformer | llama.cpp | the same for |")
    print("| --- | ---: | ---: | ---: |")
    for question in PROMPTS[: args.prompts]:
        ids = encode_text(tok, template_of(tok).render([{"role": "user", "content": question}]))
        with torch.no_grad():
            ours = [int(t[0]) for t in generate(model.module, torch.tensor([ids]),
                                               max_new_tokens=args.tokens, temperature=0.0,
                                               eos_id=list(ends))]
        ours = [t for t in ours if t not in ends]
        theirs: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token in ends or len(theirs) == args.tokens:
                break
            theirs.append(token)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                    min(len(ours), len(theirs)))
        print(f"| {question} | {len(ours)} | {len(theirs)} | "
              f"{'all' if ours == theirs else same} |", flush=True)
        print(f"  tformer:   {tok.decode(ours)!r}\n  llama.cpp: {tok.decode(theirs)!r}")


if __name__ == "__main__":
    main()
