"""`tformer evaluate CKPT [DATA]`: a language model's loss, perplexity and bits per character,
or a translation model's BLEU and chrF, as a table or one JSON object."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Annotated, Any

from tformer.api import Weights
from tformer.arguments import Gathered, Help
from tformer.cli.common import Checkpoint, Device, Ensemble, Threads, ensemble_note, print_metrics
from tformer.errors import TformerError


def add_family_options(parser: argparse.ArgumentParser) -> None:
    from tformer.registry import evaluate_options

    for option in evaluate_options():
        parser.add_argument(option.flag, dest=option.name, type=option.type, default=None,
                            choices=option.choices, help=option.help)


def given_family_options(args: argparse.Namespace) -> dict[str, Any]:
    from tformer.registry import evaluate_options

    return {o.name: getattr(args, o.name) for o in evaluate_options()
            if getattr(args, o.name, None) is not None}


def evaluate(
    checkpoint: Checkpoint,
    data: Annotated[
        list[str] | None,
        Help("LM: a text file or folder; seq2seq: SRC REF (default: the run's validation "
             "split)", nargs="*"),
    ] = None,
    *,
    weights: Weights = None,
    as_json: Annotated[bool, Help("one JSON object instead of a table", flags=("--json",))] = False,
    batch_size: Annotated[
        int, Help("sequences at once (default: the run's; seq2seq: 32 sentences)")
    ] = 0,
    ensemble: Ensemble = None,
    device: Device = "auto",
    threads: Threads = None,
    options: Annotated[dict[str, Any] | None,
                       Gathered(add_family_options, given_family_options)] = None,
) -> int:
    """options: the family's own evaluate options that were given (--mem-len as mem_len);
    ensemble: translation checkpoints to decode together with `checkpoint`."""
    from tqdm import tqdm

    from tformer.api import load

    options = options or {}
    data = list(data or [])
    model = load(checkpoint, weights=weights, device=device, threads=threads,
                 ensemble=ensemble or ())
    family = model.family
    check_evaluate_options(options, family.name, model.label)
    source = " and ".join(data) if data else "the run's validation split"
    said: list[str] = []

    def say_what_runs() -> None:
        """Once the data has been read (bad data is an error line of its own)."""
        if not said:
            said.append(source)
            print(f"evaluating {model.label}{ensemble_note(ensemble)} ({family.name}, "
                  f"{model.description}) on {source}", file=sys.stderr)

    # A bar on a terminal only; the family says what its evaluate counts (tokens, lines).
    bar = tqdm(unit=family.progress_unit, unit_scale=True, file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())

    def progress(n: int) -> None:
        say_what_runs()
        bar.update(n)

    try:
        result = family.evaluate(model.checkpoint, data, options, batch_size=batch_size,
                                 progress=progress)
    finally:
        bar.close()
    check_finite_loss(result, model.label)
    say_what_runs()
    print_metrics(result, as_json, first=family.metrics)
    return 0


def check_evaluate_options(options: dict[str, Any], family: str, label: str) -> None:
    """Refuse options the checkpoint's family does not take, naming those that do."""
    from tformer.registry import FAMILIES, evaluate_options, get_family

    taken = {o.name for o in get_family(family).eval_options}
    unknown = sorted(set(options) - {o.name for o in evaluate_options()})
    if unknown:
        raise TformerError(f"evaluate takes no option {unknown[0]!r}")
    for option in evaluate_options():
        if option.name in options and option.name not in taken:
            takers = [f.name for f in FAMILIES.values()
                      if option.name in {o.name for o in f.eval_options}]
            raise TformerError(
                f"{option.flag} applies to {' and '.join(takers)} checkpoints; {label} is a "
                f"{family} model"
            )


def check_finite_loss(result: dict[str, Any], label: str) -> None:
    loss = result.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        raise TformerError(
            f"the model in {label} gives non-finite outputs on this data (loss = {loss}); "
            f"its figures would mean nothing"
        )
