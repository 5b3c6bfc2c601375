"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import yaml
from stable_baselines3.common.base_class import BaseAlgorithm


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


def save_model(model: BaseAlgorithm, path: str | Path) -> Path:
    """``model.save`` into memory, then one atomic write (SB3 itself writes the zip in place)."""
    buffer = io.BytesIO()
    model.save(buffer)
    return atomic_write_bytes(path, buffer.getvalue())
