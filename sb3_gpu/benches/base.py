"""What every bench shares: timing two things side by side in one process (medians of alternating rounds, so that
drift hits both alike), the machine line, and results written as JSON and markdown."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch as th

from sb3_gpu.common.io import atomic_write_text


def paired_medians(
    baseline: Callable[[], object], ours: Callable[[], object], repeats: int, inner: int
) -> tuple[float, float]:
    """Median seconds per call of each, over ``repeats`` rounds that alternate the two (so drift hits both alike)."""
    baseline(), ours()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((baseline, times[0]), (ours, times[1])):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - start) / inner)
    return statistics.median(times[0]), statistics.median(times[1])


def machine_line() -> str:
    """The processor, torch version and torch threads, for the first line of a bench's output."""
    return f"machine: {platform.processor() or platform.machine()}, torch {th.__version__}, {th.get_num_threads()} threads"


def write_results(out_dir: Path, name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """``NAME.json`` and ``NAME.md`` in ``out_dir``, each written atomically."""
    json_path = atomic_write_text(out_dir / f"{name}.json", json.dumps(data, indent=2) + "\n")
    md_path = atomic_write_text(out_dir / f"{name}.md", markdown)
    return json_path, md_path
