"""Translations served under load: `tformer serve` on a trained seq2seq checkpoint, clients
sending one-line /v1/translations requests at Poisson arrivals (vLLM's benchmark_serving
draws them alike), the lines Multi30k's test2016.en (or --source FILE) in a fixed-seed order.

Reported per tree and arrival rate: sentences/s over the run, request latency p50, p90 and
p99, and how much longer than it takes alone each request waits (its latency over the
median latency of the same line sent alone, p50 and p99). With --baseline-src, another
tree's server (say the one before continuous batching) runs the same arrivals, the two
alternating --repeats times, one server at a time; the table gives medians and the ratios.

    python benchmarks/translation_serve.py CKPT --rates 2 8 --requests 120 \
        --baseline-src /tmp/old/src

The `offline` mode compares the two search paths without a server, on the same sentences:
decoding/translate.py (beam_search in batches, its decoder layers one C call each) against
decoding/beam_pool.py with every sentence joining at step 0, in alternation:

    python benchmarks/translation_serve.py CKPT --offline --sentences 256
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "data" / "multi30k" / "test2016.en"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(ckpt: str, src: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(threads)}
    server = subprocess.Popen([sys.executable, "-m", "tformer", "serve", ckpt, "--port",
                               str(port), "--device", "cpu", "--max-waiting", "1000"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"the server of {src} did not start")
        time.sleep(0.2)


def translate_one(http: httpx.Client, line: str, beam: int) -> float:
    start = time.perf_counter()
    r = http.post("/v1/translations", json={"input": [line], "beam": beam}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
    return time.perf_counter() - start


def load(url: str, lines: list[str], rate: float, beam: int, seed: int) -> dict:
    """The lines sent at Poisson arrivals of `rate` a second: latencies, sentences/s."""
    gaps = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in lines:
        arrivals.append(t)
        t += gaps.expovariate(rate)
    with httpx.Client(base_url=url) as http, \
            concurrent.futures.ThreadPoolExecutor(len(lines)) as pool:
        begin = time.perf_counter()

        def send(i: int) -> float:
            time.sleep(max(0.0, begin + arrivals[i] - time.perf_counter()))
            return translate_one(http, lines[i], beam)

        latencies = list(pool.map(send, range(len(lines))))
        wall = time.perf_counter() - begin
    return {"latencies": latencies, "per_s": len(lines) / wall}


def alone(url: str, lines: list[str], beam: int) -> list[float]:
    """Each distinct line's median latency sent alone (three times)."""
    with httpx.Client(base_url=url) as http:
        return [statistics.median(translate_one(http, line, beam) for _ in range(3))
                for line in lines]


def read(path: str) -> list[str]:
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip()]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def serve(args: argparse.Namespace) -> None:
    lines = read(args.source)
    random.Random(args.seed).shuffle(lines)
    lines = lines[: args.requests]
    trees = [("this tree", str(ROOT / "src"))]
    if args.baseline_src:
        trees.insert(0, ("baseline", args.baseline_src))
    rows: dict[tuple[str, float], list[dict]] = {}
    for _ in range(args.repeats):
        for name, src in trees:
            server, url = start(args.checkpoint, src, args.threads)
            try:
                single = alone(url, lines[: min(args.alone, len(lines))], args.beam)
                for rate in args.rates:
                    got = load(url, lines, rate, args.beam, args.seed)
                    slow = [lat / ref for lat, ref in zip(got["latencies"], single,
                                                          strict=False)]
                    rows.setdefault((name, rate), []).append({
                        "per_s": got["per_s"], "p50": quantile(got["latencies"], 0.5),
                        "p90": quantile(got["latencies"], 0.9),
                        "p99": quantile(got["latencies"], 0.99),
                        "slow50": quantile(slow, 0.5), "slow99": quantile(slow, 0.99)})
            finally:
                server.terminate()
                server.wait(60)
    print(f"\n{args.requests} one-line requests, beam {args.beam}, {args.threads} threads, "
          f"medians of {args.repeats}")
    print("| tree | rate /s | sentences/s | p50 s | p90 s | p99 s | slowdown p50 | "
          "slowdown p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (name, rate), runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} | {rate:g} | {m['per_s']:.1f} | {m['p50']:.2f} | {m['p90']:.2f} | "
              f"{m['p99']:.2f} | {m['slow50']:.1f}x | {m['slow99']:.1f}x |")


def offline(args: argparse.Namespace) -> None:
    import torch

    from tformer.decoding.beam_pool import BeamPool
    from tformer.decoding.translate import SearchOptions, source_ids, translate
    from tformer.loading import load_checkpoint

    torch.set_num_threads(args.threads)
    loaded = load_checkpoint(args.checkpoint, device=torch.device("cpu"))
    model, tokenizer = loaded.model, loaded.tokenizer
    lines = read(args.source)[: args.sentences]
    options = SearchOptions(beam=args.beam)
    sources, _ = source_ids(tokenizer, lines, model.cfg.max_len)

    def batched() -> list[str]:
        return [h[0].text for h in translate(model, tokenizer, lines, options, batch_size=32)]

    def pooled() -> list[str]:
        beams = BeamPool(model, beam=args.beam, alpha=options.alpha, bos_id=tokenizer.bos_id,
                         eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
        order = sorted(range(len(lines)), key=lambda i: len(sources[i]))
        out: dict[int, str] = {}
        waiting = list(order)
        with torch.inference_mode():
            while waiting or beams.sentences:
                room = 32 - beams.sentences
                joining = waiting[:room]
                if joining and beams.fits([sources[i] for i in joining]):
                    beams.join([(i, sources[i]) for i in joining])
                    del waiting[:room]
                for done in beams.step():
                    out[done.key] = tokenizer.decode(done.hypotheses[0].tokens)
        return [out[i] for i in range(len(lines))]

    times: dict[str, list[float]] = {"beam_search, batches of 32": [],
                                     "BeamPool, 32 in flight": []}
    texts = {}
    for _ in range(args.repeats):
        for name, run in zip(times, (batched, pooled), strict=True):
            start = time.perf_counter()
            texts[name] = run()
            times[name].append(time.perf_counter() - start)
    same = sum(a == b for a, b in zip(*texts.values(), strict=True))
    print(f"\n{len(lines)} sentences, beam {args.beam}, {args.threads} threads, medians of "
          f"{args.repeats}; {same}/{len(lines)} outputs identical")
    print("| path | sentences/s | ratio |")
    print("|---|---:|---:|")
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {len(lines) / t:.1f} | {base / t:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--source", default=str(SOURCE), help="the lines to translate")
    parser.add_argument("--baseline-src", help="another tree's src/ to serve beside this one")
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--alone", type=int, default=120,
                        help="lines also timed alone, for each request's slowdown")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offline", action="store_true")
    parser.add_argument("--sentences", type=int, default=256)
    args = parser.parse_args()
    (offline if args.offline else serve)(args)


if __name__ == "__main__":
    main()
