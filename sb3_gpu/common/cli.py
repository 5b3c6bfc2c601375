"""What the CLIs share: one-line argument errors with exit code 2, and number parsing."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

from rich.console import Console


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line and exits 2 (not a usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _integer(text: str, low: int, what: str) -> int:
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value) or value < low or value != int(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    """``1000``, ``1e5`` and ``100_000`` are accepted; zero, negatives, fractions and infinities are not."""
    return _integer(text, 1, "a positive integer")


def seed_int(text: str) -> int:
    """A seed: an integer in [0, 2**32)."""
    value = _integer(text, 0, "a seed, an integer >= 0")
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"expected a seed below 2**32, got {text!r}")
    return value


def print_error(message: str) -> None:
    Console(stderr=True).print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)
