"""Reading YAML that users write (presets, configs, search spaces): ``safe_load``'s loader only (keys given twice
refused), size and alias-bomb limits, and one-line errors."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from sb3_gpu.common.errors import ConfigError

MAX_YAML_BYTES = 1 << 20  # a preset is a page of text; refuse anything that could be a YAML bomb
MAX_YAML_VALUES = 100_000  # after alias expansion: the bundled presets hold a few hundred


class _DuplicateKeyError(yaml.MarkedYAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """``safe_load``'s loader, refusing a key given twice in one mapping (YAML forbids it; PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key of its own overrides, on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base loader refuses it
                continue
            if duplicate:
                raise _DuplicateKeyError(problem=f"key {key!r} given twice", problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def presets_dir() -> Path:
    """The bundled presets: inside the installed package, or the repo's top-level ``presets/`` in a source checkout."""
    packaged = Path(str(resources.files("sb3_gpu"))) / "presets"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "presets"


def read_yaml(path: Path | str, what: str = "preset file") -> Any:
    """Read a YAML file with ``safe_load`` (no python tags), refusing files over 1 MiB."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{what}: expected a file path, got {path!r}")
    path = Path(path)
    try:
        with path.open("rb") as f:  # read up to the cap: a device (/dev/zero) or a pipe has no size to stat
            data = f.read(MAX_YAML_BYTES + 1)
        if len(data) > MAX_YAML_BYTES:
            raise ConfigError(f"{path}: {what} is larger than {MAX_YAML_BYTES // 1024} KiB")
        text = data.decode("utf-8")
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
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # safe_load with duplicate keys refused
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
