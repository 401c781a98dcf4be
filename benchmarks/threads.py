"""How many CPU threads decoding and evaluation should use: batch-1 generation and a
batched evaluation forward pass, with 1 thread and with every core, for models of three
sizes, on the machine as it is and with one busy process beside it.

    python benchmarks/threads.py [--tokens 100] [--repeats 3]

Every measurement runs in a fresh process (torch's thread pool is set once, at start), and
the conditions alternate so that a change in the machine's load hits both sides alike.
The busy process is a plain Python loop: one core taken, as by a training next door.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {  # name: (n_layer, d_model), character vocabulary, context 256
    "0.8M": (4, 128),
    "11M": (6, 384),
    "85M": (12, 768),
}


def worker(size: str, threads: int, tokens: int) -> dict[str, float]:
    import torch

    from tformer.decoding.lm import generate
    from tformer.kernels.prepack import prepack
    from tformer.models.gpt import GPT, GPTConfig

    torch.set_num_threads(threads)
    n_layer, d = SIZES[size]
    model = GPT(GPTConfig(n_layer=n_layer, n_head=d // 64 or 2, d_model=d, d_ff=4 * d,
                          context=256, vocab_size=100, dropout=0.0)).eval()
    fast = prepack(model)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    list(generate(fast, prompt, max_new_tokens=4))  # warm-up
    start = time.perf_counter()
    list(generate(fast, prompt, max_new_tokens=tokens, temperature=0.0))
    gen = (time.perf_counter() - start) / tokens * 1000
    batch = torch.randint(100, (8, 256))
    with torch.no_grad():
        model(batch)
        start = time.perf_counter()
        for _ in range(3):
            model(batch)
    ev = (time.perf_counter() - start) / 3 * 1000
    return {"generate_ms_per_token": gen, "evaluate_ms_per_batch": ev}


def measure(size: str, threads: int, tokens: int) -> dict[str, float] | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--worker", size, str(threads), str(tokens)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                             check=True).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(SIZES))
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"{cores} cores; load average at start {os.getloadavg()[0]:.2f}")
    print("| model | machine | threads | generate ms/token | evaluate ms/batch (8x256) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for size in args.sizes.split(","):
        for busy in (False, True):
            spinner = (
                subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            )
            try:
                runs: dict[int, list[dict[str, float]]] = {1: [], cores: []}
                for _ in range(args.repeats):
                    for threads in runs:
                        result = measure(size, threads, args.tokens)
                        if result is not None:
                            runs[threads].append(result)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            for threads, results in runs.items():
                if not results:
                    print(f"| {size} | {'busy' if busy else 'as found'} | {threads} | "
                          f"timeout | timeout |")
                    continue
                gen = statistics.median(r["generate_ms_per_token"] for r in results)
                ev = statistics.median(r["evaluate_ms_per_batch"] for r in results)
                print(f"| {size} | {'+1 busy' if busy else 'as found'} | {threads} | "
                      f"{gen:.2f} | {ev:.1f} |", flush=True)


if __name__ == "__main__":
    main()
