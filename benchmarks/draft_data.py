"""Text sampled from a target model, to train a draft model on: a draft that has learnt the
target's own text proposes the target's tokens more often than one trained on the corpus
alone (speculative.py's distilled draft; Leviathan et al. 2023 and Chen et al. 2023 draw
their drafts from the same family; DistillSpec, Zhou et al. 2024, trains them on the
target's outputs).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/draft_data.py --target runs/spec-target \
        --corpus ../shared/data/tinyshakespeare/input.txt --out target-samples.txt

Each sample starts from a random slice of the corpus (`--start` tokens, so the samples
cover what the corpus covers) and continues it by sampling the target at temperature 1,
`--batch` samples at a time; the file holds the continuations, one after another.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tformer.api import load  # noqa: E402
from tformer.decoding.lm import generate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the model to sample (a run)")
    parser.add_argument("--corpus", required=True, help="text whose slices start the samples")
    parser.add_argument("--out", required=True, help="where to write the samples")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--start", type=int, default=32, help="corpus tokens a sample starts from")
    parser.add_argument("--tokens", type=int, default=0,
                        help="new tokens a sample (default: the context less --start)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model = load(args.target)
    new = args.tokens or model.module.cfg.context - args.start
    corpus = model.tokenizer.encode(Path(args.corpus).read_text(encoding="utf-8"))
    where = torch.Generator().manual_seed(args.seed)  # the starts, on the CPU
    sampling = torch.Generator(device=model.device).manual_seed(args.seed)
    pieces = []
    for done in range(0, args.samples, args.batch):
        rows = min(args.batch, args.samples - done)
        starts = torch.randint(0, len(corpus) - args.start, (rows,), generator=where)
        prompt = torch.tensor([corpus[s:s + args.start] for s in starts.tolist()],
                              device=model.device)
        steps = list(generate(model.module, prompt, max_new_tokens=new, temperature=1.0,
                              generator=sampling))
        for row in torch.stack(steps, dim=1).tolist():
            pieces.append(model.tokenizer.decode(row))
        print(f"{done + rows} of {args.samples} samples", file=sys.stderr)
    Path(args.out).write_text("".join(pieces), encoding="utf-8")
    print(f"wrote {sum(map(len, pieces)):,} characters to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
