"""``BaseCallback`` subclasses: a rich progress bar with reward and windowed steps/s, VecNormalize saving, atomic
checkpoints, a graceful stop on SIGINT/SIGTERM, and a guard that stops training before NaN reaches the weights."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch as th
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback
from stable_baselines3.common.utils import safe_mean

from sb3_gpu._io import save_pickle
from sb3_gpu.checkpoint import first_non_finite, save_state
from sb3_gpu.errors import StopNow, TrainingDiverged


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
            save_pickle(self.path, vec_normalize)
        return True


class AtomicCheckpointCallback(CheckpointCallback):
    """SB3's CheckpointCallback (same names and arguments), but every file is written to a temp file and renamed,
    the replay buffer and statistics before the model, and a model with NaN or inf weights is never saved."""

    def _on_step(self) -> bool:
        if self.n_calls % self.save_freq == 0:
            bad = first_non_finite(self.model.policy)
            if bad is not None:
                raise TrainingDiverged(f"parameter {bad} is NaN or inf at {self.num_timesteps:,} timesteps")
            save_state(
                self.model,
                Path(self._checkpoint_path(extension="zip")),
                Path(self._checkpoint_path("vecnormalize_", extension="pkl")),
                Path(self._checkpoint_path("replay_buffer_", extension="pkl")) if self.save_replay_buffer else None,
            )
            if self.verbose >= 2:
                print(f"Saving model checkpoint to {self._checkpoint_path(extension='zip')}")
        return True


class StopOnSignal(BaseCallback):
    """Stop ``learn`` after the current step on SIGINT or SIGTERM; a second signal raises StopNow at once.

    Use it as a context manager around ``learn`` (handlers can only be installed from the main thread; elsewhere
    it does nothing and Ctrl-C keeps Python's default)::

        stop = StopOnSignal()
        with stop:
            model.learn(total, callback=[stop, ...])
        if stop.received: ...  # save and exit with 128 + stop.received
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM), verbose: int = 0):
        super().__init__(verbose)
        self.signals = signals
        self.received: int | None = None
        self.installed = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
            self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        self.installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise StopNow
        self.received = signum
        # os.write, not print: a handler may run in the middle of a print, and print is not reentrant.
        name = signal.Signals(signum).name
        os.write(2, f"\n{name} received: stopping after this step and saving (again to quit at once)\n".encode())

    def _on_step(self) -> bool:
        return self.received is None


_CAUSES = "the loss diverged: look for NaN or inf in rewards or observations, or lower the learning rate"


class NanGuard(BaseCallback):
    """Stop training with :class:`TrainingDiverged` when a gradient or parameter turns NaN or inf.

    Gradients are checked by an optimizer step pre-hook, so a NaN loss is caught before it reaches the weights
    and the model in memory stays the last finite one. Steps that AMP's loss scaler skips never reach the
    optimizer's ``step`` (nor this check): its overflows are expected and handled there. Parameters are checked
    again at the start of each rollout, for what the hook cannot see (a finite gradient too large for the weights).
    """

    def __init__(self, verbose: int = 0):
        super().__init__(verbose)
        self._handles: list[Any] = []
        self._names: dict[int, str] = {}

    def _on_training_start(self) -> None:
        self.close()
        policy = self.model.policy
        self._names = {id(p): name for name, p in policy.named_parameters()}
        # SAC-like policies hold several optimizers, one per sub-module.
        optimizers = {o for m in policy.modules() if isinstance(o := getattr(m, "optimizer", None), th.optim.Optimizer)}
        self._handles = [o.register_step_pre_hook(self._check_gradients) for o in optimizers]

    def _check_gradients(self, optimizer: th.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return
        norms = th.stack(th._foreach_norm([p.grad for p in params]))
        if not bool(norms.isfinite().all()):
            name = self._names.get(id(params[int((~norms.isfinite()).nonzero()[0, 0])]), "?")
            raise TrainingDiverged(
                f"the gradient of {name} is NaN or inf at {self.num_timesteps:,} timesteps, so the step was not "
                f"applied ({_CAUSES})"
            )

    def _on_rollout_start(self) -> None:
        bad = first_non_finite(self.model.policy)
        if bad is not None:
            raise TrainingDiverged(f"parameter {bad} is NaN or inf at {self.num_timesteps:,} timesteps ({_CAUSES})")

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        self.close()

    def close(self) -> None:
        """Remove the optimizer hooks (``learn`` skips ``_on_training_end`` when it raises)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
