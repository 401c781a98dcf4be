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


# --- a translation task with exactly one right answer ---------------------------------------

BUILTIN_PARALLEL = "builtin:numbers-de"

_UNITS = ("null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun")
_TEENS = ("zehn", "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn",
          "achtzehn", "neunzehn")
_TENS = ("", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig",
         "neunzig")


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = ""
    if hundreds:
        words = ("ein" if hundreds == 1 else _UNITS[hundreds]) + "hundert"
    if rest == 0:
        return words
    if rest < 10:
        return words + _UNITS[rest]
    if rest < 20:
        return words + _TEENS[rest - 10]
    tens, units = divmod(rest, 10)
    if units == 0:
        return words + _TENS[tens]
    # German says the units first: 47 is "siebenundvierzig", 21 "einundzwanzig".
    return words + ("ein" if units == 1 else _UNITS[units]) + "und" + _TENS[tens]


def german_number(n: int) -> str:
    """0 <= n < 1,000,000 spelled out in German, as one word ("dreihundertsiebenundvierzig")."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"{n} is outside 0..999999")
    if n == 0:
        return "null"
    thousands, rest = divmod(n, 1000)
    words = ""
    if thousands:
        # "eins" loses its s before a multiplier: 1000 "eintausend", 101000 "einhunderteintausend".
        head = _below_thousand(thousands)
        words = head.removesuffix("eins") + "ein" if head.endswith("eins") else head
        words += "tausend"
    return words + _below_thousand(rest)


def number_pairs(count: int, max_number: int, seed: int = 0) -> list[tuple[str, str]]:
    """`count` distinct numbers in 0..max_number as (digits, German words) pairs, in a
    random order fixed by `seed`; all of them when count exceeds the range."""
    import random

    rng = random.Random(seed)
    if count > max_number:
        numbers = list(range(max_number + 1))
        rng.shuffle(numbers)
    else:
        numbers = rng.sample(range(max_number + 1), count)
    return [(str(n), german_number(n)) for n in numbers]
