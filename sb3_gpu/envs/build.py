"""Building vec envs: SB3's ``make_vec_env`` signature plus ``vec_env="auto"``; subprocess workers that fail to
start fall back to DummyVecEnv with a warning; envs whose workers died are closed without hanging."""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv, VecFrameStack

from sb3_gpu.common.checks import bool_arg, count_arg, seed_arg
from sb3_gpu.common.errors import ConfigError, EnvWorkerError, named, warn
from sb3_gpu.common.io import make_dir, out_of_space, temporary_environ
from sb3_gpu.envs.batched import BatchedSubprocVecEnv, main_kept_from_workers, worker_start_method
from sb3_gpu.envs.choice import VecEnvFallbackWarning, check_env_resources, check_vec_env_kind, vec_env_choice
from sb3_gpu.envs.envpool_vec import EnvPoolVecEnv
from sb3_gpu.envs.spec import EnvFactory, EnvSpec, check_env_api, resolve_env

# EnvPoolVecEnv's arguments that make_vec_env sets from its own: vec_env_kwargs may give the others.
_ENVPOOL_SET = ("env_id", "n_envs", "seed", "is_atari", "monitor_dir", "start_index", "channels_first")

# The kinds that ``vec_env_cls`` names, as SB3 users pass them.
_KIND_OF_CLASS: dict[type[VecEnv], str] = {
    DummyVecEnv: "dummy",
    SubprocVecEnv: "subproc",
    BatchedSubprocVecEnv: "batched",
    EnvPoolVecEnv: "envpool",
}


def make_vec_env(
    env_id: str | Callable[..., gym.Env] | EnvSpec,
    n_envs: int = 1,
    seed: int | None = None,
    start_index: int = 0,
    monitor_dir: str | os.PathLike[str] | None = None,
    wrapper_class: Callable[..., gym.Env] | None = None,
    env_kwargs: dict[str, Any] | None = None,
    vec_env_cls: type[VecEnv] | None = None,
    vec_env_kwargs: dict[str, Any] | None = None,
    monitor_kwargs: dict[str, Any] | None = None,
    wrapper_kwargs: dict[str, Any] | None = None,
    *,
    vec_env: str = "auto",
    atari_wrapper: bool | None = None,
    frame_stack: int | None = None,
    max_episode_steps: int | None = None,
) -> VecEnv:
    """SB3's ``make_vec_env`` (same arguments, same meaning) that also picks the vec env class itself.

    With neither ``vec_env_cls`` nor ``vec_env`` given, ``auto`` chooses among DummyVecEnv, the batched subprocess
    VecEnv and EnvPool from the cores and a short measurement of one env step. Subprocess kinds that cannot start
    (an unpicklable factory, a notebook, a worker that dies on its first reset) fall back to DummyVecEnv with a
    :class:`VecEnvFallbackWarning` naming the cause.

    :param env_id: a registered id, ``package.module:EnvClass`` or an env factory
    :param seed: seed of the first env; env ``i`` gets ``seed + i``
    :param start_index: index of the first env (names its Monitor file)
    :param vec_env_cls: a VecEnv class, as in SB3 (DummyVecEnv, SubprocVecEnv, BatchedSubprocVecEnv, ...)
    :param vec_env_kwargs: its keyword arguments (``start_method`` for the subprocess kinds)
    :param vec_env: ``auto``, ``dummy``, ``subproc`` (SB3's), ``batched`` or ``envpool``; use it or ``vec_env_cls``
    :param atari_wrapper: wrap with SB3's AtariWrapper (default: for Atari games when no ``wrapper_class`` is given)
    :param frame_stack: stack this many frames with VecFrameStack
    :param max_episode_steps: cut episodes at this many steps of the env itself (an Atari game's emulator frames, four
        to an agent step; a line on stderr says when one is cut)
    """
    count_arg(n_envs, "n_envs")
    seed = seed_arg(seed)
    count_arg(frame_stack, "frame_stack", optional=True)
    count_arg(max_episode_steps, "max_episode_steps", optional=True)
    count_arg(start_index, "start_index", low=0)
    for name, kwargs in (
        ("env_kwargs", env_kwargs),
        ("vec_env_kwargs", vec_env_kwargs),
        ("monitor_kwargs", monitor_kwargs),
        ("wrapper_kwargs", wrapper_kwargs),
    ):
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ConfigError(f"{name} must be a mapping of keyword arguments or None, got {kwargs!r}")
    if wrapper_class is not None and not callable(wrapper_class):
        raise ConfigError(f"wrapper_class must be callable (a gymnasium.Wrapper class, say), got {wrapper_class!r}")
    if wrapper_kwargs and wrapper_class is None:
        raise ConfigError(f"wrapper_kwargs {sorted(wrapper_kwargs)} are for a wrapper_class, and none is given")
    if vec_env_cls is not None and not (isinstance(vec_env_cls, type) and issubclass(vec_env_cls, VecEnv)):
        raise ConfigError(f"vec_env_cls must be a VecEnv class (DummyVecEnv, SubprocVecEnv, ...), got {vec_env_cls!r}")
    vec_env_kwargs = dict(vec_env_kwargs or {})
    method = vec_env_kwargs.get("start_method")
    if method is not None and method not in (methods := mp.get_all_start_methods()):
        raise ConfigError(f"start_method {method!r} is not one this platform has: {', '.join(methods)}")
    spec = resolve_env(env_id, env_kwargs)
    if atari_wrapper is not None:
        bool_arg(atari_wrapper, "atari_wrapper (or None: Atari games only)")
    if atari_wrapper and not spec.is_atari and spec.registered in gym.registry:
        # SB3's AtariWrapper reads the ALE's action meanings and lives count: on another env it fails in each worker.
        # (A factory's env is known only once built: where it is no ALE game, building it fails, naming the env.)
        raise ConfigError(f"atari_wrapper=True wraps ALE Atari games; {env_id!r} is not one (leave it None or False)")
    atari = (spec.is_atari and wrapper_class is None) if atari_wrapper is None else atari_wrapper
    kind = _kind(vec_env, vec_env_cls)
    if vec_env_kwargs and kind in ("auto", "dummy"):
        raise ConfigError(
            f"vec_env_kwargs {sorted(vec_env_kwargs)} need a class that takes them: give vec_env_cls, or vec_env "
            "'subproc', 'batched' or 'envpool' (auto may pick DummyVecEnv, which takes none)"
        )
    if kind == "auto":
        plain = wrapper_class is None and atari == spec.is_atari and not monitor_kwargs
        kind = vec_env_choice("auto", spec, n_envs, envpool_allowed=plain).kind
    check_env_resources(kind, n_envs, monitor=monitor_dir is not None)
    if monitor_dir is not None:
        monitor_dir = os.fspath(make_dir(monitor_dir, "monitor_dir"))
    stack_order: str | None = None  # VecFrameStack's own guess: channel-last for SB3's AtariWrapper frames
    if kind == "envpool":
        if wrapper_class is not None or monitor_kwargs:
            raise ConfigError("vec_env 'envpool' runs C++ envs: a Python wrapper_class or monitor_kwargs cannot apply")
        if max_episode_steps is not None:
            raise ConfigError("vec_env 'envpool' runs C++ envs: max_episode_steps cannot apply (use dummy or batched)")
        # Atari frames stay channel-first from EnvPool to the policy: stacked along the channel axis, they are what
        # SB3's CNN takes, so no transpose wrapper copies them (and the stack reaches the device in one piece).
        channels_first = atari and bool(frame_stack)
        stack_order = "first" if channels_first else None
        _check_kwargs(EnvPoolVecEnv, vec_env_kwargs, fixed=_ENVPOOL_SET)
        venv: VecEnv = _envpool(spec, n_envs, seed, atari, monitor_dir, start_index, vec_env_kwargs, channels_first)
    else:
        factories = [
            EnvFactory(
                spec.make,
                os.path.join(monitor_dir, str(start_index + i)) if monitor_dir else None,
                atari,
                monitor_kwargs=monitor_kwargs,
                wrapper_class=wrapper_class,
                wrapper_kwargs=wrapper_kwargs,
                max_episode_steps=max_episode_steps,
            )
            for i in range(n_envs)
        ]
        venv = _build(kind, factories, vec_env_cls, vec_env_kwargs, seed, spec.name)
    _seed(venv, seed)  # after a subprocess probe reset used the seeds up, the model's first reset gets them again
    return VecFrameStack(venv, frame_stack, channels_order=stack_order) if frame_stack else venv


def _kind(vec_env: str, vec_env_cls: type[VecEnv] | None) -> str:
    check_vec_env_kind(vec_env)
    if vec_env_cls is None:
        return vec_env
    if vec_env != "auto":
        raise ConfigError(f"give vec_env ({vec_env!r}) or vec_env_cls ({vec_env_cls.__name__}), not both")
    return _KIND_OF_CLASS.get(vec_env_cls, "class")


def _envpool(
    spec: EnvSpec,
    n_envs: int,
    seed: int | None,
    atari: bool,
    monitor_dir: str | None,
    start_index: int,
    vec_env_kwargs: dict[str, Any],
    channels_first: bool = False,
) -> VecEnv:
    if spec.env_id is None:
        with_kwargs = " with env kwargs" if ":" not in spec.name and spec.name in gym.registry else ""
        raise ConfigError(
            f"vec_env 'envpool' needs a registered Gymnasium id without env kwargs; got {spec.name!r}{with_kwargs}"
        )
    return EnvPoolVecEnv(
        spec.env_id,
        n_envs,
        seed=seed,
        is_atari=atari,
        monitor_dir=monitor_dir,
        start_index=start_index,
        channels_first=channels_first,
        **vec_env_kwargs,
    )


def _build(
    kind: str,
    factories: list[EnvFactory],
    vec_env_cls: type[VecEnv] | None,
    vec_env_kwargs: dict[str, Any],
    seed: int | None,
    name: str,
) -> VecEnv:
    fns: list[Callable[[], gym.Env]] = list(factories)
    if kind == "dummy":
        return _dummy(fns, name)
    if kind == "class":
        assert vec_env_cls is not None
        if issubclass(vec_env_cls, (SubprocVecEnv, BatchedSubprocVecEnv)):  # a user's subclass: the same preload
            worker_start_method(vec_env_kwargs.get("start_method"))
        with main_kept_from_workers() if issubclass(vec_env_cls, SubprocVecEnv) else contextlib.nullcontext():
            return vec_env_cls(fns, **vec_env_kwargs)  # type: ignore[arg-type]
    _check_kwargs(BatchedSubprocVecEnv if kind == "batched" else SubprocVecEnv, vec_env_kwargs)
    try:
        return _start_workers(kind, factories, vec_env_kwargs, seed)
    except _WorkersFailed as e:
        # An env that fails here too, to build or on its first reset and step, is the env's fault, not the workers':
        # said as such, with no fallback to name (and no DummyVecEnv that fails again at the first learn()).
        _check_in_process(factories[0], name)  # before the fallback's own envs: one that holds a port, say, is alone
        venv = _dummy(fns, name)
        cls = "BatchedSubprocVecEnv" if kind == "batched" else "SubprocVecEnv"
        warn(f"{cls} could not start ({e}); falling back to DummyVecEnv", VecEnvFallbackWarning)
        return venv


def _check_in_process(factory: EnvFactory, name: str) -> None:
    """One env as the factory makes it (writing no Monitor file), checked as a plan checks an env."""
    probe = copy.copy(factory)
    probe.monitor_path = None
    try:
        env = probe()
    except Exception as e:
        raise ConfigError(f"env {name!r} failed to build: {named(e)}") from None
    try:
        check_env_api(env, name)
    finally:
        env.close()


def _dummy(fns: list[Callable[[], gym.Env]], name: str) -> DummyVecEnv:
    """A DummyVecEnv; an env that fails to build (its factory, wrapper or Monitor raised) is named in one line."""
    try:
        return DummyVecEnv(fns)
    except ConfigError:
        raise
    except Exception as e:
        if out_of_space(e):  # the disk, not the env: said as the run's other failed writes are
            raise
        raise ConfigError(f"env {name!r} failed to build: {named(e)}") from e


def _check_kwargs(cls: type[VecEnv], kwargs: dict[str, Any], fixed: tuple[str, ...] = ("env_fns",)) -> None:
    """Refuse a keyword ``cls`` does not take (or that make_vec_env sets itself: ``fixed``), before any worker
    starts: its TypeError would otherwise read as workers that could not start, and fall back to DummyVecEnv."""
    accepted = [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", *fixed)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(f"vec_env_kwargs {unknown} are not arguments of {cls.__name__}; accepted: {', '.join(accepted)}")


class _WorkersFailed(Exception):
    pass


def _start_workers(kind: str, factories: list[EnvFactory], kwargs: dict[str, Any], seed: int | None) -> VecEnv:
    """A subprocess VecEnv that has reset once, or :class:`_WorkersFailed` naming why its workers could not start."""
    try:
        cloudpickle.dumps(factories[0])
    except Exception as e:
        raise _WorkersFailed(f"the env factory cannot be pickled ({type(e).__name__}: {e})") from None
    before = set(mp.active_children())
    cls = BatchedSubprocVecEnv if kind == "batched" else SubprocVecEnv
    if kind == "subproc":
        worker_start_method(kwargs.get("start_method"))  # so that a forkserver started here preloads torch and SB3
    with tempfile.TemporaryDirectory(prefix="sb3_gpu_") as tmp:
        for i, factory in enumerate(factories):
            factory.report, factory.worker = os.path.join(tmp, f"env{i}.err"), True
            factory.quiet_exit = kind == "subproc"  # the batched workers send their errors to the parent themselves
        try:
            # Libraries that size their thread pools at import (OpenBLAS, MKL) read this in a fresh worker.
            # (SB3's SubprocVecEnv is kept from a __main__ that is no file here; BatchedSubprocVecEnv keeps itself.)
            with (
                temporary_environ(OMP_NUM_THREADS="1"),
                main_kept_from_workers() if kind == "subproc" else contextlib.nullcontext(),
            ):
                venv = cls(list(factories), **kwargs)
            if isinstance(venv, SubprocVecEnv):
                _kill_at_exit(venv)
            _seed(venv, seed)
            venv.reset()  # a worker that dies on its first reset should fall back here, not crash training later
        except (EOFError, OSError, RuntimeError, pickle.PicklingError, TypeError, AttributeError) as e:
            # (EnvWorkerError is a RuntimeError: an env that fails to build or reset in a batched worker. A worker
            # re-running a script that lacks the __main__ guard never gets here: worker_start_method ends it.)
            _kill_workers(before)
            raise _WorkersFailed(_failure_cause(e, sorted(Path(tmp).glob("*.err")))) from None
        except BaseException:
            # Ctrl-C or SIGTERM while they start: the VecEnv was never returned, so no one else can close its workers,
            # which would go on writing their monitor files into a run dir being removed.
            _kill_workers(before)
            raise
        finally:
            for factory in factories:  # the fallback DummyVecEnv calls these in this process: no worker settings
                factory.report, factory.worker, factory.quiet_exit = None, False, False
    return venv


_UNCLOSED: weakref.WeakSet[SubprocVecEnv] = weakref.WeakSet()  # sb3_gpu's SubprocVecEnvs, for the exit hook


def _kill_at_exit(venv: SubprocVecEnv) -> None:
    """Kill ``venv``'s workers once it is dropped, or at exit. They ignore SIGTERM (ignore_stop_signals), so at exit
    multiprocessing's terminate-and-join waited forever for an env never closed (a script that calls make_model and
    learn, then ends without closing its env).
    The exit hook is registered after multiprocessing's (imported to start the workers), so it runs before it."""
    weakref.finalize(venv, _kill_processes, list(venv.processes))
    if not _UNCLOSED:
        atexit.unregister(_kill_unclosed)
        atexit.register(_kill_unclosed)
    _UNCLOSED.add(venv)


def _kill_unclosed() -> None:
    for venv in list(_UNCLOSED):
        if not venv.closed:
            _kill_processes(list(venv.processes))
            venv.closed = True  # a user's own exit hook that closes it later finds it closed, not a dead pipe


def _kill_processes(processes: list[Any]) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=5)


def _kill_workers(before: set[Any]) -> None:
    """Kill the worker processes started since ``before``: they may be dead or waiting on a pipe, where a polite
    close() would raise on the dead ones, and they let SIGTERM pass."""
    _kill_processes(list(set(mp.active_children()) - before))


def _failure_cause(error: BaseException, reports: list[Path]) -> str:
    """One line: the first worker's own report, else the error the parent saw."""
    if reports:
        cause = f"{reports[0].stem}: {reports[0].read_text(encoding='utf-8')}"
    elif isinstance(error, EnvWorkerError):
        cause = str(error)
    else:
        cause = f"{type(error).__name__}: {error}"
    # Exit code 1 is Python's for an exception it printed: in a worker that never reported, one raised as it started.
    if not reports and (isinstance(error, (EOFError, ConnectionError)) or getattr(error, "exit_code", None) == 1):
        cause += " (a worker exited before it built its env: an import error or a missing __main__ guard)"
    cause = " ".join(cause.split())
    return cause if len(cause) < 300 else cause[:297] + "..."


def _seed(venv: VecEnv, seed: int | None) -> None:
    # VecEnv.seed(None) draws a random seed; leave unseeded envs alone instead.
    if seed is not None:
        venv.seed(seed)


def explain_env_error(error: BaseException, venv: VecEnv, what: str = "env") -> BaseException:
    """Name the env behind an error: the one of a DummyVecEnv whose own step or reset raised (an
    :class:`EnvWorkerError` caused by the env's exception), or the worker behind a closed pipe (SB3's SubprocVecEnv
    only reports EOFError when a worker dies). ``what`` names the vec env's envs (``evaluation env``)."""
    base = venv.unwrapped
    if isinstance(base, DummyVecEnv) and (index := _raising_env(error, base)) is not None:
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        failed = EnvWorkerError(f"{what} {index} raised {named(error)}", env_index=index, worker_traceback=trace)
        failed.__cause__ = error
        return failed
    if not isinstance(error, (EOFError, ConnectionError)) or not isinstance(base, SubprocVecEnv):
        return error
    # The pipe closes a moment before the worker exits, which on a loaded machine can take seconds: wait for the
    # first of them to exit, not each in turn (the others are alive and would not).
    deadline = time.monotonic() + 10
    while True:
        for index, process in enumerate(base.processes):
            code = process.exitcode
            if code is not None:
                cause = f"exited with code {code} (its traceback is above)"
                if code < 0:
                    cause = f"was killed by {signal.Signals(-code).name}"
                return EnvWorkerError(
                    f"{what} {index} (SubprocVecEnv worker, pid {process.pid}) {cause}", env_index=index, exit_code=code
                )
        if time.monotonic() > deadline:
            return error
        time.sleep(0.05)


def _raising_env(error: BaseException, base: DummyVecEnv) -> int | None:
    """The index of ``base``'s env whose step or reset raised ``error`` (found in the traceback, at DummyVecEnv's loop
    over its envs), or None where the error came from elsewhere, SB3's own bookkeeping included."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        local = tb.tb_frame.f_locals
        if tb.tb_frame.f_code.co_name in ("step_wait", "reset") and local.get("self") is base and "env_idx" in local:
            index = int(local["env_idx"])  # the env the loop was at; it raised only if the next call is its own
            return index if tb.tb_next.tb_frame.f_locals.get("self") is base.envs[index] else None
        tb = tb.tb_next
    return None


def close_vec_envs(*venvs: VecEnv | None) -> None:
    """Close each env; after a worker died, neither raise nor leave the other workers running or unreaped."""
    for venv in venvs:
        if venv is None:
            continue
        base = venv.unwrapped
        processes = getattr(base, "processes", [])
        if isinstance(base, SubprocVecEnv) and not all(p.is_alive() for p in processes):
            # SB3's close() would wait for a reply from every worker still owing one: stop them instead.
            for process in processes:
                process.kill()  # workers let SIGTERM pass
            base.closed = True
        with contextlib.suppress(EOFError, BrokenPipeError, ConnectionError, OSError, EnvWorkerError):
            venv.close()
        for process in processes:
            process.join(timeout=5)
