"""Preset schema, YAML loading and validation, CPU/GPU profiles, overrides, and SB3 keyword arguments.

A preset file (``presets/ppo.yaml``) maps entry names to entries. An entry is chosen by env id, else ``atari``
for Atari games, else ``default``. An entry holds shared keys plus ``cpu:`` and ``gpu:`` profiles that override
them; the profile follows the chosen device. Every key is validated: unknown keys, wrong types and values outside
their domain raise :class:`~sb3_gpu.errors.ConfigError` naming the key, the file and the closest valid name.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from sb3_contrib import QRDQN
from stable_baselines3 import DQN, PPO
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.utils import ConstantSchedule, LinearSchedule
from torch import nn

from sb3_gpu.errors import ConfigError, closest

MAX_YAML_BYTES = 1 << 20  # a preset is a page of text; refuse anything that could be a YAML bomb
PROFILES = ("cpu", "gpu")

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}
POLICIES = ("auto", "MlpPolicy", "CnnPolicy", "MultiInputPolicy")


# --------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class Schedule:
    """A value that changes over training, written in YAML as ``{schedule: linear, start: 1.0e-3, end: 0.0}``.

    ``end_fraction`` is the share of training after which ``end`` is held (SB3's ``LinearSchedule``).
    """

    kind: str
    start: float
    end: float = 0.0
    end_fraction: float = 1.0

    def to_sb3(self) -> Callable[[float], float]:
        if self.kind == "constant":
            return ConstantSchedule(self.start)
        return LinearSchedule(self.start, self.end, self.end_fraction)

    def to_yaml(self) -> dict[str, Any]:
        if self.kind == "constant":
            return {"schedule": "constant", "value": self.start}
        out: dict[str, Any] = {"schedule": "linear", "start": self.start, "end": self.end}
        if self.end_fraction != 1.0:
            out["end_fraction"] = self.end_fraction
        return out

    def __str__(self) -> str:
        if self.kind == "constant":
            return f"{self.start:g}"
        tail = f" by {self.end_fraction:g}" if self.end_fraction != 1.0 else ""
        return f"linear {self.start:g} -> {self.end:g}{tail}"


# --------------------------------------------------------------------------- value checks
# Each check takes (value, where) and returns the normalised value or raises ConfigError.
Check = Callable[[Any, str], Any]
_NUMBER_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _as_number(value: Any, where: str, what: str) -> float:
    # PyYAML reads `1e5` (no dot) as a string; accept it, since users write it that way.
    if isinstance(value, str) and _NUMBER_RE.match(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected {what}, got {value!r}")
    return value


def _int(low: int, what: str) -> Check:
    def check(value: Any, where: str) -> int:
        number = _as_number(value, where, what)
        if number != int(number) or number < low:
            raise ConfigError(f"{where}: expected {what}, got {value!r}")
        return int(number)

    return check


def _float(low: float, high: float, what: str, low_open: bool = False) -> Check:
    def check(value: Any, where: str) -> float:
        number = float(_as_number(value, where, what))
        if number < low or number > high or (low_open and number == low):
            raise ConfigError(f"{where}: expected {what}, got {value!r}")
        return number

    return check


def _optional(inner: Check) -> Check:
    def check(value: Any, where: str) -> Any:
        return None if value is None else inner(value, where)

    return check


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _schedulable(inner: Check) -> Check:
    def check(value: Any, where: str) -> float | Schedule:
        if not isinstance(value, Mapping):
            return inner(value, where)
        kind = value.get("schedule")
        if kind == "constant":
            _keys(value, {"schedule", "value"}, where)
            return Schedule("constant", inner(value.get("value"), f"{where}.value"))
        if kind == "linear":
            _keys(value, {"schedule", "start", "end", "end_fraction"}, where)
            if "start" not in value:
                raise ConfigError(f"{where}: a linear schedule needs 'start'")
            frac = _float(0.0, 1.0, "a number in (0, 1]", low_open=True)(
                value.get("end_fraction", 1.0), f"{where}.end_fraction"
            )
            # The end of a decaying schedule may be 0 even where the value itself must be positive.
            end = _as_number(value.get("end", 0.0), f"{where}.end", "a number")
            return Schedule("linear", inner(value["start"], f"{where}.start"), float(end), frac)
        raise ConfigError(f"{where}: schedule must be 'linear' or 'constant', got {kind!r}")

    return check


def _keys(mapping: Mapping[str, Any], valid: set[str], where: str) -> None:
    for key in mapping:
        if key not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}{closest(str(key), valid)} (valid: {', '.join(sorted(valid))})")


def _net_arch(value: Any, where: str) -> list[int] | dict[str, list[int]]:
    layer = _int(1, "a positive layer width")
    if isinstance(value, list):
        return [layer(v, where) for v in value]
    if isinstance(value, Mapping):
        _keys(value, {"pi", "vf", "qf"}, where)
        out = {}
        for k, v in value.items():
            if not isinstance(v, list):
                raise ConfigError(f"{where}.{k}: expected a list of layer widths, got {v!r}")
            out[k] = [layer(x, f"{where}.{k}") for x in v]
        return out
    raise ConfigError(f"{where}: expected a list of layer widths like [64, 64] or {{pi: [...], vf: [...]}}, got {value!r}")


def _choice(choices: tuple[str, ...] | list[str]) -> Check:
    def check(value: Any, where: str) -> str:
        if value not in choices:
            raise ConfigError(f"{where}: unknown value {value!r}{closest(str(value), choices)} (valid: {', '.join(choices)})")
        return str(value)

    return check


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return {str(k): v for k, v in value.items()}


_NORMALIZE_KEYS = {
    "norm_obs": _bool,
    "norm_reward": _bool,
    "clip_obs": _float(0, math.inf, "a positive number", True),
    "clip_reward": _float(0, math.inf, "a positive number", True),
}


def _normalize(value: Any, where: str) -> bool | dict[str, Any]:
    if isinstance(value, bool):
        return value
    mapping = _mapping(value, where)
    _keys(mapping, set(_NORMALIZE_KEYS), where)
    return {k: _NORMALIZE_KEYS[k](v, f"{where}.{k}") for k, v in mapping.items()}


def _train_freq(value: Any, where: str) -> int | tuple[int, str]:
    if isinstance(value, list):
        if len(value) != 2 or value[1] not in ("step", "episode"):
            raise ConfigError(f"{where}: expected a positive int or [n, step|episode], got {value!r}")
        return (_int(1, "a positive int")(value[0], where), value[1])
    return _int(1, "a positive int or [n, step|episode]")(value, where)


_pos_int = _int(1, "a positive int")
_unit = _float(0.0, 1.0, "a number in [0, 1]")
_pos = _float(0.0, math.inf, "a positive number", low_open=True)
_nonneg = _float(0.0, math.inf, "a number >= 0")


def _f(default: Any, check: Check) -> Any:
    return field(default=default, metadata={"check": check})


# --------------------------------------------------------------------------- per-algorithm hyperparameters
# Defaults equal SB3's own (a test pins that), so "SB3 default" in the plan is the truth.
@dataclass(frozen=True)
class PPOParams:
    """PPO's keyword arguments, as SB3 names them."""

    learning_rate: float | Schedule = _f(3e-4, _schedulable(_pos))
    n_steps: int = _f(2048, _pos_int)
    batch_size: int = _f(64, _int(2, "an int >= 2"))
    n_epochs: int = _f(10, _pos_int)
    gamma: float = _f(0.99, _unit)
    gae_lambda: float = _f(0.95, _unit)
    clip_range: float | Schedule = _f(0.2, _schedulable(_pos))
    clip_range_vf: float | None = _f(None, _optional(_pos))
    normalize_advantage: bool = _f(True, _bool)
    ent_coef: float = _f(0.0, _nonneg)
    vf_coef: float = _f(0.5, _nonneg)
    max_grad_norm: float = _f(0.5, _pos)
    use_sde: bool = _f(False, _bool)
    sde_sample_freq: int = _f(-1, _int(-1, "an int >= -1"))
    target_kl: float | None = _f(None, _optional(_pos))


@dataclass(frozen=True)
class DQNParams:
    """DQN's keyword arguments, as SB3 names them."""

    learning_rate: float | Schedule = _f(1e-4, _schedulable(_pos))
    buffer_size: int = _f(1_000_000, _pos_int)
    learning_starts: int = _f(100, _int(0, "an int >= 0"))
    batch_size: int = _f(32, _pos_int)
    tau: float = _f(1.0, _float(0.0, 1.0, "a number in (0, 1]", low_open=True))
    gamma: float = _f(0.99, _unit)
    train_freq: int | tuple[int, str] = _f(4, _train_freq)
    gradient_steps: int = _f(1, _int(-1, "a positive int, or -1 for one per env step"))
    optimize_memory_usage: bool = _f(False, _bool)
    n_steps: int = _f(1, _pos_int)
    target_update_interval: int = _f(10_000, _pos_int)
    exploration_fraction: float = _f(0.1, _unit)
    exploration_initial_eps: float = _f(1.0, _unit)
    exploration_final_eps: float = _f(0.05, _unit)
    max_grad_norm: float | None = _f(10.0, _pos)


@dataclass(frozen=True)
class QRDQNParams(DQNParams):
    """QR-DQN's keyword arguments (sb3-contrib); the same as DQN's with other defaults."""

    learning_rate: float | Schedule = _f(5e-5, _schedulable(_pos))
    exploration_fraction: float = _f(0.005, _unit)
    exploration_final_eps: float = _f(0.01, _unit)
    max_grad_norm: float | None = _f(None, _optional(_pos))


AlgoParams = PPOParams | DQNParams


@dataclass(frozen=True)
class Algo:
    name: str
    model_class: type[BaseAlgorithm]
    params_class: type[PPOParams] | type[DQNParams]
    on_policy: bool


ALGOS: dict[str, Algo] = {
    "ppo": Algo("ppo", PPO, PPOParams, on_policy=True),
    "dqn": Algo("dqn", DQN, DQNParams, on_policy=False),
    "qrdqn": Algo("qrdqn", QRDQN, QRDQNParams, on_policy=False),
}


def get_algo(name: str) -> Algo:
    """Look an algorithm up by name (case-insensitive)."""
    algo = ALGOS.get(name.lower())
    if algo is None:
        raise ConfigError(f"unknown algorithm {name!r}{closest(name.lower(), ALGOS)} (valid: {', '.join(ALGOS)})")
    return algo


# Keys that every entry may hold beside the algorithm's hyperparameters.
COMMON_KEYS: dict[str, Check] = {
    "n_timesteps": _pos_int,
    "n_envs": _pos_int,
    "policy": _choice(POLICIES),
    "net_arch": _optional(_net_arch),
    "activation_fn": _optional(_choice(tuple(ACTIVATIONS))),
    "policy_kwargs": _mapping,
    "normalize": _normalize,
    "frame_stack": _optional(_pos_int),
    "env_kwargs": _mapping,
}
COMMON_DEFAULTS: dict[str, Any] = {
    "n_timesteps": 100_000,
    "n_envs": 1,
    "policy": "auto",
    "net_arch": None,
    "activation_fn": None,
    "policy_kwargs": {},
    "normalize": False,
    "frame_stack": None,
    "env_kwargs": {},
}


def _param_checks(algo: Algo) -> dict[str, Check]:
    return {f.name: f.metadata["check"] for f in dataclasses.fields(algo.params_class)}


def valid_keys(algo: Algo) -> dict[str, Check]:
    """Every key a flat (profile-free) entry of ``algo`` may hold, with its check."""
    return {**COMMON_KEYS, **_param_checks(algo)}


def validate_flat(algo: Algo, mapping: Any, where: str) -> dict[str, Any]:
    """Validate a profile-free mapping of keys; return the normalised values."""
    mapping = _mapping(mapping, where)
    checks = valid_keys(algo)
    _keys(mapping, set(checks), where)
    return {k: checks[k](v, f"{where}: {k}") for k, v in mapping.items()}


def validate_entry(algo: Algo, entry: Any, where: str) -> dict[str, Any]:
    """Validate an entry: shared keys plus optional ``cpu:``/``gpu:`` profiles."""
    entry = _mapping(entry, where)
    _keys(entry, set(valid_keys(algo)) | set(PROFILES), where)
    shared = validate_flat(algo, {k: v for k, v in entry.items() if k not in PROFILES}, where)
    out: dict[str, Any] = dict(shared)
    for profile in PROFILES:
        if profile in entry:
            values = validate_flat(algo, entry[profile] or {}, f"{where}, profile {profile}")
            if "policy" in values:
                raise ConfigError(f"{where}, profile {profile}: 'policy' must be shared, not set per profile")
            out[profile] = values
    return out


# --------------------------------------------------------------------------- files
def presets_dir() -> Path:
    """The bundled presets: inside the installed package, or the repo's top-level ``presets/`` in a source checkout."""
    packaged = Path(str(resources.files("sb3_gpu"))) / "presets"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "presets"


def read_yaml(path: Path | str, what: str = "preset file") -> Any:
    """Read a YAML file with ``safe_load`` (no python tags), refusing files over 1 MiB."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_YAML_BYTES:
            raise ConfigError(f"{path}: {what} is larger than {MAX_YAML_BYTES // 1024} KiB")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path} cannot be read: {e}") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, where: str) -> Any:
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: more than {MAX_YAML_BYTES // 1024} KiB of YAML")
    try:
        return yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        tag = getattr(e, "problem", "") or str(e)
        raise ConfigError(f"{where}: refused YAML tag ({tag.strip()}); presets are plain data") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{line}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply") from None


def load_preset_file(algo: Algo, path: Path | str | None = None) -> tuple[dict[str, dict[str, Any]], str]:
    """Load and validate a whole preset file (the bundled one for ``algo`` when ``path`` is None)."""
    path = Path(path) if path is not None else presets_dir() / f"{algo.name}.yaml"
    data = read_yaml(path)
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{path}: a preset file must be a mapping of entries (env ids, 'default', 'atari')")
    return {str(name): validate_entry(algo, entry, f"{path}, entry {name}") for name, entry in data.items()}, str(path)


def select_entry(entries: Mapping[str, Any], env_id: str, is_atari: bool, where: str) -> str:
    """The entry for an env: its own id, else ``atari`` for Atari games, else ``default``."""
    for name in (env_id, "atari" if is_atari else None, "default"):
        if name is not None and name in entries:
            return name
    raise ConfigError(f"{where} has no entry for {env_id!r} and no 'default' entry (entries: {', '.join(entries)})")


# --------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key=value`` (the value read as a YAML scalar, list or mapping)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value (e.g. batch_size=128), got {text!r}")
    return key, parse_yaml(raw, f"--set {key}")


def apply_override(values: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` in a flat mapping; ``policy_kwargs.x`` and ``env_kwargs.x`` reach one level down."""
    head, dot, rest = key.partition(".")
    if dot and head in ("policy_kwargs", "env_kwargs", "normalize") and rest:
        inner = values.get(head)
        inner = dict(inner) if isinstance(inner, Mapping) else {}
        inner[rest] = value
        values[head] = inner
    else:
        values[key] = value


# --------------------------------------------------------------------------- the resolved preset
@dataclass(frozen=True)
class Preset:
    """A fully resolved, validated set of values for one algorithm, env and profile, with each value's source."""

    algo: str
    entry: str
    profile: str
    n_timesteps: int
    n_envs: int
    policy: str
    net_arch: list[int] | dict[str, list[int]] | None
    activation_fn: str | None
    policy_kwargs: dict[str, Any]
    normalize: bool | dict[str, Any]
    frame_stack: int | None
    env_kwargs: dict[str, Any]
    params: AlgoParams
    sources: dict[str, str]

    def values(self) -> dict[str, Any]:
        """Every key as plain YAML data: a flat entry that, loaded again, gives this preset."""
        out: dict[str, Any] = {k: getattr(self, k) for k in COMMON_KEYS}
        out.update(self._params())
        return {k: v.to_yaml() if isinstance(v, Schedule) else list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def _params(self) -> dict[str, Any]:
        return {f.name: getattr(self.params, f.name) for f in dataclasses.fields(self.params)}

    def policy_kwargs_for_sb3(self) -> dict[str, Any]:
        kwargs = dict(self.policy_kwargs)
        if self.net_arch is not None:
            kwargs["net_arch"] = self.net_arch
        if self.activation_fn is not None:
            kwargs["activation_fn"] = ACTIVATIONS[self.activation_fn]
        return kwargs

    def sb3_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the SB3 class, schedules turned into SB3's own schedule objects."""
        kwargs = {k: v.to_sb3() if isinstance(v, Schedule) else v for k, v in self._params().items()}
        kwargs["policy_kwargs"] = self.policy_kwargs_for_sb3()
        return kwargs


def check_policy_kwargs(algo: Algo, policy: str, kwargs: Mapping[str, Any], where: str) -> None:
    if policy == "auto" or not kwargs:
        return
    policy_class = algo.model_class.policy_aliases.get(policy)
    if policy_class is None:  # pragma: no cover - POLICIES lists only aliases every algorithm has
        raise ConfigError(f"{where}: {algo.name} has no policy {policy!r}")
    accepted = set(inspect.signature(policy_class.__init__).parameters) - {"self", "observation_space", "action_space"}
    _keys(kwargs, accepted, f"{where}: policy_kwargs of {policy}")


def resolve_preset(
    algo: Algo,
    entry: Mapping[str, Any],
    entry_label: str,
    profile: str,
    overrides: Mapping[str, tuple[Any, str]] | None = None,
) -> Preset:
    """Merge SB3 defaults, an entry's shared keys, its profile and overrides (``key -> (value, source)``)."""
    overrides = overrides or {}
    defaults = {f.name: f.default for f in dataclasses.fields(algo.params_class)}
    values: dict[str, Any] = {**COMMON_DEFAULTS, **defaults}
    sources = {k: "sb3_gpu default" for k in COMMON_DEFAULTS} | {k: "SB3 default" for k in defaults}
    for layer, label in ((entry, entry_label), (entry.get(profile) or {}, f"{entry_label}/{profile}")):
        for key, value in layer.items():
            if key not in PROFILES:
                values[key], sources[key] = value, label
    raw: dict[str, Any] = {}
    for key, (value, source) in overrides.items():
        apply_override(raw, key, value)
        sources[key.partition(".")[0]] = source
    for key in raw:
        if isinstance(raw[key], dict) and isinstance(values.get(key), Mapping) and key != "normalize":
            raw[key] = {**values[key], **raw[key]}
    values.update(validate_flat(algo, raw, "override"))
    check_policy_kwargs(algo, values["policy"], values["policy_kwargs"], entry_label)
    params = algo.params_class(**{f.name: values[f.name] for f in dataclasses.fields(algo.params_class)})
    common = {k: values[k] for k in COMMON_KEYS}
    return Preset(algo=algo.name, entry=entry_label, profile=profile, params=params, sources=sources, **common)
