"""From a Plan to plain SB3 objects: its VecEnv and its model, and ``make_model`` that does both in one call."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from sb3_gpu.common.checks import bool_arg
from sb3_gpu.common.errors import ConfigError, named, warn
from sb3_gpu.config.schema import get_algo
from sb3_gpu.envs.build import close_vec_envs, make_vec_env
from sb3_gpu.envs.spec import space_text
from sb3_gpu.extensions.per import DevicePrioritizedReplayBuffer, PrioritizedReplayBuffer
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.extensions.rollout import DeviceRolloutBuffer
from sb3_gpu.planning.optimizers import planned_policy_kwargs
from sb3_gpu.planning.plan import Plan, make_plan
from sb3_gpu.planning.speed import apply_speed, apply_torch_settings

# Evaluation envs are seeded apart from the training envs, so that they never replay the same episodes.
EVAL_SEED_OFFSET = 10_000


def offset_seed(seed: int | None, offset: int) -> int | None:
    """``seed + offset``, wrapped into the seeds numpy takes (below 2**32): a seed near the top stays usable."""
    return None if seed is None else (seed + offset) % 2**32


def resumed_seed(seed: int | None, timesteps: int) -> int | None:
    """The seed a run resumed at ``timesteps`` continues on: a hash of both, so that it repeats for one stop, and
    neither replays the first episodes nor lands on the seeds an offset gives (``seed + 10_000`` would train on the
    evaluation episodes of a run stopped at 10,000 steps)."""
    return None if seed is None else int(np.random.SeedSequence([seed, timesteps]).generate_state(1)[0])


def build_env(
    plan: Plan, *, n_envs: int | None = None, monitor_dir: str | os.PathLike[str] | None = None, evaluation: bool = False
) -> VecEnv:
    """The plan's VecEnv (``evaluation=True``: dummy envs, one unless ``n_envs`` says, seeded apart, with frozen
    normalisation)."""
    _check_plan(plan, "build_env")
    bool_arg(evaluation, "evaluation")
    preset = plan.preset
    seed = offset_seed(plan.seed, EVAL_SEED_OFFSET if evaluation else 0)
    venv = make_vec_env(
        plan.env,
        n_envs if n_envs is not None else 1 if evaluation else preset.n_envs,
        seed=seed,
        monitor_dir=monitor_dir,
        vec_env="dummy" if evaluation else plan.vec_env,
        frame_stack=preset.frame_stack,
        max_episode_steps=plan.eval_step_cap if evaluation else None,
    )
    if not preset.normalize:
        return venv
    kwargs = preset.normalize if isinstance(preset.normalize, dict) else {}
    gamma = getattr(preset.params, "gamma", 0.99)
    if evaluation:
        frozen = {k: v for k, v in kwargs.items() if k != "norm_reward"}
        return VecNormalize(venv, training=False, norm_reward=False, gamma=gamma, **frozen)
    return VecNormalize(venv, gamma=gamma, **kwargs)


def _check_model_args(tensorboard_log: Any, verbose: Any) -> None:
    """SB3 takes these unchecked and fails on them at ``learn()`` (or reports them as the plan's hyperparameters)."""
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ConfigError(f"verbose must be 0, 1 or 2, got {verbose!r}")
    if tensorboard_log is not None and not isinstance(tensorboard_log, (str, os.PathLike)):
        raise ConfigError(f"tensorboard_log must be a folder path or None, got {tensorboard_log!r}")


def _check_plan(plan: Any, caller: str) -> None:
    if not isinstance(plan, Plan):
        raise TypeError(f"{caller} takes a Plan from make_plan(...), got {plan!r}")


def model_class(plan: Plan) -> type[BaseAlgorithm]:
    """The preset's class (plain SB3 where no extension is on), or sb3_gpu's subclass where the plan overlaps training
    with collection, compiles, or trains on a GPU: there its ``train()``, which reads nothing back from the device to
    log, spares the GPU the waits of SB3's (a read of every loss), and compiles each gradient step whole where the
    plan compiles. TQC's subclass is taken everywhere: its eager step is the faster one on a CPU too. The updates are
    SB3's either way."""
    algo = get_algo(plan.algo)
    extended = algo.extended_class
    on_gpu = plan.device.device.startswith("cuda")
    compiled = plan.speed is not None and plan.speed.compile != "false"
    if (plan.training == "overlapped" or on_gpu or compiled or algo.eager_step_faster) and extended is not None:
        return extended
    return plan.preset.model_class


def model_kwargs(plan: Plan) -> dict[str, Any]:
    """The keyword arguments of :func:`model_class`: the preset's, the device buffers and the overlapped training
    where the plan chose them."""
    preset = plan.preset
    kwargs = preset.sb3_kwargs()
    if plan.training == "overlapped":
        kwargs["overlap_training"] = True
    if plan.buffers == "device":
        if preset.algo == "ppo":
            kwargs["rollout_buffer_class"] = DeviceRolloutBuffer
        elif kwargs.get("replay_buffer_class") is PrioritizedReplayBuffer:  # same arguments, trees on the device
            kwargs["replay_buffer_class"] = DevicePrioritizedReplayBuffer
        else:
            kwargs["replay_buffer_class"] = DeviceReplayBuffer
    if plan.buffers == "host" and kwargs.get("optimize_memory_usage"):
        # An evaluation's plan (a training's takes it on sb3_gpu's device buffer only): SB3's host buffers refuse it
        # beside their handling of time limits, and an evaluation fills none.
        kwargs["optimize_memory_usage"] = False
    if kwargs.get("replay_buffer_class") is not None and kwargs.get("n_steps", 1) > 1:
        # sb3_gpu's buffers compute the n-step returns themselves. SB3 hands n_steps only to its own NStepReplayBuffer
        # (and warns that any other class ignores it), so the algorithm keeps one.
        kwargs["replay_buffer_kwargs"] = {**kwargs.get("replay_buffer_kwargs", {}), "n_steps": kwargs["n_steps"]}
        kwargs["replay_buffer_kwargs"]["gamma"] = kwargs["gamma"]
        kwargs["n_steps"] = 1
    std = getattr(preset.params, "action_noise_std", None)
    if std:  # SB3 takes the noise object; its shape is the action space's, which the plan has
        assert plan.action_shape is not None, "a continuous algorithm's plan records its action shape"
        zeros = np.zeros(plan.action_shape, dtype=np.float32)
        kwargs["action_noise"] = NormalActionNoise(mean=zeros, sigma=np.full_like(zeros, std))
    kwargs["policy_kwargs"] = planned_policy_kwargs(
        preset.algo, kwargs.get("policy_kwargs") or {}, kwargs["batch_size"], plan.device.device
    )
    return kwargs


def build_model(
    plan: Plan, env: VecEnv, *, tensorboard_log: str | os.PathLike[str] | None = None, verbose: int = 0
) -> BaseAlgorithm:
    """An SB3 model for the plan (sb3_gpu's subclass where :func:`model_class` says: PER, gradient accumulation,
    a critic LayerNorm, overlap, compile, a GPU, and TQC always), with the plan's speed settings applied (AMP,
    compile, torch threads; ``torch.set_num_threads`` is process-wide).

    If torch.compile fails, the model trains uncompiled and a ``CompileFallbackWarning`` says why.
    """
    _check_plan(plan, "build_model")
    if not isinstance(env, VecEnv):
        raise TypeError(f"build_model needs the VecEnv that build_env(plan) makes, got {env!r}")
    _check_model_args(tensorboard_log, verbose)
    _check_env_fits(plan, env)
    preset, cls = plan.preset, model_class(plan)
    params: Any = preset.params
    rollout = params.n_steps * env.num_envs if plan.algo == "ppo" else None
    if rollout is not None and params.batch_size > rollout:  # the plan table flags it; a caller of the API sees this
        source = preset.sources.get("batch_size", "preset")
        warn(
            f"batch_size {params.batch_size} ({source}) is more than one rollout (n_steps * n_envs = {params.n_steps} * "
            f"{env.num_envs} = {rollout}): each minibatch is the whole rollout; give batch_size={rollout} or less",
            UserWarning,
        )
    elif rollout is not None and rollout % params.batch_size:
        warn(
            f"batch_size {params.batch_size} ({preset.sources.get('batch_size', 'preset')}) is not a factor of the rollout "
            f"(n_steps * n_envs = {rollout}): each epoch ends on a minibatch of {rollout % params.batch_size}",
            UserWarning,
        )
    if plan.speed is not None:
        apply_torch_settings(plan.speed)  # first: the initial weights depend on the thread count
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "You have specified a mini-batch size")  # SB3's word for the same
            model = cls(
                preset.policy,
                env,
                device=plan.device.device,
                seed=plan.seed,
                tensorboard_log=None if tensorboard_log is None else os.fspath(tensorboard_log),
                verbose=verbose,
                **model_kwargs(plan),
            )
    except (ValueError, AssertionError, TypeError, NotImplementedError) as e:  # SB3's own checks we do not repeat
        raise ConfigError(f"{cls.__name__} refused the plan's settings or the env's spaces: {named(e)}") from None
    if plan.speed is not None:
        apply_speed(model, plan.speed, preset.params.batch_size)
    return model


class PresetModel(NamedTuple):
    """A ready SB3 model and the preset's training length: ``model, timesteps = make_model(...)``."""

    model: BaseAlgorithm
    timesteps: int


def _check_env_fits(plan: Plan, env: VecEnv) -> None:
    """Refuse an env whose actions are not the plan's (one built for another env): its preset would not fit it."""
    space, planned = env.action_space, plan.action_space
    if planned is not None and space_text(space) != space_text(planned):  # class, shape, choices: not a Box's bounds
        raise ConfigError(
            f"the env given to build_model has actions {space}, but the plan's env ({plan.env.name}) has {planned}: "
            "build the env with build_env(plan)"
        )


def make_model(
    algo: str,
    env: str | Callable[[], gym.Env],
    device: str | th.device = "auto",
    *,
    n_envs: int | None = None,
    vec_env: str = "auto",
    seed: int | None = None,
    preset: str | Path | None = None,
    profile: str = "auto",
    tensorboard_log: str | os.PathLike[str] | None = None,
    verbose: int = 0,
    **overrides: Any,
) -> PresetModel:
    """An SB3 model whose hyperparameters fit this machine (SB3's class, or sb3_gpu's subclass of it where an
    extension is on, and for TQC: its zips load with SB3's own ``load``), and the preset's timesteps to train it for::

        model, timesteps = make_model("ppo", "CartPole-v1", device="auto")
        model.learn(timesteps)

    :param algo: ``ppo``, ``dqn``, ``qrdqn``, ``sac``, ``td3`` or ``tqc``
    :param env: a registered id, ``package.module:EnvClass`` or a zero-argument env factory
    :param device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``
    :param profile: ``auto`` (by device), ``cpu``, ``gpu`` or ``large`` (a big workstation; DQN family)
    :param overrides: preset keys that win over the preset, e.g. ``batch_size=128, net_arch=[64, 64]``

    As :func:`build_model`, it sets the process's torch threads to the plan's (``torch.set_num_threads``, for the
    whole process: a notebook's other torch work too); ``threads=N`` chooses them.
    """
    _check_model_args(tensorboard_log, verbose)
    plan = make_plan(
        algo, env, device, n_envs=n_envs, vec_env=vec_env, seed=seed, preset=preset, profile=profile, overrides=overrides
    )
    venv = build_env(plan)
    try:
        model = build_model(plan, venv, tensorboard_log=tensorboard_log, verbose=verbose)
    except BaseException:  # refused by SB3: its env workers are not left running
        close_vec_envs(venv)
        raise
    return PresetModel(model, plan.preset.n_timesteps)
