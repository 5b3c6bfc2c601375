"""What an env is: a registered id, ``package.module:Attr`` or a factory, resolved into a picklable spec; and the
factory that builds one env of a vec env (Monitor, then SB3's Atari preprocessing)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from gymnasium.envs.registration import load_env_creator
from stable_baselines3.common.atari_wrappers import AtariWrapper
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.preprocessing import is_image_space, is_image_space_channels_first

from sb3_gpu.common.cli import ignore_stop_signals
from sb3_gpu.common.errors import ConfigError, closest, install_hint


@dataclass(frozen=True)
class EnvSpec:
    """A resolved env: a display name, a picklable factory and whether it is an Atari game."""

    name: str
    make: Callable[[], gym.Env]
    is_atari: bool = False
    env_id: str | None = None  # a registered id given without env kwargs: what EnvPool could stand in for
    factory: bool = False  # a callable given in Python: its name cannot rebuild it
    registered: str | None = None  # the Gymnasium id it is made from (``name`` less a ``module:`` before it)

    @property
    def entry_name(self) -> str:
        """The registered id, else the name: what Gymnasium's registry knows it by."""
        return self.registered or self.name

    def entry_key(self, entries: Mapping[str, Any]) -> str:
        """The name its preset entry is chosen by: a module:EnvId's whole name where an entry has it, else its id."""
        return self.name if self.name in entries else self.entry_name


ATARI_FRAME_SKIP = 4  # emulator frames per agent step under SB3's AtariWrapper (its default), EnvPool's twin too


def register_ale() -> bool:
    """Register ale-py's Atari ids with Gymnasium; False where ale-py is not installed."""
    try:
        import ale_py
    except ImportError:
        return False
    gym.register_envs(ale_py)
    return True


def _make_registered(env_id: str, kwargs: dict[str, Any], **extra: Any) -> gym.Env:
    if env_id not in gym.registry:
        register_ale()  # worker processes start with an empty ALE registry
    return gym.make(env_id, **kwargs, **extra)


def _make_from_path(path: str, kwargs: dict[str, Any], **extra: Any) -> gym.Env:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)(**kwargs, **extra)


def rendering(spec: EnvSpec, render_mode: str = "rgb_array") -> EnvSpec:
    """``spec`` whose envs are made with ``render_mode`` (an id's or a class's keyword; a factory gets it too).

    :raises ConfigError: where the env cannot render in that mode, or its factory takes no ``render_mode``
    """
    factory: Callable[..., gym.Env] = spec.make  # takes keywords: an id's and a class's pass them on
    make = functools.partial(factory, render_mode=render_mode)
    try:
        env = make()
    except TypeError as e:
        if "multiple values for keyword argument 'render_mode'" in str(e):
            raise ConfigError(f"env {spec.name}: its env_kwargs set render_mode; remove it to record a video") from None
        if "render_mode" not in str(e):
            raise
        raise ConfigError(f"env {spec.name}: its factory takes no render_mode argument; add render_mode=None to it") from None
    try:
        modes, mode = env.metadata.get("render_modes", []), getattr(env, "render_mode", None)
        if render_mode not in modes or mode != render_mode:
            raise ConfigError(
                f"env {spec.name} cannot render {render_mode!r} frames (its render modes: {modes or 'none'}; made with "
                f"render_mode={render_mode!r}, it has {mode!r})"
            )
        env.reset(seed=0)
        frame = env.render()  # drawing may need a package of its own: pygame, for the classic-control and Box2D envs
        if not isinstance(frame, np.ndarray):  # said before an evaluation runs, not after it
            raise ConfigError(
                f"env {spec.name} lists {render_mode!r} among its render modes, but its render() returned "
                f"{type(frame).__name__}, not an image"
            )
    except gym.error.DependencyNotInstalled as e:
        raise ConfigError(f"env {spec.name} cannot render frames: {e}; {install_hint('video')}") from None
    finally:
        env.close()
    return dataclasses.replace(spec, make=make, env_id=None)  # env_id None: EnvPool cannot stand in for it


def declares_render_mode(env_id: str, render_mode: str = "rgb_array") -> bool | None:
    """Whether an env's class (a registered id's, or ``module:Class`` of a module already imported) lists
    ``render_mode`` in its metadata, read without making the env; None where that cannot be told (a factory, an entry
    point that is a function)."""
    module, _, attr = env_id.partition(":")
    spec = gym.registry.get(env_id) or gym.registry.get(attr)  # an id, or Gymnasium's module:EnvId
    try:
        if spec is not None:
            entry = spec.entry_point
            target = gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
        elif attr and module in sys.modules:
            target = getattr(sys.modules[module], attr, None)
        else:
            return None
    except Exception:  # an entry point that does not import: the run itself would have said so
        return None
    metadata = getattr(target, "metadata", None) if inspect.isclass(target) else None
    return render_mode in metadata.get("render_modes", []) if isinstance(metadata, dict) else None


def looks_atari(env_id: str) -> bool:
    """Whether ``env_id`` names an Atari game: ``ALE/...``, ``...NoFrameskip...``, or an id ale-py registered
    (``Pong-v4``); Gymnasium's ``module:EnvId`` form by its id."""
    env_id = env_id.rpartition(":")[2]
    spec = gym.registry.get(env_id)
    return env_id.startswith("ALE/") or "NoFrameskip" in env_id or (spec is not None and "ale_py" in str(spec.entry_point))


def _resolve_id(env_id: str, kwargs: dict[str, Any], made_as: str | None = None) -> EnvSpec:
    """``made_as``: Gymnasium's ``module:EnvId`` form, kept whole so that a fresh process (a worker, a resumed run)
    imports the module that registers the id."""
    if env_id not in gym.registry and not register_ale() and looks_atari(env_id):
        raise ConfigError(f"env {env_id!r} is an Atari game and needs ale-py: {install_hint('atari')}")
    if env_id not in gym.registry:
        raise ConfigError(
            f"unknown env id {env_id!r}{closest(env_id, gym.registry.keys())} "
            "(accepted: a registered Gymnasium id, 'package.module:EnvClass' or a factory)"
        )
    entry_point = str(gym.registry[env_id].entry_point)
    if kwargs:
        _check_env_kwargs(made_as or env_id, _creator(gym.registry[env_id].entry_point), kwargs, also=_MAKE_KWARGS)
    is_atari = "ale_py" in entry_point
    plain_id = None if kwargs else env_id
    if is_atari and gym.registry[env_id].kwargs.get("frameskip", 1) != 1:
        # v5 ids skip 4 frames themselves, Pong-v4 and v0 2 to 4 at random; SB3's AtariWrapper skips too, so let it
        # do the skipping alone (as on the NoFrameskip ids), or each action would last 8 to 20 frames.
        kwargs = {"frameskip": 1, **kwargs}
    name = made_as or env_id
    return EnvSpec(name, functools.partial(_make_registered, name, kwargs), is_atari, plain_id, registered=env_id)


def _resolve_path(path: str, kwargs: dict[str, Any]) -> EnvSpec:
    module, _, attr = path.partition(":")
    try:
        imported = importlib.import_module(module)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ConfigError(f"env {path!r}: cannot import module {module!r} ({type(e).__name__}: {e})") from None
    if attr in gym.registry:  # Gymnasium's own "package:EnvId-v0" form: the import registered the env
        return _resolve_id(attr, kwargs, made_as=path)
    target = getattr(imported, attr, None)
    if target is None:
        # Its env classes, and the ids its import registered (Gymnasium's "package:EnvId-v0" form).
        names = [name for name, value in vars(imported).items() if _env_class(value)] + list(gym.registry)
        raise ConfigError(
            f"env {path!r}: module {module!r} has no attribute {attr!r}{closest(attr, names)} (accepted after the "
            "colon: an env class of the module, or an id its import registers)"
        )
    # Checked before anything is called: a name in a file (a run's config.yaml, say) must not run arbitrary code.
    if not _env_class(target):
        raise ConfigError(
            f"env {path!r}: {attr!r} is not a gymnasium.Env class (nor may it be a wrapper, which takes an env); a name "
            "may only be an env class or a registered id "
            "(to use a factory function, pass the function itself to make_plan, make_model or make_vec_env)"
        )
    _check_env_kwargs(path, target, kwargs)
    return EnvSpec(path, functools.partial(_make_from_path, path, kwargs))


# gym.make's own keywords, which env_kwargs pass through it for a registered id.
_MAKE_KWARGS = tuple(name for name in inspect.signature(gym.make).parameters if name not in ("id", "kwargs"))


def _creator(entry_point: Any) -> Any:
    if not isinstance(entry_point, str):
        return entry_point
    try:
        return load_env_creator(entry_point)
    except Exception:  # its import fails: building the env says so
        return None


def _check_env_kwargs(name: str, creator: Any, kwargs: Mapping[str, Any], also: tuple[str, ...] = ()) -> None:
    """Refuse a keyword the env's class or function does not take, naming those it does (its TypeError, raised as
    the env is built, named neither). Nothing is checked where it takes any (``**kwargs``)."""
    try:
        params = inspect.signature(creator, follow_wrapped=False).parameters  # a decorator may add keywords of its own
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [n for n, p in params.items() if p.kind in kinds] + list(also)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(
            f"env {name!r} takes no keyword argument {unknown[0]!r}{closest(unknown[0], accepted)} "
            f"(env_kwargs accepted: {', '.join(accepted) or 'none'})"
        )


def _env_class(target: Any) -> bool:
    """A ``gymnasium.Env`` subclass that builds its own env: a wrapper that takes one (Monitor, which writes the file
    it is given) is not, though an env class that wraps itself (``TimeLimit`` around its own env) is."""
    try:
        if not (inspect.isclass(target) and issubclass(target, gym.Env)):
            return False
    except TypeError:  # isclass is true of objects that issubclass refuses
        return False
    if issubclass(target, gym.Wrapper):
        try:
            return "env" not in inspect.signature(target).parameters
        except (TypeError, ValueError):
            return False
    return True


def resolve_env(env: str | Callable[[], gym.Env] | EnvSpec, env_kwargs: dict[str, Any] | None = None) -> EnvSpec:
    """Turn a registered id, ``package.module:EnvClass`` or a zero-argument factory into an :class:`EnvSpec`.

    A name (a string) may only be a registered Gymnasium id (``package.module:EnvId`` registers it first) or a
    ``gymnasium.Env`` subclass, so that nothing a file names runs as a function; a factory is passed as a callable.
    """
    env_kwargs = dict(env_kwargs or {})
    if isinstance(env, EnvSpec):
        return env
    if callable(env):
        name = factory_name(env)
        if env_kwargs:
            _check_env_kwargs(name, env, env_kwargs)
            env = functools.partial(env, **env_kwargs)
        return EnvSpec(name, env, factory=True)
    if not isinstance(env, str) or not env.strip():
        raise ConfigError(f"env must be a Gymnasium id, 'package.module:Attr' or a factory, got {env!r}")
    if ":" in env:
        return _resolve_path(env, env_kwargs)
    return _resolve_id(env, env_kwargs)


def factory_name(factory: Callable[..., Any]) -> str:
    """The name a factory is known by (a ``functools.partial``'s function's): all a run's config keeps of it."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return getattr(factory, "__name__", None) or type(factory).__name__


def _monitor_csv(path: str) -> str:
    """The file SB3's Monitor writes for ``path``, named as its ResultsWriter opens it (by its real path)."""
    if not path.endswith(Monitor.EXT):
        path = os.path.join(path, Monitor.EXT) if os.path.isdir(path) else f"{path}.{Monitor.EXT}"
    return os.path.realpath(path)


class _RowsNamed:
    """SB3's Monitor ResultsWriter whose failed write of an episode's row names its file (an error of a write on a
    full disk names none), so that the run can tell it from an env's own."""

    def __init__(self, writer: Any):
        self._writer = writer

    def write_row(self, epinfo: dict[str, float]) -> None:
        try:
            self._writer.write_row(epinfo)
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, e.strerror, self._writer.file_handler.name) from None

    def __getattr__(self, name: str) -> Any:
        if name == "_writer":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._writer, name)


class EnvFactory:
    """One env of a vec env: the user's env, Monitor, SB3's Atari wrapper, then ``wrapper_class``.

    Picklable with cloudpickle, so subprocess workers build their envs from it.

    :param make: the env's zero-argument factory
    :param monitor_path: Monitor's CSV file (None: none written)
    :param atari: wrap with SB3's AtariWrapper
    :param wrapper_class: a wrapper applied last (SB3's ``make_vec_env`` argument of the same name)
    :param max_episode_steps: cut episodes at this many steps, inside Monitor (so the cut episode is counted)
    """

    def __init__(
        self,
        make: Callable[[], gym.Env],
        monitor_path: str | None = None,
        atari: bool = False,
        *,
        monitor_kwargs: dict[str, Any] | None = None,
        wrapper_class: Callable[..., gym.Env] | None = None,
        wrapper_kwargs: dict[str, Any] | None = None,
        max_episode_steps: int | None = None,
    ):
        self.make, self.monitor_path, self.atari = make, monitor_path, atari
        self.max_episode_steps = max_episode_steps
        self.monitor_kwargs = monitor_kwargs or {}
        self.wrapper_class, self.wrapper_kwargs = wrapper_class, wrapper_kwargs or {}
        # Set by the subprocess builder for the time its workers start (see envs.build).
        self.report: str | None = None
        self.worker = False
        # A worker of SB3's SubprocVecEnv, whose process would print a page of traceback for an error it reported.
        self.quiet_exit = False

    def __call__(self) -> gym.Env:
        if self.worker:
            # One thread per worker: n workers each running a core-wide thread pool would oversubscribe the CPU.
            os.environ["OMP_NUM_THREADS"] = "1"
            th.set_num_threads(1)
            # Ctrl-C reaches the whole process group, and so does a SIGTERM sent to the job (a cluster's preemption,
            # `kill -- -PGID`): the parent stops training after the current step and needs its workers alive to
            # finish it (SB3's workers would otherwise exit on KeyboardInterrupt, or on the parent's SIGTERM handler,
            # which they inherit). The parent closes them; they die with it too (their pipes close).
            ignore_stop_signals()
        try:
            env: gym.Env = self.make()
            if self.max_episode_steps is not None:
                env = EpisodeStepCap(env, self.max_episode_steps, "emulator frames" if self.atari else "steps")
            # Named before Monitor makes its folder, as its ResultsWriter names it (a path ending in a separator).
            csv = _monitor_csv(self.monitor_path) if self.monitor_path is not None else None
            try:
                env = Monitor(env, filename=self.monitor_path, **self.monitor_kwargs)
            except OSError as e:  # its CSV's header on a full disk, say: a write error names no file
                if e.filename is not None or csv is None:
                    raise
                raise OSError(e.errno, e.strerror, csv) from None
            if env.results_writer is not None:
                env.results_writer = _RowsNamed(env.results_writer)  # type: ignore[assignment]
            env = AtariWrapper(env, frame_skip=ATARI_FRAME_SKIP) if self.atari else env
            env = self.wrapper_class(env, **self.wrapper_kwargs) if self.wrapper_class is not None else env
        except BaseException as e:
            if write_report(self.report, e) and self.quiet_exit and isinstance(e, Exception):
                raise _QuietExit from None
            raise
        return _ReportResetErrors(env, self.report, self.quiet_exit) if self.report else env


class EpisodeStepCap(gym.Wrapper):
    """Truncate an episode after ``cap`` steps of the env itself (emulator frames under SB3's Atari frame skip), and
    say so on stderr: where the env did not end it, a policy may be stuck."""

    def __init__(self, env: gym.Env, cap: int, unit: str = "steps"):
        super().__init__(env)
        self.cap, self.steps, self.unit = cap, 0, unit

    def reset(self, **kwargs: Any) -> Any:
        self.steps = 0
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if self.steps >= self.cap and not (terminated or truncated):
            truncated = True
            sys.stderr.write(f"warning: an episode was cut at {self.cap:,} {self.unit}; the env did not end it\n")
        return obs, reward, terminated, truncated, info


def episode_limit(env: gym.Env) -> str | None:
    """The env's own bound on an episode's length, in words (None: it has none, and an episode may never end)."""
    layer: Any = env
    while isinstance(layer, gym.Wrapper):  # a class may wrap itself in TimeLimit, with no registered spec
        if isinstance(layer, gym.wrappers.TimeLimit):
            return f"{layer._max_episode_steps:,} steps"
        layer = layer.env
    spec = env.spec
    if spec is not None and spec.max_episode_steps is not None:
        return f"{spec.max_episode_steps:,} steps"
    frames = spec.kwargs.get("max_num_frames_per_episode") if spec is not None else None  # ALE's, in frames
    return f"{frames:,} frames" if isinstance(frames, int) and frames > 0 else None


def write_report(path: str | None, error: BaseException) -> bool:
    """Leave the cause of a worker's failure in a file: its parent only sees a closed pipe. Whether it was left."""
    # After start-up the folder is gone, and the worker's own traceback is the report.
    if path is None:
        return False
    try:
        Path(path).write_text(f"{type(error).__name__}: {error}", encoding="utf-8")
    except OSError:
        return False
    return True


class _QuietExit(SystemExit):
    """Ends a worker whose error its parent reads from the report (with exit code 1, as for an error): the process
    prints no traceback for it, and its parent says it once, as the fallback's cause."""

    def __init__(self) -> None:
        super().__init__(1)


class _ReportResetErrors(gym.Wrapper):
    """In subprocess workers only: record why a reset failed (a failed first reset triggers the fallback)."""

    def __init__(self, env: gym.Env, report: str, quiet_exit: bool = False):
        super().__init__(env)
        self._report, self._quiet_exit = report, quiet_exit

    def reset(self, **kwargs: Any) -> Any:
        try:
            return self.env.reset(**kwargs)
        except BaseException as e:
            if write_report(self._report, e) and self._quiet_exit and isinstance(e, Exception):
                raise _QuietExit from None
            raise


def probe_env(spec: EnvSpec) -> gym.Env:
    """Build one env in this process as a vec env would (Atari wrapped), naming the pip extra a failure needs."""
    try:
        return EnvFactory(spec.make, None, spec.is_atari)()
    except gym.error.DependencyNotInstalled as e:
        text = str(e).lower()
        words = {"box2d": "box2d", "mujoco": "mujoco", "atari": "ale"}  # the extra: a word of gymnasium's message
        extra = next((extra for extra, word in words.items() if word in text), None)
        hint = f": {install_hint(extra)}" if extra else ""
        raise ConfigError(f"env {spec.name!r} needs a missing dependency ({str(e).splitlines()[0]}){hint}") from None
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"env {spec.name!r} failed to build: {type(e).__name__}: {e}") from None


def check_env_api(env: gym.Env, name: str) -> None:
    """What SB3's vec envs take for granted, checked on one env before anything trains: its two spaces, ``reset``'s
    ``(obs, info)``, ``step``'s five values, and observations of the space's shape. A break here (an env written for
    the old Gym API, say) otherwise surfaces deep inside SB3, once ``learn()`` has started."""
    for attr in ("observation_space", "action_space"):
        if not isinstance(getattr(env, attr, None), gym.spaces.Space):
            raise ConfigError(f"env {name!r} sets no {attr}; a Gymnasium env sets observation_space and action_space")
    try:
        reset = env.reset(seed=0)
        if not (isinstance(reset, tuple) and len(reset) == 2):
            raise ConfigError(f"env {name!r}: reset() returned {_returned(reset)}; a Gymnasium env returns (obs, info)")
        _check_observation(reset[0], env.observation_space, name, "reset()")
        step = env.step(env.action_space.sample())
        if not (isinstance(step, tuple) and len(step) == 5):
            raise ConfigError(
                f"env {name!r}: step() returned {_returned(step)}; a Gymnasium env returns (obs, reward, terminated, "
                "truncated, info)"
            )
        _check_observation(step[0], env.observation_space, name, "step()")
    except ConfigError:
        raise
    except Exception as e:
        # Gymnasium's own wrappers unpack step()'s values first: the old Gym API's four fail there.
        old = " (four values: the old Gym API; Gymnasium's step() returns five)" if "expected 5, got 4" in str(e) else ""
        raise ConfigError(f"env {name!r} failed on its first reset or step: {type(e).__name__}: {e}{old}") from None


def _returned(value: Any) -> str:
    return f"a tuple of {len(value)}" if isinstance(value, tuple) else f"a value of type {type(value).__name__}"


def _check_observation(obs: Any, space: gym.spaces.Space, name: str, where: str) -> None:
    """The shape only: bounds and dtypes are the env's to keep, and SB3 casts the dtype."""
    if isinstance(space, gym.spaces.Box) and np.shape(obs) != space.shape:
        raise ConfigError(
            f"env {name!r}: {where} returned an observation of shape {np.shape(obs)}, but its observation_space has "
            f"shape {space.shape}"
        )
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(obs, dict) or set(obs) != set(space.spaces):
            keys = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
            raise ConfigError(
                f"env {name!r}: {where} returned an observation with keys {keys}, but its Dict observation_space has "
                f"{sorted(space.spaces)}"
            )
        for key, sub in space.spaces.items():
            _check_observation(obs[key], sub, name, f"{where}[{key!r}]")


def measure_step_seconds(env: gym.Env, budget_s: float = 0.05, max_steps: int = 500) -> float:
    """Median wall time of one ``step`` with random actions, over ``budget_s`` seconds (at least 5 steps, at most
    ``max_steps``)."""
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


def space_text(space: Any) -> str | None:
    """A space's class and size as ``Box(17,)``, ``Discrete(3)`` or ``Dict(image: Box(3,64,64,), speed: Box(1,))``,
    from the space or from SB3's JSON record of it (None where the record says too little)."""
    if isinstance(space, dict):  # the record: text fields beside the pickle
        kind = re.search(r"\.(\w+)'>$", str(space.get(":type:", "")))
        if kind is not None and kind.group(1) == "Dict" and isinstance(space.get("spaces"), str):
            return _recorded_dict_text(space["spaces"])
        if kind is None or "_shape" not in space:
            return None
        name, shape, size = kind.group(1), space["_shape"], space.get("n", space.get("nvec"))
    elif isinstance(space, gym.spaces.Dict):
        members = {str(key): space_text(member) for key, member in space.spaces.items()}
        return _dict_text(members)
    elif isinstance(space, gym.spaces.Space):
        name, shape, size = type(space).__name__, space.shape, getattr(space, "n", getattr(space, "nvec", None))
    else:
        return None
    return _text(name, shape, size)


def _dict_text(members: dict[str, str | None]) -> str | None:
    if any(text is None for text in members.values()):
        return None
    return "Dict(" + ", ".join(f"{key}: {members[key]}" for key in sorted(members)) + ")"


def _recorded_dict_text(spaces_repr: str) -> str | None:
    """:func:`space_text` of a Dict from the repr of its members that SB3's JSON record keeps, as
    ``{'image': Box(0, 255, (3, 64, 64), uint8), 'speed': Discrete(3)}``; None where a member cannot be read there."""
    members: dict[str, str | None] = {}
    end = 0
    for found in re.finditer(r"""(['"])(.*?)\1: (\w+)\(""", spaces_repr):
        if found.start() < end:  # inside a member already read
            continue
        depth, end = 1, found.end()
        while end < len(spaces_repr) and depth:
            depth += {"(": 1, ")": -1}.get(spaces_repr[end], 0)
            end += 1
        name, inside = found.group(3), spaces_repr[found.end() : end - 1]
        if name == "Box":  # Box(low, high, shape, dtype): the shape is its last tuple (the bounds print as arrays)
            shapes = re.findall(r"\(([\d,\s]*)\)", inside)
            members[found.group(2)] = _text(name, shapes[-1], None) if shapes else None
        elif name in ("Discrete", "MultiDiscrete", "MultiBinary"):  # the choices come first: 3, [2 3], 4 or [2 2]
            choices = re.match(r"\s*(\[[^\]]*\]|\d+)", inside)
            members[found.group(2)] = _text(name, None, choices.group(1)) if choices else None
        else:
            members[found.group(2)] = None
    return _dict_text(members) if members else None


def _text(name: str, shape: Any, size: Any) -> str:
    if size is not None:  # the choices
        inside = " ".join(re.findall(r"\d+", str(size)))
    elif shape is None:
        inside = ""
    else:
        dims = re.findall(r"\d+", str(shape))
        inside = ",".join(dims) + ("," if len(dims) == 1 else "")
    return f"{name}({inside})"


def channel_last_images(space: gym.Space) -> list[str]:
    """The observations SB3 moves channels first (in the VecTransposeImage it adds for the model): a Box's (key
    ``""``) or a Dict's keys, where they are channel-last images."""
    members = space.spaces if isinstance(space, gym.spaces.Dict) else {"": space}
    return [
        key
        for key, member in members.items()
        if isinstance(member, gym.spaces.Box)
        and is_image_space(member, check_channels=False)
        and not is_image_space_channels_first(member)
    ]
