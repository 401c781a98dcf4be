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
from tformer.loading import config_of, read_config_json, resolve_checkpoint, tokenizer_kind


def importers() -> dict[str, Callable[[Path, Path], Path]]:
    """model_type -> importer(src, dest). Imported lazily: each may need an extra."""
    from tformer.interop import gemma, gpt2, gpt_oss, llama, marian, phi3

    found = {"gpt2": gpt2.import_gpt2, "marian": marian.import_marian,
             "phi3": phi3.import_phi3, "gpt_oss": gpt_oss.import_gpt_oss}
    return (found | dict.fromkeys(llama.MODEL_TYPES, llama.import_llama)
            | dict.fromkeys(gemma.MODEL_TYPES, gemma.import_gemma))


def import_checkpoint(src: str | Path, dest: str | Path) -> Path:
    """A local Hugging Face model directory, or a GGUF file, -> a tformer checkpoint
    directory at `dest`."""
    src, dest = Path(src), Path(dest)
    if src.is_file() or src.suffix == ".gguf":
        from tformer.interop.gguf import import_gguf

        return import_gguf(src, dest)
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
    tokenizers: tuple[str, ...] = ()
    """The tokenizer kinds it can write (none named: any)."""


BYTE_LEVEL_BPE = ("gpt2", "bpe")
"""A pretrained byte-level BPE, and the one `tformer train` makes: what other libraries read."""

EXPORTERS: dict[str, Exporter] = {
    "gpt2": Exporter("tformer.interop.gpt2:export_gpt2", "GPT2LMHeadModel",
                     fits="tformer.interop.gpt2:exported_family", tokenizers=BYTE_LEVEL_BPE),
    "llama": Exporter("tformer.interop.llama:export_llama",
                      "Llama, Qwen2, Qwen3 or Mistral (or the mixtures Qwen2-MoE, Qwen3-MoE, "
                      "Mixtral), whichever the config is exactly",
                      fits="tformer.interop.llama:exported_family",
                      tokenizers=BYTE_LEVEL_BPE),
    "gemma": Exporter("tformer.interop.gemma:export_gemma",
                      "Gemma2ForCausalLM or Gemma3ForCausalLM (text), whichever the config is",
                      fits="tformer.interop.gemma:exported_family", tokenizers=BYTE_LEVEL_BPE),
    "phi3": Exporter("tformer.interop.phi3:export_phi3",
                     "Phi3ForCausalLM (Phi-3, Phi-4): fused q/k/v and gate/up projections",
                     fits="tformer.interop.phi3:exported_family", tokenizers=BYTE_LEVEL_BPE),
    "gpt_oss": Exporter("tformer.interop.gpt_oss:export_gpt_oss",
                        "GptOssForCausalLM: attention sinks, biased experts with the clamped "
                        "gate, fp32 experts (not MXFP4)",
                        fits="tformer.interop.gpt_oss:exported_family",
                        tokenizers=BYTE_LEVEL_BPE),
    "tformer": Exporter("tformer.training.checkpoint:ship_checkpoint",
                        "this library's checkpoint as a model is shipped: config, weights, "
                        "tokenizer, without the trainer state only --resume needs"),
    "gguf": Exporter("tformer.interop.gguf_export:export_gguf",
                     "one GGUF file for llama.cpp, Ollama and LM Studio (Llama-layout, "
                     "GPT-2, Gemma, Phi-3 or gpt-oss models; --type sets its matrices' type)",
                     fits="tformer.interop.gguf_export:exported_family", suffix=".gguf",
                     tokenizers=BYTE_LEVEL_BPE),
}
"""--format NAME -> its exporter; a format is one entry here."""


def _function(dotted: str) -> Callable[..., Any]:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def _family_written(exporter: Exporter, raw: dict[str, Any]) -> str:
    """The family `exporter` writes a checkpoint as, from its config.json (`raw`); a
    TformerError naming what it cannot write (its model or its tokenizer)."""
    kind = tokenizer_kind(raw)
    if exporter.tokenizers and kind not in exporter.tokenizers:
        raise TformerError(f"the tokenizer is {kind!r}; this format writes a byte-level BPE "
                           f"one ({' or '.join(exporter.tokenizers)})")
    return _function(exporter.fits)(config_of(raw)) if exporter.fits else "tformer"


def choose_format(checkpoint: str | Path, dest: str | Path,
                  format: str | None = None) -> tuple[str, str]:
    """(the format, the family it writes) for exporting `checkpoint` to `dest`: `format`
    where given, else the one --out's suffix names, else the first that writes the model
    and its tokenizer exactly; none is a one-line error with each format's reason."""
    if format is not None and format not in EXPORTERS:
        raise TformerError(f"--format {format!r} is not known; choose one of: "
                           f"{', '.join(EXPORTERS)}")
    raw = read_config_json(resolve_checkpoint(checkpoint))
    if format is None:
        format = next((name for name, e in EXPORTERS.items()
                       if e.suffix is not None and str(dest).endswith(e.suffix)), None)
    if format is not None:
        return format, _family_written(EXPORTERS[format], raw)
    reasons = []
    for name, exporter in EXPORTERS.items():
        if exporter.fits is None:
            continue
        try:
            return name, _family_written(exporter, raw)
        except TformerError as e:
            reasons.append(f"{name}: {e}")
    raise TformerError(f"no format other libraries load expresses {checkpoint} exactly ("
                       f"{'; '.join(reasons)}); --format tformer ships it as it is")


def export_checkpoint(checkpoint: str | Path, dest: str | Path,
                      format: str | None = None, *, type: str | None = None) -> Path:
    """A tformer checkpoint -> `dest` in `format` (None: choose_format's choice); `type`:
    the GGUF format's tensor type."""
    format, _ = choose_format(checkpoint, dest, format)
    export = _function(EXPORTERS[format].function)
    if format == "gguf":
        return export(Path(checkpoint), Path(dest), type or "f32")
    if type is not None:
        raise TformerError("--type is for --format gguf")
    return export(Path(checkpoint), Path(dest))


def import_command(
    source: Annotated[
        str, Help("directory with config.json and the weights (GPT-2, Marian, Llama, Qwen2, "
                  "Qwen3, Mistral, Gemma 2, Gemma 3 (its text model), Phi-3/Phi-4, gpt-oss), "
                  "a .gguf file (llama, qwen2, qwen3, gpt2, gemma2, gemma3, phi3, gpt-oss), "
                  "or a PEFT LoRA adapter directory (with --base)")
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
    if Path(source).is_file():
        from tformer.interop.gguf import convert_gguf

        kept, dequantized = convert_gguf(Path(source), dest)
        print(f"imported {source} into {dest}")
        for what, types in (("kept as blocks", kept), ("dequantized to fp32", dequantized)):
            if types:
                print(f"{what}: " + ", ".join(f"{kind} ({n} tensors)"
                                              for kind, n in sorted(types.items())))
        return 0
    import_checkpoint(source, dest)
    print(f"imported {source} into {dest}")
    return 0


def export_command(
    checkpoint: Annotated[str, Help("run or checkpoint directory")],
    *,
    out: Annotated[str, Help("the new model directory (a file for gguf)")],
    format: Annotated[str | None, Help(
        "; ".join(f"{name}: {e.summary}" for name, e in EXPORTERS.items())
        + " (default: the family the model's config is exactly)",
        choices=tuple(EXPORTERS))] = None,
    type: Annotated[str | None, Help(
        "gguf only: the matrices' type, f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q6_k, iq4_xs, or "
        "llama.cpp's mixtures q4_k_m, q5_k_m (default f32)")] = None,
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
    dest = export_checkpoint(checkpoint, out, chosen, type=type)
    size = dest.stat().st_size if dest.is_file() else \
        sum(f.stat().st_size for f in Path(dest).rglob("*") if f.is_file())
    how = family if family == chosen else f"{family} (--format {chosen})"
    print(f"exported {checkpoint} as {how}"
          + (", chosen by its config" if format is None else "")
          + f" into {dest}: {size / 2**20:.2f} MiB")
    return 0
