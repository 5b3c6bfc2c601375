"""The one error type that sb3_gpu raises for bad input."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """Bad input: an unknown name, a value outside its domain, a file that cannot be read.

    The message is one line that says what was wrong and what is accepted; the CLIs print it and exit with code 2.
    """


def closest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ``"; did you mean 'x'?"`` (or ``""``) for the choices closest to ``name``."""
    matches = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    if not matches:
        return ""
    return "; did you mean " + " or ".join(repr(m) for m in matches) + "?"
