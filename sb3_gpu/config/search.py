"""Search spaces for tuning: preset keys mapped to ``{low, high[, log]}`` or ``{choices: [...]}``, checked like presets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sb3_gpu.common.errors import ConfigError, closest
from sb3_gpu.config.files import presets_dir, read_yaml
from sb3_gpu.config.presets import apply_override
from sb3_gpu.config.schema import get_algo, validate_flat

SPEC_KEYS = ("low", "high", "log", "choices")


def load_space(algo: str, path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Read and check a search space: every key a preset key, every bound and choice a valid value for it."""
    algo_ = get_algo(algo)
    path = Path(path) if path is not None else presets_dir() / "search" / f"{algo_.name}.yaml"
    data = read_yaml(path, "search space")
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{path}: a search space must be a mapping of preset keys to {{low, high}} or {{choices}}")
    for key, spec in data.items():
        where = f"{path}, key {key}"
        for value in _candidates(spec, where):  # the preset checks say whether the key exists and the value fits
            flat: dict[str, Any] = {}
            apply_override(flat, str(key), value)
            validate_flat(algo_, flat, f"{path}")
    return {str(k): v for k, v in data.items()}


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
    if not {"low", "high"} <= set(spec) or not all(isinstance(spec[b], (int, float)) for b in ("low", "high")):
        raise ConfigError(f"{where}: a range needs numeric 'low' and 'high'")
    if spec["low"] >= spec["high"] or (spec.get("log") and spec["low"] <= 0):
        raise ConfigError(f"{where}: need low < high (and low > 0 with log: true)")
    return [spec["low"], spec["high"]]
