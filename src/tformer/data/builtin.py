"""Corpora the package makes itself, so that it runs with no download.

`python_source()`: the Python standard library's own source files on this machine, a few
megabytes of real, varied text that every Python installation has.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

BUILTIN_LM = "builtin:python"


def python_source(max_chars: int = 2_000_000) -> str:
    """The standard library's top-level modules in name order, up to `max_chars` characters."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(parts)[:max_chars]
