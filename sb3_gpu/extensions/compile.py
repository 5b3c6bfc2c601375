"""``torch.compile`` of a policy's networks, compiled at once so that a failure shows before training starts."""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common import preprocessing
from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.common.errors import ConfigError, named, warn
from sb3_gpu.common.torch_settings import own_rng
from sb3_gpu.extensions.networks import narrow_linears, policy_networks, steps_one_optimizer


class CompileFallbackWarning(UserWarning):
    """torch.compile failed, so the policy trains uncompiled; the message says why."""


def own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a function or a bound method) with a code object of its own: dynamo keeps compiled graphs per code
    object, and every model's function would otherwise count against one recompile limit (8), which a process with
    several models reaches. Every function sb3_gpu compiles passes here, so SB3's space checks are made constants of
    the graph here too (:func:`_space_checks_constant`)."""
    _space_checks_constant()
    raw: Any = getattr(method, "__func__", method)
    own = types.FunctionType(raw.__code__.replace(), raw.__globals__, raw.__name__, raw.__defaults__, raw.__closure__)
    own.__kwdefaults__ = raw.__kwdefaults__
    bound = getattr(method, "__self__", None)
    return own if bound is None else types.MethodType(own, bound)


def python_int_spaces(networks: th.nn.Module) -> None:
    """Give each module's Discrete spaces a Python int ``n``, before anything of ``networks`` is compiled. SB3 one-hot
    encodes a Discrete observation with ``int(observation_space.n)`` and sb3-contrib's quantile networks reshape by
    ``int(action_space.n)``; gymnasium's ``n`` is a NumPy integer, which dynamo turns into a tensor and cannot read
    back, so the graph broke there. Each space is replaced by a copy (the env's own is left as it is); Discrete
    spaces compare equal whatever ``n``'s type."""
    for module in networks.modules():
        for name in ("observation_space", "action_space"):
            space = vars(module).get(name)
            if isinstance(space, spaces.Discrete) and not isinstance(space.n, int):
                fixed = copy.copy(space)
                fixed.n = int(space.n)
                setattr(module, name, fixed)


def _space_checks_constant() -> None:
    """Mark SB3's ``is_image_space`` as constant for dynamo. SB3's ``preprocess_obs`` asks it whether a Box of uint8
    frames is bounded by 0 and 255, with NumPy comparisons of the space's bounds, which dynamo traces as tensor ops and
    then cannot branch on: every CNN policy's graph broke there ("Data-dependent branching"). A space's bounds do not
    change, so the answer is a constant of each graph. Marking changes nothing outside a compiled function; it is
    left undone where this torch's dynamo cannot take a space as such a function's argument."""
    if _constants_take_objects():
        th.compiler.assume_constant_result(preprocessing.is_image_space)


def _is_box(space: Any) -> bool:
    return isinstance(space, spaces.Box)


@functools.cache
def _constants_take_objects() -> bool:
    """Whether dynamo takes an object (a space) as the argument of a function marked constant, guarding on the
    object's identity, as torch 2.13's does. A dynamo that takes only Python constants there would break every graph
    that calls the marked function: every policy's, MLPs' too, since ``preprocess_obs`` asks about any Box. Traced
    once per process, without compiling (dynamo's eager backend)."""
    marked = th.compiler.assume_constant_result(_is_box)
    space = spaces.Box(0.0, 1.0, (1,))

    def probe(x: th.Tensor) -> th.Tensor:
        return x + 1 if marked(space) else x

    try:
        th.compile(probe, backend="eager", fullgraph=True)(th.zeros(1))
    except Exception:  # dynamo's refusals take several types across versions
        return False
    return True


def compile_policy(model: BaseAlgorithm, mode: str, batch_size: int) -> str | None:
    """Compile the policy's networks in place (state dict keys unchanged) and run one training and one rollout batch
    through them now. On failure they are left uncompiled and a :class:`CompileFallbackWarning` says why, which is
    also returned."""
    if not steps_one_optimizer(type(model.policy)):  # SAC, TD3, TQC
        raise ConfigError(
            f"compile_policy is for PPO and the DQN family; {type(model).__name__} compiles its whole gradient step "
            "(sb3_gpu's SyncFree classes, compile_step)"
        )
    if not hasattr(th.nn.Module, "_compiled_call_impl"):
        # What Module.compile sets, and the fallback (and overlap's acting copy) clears: a torch that keeps it under
        # another name could not be run uncompiled again.
        reason = f"torch {th.__version__}'s Module.compile cannot be undone here; training uncompiled"
        warn(reason, CompileFallbackWarning)
        return reason
    modules = policy_networks(model).compute
    python_int_spaces(model.policy)
    # Narrow heads before the trial compiles: the compiled gradient step narrows them too (compile_step), and a class
    # changed after the trial would fail every compiled network's type guard and compile it again (30-60 s on a CPU).
    narrow_linears(model.policy)
    previous = th._dynamo.config.suppress_errors  # the process's own, put back after the trial
    th._dynamo.config.suppress_errors = False  # the trial must see a failure, not a silent eager fallback
    wrapped = {id(m): vars(m).get("forward") for m in modules}  # AMP's wrapper where enable_amp set one
    try:
        for module in modules:
            # Each module's forward as code of its own: past the recompile limit, a process that builds many models
            # of one class (tune's trials) would run the later ones uncompiled without a word.
            module.forward = own_code(module.forward)
            module.compile(mode=None if mode == "default" else mode)
        # On draws of its own: a seeded run takes the same random actions and minibatches, compiled or not.
        with own_rng(model.device):
            _trial_step(model, batch_size)
    except Exception as e:  # compilers fail in many ways (no C++ compiler, unsupported op, ...): all mean "fall back"
        for module in modules:
            module._compiled_call_impl = None  # what Module.compile set; torch has no public way to undo it
            amp_forward = wrapped[id(module)]
            if amp_forward is None:
                vars(module).pop("forward", None)  # the class's forward again
            else:
                module.forward = amp_forward
        vars(model.policy).pop("_sb3_gpu_compiled", None)  # an earlier compile's mark: its networks are eager again
        reason = f"torch.compile failed ({named(e, 200)}); training uncompiled"
        warn(reason, CompileFallbackWarning)
        return reason
    finally:
        th._dynamo.config.suppress_errors = previous
    policy: Any = model.policy
    policy._sb3_gpu_compiled = True  # see forgiving_recompiles
    return None


def forgiving_recompiles(model: BaseAlgorithm) -> contextlib.AbstractContextManager[Any]:
    """dynamo's ``suppress_errors`` on the calling thread while ``model`` trains, where :func:`compile_policy`
    compiled its networks: a shape seen only later (a last short minibatch, say) recompiles during training, and a
    recompile that fails then runs that frame uncompiled rather than ending the run. Put back after, so the user's own
    compiles keep the process's setting. torch 2.13's dynamo keeps its settings per thread (older ones, for the
    process): each thread that trains the model patches its own."""
    if getattr(model.__dict__.get("policy"), "_sb3_gpu_compiled", False):
        return th._dynamo.config.patch(suppress_errors=True)
    return contextlib.nullcontext()


def _trial_step(model: BaseAlgorithm, batch_size: int) -> None:
    """The training path (forward and backward on a training batch, gradients thrown away) and the rollout path
    (a no-grad forward on up to ``n_envs`` observations; the whole batch for dict observations), so that both compile
    now."""
    policy: Any = model.policy
    # Copies, sampled: the spaces' own generators draw SB3's random actions (learning_starts, exploration).
    observation_space, action_space = copy.deepcopy(model.observation_space), copy.deepcopy(model.action_space)
    obs_tensor, _ = policy.obs_to_tensor(_stack([observation_space.sample() for _ in range(batch_size)]))
    rollout = obs_tensor[: model.n_envs] if isinstance(obs_tensor, th.Tensor) else obs_tensor
    if hasattr(policy, "evaluate_actions"):
        actions = th.as_tensor(_stack([action_space.sample() for _ in range(batch_size)]), device=model.device)
        values, log_prob, _ = policy.evaluate_actions(obs_tensor, actions)
        loss, act = values.sum() + log_prob.sum(), policy
    else:
        act = getattr(policy, "q_net", None) or policy.quantile_net
        with th.no_grad():
            (getattr(policy, "q_net_target", None) or policy.quantile_net_target)(obs_tensor)
        loss = act(obs_tensor).sum()
    loss.backward()
    policy.optimizer.zero_grad(set_to_none=True)
    with th.no_grad():
        act(rollout)


def _stack(items: list[Any]) -> Any:
    if isinstance(items[0], dict):
        return {k: np.stack([i[k] for i in items]) for k in items[0]}
    return np.stack(items)
