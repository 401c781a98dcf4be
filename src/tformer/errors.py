"""The one exception type for mistakes a user can fix (bad config, bad data, bad paths).

The CLI turns it into a one-line message and exit code 2; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TformerError(Exception):
    """A problem with the user's input, explained in one line."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def shown(name: str) -> str:
    """A user-given name as it can appear in a one-line message (escaped if it must be)."""
    return name if name.isprintable() else repr(name)
