"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.common.errors import ConfigError


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to a temp file beside ``path``, fsync it, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def write_yaml(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))


def write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def save_pickle(path: str | Path, obj: Any) -> Path:
    """Pickle ``obj`` (VecNormalize statistics, a replay buffer) with one atomic write."""
    return atomic_write_bytes(path, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def load_pickle(path: str | Path, allowed: Mapping[str, Collection[str]], what: str) -> Any:
    """Unpickle ``path``, refusing every class or function that ``allowed`` (module -> names) does not list.

    Unpickling calls whatever the file names, so a file from elsewhere could run any code; this runs only the
    constructors of the data types listed.
    """

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if name not in allowed.get(module, ()):
                raise ConfigError(
                    f"{path} names {module}.{name}, which no {what} holds; sb3_gpu does not unpickle it (it could run code)"
                )
            return super().find_class(module, name)

    try:
        with open(path, "rb") as f:
            return Restricted(f).load()
    except ConfigError:
        raise
    except Exception as e:  # a truncated or foreign file fails in many ways
        raise ConfigError(f"{path} is not a readable {what} ({type(e).__name__}: {e})") from None


def save_model(model: BaseAlgorithm, path: str | Path) -> Path:
    """``model.save`` into memory, then one atomic write (SB3 itself writes the zip in place)."""
    buffer = io.BytesIO()
    model.save(buffer)
    return atomic_write_bytes(path, buffer.getvalue())
