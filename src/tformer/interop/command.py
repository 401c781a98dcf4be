"""`tformer import` and `tformer export`, and the functions behind them: the formats are
found here (each format's module imports tformer.interop's shared readers, never this)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from tformer.arguments import Help
from tformer.errors import TformerError
from tformer.interop import read_hf_config


def importers() -> dict[str, Callable[[Path, Path], Path]]:
    """model_type -> importer(src, dest). Imported lazily: each may need an extra."""
    from tformer.interop import gpt2, llama, marian

    found = {"gpt2": gpt2.import_gpt2, "marian": marian.import_marian}
    return found | dict.fromkeys(llama.MODEL_TYPES, llama.import_llama)


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


def exporters() -> dict[str, Callable[[Path, Path], Path]]:
    """--format -> exporter(checkpoint, dest). Imported lazily: each may need an extra."""
    from tformer.interop import gguf_export, gpt2, llama

    # llama: whichever of Llama, Qwen2, Qwen3 and Mistral the model's config is exactly.
    return {"gpt2": gpt2.export_gpt2, "llama": llama.export_llama,
            "gguf": gguf_export.export_gguf}


def export_checkpoint(checkpoint: str | Path, dest: str | Path, format: str | None = None,
                      *, type: str | None = None) -> Path:
    """A tformer checkpoint -> a Hugging Face model directory at `dest`, or a GGUF file
    (format "gguf", or a dest ending in .gguf; `type`: its tensors' type)."""
    if format is None:
        format = "gguf" if str(dest).endswith(".gguf") else "gpt2"
    found = exporters()
    if format not in found:
        raise TformerError(
            f"--format {format!r} is not known; choose one of: {', '.join(found)}"
        )
    if format == "gguf":
        from tformer.interop.gguf_export import export_gguf

        return export_gguf(Path(checkpoint), Path(dest), type or "f32")
    if type is not None:
        raise TformerError("--type is for --format gguf")
    return found[format](Path(checkpoint), Path(dest))


def import_command(
    source: Annotated[
        str, Help("directory with config.json and the weights (GPT-2, Marian, Llama, Qwen2, "
                  "Qwen3, Mistral), a .gguf file (llama, qwen2, qwen3, gpt2), or a PEFT LoRA "
                  "adapter directory (with --base)")
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
    out: Annotated[str, Help("the new model directory (a .gguf file for --format gguf)")],
    format: Annotated[str | None, Help(
        "gpt2 (GPT2LMHeadModel), llama (Llama, Qwen2, Qwen3 or Mistral: whichever the "
        "config is exactly), or gguf (one file for llama.cpp, Ollama, LM Studio); default: "
        "gguf for an --out ending in .gguf, else gpt2")] = None,
    type: Annotated[str | None, Help(
        "GGUF only: the matrices' type, f32, f16, q8_0, q4_0 or q4_1 (default f32)")] = None,
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
    export_checkpoint(checkpoint, out, format, type=type)
    chosen = format or ("gguf" if out.endswith(".gguf") else "gpt2")
    print(f"exported {checkpoint} as {chosen} into {out}")
    return 0
