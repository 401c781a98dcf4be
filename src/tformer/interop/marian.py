"""Hugging Face MarianMTModel (OPUS-MT) import: not written yet."""

from __future__ import annotations

from pathlib import Path

from tformer.errors import TformerError


def import_marian(src: Path, dest: Path) -> Path:
    raise TformerError(f"{src}: importing Marian models is not supported yet")
