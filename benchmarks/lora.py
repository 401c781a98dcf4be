"""A LoRA training step beside a full fine-tuning step of the same model, beside LoRA over
a base kept in int8 (train.lora.int8), and beside a `transformers` + `peft` LoRA step:
trainable parameters, resident memory once set up, peak resident memory and tokens/s.

    python benchmarks/lora.py [--tiny] [--repeats 3] [--steps 4] [--batch 4]
                              [--modes full,lora,lora-int8,peft] [--json]

The model is a GPT2LMHeadModel with random weights, GPT-2-small-shaped (12 x 768,
vocabulary 50257; context 256, batch 4) or with --tiny a 2 x 64 one, saved once with
save_pretrained; every run loads it from there, tformer's through its GPT-2 importer. Three
ways of training it:

- full: tformer, every weight trained;
- lora: tformer, r = 8 adapters on qkv_proj and out_proj (Hu et al. 2021's GPT-3 setting
  adapts the query and value projections; GPT-2 fuses q, k and v in one layer);
- lora-int8: the same adapters over every linear layer of the blocks kept as int8 rows
  (kernels/quantize.py's FrozenInt8Linear);
- peft: GPT2LMHeadModel wrapped by peft.get_peft_model with the same adapters (c_attn and
  the attention's c_proj, r = 8, alpha 16), in a plain training loop.

All three use the same optimizer (torch's fused AdamW over the parameters that train),
gradient clipping and random tokens, with dropout off. Each run is a process of its own and
the ways alternate `repeats` times, the order reversed every other round, so the machine's
drift falls on all alike. A process
times `steps` optimizer steps after one warm-up step; its peak resident memory is that of
those steps alone (the kernel's high-water mark is reset after loading, so the importer's
transient copies do not count). Rows give medians; the ratios are LoRA / full, LoRA int8 /
LoRA and tformer's LoRA / peft's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
              "context": 256, "batch": 4},
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512, "context": 32,
             "batch": 4},
}
MODES = ("full", "lora", "lora-int8", "peft")
LABELS = {"full": "full", "lora": "LoRA r=8", "lora-int8": "LoRA int8", "peft": "peft r=8"}
RATIOS = (("lora", "full"), ("lora-int8", "lora"), ("lora", "peft"))
RANK, ALPHA = 8, 16.0


def save_model(shape: str, dest: Path) -> None:
    """The random GPT2LMHeadModel every run starts from, written to `dest`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = dict(SHAPES[shape])
    context = sizes.pop("context")
    sizes.pop("batch")
    torch.manual_seed(0)
    last = sizes["vocab_size"] - 1
    config = GPT2Config(**sizes, n_positions=context, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=last, eos_token_id=last)
    GPT2LMHeadModel(config).save_pretrained(dest)


def load(mode: str, src: Path):  # noqa: ANN201 (an nn.Module of either library)
    """The model `mode` trains, its adapters in place, in training mode."""
    if mode == "peft":
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel.from_pretrained(src)
        adapters = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                              target_modules=r".*\.attn\.(c_attn|c_proj)", fan_in_fan_out=True)
        return get_peft_model(model, adapters).train()

    from tformer.config import LoRAConfig
    from tformer.interop import read_hf_config, read_hf_weights
    from tformer.interop.gpt2 import gpt_from_hf
    from tformer.training import lora

    model = gpt_from_hf(read_hf_config(src), read_hf_weights(src), src)
    if mode != "full":
        lora.add_adapters(model, LoRAConfig(r=RANK, alpha=ALPHA, targets=["qkv_proj", "out_proj"],
                                            int8=mode == "lora-int8"))
    return model.train()


def reset_peak_rss() -> None:
    """Start the kernel's peak-RSS count (VmHWM) again from the present RSS (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def status_mb(field: str) -> float:
    """A memory figure of /proc/self/status (VmRSS: resident now; VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one_run(shape: str, mode: str, src: Path, steps: int, batch: int) -> dict[str, float]:
    """Train `steps` steps in this process; what it measured."""
    import torch
    import torch.nn.functional as F

    from tformer.training.lora import parameter_count

    sizes = SHAPES[shape]
    context, vocab = sizes["context"], sizes["vocab_size"]
    model = load(mode, src)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    torch.manual_seed(1)
    data = torch.randint(0, vocab, (steps + 1, batch, context + 1))

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        out = model(tokens)
        return out if isinstance(out, torch.Tensor) else out.logits

    def step(s: int) -> None:
        x, y = data[s, :, :-1], data[s, :, 1:]
        loss = F.cross_entropy(logits(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    gc.collect()
    set_up = status_mb("VmRSS")
    reset_peak_rss()
    step(0)  # warm-up: the optimizer's state is made here
    start = time.perf_counter()
    for s in range(1, steps + 1):
        step(s)
    elapsed = time.perf_counter() - start
    return {
        "parameters": parameter_count(model),  # int8 weights included
        "trainable": sum(p.numel() for p in params),
        "tokens_per_s": steps * batch * context / elapsed,
        "set_up_rss_mb": set_up,
        "peak_rss_mb": status_mb("VmHWM"),
    }


def print_table(shape: str, batch: int, args: argparse.Namespace,
                table: dict[str, dict[str, float]]) -> None:
    ratios = [(a, b) for a, b in RATIOS if a in table and b in table]
    print(f"GPT-2 {shape}: {SHAPES[shape] | {'batch': batch}}, {args.steps} steps x "
          f"{args.repeats} runs each (medians)")
    header = "".join(f"{LABELS[m]:>12}" for m in table)
    header += "".join(f"{f'{LABELS[a]} / {LABELS[b]}':>22}" for a, b in ratios)
    print(f"{'':<22}{header}")
    for key, label, fmt in (("trainable", "trainable parameters", "{:,.0f}"),
                            ("parameters", "parameters", "{:,.0f}"),
                            ("set_up_rss_mb", "RSS set up (MB)", "{:,.0f}"),
                            ("peak_rss_mb", "peak RSS (MB)", "{:,.0f}"),
                            ("tokens_per_s", "tokens/s", "{:,.1f}")):
        row = "".join(f"{fmt.format(table[m][key]):>12}" for m in table)
        row += "".join(f"{table[a][key] / table[b][key]:>22.3f}" for a, b in ratios)
        print(f"{label:<22}{row}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2 x 64 model (a quick check)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, help="sequences a step (default: the shape's)")
    parser.add_argument("--modes", default=",".join(MODES), help="which of: " + ", ".join(MODES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "small"
    batch = args.batch or SHAPES[shape]["batch"]
    if args.one:  # a child process: one measurement, as JSON
        print(json.dumps(one_run(shape, args.one, args.model, args.steps, batch)))
        return
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes}: give some of {', '.join(MODES)}")

    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(shape, Path(tmp))
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                command = [sys.executable, __file__, "--one", mode, "--steps", str(args.steps),
                           "--batch", str(batch), "--model", tmp]
                out = subprocess.run(command + (["--tiny"] if args.tiny else []), check=True,
                                     capture_output=True, text=True).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    table = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
             for mode, rs in runs.items()}
    if args.json:
        print(json.dumps({"shape": {**SHAPES[shape], "batch": batch}, "steps": args.steps,
                          "repeats": args.repeats, **table}))
    else:
        print_table(shape, batch, args, table)


if __name__ == "__main__":
    main()
