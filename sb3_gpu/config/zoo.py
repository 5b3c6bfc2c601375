"""rl-zoo3 hyperparameter files as presets (``--preset zoo:ppo`` or ``--preset zoo:PATH.yml``), read without ``eval``.

rl-zoo3 writes some values as Python source that it passes to ``eval``: ``policy_kwargs: "dict(net_arch=[64, 64],
activation_fn=nn.Tanh)"``, ``normalize: "{'norm_obs': True}"``, ``learning_rate: lin_2.5e-4``. Here such a string is
parsed (``ast.parse``, which runs nothing) and walked by a small grammar of the literal forms those files use:
numbers, strings, booleans, None, lists, tuples, ``{...}`` and ``dict(key=...)``, and ``nn.<activation>`` names. Any
other form (a call, a name, an import) is refused in one line naming the file, the entry, the key and the text. Each
converted entry then goes through the same checks as a bundled preset.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sb3_gpu.common.checks import OTHER_ALGO_NAMES
from sb3_gpu.common.errors import ConfigError, closest, install_hint
from sb3_gpu.config.files import read_yaml
from sb3_gpu.config.schema import ACTIVATIONS, Algo, validate_entry
from sb3_gpu.envs.spec import looks_atari

ZOO_ALGOS = ("ppo", "dqn", "qrdqn", "sac", "td3", "tqc")  # the rl-zoo3 files whose algorithms sb3_gpu trains
MAX_SOURCE_CHARS = 2000  # a policy_kwargs string is a line or two; anything longer is not a literal worth parsing

# nn.<Name> (also th.nn.<Name>, torch.nn.<Name>) -> the activation_fn name of a preset.
_ACTIVATION_NAMES = {cls.__name__: name for name, cls in ACTIVATIONS.items()}
# The env wrappers that sb3_gpu applies itself, and where: SB3's AtariWrapper, with its defaults, to Atari games.
_ATARI_WRAPPER = "stable_baselines3.common.atari_wrappers.AtariWrapper"
# Keys that change what runs (classes, callbacks, wrappers of the vec env) and that a preset cannot express.
_UNSUPPORTED_KEYS = {
    "callback": "callbacks named by import path are not run",
    "vec_env_wrapper": "vec env wrappers named by import path are not run",
    "replay_buffer_class": "replay buffer classes named by import path are not run",
    "replay_buffer_kwargs": "replay buffer arguments are set by sb3_gpu (per, device_buffers)",
    "normalize_kwargs": "use normalize: {norm_obs: ..., norm_reward: ...}",
    "monitor_kwargs": "sb3_gpu sets up its own Monitor",
}
_SCHEDULE = re.compile(r"^(?:lin|linear)_([-+0-9.eE]+)$")


class _Activation(str):
    """An ``nn.<Name>`` reference read from a string: the preset's activation name."""


def zoo_file(spec: str) -> Path:
    """The file named by ``zoo:<spec>``: ``ppo``, ``dqn``, ``qrdqn``, ``sac``, ``td3``, ``tqc`` (an installed
    rl_zoo3's own) or a path."""
    if spec.lower().replace("-", "_") in OTHER_ALGO_NAMES and not Path(spec).is_file():
        raise ConfigError(f"zoo:{spec}: sb3_gpu trains {', '.join(ZOO_ALGOS)}; there is no preset for {spec}")
    if spec in ZOO_ALGOS:
        found = importlib.util.find_spec("rl_zoo3")
        if found is None or not found.submodule_search_locations:
            raise ConfigError(f"zoo:{spec} reads an installed rl_zoo3's files: {install_hint('zoo')} (or give zoo:PATH.yml)")
        return Path(next(iter(found.submodule_search_locations))) / "hyperparams" / f"{spec}.yml"
    path = Path(spec)
    if not path.is_file():
        named = spec.partition(":")[0].removesuffix(".yml").removesuffix(".yaml").lower()
        hint = (  # zoo:dqn.yml or zoo:dqn:CartPole-v1, as rl-zoo3 names its files and entries
            f"; did you mean zoo:{named}? (the entry is the one for --env)"
            if named in ZOO_ALGOS
            else closest(spec.lower(), ZOO_ALGOS)
        )
        raise ConfigError(
            f"zoo:{spec} is neither an algorithm's rl-zoo3 file nor a readable file; accepted: "
            f"{', '.join(f'zoo:{a}' for a in ZOO_ALGOS)} or zoo:PATH.yml{hint}"
        )
    return path


class ZooEntries(Mapping[str, dict[str, Any]]):
    """An rl-zoo3 file's entries, each converted and validated when first read: one entry the project cannot express
    (an env wrapper, say) fails only a run that picks it."""

    def __init__(self, algo: Algo, raw: Mapping[str, Any], file: str):
        self._algo, self._raw, self._file = algo, {str(k): v for k, v in raw.items()}, file
        self._done: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self._done:
            self._done[name] = convert_entry(self._algo, name, self._raw[name], self._file)
        return self._done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def load_zoo_file(algo: Algo, spec: str) -> tuple[ZooEntries, str]:
    """The entries of an rl-zoo3 file for ``algo`` (converted when read) and the file's label (``zoo:ppo.yml``)."""
    if spec in ZOO_ALGOS and spec != algo.name:
        raise ConfigError(f"zoo:{spec} holds rl-zoo3's values for {spec}; this run trains {algo.name} (zoo:{algo.name})")
    path = zoo_file(spec)
    data = read_yaml(path, "rl-zoo3 hyperparameter file")
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{path}: an rl-zoo3 file must be a mapping of env ids to hyperparameters")
    return ZooEntries(algo, data, str(path)), f"zoo:{path.name}"


def convert_entry(algo: Algo, name: str, entry: Any, file: str) -> dict[str, Any]:
    """One rl-zoo3 entry as a validated sb3_gpu entry; refuses what it cannot express, naming file, entry and key."""
    where = f"{file}, entry {name}"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping of hyperparameters, got {type(entry).__name__}")
    out: dict[str, Any] = {}
    noise: dict[str, Any] = {}
    for key, value in entry.items():
        at = f"{where}, key {key}"
        if key in ("noise_type", "noise_std"):
            noise[key] = value
        elif key in _UNSUPPORTED_KEYS:
            raise ConfigError(f"{at}: not supported ({_UNSUPPORTED_KEYS[key]}): {_short(value)}")
        elif key == "env_wrapper":
            _check_wrappers(value, name, at)
        elif key == "policy_kwargs":
            kwargs = _read(value, at) if isinstance(value, str) else value
            if not isinstance(kwargs, dict):
                raise ConfigError(f"{at}: expected dict(...), got {_short(value)}")
            out.update(_policy_kwargs(kwargs, at))
        elif key == "normalize":
            out["normalize"] = _plain(_read(value, at) if isinstance(value, str) else value, at)
        elif key == "n_timesteps" and isinstance(value, float) and value.is_integer():
            out[key] = int(value)  # rl-zoo3 writes !!float 1e6
        elif isinstance(value, str) and (match := _SCHEDULE.match(value)):
            out[key] = {"schedule": "linear", "start": _number(match.group(1), at), "end": 0.0}
        else:
            out[key] = value
    if "noise_type" in noise:  # rl-zoo3 adds action noise only where a type is named
        if noise["noise_type"] != "normal":
            raise ConfigError(f"{where}, key noise_type: only 'normal' is supported, got {_short(noise['noise_type'])}")
        out["action_noise_std"] = noise.get("noise_std", 0.0)
    return validate_entry(algo, out, where)


def _check_wrappers(value: Any, entry: str, where: str) -> None:
    wrappers = value if isinstance(value, list) else [value]
    for wrapper in wrappers:
        name, kwargs = next(iter(wrapper.items())) if isinstance(wrapper, Mapping) and len(wrapper) == 1 else (wrapper, {})
        if name != _ATARI_WRAPPER:
            raise ConfigError(f"{where}: env wrapper {_short(name)} is not supported (sb3_gpu applies only AtariWrapper)")
        if kwargs:
            raise ConfigError(f"{where}: AtariWrapper arguments {_short(kwargs)} are not supported (its defaults are used)")
        if entry != "atari" and not looks_atari(entry):
            raise ConfigError(f"{where}: AtariWrapper on {entry}, which is not an Atari game")
        # Nothing to store: sb3_gpu wraps every Atari game in AtariWrapper with its defaults.


def _policy_kwargs(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """``net_arch`` and ``activation_fn`` become the preset's own keys; the rest stays in ``policy_kwargs``."""
    out: dict[str, Any] = {}
    rest = dict(kwargs)
    if "activation_fn" in rest:
        activation = rest.pop("activation_fn")
        if not isinstance(activation, _Activation):
            raise ConfigError(f"{where}: activation_fn must be one of nn.{', nn.'.join(_ACTIVATION_NAMES)}")
        out["activation_fn"] = str(activation)
    if "net_arch" in rest:
        arch = rest.pop("net_arch")
        # SB3 < 1.8 wrote shared and separate layers as [dict(pi=[...], vf=[...])]; one dict means the same now.
        if isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], dict):
            arch = arch[0]
        out["net_arch"] = arch
    out["policy_kwargs"] = _plain(rest, where)
    return out


def _plain(value: Any, where: str) -> Any:
    """``value`` as YAML data: an ``nn.*`` name outside ``activation_fn`` has no meaning in a preset."""
    if isinstance(value, _Activation):
        raise ConfigError(f"{where}: an nn activation ({value}) is accepted only as policy_kwargs' activation_fn")
    if isinstance(value, dict):
        return {k: _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    return value


def _read(text: str, where: str) -> Any:
    """A Python literal as rl-zoo3 writes it, parsed by the grammar above; never evaluated."""
    if len(text) > MAX_SOURCE_CHARS:
        raise ConfigError(f"{where}: cannot read a string of {len(text):,} characters (at most {MAX_SOURCE_CHARS:,})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
        return _literal(tree.body, text, where)
    except SyntaxError as e:
        raise ConfigError(f"{where}: cannot read {_short(text)}: not a Python literal ({e.msg})") from None
    except ConfigError:  # _literal's own, which names the place already (a ValueError too)
        raise
    except ValueError as e:  # a NUL character, say
        raise ConfigError(f"{where}: cannot read {_short(text)}: {e}") from None
    except (RecursionError, MemoryError):
        raise ConfigError(f"{where}: cannot read {_short(text)}: nested too deeply") from None


def _literal(node: ast.AST, text: str, where: str) -> Any:
    def refuse(what: str) -> ConfigError:
        return ConfigError(
            f"{where}: cannot read {_short(text)}: {what} is not accepted (only literals, lists, dicts, dict(...) and "
            f"nn.<activation>)"
        )

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = walk(node.operand)
            if isinstance(operand, (int, float)) and not isinstance(operand, bool):
                return -operand if isinstance(node.op, ast.USub) else operand
        elif isinstance(node, (ast.List, ast.Tuple)):
            return [walk(item) for item in node.elts]
        elif isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise refuse("** unpacking")
            keys = [walk(k) for k in node.keys if k is not None]
            if not all(isinstance(k, str) for k in keys):
                raise refuse("a dict key that is not a string")
            return dict(zip(keys, (walk(v) for v in node.values), strict=True))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            if node.args or any(kw.arg is None for kw in node.keywords):
                raise refuse("dict() with positional or ** arguments")
            return {str(kw.arg): walk(kw.value) for kw in node.keywords}
        elif isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if dotted.rpartition(".")[0] in ("nn", "th.nn", "torch.nn"):
                if node.attr in _ACTIVATION_NAMES:
                    return _Activation(_ACTIVATION_NAMES[node.attr])
                raise refuse(f"{dotted}, not an activation (nn.{', nn.'.join(_ACTIVATION_NAMES)}),")
            raise refuse(f"the name {dotted}")
        raise refuse(f"{type(node).__name__.lower()} {ast.unparse(node)[:60]!r}")

    return walk(node)


def _number(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{where}: cannot read the schedule's value {text!r}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
