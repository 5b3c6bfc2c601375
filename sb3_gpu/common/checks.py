"""Value checks for preset keys and their domains, and the Schedule type. Each check takes (value, where) and returns
the normalised value or raises ConfigError naming ``where``."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sb3_gpu.common.errors import ConfigError, closest


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
        # Imported here: the CLIs read this module before their main starts, and SB3 pulls in torch.
        from stable_baselines3.common.utils import ConstantSchedule, LinearSchedule

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


Check = Callable[[Any, str], Any]
_NUMBER_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def yaml_number(value: Any) -> Any:
    """``value``, or the float a string such as ``"1e5"`` spells: PyYAML reads an exponent without a dot as a string,
    and users write numbers that way."""
    if isinstance(value, str) and _NUMBER_RE.match(value.strip()):
        return float(value)
    return value


def plain_number(value: Any) -> Any:
    """``value`` with a numpy scalar (from a grid or ``np.arange``, as SB3 takes them) as the Python int, float or bool."""
    if getattr(getattr(value, "dtype", None), "kind", None) == "b" and getattr(value, "shape", None) == ():
        return bool(value)  # numpy's bool: no numbers.Real, and no YAML either
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value) in (int, float):
        return value  # numpy's float64 is a float, but YAML's safe dumper writes only Python's own
    return int(value) if isinstance(value, numbers.Integral) else float(value)


_EXPONENT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def plain_numbers(value: Any) -> Any:
    """``value`` (a mapping's, list's or tuple's items too) with numpy scalars as Python numbers, and exponent strings such as
    ``"1e-5"``, which PyYAML reads as strings, as floats: for mappings passed on as given (``policy_kwargs``)."""
    if isinstance(value, Mapping):
        return {k: plain_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_numbers(v) for v in value]
    if type(value) is tuple:  # stays one (optimizer_kwargs' betas); a named tuple is left as it is
        return tuple(plain_numbers(v) for v in value)
    if isinstance(value, str) and _EXPONENT_RE.match(value.strip()):
        return float(value)
    return plain_number(value)


def _as_number(value: Any, where: str, what: str) -> float:
    value = plain_number(yaml_number(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        text = repr(value)
        raise ConfigError(f"{where}: expected {what}, got {text if len(text) <= 60 else text[:57] + '...'}")
    return value


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


# The algorithms and vec env kinds the CLIs accept, named here so that building a parser imports no torch or SB3.
ALGO_NAMES = ("ppo", "dqn", "qrdqn", "sac", "td3", "tqc")
CONTINUOUS_ALGOS = ("sac", "td3", "tqc")  # these need continuous (Box) actions
# SB3's and sb3-contrib's other algorithms (and rl-zoo3's names for them): asking for one is told that sb3_gpu does not
# train it, not "did you mean" a different algorithm (a2c is as close to sac as a typo).
OTHER_ALGO_NAMES = (
    "a2c", "ddpg", "her", "ars", "crossq", "trpo", "recurrentppo", "recurrent_ppo", "ppo_lstm", "maskableppo",
    "maskable_ppo", "ppo_mask",
)  # fmt: skip


def algo_name(name: Any) -> str:
    """The algorithm ``name`` names (case and spaces aside), or a ConfigError that says which are trained."""
    if not isinstance(name, str):
        raise ConfigError(f"the algorithm is a name ({', '.join(ALGO_NAMES)}); got {name!r}")
    key = name.strip().lower()
    if key in ALGO_NAMES:
        return key
    if key.replace("-", "_") in OTHER_ALGO_NAMES:
        raise ConfigError(
            f"sb3_gpu trains {', '.join(ALGO_NAMES)}; {name.strip()!r} is not one of them (train it with SB3 or "
            "sb3-contrib directly)"
        )
    raise ConfigError(f"unknown algorithm {name!r}{closest(key, ALGO_NAMES)} (valid: {', '.join(ALGO_NAMES)})")


def default_env(algo: str) -> str:
    """The env a CLI trains ``algo`` on when none is named: CartPole-v1, or Pendulum-v1 for continuous actions."""
    return "Pendulum-v1" if algo in CONTINUOUS_ALGOS else "CartPole-v1"


VEC_ENV_KINDS = ("auto", "dummy", "subproc", "batched", "envpool")

# Counts (timesteps, envs, episodes, buffer sizes) above this are typos: they would overflow numpy and torch later.
MAX_COUNT = 2**31 - 1


# --------------------------------------------------------------------------- Python API arguments
# Strict, unlike preset values (which YAML and --set give as text): a caller's "3" or 2.5 is a mistake to name.
def seed_arg(value: Any, name: str = "seed") -> int | None:
    """A seed argument: None, or an int from 0 to 2**32 - 1 (numpy's and gymnasium's range)."""
    if value is None:
        return None
    number = _whole(value)
    if number is None or not 0 <= number < 2**32:
        raise ConfigError(f"{name} must be an int from 0 to 2**32 - 1 or None, got {value!r}")
    return number


def count_arg(value: Any, name: str, low: int = 1, optional: bool = False) -> int | None:
    """A count argument: an int >= ``low`` (or None where ``optional``)."""
    if value is None and optional:
        return None
    number = _whole(value)
    if number is None or not low <= number <= MAX_COUNT:
        what = "a positive int" if low == 1 else f"an int >= {low}"
        if number is not None and number > MAX_COUNT:
            what += f" up to {MAX_COUNT:,}"
        raise ConfigError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")
    return number


def seconds_arg(value: Any, name: str) -> float | None:
    """A period in seconds: None, or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise ConfigError(f"{name} must be a number of seconds > 0 or None, got {value!r}")
    return float(value)


def duration_arg(value: Any, name: str, zero: bool = False) -> float:
    """A duration in seconds: a finite number > 0 (``zero``: >= 0)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or float(value) < 0
        or (float(value) == 0 and not zero)
    ):
        raise ConfigError(f"{name} must be a finite number of seconds {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


def _whole(value: Any) -> int | None:
    """An int (numpy's too) as a Python int; None for anything else, a bool or a float included."""
    return None if isinstance(value, bool) or not isinstance(value, numbers.Integral) else int(value)


def bool_arg(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def integer(low: int, what: str) -> Check:
    def check(value: Any, where: str) -> int:
        number = _as_number(value, where, what)
        if number != int(number) or number < low:
            raise ConfigError(f"{where}: expected {what}, got {value!r}")
        if number > MAX_COUNT:
            raise ConfigError(f"{where}: expected {what} up to {MAX_COUNT:,}, got {value!r}")
        return int(number)

    return check


def number(low: float, high: float, what: str, low_open: bool = False) -> Check:
    def check(value: Any, where: str) -> float:
        number = float(_as_number(value, where, what))
        if number < low or number > high or (low_open and number == low):
            raise ConfigError(f"{where}: expected {what}, got {value!r}")
        return number

    return check


def optional(inner: Check) -> Check:
    def check(value: Any, where: str) -> Any:
        if value is None:
            return None
        try:
            return inner(value, where)
        except ConfigError as e:
            if isinstance(value, (list, tuple, Mapping)):  # the message is about an item inside it
                raise
            # About the value itself: null is accepted too. A choice's message ends in its "(valid: ...)", a check's
            # reads "expected X, got V"; the value, which may hold either text, comes after X and before the list.
            said = str(e)
            head, valid, tail = said.rpartition("(valid: ")
            if valid and tail.endswith(")"):
                said = f"{head}(valid: null, {tail}"
            else:
                said = said.replace(", got ", " or null, got ", 1)
            raise ConfigError(said) from None

    return check


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def schedulable(inner: Check) -> Check:
    def check(value: Any, where: str) -> float | Schedule:
        if callable(value) and not isinstance(value, Schedule):  # SB3's own form, given from Python
            raise ConfigError(
                f"{where}: a function cannot be written to the run's config.yaml, so it cannot be resumed or replayed; "
                "give a number or a schedule, e.g. {'schedule': 'linear', 'start': 3e-4, 'end': 0.0}"
            )
        if not isinstance(value, Mapping):
            return inner(value, where)
        kind = value.get("schedule")
        if kind == "constant":
            check_keys(value, {"schedule", "value"}, where)
            return Schedule("constant", inner(value.get("value"), f"{where}.value"))
        if kind == "linear":
            check_keys(value, {"schedule", "start", "end", "end_fraction"}, where)
            if "start" not in value:
                raise ConfigError(f"{where}: a linear schedule needs 'start'")
            frac = number(0.0, 1.0, "a number in (0, 1]", low_open=True)(
                value.get("end_fraction", 1.0), f"{where}.end_fraction"
            )
            # The end of a decaying schedule may be 0 even where the value itself must be positive.
            end = NON_NEGATIVE(value.get("end", 0.0), f"{where}.end")
            return Schedule("linear", inner(value["start"], f"{where}.start"), float(end), frac)
        raise ConfigError(f"{where}: schedule must be 'linear' or 'constant', got {kind!r}")

    return check


def check_keys(mapping: Mapping[str, Any], valid: set[str], where: str) -> None:
    for key in mapping:
        if key not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}{closest(str(key), valid)} (valid: {', '.join(sorted(valid))})")


def net_arch(value: Any, where: str) -> list[int] | dict[str, list[int]]:
    layer = integer(1, "a positive layer width")
    if isinstance(value, (list, tuple)):  # a tuple from Python, as SB3 takes it
        return [layer(v, where) for v in value]
    if isinstance(value, Mapping):
        check_keys(value, {"pi", "vf", "qf"}, where)
        out = {}
        for k, v in value.items():
            if not isinstance(v, (list, tuple)):
                raise ConfigError(f"{where}.{k}: expected a list of layer widths, got {v!r}")
            out[k] = [layer(x, f"{where}.{k}") for x in v]
        return out
    raise ConfigError(
        f"{where}: expected a list of layer widths like [64, 64], or {{pi: [...], vf: [...]}} (PPO) or "
        f"{{pi: [...], qf: [...]}} (SAC, TD3, TQC), got {value!r}"
    )


def choice(choices: tuple[str, ...] | list[str]) -> Check:
    def check(value: Any, where: str) -> str:
        if value not in choices:
            raise ConfigError(f"{where}: unknown value {value!r}{closest(str(value), choices)} (valid: {', '.join(choices)})")
        return str(value)

    return check


def mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return {str(k): v for k, v in value.items()}


def kwargs_mapping(value: Any, where: str) -> dict[str, Any]:
    """A mapping of keyword arguments passed on as given (``policy_kwargs``), its numbers as Python's."""
    return plain_numbers(mapping(value, where))


def names(value: Any, where: str) -> list[str]:
    """A non-empty list of distinct names (``[position, velocity]``)."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: expected a non-empty list of names, got {value!r}")
    if len(set(value)) < len(value):
        raise ConfigError(f"{where}: {value!r} names a key twice")
    return list(value)


NORMALIZE_KEYS = {
    "norm_obs": boolean,
    "norm_reward": boolean,
    "clip_obs": number(0, math.inf, "a positive number", True),
    "clip_reward": number(0, math.inf, "a positive number", True),
    "epsilon": number(0, 1, "a number in (0, 1]", True),
    "norm_obs_keys": names,  # a Dict observation's keys to scale (VecNormalize's default: all of them)
}


def normalize(value: Any, where: str) -> bool | dict[str, Any]:
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        keys = ", ".join(NORMALIZE_KEYS)
        raise ConfigError(f"{where}: expected true, false or a mapping of VecNormalize's options ({keys}), got {value!r}")
    options = mapping(value, where)
    check_keys(options, set(NORMALIZE_KEYS), where)
    # An empty mapping stays one (a profile's adds nothing to its entry's); the resolved preset's is VecNormalize
    # with its defaults (resolve_preset).
    return {k: NORMALIZE_KEYS[k](v, f"{where}.{k}") for k, v in options.items()}


def train_freq(value: Any, where: str) -> int | tuple[int, str]:
    if isinstance(value, (list, tuple)):  # SB3's (n, "episode") from Python, [n, episode] from YAML
        if len(value) != 2 or value[1] not in ("step", "episode"):
            unit = closest(str(value[1]), ("step", "episode")) if len(value) == 2 else ""
            raise ConfigError(f"{where}: expected a positive int or [n, step|episode], got {value!r}{unit}")
        return (integer(1, "a positive int")(value[0], where), value[1])
    return integer(1, "a positive int or [n, step|episode]")(value, where)


POS_INT = integer(1, "a positive int")


def gradient_steps(value: Any, where: str) -> int:
    """A positive int, or -1 for as many as the env steps collected; 0 would train nothing (SB3 skips ``train()``)."""
    what = "a positive int, or -1 for one per env step"
    steps = integer(-1, what)(value, where)
    if steps == 0:
        raise ConfigError(f"{where}: expected {what}, got 0 (no gradient step would ever be taken)")
    return steps


UNIT = number(0.0, 1.0, "a number in [0, 1]")
POSITIVE = number(0.0, math.inf, "a positive number", low_open=True)


def ent_coef(value: Any, where: str) -> float | str:
    """SAC's entropy coefficient: ``auto`` (learned, from 1.0), ``auto_0.1`` (learned, from 0.1) or a fixed number
    (0: no entropy bonus, as SB3 allows; a learned one starts above 0, its logarithm being what is learned)."""
    what = "auto, auto_<initial value above 0> or a number >= 0"
    if isinstance(value, str) and value.startswith("auto"):
        if value != "auto":
            head, _, start = value.partition("_")
            try:
                number(0.0, math.inf, what, low_open=True)(start, where)
            except ConfigError:
                start = ""
            if head != "auto" or not start:
                raise ConfigError(f"{where}: expected {what}, got {value!r}") from None
        return value
    return number(0.0, math.inf, what)(value, where)


def target_entropy(value: Any, where: str) -> float | str:
    """SAC's target entropy: ``auto`` (minus the action dimension) or a number."""
    if value == "auto":
        return value
    return number(-math.inf, math.inf, "auto or a finite number")(value, where)


NON_NEGATIVE = number(0.0, math.inf, "a number >= 0")


def param(default: Any, check: Check) -> Any:
    return field(default=default, metadata={"check": check})


PER_NORMALIZE = ("batch", "buffer")
PER_DEFAULTS = {"alpha": 0.6, "beta0": 0.4, "eps": 1e-6, "beta_fraction": 1.0, "normalize": "batch"}
PER_CHECKS: dict[str, Check] = {
    "alpha": number(0.0, math.inf, "a number >= 0 (0 is uniform sampling)"),
    "beta0": number(0.0, 1.0, "a number in [0, 1]"),
    "eps": number(0.0, math.inf, "a number > 0", low_open=True),
    "beta_fraction": number(0.0, 1.0, "a number in (0, 1]", low_open=True),
    "normalize": choice(PER_NORMALIZE),
}


def per_config(value: Any, where: str) -> dict[str, Any] | bool:
    """``false``, ``true`` (the defaults) or a mapping of ``alpha``, ``beta0``, ``eps``, ``beta_fraction``,
    ``normalize``."""
    if isinstance(value, bool):
        return dict(PER_DEFAULTS) if value else False
    options = mapping(value, where)
    check_keys(options, set(PER_CHECKS), where)
    return {**PER_DEFAULTS, **{k: PER_CHECKS[k](v, f"{where}.{k}") for k, v in options.items()}}


AMP_MODES = ("auto", "off", "bf16", "fp16")
COMPILE_MODES = ("auto", "false", "default", "reduce-overhead", "max-autotune")


def compile_mode(value: Any, where: str) -> str:
    """``auto``, ``false`` (YAML bool or string, or ``off``), ``true`` (the same, or ``on``: torch.compile's default
    mode) or a torch.compile mode."""
    if value is False or (isinstance(value, str) and value.strip().lower() in ("false", "off")):
        return "false"
    if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "on")):
        return "default"
    return choice(COMPILE_MODES)(value, where)


def amp_mode(value: Any, where: str) -> str:
    """``auto``, ``off``, ``bf16`` or ``fp16``. YAML reads a bare ``off`` (and ``no``, ``false``) as False: that is
    ``off`` too; True names no precision."""
    if value is False:
        return "off"
    if value is True:
        raise ConfigError(f"{where}: true names no precision; give one of {', '.join(AMP_MODES)}")
    return choice(AMP_MODES)(value, where)


def auto_or_bool(value: Any, where: str) -> str:
    """``auto``, ``true`` or ``false`` (YAML bools or strings), as a string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return choice(("auto", "true", "false"))(value.strip().lower() if isinstance(value, str) else value, where)


def threads(value: Any, where: str) -> int | str:
    """``auto`` or a positive int."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    value = plain_number(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected 'auto' or a positive int, got {value!r}")
    return value
