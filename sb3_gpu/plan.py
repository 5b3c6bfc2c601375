"""The Plan: hardware, resolved preset and device and vec env choices, each with its reason; and the model built from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium import spaces
from rich.table import Table
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.preprocessing import is_image_space
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from sb3_gpu._checks import check_keys
from sb3_gpu.envs import EnvSpec, choose_vec_env, envpool_fits, make_vec_env, measure_step_seconds, probe_env, resolve_env
from sb3_gpu.errors import ConfigError, closest
from sb3_gpu.hardware import DeviceChoice, HardwareProfile, PolicyKind, choose_device, detect_hardware
from sb3_gpu.presets import (
    PROFILES,
    Preset,
    check_policy_kwargs,
    get_algo,
    load_preset_file,
    read_yaml,
    resolve_preset,
    select_entry,
    validate_flat,
)
from sb3_gpu.speed import SpeedPlan, apply_speed, choose_speed

CONFIG_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """Everything decided before training, with the reason for each decision. Saved as ``config.yaml``."""

    algo: str
    env: EnvSpec
    device_request: str
    device: DeviceChoice
    vec_env_request: str
    vec_env: str
    vec_env_reason: str
    preset: Preset
    hardware: HardwareProfile
    profile_reason: str = ""
    seed: int | None = None
    # Training extensions (AMP, PER, ...) record what they switched on and why, keyed by name.
    extensions: dict[str, str] = field(default_factory=dict)
    # amp, compile, threads and CUDA math flags as decided for this machine (None: leave torch as it is).
    speed: SpeedPlan | None = None

    def to_config(self) -> dict[str, Any]:
        """Plain data that :func:`load_config` turns back into the same hyperparameters."""
        return {
            "version": CONFIG_VERSION,
            "algo": self.algo,
            "env": self.env.name,
            "device": self.device_request,
            "vec_env": self.vec_env_request,
            "seed": self.seed,
            "hyperparameters": self.preset.values(),
            # Informational: what was chosen on the machine that wrote this file, and why.
            "resolved": {
                "device": f"{self.device.device} ({self.device.reason})",
                "profile": f"{self.preset.profile} ({self.profile_reason})",
                "vec_env": f"{self.vec_env} ({self.vec_env_reason})",
                "hardware": self.hardware.describe(),
                **({f"speed.{k}": f"{v} ({why})" for k, v, why in self.speed.rows()} if self.speed else {}),
                "sources": dict(self.preset.sources),
            },
        }


_CONFIG_KEYS = {"version", "algo", "env", "device", "vec_env", "seed", "hyperparameters", "resolved", "run"}


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
    # How the run evaluates and saves (see ``run.RunOptions``); checked where it is used.
    run: dict[str, Any] = field(default_factory=dict)


def load_config(path: str | Path) -> RunConfig:
    """Read a run's ``config.yaml`` (a run dir is accepted too)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.yaml"
    data = read_yaml(path, "config file")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a config file must be a mapping, as written by sb3_gpu.train")
    check_keys(data, _CONFIG_KEYS, str(path))
    missing = {"algo", "env", "hyperparameters"} - set(data)
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(sorted(missing))}")
    algo = get_algo(str(data["algo"]))
    hyper = validate_flat(algo, data["hyperparameters"], f"{path}: hyperparameters")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"{path}: seed must be an int or null, got {seed!r}")
    run = data.get("run") or {}
    if not isinstance(run, Mapping):
        raise ConfigError(f"{path}: run must be a mapping, got {run!r}")
    return RunConfig(
        algo.name,
        str(data["env"]),
        str(data.get("device", "auto")),
        str(data.get("vec_env", "auto")),
        seed,
        hyper,
        str(path),
        dict(run),
    )


def _policy_for(obs_space: spaces.Space) -> str:
    if isinstance(obs_space, spaces.Dict):
        return "MultiInputPolicy"
    return "CnnPolicy" if is_image_space(obs_space, check_channels=False) else "MlpPolicy"


def _policy_kind(policy: str, obs_space: spaces.Space) -> PolicyKind:
    if policy == "CnnPolicy":
        return "cnn"
    if policy == "MultiInputPolicy":
        subspaces = obs_space.spaces.values() if isinstance(obs_space, spaces.Dict) else []
        return "cnn" if any(is_image_space(s, check_channels=False) for s in subspaces) else "multi"
    return "mlp"


def make_plan(
    algo: str,
    env: str | Callable[[], gym.Env],
    device: str = "auto",
    *,
    n_envs: int | None = None,
    n_timesteps: int | None = None,
    vec_env: str = "auto",
    seed: int | None = None,
    preset: str | Path | None = None,
    profile: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    override_source: str = "override",
    config: RunConfig | None = None,
    hardware: HardwareProfile | None = None,
) -> Plan:
    """Resolve hardware, preset, device and vec env for ``algo`` on ``env``.

    :param preset: a preset YAML file to use instead of the bundled one for ``algo``
    :param profile: ``auto`` (``cpu`` or ``gpu`` by the chosen device) or a profile name: ``cpu``, ``gpu``, ``large``
    :param overrides: hyperparameters that win over the preset (``{"batch_size": 128, "policy_kwargs.ortho_init": False}``)
    :param config: a run's config read by :func:`load_config`; its hyperparameters replace the preset
    """
    algo_ = get_algo(algo)
    hardware = hardware or detect_hardware()
    if config is not None:
        entry, entry_label = dict(config.hyperparameters), f"{config.path}"
    else:
        entries, file_label = load_preset_file(algo_, preset)
        name_probe = resolve_env(env)
        name = select_entry(entries, name_probe.name, name_probe.is_atari, file_label)
        entry, entry_label = entries[name], f"{Path(file_label).name}:{name}"

    layered: dict[str, tuple[Any, str]] = {k: (v, override_source) for k, v in (overrides or {}).items()}
    if n_envs is not None:
        layered["n_envs"] = (n_envs, "--n-envs")
    if n_timesteps is not None:
        layered["n_timesteps"] = (n_timesteps, "--timesteps")

    # Policy and env kwargs never differ between profiles, so a provisional resolve tells what to probe.
    provisional = resolve_preset(algo_, entry, entry_label, "cpu", layered)
    spec = resolve_env(env, provisional.env_kwargs)
    # One env as training will see it, for its spaces and its step cost.
    one = probe_env(spec)
    try:
        obs_space, action_space = one.observation_space, one.action_space
        # Only `auto` needs the step cost; evaluate and explicit choices skip the measurement.
        pool = vec_env == "auto" and envpool_fits(spec)
        step_seconds = measure_step_seconds(one) if vec_env == "auto" else 0.0
    finally:
        one.close()
    if not algo_.on_policy and not isinstance(action_space, spaces.Discrete):
        raise ConfigError(f"{algo_.name} needs a Discrete action space; {spec.name} has {action_space}")

    policy = provisional.policy if provisional.policy != "auto" else _policy_for(obs_space)
    choice = choose_device(device, _policy_kind(policy, obs_space), algo_.on_policy, hardware)
    if profile == "auto":
        profile, profile_reason = choice.profile, f"follows the device ({choice.device})"
    elif profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}{closest(profile, PROFILES)} (valid: auto, {', '.join(PROFILES)})")
    elif profile not in entry and profile not in ("cpu", "gpu"):
        have = [p for p in PROFILES if p in entry]
        raise ConfigError(f"{entry_label} has no {profile!r} profile (it has: {', '.join(have) or 'none'})")
    else:
        profile_reason = "asked for"
    resolved = resolve_preset(algo_, entry, entry_label, profile, layered)
    if resolved.policy == "auto":
        resolved = dataclasses.replace(
            resolved, policy=policy, sources={**resolved.sources, "policy": "auto (observation space)"}
        )
    check_policy_kwargs(algo_, resolved.policy, resolved.policy_kwargs, entry_label)
    _check_combinations(resolved, obs_space)
    kind, reason = choose_vec_env(vec_env, resolved.n_envs, step_seconds, hardware.logical_cores, envpool=pool)
    if kind in ("subproc", "batched") and hardware.in_notebook:
        reason += "; in a notebook, falls back to dummy with a warning if workers cannot start"
    speed = choose_speed(
        resolved.amp,
        resolved.compile,
        resolved.threads,
        device=choice.device,
        policy=_policy_kind(resolved.policy, obs_space),
        net_arch=resolved.net_arch,
        batch_size=resolved.params.batch_size,
        env_workers={"subproc": resolved.n_envs, "batched": min(resolved.n_envs, hardware.logical_cores)}.get(kind, 0),
        hardware=hardware,
    )
    return Plan(
        algo=algo_.name,
        env=spec,
        device_request=device,
        device=choice,
        vec_env_request=vec_env,
        vec_env=kind,
        vec_env_reason=reason,
        preset=resolved,
        hardware=hardware,
        profile_reason=profile_reason,
        seed=seed,
        speed=speed,
    )


def _check_combinations(preset: Preset, obs_space: spaces.Space) -> None:
    """Refuse settings that each pass alone but that SB3 or sb3_gpu cannot run together."""
    params: Any = preset.params
    if preset.algo == "ppo" and params.n_steps * preset.n_envs < 2:
        raise ConfigError(f"n_steps * n_envs must be > 1 for PPO, got {params.n_steps} * {preset.n_envs}")
    if preset.algo == "ppo" and (-(-params.n_steps * preset.n_envs // params.batch_size)) % params.grad_accum_steps:
        minibatches = -(-params.n_steps * preset.n_envs // params.batch_size)
        raise ConfigError(
            f"grad_accum_steps={params.grad_accum_steps} must divide the {minibatches} minibatches per epoch"
            f" (n_steps * n_envs / batch_size = {params.n_steps} * {preset.n_envs} / {params.batch_size})"
        )
    if getattr(params, "optimize_memory_usage", False):
        raise ConfigError(
            "optimize_memory_usage=true is not supported: SB3 refuses it beside timeout handling, which stays on"
        )
    if getattr(params, "per", False):
        if params.n_steps > 1:
            raise ConfigError("prioritized replay does not support n-step returns yet; set per=false or n_steps=1")
        if isinstance(obs_space, spaces.Dict):
            raise ConfigError("prioritized replay does not support Dict observations yet; set per=false")


def build_env(plan: Plan, *, n_envs: int | None = None, monitor_dir: str | None = None, evaluation: bool = False) -> VecEnv:
    """The plan's VecEnv (``evaluation=True``: one dummy env, seeded apart, with frozen normalisation)."""
    preset = plan.preset
    seed = None if plan.seed is None else plan.seed + (10_000 if evaluation else 0)
    venv = make_vec_env(
        plan.env,
        n_envs or (1 if evaluation else preset.n_envs),
        vec_env="dummy" if evaluation else plan.vec_env,
        seed=seed,
        monitor_dir=monitor_dir,
        frame_stack=preset.frame_stack,
    )
    if preset.normalize:
        kwargs = preset.normalize if isinstance(preset.normalize, dict) else {}
        gamma = getattr(preset.params, "gamma", 0.99)
        if evaluation:
            venv = VecNormalize(
                venv, training=False, norm_reward=False, gamma=gamma, **{k: v for k, v in kwargs.items() if k != "norm_reward"}
            )
        else:
            venv = VecNormalize(venv, gamma=gamma, **kwargs)
    return venv


def build_model(plan: Plan, env: VecEnv, *, tensorboard_log: str | None = None, verbose: int = 0) -> BaseAlgorithm:
    """An SB3 model for the plan (sb3_gpu's subclass only where PER or gradient accumulation is on), with the
    plan's speed settings applied (AMP, compile, torch threads; ``torch.set_num_threads`` is process-wide).

    ``model.preset_timesteps`` holds the preset's training length.
    """
    try:
        model = plan.preset.model_class(
            plan.preset.policy,
            env,
            device=plan.device.device,
            seed=plan.seed,
            tensorboard_log=tensorboard_log,
            verbose=verbose,
            **plan.preset.sb3_kwargs(),
        )
    except (ValueError, AssertionError, TypeError) as e:  # SB3's own checks of combinations we do not know
        raise ConfigError(f"{plan.preset.model_class.__name__} refused the plan's hyperparameters: {e}") from None
    model.preset_timesteps = plan.preset.n_timesteps  # type: ignore[attr-defined]
    if plan.speed is not None:
        # Warns and goes on uncompiled if torch.compile fails; the reason is kept on the model.
        model.compile_fallback = apply_speed(model, plan.speed, plan.preset.params.batch_size)  # type: ignore[attr-defined]
    return model


def make_model(
    algo: str,
    env: str | Callable[[], gym.Env],
    device: str = "auto",
    *,
    n_envs: int | None = None,
    vec_env: str = "auto",
    seed: int | None = None,
    preset: str | Path | None = None,
    profile: str = "auto",
    tensorboard_log: str | None = None,
    verbose: int = 0,
    **overrides: Any,
) -> BaseAlgorithm:
    """A ready SB3 model whose hyperparameters fit this machine: ``model.learn(model.preset_timesteps)`` trains it.

    :param algo: ``ppo``, ``dqn`` or ``qrdqn``
    :param env: a registered id, ``package.module:Attr`` or a zero-argument env factory
    :param device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``
    :param profile: ``auto`` (by device), ``cpu``, ``gpu`` or ``large`` (a big workstation; DQN family)
    :param overrides: preset keys that win over the preset, e.g. ``batch_size=128, net_arch=[64, 64]``
    """
    plan = make_plan(
        algo, env, device, n_envs=n_envs, vec_env=vec_env, seed=seed, preset=preset, profile=profile, overrides=overrides
    )
    return build_model(plan, build_env(plan), tensorboard_log=tensorboard_log, verbose=verbose)


def plan_table(plan: Plan) -> Table:
    """The plan as one table: decisions with reasons, then every hyperparameter with its source."""
    table = Table(title=f"sb3_gpu plan: {plan.algo.upper()} on {plan.env.name}", show_lines=False, title_justify="left")
    table.add_column("setting", style="bold")
    table.add_column("value")
    table.add_column("why / source", style="dim")
    table.add_row("hardware", plan.hardware.describe(), plan.hardware.cpu_model)
    table.add_row("device", plan.device.device, plan.device.reason)
    table.add_row("profile", plan.preset.profile, f"{plan.preset.entry}: {plan.profile_reason}")
    table.add_row("vec_env", plan.vec_env, plan.vec_env_reason)
    table.add_row("seed", str(plan.seed), "")
    for name, what in plan.extensions.items():
        table.add_row(name, what, "extension")
    for name, value, why in plan.speed.rows() if plan.speed else []:
        table.add_row(name, value, why)
    table.add_section()
    values = plan.preset.values()
    for key, value in values.items():
        if (key == "policy_kwargs" and not value) or (key == "env_kwargs" and not value):
            continue
        shown = "SB3 default" if value is None and key in ("net_arch", "activation_fn") else _show(value)
        table.add_row(key, shown, plan.preset.sources.get(key, ""))
    return table


def _show(value: Any) -> str:
    if isinstance(value, dict) and value.get("schedule") == "linear":
        return f"linear {value['start']:g} -> {value['end']:g}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
