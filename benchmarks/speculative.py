"""Speculative decoding at batch 1: tokens/s against plain decoding of the same target, in one
run, with the same greedy tokens checked first.

    .venv/bin/python benchmarks/speculative.py --target RUN --draft RUN [--prompt-file F]
    .venv/bin/python benchmarks/speculative.py --tiny        # random tiny models: a smoke run
    python benchmarks/speculative.py --target RUN --draft RUN --device cuda   # on a GPU

Rows: plain greedy; a draft model drafting K tokens a round (K = 2, 3, 4, 6); prompt lookup
(3-grams, K = 2, 4, 7, 8) on a repetitive input (the prompt given twice, so the continuation
can copy). Each row is the median of --repeats runs, the rows timed in turn in each round;
the ratio is against plain decoding of the same prompt. `--batch B` decodes B prompts
together (row i's starts at the prompt's line i), plainly and speculating, left-padded, as
`tformer serve` batches them: rows accept different numbers of drafts.
Run it alone on the machine (one thread: OMP_NUM_THREADS=1). On a GPU a step of a small
model costs its kernel launches more than its arithmetic, so checking K + 1 tokens costs
about what one does there even where the weights would fit a CPU's cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tformer.api import load  # noqa: E402
from tformer.decoding.lm import generate, left_pad  # noqa: E402
from tformer.decoding.speculative import SpeculationStats, speculative_generate  # noqa: E402

PROMPT = ("ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and "
          "Juliet is the sun.\n")


def timed(model, prompts: list[str], tokens: int, **options) -> tuple[float, str, dict]:
    """Seconds of one greedy run over the prompts, its text, and its statistics. One prompt
    runs as `tformer generate` does (Model.stream); several decode as one batch, left-padded,
    as `tformer serve` batches them."""
    stats = SpeculationStats()
    synchronize(model.device)
    start = time.perf_counter()
    if len(prompts) == 1:
        text = "".join(model.stream(prompts[0], max_new_tokens=tokens, temperature=0.0,
                                    stats=stats, **options))
    else:
        text = "\n".join(model.tokenizer.decode(row)
                         for row in batch_tokens(model, prompts, tokens, stats, **options))
    synchronize(model.device)
    return time.perf_counter() - start, text, stats.as_dict()


def batch_tokens(model, prompts: list[str], tokens: int, stats: SpeculationStats, *,
                 draft=None, prompt_lookup: int = 0, draft_tokens: int = 4) -> list[list[int]]:
    """Each row's greedy tokens, the rows decoded together: plainly, or speculating."""
    ids = [model.prompt_ids(p) for p in prompts]
    rows: list[list[int]] = [[] for _ in ids]
    if draft is None and not prompt_lookup:
        padded, real = left_pad(ids, 0)
        for step in generate(model.module, padded.to(model.device),
                             is_real=real.to(model.device), max_new_tokens=tokens,
                             temperature=0.0):
            for row, token in zip(rows, step.tolist(), strict=True):
                row.append(token)
        stats.tokens += tokens * len(ids)
        return rows
    for new in speculative_generate(model.module, ids, max_new_tokens=tokens,
                                    draft=draft.module if draft is not None else None,
                                    lookup=prompt_lookup, draft_tokens=draft_tokens,
                                    temperature=0.0, stats=stats):
        for row, got in zip(rows, new, strict=True):
            row += got
    return rows


def batch_prompts(prompt: str, batch: int) -> list[str]:
    """`batch` prompts of different lengths from one text: row i starts at the text's line
    i (cycling), so that the rows are padded and accept different numbers of drafts."""
    lines = prompt.splitlines(keepends=True)
    return ["".join(lines[i % len(lines):]) for i in range(batch)]


def ks(text: str) -> list[int]:
    return [int(k) for k in text.split(",") if k.strip()]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_models(tmp: Path) -> tuple[Path, Path]:
    """Two small random GPTs of one tokenizer, saved as checkpoints (for --tiny)."""
    from tformer.config import config_from_dict
    from tformer.data.tokenizers import CharTokenizer
    from tformer.registry import get_family
    from tformer.training.checkpoint import save_checkpoint

    tokenizer = CharTokenizer(PROMPT)
    paths = []
    for name, layers in (("target", 2), ("draft", 1)):
        cfg = config_from_dict({"model": {"family": "gpt", "vocab_size": tokenizer.vocab_size,
                                          "n_layer": layers, "d_model": 32, "n_head": 2,
                                          "context": 512}})
        torch.manual_seed(layers)
        model = get_family("gpt").model(cfg.model)
        paths.append(save_checkpoint(tmp / name, cfg, model, tokenizer))
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="the model whose output is wanted (a run)")
    parser.add_argument("--draft", help="a small model of the same tokenizer (a run)")
    parser.add_argument("--prompt-file", help="the prompt (default: a few lines of Romeo)")
    parser.add_argument("--tokens", type=int, default=120, help="new tokens per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--weights", default="fp32", help="both models' weight format")
    parser.add_argument("--int8", dest="weights", action="store_const", const="int8",
                        help="the same as --weights int8")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--draft-ks", default="2,3,4,6", help="K of the draft model's rows")
    parser.add_argument("--lookup-ks", default="2,4,7,8", help="K of prompt lookup's rows")
    parser.add_argument("--batch", type=int, default=1,
                        help="rows decoded together (their prompts: the prompt from its line "
                             "i on, for row i)")
    parser.add_argument("--tiny", action="store_true", help="random tiny models: a smoke run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.tiny:
        import tempfile

        tmp = Path(tempfile.mkdtemp())
        args.target, args.draft = map(str, tiny_models(tmp))
        args.tokens, args.repeats = 30, 1
    if args.target is None or args.draft is None:
        parser.error("give --target and --draft (or --tiny)")
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else PROMPT
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    target = load(args.target, weights=args.weights, device=args.device, threads=1)
    draft = load(args.draft, weights=args.weights, device=args.device, threads=1)
    target.check_draft(draft)
    gpu = f"{torch.cuda.get_device_name()}; " if args.device == "cuda" else ""
    print(f"target {target.label} ({target.description}); draft {draft.label} "
          f"({draft.description}); {gpu}{args.tokens} greedy tokens, batch {args.batch}, "
          f"median of {args.repeats}")

    once = tuple(batch_prompts(prompt, args.batch))
    twice = tuple(p + p for p in once)
    cases = (
        ("plain", once, {}),
        *[(f"draft, K={k}", once, {"draft": draft, "draft_tokens": k})
          for k in ks(args.draft_ks)],
        ("plain, repeated prompt", twice, {}),
        *[(f"prompt lookup 3, K={k}, repeated prompt", twice,
           {"prompt_lookup": 3, "draft_tokens": k}) for k in ks(args.lookup_ks)],
    )
    # Rounds over all rows, the first a warm-up (kernels chosen, memory pooled): a machine
    # whose speed drifts moves every row alike.
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    last: dict[str, tuple[str, dict]] = {}
    for round_ in range(args.repeats + 1):
        for name, prompt_text, options in cases:
            seconds, text, stats = timed(target, list(prompt_text), args.tokens, **options)
            if round_:
                times[name].append(seconds)
            last[name] = (text, stats)
    rows = [(name, prompt_text, statistics.median(times[name]), *last[name])
            for name, prompt_text, _ in cases]

    plain = {p: (s, t) for n, p, s, t, _ in rows if n.startswith("plain")}
    print(f"\n| {'row':<38} | tokens/s | vs plain | accepted | same tokens |")
    print(f"| {'-' * 38} | -------: | -------: | -------: | :---------: |")
    for name, prompt_text, seconds, text, stats in rows:
        base_seconds, base_text = plain[prompt_text]
        accepted = (f"{100 * stats['acceptance_rate']:.0f}%" if stats["drafted"] else "-")
        print(f"| {name:<38} | {stats['tokens'] / seconds:8.1f} | {base_seconds / seconds:7.2f}x "
              f"| {accepted:>8} | {'yes' if text == base_text else 'NO':^11} |")
    return 0 if all(t == plain[p][1] for _, p, _, t, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
