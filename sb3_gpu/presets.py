"""Preset schema, YAML loading and validation, CPU/GPU profiles, overrides, and SB3 keyword arguments.

A preset file (``presets/ppo.yaml``) maps entry names to entries. An entry is chosen by env id, else ``atari``
for Atari games, else ``default``. An entry holds shared keys plus ``cpu:`` and ``gpu:`` profiles that override
them; the profile follows the chosen device. Every key is validated: unknown keys, wrong types and values outside
their domain raise :class:`~sb3_gpu.errors.ConfigError` naming the key, the file and the closest valid name.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from sb3_contrib import QRDQN
from stable_baselines3 import DQN, PPO
from stable_baselines3.common.base_class import BaseAlgorithm
from torch import nn

from sb3_gpu import _checks as c
from sb3_gpu._checks import Check, Schedule
from sb3_gpu.accumulate import GradAccumPPO
from sb3_gpu.amp import AMP_MODES
from sb3_gpu.errors import ConfigError, closest
from sb3_gpu.per import PrioritizedDQN, PrioritizedQRDQN, PrioritizedReplayBuffer

MAX_YAML_BYTES = 1 << 20  # a preset is a page of text; refuse anything that could be a YAML bomb
MAX_YAML_VALUES = 100_000  # after alias expansion: the bundled presets hold a few hundred
# `cpu`/`gpu` follow the chosen device; `large` is asked for by name (`--profile large`): a big workstation.
PROFILES = ("cpu", "gpu", "large")

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}
POLICIES = ("auto", "MlpPolicy", "CnnPolicy", "MultiInputPolicy")


# --------------------------------------------------------------------------- per-algorithm hyperparameters
# Defaults equal SB3's own (a test pins that), so "SB3 default" in the plan is the truth.
@dataclass(frozen=True)
class PPOParams:
    """PPO's keyword arguments, as SB3 names them."""

    learning_rate: float | Schedule = c.param(3e-4, c.schedulable(c.POSITIVE))
    n_steps: int = c.param(2048, c.POS_INT)
    batch_size: int = c.param(64, c.integer(2, "an int >= 2"))
    n_epochs: int = c.param(10, c.POS_INT)
    gamma: float = c.param(0.99, c.UNIT)
    gae_lambda: float = c.param(0.95, c.UNIT)
    clip_range: float | Schedule = c.param(0.2, c.schedulable(c.POSITIVE))
    clip_range_vf: float | None = c.param(None, c.optional(c.POSITIVE))
    normalize_advantage: bool = c.param(True, c.boolean)
    ent_coef: float = c.param(0.0, c.NON_NEGATIVE)
    vf_coef: float = c.param(0.5, c.NON_NEGATIVE)
    max_grad_norm: float = c.param(0.5, c.POSITIVE)
    use_sde: bool = c.param(False, c.boolean)
    sde_sample_freq: int = c.param(-1, c.integer(-1, "an int >= -1"))
    target_kl: float | None = c.param(None, c.optional(c.POSITIVE))
    # sb3_gpu extension (accumulate.py): k minibatches per optimizer step; SB3 has none.
    grad_accum_steps: int = c.param(1, c.POS_INT)


@dataclass(frozen=True)
class DQNParams:
    """DQN's keyword arguments, as SB3 names them."""

    learning_rate: float | Schedule = c.param(1e-4, c.schedulable(c.POSITIVE))
    buffer_size: int = c.param(1_000_000, c.POS_INT)
    learning_starts: int = c.param(100, c.integer(0, "an int >= 0"))
    batch_size: int = c.param(32, c.POS_INT)
    tau: float = c.param(1.0, c.number(0.0, 1.0, "a number in (0, 1]", low_open=True))
    gamma: float = c.param(0.99, c.UNIT)
    train_freq: int | tuple[int, str] = c.param(4, c.train_freq)
    gradient_steps: int = c.param(1, c.integer(-1, "a positive int, or -1 for one per env step"))
    optimize_memory_usage: bool = c.param(False, c.boolean)
    n_steps: int = c.param(1, c.POS_INT)
    target_update_interval: int = c.param(10_000, c.POS_INT)
    exploration_fraction: float = c.param(0.1, c.UNIT)
    exploration_initial_eps: float = c.param(1.0, c.UNIT)
    exploration_final_eps: float = c.param(0.05, c.UNIT)
    max_grad_norm: float | None = c.param(10.0, c.POSITIVE)
    # sb3_gpu extensions (per.py): prioritized replay and gradient accumulation; SB3 has neither.
    per: dict[str, float] | bool = c.param(False, c.per_config)
    grad_accum_steps: int = c.param(1, c.POS_INT)


@dataclass(frozen=True)
class QRDQNParams(DQNParams):
    """QR-DQN's keyword arguments (sb3-contrib); the same as DQN's with other defaults."""

    learning_rate: float | Schedule = c.param(5e-5, c.schedulable(c.POSITIVE))
    exploration_fraction: float = c.param(0.005, c.UNIT)
    exploration_final_eps: float = c.param(0.01, c.UNIT)
    max_grad_norm: float | None = c.param(None, c.optional(c.POSITIVE))


AlgoParams = PPOParams | DQNParams


@dataclass(frozen=True)
class Algo:
    name: str
    model_class: type[BaseAlgorithm]
    params_class: type[PPOParams] | type[DQNParams]
    on_policy: bool
    # The subclass that runs sb3_gpu's training extensions; the plain SB3 class is used when they are off.
    extended_class: type[BaseAlgorithm] | None = None


ALGOS: dict[str, Algo] = {
    "ppo": Algo("ppo", PPO, PPOParams, on_policy=True, extended_class=GradAccumPPO),
    "dqn": Algo("dqn", DQN, DQNParams, on_policy=False, extended_class=PrioritizedDQN),
    "qrdqn": Algo("qrdqn", QRDQN, QRDQNParams, on_policy=False, extended_class=PrioritizedQRDQN),
}
EXTENSION_KEYS = ("per", "grad_accum_steps")  # sb3_gpu's own, not SB3 arguments
OFF_POLICY_ONLY = ("per", "buffer_size", "train_freq", "target_update_interval")


def get_algo(name: str) -> Algo:
    """Look an algorithm up by name (case-insensitive)."""
    algo = ALGOS.get(name.lower())
    if algo is None:
        raise ConfigError(f"unknown algorithm {name!r}{closest(name.lower(), ALGOS)} (valid: {', '.join(ALGOS)})")
    return algo


# Keys that every entry may hold beside the algorithm's hyperparameters.
COMMON_KEYS: dict[str, Check] = {
    "n_timesteps": c.POS_INT,
    "n_envs": c.POS_INT,
    "policy": c.choice(POLICIES),
    "net_arch": c.optional(c.net_arch),
    "activation_fn": c.optional(c.choice(tuple(ACTIVATIONS))),
    "policy_kwargs": c.mapping,
    "normalize": c.normalize,
    "frame_stack": c.optional(c.POS_INT),
    "env_kwargs": c.mapping,
    # Speed switches (speed.py): not SB3 arguments; `auto` is decided per machine with a reason in the plan.
    "amp": c.choice(AMP_MODES),
    "compile": c.compile_mode,
    "threads": c.threads,
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
    "amp": "auto",
    "compile": "false",
    "threads": "auto",
}


def _param_checks(algo: Algo) -> dict[str, Check]:
    return {f.name: f.metadata["check"] for f in dataclasses.fields(algo.params_class)}


def valid_keys(algo: Algo) -> dict[str, Check]:
    """Every key a flat (profile-free) entry of ``algo`` may hold, with its check."""
    return {**COMMON_KEYS, **_param_checks(algo)}


def validate_flat(algo: Algo, mapping: Any, where: str) -> dict[str, Any]:
    """Validate a profile-free mapping of keys; return the normalised values."""
    mapping = c.mapping(mapping, where)
    checks = valid_keys(algo)
    for key in mapping:
        if algo.on_policy and key in OFF_POLICY_ONLY:
            raise ConfigError(f"{where}: {key!r} is for off-policy algorithms (dqn, qrdqn); {algo.name} is on-policy")
    c.check_keys(mapping, set(checks), where)
    return {k: checks[k](v, f"{where}: {k}") for k, v in mapping.items()}


def validate_entry(algo: Algo, entry: Any, where: str) -> dict[str, Any]:
    """Validate an entry: shared keys plus optional ``cpu:``, ``gpu:`` and ``large:`` profiles."""
    entry = c.mapping(entry, where)
    c.check_keys(entry, set(valid_keys(algo)) | set(PROFILES), where)
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


def _expanded_size(value: Any, where: str) -> int:
    """How many values ``value`` holds once aliases are expanded; refuses self-reference and anchor bombs."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        if not isinstance(node, (list, dict)):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(f"{where}: a YAML alias refers to itself; presets are plain data")
        active.add(key)
        children = node.values() if isinstance(node, dict) else node
        total = 1 + sum(size(child) for child in children)
        active.discard(key)
        if total > MAX_YAML_VALUES:
            raise ConfigError(f"{where}: YAML expands to more than {MAX_YAML_VALUES:,} values (an anchor/alias bomb?)")
        sizes[key] = total
        return total

    return size(value)


def parse_yaml(text: str, where: str) -> Any:
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: more than {MAX_YAML_BYTES // 1024} KiB of YAML")
    try:
        data = yaml.safe_load(text)
        # Aliases share one object, so loading is cheap; walking them later (checks, messages) would not be.
        _expanded_size(data, where)
        return data
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
    """Set ``key`` in a flat mapping; ``policy_kwargs.x``, ``env_kwargs.x``, ``per.x`` reach one level down."""
    head, dot, rest = key.partition(".")
    if dot and head in ("policy_kwargs", "env_kwargs", "normalize", "per") and rest:
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
    amp: str
    compile: str
    threads: int | str
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

    @property
    def model_class(self) -> type[BaseAlgorithm]:
        """The plain SB3 class, or sb3_gpu's subclass where prioritized replay or gradient accumulation is on."""
        algo = get_algo(self.algo)
        extended = getattr(self.params, "per", False) or getattr(self.params, "grad_accum_steps", 1) > 1
        return algo.extended_class if extended and algo.extended_class is not None else algo.model_class

    def sb3_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :attr:`model_class`, schedules turned into SB3's own schedule objects."""
        kwargs = {k: v.to_sb3() if isinstance(v, Schedule) else v for k, v in self._params().items()}
        kwargs["policy_kwargs"] = self.policy_kwargs_for_sb3()
        per: Any = self._params().get("per", False)
        grad_accum_steps = kwargs.pop("grad_accum_steps", 1)
        kwargs.pop("per", None)
        if self.model_class is not get_algo(self.algo).model_class:
            kwargs["grad_accum_steps"] = grad_accum_steps
        if per:
            kwargs["replay_buffer_class"] = PrioritizedReplayBuffer
            kwargs["replay_buffer_kwargs"] = {"alpha": per["alpha"], "beta": per["beta0"], "eps": per["eps"]}
            kwargs["per_beta_fraction"] = per["beta_fraction"]
        return kwargs


def check_policy_kwargs(algo: Algo, policy: str, kwargs: Mapping[str, Any], where: str) -> None:
    if policy == "auto" or not kwargs:
        return
    policy_class = algo.model_class.policy_aliases.get(policy)
    if policy_class is None:  # pragma: no cover - POLICIES lists only aliases every algorithm has
        raise ConfigError(f"{where}: {algo.name} has no policy {policy!r}")
    accepted = set(inspect.signature(policy_class.__init__).parameters) - {"self", "observation_space", "action_space"}
    c.check_keys(kwargs, accepted, f"{where}: policy_kwargs of {policy}")


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
    sources.update({k: "sb3_gpu default" for k in EXTENSION_KEYS if k in defaults})
    for layer, label in ((entry, entry_label), (entry.get(profile) or {}, f"{entry_label}/{profile}")):
        for key, value in layer.items():
            if key not in PROFILES:
                values[key], sources[key] = value, label
    raw: dict[str, Any] = {}
    for key, (value, source) in overrides.items():
        apply_override(raw, key, value)
        sources[key.partition(".")[0]] = source
    for key in raw:
        if isinstance(raw[key], dict) and isinstance(values.get(key), Mapping):
            raw[key] = {**values[key], **raw[key]}
        elif key == "per" and raw[key] is True and isinstance(values.get(key), Mapping):
            raw[key] = values[key]  # --per switches the preset's own PER settings on, not the defaults
    values.update(validate_flat(algo, raw, "override"))
    check_policy_kwargs(algo, values["policy"], values["policy_kwargs"], entry_label)
    params = algo.params_class(**{f.name: values[f.name] for f in dataclasses.fields(algo.params_class)})
    common = {k: values[k] for k in COMMON_KEYS}
    return Preset(algo=algo.name, entry=entry_label, profile=profile, params=params, sources=sources, **common)
