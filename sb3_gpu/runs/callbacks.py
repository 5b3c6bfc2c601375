"""``BaseCallback`` subclasses that every sb3_gpu training runs: a graceful stop on SIGINT/SIGTERM, the NaN guard,
atomic checkpoints, VecNormalize saving, a progress bar with reward and windowed steps/s, and free heap memory given
back."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch as th
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.utils import safe_mean

from sb3_gpu.common.checks import duration_arg
from sb3_gpu.common.errors import ConfigError, StopNow, TrainingDiverged, warn
from sb3_gpu.common.io import save_pickle
from sb3_gpu.common.memory import return_free_memory
from sb3_gpu.extensions.stepping import UPDATE_OF, OptimizerStep, first_non_finite, optimizer_steps, settle_guards
from sb3_gpu.runs.rundir import RunDir
from sb3_gpu.runs.saving import calls_from_the_models_steps, non_finite_statistics, save_state, settle_training
from sb3_gpu.runs.telemetry import WindowedRate


class StopOnSignal(BaseCallback):
    """Stop ``learn`` after the current step on SIGINT or SIGTERM; a second signal raises StopNow at once.

    ``saving`` says, in the line printed on the first signal, that the caller saves the model after the stop.

    Use it as a context manager around ``learn`` (handlers can only be installed from the main thread; elsewhere
    it does nothing and Ctrl-C keeps Python's default)::

        stop = StopOnSignal()
        with stop:
            model.learn(total, callback=[stop, ...])
        if stop.received: ...  # save and exit with 128 + stop.received
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM), saving: bool = True, verbose: int = 0):
        super().__init__(verbose)
        self.signals, self.saving = signals, saving
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
            raise StopNow(signum)
        self.received = signum
        # os.write, not print: a handler may run in the middle of a print, and print is not reentrant.
        name = signal.Signals(signum).name
        then = " and saving" if self.saving else ""
        os.write(2, f"\n{name} received: stopping after this step{then} (again to quit at once)\n".encode())

    def _on_step(self) -> bool:
        return self.received is None


_CAUSES = "the loss diverged: look for NaN or inf in rewards or observations, or lower the learning rate"
_STATISTICS = "an env returned a NaN or inf observation or reward, and VecNormalize took it into its running statistics"


def non_finite_input(error: BaseException, timesteps: int) -> TrainingDiverged | None:
    """The error said as what it is where the policy was given a NaN or inf observation: torch's distributions refuse
    their parameters then (a ValueError about a constraint; with argument checks off, as sb3_gpu's collection runs,
    a categorical's draw refuses its probabilities), and the observation is found in the traceback's frames. None for
    any other error (a user's callback's, say, whatever its locals hold)."""
    refused = (isinstance(error, ValueError) and "to satisfy the constraint" in str(error)) or (
        isinstance(error, RuntimeError) and "probability tensor contains either" in str(error)
    )
    if not refused:
        return None
    tb, evaluating = error.__traceback__, False
    while tb is not None:
        frame = tb.tb_frame
        evaluating = evaluating or frame.f_code.co_name == "evaluate_policy"
        if any(_non_finite(frame.f_locals.get(name)) for name in ("observation", "obs")):
            diverged = _nan_observation("in an evaluation" if evaluating else "in training", timesteps)
            diverged.__cause__ = error
            return diverged
        tb = tb.tb_next
    return None


def _nan_observation(where: str, timesteps: int) -> TrainingDiverged:
    return TrainingDiverged(
        f"the policy was given a NaN or inf observation {where} at {timesteps:,} timesteps: an env returned it, "
        "or VecNormalize's statistics hold it (SB3's VecCheckNan finds the step that made it)"
    )


def _non_finite(value: object) -> bool:
    if isinstance(value, dict):
        return any(_non_finite(item) for item in value.values())
    try:
        if isinstance(value, th.Tensor):
            return value.is_floating_point() and not bool(th.isfinite(value).all())
        if isinstance(value, np.ndarray):
            return value.dtype.kind == "f" and not bool(np.isfinite(value).all())
    except RuntimeError:  # a device that failed (after a CUDA error): the error stays as it was
        return False
    return False


class NanGuard(BaseCallback):
    """Stop training with :class:`TrainingDiverged` when a gradient or parameter turns NaN or inf.

    Gradients are checked by the policy's :class:`~sb3_gpu.extensions.stepping.OptimizerStep` before each step, so
    a NaN loss is caught before it reaches the weights and the model in memory stays the last finite one. Steps
    that fp16 AMP's loss scale skips are not errors: its overflows are expected and handled there. Parameters are
    checked again at the start of each rollout, for what the step cannot see (a finite gradient too large for the
    weights), except where every step is compiled (``extensions.graphstep``): those skip such an update themselves,
    and reading the weights would make the host wait for the device at each rollout.
    """

    def __init__(self, verbose: int = 0):
        super().__init__(verbose)
        self._guarded: list[OptimizerStep] = []

    def _on_training_start(self) -> None:
        self.close()
        # The observations of the reset that learn() began with (then each step's, in _on_step).
        if _non_finite(getattr(self.model, "_last_obs", None)):
            raise _nan_observation("in training", self.num_timesteps)
        self._guarded = optimizer_steps(self.model)
        for step in self._guarded:
            step.on_non_finite = self._diverged

    def _diverged(self, name: str) -> TrainingDiverged:
        if name.startswith(UPDATE_OF):  # a compiled step: the gradient was finite, the weight it made was not
            what = f"the {name}"
        else:
            what = f"the gradient of {name}" if name else "the loss (its gradients finite)"
        return TrainingDiverged(
            f"{what} is NaN or inf at {self.num_timesteps:,} timesteps, so the step was not applied ({_CAUSES})"
        )

    def _on_rollout_start(self) -> None:
        if self._guarded and all(step.compiled for step in self._guarded):
            return  # compiled steps skip any step that would leave a weight non-finite: nothing to read here
        bad = first_non_finite(self.model.policy)
        if bad is not None:
            raise TrainingDiverged(f"parameter {bad} is NaN or inf at {self.num_timesteps:,} timesteps ({_CAUSES})")

    def _on_step(self) -> bool:
        # The observations the env just returned, on the host: where the policy takes them without torch's argument
        # checks (sb3_gpu's collection), or ignores them (random actions before learning_starts), a NaN would reach
        # the env as an action and the buffer as a transition, and be found only later, as a NaN gradient.
        infos, dones = self.locals.get("infos") or (), self.locals.get("dones")
        ended = (info.get("terminal_observation") for i, info in enumerate(infos) if dones is not None and dones[i])
        if _non_finite(self.locals.get("new_obs")) or any(_non_finite(obs) for obs in ended):
            raise _nan_observation("in training", self.num_timesteps)
        return True

    def _on_training_end(self) -> None:
        try:
            settle_guards(self.model)  # steps skipped on the device since the last log write
        finally:
            self.close()

    def close(self) -> None:
        """Stop guarding the optimizers (``learn`` skips ``_on_training_end`` when it raises)."""
        for step in self._guarded:
            step.on_non_finite = None
        self._guarded = []


class AtomicCheckpointCallback(BaseCallback):
    """Checkpoints every ``save_freq`` calls, named as SB3's CheckpointCallback names them, written atomically: the
    statistics, the model, then the replay buffer. A model with NaN or inf weights is never saved, and a step that the
    NaN guard skipped on the device since the last log write stops the run here, before the checkpoint. Only the
    newest checkpoint keeps its replay buffer: each is a whole copy, and an older one is dropped once a newer one is
    written whole.

    :param save_freq: calls (env steps / n_envs) between checkpoints
    :param run_dir: the run whose ``checkpoints/`` folder receives them
    :param save_replay_buffer: save the replay buffer (with PER priorities) with the checkpoint, in place of the last
    """

    def __init__(self, save_freq: int, run_dir: RunDir, save_replay_buffer: bool = False, verbose: int = 0):
        super().__init__(verbose)
        self.save_freq, self.run_dir, self.save_replay_buffer = save_freq, run_dir, save_replay_buffer

    def _init_callback(self) -> None:
        calls_from_the_models_steps(self)

    def _on_step(self) -> bool:
        if self.n_calls % self.save_freq == 0:
            settle_training(self.model)  # a step skipped on the device since the last log write stops the run here
            bad = first_non_finite(self.model.policy)
            if bad is not None:
                raise TrainingDiverged(f"parameter {bad} is NaN or inf at {self.num_timesteps:,} timesteps")
            stats = non_finite_statistics(self.model)
            if stats is not None:
                raise TrainingDiverged(f"{stats} is NaN or inf at {self.num_timesteps:,} timesteps ({_STATISTICS})")
            files = self.run_dir.checkpoint(self.num_timesteps)
            lost = save_state(self.model, files, replay_buffer=self.save_replay_buffer)
            if lost is not None:  # the model is saved; the next checkpoint tries the buffer again
                warn(f"checkpoint {files.model}: {lost}", RuntimeWarning)
            elif files.replay_buffer.is_file():  # written whole: the older checkpoints' copies are not needed
                removed = self.run_dir.drop_older_checkpoint_buffers(self.num_timesteps)
                final = self.run_dir.drop_older_final_buffer(self.num_timesteps)
                if self.verbose >= 2:
                    for path in removed:
                        print(f"Removed the older checkpoint replay buffer {path}")
                    if final is not None:
                        print(f"Removed the older final replay buffer {final}")
            if self.verbose >= 2:
                print(f"Saving model checkpoint to {files.model}")
        return True


class ReturnFreeMemory(BaseCallback):
    """Give the C heap's free pages back to the system every ``every_s`` seconds, between env steps.

    Without it, a training whose steps allocate large temporaries (TQC's quantile losses) can hold gigabytes of free
    heap in its resident memory while using a few hundred megabytes (see :mod:`sb3_gpu.common.memory`). A no-op where
    the C library cannot do it.
    """

    def __init__(self, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic, verbose: int = 0):
        super().__init__(verbose)
        if not callable(clock):
            raise ConfigError(f"clock must be a callable that returns seconds (time.monotonic, say), got {clock!r}")
        self.every_s, self.clock = duration_arg(every_s, "every_s", zero=True), clock
        self.returned = 0  # calls that gave pages back
        self._due = 0.0

    def _on_training_start(self) -> None:
        self._due = self.clock() + self.every_s

    def _on_step(self) -> bool:
        now = self.clock()
        if now >= self._due:
            self.returned += return_free_memory()
            self._due = now + self.every_s
        return True


class SaveVecNormalizeCallback(BaseCallback):
    """Save the training env's VecNormalize statistics (atomically) whenever it is called, e.g. on a new best model."""

    def __init__(self, path: str | Path, verbose: int = 0):
        super().__init__(verbose)
        self.path = Path(path)

    def _on_step(self) -> bool:
        vec_normalize = self.model.get_vec_normalize_env()
        if vec_normalize is not None:
            stats = non_finite_statistics(self.model)
            if stats is not None:
                raise TrainingDiverged(f"{stats} is NaN or inf at {self.num_timesteps:,} timesteps ({_STATISTICS})")
            save_pickle(self.path, vec_normalize)
        return True


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
