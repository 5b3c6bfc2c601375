"""Learning curves and throughput of one or several runs, read from their Monitor and evaluation files.

Three panels: episode return against env steps (a rolling mean of training episodes, dots for evaluations),
return against wall time, and env steps/s over the run. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import io
import json
import math
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sb3_gpu.common.errors import ConfigError, install_hint, named, warn
from sb3_gpu.common.io import atomic_write_bytes, check_dir_creatable
from sb3_gpu.config.files import read_yaml
from sb3_gpu.envs.spec import ATARI_FRAME_SKIP, looks_atari, register_ale
from sb3_gpu.runs.rundir import RunDir


def missing() -> str:
    """Why no plot is drawn without matplotlib, with the command that installs it."""
    return f"plotting needs matplotlib: {install_hint('plot')}"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(missing()) from None
    return plt


def load_curves(run_dir: str | Path | RunDir) -> dict[str, np.ndarray]:
    """A run's episodes in time order: ``steps`` (cumulative env steps), ``seconds``, ``returns``; and evaluations."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    if not run.path.exists():
        raise ConfigError(f"{run}: no such folder; give a run dir written by sb3_gpu.train")
    if not run.path.is_dir():
        raise ConfigError(f"{run} is a file; give the run dir written by sb3_gpu.train (the folder that holds monitor/)")
    files = sorted(run.monitor.glob("*.monitor.csv")) if run.monitor.is_dir() else []
    if not files:
        raise ConfigError(f"{run} has no monitor/*.monitor.csv; is it a run dir written by sb3_gpu.train?")
    # Each stretch of training (the first, and each --resume) has its own files (N.segK.monitor.csv, then the
    # current N.monitor.csv) whose episodes carry wall-clock end times.
    segments: dict[float, tuple[list[float], list[tuple[float, float, float]]]] = {}
    for path in files:
        seg = re.search(r"\.seg(\d+)\.monitor\.csv$", path.name)  # none: the current files, after every seg
        starts, rows = segments.setdefault(int(seg[1]) if seg else math.inf, ([], []))
        try:
            start = _read_monitor(path, rows)
            starts.extend([start] if start is not None else [])  # an empty file (its header never written) has none
        except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as e:
            raise ConfigError(f"cannot read {path}: not a Monitor file ({type(e).__name__}: {e})") from None
    episodes = _training_time(segments)
    episodes = episodes[np.argsort(episodes[:, 2], kind="stable")]
    curves = {
        "returns": episodes[:, 0],
        # On Atari the Monitor sits below the frame skip (it counts whole games): its lengths are emulator frames, the
        # reset no-ops of SB3's wrappers included, so this overstates agent steps by a few per game.
        "steps": np.cumsum(episodes[:, 1]) / _frames_per_step(run),
        "seconds": episodes[:, 2],
    }
    evaluations = run.evaluations
    if evaluations.is_file():
        try:
            with evaluations.open("rb") as f, np.load(f) as ev:  # our handle: numpy's own leaks on a damaged file
                curves["eval_steps"], curves["eval_returns"] = ev["timesteps"], ev["results"].mean(axis=1)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            # Runs write it whole (renamed into place), so a file that cannot be read is damaged: the curves go on.
            # (numpy reads a damaged file as pickled data, and says how to load it unsafely: not advice to pass on.)
            why = "damaged" if "allow_pickle" in str(e) else named(e)
            warn(f"cannot read {evaluations} ({why}); the evaluations are left out")
    return curves


def _frames_per_step(run: RunDir) -> int:
    """Emulator frames per agent step of the run's env: the Atari frame skip for an Atari game, else 1. A run dir whose
    config cannot be read counts 1 (its curves are still drawn)."""
    try:
        env = read_yaml(run.config, "config").get("env")
    except (ConfigError, AttributeError):
        return 1
    if not isinstance(env, str):
        return 1
    register_ale()  # an id ale-py registers (Pong-v4) is known as Atari only then
    return ATARI_FRAME_SKIP if looks_atari(env) else 1


def _training_time(segments: dict[float, tuple[list[float], list[tuple[float, float, float]]]]) -> np.ndarray:
    """The episodes of every segment in order (seg1, seg2, ..., then the current files), their end times counted in
    training time from the run's start: each resumed segment begins where the one before it ended its last episode.
    The time between a stop and its resume is left out (a resume the next day would otherwise stretch the axis and
    draw a day at 0 env steps/s), and so is any clock difference between machines."""
    out, offset = [], 0.0  # where, in training time, the segment under way began
    for key in sorted(segments):
        starts, rows = segments[key]
        times = np.array(rows, dtype=np.float64).reshape(-1, 3)
        times[:, 2] += offset - (min(starts) if starts else 0.0)  # no start: no episode either
        out.append(times)
        offset = max(offset, float(times[:, 2].max())) if len(times) else offset
    return np.concatenate(out)


def _read_monitor(path: Path, rows: list[tuple[float, float, float]]) -> float | None:
    """Append a Monitor file's episodes (return, length, end time) to ``rows``; its start time (None: none written, as
    in the empty file a run stopped between opening it and writing its header leaves).

    Only the last line may be unreadable (a run still writing may end in half a line); any other is damage, said
    as such rather than read as "no episode yet".
    """
    with path.open(encoding="utf-8") as f:
        header = f.readline()  # #{"t_start": ..., "env_id": ...}: episode times count from t_start
        if not header:
            return None
        if not header.startswith("#"):
            raise ValueError(f"line 1 is {header.strip()[:40]!r}, not a Monitor header")
        meta = json.loads(header[1:]) if header.startswith("#{") else {}
        start = float(meta["t_start"]) if "t_start" in meta else None  # (SB3's Monitor writes it)
        columns = f.readline()
        if columns and not columns.startswith("r,l,t"):
            raise ValueError(f"line 2 is {columns.strip()[:40]!r}, not the r,l,t header")
        bad: tuple[int, str] | None = None
        for number, line in enumerate(f, start=3):
            if bad is not None:
                raise ValueError(f"line {bad[0]} is {bad[1][:40]!r}, not an episode's r,l,t")
            try:
                r, length, t = (float(v) for v in line.split(",", 3)[:3])
            except ValueError:
                bad = (number, line.strip())
                continue
            rows.append((r, length, t + (start or 0.0)))
    return start


def _rolling(values: np.ndarray, width: int) -> np.ndarray:
    if len(values) < width:
        return np.cumsum(values) / np.arange(1, len(values) + 1)
    kernel = np.ones(width) / width
    head = np.cumsum(values[: width - 1]) / np.arange(1, width)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def _rate(steps: np.ndarray, seconds: np.ndarray, points: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Env steps/s on an even time grid: cumulative steps interpolated in time, differenced (``points`` values)."""
    if len(steps) < 2 or seconds[-1] <= seconds[0]:
        return np.zeros(0), np.zeros(0)
    grid = np.linspace(seconds[0], seconds[-1], points + 1)
    done = np.interp(grid, seconds, steps)
    return (grid[1:] + grid[:-1]) / 2, np.diff(done) / np.diff(grid)


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Each run's name in the legend: its folder's name, with as many parent folders as tell two runs apart
    (``exp1/ppo``, ``exp2/ppo``); never one matplotlib hides (a name starting with ``_``) or an empty one (``.``)."""
    full = [path.resolve().parts for path in paths]
    depth = 1
    while depth < max(map(len, full)) and len({parts[-depth:] for parts in full}) < len(full):
        depth += 1
    return [" " + name if (name := "/".join(parts[-depth:])).startswith("_") else name for parts in full]


def plot_runs(run_dirs: Sequence[str | Path | RunDir], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Draw the runs on one figure and write it (atomically) to ``out``, a ``.png`` file."""
    out = Path(out)
    if out.suffix.lower() != ".png":  # (".png" alone is a hidden file's name, with no suffix)
        what = "a name before .png" if out.name.lower() == ".png" else "a path ending in .png"
        raise ConfigError(f"the plot is written as a PNG file: give {what}, got {str(out)!r}")
    curves = [load_curves(run_dir) for run_dir in run_dirs]  # first: a path that is no run dir is named as such
    if out.is_dir():
        raise ConfigError(f"cannot write the plot to {out}: it is a folder")
    check_dir_creatable(out.parent, "the plot's folder")
    plt = _pyplot()
    labels = list(labels) if labels else run_labels([Path(str(r)) for r in run_dirs])
    fig, (by_steps, by_time, speed) = plt.subplots(1, 3, figsize=(16, 4.5))
    for c, label in zip(curves, labels, strict=True):
        smooth = _rolling(c["returns"], 20)
        (line,) = by_steps.plot(c["steps"], smooth, label=label)
        if "eval_steps" in c:
            by_steps.plot(c["eval_steps"], c["eval_returns"], "o", color=line.get_color(), markersize=4)
        by_time.plot(c["seconds"], smooth, color=line.get_color(), label=label)
        t, rate = _rate(c["steps"], c["seconds"])
        speed.plot(t, rate, color=line.get_color(), label=label)
    by_steps.set(xlabel="env steps", ylabel="episode return", title="return (line: last 20 episodes; dots: eval)")
    by_time.set(xlabel="wall time (s)", ylabel="episode return", title="return against wall time")
    speed.set(xlabel="wall time (s)", ylabel="env steps/s", title="throughput (evaluation pauses included)")
    for ax in (by_steps, by_time, speed):
        ax.grid(alpha=0.3)
    by_steps.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(out, buffer.getvalue())
