"""Throughput telemetry: where a run's time goes, logged through SB3's logger, and a TensorBoard dashboard layout.

``ThroughputCallback`` records under ``throughput/``: env steps/s and episodes/s over a sliding window (warm-up
excluded), optimizer steps per 1,000 env steps, the shares of wall time spent stepping envs, in the rest of
collection (policy inference, buffer writes, callbacks), in training and in periodic evaluation, replay-buffer
fill, process RSS and CPU use, and on CUDA the allocated and peak device memory (and GPU utilisation where
nvidia-ml-py is installed). Env time comes from a thin VecEnv timer put on the model's env for the duration
of ``learn``; collection and training time from the rollout hooks; optimizer steps from the count that the policy's
:class:`~sb3_gpu.extensions.stepping.OptimizerStep` keeps: steps that gradient accumulation held back do not
count, nor fp16 overflows skipped on the host; those skipped on the device (a fused or compiled step) do, since
reading them would make training wait (``amp/skipped_steps`` has their number).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import TensorBoardOutputFormat
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import VecEnv, VecMonitor, is_vecenv_wrapped

from sb3_gpu.common.checks import bool_arg, duration_arg
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.stepping import OptimizerStep, optimizer_steps
from sb3_gpu.runs.evaluation import TimedEvalCallback, hold_writes


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


# Where the time goes, in the order lines and tables give it: env steps, the rest of collection and SB3's loop,
# training, periodic evaluation.
SHARES = ("env", "other", "train", "eval")

# The "Custom Scalars" dashboard: category -> chart -> tag regexes (several runs in one log dir share it).
DASHBOARD: dict[str, dict[str, list[Any]]] = {
    "Returns": {
        "episode return (rollout, eval, confirmed)": [
            "Multiline",
            [r"rollout/ep_rew_mean", r"eval/mean_reward", r"eval/confirmed_mean_reward"],
        ],
        "episode length": ["Multiline", [r"rollout/ep_len_mean", r"eval/mean_ep_length"]],
    },
    "Throughput": {
        "env steps/s (windowed)": ["Multiline", [r"throughput/env_steps_per_s"]],
        "episodes/s": ["Multiline", [r"throughput/episodes_per_s"]],
        "optimizer steps per 1k env steps": ["Multiline", [r"throughput/grad_steps_per_1k_env_steps"]],
        "SB3 fps (since start)": ["Multiline", [r"time/fps"]],
    },
    "Time split": {
        "share of wall time": ["Multiline", [r"throughput/share_(env|other|train|eval)"]],
    },
    "Losses": {
        "losses": ["Multiline", [r"train/.*loss"]],
        "learning rate, exploration, entropy coefficient": [
            "Multiline",
            [r"train/learning_rate", r"rollout/exploration_rate", r"train/ent_coef$"],
        ],
        "PPO: KL, clip fraction and range, explained variance": [
            "Multiline",
            [r"train/(approx_kl|clip_fraction|clip_range|explained_variance)"],
        ],
        "prioritized replay, AMP": ["Multiline", [r"per/.*", r"amp/.*"]],
    },
    "Hardware": {
        "process memory (MiB)": ["Multiline", [r"throughput/rss_mib", r"throughput/cuda_(allocated|peak)_mib"]],
        "CPU use (% of one core), GPU use (%)": ["Multiline", [r"throughput/cpu_percent", r"throughput/gpu_util_percent"]],
        "replay buffer fill": ["Multiline", [r"throughput/buffer_fill"]],
    },
}


def write_dashboard(model: Any) -> bool:
    """Write the custom-scalars layout into the model's TensorBoard run, if it logs to TensorBoard."""
    for fmt in model.logger.output_formats:
        if isinstance(fmt, TensorBoardOutputFormat):
            fmt.writer.add_custom_scalars(DASHBOARD)
            fmt.writer.flush()
            return True
    return False


class EnvTimer:
    """Adds up the wall time spent in a VecEnv's ``step_async``, ``step_wait`` and ``reset``.

    It times the env object in place (instance attributes over its methods) rather than wrapping it: SB3 walks
    wrapper chains level by level (``sync_envs_normalization``, ``get_vec_normalize_env``), and an extra level
    would break them. ``remove`` puts the methods back. Give it the innermost VecEnv (``venv.unwrapped``).
    """

    _METHODS = ("step_async", "step_wait", "reset")

    def __init__(self, venv: VecEnv, learn: object = None):
        """``learn``: what tells one ``learn`` call from another (SB3's ``start_time``). A timer an earlier call left
        on the env (its ``learn`` interrupted, so its callback never ended) is removed first: each interrupted cell
        of a notebook would add one more."""
        while (stale := getattr(venv.__dict__.get("step_wait"), "timer", None)) is not None and stale.learn != learn:
            stale.remove()
        self.venv, self.seconds, self.learn = venv, 0.0, learn
        self._saved = {name: venv.__dict__.get(name) for name in self._METHODS}
        for name in self._METHODS:
            setattr(venv, name, self._timed(getattr(venv, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        timed.timer = self  # type: ignore[attr-defined]
        return timed

    def remove(self) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                self.venv.__dict__.pop(name, None)
            else:
                setattr(self.venv, name, saved)


class ThroughputCallback(BaseCallback):
    """Throughput and time-split figures under ``throughput/``, recorded at the end of each rollout.

    :param window_s: the sliding window for rates and shares
    :param warmup_s: the first seconds of ``learn`` (start-up, first compilations) are left out of the window; a
        ``learn`` shorter than twice this is measured whole
    :param report_s: print a compact line every ``report_s`` seconds (None: never), via ``print_fn``
    :param dashboard: write the TensorBoard custom-scalars layout when training starts
    :param record_s: record figures at most this often (DQN's rollouts can be a single step long)
    """

    # Counters kept cumulative since training start: env steps, episodes, optimizer steps, and seconds in env
    # steps, in collection as a whole, in training, in periodic evaluation (which runs inside collection), and
    # between rollouts without a gradient step (SB3's loop before learning starts, or between off-policy updates);
    # and the envs' dones, which are episodes where no Monitor says when a whole one ended.
    _STEPS, _EPISODES, _GRAD, _ENV, _COLLECT, _TRAIN, _EVAL, _LOOP, _DONES = range(9)
    # CPU use is measured over at least this many seconds (psutil measures since its previous call), or over the
    # whole of a run that ends sooner.
    cpu_span_s = 1.0

    def __init__(
        self,
        window_s: float = 30.0,
        warmup_s: float = 5.0,
        report_s: float | None = None,
        print_fn: Callable[[str], Any] = print,
        dashboard: bool = True,
        eval_callback: TimedEvalCallback | None = None,
        record_s: float = 1.0,
        verbose: int = 0,
    ):
        super().__init__(verbose)
        window_s, warmup_s = duration_arg(window_s, "window_s"), duration_arg(warmup_s, "warmup_s", zero=True)
        record_s = duration_arg(record_s, "record_s", zero=True)
        report_s = None if report_s is None else duration_arg(report_s, "report_s", zero=True)
        if not callable(print_fn):
            raise ConfigError(f"print_fn must be a callable that takes a line of text (print, say), got {print_fn!r}")
        bool_arg(dashboard, "dashboard")
        if eval_callback is not None and not isinstance(eval_callback, TimedEvalCallback):
            raise ConfigError(
                f"eval_callback must be a TimedEvalCallback (its time is set apart) or None, got {eval_callback!r}"
            )
        self.dashboard, self.eval_callback, self.record_s = dashboard, eval_callback, record_s
        if eval_callback is not None:  # its evaluation at the last step is written with this callback's last record
            eval_callback.last_write_elsewhere = True
        self._next_record = 0.0
        self._release_writes: Callable[[bool], None] | None = None  # ends the hold on SB3's writes after the last rollout
        self.window = Window(window_s)
        self.warmup_s, self.report_s, self.print_fn = warmup_s, report_s, print_fn
        self.counters = np.zeros(9)
        self._monitored = False  # episodes are those Monitor reports (a done can be a life lost, Atari's)
        self.latest: dict[str, float] = {}
        self._timer: EnvTimer | None = None
        self._optimizer_steps: list[OptimizerStep] = []
        self._grad0 = 0
        self._steps0, self._eval0 = 0, 0.0
        self._pace0: tuple[float, int] | None = None  # where the time left is measured from (time, steps)
        self._start = self._rollout_start = self._rollout_end = 0.0
        self._trained_at_rollout_end = (0, 0)  # optimizer steps and SB3's update count as the last rollout ended
        self._cpu: tuple[float, float | None] = (0.0, None)  # (since when, figure): CPU use, see cpu_span_s
        self._next_report = 0.0
        self._process: Any = None
        self._last: tuple[float, np.ndarray] = (0.0, self.counters.copy())  # the latest sample, warm-up or not

    # ------------------------------------------------------------------ hooks
    def _on_training_start(self) -> None:
        self.close()  # anything left over from an interrupted learn
        self._optimizer_steps = optimizer_steps(self.model)
        self._grad0 = self._steps_taken()
        if self.dashboard:
            write_dashboard(self.model)
        assert self.model.env is not None
        # The innermost VecEnv: wrappers such as VecNormalize pickle their own attributes (checkpoints do that).
        self._timer = EnvTimer(self.model.env.unwrapped, learn=getattr(self.model, "start_time", None))
        import psutil

        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only starts the measurement
        self.counters[:] = 0.0
        self._monitored = _monitored(self.model.env)
        self.window.points.clear()
        self._steps0 = self.num_timesteps
        self._eval0 = self.eval_callback.seconds if self.eval_callback is not None else 0.0
        self._start = time.perf_counter()
        self._rollout_end = self._start
        self._trained_at_rollout_end = self._trained()
        self._last = (self._start, self.counters.copy())
        self._next_report = self._start + (self.report_s or 0.0)
        self._cpu = (self._start, None)
        self._next_record = 0.0
        self._pace0 = None
        self._set_pace_origin(self._start)

    def _set_pace_origin(self, now: float) -> None:
        # The steps before learning_starts take no gradient steps and run many times faster than the rest: an average
        # over them would promise an off-policy run's end far too soon. The time left counts from the first update.
        if self._pace0 is None and self.num_timesteps >= int(getattr(self.model, "learning_starts", 0) or 0):
            self._pace0 = (now, self.num_timesteps)

    def _steps_taken(self) -> int:
        # One per gradient step: SAC's actor and critic each step once per gradient step (TD3's actor less often).
        return max((step.steps for step in self._optimizer_steps), default=0)

    def _trained(self) -> tuple[int, int]:
        # SB3's own count moves where every step of a training was skipped (fp16's first overflows), the steps do not.
        return self._steps_taken(), int(getattr(self.model, "_n_updates", 0) or 0)

    def _count_gap(self, now: float) -> None:
        # Training runs between one rollout and the next (with overlapped training, the wait for it); a gap that
        # trained nothing (before learning starts, say) is SB3's loop alone.
        trained = self._trained() != self._trained_at_rollout_end
        self.counters[self._TRAIN if trained else self._LOOP] += now - self._rollout_end

    def _on_rollout_start(self) -> None:
        now = time.perf_counter()
        self._count_gap(now)
        self._rollout_start = now
        self._sample(now)

    def _sample(self, now: float) -> None:
        # Taken where every finished rollout has had its training, so steps and optimizer steps match.
        self.counters[self._STEPS] = self.num_timesteps - self._steps0
        self.counters[self._GRAD] = self._steps_taken() - self._grad0
        self.counters[self._ENV] = self._timer.seconds if self._timer is not None else 0.0
        if self.eval_callback is not None:
            self.counters[self._EVAL] = self.eval_callback.seconds - self._eval0
        self._last = (now, self.counters.copy())
        self._set_pace_origin(now)
        if now - self._start >= self.warmup_s:
            self.window.add(now, self.counters.copy())

    def _on_step(self) -> bool:
        dones = self.locals.get("dones")
        if dones is not None and np.any(dones):
            self.counters[self._DONES] += int(np.count_nonzero(dones))
            # An Atari env ends its episode at each life lost, for training; Monitor's info marks a whole game's end.
            infos = self.locals.get("infos") or [{}] * len(dones)
            ended = sum("episode" in info for done, info in zip(dones, infos, strict=True) if done)
            self.counters[self._EPISODES] += ended
            self._monitored = self._monitored or ended > 0
        return True

    def _on_rollout_end(self) -> None:
        now = time.perf_counter()
        self._rollout_end = now
        self._trained_at_rollout_end = self._trained()
        self.counters[self._COLLECT] += now - self._rollout_start
        # The last rollout's point is recorded as learn() ends, with its training in it: one point per step. SB3's
        # own write of it (PPO's, after each rollout, before its training) waits for that one.
        if self.num_timesteps >= self.model._total_timesteps:
            if self._release_writes is None:
                self._release_writes = hold_writes(self.logger, self.num_timesteps)
        elif now >= self._next_record:
            self._next_record = now + self.record_s
            self._record(now)

    def _on_training_end(self) -> None:
        # The last training ran after the last rollout: count it, record, and write what is pending.
        now = time.perf_counter()
        self._count_gap(now)
        self._rollout_end = now
        self._sample(now)
        self._record(now, final=True)
        # A row of its own: its step, as SB3's rows carry it (a CSV plotted against it had a blank at each learn's end).
        self.logger.record("time/total_timesteps", self.num_timesteps, exclude="tensorboard")
        self._release_writes_held(write=False)
        self.logger.dump(self.num_timesteps)
        self.close()

    def _release_writes_held(self, write: bool) -> None:
        release, self._release_writes = self._release_writes, None
        if release is not None:
            release(write)

    def close(self) -> None:
        """Stop timing the env (also after an interrupted ``learn``, whose held write is made here, at its step)."""
        self._release_writes_held(write=True)
        if self._timer is not None:
            self._timer.remove()
            self._timer = None
        self._optimizer_steps = []

    # ------------------------------------------------------------------ figures
    def _record(self, now: float, final: bool = False) -> None:
        figures: dict[str, float] = {}
        window = self.window.delta()
        last_t, last = self._last
        whole = last_t - self._start < 2 * self.warmup_s
        if whole:
            # Less measured after the warm-up than the warm-up itself (a short run or resume, or its first seconds):
            # the whole of it is the measure, or a window of a second or two (a final evaluation, say) would be.
            window = (last_t - self._start, last) if last_t > self._start else None
        if window is not None and window[1][self._STEPS] > 0:  # the first rollout's end has only its start sampled
            seconds, d = window
            figures["env_steps_per_s"] = d[self._STEPS] / seconds
            figures["episodes_per_s"] = d[self._EPISODES if self._monitored else self._DONES] / seconds
            if d[self._STEPS] > 0:
                figures["grad_steps_per_1k_env_steps"] = 1000.0 * d[self._GRAD] / d[self._STEPS]
            busy = d[self._COLLECT] + d[self._TRAIN] + d[self._LOOP]
            if busy > 0:
                # Collection = env steps + evaluation + the rest: policy inference, buffer writes, callbacks; and SB3's
                # loop between rollouts that trained nothing.
                figures["share_env"] = d[self._ENV] / busy
                figures["share_eval"] = d[self._EVAL] / busy
                rest = max(d[self._COLLECT] - d[self._ENV] - d[self._EVAL], 0.0) + d[self._LOOP]
                figures["share_other"] = rest / busy
                figures["share_train"] = d[self._TRAIN] / busy
        buffer = getattr(self.model, "replay_buffer", None)
        if buffer is not None:
            figures["buffer_fill"] = buffer.size() / buffer.buffer_size
        if self._process is not None:
            figures["rss_mib"] = self._process.memory_info().rss / 2**20
            # A record right after another (the last one) would measure a few milliseconds, so the figure is
            # renewed once cpu_span_s has passed; a run shorter than that is measured whole at its end.
            if now - self._cpu[0] >= self.cpu_span_s or (final and self._cpu[1] is None):
                self._cpu = (now, self._process.cpu_percent(None))
            if self._cpu[1] is not None:
                figures["cpu_percent"] = self._cpu[1]
        device = self.model.device
        if device.type == "cuda":
            figures["cuda_allocated_mib"] = th.cuda.memory_allocated(device) / 2**20
            figures["cuda_peak_mib"] = th.cuda.max_memory_allocated(device) / 2**20
            util = _gpu_util(device.index or 0)
            if util is not None:
                figures["gpu_util_percent"] = util
        for key, value in figures.items():
            self.logger.record(f"throughput/{key}", value)
        if window is not None and "env_steps_per_s" in figures:
            # What the rates are measured over, for the summary to say (not logged: TensorBoard has the steps).
            figures.update(window_s=window[0], window_whole=float(whole))
        self.latest = figures
        if self.report_s is not None and now >= self._next_report and "env_steps_per_s" in figures:
            self._next_report = now + self.report_s
            self.print_fn(self.line())

    def line(self) -> str:
        """The latest figures as one compact line."""
        f = self.latest
        done, total, rate = (
            self.num_timesteps,
            int(getattr(self.model, "_total_timesteps", 0) or 0),
            f.get("env_steps_per_s", 0),
        )
        parts = [f"{done:,}/{total:,} steps ({min(done / total, 1):.0%})" if total else f"{done:,} steps"]
        average = 0.0  # steadier than the window's rate; none yet before learning starts
        if self._pace0 is not None:
            elapsed = time.perf_counter() - self._pace0[0]
            average = (done - self._pace0[1]) / elapsed if elapsed > 0 else 0.0
        if total > done and average > 0:
            parts.append(f"{_clock((total - done) / average)} left")
        episodes = getattr(self.model, "ep_info_buffer", None)
        if episodes:  # SB3's window of the latest training episodes (Monitor's unclipped returns)
            parts.append(f"return {np.mean([e['r'] for e in episodes]):,.1f}")
        parts.append(f"{rate:,.0f} steps/s")
        parts.append(f"{f.get('episodes_per_s', 0):.1f} ep/s")
        if "grad_steps_per_1k_env_steps" in f:
            parts.append(f"{f['grad_steps_per_1k_env_steps']:.0f} grad steps/1k")
        if "share_env" in f:
            shares = (f"{name} {f['share_' + name]:.0%}" for name in SHARES)
            parts.append(" ".join(shares))
        if "buffer_fill" in f:
            parts.append(f"buffer {f['buffer_fill']:.0%}")
        if "rss_mib" in f:
            parts.append(f"RSS {f['rss_mib']:,.0f} MiB")
        if "cuda_allocated_mib" in f:
            parts.append(f"GPU mem {f['cuda_allocated_mib']:,.0f} MiB")
        return " | ".join(parts)


def _monitored(venv: VecEnv) -> bool:
    """Whether Monitor (or VecMonitor) reports the envs' whole episodes; until one does, every done counts."""
    try:
        return any(venv.env_is_wrapped(Monitor)) or is_vecenv_wrapped(venv, VecMonitor)
    except Exception:  # a VecEnv of the user's that does not implement it: SB3's learn() never asks
        return False


def _clock(seconds: float) -> str:
    """``1:02:03`` (or ``2:03`` under an hour)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


_NVML: dict[str, Any] = {}


def _gpu_util(index: int) -> float | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        if "init" not in _NVML:
            pynvml.nvmlInit()
            _NVML["init"] = True
        return float(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(index)).gpu)
    except Exception:  # no driver, no permission: the figure is optional
        return None
