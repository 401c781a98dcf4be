"""Peak resident memory while decoding the real SmolLM2-135M-Instruct's GGUF file: tformer
on its own Q4_1 blocks (`tformer import`ed), llama.cpp (llama-cpp-python, `make bench`) on
the file, and the share that is the torch runtime alone (a process that imports torch and
tformer and allocates nothing). Each in a process of its own, greedy, batch 1, the same
--prompt and --new token counts; VmHWM from /proc.

    cd benchmarks && python decode_memory.py [--prompt 512 --new 128]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

TORCH_ONLY = "import torch, tformer, tformer.decoding.lm"
TFORMER = """
import sys, torch, tformer
from tformer.decoding.lm import generate
model = tformer.load(sys.argv[1])
ids = torch.randint(100, 1000, (1, int(sys.argv[2])), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    for _ in generate(model.module, ids, max_new_tokens=int(sys.argv[3]), temperature=0.0):
        pass
"""
LLAMA_CPP = """
import sys, torch
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]) + int(sys.argv[3]), verbose=False)
ids = torch.randint(100, 1000, (int(sys.argv[2]),), generator=torch.Generator().manual_seed(0))
for n, _ in enumerate(llm.generate(ids.tolist(), temp=0.0, top_k=1)):
    if n + 1 == int(sys.argv[3]):
        break
"""
PEAK = "\nprint(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"


def peak_mb(code: str, *args: str) -> float:
    done = subprocess.run([sys.executable, "-c", code + PEAK, *args], capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return int(done.stdout.split()[-1]) / 1024


def main() -> None:
    from blocks_quality import gguf_path  # a sibling script: run from benchmarks/

    from tformer.interop.gguf import import_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    path = gguf_path()
    sizes = (str(args.prompt), str(args.new))
    rows = {"the torch runtime and tformer, imported": peak_mb(TORCH_ONLY)}
    with tempfile.TemporaryDirectory() as tmp:
        run = import_gguf(path, Path(tmp) / "run")
        rows["tformer, the file's blocks"] = peak_mb(TFORMER, str(run), *sizes)
    try:
        import llama_cpp  # noqa: F401
        rows["llama.cpp, the file"] = peak_mb(LLAMA_CPP, str(path), *sizes)
    except ImportError:
        print("(llama.cpp's row needs `pip install llama-cpp-python`; not installed here)")
    print(f"peak resident memory, greedy decoding at batch 1: a {args.prompt}-token prompt, "
          f"{args.new} new tokens, {path.name}")
    print("| process | peak RSS (MB) |")
    print("| --- | ---: |")
    for name, mb in rows.items():
        print(f"| {name} | {mb:,.0f} |")


if __name__ == "__main__":
    main()
