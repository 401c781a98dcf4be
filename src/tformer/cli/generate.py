"""`tformer generate CKPT --prompt TEXT`: sample from a language model, streamed as it goes,
or with --json one object a sample; --draft or --prompt-lookup decode speculatively;
--json-schema FILE or --regex constrain the text to follow them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

from tformer.api import DRAFT_TOKENS, SAMPLING, Draft, DraftTokens, PromptLookup, Weights
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
    min_p: Annotated[
        float, Help("sample from the tokens at least this share as likely as the likeliest; "
                    "0 is off")
    ] = 0.0,
    repetition_penalty: Annotated[
        float, Help("divide the logits of the tokens already in the text (prompt included) "
                    "by this, multiply where negative; 1 is off")
    ] = 1.0,
    min_tokens: Annotated[int, Help("no end of text before this many tokens")] = 0,
    ignore_eos: Annotated[bool, Help("go on past the end-of-text token, to "
                                     "--max-new-tokens")] = False,
    seed: Annotated[int, Help("random seed of the sampling")] = SAMPLING.seed,
    num_samples: Annotated[int, Help("samples from the same prompt")] = 1,
    no_cache: Annotated[bool, Help("recompute every step (slow)")] = False,
    weights: Weights = None,
    device: Device = "auto",
    threads: Threads = None,
    draft: Draft = None,
    draft_tokens: DraftTokens = DRAFT_TOKENS,
    prompt_lookup: PromptLookup = 0,
    json_schema: Annotated[
        Path | None, Help("a JSON schema file the text follows (needs tformer[structured])")
    ] = None,
    regex: Annotated[str | None, Help("a regular expression the text follows")] = None,
    as_json: Annotated[
        bool, Help("one JSON object a sample (text, tokens, speed, speculation)",
                   flags=("--json",))
    ] = False,
) -> int:
    from tformer.api import check_generation_args, check_speculation_args, load
    from tformer.data.corpus import check_utf8
    from tformer.decoding.sampling import ExtraSampling
    from tformer.decoding.speculative import SpeculationStats

    temperature = 0.0 if greedy else temperature
    check_generation_args(max_new_tokens, temperature, top_k, top_p, num_samples)
    check_utf8(prompt, "--prompt")
    check_speculation_args(draft, draft_tokens, prompt_lookup)
    # Checked before the model loads (a bad value is a one-line error naming it).
    ExtraSampling(min_p, repetition_penalty, min_tokens, ignore_eos)
    schema = read_schema(json_schema) if json_schema is not None else None
    model = load(checkpoint, weights=weights, device=device, threads=threads, needs="generate")
    drafter = None
    if draft is not None:
        drafter = load(draft, weights=weights, device=device, threads=model.threads)
        model.check_draft(drafter)
    ids = model.prompt_ids(prompt)
    speculative = drafter is not None or prompt_lookup > 0
    how = ""
    if drafter is not None:
        how = f"; {drafter.label} drafts {draft_tokens} a round"
    elif prompt_lookup:
        how = f"; prompt lookup of {prompt_lookup}-grams drafts {draft_tokens} a round"
    print(f"generating with {model.label} ({model.family.name}, {model.description}{how})",
          file=sys.stderr)
    window = model.window
    if window is not None and len(ids) > window:
        print(f"note: the prompt is {len(ids)} tokens and the model's context is {window}; "
              f"it reads the last {window}", file=sys.stderr)
    generator = model.generator(seed)
    for sample in range(num_samples):
        stats = SpeculationStats()
        if num_samples > 1 and not as_json:
            print(f"--- sample {sample + 1} ---")
        if not as_json:
            sys.stdout.write(prompt)
        start, pieces = time.perf_counter(), []
        for piece in model.stream(
            ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, generator=generator, use_cache=not no_cache, draft=drafter,
            prompt_lookup=prompt_lookup, draft_tokens=draft_tokens, stats=stats,
            json_schema=schema, regex=regex, min_p=min_p,
            repetition_penalty=repetition_penalty, min_tokens=min_tokens, ignore_eos=ignore_eos,
        ):
            pieces.append(piece)
            if not as_json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        seconds = time.perf_counter() - start
        text = "".join(pieces)
        if as_json:
            out = {"prompt": prompt, "text": text, "tokens": stats.tokens,
                   "seconds": round(seconds, 4),
                   "tokens_per_s": round(stats.tokens / seconds, 2) if seconds else None}
            if speculative:
                out["speculation"] = stats.as_dict()
            print(json.dumps(out, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
        sys.stdout.flush()
        if speculative:
            print(f"speculation: {stats.accepted:,} of {stats.drafted:,} drafted tokens "
                  f"accepted ({100 * stats.acceptance_rate:.1f}%); {stats.tokens:,} tokens in "
                  f"{stats.rounds:,} passes of the model, {seconds:.2f} s", file=sys.stderr)
    return 0


def read_schema(path: Path) -> dict:
    """A JSON schema file; unreadable or not JSON is a one-line error naming it."""
    from tformer.errors import TformerError

    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TformerError(f"--json-schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise TformerError(f"--json-schema {path}: a schema is a JSON object")
    return schema
