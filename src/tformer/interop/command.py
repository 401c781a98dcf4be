"""`tformer import` and `tformer export`: the command-line side of interop."""

from __future__ import annotations

from pathlib import Path

from tformer.errors import TformerError
from tformer.interop import export_checkpoint, import_checkpoint


def import_command(source: str, out: str) -> int:
    dest = Path(out)
    if dest.exists() and any(dest.iterdir()):
        raise TformerError(f"--out {dest} exists and is not empty; choose another directory")
    import_checkpoint(source, dest)
    print(f"imported {source} into {dest}")
    return 0


def export_command(checkpoint: str, out: str, *, format: str = "gpt2") -> int:
    export_checkpoint(checkpoint, out, format)
    print(f"exported {checkpoint} as {format} into {out}")
    return 0
