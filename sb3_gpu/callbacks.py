"""``BaseCallback`` subclasses: a rich progress bar with reward and windowed steps/s, and VecNormalize saving."""

from __future__ import annotations

import collections
import io
import pickle
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.utils import safe_mean

from sb3_gpu._io import atomic_write_bytes


class Window:
    """Cumulative counters (a number or an array) sampled over time; their change over the last ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.points: collections.deque[tuple[float, Any]] = collections.deque()

    def add(self, now: float, counters: Any) -> None:
        self.points.append((now, counters))
        while len(self.points) > 2 and now - self.points[1][0] >= self.seconds:
            self.points.popleft()

    def delta(self) -> tuple[float, Any] | None:
        """(seconds, change of the counters) from the oldest point kept to the newest; None before two points."""
        if len(self.points) < 2:
            return None
        (t0, c0), (t1, c1) = self.points[0], self.points[-1]
        return (t1 - t0, c1 - c0) if t1 > t0 else None


class WindowedRate(Window):
    """Steps per second over the last ``window_s`` seconds (a running average since start-up lags for the whole run)."""

    def __init__(self, window_s: float = 10.0) -> None:
        super().__init__(window_s)

    def rate(self) -> float:
        delta = self.delta()
        return float(delta[1] / delta[0]) if delta is not None else 0.0


class ProgressCallback(BaseCallback):
    """A rich progress bar showing timesteps, mean episode return and steps/s over the last 10 seconds.

    :param total_timesteps: the length of the bar (``model.learn``'s ``total_timesteps``)
    :param refresh_s: how often the bar is redrawn; the step hook costs one clock read otherwise
    """

    def __init__(self, total_timesteps: int, refresh_s: float = 0.5, console: Console | None = None, verbose: int = 0):
        super().__init__(verbose)
        self.total_timesteps = total_timesteps
        self.refresh_s = refresh_s
        self.console = console
        self.rate = WindowedRate()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._next_refresh = 0.0

    def _on_training_start(self) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[sps]:>7.0f} steps/s"),
            TextColumn("return {task.fields[ret]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("training", total=self.total_timesteps, sps=0.0, ret="-")
        self._progress.start()
        self.rate.add(time.perf_counter(), self.num_timesteps)

    def _on_step(self) -> bool:
        now = time.perf_counter()
        if now >= self._next_refresh:
            self._next_refresh = now + self.refresh_s
            self._refresh(now)
        return True

    def _refresh(self, now: float) -> None:
        assert self._progress is not None and self._task is not None
        self.rate.add(now, self.num_timesteps)
        episodes = self.model.ep_info_buffer
        ret = f"{safe_mean([ep['r'] for ep in episodes]):.1f}" if episodes else "-"
        self._progress.update(self._task, completed=self.num_timesteps, sps=self.rate.rate(), ret=ret)

    def _on_training_end(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Draw the last state and release the terminal (also after an interrupted ``learn``)."""
        if self._progress is not None:
            self._refresh(time.perf_counter())
            self._progress.stop()
            self._progress = None


class SaveVecNormalizeCallback(BaseCallback):
    """Save the training env's VecNormalize statistics (atomically) whenever it is called, e.g. on a new best model."""

    def __init__(self, path: str | Path, verbose: int = 0):
        super().__init__(verbose)
        self.path = Path(path)

    def _on_step(self) -> bool:
        vec_normalize = self.model.get_vec_normalize_env()
        if vec_normalize is not None:
            buffer = io.BytesIO()
            pickle.dump(vec_normalize, buffer)
            atomic_write_bytes(self.path, buffer.getvalue())
        return True
