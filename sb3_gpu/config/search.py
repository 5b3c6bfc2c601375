"""Search spaces for tuning: preset keys mapped to ``{low, high[, log]}`` or ``{choices: [...]}``, checked like presets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sb3_gpu.common.checks import yaml_number
from sb3_gpu.common.errors import ConfigError, closest
from sb3_gpu.config.files import presets_dir, read_yaml
from sb3_gpu.config.presets import apply_override, check_policy_kwargs
from sb3_gpu.config.schema import check_key_names, get_algo, validate_flat

SPEC_KEYS = ("low", "high", "log", "choices")


def load_space(algo: str, path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Read and check a search space: every key a preset key, every bound and choice a valid value for it."""
    algo_ = get_algo(algo)
    path = Path(path) if path is not None else presets_dir() / "search" / f"{algo_.name}.yaml"
    data = read_yaml(path, "search space")
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{path}: a search space must be a mapping of preset keys to {{low, high}} or {{choices}}")
    # A misspelt key named as such, whatever its spec; n_timesteps is a key, but not one to search (below).
    check_key_names(algo_, [str(key) for key in data], str(path), excluded=("n_timesteps",))
    if "n_timesteps" in data:  # every trial trains tune's --timesteps, whatever a preset key says
        raise ConfigError(f"{path}: n_timesteps cannot be searched: each trial trains --timesteps (tune's budget per seed)")
    for key in data:  # each trial's plan would refuse the pair (a mapping and its own key): refused once, here
        head, _, inner = str(key).partition(".")
        if inner and isinstance(data.get(head), dict):
            choices = data[head].get("choices")
            if isinstance(choices, list) and any(isinstance(c, dict) and inner in c for c in choices):
                raise ConfigError(f"{path}: {key} and a choice of {head} both set {key}; search it in one place")
    space: dict[str, dict[str, Any]] = {}
    for key, spec in data.items():
        where = f"{path}, key {key}"
        if isinstance(spec, dict):
            spec = _numbers_read(spec)
        for value in _candidates(spec, where):  # the preset checks say whether the key exists and the value fits
            _check(algo_, str(key), value, path)
        space[str(key)] = spec if "choices" in spec else _typed_range(algo_, str(key), spec, path)
    return space


def check_policy_kwargs_space(algo: str, policy: str, space: dict[str, dict[str, Any]], where: str) -> None:
    """Check a space's ``policy_kwargs.*`` keys and their edge values against the policy the plan chose, before any
    trial: a misspelt one would otherwise fail every trial of the study. (Loading cannot: the policy is the plan's.)"""
    for key, spec in space.items():
        if key.startswith("policy_kwargs."):
            for value in _candidates(spec, f"{where}, key {key}"):
                flat: dict[str, Any] = {}
                apply_override(flat, key, value)
                check_policy_kwargs(get_algo(algo), policy, flat["policy_kwargs"], f"{where}, key {key}")


def _numbers_read(spec: dict[str, Any]) -> dict[str, Any]:
    """Bounds and choices written ``1e-5`` or ``2e3``, which YAML reads as strings, as the numbers they spell (as presets
    read them): a whole one as an int, as YAML reads ``2000``."""

    def number(value: Any) -> Any:
        read = yaml_number(value)
        if read is not value and "." not in value and read.is_integer():
            return int(read)
        return read

    read = {name: number(v) if name in ("low", "high") else v for name, v in spec.items()}
    if isinstance(read.get("choices"), list):
        read["choices"] = [number(v) for v in read["choices"]]
    return read


def _check(algo: Any, key: str, value: Any, path: Path) -> None:
    flat: dict[str, Any] = {}
    apply_override(flat, key, value)
    validate_flat(algo, flat, f"{path}")


def _typed_range(algo: Any, key: str, spec: dict[str, Any], path: Path) -> dict[str, Any]:
    """The range with bounds of the key's type, which is what the sampler goes by: ints draw whole numbers.

    How the bounds are written must not decide it: ``high: 1.0e+6`` for a buffer size would draw fractions that every
    trial's preset check refuses, and ``{low: 0, high: 1}`` for a coefficient would draw only 0 and 1. The key's own
    check decides: a value between the bounds that is not a whole number either fits it or not. Keys passed on
    unchecked (``policy_kwargs.*``, ``env_kwargs.*``: their classes take what they take) go by how the bounds are
    written, ints drawing ints.
    """
    low, high = spec["low"], spec["high"]
    if _accepts(algo, key, "not a number", path):
        whole = isinstance(low, int) and isinstance(high, int)
    else:
        fraction = low / 2 + high / 2
        if float(fraction).is_integer():
            fraction += min(0.25, (high - low) / 4)
        whole = not _accepts(algo, key, fraction, path)  # then its check took the bounds, so they are whole
    return {**spec, "low": int(low), "high": int(high)} if whole else {**spec, "low": float(low), "high": float(high)}


def _accepts(algo: Any, key: str, value: Any, path: Path) -> bool:
    try:
        _check(algo, key, value, path)
    except ConfigError:
        return False
    return True


def _candidates(spec: Any, where: str) -> list[Any]:
    """The values a key's spec can take at its edges: its choices, or its low and high bounds."""
    if not isinstance(spec, dict) or not spec or not set(spec) <= set(SPEC_KEYS):
        bad = sorted(set(spec) - set(SPEC_KEYS)) if isinstance(spec, dict) else []
        hint = closest(bad[0], SPEC_KEYS) if bad else ""
        raise ConfigError(f"{where}: expected {{low, high[, log]}} or {{choices: [...]}}, got {spec!r}{hint}")
    if "choices" in spec:
        if set(spec) != {"choices"} or not isinstance(spec["choices"], list) or not spec["choices"]:
            raise ConfigError(f"{where}: 'choices' must be a non-empty list and stand alone")
        return list(spec["choices"])
    bounds = [spec.get("low"), spec.get("high")]
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bounds):
        raise ConfigError(f"{where}: a range needs finite numbers for 'low' and 'high', got {bounds[0]!r} and {bounds[1]!r}")
    if not isinstance(spec.get("log", False), bool):
        raise ConfigError(f"{where}: 'log' is true or false, got {spec['log']!r}")
    if spec["low"] >= spec["high"] or (spec.get("log") and spec["low"] <= 0):
        raise ConfigError(f"{where}: need low < high (and low > 0 with log: true)")
    return [spec["low"], spec["high"]]


def fit_to_budget(
    space: dict[str, dict[str, Any]],
    timesteps: int,
    n_envs: int,
    on_policy: bool,
    learning_starts: int | None = None,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The space without values that cannot fit a trial of ``timesteps``, and a note for each key it narrowed.

    A rollout (``n_steps`` or ``train_freq`` times ``n_envs``, the largest ``n_envs`` of the space where it is
    searched) must fit the budget, ``learning_starts`` must leave at least half of it for learning, a target network
    (``target_update_interval``) must be synced at least twice in it, and buffer sizes
    beyond it behave alike (nothing is ever evicted), so only the smallest of those is kept. The preset's own
    ``learning_starts``, where the space leaves it fixed, is refused if no trial could take a gradient step with it,
    and noted if it leaves less than half.
    """
    fixed_note = _fixed_learning_starts(learning_starts, timesteps) if "learning_starts" not in space else []
    envs = int(max(_numbers(space["n_envs"]), default=n_envs)) if "n_envs" in space else n_envs
    limits = {
        "n_steps" if on_policy else "train_freq": (timesteps // envs, f"a rollout of {envs} envs would outrun"),
        "learning_starts": (timesteps // 2, "it would leave less than half of"),
    }
    if not on_policy:  # a target network synced at most once in a trial learns from its first weights throughout
        limits["target_update_interval"] = (timesteps // 2, "the target network would be synced less than twice in")
    fitted, notes = dict(space), []
    for key, (limit, why) in limits.items():
        if key in space:
            fitted[key], dropped = _capped(space[key], limit, key, timesteps)
            if dropped:
                notes.append(f"{key}: {dropped} left out ({why} the {timesteps:,}-step budget)")
    if "buffer_size" in space:
        fitted["buffer_size"], dropped = _capped(space["buffer_size"], timesteps, "buffer_size", timesteps, keep_next=True)
        if dropped:
            notes.append(f"buffer_size: {dropped} left out (larger than the {timesteps:,}-step budget, like the size kept)")
    return fitted, notes + fixed_note


def _fixed_learning_starts(value: int | None, timesteps: int) -> list[str]:
    fix = "raise --timesteps, or search learning_starts (--space)"
    if value is not None and value >= timesteps:
        raise ConfigError(
            f"the preset's learning_starts ({value:,}) is not below the {timesteps:,}-step trials: no trial would take "
            f"a gradient step; {fix}"
        )
    if value is not None and value > timesteps // 2:
        return [
            f"learning_starts: the preset's {value:,} leaves under half of the {timesteps:,}-step budget to learn in; {fix}"
        ]
    return []


def _numbers(spec: dict[str, Any]) -> list[int | float]:
    values = spec["choices"] if "choices" in spec else [spec["low"], spec["high"]]
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _capped(spec: dict[str, Any], limit: int, key: str, timesteps: int, keep_next: bool = False) -> tuple[dict[str, Any], str]:
    """``spec`` without the values above ``limit`` (with ``keep_next``, the smallest of them, or of a range the limit
    itself, stays), and which went."""
    if "choices" in spec:
        choices = spec["choices"]
        above = sorted(c for c in _numbers(spec) if c > limit)
        drop = set(above[1:] if keep_next else above)
        kept = [c for c in choices if c not in drop]
        if not kept:
            raise ConfigError(
                f"search space key {key}: every choice ({', '.join(map(str, choices))}) is too large for trials of "
                f"{timesteps:,} timesteps; train longer (--timesteps) or give smaller choices"
            )
        return {"choices": kept}, ", ".join(str(c) for c in choices if c in drop)
    if spec["high"] <= limit:
        return spec, ""
    if keep_next:  # a range keeps the least of the values above the limit: the limit, or its low beyond it
        high = max(spec["low"], limit)
        return {**spec, "high": high}, f"values above {high:,}" if high < spec["high"] else ""
    if spec["low"] > limit:
        raise ConfigError(
            f"search space key {key}: its range starts at {spec['low']}, too large for trials of {timesteps:,} "
            "timesteps; train longer (--timesteps) or lower 'low'"
        )
    return {**spec, "high": limit}, f"values above {limit:,}"
