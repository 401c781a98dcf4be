"""A LoRA training step beside a full fine-tuning step of the same model, and beside LoRA
over a base kept in int8 (train.lora.int8): trainable parameters, peak resident memory,
resident memory once the model is set up, and tokens/s.

    python benchmarks/lora.py [--tiny] [--repeats 3] [--steps 4] [--batch 4]
                              [--modes full,lora,lora-int8] [--json]

The model is GPT-2-small-shaped (12 x 768, vocabulary 50257, context 256, batch 4) with
random weights, or with --tiny a 2 x 64 one. Each way of training runs in its own process
(peak RSS only grows within a process), in alternation `repeats` times (the order reversed
every other round, so that drift on a shared machine falls on all); each process times
`steps` optimizer steps after one warm-up step, with the trainer's own optimizer
(tformer.training.optimizer.make_optimizer: fused AdamW over the parameters that train). LoRA
adapts qkv_proj and out_proj at r = 8 (Hu et al. 2021's GPT-3 setting adapts the query and
value projections); lora-int8 keeps every linear layer of the blocks, adapted or not, as
int8 rows (kernels/quantize.py's FrozenInt8Linear). Rows give medians; the ratios are
LoRA / full and LoRA int8 / LoRA.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SHAPES = {
    "small": {"n_layer": 12, "n_head": 12, "d_model": 768, "vocab_size": 50257,
              "context": 256, "batch": 4},
    "tiny": {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 512, "context": 32,
             "batch": 4},
}
MODES = ("full", "lora", "lora-int8")
LABELS = {"full": "full", "lora": "LoRA r=8", "lora-int8": "LoRA int8"}


def resident_mb() -> float:
    """This process's resident memory now (ru_maxrss is the peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def one_run(shape: str, mode: str, steps: int, batch: int) -> dict[str, float]:
    """Train `steps` steps in this process; what it measured."""
    import torch

    from tformer.config import LoRAConfig, TrainConfig
    from tformer.evaluation.loss import lm_loss
    from tformer.models.gpt import GPT, GPTConfig
    from tformer.training import lora
    from tformer.training.optimizer import make_optimizer

    sizes = dict(SHAPES[shape])
    sizes.pop("batch")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**sizes))
    if mode != "full":
        lora.add_adapters(model, LoRAConfig(r=8, alpha=16.0, targets=["qkv_proj", "out_proj"],
                                            int8=mode == "lora-int8"))
    set_up = resident_mb()
    optimizer = make_optimizer(model, TrainConfig(lr=1e-4, min_lr=0.0), torch.device("cpu"))
    data = torch.randint(0, sizes["vocab_size"], (steps + 1, batch, sizes["context"] + 1))
    params = [p for p in model.parameters() if p.requires_grad]

    def step(s: int) -> None:
        loss = lm_loss(model(data[s, :, :-1]), data[s, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)  # warm-up: the optimizer's state is made here
    start = time.perf_counter()
    for s in range(1, steps + 1):
        step(s)
    elapsed = time.perf_counter() - start
    return {
        "parameters": lora.parameter_count(model),
        "trainable": lora.trainable_parameters(model),
        "tokens_per_s": steps * batch * sizes["context"] / elapsed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "set_up_rss_mb": set_up,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2 x 64 model (a quick check)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, help="sequences a step (default: the shape's)")
    parser.add_argument("--modes", default=",".join(MODES), help="which of: " + ", ".join(MODES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "small"
    batch = args.batch or SHAPES[shape]["batch"]
    if args.one:  # a child process: one measurement, as JSON
        print(json.dumps(one_run(shape, args.one, args.steps, batch)))
        return
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes}: give some of {', '.join(MODES)}")

    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            command = [sys.executable, __file__, "--one", mode, "--steps", str(args.steps),
                       "--batch", str(batch)]
            out = subprocess.run(command + (["--tiny"] if args.tiny else []), check=True,
                                 capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    table = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
             for mode, rs in runs.items()}
    if args.json:
        print(json.dumps({"shape": {**SHAPES[shape], "batch": batch}, "steps": args.steps,
                          "repeats": args.repeats, **table}))
        return
    print_table(shape, batch, args, table)


def print_table(shape: str, batch: int, args: argparse.Namespace,
                table: dict[str, dict[str, float]]) -> None:
    ratios = [(a, b) for a, b in (("lora", "full"), ("lora-int8", "lora"))
              if a in table and b in table]
    print(f"GPT {shape}: {SHAPES[shape] | {'batch': batch}}, {args.steps} steps x "
          f"{args.repeats} runs each (medians)")
    header = "".join(f"{LABELS[m]:>14}" for m in table)
    header += "".join(f"{f'{LABELS[a]} / {LABELS[b]}':>22}" for a, b in ratios)
    print(f"{'':<24}{header}")
    for key, label, fmt in (("trainable", "trainable parameters", "{:,.0f}"),
                            ("parameters", "parameters", "{:,.0f}"),
                            ("set_up_rss_mb", "RSS set up (MB)", "{:,.0f}"),
                            ("peak_rss_mb", "peak RSS (MB)", "{:,.0f}"),
                            ("tokens_per_s", "tokens/s", "{:,.1f}")):
        row = "".join(f"{fmt.format(table[m][key]):>14}" for m in table)
        row += "".join(f"{table[a][key] / table[b][key]:>22.3f}" for a, b in ratios)
        print(f"{label:<24}{row}")


if __name__ == "__main__":
    main()
