"""Load on `tformer serve`: 1, 4, 16 and 64 concurrent clients against a GPT-2-small-shaped
model (random weights), beside offline batched `generate` at the same batch.

Each client sends --requests completions one after another (a --prompt-tokens prompt,
--max-tokens greedy tokens). Reported per level: completion tokens per second over the
whole run, the p50 and p99 request latency, failed requests, and offline tokens per second
for one batch of that many prompts decoded by tformer.decoding.lm.generate (same model, same
prepacked weights, prompt reading included on both sides). The two sides alternate
--repeats times; the table shows medians, and the ratio of each pair.

With --prompt-lookup N a second server speculates (`tformer serve --prompt-lookup N
--draft-tokens K`) and two more columns show its tokens per second and its ratio to the plain
server's; --repetitive prompts repeat a short motif, the case prompt lookup is for.

    python benchmarks/serve_load.py                 # GPT-2 small: 12 x 768, context 1024
    python benchmarks/serve_load.py --layers 4 --clients 1 4 16   # a smaller run
    python benchmarks/serve_load.py --clients 1 --repetitive --prompt-lookup 3

With --long-prompt CKPT (the real SmolLM2-135M-Instruct, imported) it runs instead the
scenario of one 7,314-token prompt sent with seven ~115-token ones at the same moment, each
streaming 8 greedy tokens: the time to first token and to the end of each short request,
the long one's, and the server's peak resident memory (VmHWM), for this tree's server and,
with --baseline-src DIR, another tree's (say main's) side by side.

    python benchmarks/serve_load.py --long-prompt CKPT --baseline-src /work/main/src

With --budget CKPT, --budget-clients (64) clients each send a --budget-tokens (2,000)
prompt at once to a server with --kv-memory 1 (GiB) and --max-waiting --budget-waiting
(default: twice the clients, so that none is turned away): the answered requests, those
refused with 503 and a Retry-After header (past --max-waiting), any other failure, the wall
time, and the server's resident memory at idle and at its peak against the pool's budget
plus the idle model plus 500 MB.

    python benchmarks/serve_load.py --budget CKPT

With --chat CKPT, a client holds a 10-turn chat, sending the whole conversation each turn
(/v1/chat/completions, streamed), against a server with its prefix cache and one with
--no-prefix-cache: the time to first token of each turn.

    python benchmarks/serve_load.py --chat CKPT

With --gguf FILE, streaming clients (--clients levels, --requests each, prompt and output
lengths drawn from a fixed seed around --prompt-tokens random token ids and up to
--max-tokens greedy tokens with ignore_eos, over /v1/completions; with --rate, Poisson
arrivals as vLLM's benchmark_serving draws them) run against `tformer serve` on the file
(`tformer import`ed, its own blocks) and against llama.cpp's llama-server on the same file
(one slot per client, continuous batching; `make bench` builds it, benchmarks/llama_cpp.py),
both on --threads threads, in alternation: output tokens/s, time to first token and
inter-token latency, p50 and p99.

    python benchmarks/serve_load.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --clients 1 4 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tformer.config import config_from_dict  # noqa: E402
from tformer.data.tokenizers import CharTokenizer  # noqa: E402
from tformer.decoding.lm import generate  # noqa: E402
from tformer.kernels.formats import quantize_model  # noqa: E402
from tformer.models.gpt import GPT  # noqa: E402
from tformer.training.checkpoint import save_checkpoint  # noqa: E402

FIRST_CHAR = 0x100  # one character per token id, so that any id decodes


def build_checkpoint(dest: Path, *, layers: int, d_model: int, heads: int, vocab: int,
                     context: int) -> tuple[Path, GPT, CharTokenizer]:
    tokenizer = CharTokenizer(chr(FIRST_CHAR + i) for i in range(vocab))
    cfg = config_from_dict({"model": {"family": "gpt", "n_layer": layers, "d_model": d_model,
                                      "n_head": heads, "context": context,
                                      "vocab_size": tokenizer.vocab_size},
                            "train": {"device": "cpu"}})
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    return save_checkpoint(dest, cfg, model, tokenizer), model, tokenizer


def prompt_ids(i: int, length: int) -> list[int]:
    """Random token ids away from a real vocabulary's special and byte tokens."""
    return torch.randint(100, 1000, (length,), generator=torch.Generator().manual_seed(i)).tolist()


def prompt_text(i: int, length: int, vocab: int, motif: int = 0) -> str:
    """Random tokens; with `motif`, a random motif of that many tokens repeated."""
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, vocab, (motif or length,), generator=g).tolist()
    return "".join(chr(FIRST_CHAR + t) for t in (ids * length)[:length])


def offline_tokens_per_s(model, tokenizer, batch: int, prompt_tokens: int, max_tokens: int,
                         vocab: int, motif: int = 0) -> float:
    prompts = torch.tensor([tokenizer.encode(prompt_text(i, prompt_tokens, vocab, motif))
                            for i in range(batch)])
    start = time.perf_counter()
    n = sum(1 for _ in generate(model, prompts, max_new_tokens=max_tokens, temperature=0.0))
    return batch * n / (time.perf_counter() - start)


async def load(url: str, clients: int, requests: int, prompt_tokens: int, max_tokens: int,
               vocab: int, motif: int = 0, ids: bool = False) -> dict[str, float]:
    """`clients` clients, each sending `requests` completions one after another: prompts of
    text for the char tokenizer, or with `ids` of token ids (a real model's vocabulary)."""
    latencies: list[float] = []
    failed = 0
    tokens = 0
    reasons: dict[str, int] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def client(c: int) -> None:
            nonlocal failed, tokens
            for r in range(requests):
                i = c * requests + r
                prompt = (prompt_ids(i, prompt_tokens) if ids
                          else prompt_text(i, prompt_tokens, vocab, motif))
                body = {"prompt": prompt,
                        "max_tokens": max_tokens, "temperature": 0}
                t0 = time.perf_counter()
                try:
                    resp = await http.post("/v1/completions", json=body)
                except httpx.HTTPError as e:
                    failed += 1
                    reasons[type(e).__name__] = reasons.get(type(e).__name__, 0) + 1
                    continue
                if resp.status_code != 200:
                    failed += 1
                    why = f"{resp.status_code} {resp.text[:200]}"
                    reasons[why] = reasons.get(why, 0) + 1
                    continue
                latencies.append(time.perf_counter() - t0)
                tokens += resp.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - start
    for why, n in reasons.items():
        print(f"  {n} failed: {why}", file=sys.stderr)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0
    return {"tokens_per_s": tokens / wall, "p50": statistics.median(latencies or [0]),
            "p99": p99, "failed": failed, "done": len(latencies)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, clients: int, *options: str) -> tuple[subprocess.Popen, str]:
    """`tformer serve` on a free port, once /health answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    server = subprocess.Popen(
        [sys.executable, "-m", "tformer", "serve", str(ckpt), "--port", str(port),
         "--device", "cpu", "--max-batch", str(clients), "--max-waiting", str(4 * clients),
         *options], env=env)
    return server, ready(server, url)


def ready(server: subprocess.Popen, url: str) -> str:
    """`url` once the server there answers /health (within 5 minutes), else exit."""
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit("the server did not start")
        time.sleep(0.2)


def figures(url: str, *names: str) -> str:
    return " ".join(line for line in httpx.get(url + "/metrics").text.splitlines()
                    if line.startswith(names))


@contextmanager
def real_server(ckpt: str, src: str, *options: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`tformer serve` of `src`'s tree on the real model, once /health answers; stopped
    after the block."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": src}
    server = subprocess.Popen([sys.executable, "-m", "tformer", "serve", ckpt, "--port",
                               str(port), "--device", "cpu", "--max-batch", "16", *options],
                              env=env)
    try:
        yield server, ready(server, url)
    finally:
        server.terminate()
        server.wait(120)


class Refused(RuntimeError):
    """A 503 with a Retry-After header: the server's queue was full."""


async def timed_stream(http: httpx.AsyncClient, prompt: list[int], tokens: int
                       ) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed completion;
    Refused for a 503 that says when to retry, RuntimeError for any other answer than 200."""
    start = time.perf_counter()
    first = None
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 503 and "retry-after" in r.headers:
            raise Refused(r.headers["retry-after"])
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in sse_lines(r):
            if line.startswith("data: ") and first is None and line != "data: [DONE]":
                first = time.perf_counter() - start
    return first or float("nan"), time.perf_counter() - start


def memory_mb(pid: int, field: str = "VmHWM") -> float:
    """A process's resident memory in MB: at its peak (VmHWM) or now (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def long_prompt_round(url: str, long_tokens: int, short_tokens: int, shorts: int
                            ) -> list[tuple[float, float]]:
    g = torch.Generator().manual_seed(0)
    long = torch.randint(100, 40000, (long_tokens,), generator=g).tolist()
    short = [torch.randint(100, 40000, (short_tokens,), generator=g).tolist()
             for _ in range(shorts)]
    async with httpx.AsyncClient(base_url=url, timeout=1800) as http:
        await timed_stream(http, short[0][:8], 2)  # warm up
        return await asyncio.gather(timed_stream(http, long, 8),
                                    *(timed_stream(http, p, 8) for p in short))


def long_prompt_scenario(args: argparse.Namespace) -> None:
    sides = [("this tree", str(ROOT / "src"))]
    if args.baseline_src:
        sides.append(("baseline", args.baseline_src))
    print(f"one {args.long_tokens}-token prompt + {args.shorts} of {args.short_tokens} tokens "
          f"at once, 8 greedy tokens each, SmolLM2-135M {args.weights}; "
          f"load {os.getloadavg()[0]:.1f}")
    print("| server | short TTFT median / max (s) | short done max (s) | long TTFT (s) "
          "| peak RSS (GB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, src in sides:
        with real_server(args.long_prompt, src, "--weights", args.weights) as (server, url):
            times = asyncio.run(long_prompt_round(url, args.long_tokens, args.short_tokens,
                                                  args.shorts))
            peak = memory_mb(server.pid)
        firsts = [t[0] for t in times[1:]]
        print(f"| {name} | {statistics.median(firsts):.2f} / {max(firsts):.2f} | "
              f"{max(t[1] for t in times[1:]):.2f} | {times[0][0]:.2f} | {peak / 1024:.2f} |",
              flush=True)


async def chat_turns(url: str, turns: int, words: list[str], reply_tokens: int
                     ) -> list[float]:
    """Each turn's time to first token, the client resending the whole conversation."""
    messages: list[dict[str, str]] = []
    firsts = []
    async with httpx.AsyncClient(base_url=url, timeout=1800) as http:
        for turn in range(turns):
            question = " ".join(words[turn * 80 : (turn + 1) * 80])
            messages.append({"role": "user", "content": question})
            body = {"messages": messages, "max_tokens": reply_tokens, "temperature": 0,
                    "stream": True}
            start = time.perf_counter()
            first, reply = None, []
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in sse_lines(r):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if first is None and delta.get("content"):  # not the role's chunk
                        first = time.perf_counter() - start
                    reply.append(delta.get("content") or "")
            firsts.append(first or float("nan"))
            messages.append({"role": "assistant", "content": "".join(reply)})
    return firsts


def chat_scenario(args: argparse.Namespace) -> None:
    text = (Path("/work/shared/data/wikitext-2") / "wiki.valid.tokens")
    words = text.read_text().split()[:5000] if text.exists() else ["word"] * 5000
    print(f"a {args.turns}-turn chat resent whole each turn, {args.reply_tokens}-token "
          f"replies, SmolLM2-135M {args.weights}; load {os.getloadavg()[0]:.1f}")
    print("| server | " + " | ".join(f"turn {t + 1} TTFT (s)" for t in range(args.turns))
          + " |")
    print("| --- |" + " ---: |" * args.turns)
    results = {}
    for name, options in [("prefix cache", ()), ("no prefix cache", ("--no-prefix-cache",))]:
        with real_server(args.chat, str(ROOT / "src"), "--weights", args.weights,
                         *options) as (_, url):
            firsts = asyncio.run(chat_turns(url, args.turns, words, args.reply_tokens))
            print("  " + figures(url, "tformer_prefix_cache_hit_rate"), file=sys.stderr)
        results[name] = firsts
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in firsts) + " |", flush=True)
    last = results["no prefix cache"][-1] / results["prefix cache"][-1]
    print(f"turn {args.turns}: {last:.1f}x faster to the first token with the prefix cache")


async def budget_round(url: str, clients: int, prompt_tokens: int
                       ) -> list[tuple[float, float] | BaseException]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (prompt_tokens,), generator=g).tolist()
               for _ in range(clients)]
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        await timed_stream(http, prompts[0][:8], 2)  # warm up
        return await asyncio.gather(*(timed_stream(http, p, 8) for p in prompts),
                                    return_exceptions=True)


def budget_scenario(args: argparse.Namespace) -> None:
    """Many long prompts at once into a KV pool far smaller than they need together: none
    may fail (those past --max-waiting are refused with 503 and Retry-After), and the
    server's memory stays within the pool, the model and 500 MB."""
    waiting = args.budget_waiting or 2 * args.budget_clients
    need = args.budget_clients * (args.budget_tokens + 8)
    print(f"{args.budget_clients} clients x {args.budget_tokens}-token prompts at once ("
          f"{need:,} positions), 8 greedy tokens each, --kv-memory {args.kv_memory} GiB, "
          f"--max-batch 16, --max-waiting {waiting}, SmolLM2-135M {args.weights}; "
          f"load {os.getloadavg()[0]:.1f}")
    with real_server(args.budget, str(ROOT / "src"), "--weights", args.weights, "--kv-memory",
                     str(args.kv_memory), "--max-waiting", str(waiting)) as (server, url):
        idle = memory_mb(server.pid, "VmRSS")
        start = time.perf_counter()
        results = asyncio.run(budget_round(url, args.budget_clients, args.budget_tokens))
        wall = time.perf_counter() - start
        peak = memory_mb(server.pid)
        print("  " + figures(url, "tformer_preemptions", "tformer_kv_blocks"), file=sys.stderr)
    done = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, Refused)]
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Refused):
            print(f"  failed: {r!r}"[:300], file=sys.stderr)
    limit = idle + args.kv_memory * 1024 + 500
    firsts = sorted(t[0] for t in done) or [float("nan")]
    retry = sorted({str(r) for r in refused})
    print("| answered | refused: 503 + Retry-After | failed otherwise | wall (s) "
          "| TTFT median / max (s) | RSS idle / peak (MB) | idle + budget + 500 MB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {len(done)} | {len(refused)} ({', '.join(retry) or '-'} s) | "
          f"{len(results) - len(done) - len(refused)} | {wall:.1f} | "
          f"{statistics.median(firsts):.1f} / {firsts[-1]:.1f} | {idle:.0f} / {peak:.0f} | "
          f"{limit:.0f} ({'within' if peak <= limit else 'OVER'}) |", flush=True)


async def sse_lines(response: httpx.Response):
    """A streamed response's server-sent-event lines, split where the SSE format ends a line
    (LF, CR LF or CR) and nowhere else: httpx's aiter_lines also splits at U+2028, U+0085
    and the like, which a JSON payload may hold unescaped (a sampled text's characters)."""
    rest = b""
    async for chunk in response.aiter_bytes():
        *lines, rest = (rest + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode()
    if rest:
        yield rest.decode()


async def streamed(http: httpx.AsyncClient, prompt: list[int], tokens: int) -> dict:
    """One streamed completion of exactly `tokens` greedy tokens (ignore_eos): seconds to
    the first token, the gaps between tokens after it, tokens received."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in sse_lines(r):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in event.get("choices") or ()):
                stamps.append(time.perf_counter() - start)  # (not the closing event)
    if not stamps:
        raise RuntimeError("no token came")
    return {"ttft": stamps[0], "gaps": [b - a for a, b in itertools.pairwise(stamps)],
            "tokens": usage if usage is not None else len(stamps)}


async def streaming_load(url: str, clients: int, requests: int, prompt_tokens: int,
                         max_tokens: int, rate: float, seed: int = 0) -> dict[str, float]:
    """`clients` clients streaming `requests` completions each; before each request a
    client waits an exponential time of mean 1 / rate seconds (Poisson arrivals; rate 0:
    none, each request right after the last). Prompt and output lengths drawn from a fixed
    seed: prompts of prompt_tokens / 2 .. 3 prompt_tokens / 2 ids, outputs of
    max_tokens / 2 .. max_tokens tokens."""
    g = torch.Generator().manual_seed(seed)
    plan = [[(int(torch.randint(max(1, prompt_tokens // 2), prompt_tokens * 3 // 2 + 1, (1,),
                                generator=g)),
              int(torch.randint(max(1, max_tokens // 2), max_tokens + 1, (1,), generator=g)),
              float(torch.empty(1).exponential_(generator=g)) / rate if rate else 0.0)
             for _ in range(requests)] for _ in range(clients)]
    results: list[dict] = []
    failed = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        async def client(c: int) -> None:
            nonlocal failed
            for r, (length, tokens, wait) in enumerate(plan[c]):
                await asyncio.sleep(wait)
                try:
                    results.append(await streamed(
                        http, prompt_ids(c * requests + r, length), tokens))
                except (httpx.HTTPError, RuntimeError) as e:
                    failed += 1
                    print(f"  failed: {e}", file=sys.stderr)

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - start

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    return {"tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99), "failed": failed}


def gguf_scenario(args: argparse.Namespace) -> None:
    """The same streaming clients on `tformer serve` and llama-server, one GGUF file."""
    import llama_cpp  # a sibling script

    from tformer.interop.gguf import import_gguf

    path = Path(args.gguf)
    if not path.is_file():
        raise SystemExit(f"no GGUF file {path}")
    threads = args.threads or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the tformer server inherits it
    shape = (args.prompt_tokens, args.max_tokens, args.rate)
    context = args.prompt_tokens * 3 // 2 + args.max_tokens + 16
    arrivals = (f"Poisson arrivals, {args.rate:g} requests/s a client" if args.rate
                else "each request right after the last")
    print(f"{path.name}: {args.requests} streamed requests per client ({arrivals}) of "
          f"{args.prompt_tokens // 2}-{args.prompt_tokens * 3 // 2} random token ids + "
          f"{args.max_tokens // 2}-{args.max_tokens} greedy tokens (ignore_eos), lengths "
          f"from a fixed seed; {threads} thread(s) each side; medians of {args.repeats} "
          f"alternating runs; llama.cpp: {llama_cpp.isa_summary()}; "
          f"load {os.getloadavg()[0]:.1f}")
    print("| clients | server | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | "
          "failed |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        run = import_gguf(path, Path(tmp) / "run")
        for clients in args.clients:
            ours, url = start_server(run, clients)
            try:
                with llama_cpp.server(path, threads, parallel=clients, context=context) as peer:
                    for each in (url, peer):  # warm both up
                        asyncio.run(streaming_load(each, 1, 1, args.prompt_tokens, 4, 0))
                    sides: dict[str, list[dict]] = {"tformer": [], "llama.cpp": []}
                    for repeat in range(args.repeats):
                        for name, each in (("tformer", url), ("llama.cpp", peer)):
                            sides[name].append(asyncio.run(streaming_load(
                                each, clients, args.requests, *shape, seed=repeat)))
            finally:
                ours.terminate()
                ours.wait(120)
            med = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                   for name, runs in sides.items()}
            for name, m in med.items():
                ratio = (f" ({m['tokens_per_s'] / med['llama.cpp']['tokens_per_s']:.2f}x)"
                         if name == "tformer" else "")
                print(f"| {clients} | {name} | {m['tokens_per_s']:.1f}{ratio} | "
                      f"{m['ttft_p50']:.2f} / {m['ttft_p99']:.2f} | "
                      f"{1e3 * m['itl_p50']:.0f} / {1e3 * m['itl_p99']:.0f} | "
                      f"{sum(r['failed'] for r in sides[name])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat", metavar="CKPT", help="the multi-turn chat scenario instead")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--weights", default="fp32",
                        help="the real model's weight format in the server (--chat, --budget, "
                             "--long-prompt): fp32, or q4_1 as the GGUF file holds it")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--long-prompt", metavar="CKPT",
                        help="the long-prompt scenario on this checkpoint instead")
    parser.add_argument("--baseline-src", help="another tree's src/ to serve beside this one")
    parser.add_argument("--budget", metavar="CKPT",
                        help="the scenario of many long prompts under a small --kv-memory")
    parser.add_argument("--budget-clients", type=int, default=64)
    parser.add_argument("--budget-tokens", type=int, default=2000)
    parser.add_argument("--budget-waiting", type=int,
                        help="the server's --max-waiting in --budget (default: twice the "
                             "clients, none turned away)")
    parser.add_argument("--kv-memory", type=float, default=1.0)
    parser.add_argument("--long-tokens", type=int, default=7314)
    parser.add_argument("--short-tokens", type=int, default=115)
    parser.add_argument("--shorts", type=int, default=7)
    parser.add_argument("--gguf", metavar="FILE",
                        help="tformer serve beside llama-server on this GGUF file instead")
    parser.add_argument("--threads", type=int, default=None,
                        help="--gguf: each server's threads (default: every core)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=2, help="per client")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="--gguf: Poisson arrivals, requests a second a client (0: each "
                             "request right after the last)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3,
                        help="server and offline runs alternate this many times; medians")
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                        help="also a server with --prompt-lookup N (0: none)")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--repetitive", action="store_true",
                        help="prompts that repeat a motif of 4 tokens")
    args = parser.parse_args()
    if args.budget:
        budget_scenario(args)
        return
    if args.long_prompt:
        long_prompt_scenario(args)
        return
    if args.chat:
        chat_scenario(args)
        return
    if args.gguf:
        gguf_scenario(args)
        return
    motif = 4 if args.repetitive else 0
    shape = (args.prompt_tokens, args.max_tokens, args.vocab, motif)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, model, tokenizer = build_checkpoint(
            Path(tmp) / "gpt2-small-random", layers=args.layers, d_model=args.d_model,
            heads=args.heads, vocab=args.vocab, context=args.context)
        fast = quantize_model(model, "fp32")
        servers = [start_server(ckpt, max(args.clients))]
        if args.prompt_lookup:
            servers.append(start_server(ckpt, max(args.clients), "--prompt-lookup",
                                        str(args.prompt_lookup), "--draft-tokens",
                                        str(args.draft_tokens)))
        url = servers[0][1]
        try:
            print(f"model: {args.layers} layers x {args.d_model}, {args.heads} heads, vocab "
                  f"{args.vocab}; {args.requests} requests per client of {args.prompt_tokens} "
                  f"{'repetitive ' if motif else ''}prompt + {args.max_tokens} new tokens; "
                  f"torch threads {torch.get_num_threads()}")
            lookup = (f" {'lookup tok/s':>12} {'vs plain':>8}" if args.prompt_lookup else "")
            print(f"{'clients':>7} {'server tok/s':>12} {'offline tok/s':>13} {'ratio':>6} "
                  f"{'p50 s':>7} {'p99 s':>7} {'failed':>6}{lookup}")
            # Warm every side up once.
            for _, each in servers:
                asyncio.run(load(each, 1, 1, args.prompt_tokens, 4, args.vocab, motif))
            offline_tokens_per_s(fast, tokenizer, 1, args.prompt_tokens, 4, args.vocab)
            for clients in args.clients:
                # Alternate the sides so that a busy moment of a shared machine lands on
                # all of them; report medians.
                runs, offline, speculated = [], [], []
                for _ in range(args.repeats):
                    runs.append(asyncio.run(load(url, clients, args.requests, *shape)))
                    offline.append(offline_tokens_per_s(fast, tokenizer, clients, *shape))
                    if args.prompt_lookup:
                        speculated.append(asyncio.run(load(servers[1][1], clients,
                                                           args.requests, *shape)))
                served = {key: statistics.median(r[key] for r in runs)
                          for key in ("tokens_per_s", "p50", "p99")}
                for _, each in servers:
                    print("  " + figures(each, "tformer_decoding_steps_total",
                                         "tformer_prefill_passes_total", "tformer_draft",
                                         "tformer_accepted"), file=sys.stderr)
                ratios = [r["tokens_per_s"] / o for r, o in zip(runs, offline, strict=True)]
                failed = sum(r["failed"] for r in runs + speculated)
                extra = ""
                if speculated:
                    gains = [s["tokens_per_s"] / r["tokens_per_s"]
                             for s, r in zip(speculated, runs, strict=True)]
                    extra = (f" {statistics.median(s['tokens_per_s'] for s in speculated):>12.1f}"
                             f" {statistics.median(gains):>8.2f}")
                print(f"{clients:>7} {served['tokens_per_s']:>12.1f} "
                      f"{statistics.median(offline):>13.1f} {statistics.median(ratios):>6.2f} "
                      f"{served['p50']:>7.2f} {served['p99']:>7.2f} {failed:>6}{extra}   "
                      f"ratios {' '.join(f'{x:.2f}' for x in ratios)}", flush=True)
        finally:
            for server, _ in servers:
                server.terminate()
                server.wait(120)


if __name__ == "__main__":
    main()
