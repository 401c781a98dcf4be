"""`tformer import` and `tformer export`, and the functions behind them: the formats are
found here (each format's module imports tformer.interop's shared readers, never this)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from tformer.arguments import Help
from tformer.errors import TformerError
from tformer.interop import read_hf_config
from tformer.loading import read_config, resolve_checkpoint


def importers() -> dict[str, Callable[[Path, Path], Path]]:
    """model_type -> importer(src, dest). Imported lazily: each may need an extra."""
    from tformer.interop import gpt2, llama, marian

    found = {"gpt2": gpt2.import_gpt2, "marian": marian.import_marian}
    return found | dict.fromkeys(llama.MODEL_TYPES, llama.import_llama)


def import_checkpoint(src: str | Path, dest: str | Path) -> Path:
    """A local Hugging Face model directory -> a tformer checkpoint directory at `dest`."""
    src, dest = Path(src), Path(dest)
    model_type = read_hf_config(src).get("model_type")
    found = importers()
    if model_type not in found:
        raise TformerError(
            f"{src}: model_type {model_type!r} cannot be imported; known: {', '.join(found)}"
        )
    return found[model_type](src, dest)


@dataclass(frozen=True)
class Exporter:
    """One format `tformer export` writes."""

    function: str
    """"module:function", (checkpoint: Path, dest: Path) -> Path; imported when used."""
    summary: str
    """What it writes, for --help."""
    fits: str | None = None
    """"module:function", (cfg: RunConfig) -> the name of the family it would write the model
    as, or a TformerError naming what it cannot express. Export without --format takes the
    first format in EXPORTERS whose `fits` accepts the model."""
    suffix: str | None = None
    """An --out ending in it chooses this format when no --format is given."""


EXPORTERS: dict[str, Exporter] = {
    "gpt2": Exporter("tformer.interop.gpt2:export_gpt2", "GPT2LMHeadModel",
                     fits="tformer.interop.gpt2:exported_family"),
    "llama": Exporter("tformer.interop.llama:export_llama",
                      "Llama, Qwen2, Qwen3 or Mistral, whichever the config is exactly",
                      fits="tformer.interop.llama:exported_family"),
    "tformer": Exporter("tformer.training.checkpoint:ship_checkpoint",
                        "this library's checkpoint as a model is shipped: config, weights, "
                        "tokenizer, without the trainer state only --resume needs"),
}
"""--format NAME -> its exporter; a format is one entry here."""


def _function(dotted: str) -> Callable[..., Any]:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def choose_format(checkpoint: str | Path, dest: str | Path,
                  format: str | None = None) -> tuple[str, str]:
    """(the format, the family it writes) for exporting `checkpoint` to `dest`: `format`
    where given, else the one --out's suffix names, else the first whose family the
    model's config is exactly; none is a one-line error with each format's reason."""
    if format is not None and format not in EXPORTERS:
        raise TformerError(f"--format {format!r} is not known; choose one of: "
                           f"{', '.join(EXPORTERS)}")
    if format is None:
        format = next((name for name, e in EXPORTERS.items()
                       if e.suffix is not None and str(dest).endswith(e.suffix)), None)
    if format is not None:
        fits = EXPORTERS[format].fits
        cfg = read_config(resolve_checkpoint(checkpoint)) if fits else None
        return format, _function(fits)(cfg) if fits else format
    cfg = read_config(resolve_checkpoint(checkpoint))
    reasons = []
    for name, exporter in EXPORTERS.items():
        if exporter.fits is None:
            continue
        try:
            return name, _function(exporter.fits)(cfg)
        except TformerError as e:
            reasons.append(f"{name}: {e}")
    raise TformerError(f"no format other libraries load expresses {checkpoint} exactly ("
                       f"{'; '.join(reasons)}); --format tformer ships it as it is")


def export_checkpoint(checkpoint: str | Path, dest: str | Path,
                      format: str | None = None) -> Path:
    """A tformer checkpoint -> `dest` in `format` (None: choose_format's choice)."""
    format, _ = choose_format(checkpoint, dest, format)
    return _function(EXPORTERS[format].function)(Path(checkpoint), Path(dest))


def import_command(
    source: Annotated[
        str, Help("directory with config.json and the weights (GPT-2, Marian, Llama, Qwen2, "
                  "Qwen3, Mistral), or a PEFT LoRA adapter directory (with --base)")
    ],
    *,
    out: Annotated[str, Help("the new checkpoint's directory")],
    base: Annotated[
        str | None, Help("a PEFT adapter's base: the checkpoint imported from its model")
    ] = None,
) -> int:
    from tformer.interop import peft

    dest = Path(out)
    if dest.exists() and any(dest.iterdir()):
        raise TformerError(f"--out {dest} exists and is not empty; choose another directory")
    if peft.is_adapter_dir(Path(source)):
        if base is None:
            raise TformerError(f"{source} is a PEFT adapter: name the checkpoint it adapts "
                               f"with --base (a model brought in by tformer import)")
        peft.import_adapter(Path(source), base, dest)
        print(f"imported the adapter {source} on {base} into {dest}")
        return 0
    if base is not None:
        raise TformerError(f"--base is for PEFT adapter directories; {source} has no "
                           f"{peft.ADAPTER_CONFIG}")
    import_checkpoint(source, dest)
    print(f"imported {source} into {dest}")
    return 0


def export_command(
    checkpoint: Annotated[str, Help("run or checkpoint directory")],
    *,
    out: Annotated[str, Help("the new model directory")],
    format: Annotated[str | None, Help(
        "; ".join(f"{name}: {e.summary}" for name, e in EXPORTERS.items())
        + " (default: the family the model's config is exactly)",
        choices=tuple(EXPORTERS))] = None,
    adapter: Annotated[
        bool, Help("a LoRA run's adapters alone, in PEFT's format, for its exported base "
                   "(without it a LoRA run is exported with its adapters merged)")
    ] = False,
) -> int:
    if adapter:
        from tformer.interop.peft import export_adapter

        export_adapter(Path(checkpoint), Path(out))
        print(f"exported the LoRA adapters of {checkpoint} in PEFT's format into {out}")
        return 0
    chosen, family = choose_format(checkpoint, out, format)
    dest = _function(EXPORTERS[chosen].function)(Path(checkpoint), Path(out))
    size = sum(f.stat().st_size for f in Path(dest).rglob("*") if f.is_file())
    how = family if family == chosen else f"{family} (--format {chosen})"
    print(f"exported {checkpoint} as {how}"
          + (", chosen by its config" if format is None else "")
          + f" into {dest}: {size / 2**20:.2f} MiB")
    return 0
