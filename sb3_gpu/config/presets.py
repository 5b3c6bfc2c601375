"""Presets: loading a preset file, choosing its entry for an env, layering SB3 defaults, the entry, its profile and
overrides into one resolved :class:`Preset`, and turning that into SB3 keyword arguments.

A preset file (``presets/ppo.yaml``) maps entry names to entries. An entry is chosen by env id, else ``atari`` for
Atari games, else ``default``. An entry holds shared keys plus ``cpu:``, ``gpu:`` and ``large:`` profiles that
override them; the profile follows the chosen device unless one is asked for. Every key is validated: unknown keys,
wrong types and values outside their domain raise :class:`~sb3_gpu.common.errors.ConfigError` naming the key, the file
and the closest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.common import checks as c
from sb3_gpu.common.checks import Schedule
from sb3_gpu.common.errors import ConfigError, closest
from sb3_gpu.config.files import parse_yaml, presets_dir, read_yaml
from sb3_gpu.config.schema import (
    ACTIVATIONS,
    COMMON_DEFAULTS,
    COMMON_KEYS,
    CONVERTED_KEYS,
    EXTENSION_KEYS,
    PROFILES,
    Algo,
    AlgoParams,
    get_algo,
    validate_entry,
    validate_flat,
)
from sb3_gpu.config.zoo import ZooEntries, load_zoo_file
from sb3_gpu.extensions.per import PrioritizedReplayBuffer


def load_preset_file(algo: Algo, path: Path | str | None = None) -> tuple[Mapping[str, dict[str, Any]], str]:
    """Load and validate a whole preset file (the bundled one for ``algo`` when ``path`` is None); ``zoo:ppo`` or
    ``zoo:PATH.yml`` reads an rl-zoo3 hyperparameter file (:mod:`sb3_gpu.config.zoo`)."""
    if isinstance(path, str) and path.startswith("zoo:"):
        return load_zoo_file(algo, path.removeprefix("zoo:"))
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"preset: expected a preset file's path or zoo:ALGO, got {path!r}")
    path = Path(path) if path is not None else presets_dir() / f"{algo.name}.yaml"
    data = read_yaml(path)
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{path}: a preset file must be a mapping of entries (env ids, 'default', 'atari')")
    return {str(name): validate_entry(algo, entry, f"{path}, entry {name}") for name, entry in data.items()}, str(path)


def select_entry(entries: Mapping[str, Any], env_id: str, is_atari: bool, where: str) -> str:
    """The entry for an env: its own id, else (in an rl-zoo3 file) its task's entry in another version, else
    ``atari`` for Atari games, else ``default``.

    In a preset file, an entry that is no registered id but looks like ``env_id`` is a typo, refused rather than
    passed over for the fallback (the run would train on ``default``'s values without a word). rl-zoo3's files are
    left alone: they hold entries for other packages' envs (PyBullet's, the NoVel variants) that are no typos.
    """
    if env_id not in entries and not isinstance(entries, ZooEntries):
        for name in entries:
            looks_like = difflib.get_close_matches(name, [env_id], cutoff=0.85)
            if name not in ("default", "atari") and ":" not in name and name not in gym.registry and looks_like:
                raise ConfigError(
                    f"{where}, entry {name!r}: no registered env id; did you mean {env_id!r}? (an entry is an env id, "
                    "'default' or 'atari')"
                )
    for wanted in (env_id, _other_version(entries, env_id), "atari" if is_atari else None, "default"):
        if wanted is not None and wanted in entries:
            return wanted
    hint = next((h for n in entries if n not in gym.registry and (h := closest(n, ["default", "atari"]))), "")
    raise ConfigError(f"{where} has no entry for {env_id!r} and no 'default' entry (entries: {', '.join(entries)}){hint}")


def _other_version(entries: Mapping[str, Any], env_id: str) -> str | None:
    """In an rl-zoo3 file, the newest entry for another version of ``env_id``'s env: its files lag behind
    gymnasium's versions (MuJoCo's ``-v4`` entries for the ``-v5`` envs), and the task's values beat ``default``'s,
    whichever version is newer. The plan names the entry it took."""
    name, sep, version = env_id.rpartition("-v")
    if not isinstance(entries, ZooEntries) or not sep or not version.isdigit():
        return None
    versions = [int(v) for e in entries if (n := e.rpartition("-v"))[0] == name and (v := n[2]).isdigit()]
    return f"{name}-v{max(versions)}" if versions else None


# --------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key=value`` (the value read as a YAML scalar, list or mapping)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not key.isprintable() or any(c.isspace() for c in key):
        raise ConfigError(f"--set expects key=value (e.g. batch_size=128), got {text!r}")
    if not raw.strip():  # YAML would read it as null: say so rather than report "got None"
        raise ConfigError(f"--set {key}=: no value after '=' (give one, or {key}=null for none)")
    return key, parse_yaml(raw, f"--set {key}")


def apply_override(values: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` in a flat mapping; ``policy_kwargs.x``, ``env_kwargs.x``, ``normalize.x``, ``per.x`` reach one level
    down."""
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
    eval_max_episode_steps: int | None
    eval_freq: int | None
    amp: str
    compile: str
    threads: int | str
    device_buffers: str
    probe: bool
    params: AlgoParams
    sources: dict[str, str]

    def values(self) -> dict[str, Any]:
        """Every key as plain YAML data: a flat entry that, loaded again, gives this preset."""
        out: dict[str, Any] = {k: getattr(self, k) for k in COMMON_KEYS}
        out.update(self._params())
        return {k: v.to_yaml() if isinstance(v, Schedule) else list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def _params(self) -> dict[str, Any]:
        return {f.name: getattr(self.params, f.name) for f in dataclasses.fields(self.params)}

    @property
    def timesteps_trained(self) -> int:
        """The env steps a run of ``n_timesteps`` takes: SB3's ``learn`` collects whole rollouts of ``n_steps *
        n_envs`` (on-policy) or ``train_freq * n_envs`` (off-policy), so it can run past ``n_timesteps``. A
        ``train_freq`` counted in episodes ends where they end: ``n_timesteps``, at the least."""
        if get_algo(self.algo).on_policy:
            block = self.params.n_steps * self.n_envs
        else:
            params: Any = self.params  # DQN's, QR-DQN's, SAC's, TD3's or TQC's
            count, unit = (params.train_freq, "step") if isinstance(params.train_freq, int) else params.train_freq
            if unit != "step":
                return self.n_timesteps
            block = count * self.n_envs
        return -(-self.n_timesteps // block) * block

    def policy_kwargs_for_sb3(self) -> dict[str, Any]:
        kwargs = dict(self.policy_kwargs)
        if self.net_arch is not None:
            kwargs["net_arch"] = self.net_arch
        if self.activation_fn is not None:
            kwargs["activation_fn"] = ACTIVATIONS[self.activation_fn]
        return kwargs

    @property
    def model_class(self) -> type[BaseAlgorithm]:
        """The plain SB3 class, or sb3_gpu's subclass where prioritized replay, gradient accumulation or layer-normed
        critics are on."""
        algo = get_algo(self.algo)
        params = self.params
        extended = getattr(params, "per", False) or getattr(params, "grad_accum_steps", 1) > 1
        extended = extended or getattr(params, "critic_layer_norm", False)
        return algo.extended_class if extended and algo.extended_class is not None else algo.model_class

    def sb3_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :attr:`model_class`, schedules turned into SB3's own schedule objects."""
        kwargs: dict[str, Any] = {k: v.to_sb3() if isinstance(v, Schedule) else v for k, v in self._params().items()}
        kwargs["policy_kwargs"] = self.policy_kwargs_for_sb3()
        per: Any = self._params().get("per", False)
        grad_accum_steps = kwargs.get("grad_accum_steps", 1)
        critic_layer_norm = kwargs.get("critic_layer_norm")
        # sb3_gpu's own keys go to its subclasses below or to the plan (overlap_training: planning.buffers; the
        # action noise object, which needs the action space): none is an SB3 argument.
        for key in (*EXTENSION_KEYS, *CONVERTED_KEYS):
            kwargs.pop(key, None)
        if self.model_class is not get_algo(self.algo).model_class:
            kwargs["grad_accum_steps"] = grad_accum_steps
            if critic_layer_norm is not None:
                kwargs["critic_layer_norm"] = critic_layer_norm
        if per:
            kwargs["replay_buffer_class"] = PrioritizedReplayBuffer
            kwargs["replay_buffer_kwargs"] = {
                "alpha": per["alpha"],
                "beta": per["beta0"],
                "eps": per["eps"],
                "normalize": per["normalize"],
            }
            kwargs["per_beta_fraction"] = per["beta_fraction"]
        return kwargs


_OWN_KEYS = ("net_arch", "activation_fn", "use_sde")  # policy arguments that a preset sets with keys of their own


def check_policy_kwargs(algo: Algo, policy: str, kwargs: Mapping[str, Any], where: str) -> None:
    for key in _OWN_KEYS:  # SB3 or the preset would overwrite them without a word
        if key in kwargs:
            raise ConfigError(f"{where}: policy_kwargs.{key} is a preset key of its own; set {key} instead")
    if "lr_schedule" in kwargs:
        raise ConfigError(f"{where}: policy_kwargs.lr_schedule is made by {algo.name} from learning_rate; set that")
    if policy == "auto" or not kwargs:
        return
    policy_class = algo.model_class.policy_aliases.get(policy)
    if policy_class is None:  # pragma: no cover - POLICIES lists only aliases every algorithm has
        raise ConfigError(f"{where}: {algo.name} has no policy {policy!r}")
    accepted = set(inspect.signature(policy_class.__init__).parameters) - {"self", "observation_space", "action_space"}
    valid = accepted - {*_OWN_KEYS, "lr_schedule"}
    own_keys = set(_OWN_KEYS) & accepted
    for key in kwargs:
        match = difflib.get_close_matches(str(key), [*valid, *own_keys], n=1, cutoff=0.6)
        if key not in valid and match and match[0] in own_keys:  # net_arc: net_arch, a preset key of its own
            own = closest(str(key), [match[0]])
            raise ConfigError(
                f"{where}: policy_kwargs of {policy}: unknown key {key!r}{own} It is a preset key of its own: set it "
                f"without policy_kwargs (valid in policy_kwargs: {', '.join(sorted(valid))})"
            )
    c.check_keys(kwargs, valid, f"{where}: policy_kwargs of {policy}")
    try:
        hints = typing.get_type_hints(policy_class.__init__)
    except Exception:  # pragma: no cover - an annotation that does not resolve: SB3 checks the values itself
        return
    for key, value in kwargs.items():
        if key in hints and (wanted := _mismatch(value, hints[key])):
            raise ConfigError(f"{where}: policy_kwargs.{key} must be {wanted}, got {value!r}")
    chosen = inspect.signature(policy_class.__init__).parameters.get("optimizer_class")
    if kwargs.get("optimizer_kwargs") and chosen is not None:  # tried on one parameter: the optimizer's own refusal
        import torch as th

        if "lr" in kwargs["optimizer_kwargs"]:
            raise ConfigError(f"{where}: policy_kwargs.optimizer_kwargs.lr comes from {algo.name}'s learning_rate; set that")
        optimizer = kwargs.get("optimizer_class", chosen.default)
        arguments = inspect.signature(optimizer.__init__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in arguments.values()):  # a typo gets a suggestion, not a TypeError
            c.check_keys(
                kwargs["optimizer_kwargs"],
                set(arguments) - {"self", "params", "lr"},
                f"{where}: policy_kwargs.optimizer_kwargs of {optimizer.__name__}",
            )
        try:
            optimizer([th.zeros(1, requires_grad=True)], **{"lr": 1e-3, **kwargs["optimizer_kwargs"]})
        except (TypeError, ValueError, KeyError, IndexError) as e:
            raise ConfigError(
                f"{where}: policy_kwargs.optimizer_kwargs {kwargs['optimizer_kwargs']!r}: {optimizer.__name__} refused "
                f"them ({type(e).__name__}: {e})"
            ) from None


def _mismatch(value: Any, hint: Any) -> str:
    """What ``hint`` wants, where YAML data ``value`` does not fit it ("" where it fits, or the hint is no plain type).

    A class (``optimizer_class``, ``features_extractor_class``) fits only as one, given in Python: a preset file's
    text never names code to run."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        wants = [_mismatch(value, h) for h in typing.get_args(hint)]
        return "" if "" in wants else " or ".join(wants)
    plain = {type(None): ("null", lambda v: v is None), bool: ("true or false", lambda v: isinstance(v, bool))}
    plain |= {int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))}
    plain |= {float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))}
    plain |= {dict: ("a mapping", lambda v: isinstance(v, Mapping)), list: ("a list", lambda v: isinstance(v, list))}
    if origin is type:
        if not inspect.isclass(value):
            return "a class, passed in Python (a preset file cannot name code to run)"
        base = (typing.get_args(hint) or (object,))[0]
        return "" if not inspect.isclass(base) or issubclass(value, base) else f"a subclass of {base.__name__}"
    what, fits = plain.get(origin or hint, ("", lambda v: True))
    return "" if fits(value) else what


# Mappings of options, which a profile's own mapping adds to key by key (a schedule mapping it replaces whole).
_OPTION_MAPPINGS = ("policy_kwargs", "env_kwargs", "normalize", "per")


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
            if key in PROFILES:
                continue
            shared = values.get(key) if sources.get(key) == entry_label else None
            source = label
            if key in _OPTION_MAPPINGS and isinstance(shared, Mapping) and isinstance(value, Mapping):
                value, source = {**shared, **value}, f"{entry_label} and {label}"  # as --set adds to them
            values[key], sources[key] = value, source
    raw: dict[str, Any] = {}
    given: dict[str, list[str]] = {}  # each key's override sources, in order
    # Named as the user gave them: the CLI's --set, or make_plan's overrides.
    labels = {source for _, source in overrides.values()}
    given_as = next((label for label in ("--set", "search space") if label in labels), "overrides")
    # A whole mapping first, then the dotted keys that refine it, whatever order they came in (true, as --per gives,
    # takes the preset's mapping); a value given by both, or a whole that is no mapping, is refused (which should win
    # would be a guess).
    for key, (value, source) in sorted(overrides.items(), key=lambda item: "." in item[0]):
        head, dot, inner = key.partition(".")
        if dot and head in _OPTION_MAPPINGS and head in overrides:
            whole = overrides[head][0]
            if isinstance(whole, Mapping) and inner in whole:
                raise ConfigError(f"{given_as}: {head} gives {inner}={whole[inner]!r} and {key} gives {value!r}; give one")
            if not isinstance(whole, Mapping) and whole is not True:
                raise ConfigError(f"{given_as}: {head}={whole!r} and {key}={value!r} both set {head}; give one")
        apply_override(raw, key, value)
        given.setdefault(head, []).extend([source] if source not in given.get(head, ()) else [])
    for key, named in given.items():
        if isinstance(raw.get(key), dict) and isinstance(values.get(key), Mapping) and set(values[key]) - set(raw[key]):
            named = [sources[key], *named]  # the preset's own options stay beside the given ones
        sources[key] = " and ".join(named)
    for key in raw:
        if isinstance(raw[key], dict) and isinstance(values.get(key), Mapping):
            raw[key] = {**values[key], **raw[key]}
        elif key == "per" and raw[key] is True and isinstance(values.get(key), Mapping):
            raw[key] = values[key]  # --per switches the preset's own PER settings on, not the defaults
    values.update(validate_flat(algo, raw, given_as))
    if values["normalize"] == {}:  # no options: VecNormalize with its defaults, as rl-zoo3 reads `normalize: "{}"`
        values["normalize"] = True
    check_policy_kwargs(algo, values["policy"], values["policy_kwargs"], sources.get("policy_kwargs", entry_label))
    params = algo.params_class(**{f.name: values[f.name] for f in dataclasses.fields(algo.params_class)})
    common = {k: values[k] for k in COMMON_KEYS}
    return Preset(algo=algo.name, entry=entry_label, profile=profile, params=params, sources=sources, **common)
