"""What the CLIs share: one-line argument errors with exit code 2, and number parsing."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

from sb3_gpu.common.checks import MAX_COUNT


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line and exits 2 (not a usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _integer(text: str, low: int, what: str, high: int = MAX_COUNT) -> int:
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value) or value < low or value != int(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    if value > high:
        raise argparse.ArgumentTypeError(f"expected {what} up to {high:,}, got {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    """``1000``, ``1e5`` and ``100_000`` are accepted; zero, negatives, fractions and infinities are not."""
    return _integer(text, 1, "a positive integer")


def seed_int(text: str) -> int:
    """A seed: an integer in [0, 2**32)."""
    return _integer(text, 0, "a seed, an integer >= 0", high=2**32 - 1)


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
