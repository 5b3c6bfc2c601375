"""The one training loop that ``train``, ``tune`` and ``bench`` share: ``model.learn`` with a stop on SIGINT/SIGTERM
after the current step, the NaN guard, throughput telemetry, periodic evaluation and free heap pages given back to the
system; with a run dir also checkpoints, the best model, and a save at the end (after a stop or an error too, where the
weights are finite)."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import TensorBoardOutputFormat
from stable_baselines3.common.vec_env import unwrap_vec_normalize

from sb3_gpu.common.cli import shell_line
from sb3_gpu.common.errors import StopNow
from sb3_gpu.common.io import out_of_space
from sb3_gpu.envs.build import explain_env_error
from sb3_gpu.extensions.compile import forgiving_recompiles
from sb3_gpu.extensions.stepping import first_non_finite
from sb3_gpu.runs.callbacks import (
    AtomicCheckpointCallback,
    NanGuard,
    ProgressCallback,
    ReturnFreeMemory,
    StopOnSignal,
    non_finite_input,
)
from sb3_gpu.runs.evaluation import EvaluationStopped, TimedEvalCallback, evaluate
from sb3_gpu.runs.rundir import RunDir
from sb3_gpu.runs.saving import non_finite_statistics, save_state
from sb3_gpu.runs.telemetry import ThroughputCallback


@dataclass
class Outcome:
    """How a session's training ended.

    :ivar timesteps: the model's ``num_timesteps`` at the end
    :ivar steps: env steps taken in this session
    :ivar stopped_by: ``SIGINT`` or ``SIGTERM`` when a signal stopped it
    :ivar error: the exception that ended it (an env crash, a diverged loss), to re-raise once reported
    :ivar saved: with a run dir, what was saved and where (and how to go on when interrupted)
    """

    timesteps: int
    steps: int
    wall_s: float
    stopped_by: str | None = None
    error: BaseException | None = None
    saved: str | None = None
    model_path: Path | None = None
    throughput: dict[str, float] = field(default_factory=dict)

    @property
    def interrupted(self) -> bool:
        return self.stopped_by is not None or self.error is not None

    @property
    def steps_per_s(self) -> float | None:
        return self.steps / self.wall_s if self.wall_s > 0 else None


class Session:
    """One training of ``model``, inside a ``with`` block that owns SIGINT and SIGTERM::

        with Session(model, evaluator=TimedEvalCallback(eval_env, eval_freq=1000)) as session:
            outcome = session.learn(100_000)
            mean, std = session.evaluate(10)   # a second signal still quits at once here

    The first signal stops ``learn`` after the current env step (``outcome.stopped_by``); a second one raises
    :class:`~sb3_gpu.common.errors.StopNow` at once, also while the session saves. Errors out of ``learn`` are
    returned in ``outcome.error`` after the save, for the caller to report and re-raise.

    :param evaluator: periodic evaluation (its time is split out by telemetry)
    :param run_dir: where checkpoints and the final model go (nothing is written without one)
    :param checkpoint_freq: env steps between checkpoints (with ``run_dir``; None: none)
    :param save_replay_buffer: save the replay buffer with the final model and each checkpoint
    :param progress: draw a progress bar on this console
    :param report_s: print a throughput line every ``report_s`` seconds through ``print_fn`` (None: never)
    :param callbacks: more callbacks, run after these
    """

    def __init__(
        self,
        model: BaseAlgorithm,
        *,
        evaluator: TimedEvalCallback | None = None,
        run_dir: RunDir | None = None,
        checkpoint_freq: int | None = None,
        save_replay_buffer: bool = False,
        progress: Console | None = None,
        report_s: float | None = None,
        print_fn: Callable[[str], None] = print,
        callbacks: Sequence[BaseCallback] = (),
    ):
        self.model, self.evaluator, self.run_dir = model, evaluator, run_dir
        self.save_replay_buffer = save_replay_buffer
        self.stop = StopOnSignal(saving=run_dir is not None)
        self.guard = NanGuard()
        self.telemetry = ThroughputCallback(report_s=report_s, print_fn=print_fn, eval_callback=evaluator)
        self._progress_console = progress
        self._progress: ProgressCallback | None = None
        self._checkpoint_freq = checkpoint_freq
        self._extra = list(callbacks)
        if evaluator is not None:
            evaluator.should_stop = self.stopping

    def stopping(self) -> bool:
        """Whether a signal asked the session to stop."""
        return self.stop.received is not None

    @property
    def stopped_by(self) -> str | None:
        """``SIGINT`` or ``SIGTERM`` once a signal asked the session to stop."""
        return signal.Signals(self.stop.received).name if self.stop.received is not None else None

    def __enter__(self) -> Session:
        self.stop.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()
        self.stop.__exit__(*exc)

    def learn(self, timesteps: int, *, reset_num_timesteps: bool = True, tb_log_name: str = "run") -> Outcome:
        """``model.learn(timesteps)`` with the session's callbacks, then, with a run dir, the final save."""
        model = self.model
        start_steps = 0 if reset_num_timesteps else model.num_timesteps
        callbacks = self._callbacks(start_steps + timesteps)
        error: BaseException | None = None
        start = time.perf_counter()
        try:
            # forgiving_recompiles: sb3_gpu's classes set it themselves; a plain SB3 model compiled too
            with forgiving_recompiles(model), _tensorboard_errors_raised_once():
                model.learn(timesteps, callback=callbacks, tb_log_name=tb_log_name, reset_num_timesteps=reset_num_timesteps)
        except StopNow:  # the second signal: quit at once, writing nothing more
            raise
        except KeyboardInterrupt:
            self.stop.received = signal.SIGINT  # not the main thread, so Python's own Ctrl-C: stop and save
        except EvaluationStopped:  # the evaluation a resume owed, run before the first step: stopped_by names the signal
            pass
        except Exception as e:
            if self.run_dir is not None and _monitor_out_of_space(e, self.run_dir):  # the disk's, not the env's
                error = e
            else:
                error = explain_env_error(e, model.get_env())  # type: ignore[arg-type]
            if error is e and self.evaluator is not None:  # not a training env's: maybe one of a periodic evaluation
                error = explain_env_error(e, self.evaluator.eval_env, what="evaluation env")
            if error is e:  # not an env's own: maybe the policy's, on an observation an env made NaN
                error = non_finite_input(e, model.num_timesteps) or e
            if isinstance(error, OSError) and error.filename is None and _from_tensorboard(error):
                error.filename = _tensorboard_dir(model)  # a full disk, say: the write names no file
        finally:
            self._release()
        outcome = Outcome(
            timesteps=int(model.num_timesteps),
            steps=int(model.num_timesteps - start_steps),
            wall_s=time.perf_counter() - start,
            stopped_by=self.stopped_by,
            error=error,
            throughput={k: round(v, 4) for k, v in self.telemetry.latest.items()},
        )
        if self.run_dir is not None:
            self._save(outcome, complete=model.num_timesteps >= start_steps + timesteps)
        return outcome

    def evaluate(self, episodes: int, deterministic: bool = True) -> tuple[float, float]:
        """Mean and std of the return on the evaluator's env, with the training env's normalisation statistics.

        A signal abandons it at once with :class:`~sb3_gpu.runs.evaluation.EvaluationStopped` (``stopped_by`` names
        the signal).
        """
        assert self.evaluator is not None, "a session evaluates on its evaluator's env"
        train_norm, eval_norm = self.model.get_vec_normalize_env(), unwrap_vec_normalize(self.evaluator.eval_env)
        # Only the statistics: SB3 wraps image envs in VecTransposeImage for training, so the two chains differ.
        if train_norm is not None and eval_norm is not None:
            if train_norm.norm_obs:  # VecNormalize has no obs_rms where it scales rewards only
                eval_norm.obs_rms = copy.deepcopy(train_norm.obs_rms)
            eval_norm.ret_rms = copy.deepcopy(train_norm.ret_rms)
        if self.stopping():
            raise EvaluationStopped
        return evaluate(self.model, self.evaluator.eval_env, episodes, deterministic, should_stop=self.stopping)

    def _callbacks(self, total_timesteps: int) -> list[BaseCallback]:
        callbacks: list[BaseCallback] = [self.stop, self.guard]
        if self.evaluator is not None:
            callbacks.append(self.evaluator)
        if self.run_dir is not None and self._checkpoint_freq is not None:
            calls = max(self._checkpoint_freq // self.model.n_envs, 1)
            callbacks.append(AtomicCheckpointCallback(calls, self.run_dir, self.save_replay_buffer))
        if self._progress_console is not None:
            self._progress = ProgressCallback(total_timesteps, console=self._progress_console)
            callbacks.append(self._progress)
        return [*callbacks, ReturnFreeMemory(), self.telemetry, *self._extra]

    def _release(self) -> None:
        # SB3 skips on_training_end when learn() raises: release the terminal and the hooks here.
        if self._progress is not None:
            self._progress.stop()
        self.telemetry.close()
        self.guard.close()

    def _save(self, outcome: Outcome, complete: bool) -> None:
        """Save the model (unless its weights are NaN) and say where, and how to go on if the run was cut short."""
        assert self.run_dir is not None
        run, model = self.run_dir, self.model
        bad = first_non_finite(model.policy)
        stats = non_finite_statistics(model) if bad is None else None
        if bad is not None:
            outcome.saved = f"the weights are NaN ({bad}), so no model was saved; {run.last_good()}"
        elif stats is not None:
            outcome.saved = f"{stats} is NaN or inf (an env returned one), so no model was saved; {run.last_good()}"
        else:
            try:
                lost = save_state(model, run.final, replay_buffer=self.save_replay_buffer)
                outcome.model_path = run.final.model
                outcome.saved = f"model saved to {run.final.model} at {model.num_timesteps:,} timesteps"
                if lost is not None:
                    outcome.saved += f" ({lost}; --resume would start with an empty one)"
                    # Said now, not only in summary.json: a run that finished exits 0 and prints no `saved` line.
                    warnings.warn(
                        f"{run.final.model}: {lost}; --resume would start with an empty one", RuntimeWarning, stacklevel=2
                    )
                elif run.final.replay_buffer.is_file() and self.save_replay_buffer:
                    outcome.saved += f", its replay buffer beside it ({run.final.replay_buffer.name})"
                    # The final copy supersedes theirs, a checkpoint's of this very step too (the last one often is).
                    run.drop_older_checkpoint_buffers(model.num_timesteps + 1)
            except OSError as e:  # a full disk, say: the atomic writes kept every earlier file whole
                outcome.saved = f"could not write {e.filename} ({e.strerror}); {run.last_good()}"
                outcome.error = outcome.error or e
        if outcome.interrupted and complete and not (run.saved_states() or run.best_model.is_file()):
            outcome.saved += "; training was complete"  # nothing to evaluate
        elif outcome.interrupted and complete:  # a stop during the last update: nothing is left to resume
            outcome.saved += f"; training was complete (to evaluate: {shell_line('-m', 'sb3_gpu.evaluate', run)})"
        elif outcome.interrupted and run.saved_states():
            outcome.saved += f"; continue with: {shell_line('-m', 'sb3_gpu.train', '--resume', run)}"
        elif outcome.interrupted:  # --resume would refuse it: no model.zip, no checkpoint
            outcome.saved += "; nothing to resume from (--resume needs model.zip or a checkpoint)"


class _TensorBoardThreadErrors:
    """Sessions training at once (threads) share one hook: set by the first, put back by the last."""

    lock = threading.Lock()
    users = 0
    previous: Callable[[threading.ExceptHookArgs], object] = threading.excepthook

    inside = threading.local()

    @classmethod
    def hook(cls, args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__module__.startswith("tensorboard."):
            return
        if getattr(cls.inside, "active", False):  # a hook set meanwhile that chains back here: Python's own ends it
            threading.__excepthook__(args)
            return
        cls.inside.active = True
        try:
            cls.previous(args)
        finally:
            cls.inside.active = False

    @classmethod
    def unlocked_in_child(cls) -> None:  # a child forked while a thread held the lock would wait for it for ever
        cls.lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_TensorBoardThreadErrors.unlocked_in_child)


@contextlib.contextmanager
def _tensorboard_errors_raised_once() -> Iterator[None]:
    """TensorBoard writes on a thread of its own: a failed write there (a full disk) is raised again in the training
    thread at its next log write, where the run says it in one line; Python's thread hook printed it as a traceback
    before that. Not here."""
    state = _TensorBoardThreadErrors
    with state.lock:
        if state.users == 0 and threading.excepthook != state.hook:
            state.previous, threading.excepthook = threading.excepthook, state.hook
        state.users += 1
    try:
        yield
    finally:
        with state.lock:
            state.users -= 1
            if state.users == 0 and threading.excepthook == state.hook:  # not if something else set its own meanwhile
                threading.excepthook = state.previous


def _from_tensorboard(e: BaseException) -> bool:
    return any(f"{os.sep}tensorboard{os.sep}" in frame.filename for frame in traceback.extract_tb(e.__traceback__))


def _monitor_out_of_space(e: BaseException, run: RunDir) -> bool:
    """Whether ``e`` is a Monitor (of an env in this process) failing to write the run's episode rows for want of
    space: the env factory's Monitor names its file in the error (``envs.spec``)."""
    filename = getattr(e, "filename", None)
    # SB3 opens the CSV by its real path; the run dir may be relative (runs/...) or under a link.
    return out_of_space(e) and isinstance(filename, str) and Path(filename).parent == Path(os.path.realpath(run.monitor))


def _tensorboard_dir(model: BaseAlgorithm) -> str | None:
    for output in model.logger.output_formats:
        if isinstance(output, TensorBoardOutputFormat):
            return str(output.writer.log_dir)
    return None
