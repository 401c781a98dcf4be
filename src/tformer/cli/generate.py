"""`tformer generate CKPT --prompt TEXT`: sample from a language model, streamed as it goes."""

from __future__ import annotations

import sys
from typing import Annotated

from tformer.api import SAMPLING
from tformer.arguments import Help
from tformer.cli.common import Checkpoint, Device, Threads


def generate(
    checkpoint: Checkpoint,
    *,
    prompt: Annotated[str, Help("text to continue (default: none)")] = "",
    max_new_tokens: Annotated[int, Help("tokens to add")] = SAMPLING.max_new_tokens,
    temperature: Annotated[float, Help("0 is greedy")] = SAMPLING.temperature,
    greedy: Annotated[bool, Help("same as --temperature 0")] = False,
    top_k: Annotated[int, Help("sample from the k likeliest; 0 is off")] = SAMPLING.top_k,
    top_p: Annotated[
        float, Help("sample from the likeliest tokens of this total probability; 1 is off")
    ] = SAMPLING.top_p,
    seed: Annotated[int, Help("random seed of the sampling")] = SAMPLING.seed,
    num_samples: Annotated[int, Help("samples from the same prompt")] = 1,
    no_cache: Annotated[bool, Help("recompute every step (slow)")] = False,
    int8: Annotated[bool, Help("int8 weights (CPU): faster, ~same text")] = False,
    device: Device = "auto",
    threads: Threads = None,
) -> int:
    from tformer.api import check_generation_args, load
    from tformer.data.corpus import check_utf8

    temperature = 0.0 if greedy else temperature
    check_generation_args(max_new_tokens, temperature, top_k, top_p, num_samples)
    check_utf8(prompt, "--prompt")
    model = load(checkpoint, int8=int8, device=device, threads=threads, needs="generate")
    ids = model.prompt_ids(prompt)
    print(f"generating with {model.label} ({model.family.name}, {model.description})",
          file=sys.stderr)
    window = model.window
    if window is not None and len(ids) > window:
        print(f"note: the prompt is {len(ids)} tokens and the model's context is {window}; "
              f"it reads the last {window}", file=sys.stderr)
    generator = model.generator(seed)
    for sample in range(num_samples):
        if num_samples > 1:
            print(f"--- sample {sample + 1} ---")
        sys.stdout.write(prompt)
        for piece in model.stream(
            ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, generator=generator, use_cache=not no_cache,
        ):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0
