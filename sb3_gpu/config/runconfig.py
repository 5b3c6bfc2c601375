"""A run's ``config.yaml`` read back: the arguments and pinned hyperparameters that ``--config`` and ``--resume`` use."""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sb3_gpu.common.checks import check_keys
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.config.files import read_yaml
from sb3_gpu.config.schema import get_algo, validate_flat

# The layout of config.yaml that this version writes and reads; a newer one is refused rather than misread.
CONFIG_VERSION = 1
CONFIG_KEYS = ("version", "algo", "env", "device", "vec_env", "seed", "hyperparameters", "resolved", "run")


@dataclass(frozen=True)
class RunConfig:
    """A ``config.yaml`` read back: the run's arguments and its pinned hyperparameters."""

    algo: str
    env: str
    device: str
    vec_env: str
    seed: int | None
    hyperparameters: dict[str, Any]
    path: str
    # How the run evaluates and saves (see ``runs.training.RunOptions``); checked where it is used.
    run: dict[str, Any] = field(default_factory=dict)
    # Where each hyperparameter first came from (the preset, --set, a default), as the run's plan recorded it: a
    # resumed or replayed run keeps naming those, not this file.
    sources: dict[str, str] = field(default_factory=dict)
    # The run trained on a factory given in Python: ``env`` is only its name.
    env_factory: bool = False


def config_env(config: RunConfig, env: Any, how: str, confirm: str) -> Any:
    """``env`` where given, else what the config names; a factory's name is refused, saying ``how`` to go on.

    A ``package.module:EnvClass`` name whose module (or a package above it) lies inside the config's own folder is
    refused too: importing a module runs its code, and a run dir handed over must not bring code for sb3_gpu to run.
    ``confirm`` says how to give the name again (``{env}`` in it is filled in): the user who gives it asks for that
    import. Modules found elsewhere (installed, or the user's own beside the run) are imported as named."""
    if env is not None:
        return env
    if config.env_factory:
        raise ConfigError(
            f"{config.path}: the run trained on an env factory given in Python ({config.env}), which a config file "
            f"cannot rebuild; {how}"
        )
    # The folder the file is in, and the one it leads to where it is a link: a link must not move the check elsewhere.
    config_path = Path(os.path.abspath(config.path))
    folders = dict.fromkeys((config_path.parent.resolve(), config_path.resolve().parent))
    for folder in folders:
        shipped = _found_inside(config.env.partition(":")[0], folder) if ":" in config.env else None
        if shipped is not None:
            raise ConfigError(
                f"{config.path} names the env {config.env!r}, whose module {shipped!r} lies inside {folder}: importing "
                "it would run code that came with the config's folder (a run dir handed over, say); to confirm, give it "
                "again: " + confirm.format(env=config.env)
            )
    return config.env


def _installed_places() -> list[Path]:
    """The folders this Python's packages and standard library are installed in (a virtual environment inside a
    project holding configs, say); not its prefix (``/usr`` holds far more than packages)."""
    paths = sysconfig.get_paths()
    places = {*site.getsitepackages(), site.getusersitepackages(), *(paths.get(k) for k in _LIBRARY_PATHS)}
    resolved = {Path(place).resolve() for place in places if place}
    return [place for place in resolved if place != Path(place.anchor)]  # never the whole file system


_LIBRARY_PATHS = ("stdlib", "platstdlib", "purelib", "platlib")


def _found_inside(module: str, folder: Path) -> str | None:
    """The first package or module of dotted ``module`` that lies inside ``folder`` (and not among this Python's
    installed packages), found without running its code (each step imports only the package above it, already found
    outside); None where none does or it is not found."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        loaded = sys.modules.get(name)
        if loaded is not None:
            places = [getattr(loaded, "__file__", None), *getattr(loaded, "__path__", [])]
        else:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):  # the import fails anyway: resolve_env says so in one line
                return None
            if spec is None:
                return None
            places = [spec.origin, *(spec.submodule_search_locations or [])]
        for place in places:
            if not place or not Path(place).is_absolute():
                continue
            where = Path(place).resolve()
            if where.is_relative_to(folder) and not any(where.is_relative_to(p) for p in _installed_places()):
                return name
    return None


def load_config(path: str | Path) -> RunConfig:
    """Read a run's ``config.yaml`` (a run dir is accepted too)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.yaml"
    data = read_yaml(path, "config file")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a config file must be a mapping, as written by sb3_gpu.train")
    check_keys(data, set(CONFIG_KEYS), str(path))
    missing = {"algo", "env", "hyperparameters"} - set(data)
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(sorted(missing))}")
    version = data.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION or isinstance(version, bool):  # True == 1
        raise ConfigError(f"{path}: config version {version!r}; this sb3_gpu reads version {CONFIG_VERSION}")
    try:
        algo = get_algo(str(data["algo"]))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    hyper = validate_flat(algo, data["hyperparameters"], f"{path}: hyperparameters")
    written_per = data["hyperparameters"].get("per") if isinstance(data["hyperparameters"], Mapping) else None
    if isinstance(written_per, Mapping) and "normalize" not in written_per and isinstance(hyper.get("per"), Mapping):
        # Written before PER's weights could be normalised by the batch: those runs normalised by the buffer, and a
        # resumed or repeated run goes on as it began.
        hyper["per"] = {**hyper["per"], "normalize": "buffer"}
    if hyper.get("normalize") == {}:
        # Written before an empty mapping meant VecNormalize with its defaults (a run writes that as true now): such
        # runs trained without it, and a resumed or repeated run goes on as it began.
        hyper["normalize"] = False
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise ConfigError(f"{path}: seed must be an integer in [0, 2**32) or null, got {seed!r}")
    run = data.get("run") or {}
    if not isinstance(run, Mapping):
        raise ConfigError(f"{path}: run must be a mapping, got {run!r}")
    resolved = data.get("resolved")
    recorded = resolved.get("sources") if isinstance(resolved, Mapping) else None
    sources = {k: v for k, v in recorded.items() if k in hyper and isinstance(v, str)} if isinstance(recorded, Mapping) else {}
    run = dict(run)
    if run.get("eval_freq") is not None:
        # The interval the run evaluated by (train_run's eval_freq, or an old config's --eval-freq wins over the preset
        # key): the preset key from now on, for the CLI and the API alike.
        hyper.update(validate_flat(algo, {"eval_freq": run.pop("eval_freq")}, f"{path}: run"))
        sources["eval_freq"] = f"run.eval_freq, {path}"
    run.pop("eval_freq", None)
    return RunConfig(
        algo=algo.name,
        env=str(data["env"]),
        device=str(data.get("device", "auto")),
        vec_env=str(data.get("vec_env", "auto")),
        seed=seed,
        hyperparameters=hyper,
        path=str(path),
        run=run,
        sources=sources,
        env_factory=isinstance(resolved, Mapping) and resolved.get("env_factory") is True,
    )
