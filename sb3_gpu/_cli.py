"""What the CLIs share: one-line argument errors with exit code 2, and number parsing."""

from __future__ import annotations

import argparse
from typing import NoReturn

from rich.console import Console


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line and exits 2 (not a usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """``1000``, ``1e5`` and ``100_000`` are accepted; zero, negatives and fractions are not."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(value)


def print_error(message: str) -> None:
    Console(stderr=True).print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)
