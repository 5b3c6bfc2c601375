"""The preset schema: each algorithm's hyperparameters as a frozen dataclass whose fields carry their checks, the
keys every entry may hold, and the validation of flat mappings and of entries with profiles."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gymnasium import spaces
from sb3_contrib import QRDQN, TQC
from stable_baselines3 import DQN, PPO, SAC, TD3
from stable_baselines3.common.base_class import BaseAlgorithm
from torch import nn

from sb3_gpu.common import checks as c
from sb3_gpu.common.checks import Check, Schedule
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.accumulate import GradAccumPPO
from sb3_gpu.extensions.continuous import SyncFreeSAC, SyncFreeTD3, SyncFreeTQC
from sb3_gpu.extensions.networks import steps_one_optimizer
from sb3_gpu.extensions.per import PrioritizedDQN, PrioritizedQRDQN

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
    # sb3_gpu extension (extensions.accumulate): k minibatches per optimizer step; SB3 has none.
    grad_accum_steps: int = c.param(1, c.POS_INT)


@dataclass(frozen=True)
class _ReplayParams:
    """The arguments of every off-policy algorithm of SB3, with DQN's defaults; subclasses set their own."""

    learning_rate: float | Schedule = c.param(1e-4, c.schedulable(c.POSITIVE))
    buffer_size: int = c.param(1_000_000, c.POS_INT)
    learning_starts: int = c.param(100, c.integer(0, "an int >= 0"))
    batch_size: int = c.param(32, c.POS_INT)
    tau: float = c.param(1.0, c.number(0.0, 1.0, "a number in (0, 1]", low_open=True))
    gamma: float = c.param(0.99, c.UNIT)
    train_freq: int | tuple[int, str] = c.param(4, c.train_freq)
    gradient_steps: int = c.param(1, c.gradient_steps)
    optimize_memory_usage: bool = c.param(False, c.boolean)
    n_steps: int = c.param(1, c.POS_INT)


@dataclass(frozen=True)
class DQNParams(_ReplayParams):
    """DQN's keyword arguments, as SB3 names them."""

    target_update_interval: int = c.param(10_000, c.POS_INT)
    exploration_fraction: float = c.param(0.1, c.UNIT)
    exploration_initial_eps: float = c.param(1.0, c.UNIT)
    exploration_final_eps: float = c.param(0.05, c.UNIT)
    max_grad_norm: float | None = c.param(10.0, c.POSITIVE)
    # sb3_gpu extensions (extensions.per): prioritized replay and gradient accumulation; SB3 has neither.
    per: dict[str, float] | bool = c.param(False, c.per_config)
    grad_accum_steps: int = c.param(1, c.POS_INT)
    # sb3_gpu extension (extensions.overlap): train on a thread of its own while the envs step (auto: on CUDA).
    overlap_training: str = c.param("auto", c.auto_or_bool)


@dataclass(frozen=True)
class QRDQNParams(DQNParams):
    """QR-DQN's keyword arguments (sb3-contrib); the same as DQN's with other defaults."""

    learning_rate: float | Schedule = c.param(5e-5, c.schedulable(c.POSITIVE))
    exploration_fraction: float = c.param(0.005, c.UNIT)
    exploration_final_eps: float = c.param(0.01, c.UNIT)
    max_grad_norm: float | None = c.param(None, c.optional(c.POSITIVE))


@dataclass(frozen=True)
class _ContinuousParams(_ReplayParams):
    """The arguments that SAC, TD3 and TQC share, with SB3's defaults (SAC's learning rate)."""

    learning_rate: float | Schedule = c.param(3e-4, c.schedulable(c.POSITIVE))
    batch_size: int = c.param(256, c.POS_INT)
    tau: float = c.param(0.005, c.number(0.0, 1.0, "a number in (0, 1]", low_open=True))
    train_freq: int | tuple[int, str] = c.param(1, c.train_freq)
    # Gaussian exploration noise added to the actor's actions (std, in units of the action range's half-width; SB3's
    # NormalActionNoise); none by default, as in SB3.
    action_noise_std: float | None = c.param(None, c.optional(c.NON_NEGATIVE))
    # sb3_gpu extension (extensions.continuous): k micro-batches per gradient step, each optimizer in its stage.
    grad_accum_steps: int = c.param(1, c.POS_INT)
    # sb3_gpu extension (extensions.continuous): layer normalisation after each hidden layer of the critics (and
    # their targets), as DroQ's critics have; SB3's critics have none.
    critic_layer_norm: bool = c.param(False, c.boolean)


@dataclass(frozen=True)
class TD3Params(_ContinuousParams):
    """TD3's keyword arguments, as SB3 names them."""

    learning_rate: float | Schedule = c.param(1e-3, c.schedulable(c.POSITIVE))
    policy_delay: int = c.param(2, c.POS_INT)
    target_policy_noise: float = c.param(0.2, c.NON_NEGATIVE)
    target_noise_clip: float = c.param(0.5, c.NON_NEGATIVE)


@dataclass(frozen=True)
class SACParams(_ContinuousParams):
    """SAC's keyword arguments, as SB3 names them."""

    ent_coef: float | str = c.param("auto", c.ent_coef)
    target_update_interval: int = c.param(1, c.POS_INT)
    target_entropy: float | str = c.param("auto", c.target_entropy)
    use_sde: bool = c.param(False, c.boolean)
    sde_sample_freq: int = c.param(-1, c.integer(-1, "an int >= -1"))
    use_sde_at_warmup: bool = c.param(False, c.boolean)


@dataclass(frozen=True)
class TQCParams(SACParams):
    """TQC's keyword arguments (sb3-contrib): SAC's and how many of the top quantiles each critic drops."""

    top_quantiles_to_drop_per_net: int = c.param(2, c.integer(0, "an int >= 0"))


AlgoParams = PPOParams | DQNParams | TD3Params | SACParams
ParamsClass = type[PPOParams] | type[DQNParams] | type[TD3Params] | type[SACParams]


@dataclass(frozen=True)
class Algo:
    name: str
    model_class: type[BaseAlgorithm]
    params_class: ParamsClass
    on_policy: bool
    # The subclass that runs sb3_gpu's training extensions; the plain SB3 class is used when they are off, unless
    # the subclass's eager gradient step is the faster one on every device (eager_step_faster).
    extended_class: type[BaseAlgorithm] | None = None
    # The action spaces the algorithm takes (the default: SB3's on-policy policies').
    action_space: tuple[type[spaces.Space], ...] = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
    # The widest hidden layer of SB3's default network for the algorithm's MLP policy (what the speed rules size).
    default_width: int = 64
    # The networks a dict net_arch names, each required: SB3 builds only these, ignores any other key, and builds a
    # missing one empty (PPO) or refuses it when the model is built (SAC's family). None: a list of widths only.
    net_arch_heads: tuple[str, ...] | None = None
    # TQC: its quantile loss makes its gradient in the forward pass (extensions.quantile), in about a third of
    # sb3-contrib's passes over the pairwise differences; on a 2-core CPU its Pendulum preset trained at 232 env
    # steps/s against about 154 with sb3-contrib's step (bench train).
    eager_step_faster: bool = False

    @property
    def fp16(self) -> bool:
        """Whether fp16 can train it: its policies step one optimizer, which fp16's loss scale spans."""
        return all(steps_one_optimizer(policy) for policy in self.model_class.policy_aliases.values())


# SAC, TD3 and TQC: device buffers, the compiled, sync-free step, the probe, bf16 and gradient accumulation apply;
# fp16 and PER do not yet.
QF_HEADS = ("pi", "qf")  # the actor and its critics (SB3's get_actor_critic_arch)
ALGOS: dict[str, Algo] = {
    "ppo": Algo("ppo", PPO, PPOParams, on_policy=True, extended_class=GradAccumPPO, net_arch_heads=("pi", "vf")),
    "dqn": Algo("dqn", DQN, DQNParams, False, PrioritizedDQN, (spaces.Discrete,)),
    "qrdqn": Algo("qrdqn", QRDQN, QRDQNParams, False, PrioritizedQRDQN, (spaces.Discrete,)),
    "sac": Algo("sac", SAC, SACParams, False, SyncFreeSAC, (spaces.Box,), default_width=256, net_arch_heads=QF_HEADS),
    "td3": Algo("td3", TD3, TD3Params, False, SyncFreeTD3, (spaces.Box,), default_width=400, net_arch_heads=QF_HEADS),
    "tqc": Algo(
        "tqc",
        TQC,
        TQCParams,
        False,
        SyncFreeTQC,
        (spaces.Box,),
        default_width=256,
        net_arch_heads=QF_HEADS,
        eager_step_faster=True,
    ),
}
EXTENSION_KEYS = ("per", "grad_accum_steps", "overlap_training", "critic_layer_norm")  # sb3_gpu's own, not SB3 arguments
# Not an SB3 argument: the plan builds SB3's NormalActionNoise from it (SB3 takes the noise object, `action_noise`).
CONVERTED_KEYS = ("action_noise_std",)
OFF_POLICY_ONLY = ("per", "buffer_size", "train_freq", "target_update_interval", "overlap_training")
_OWN_BUFFER = "for a buffer class of your own, build the SB3 model yourself, on build_env(plan)'s env"
# SB3 arguments that are no preset key, each with where it is set instead: "unknown key" would read as a typo.
SET_ELSEWHERE = {
    "replay_buffer_class": f"sb3_gpu chooses the replay buffer from per, n_steps and device_buffers; {_OWN_BUFFER}",
    "replay_buffer_kwargs": f"sb3_gpu chooses the replay buffer from per, n_steps and device_buffers; {_OWN_BUFFER}",
    "rollout_buffer_class": f"sb3_gpu chooses the rollout buffer from device_buffers; {_OWN_BUFFER}",
    "rollout_buffer_kwargs": f"sb3_gpu chooses the rollout buffer from device_buffers; {_OWN_BUFFER}",
    "handle_timeout_termination": "sb3_gpu's replay buffers always bootstrap from truncated episodes, as SB3's default",
    "action_noise": "set action_noise_std, the standard deviation of Gaussian noise on the actions",
    "stats_window_size": "sb3_gpu keeps SB3's window of 100 episodes for the rollout/ep_* figures",
    "device": "pass device to make_model or make_plan (the CLI's --device)",
    "seed": "pass seed to make_model or make_plan (the CLI's --seed)",
    "env": "the env is make_model's and make_plan's second argument (the CLI's --env)",
    "tensorboard_log": "pass it to make_model or build_model (a CLI run logs to its run dir's tb/)",
    "verbose": "pass it to make_model or build_model",
}


def get_algo(name: str) -> Algo:
    """Look an algorithm up by name (case-insensitive)."""
    return ALGOS[c.algo_name(name)]


def _activation(value: Any, where: str) -> str:
    """An activation by its name; from Python, SB3's form (the torch.nn class) is taken as its name."""
    if isinstance(value, type):
        name = next((n for n, cls in ACTIVATIONS.items() if cls is value), None)
        if name is None:
            raise ConfigError(
                f"{where}: {value.__name__} is none of the activations accepted (torch.nn's "
                f"{', '.join(cls.__name__ for cls in ACTIVATIONS.values())}, or their names)"
            )
        return name
    return c.choice(tuple(ACTIVATIONS))(value, where)


# Keys that every entry may hold beside the algorithm's hyperparameters.
COMMON_KEYS: dict[str, Check] = {
    "n_timesteps": c.POS_INT,
    "n_envs": c.POS_INT,
    "policy": c.choice(POLICIES),
    "net_arch": c.optional(c.net_arch),
    "activation_fn": c.optional(_activation),
    "policy_kwargs": c.kwargs_mapping,
    "normalize": c.normalize,
    "frame_stack": c.optional(c.POS_INT),
    "env_kwargs": c.kwargs_mapping,  # passed on as given, its numbers as Python's (1e-3 a float, not YAML's string)
    # Evaluation episodes are cut after this many steps of the env itself (an Atari game's emulator frames; default:
    # the env's own time limit, else 10,000), so that a deterministic policy that never ends an episode cannot hang an
    # evaluation.
    "eval_max_episode_steps": c.optional(c.POS_INT),
    # Evaluate every this many env steps (default: a tenth of the run); `--eval-freq` overrides it. A long run whose
    # policy swings between evaluations needs them closer, or its best model is chosen among too few.
    "eval_freq": c.optional(c.POS_INT),
    # Speed switches (planning.speed): not SB3 arguments; `auto` is decided per machine with a reason in the plan.
    "amp": c.amp_mode,
    "compile": c.compile_mode,
    "threads": c.threads,
    # Replay or rollout data on the model's device (auto: on CUDA; planning.buffers says why).
    "device_buffers": c.auto_or_bool,
    # Time the policy on each candidate of the auto choices (device, amp, threads) and take the fastest (planning.probe);
    # false: the fixed rules decide.
    "probe": c.boolean,
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
    "eval_max_episode_steps": None,
    "eval_freq": None,
    "amp": "auto",
    "compile": "auto",
    "threads": "auto",
    "device_buffers": "auto",
    "probe": True,
}


def _param_checks(algo: Algo) -> dict[str, Check]:
    return {f.name: f.metadata["check"] for f in dataclasses.fields(algo.params_class)}


def valid_keys(algo: Algo) -> dict[str, Check]:
    """Every key a flat (profile-free) entry of ``algo`` may hold, with its check."""
    return {**COMMON_KEYS, **_param_checks(algo)}


def validate_flat(algo: Algo, mapping: Any, where: str, shared_only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Validate a profile-free mapping of keys; return the normalised values. ``shared_only`` keys are refused
    (a profile's mapping may not set them)."""
    mapping = c.mapping(mapping, where)
    for key in shared_only:
        if key in mapping:
            raise ConfigError(f"{where}: {key!r} must be shared, not set per profile")
    checks = {k: v for k, v in valid_keys(algo).items() if k not in shared_only}
    _refuse_other_algorithms_keys(algo, mapping, where)
    c.check_keys(mapping, set(checks), where)
    values = {k: checks[k](v, f"{where}: {k}") for k, v in mapping.items()}
    if isinstance(values.get("net_arch"), dict):
        _check_net_arch_heads(algo, values["net_arch"], f"{where}: net_arch")
    return values


def check_key_names(algo: Algo, keys: list[str], where: str, excluded: tuple[str, ...] = ()) -> None:
    """Refuse keys that are no preset key of ``algo`` (a dotted key by its head), before their values are read;
    ``excluded`` keys are left out of the valid ones the error lists (the caller refuses them itself)."""
    heads = {key.partition(".")[0]: None for key in keys}
    _refuse_other_algorithms_keys(algo, heads, where)
    c.check_keys({k: v for k, v in heads.items() if k not in excluded}, set(valid_keys(algo)) - set(excluded), where)


def _check_net_arch_heads(algo: Algo, arch: dict[str, list[int]], where: str) -> None:
    heads = algo.net_arch_heads
    if heads is None:
        raise ConfigError(f"{where}: {algo.name}'s Q-network takes a list of layer widths like [64, 64], got {arch!r}")
    c.check_keys(arch, set(heads), f"{where} of {algo.name}")
    missing = [h for h in heads if h not in arch]
    if missing:
        shape = ", ".join(f"{h}: [...]" for h in heads)
        raise ConfigError(
            f"{where}: {algo.name} needs {{{shape}}}, {' and '.join(missing)} missing (an empty list for none), got {arch!r}"
        )


# sb3_gpu's own settings that are no preset keys, named as such rather than answered with the closest spelling of one.
RUN_SETTINGS = {
    "vec_env": "the CLI's --vec-env, make_model's and make_plan's vec_env=",
    "profile": "the CLI's --profile, make_model's and make_plan's profile=",
    "preset": "the CLI's --preset, make_model's and make_plan's preset=",
    "eval_episodes": "the CLI's --eval-episodes, train_run's eval_episodes=",
    "confirm_episodes": "the CLI's --confirm-episodes, train_run's confirm_episodes=",
    "checkpoint_freq": "the CLI's --checkpoint-freq, train_run's checkpoint_freq=",
    "save_replay_buffer": "the CLI's --save-replay-buffer, train_run's save_replay_buffer=",
    "run_dir": "the CLI's --run-dir, train_run's second argument",
}


def _refuse_other_algorithms_keys(algo: Algo, mapping: Mapping[str, Any], where: str) -> None:
    """A key of another algorithm is named as such, not answered with the closest spelling of one of ``algo``'s."""
    checks = valid_keys(algo)
    for key in mapping:
        if key in checks:
            continue
        if key in SET_ELSEWHERE and _sb3_takes(algo, key):
            raise ConfigError(f"{where}: {key!r} is SB3's but no preset key: {SET_ELSEWHERE[key]}")
        if key in RUN_SETTINGS:
            raise ConfigError(f"{where}: {key!r} is no preset key: {RUN_SETTINGS[key]}")
        others = ", ".join(a.name for a in ALGOS.values() if key in _param_checks(a))
        if algo.on_policy and key in OFF_POLICY_ONLY:
            raise ConfigError(f"{where}: {key!r} is for off-policy algorithms ({others}); {algo.name} is on-policy")
        if others:
            raise ConfigError(f"{where}: {key!r} is for {others}, not {algo.name}")


def _sb3_takes(algo: Algo, key: str) -> bool:
    """Whether ``algo``'s SB3 class takes ``key`` (its replay buffer's, for ``handle_timeout_termination``)."""
    if key == "handle_timeout_termination":
        return not algo.on_policy
    return key in inspect.signature(algo.model_class.__init__).parameters


def validate_entry(algo: Algo, entry: Any, where: str) -> dict[str, Any]:
    """Validate an entry: shared keys plus optional ``cpu:``, ``gpu:`` and ``large:`` profiles."""
    entry = c.mapping(entry, where)
    _refuse_other_algorithms_keys(algo, {k: v for k, v in entry.items() if k not in PROFILES}, where)
    c.check_keys(entry, set(valid_keys(algo)) | set(PROFILES), where)
    shared = validate_flat(algo, {k: v for k, v in entry.items() if k not in PROFILES}, where)
    out: dict[str, Any] = dict(shared)
    for profile in PROFILES:
        if profile in entry:
            out[profile] = validate_flat(algo, entry[profile] or {}, f"{where}, profile {profile}", shared_only=("policy",))
    return out
