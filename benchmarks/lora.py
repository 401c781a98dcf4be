"""A LoRA training step beside a full fine-tuning step of the same model: trainable
parameters, peak resident memory and tokens/s.

    python benchmarks/lora.py [--tiny] [--repeats 3] [--steps 4] [--json]

The model is GPT-2-small-shaped (12 x 768, vocabulary 50257, context 256, batch 4) with
random weights, or with --tiny a 2 x 64 one. Each way of training runs in its own process
(peak RSS only grows within a process), the two alternating `repeats` times; each process
times `steps` optimizer steps after one warm-up step, with the trainer's own optimizer
(tformer.training.optimizer.make_optimizer: fused AdamW over the parameters that train). LoRA
adapts qkv_proj and out_proj at r = 8 (Hu et al. 2021's GPT-3 setting adapts the query and
value projections). Rows give medians; the ratio is LoRA / full.
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


def one_run(shape: str, mode: str, steps: int) -> dict[str, float]:
    """Train `steps` steps in this process; what it measured."""
    import torch

    from tformer.config import LoRAConfig, TrainConfig
    from tformer.evaluation.loss import lm_loss
    from tformer.models.gpt import GPT, GPTConfig
    from tformer.training import lora
    from tformer.training.optimizer import make_optimizer

    sizes = dict(SHAPES[shape])
    batch = sizes.pop("batch")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**sizes))
    if mode == "lora":
        lora.add_adapters(model, LoRAConfig(r=8, alpha=16.0, targets=["qkv_proj", "out_proj"]))
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
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": lora.trainable_parameters(model),
        "tokens_per_s": steps * batch * sizes["context"] / elapsed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2 x 64 model (a quick check)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "small"
    if args.one:  # a child process: one measurement, as JSON
        print(json.dumps(one_run(shape, args.one, args.steps)))
        return

    runs: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    for _ in range(args.repeats):
        for mode in runs:
            command = [sys.executable, __file__, "--one", mode, "--steps", str(args.steps)]
            out = subprocess.run(command + (["--tiny"] if args.tiny else []), check=True,
                                 capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    table = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
             for mode, rs in runs.items()}
    if args.json:
        print(json.dumps({"shape": SHAPES[shape], "steps": args.steps,
                          "repeats": args.repeats, **table}))
        return
    full, lora = table["full"], table["lora"]
    print(f"GPT {shape}: {SHAPES[shape]}, {args.steps} steps x {args.repeats} runs each "
          f"(medians; ratio = LoRA / full)")
    print(f"{'':<24}{'full':>14}{'LoRA r=8':>14}{'ratio':>10}")
    for key, label, fmt in (("trainable", "trainable parameters", "{:,.0f}"),
                            ("parameters", "parameters", "{:,.0f}"),
                            ("peak_rss_mb", "peak RSS (MB)", "{:,.0f}"),
                            ("tokens_per_s", "tokens/s", "{:,.0f}")):
        print(f"{label:<24}{fmt.format(full[key]):>14}{fmt.format(lora[key]):>14}"
              f"{lora[key] / full[key]:>10.3f}")


if __name__ == "__main__":
    main()
