"""Env resolution (registered id, ``module:attr`` or factory) and vec env building with a clean fallback."""

from __future__ import annotations

import contextlib
import functools
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3.common.atari_wrappers import AtariWrapper
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv, VecFrameStack

from sb3_gpu.batched import BatchedSubprocVecEnv
from sb3_gpu.envpool_vec import EnvPoolVecEnv, envpool_available, envpool_task
from sb3_gpu.errors import ConfigError, EnvWorkerError, closest

VEC_ENV_KINDS = ("auto", "dummy", "subproc", "batched", "envpool")

# BatchedSubprocVecEnv pays one round trip per worker per step (the workers wake in parallel), plus the infos'
# pickling per env. Measured on a 2-core Firecracker VM, where waking an idle vCPU is slow: ~350 us per step and
# ~10 us per env (python -m sb3_gpu.bench envs). Bare-metal machines pay less, so auto errs towards dummy.
BATCHED_STEP_OVERHEAD_S = 350e-6
BATCHED_PER_ENV_S = 10e-6
# EnvPool hands each step to its C++ thread pool; waking those threads cost ~250 us per step on the same VM, so it
# only pays where a DummyVecEnv step (n_envs * one env step) is longer than this: CartPole from ~64 envs,
# LunarLander from ~16, Atari always (bench envs: CartPole x32 on EnvPool measured 0.86x dummy).
ENVPOOL_MIN_VEC_STEP_S = 1e-3


class VecEnvFallbackWarning(UserWarning):
    """SubprocVecEnv could not start, so the envs step in this process (DummyVecEnv)."""


@dataclass(frozen=True)
class EnvSpec:
    """A resolved env: a display name, a picklable factory and whether it is an Atari game."""

    name: str
    make: Callable[[], gym.Env]
    is_atari: bool = False
    env_id: str | None = None  # a registered id given without env kwargs: what EnvPool could stand in for


def envpool_fits(spec: EnvSpec) -> bool:
    """Whether EnvPool is installed and has a faithful twin of this env."""
    return spec.env_id is not None and envpool_task(spec.env_id, spec.is_atari) is not None and envpool_available()


def _register_ale() -> bool:
    try:
        import ale_py
    except ImportError:
        return False
    gym.register_envs(ale_py)
    return True


def _make_registered(env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    if env_id not in gym.registry:
        _register_ale()  # worker processes start with an empty ALE registry
    return gym.make(env_id, **kwargs)


def _make_from_path(path: str, kwargs: dict[str, Any]) -> gym.Env:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)


def _looks_atari(env_id: str) -> bool:
    return env_id.startswith("ALE/") or "NoFrameskip" in env_id


def _resolve_id(env_id: str, kwargs: dict[str, Any]) -> EnvSpec:
    if env_id not in gym.registry and not _register_ale() and _looks_atari(env_id):
        raise ConfigError(f"env {env_id!r} is an Atari game and needs ale-py: pip install 'sb3-gpu[atari]'")
    if env_id not in gym.registry:
        raise ConfigError(
            f"unknown env id {env_id!r}{closest(env_id, gym.registry.keys())} "
            "(accepted: a registered Gymnasium id, 'package.module:EnvClass' or a factory)"
        )
    entry_point = str(gym.registry[env_id].entry_point)
    is_atari = "ale_py" in entry_point
    plain_id = None if kwargs else env_id
    if is_atari and env_id.startswith("ALE/"):
        # v5 ids skip 4 frames themselves; SB3's AtariWrapper skips too, so let it do the skipping alone.
        kwargs = {"frameskip": 1, **kwargs}
    return EnvSpec(env_id, functools.partial(_make_registered, env_id, kwargs), is_atari, plain_id)


def _resolve_path(path: str, kwargs: dict[str, Any]) -> EnvSpec:
    module, _, attr = path.partition(":")
    try:
        imported = importlib.import_module(module)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ConfigError(f"env {path!r}: cannot import module {module!r} ({type(e).__name__}: {e})") from None
    if attr in gym.registry:  # Gymnasium's own "package:EnvId-v0" form: the import registered the env
        return _resolve_id(attr, kwargs)
    target = getattr(imported, attr, None)
    if target is None:
        raise ConfigError(f"env {path!r}: module {module!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigError(f"env {path!r}: {attr!r} is not an env class or factory")
    return EnvSpec(path, functools.partial(_make_from_path, path, kwargs))


def resolve_env(env: str | Callable[[], gym.Env], env_kwargs: dict[str, Any] | None = None) -> EnvSpec:
    """Turn a registered id, ``package.module:Attr`` or a zero-argument factory into an :class:`EnvSpec`."""
    env_kwargs = dict(env_kwargs or {})
    if isinstance(env, EnvSpec):
        return env
    if callable(env):
        if env_kwargs:
            env = functools.partial(env, **env_kwargs)
        name = getattr(env, "__name__", None) or type(env).__name__
        return EnvSpec(name, env)
    if not isinstance(env, str) or not env.strip():
        raise ConfigError(f"env must be a Gymnasium id, 'package.module:Attr' or a factory, got {env!r}")
    if ":" in env:
        return _resolve_path(env, env_kwargs)
    return _resolve_id(env, env_kwargs)


def probe_env(spec: EnvSpec) -> gym.Env:
    """Build one env in this process as a vec env would (Atari wrapped), naming the pip extra a failure needs."""
    try:
        return _EnvFactory(spec.make, None, spec.is_atari)()
    except gym.error.DependencyNotInstalled as e:
        extra = "box2d" if "box2d" in str(e).lower() else "atari" if "ale" in str(e).lower() else None
        hint = f": pip install 'sb3-gpu[{extra}]'" if extra else ""
        raise ConfigError(f"env {spec.name!r} needs a missing dependency ({str(e).splitlines()[0]}){hint}") from None
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"env {spec.name!r} failed to build: {type(e).__name__}: {e}") from None


def measure_step_seconds(env: gym.Env, budget_s: float = 0.05, max_steps: int = 500) -> float:
    """Median wall time of one ``step`` with random actions, over at most ``budget_s`` seconds."""
    env.reset(seed=0)
    env.action_space.seed(0)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_steps and (len(times) < 5 or time.perf_counter() < deadline):
        start = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        times.append(time.perf_counter() - start)
        if terminated or truncated:
            env.reset()
    return float(np.median(times))


def choose_vec_env(requested: str, n_envs: int, step_seconds: float, cores: int, envpool: bool = False) -> tuple[str, str]:
    """Pick a VecEnv kind for ``n_envs`` envs whose step takes ``step_seconds``; return (kind, reason).

    ``envpool`` says whether EnvPool is installed and has a twin of this env: its C++ envs step on a thread pool
    with no Python in the loop, which wins once a step is long enough to pay for waking the threads. Otherwise the
    model is: DummyVecEnv costs
    ``n_envs * step``; the batched subprocess VecEnv spreads the envs over ``cores`` workers and pays a round trip
    per worker and a little per env. Batched must win by 20%, since its start-up costs too. SB3's SubprocVecEnv is
    never the automatic choice: batched does the same work with one round trip per worker instead of per env.
    """
    if requested not in VEC_ENV_KINDS:
        raise ConfigError(
            f"unknown vec_env {requested!r}{closest(requested, VEC_ENV_KINDS)} (valid: {', '.join(VEC_ENV_KINDS)})"
        )
    if requested != "auto":
        return requested, "asked for"
    if envpool and n_envs * step_seconds >= ENVPOOL_MIN_VEC_STEP_S:
        return "envpool", (
            f"EnvPool has a faithful twin of this env; {n_envs} envs x {step_seconds * 1e6:.0f} us per Python step "
            "pays for its thread pool"
        )
    if n_envs == 1:
        return "dummy", "one env: nothing to parallelise"
    if cores < 2:
        return "dummy", "one CPU core: subprocesses would only add overhead"
    dummy = n_envs * step_seconds
    workers = min(n_envs, cores)
    batched = -(-n_envs // workers) * step_seconds + BATCHED_STEP_OVERHEAD_S + n_envs * BATCHED_PER_ENV_S
    ratio = dummy / batched
    detail = (
        f"env step {step_seconds * 1e6:.0f} us, {n_envs} envs on {cores} cores: "
        f"batched ({workers} workers) est. {ratio:.2f}x dummy"
    )
    if ratio >= 1.2:
        return "batched", detail
    return "dummy", detail


class _EnvFactory:
    """One env of a vec env: the user's env, Monitor, then SB3's Atari wrapper. Picklable for SubprocVecEnv."""

    def __init__(self, make: Callable[[], gym.Env], monitor_path: str | None, atari: bool, report: str | None = None):
        self.make, self.monitor_path, self.atari, self.report = make, monitor_path, atari, report
        self.worker = False  # set for SubprocVecEnv workers

    def __call__(self) -> gym.Env:
        if self.worker:
            # One thread per worker: n workers each running a core-wide thread pool would oversubscribe the CPU.
            os.environ["OMP_NUM_THREADS"] = "1"
            th.set_num_threads(1)
            # Ctrl-C reaches the whole process group: the parent stops training after the current step and
            # needs its workers alive to finish it (SB3's workers would otherwise exit on KeyboardInterrupt).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            env: gym.Env = Monitor(self.make(), filename=self.monitor_path)
            env = AtariWrapper(env) if self.atari else env
        except BaseException as e:
            _write_report(self.report, e)
            raise
        return _ReportResetErrors(env, self.report) if self.report else env


def _write_report(path: str | None, error: BaseException) -> None:
    # In a worker process the parent only sees a closed pipe; leave it the cause in a file. After start-up the
    # folder is gone, and the worker's own traceback is the report.
    if path is not None:
        with contextlib.suppress(OSError):
            Path(path).write_text(f"{type(error).__name__}: {error}", encoding="utf-8")


class _ReportResetErrors(gym.Wrapper):
    """In subprocess workers only: record why a reset failed (a failed first reset triggers the fallback)."""

    def __init__(self, env: gym.Env, report: str):
        super().__init__(env)
        self._report = report

    def reset(self, **kwargs: Any) -> Any:
        try:
            return self.env.reset(**kwargs)
        except BaseException as e:
            _write_report(self._report, e)
            raise


def _subproc(factories: list[_EnvFactory], start_method: str | None, seed: int | None, batched: bool = False) -> VecEnv:
    try:
        cloudpickle.dumps(factories[0].make)
    except Exception as e:
        raise _SubprocFailed(f"the env factory cannot be pickled ({type(e).__name__}: {e})") from None
    before = set(mp.active_children())
    with tempfile.TemporaryDirectory(prefix="sb3_gpu_") as tmp:
        for i, factory in enumerate(factories):
            factory.report, factory.worker = os.path.join(tmp, f"env{i}.err"), True
        try:
            # Libraries that size their thread pools at import (OpenBLAS, MKL) read this in a fresh worker.
            with _environ(OMP_NUM_THREADS="1"):
                venv = (
                    BatchedSubprocVecEnv(factories, start_method=start_method)  # type: ignore[arg-type]
                    if batched
                    else SubprocVecEnv(factories, start_method=start_method)  # type: ignore[arg-type]
                )
            _seed(venv, seed)
            venv.reset()  # a worker that dies on its first reset should fall back here, not crash training later
        except (EOFError, OSError, RuntimeError, pickle.PicklingError, TypeError, AttributeError) as e:
            # (EnvWorkerError is a RuntimeError: an env that fails to build or reset in a batched worker.)
            if getattr(mp.current_process(), "_inheriting", False):
                # We are a worker re-running a script that lacks the __main__ guard: die, as multiprocessing
                # intends, rather than fall back and run the user's whole script inside the worker.
                raise
            reports = sorted(Path(tmp).glob("*.err"))
            if reports:
                cause = f"{reports[0].stem}: {reports[0].read_text(encoding='utf-8')}"
            elif isinstance(e, EnvWorkerError):
                cause = str(e)
            else:
                cause = f"{type(e).__name__}: {e}"
            if not reports and isinstance(e, (EOFError, ConnectionError)):
                cause += " (a worker exited before it built its env: an import error or a missing __main__ guard)"
            # Workers may be dead or waiting on a pipe; a polite close() would raise on the dead ones.
            for proc in set(mp.active_children()) - before:
                proc.terminate()
                proc.join(timeout=5)
            cause = " ".join(cause.split())
            raise _SubprocFailed(cause if len(cause) < 300 else cause[:297] + "...") from None
        finally:
            for factory in factories:  # the fallback DummyVecEnv calls these in this process: no worker settings
                factory.report, factory.worker = None, False
    return venv


class _SubprocFailed(Exception):
    pass


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _seed(venv: VecEnv, seed: int | None) -> None:
    # VecEnv.seed(None) draws a random seed; leave unseeded envs alone instead.
    if seed is not None:
        venv.seed(seed)


def make_vec_env(
    env: str | Callable[[], gym.Env] | EnvSpec,
    n_envs: int = 1,
    *,
    vec_env: str = "auto",
    start_method: str | None = None,
    seed: int | None = None,
    env_kwargs: dict[str, Any] | None = None,
    monitor_dir: str | None = None,
    atari_wrapper: bool | None = None,
    frame_stack: int | None = None,
) -> VecEnv:
    """Build a monitored VecEnv; ``subproc``/``batched`` that fail to start fall back to DummyVecEnv with a warning.

    :param env: a registered id, ``package.module:Attr`` or a zero-argument factory
    :param n_envs: number of envs
    :param vec_env: ``auto`` (EnvPool where installed and faithful, else chosen from cores and a short
        measurement of one env step), ``dummy``, ``subproc`` (SB3's), ``batched`` or ``envpool``
    :param start_method: multiprocessing start method for ``subproc`` (SB3's default when None)
    :param seed: seed of the first env; env ``i`` gets ``seed + i``
    :param env_kwargs: keyword arguments for the env
    :param monitor_dir: folder for the Monitor CSV files (none written when None)
    :param atari_wrapper: wrap with SB3's AtariWrapper (default: for Atari games)
    :param frame_stack: stack this many frames with VecFrameStack
    """
    if isinstance(n_envs, bool) or not isinstance(n_envs, int) or n_envs < 1:
        raise ConfigError(f"n_envs must be a positive int, got {n_envs!r}")
    spec = env if isinstance(env, EnvSpec) else resolve_env(env, env_kwargs)
    atari = spec.is_atari if atari_wrapper is None else atari_wrapper
    if vec_env == "auto":
        pool = envpool_fits(spec) and atari == spec.is_atari
        probe = probe_env(spec)
        try:
            step = measure_step_seconds(probe)
        finally:
            probe.close()
        vec_env, _ = choose_vec_env("auto", n_envs, step, os.cpu_count() or 1, envpool=pool)
    else:
        choose_vec_env(vec_env, n_envs, 0.0, 1)  # validates the name
    if monitor_dir is not None:
        os.makedirs(monitor_dir, exist_ok=True)
    venv: VecEnv
    if vec_env == "envpool":
        if spec.env_id is None:
            raise ConfigError(
                f"vec_env 'envpool' needs a registered Gymnasium id without env kwargs; got {spec.name!r}"
                + (" with env kwargs" if ":" not in spec.name and spec.name in gym.registry else "")
            )
        venv = EnvPoolVecEnv(spec.env_id, n_envs, seed=seed, is_atari=atari, monitor_dir=monitor_dir)
        _seed(venv, seed)
        return VecFrameStack(venv, frame_stack) if frame_stack else venv
    factories = [
        _EnvFactory(spec.make, os.path.join(monitor_dir, str(i)) if monitor_dir else None, atari) for i in range(n_envs)
    ]
    if vec_env in ("subproc", "batched"):
        try:
            venv = _subproc(factories, start_method, seed, batched=vec_env == "batched")
        except _SubprocFailed as e:
            name = "BatchedSubprocVecEnv" if vec_env == "batched" else "SubprocVecEnv"
            warnings.warn(f"{name} could not start ({e}); falling back to DummyVecEnv", VecEnvFallbackWarning, stacklevel=2)
            venv = DummyVecEnv(factories)  # type: ignore[arg-type]
    else:
        venv = DummyVecEnv(factories)  # type: ignore[arg-type]
    _seed(venv, seed)  # after subproc's probe reset used the seeds up, the model's first reset gets them again
    if frame_stack:
        venv = VecFrameStack(venv, frame_stack)
    return venv
