"""lm-evaluation-harness on one multiple-choice task, through `tformer serve` (its
`local-completions` backend) beside its own `hf` backend on the same weights.

The model is a GPT-2-shaped tformer GPT (random weights, a byte-level BPE trained on tiny
shakespeare, or on generated text where the data is missing), exported with
tformer.interop.gpt2.export_gpt2 so that transformers' GPT2LMHeadModel holds the same
weights. The task: --items questions, each the start of a line of the text, with four
endings to choose from (its own, and three from other lines), written as local files.
Reported per backend: the harness's wall time (its start-up included; the server is up
before the clock starts), the accuracy, and the largest difference between the two
backends' log-likelihoods of any choice, which says they scored the same thing. The two
backends alternate --repeats times; the table shows medians and their ratio.

    python benchmarks/lm_eval_speed.py                      # 4 x 256, 200 items
    python benchmarks/lm_eval_speed.py --layers 12 --d-model 768 --items 500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tformer.config import config_from_dict  # noqa: E402
from tformer.data.tokenizers import BPETokenizer  # noqa: E402
from tformer.interop.gpt2 import export_gpt2  # noqa: E402
from tformer.models.gpt import GPT  # noqa: E402
from tformer.training.checkpoint import save_checkpoint  # noqa: E402

SHAKESPEARE = [base / "shared" / "data" / "tinyshakespeare" / "input.txt"
               for base in (ROOT.parent, ROOT.parent.parent)]
"""../shared/data beside the repository (or beside the folder of worktrees)."""
TASK = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def corpus_lines() -> list[str]:
    found = [path for path in SHAKESPEARE if path.exists()]
    if found:
        text = found[0].read_text(encoding="utf-8")
    else:
        rng = random.Random(0)
        words = ["the", "king", "queen", "sword", "night", "love", "death", "crown", "fair"]
        text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 12)))
                         for _ in range(4000))
    return [line.strip() for line in text.splitlines() if len(line.split()) >= 6]


def write_task(lines: list[str], items: int, dest: Path) -> Path:
    rng = random.Random(1)
    picked = rng.sample(lines, items)
    rows = []
    for line in picked:
        words = line.split()
        cut = len(words) // 2
        ending = " ".join(words[cut:])
        others = [" ".join(o.split()[len(o.split()) // 2:]) for o in rng.sample(lines, 3)]
        choices = [ending, *others]
        rng.shuffle(choices)
        rows.append({"question": " ".join(words[:cut]), "choices": choices,
                     "answer": choices.index(ending)})
    data = dest / "items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (dest / "tasks").mkdir()
    (dest / "tasks" / "bench_mc.yaml").write_text(TASK.format(data=data), encoding="utf-8")
    return dest / "tasks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def harness(args: list[str], out: Path, env: dict[str, str]) -> tuple[float, dict, list]:
    """Run lm_eval; its wall time, results and samples."""
    exe = Path(sys.executable).parent / "lm_eval"
    start = time.perf_counter()
    run = subprocess.run([str(exe) if exe.exists() else "lm_eval", "run", *args,
                          "--output_path", str(out), "--log_samples"],
                         env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"lm_eval failed:\n{run.stderr[-4000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["bench_mc"]
    samples = [json.loads(line) for line in
               next(out.rglob("samples_bench_mc_*.jsonl")).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    return wall, results, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    lines = corpus_lines()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = BPETokenizer.train(lines, args.vocab)
        cfg = config_from_dict({"model": {"family": "gpt", "n_layer": args.layers,
                                          "d_model": args.d_model, "n_head": args.heads,
                                          "context": args.context,
                                          "vocab_size": tokenizer.vocab_size},
                                "train": {"device": "cpu"}})
        torch.manual_seed(0)
        ckpt = save_checkpoint(tmp / "bench-gpt", cfg, GPT(cfg.model).eval(), tokenizer)
        hf_dir = export_gpt2(ckpt, tmp / "hf")
        tasks = write_task(lines, args.items, tmp)
        threads = str(torch.get_num_threads())
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf-home"),
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": threads}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [sys.executable, "-m", "tformer", "serve", str(ckpt), "--port", str(port),
             "--device", "cpu", "--max-batch", str(args.batch_size)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: {server.stderr.read()}")
                time.sleep(0.2)
            common = ["--tasks", "bench_mc", "--include_path", str(tasks),
                      "--batch_size", str(args.batch_size)]
            backends = {
                "tformer serve": ["--model", "local-completions", "--model_args",
                                  f"model=bench-gpt,base_url={url}/v1/completions,"
                                  f"tokenizer_backend=remote,max_length={args.context}",
                                  *common],
                "hf": ["--model", "hf", "--model_args",
                       f"pretrained={hf_dir},dtype=float32", "--device", "cpu", *common],
            }
            walls: dict[str, list[float]] = {name: [] for name in backends}
            seen: dict[str, tuple[dict, list]] = {}
            for r in range(args.repeats):
                for name, cli in backends.items():
                    wall, results, samples = harness(cli, tmp / f"out-{name[:2]}-{r}", env)
                    walls[name].append(wall)
                    seen[name] = (results, samples)
        finally:
            server.terminate()
            server.wait(60)
    diff = max(abs(float(a[0][0]) - float(b[0][0]))
               for sa, sb in zip(seen["tformer serve"][1], seen["hf"][1], strict=True)
               for a, b in zip(sa["resps"], sb["resps"], strict=True))
    print(f"model: {args.layers} layers x {args.d_model}, {args.heads} heads, vocab "
          f"{tokenizer.vocab_size}, context {args.context}; {args.items} items x 4 choices; "
          f"batch {args.batch_size}; torch threads {threads}; medians of {args.repeats}")
    print(f"{'backend':>14} {'wall s':>8} {'acc':>7}")
    for name in backends:
        print(f"{name:>14} {statistics.median(walls[name]):8.2f} "
              f"{seen[name][0]['acc,none']:7.3f}")
    ratio = statistics.median(walls["hf"]) / statistics.median(walls["tformer serve"])
    print(f"hf wall / tformer serve wall: {ratio:.2f}; largest log-likelihood difference "
          f"between the backends: {diff:.2e}")


if __name__ == "__main__":
    main()
