"""What every bench shares: timing two things side by side in one process (medians of alternating rounds, so that
drift hits both alike), the machine line, and results written as JSON and markdown."""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch as th

from sb3_gpu.common.cli import stops_held
from sb3_gpu.common.errors import ConfigError, ResultsNotWritten
from sb3_gpu.common.hardware import detect_hardware
from sb3_gpu.common.io import atomic_write_text, make_dir
from sb3_gpu.common.torch_settings import TorchSettings
from sb3_gpu.config.files import presets_dir


@dataclass(frozen=True)
class Paired:
    """Seconds per call of a baseline and of ours, one pair per round, by one clock."""

    baseline: list[float]
    ours: list[float]

    def medians(self) -> tuple[float, float]:
        return statistics.median(self.baseline), statistics.median(self.ours)

    def median_ratio(self) -> float:
        """The median over rounds of ours / baseline: each round's two runs saw the same machine, so their ratio
        is steadier than a ratio of medians when the machine's speed drifts."""
        return statistics.median(o / b for o, b in zip(self.ours, self.baseline, strict=True))


def paired_times(
    baseline: Callable[[], object], ours: Callable[[], object], repeats: int, inner: int = 1
) -> tuple[Paired, Paired]:
    """Wall and CPU (this process) seconds per call of each, over ``repeats`` rounds in ABBA order, after a warm-up.

    CPU time leaves out what the machine took away (other processes, a VM's stolen time), so for single-process
    work it shows the cost of what was added more steadily than wall time.
    """
    baseline(), ours()  # warm-up
    wall: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    for round_ in range(repeats):
        order = ((baseline, 0), (ours, 1)) if round_ % 2 == 0 else ((ours, 1), (baseline, 0))
        for fn, side in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(inner):
                fn()
            wall[side].append((time.perf_counter() - start) / inner)
            cpu[side].append((time.process_time() - start_cpu) / inner)
    return Paired(*wall), Paired(*cpu)


def paired_medians(
    baseline: Callable[[], object], ours: Callable[[], object], repeats: int, inner: int
) -> tuple[float, float]:
    """Median wall seconds per call of each, over ``repeats`` rounds that alternate the two (drift hits both alike)."""
    return paired_times(baseline, ours, repeats, inner)[0].medians()


# As plain SB3 finds them: taken at import, before any plan of a bench sets its own. A baseline trains with these, not
# with what the variant or seed before it left in the process.
SB3_TORCH = TorchSettings.current()


def machine_line() -> str:
    """The processor's model name, torch version and torch threads, for the first line of a bench's output.

    The model name, not just the architecture: the project's own figures come from VMs whose processor changes, and
    a timing table is only comparable with one from the same processor.
    """
    return f"machine: {detect_hardware().cpu}, torch {th.__version__}, {th.get_num_threads()} threads"


def write_results(out_dir: Path, name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """``NAME.json`` and ``NAME.md`` in ``out_dir``, each written atomically."""
    make_dir(out_dir, "--out folder")
    try:
        with stops_held():  # a stop that comes now is dropped: the write is a moment's, and it completes two files
            json_path = atomic_write_text(out_dir / f"{name}.json", json.dumps(data, indent=2) + "\n")
            md_path = atomic_write_text(out_dir / f"{name}.md", markdown)
    except OSError as e:  # the runs file (bench train, solve) still holds the ended runs: the same command writes them
        raise ResultsNotWritten(f"cannot write the results into {out_dir}: {e.strerror or e}") from None
    return json_path, md_path


def machine_key() -> str:
    """The processor, its cores and the GPUs torch sees: what a saved result is kept for (a run timed with a GPU
    hidden is not one timed with it)."""
    hardware = detect_hardware()
    gpus = ", ".join(g.name for g in hardware.gpus) or ("Apple MPS" if hardware.mps else "no GPU")
    return f"{hardware.cpu}, {hardware.logical_cores} cores, {gpus}"


def preset_sha256(algo: str, preset: str | None = None) -> str:
    """The sha256 of the preset file a run of ``algo`` reads: ``preset`` (a path or ``zoo:SPEC``), else the bundled
    one. A saved result is kept only for the same bytes."""
    if preset is None:
        path = presets_dir() / f"{algo}.yaml"
    elif preset.startswith("zoo:"):
        from sb3_gpu.config.zoo import zoo_file  # reads SB3's algorithm table: only when asked

        path = zoo_file(preset.removeprefix("zoo:"))
    else:
        path = Path(preset)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"cannot read the preset file {path}: {exc.strerror or exc}") from None


def save_json(path: Path, data: dict[str, Any], what: str) -> None:
    """``data`` written atomically to ``path``; a failure (a full disk) is one line, not a traceback mid-bench."""
    try:
        make_dir(path.parent, "--out folder")
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise ResultsNotWritten(f"cannot save {what} to {path}: {exc.strerror or exc}") from None
