"""Mixed precision for SB3 models without copying their ``train()``.

``enable_amp(model, "bf16" | "fp16")`` wraps the networks' forward passes (PPO's feature extractor, MLP extractor
and heads; the DQN family's online and target networks; SAC's, TD3's and TQC's actors and critics) in
``torch.autocast`` and hands their outputs back as float32, so distributions and losses are computed in full
precision. The last layer of each Q-network (and TD3's actor), which gives the values themselves, stays in float32,
as do SAC's Gaussian heads. fp16 (PPO and the DQN family) also gets dynamic loss scaling: a
gradient hook on each output that feeds the loss multiplies the incoming gradient by the scale (before it is cast to
fp16, where small gradients would underflow), which is what scaling the loss does; the model's
:class:`~sb3_gpu.extensions.stepping.OptimizerStep` divides it back out before clipping, skips steps whose gradients
overflowed and updates the scale.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.common.checks import count_arg
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.networks import policy_networks, steps_one_optimizer
from sb3_gpu.extensions.stepping import LossScale, optimizer_step

_DTYPES = {"bf16": th.bfloat16, "fp16": th.float16}


class AmpState:
    """What :func:`enable_amp` attached to a policy: the dtype, the device type, and the loss scale for fp16."""

    def __init__(self, mode: str, device_type: str, scaler: LossScale | None):
        self.mode, self.device_type, self.scaler = mode, device_type, scaler
        self.dtype = _DTYPES[mode]


def _to_float(out: Any) -> Any:
    if isinstance(out, th.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, tuple):
        return tuple(_to_float(o) for o in out)
    return out


def _scale_gradients(out: Any, scaler: LossScale) -> Any:
    """Make each float output that carries a gradient multiply it by the loss scale on the way back."""
    if scaler.hooks_off:
        return out
    if isinstance(out, th.Tensor) and out.is_floating_point() and out.requires_grad:
        out.register_hook(lambda grad: grad * scaler.factor)
    elif isinstance(out, tuple):
        for o in out:
            _scale_gradients(o, scaler)
    return out


# Wrappers are bound with types.MethodType to module-level functions and read their settings from the object, so that
# a deep copy of a policy rebinds them to the copy (a closure would keep running the original's weights).
def _amp_forward(self: th.nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: AmpState = self.__dict__["_sb3_gpu_amp_module"]
    with th.autocast(device_type=state.device_type, dtype=state.dtype):
        out = type(self).forward(self, *args, **kwargs)
    out = _to_float(out)
    return _scale_gradients(out, state.scaler) if self._sb3_gpu_amp_scaled and state.scaler is not None else out


def _full_precision_forward(self: th.nn.Module, x: th.Tensor) -> th.Tensor:
    # A Q-value of 50 has a bf16 step of 0.25, more than the gap between two actions' values on CartPole: the head
    # runs in float32 (its input cast up), so targets and argmax see full-precision values.
    state: AmpState = self.__dict__["_sb3_gpu_amp_module"]
    with th.autocast(device_type=state.device_type, enabled=False):
        return type(self).forward(self, x.float())


def _scaled_evaluate_actions(self: Any, *args: Any, **kwargs: Any) -> Any:
    scaler = self._sb3_gpu_amp.scaler
    return _scale_gradients(type(self).evaluate_actions(self, *args, **kwargs), scaler)


def enable_amp(model: BaseAlgorithm, mode: str, *, init_scale: float = 2.0**16, growth_interval: int = 2000) -> AmpState:
    """Switch ``model``'s training step to ``bf16`` or ``fp16`` autocast (``fp16`` with dynamic loss scaling).

    Call it again after ``load`` made a new policy; it refuses a policy set up twice. Logs ``amp/scale`` and
    ``amp/skipped_steps`` for fp16. fp16 runs on the CPU too (slowly: it is there so that the scaling logic can be
    tested without a GPU); the plan only picks it for CUDA.
    """
    if not isinstance(model, BaseAlgorithm):
        raise TypeError(f"enable_amp takes an SB3 model, got {model!r}")
    if mode not in _DTYPES:
        raise ConfigError(f"enable_amp: mode must be bf16 or fp16, got {mode!r}")
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not 0 < init_scale < float("inf"):
        raise ConfigError(f"enable_amp: init_scale must be a finite number > 0, got {init_scale!r}")
    count_arg(growth_interval, "enable_amp: growth_interval")
    policy: Any = model.policy
    if getattr(policy, "_sb3_gpu_amp", None) is not None:
        raise ConfigError("AMP is already enabled on this model's policy")
    device_type = model.device.type
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"AMP runs on cpu (bf16) or cuda, not {device_type}")
    networks = policy_networks(model)
    if mode == "fp16" and not steps_one_optimizer(type(policy)):
        raise ConfigError(
            f"amp=fp16 is for one-optimizer policies (PPO, the DQN family), not {type(model).__name__}: its loss scale "
            "would have to span the several optimizers a step takes; use bf16 or off"
        )
    scaler = LossScale(init_scale, growth_interval=growth_interval) if mode == "fp16" else None
    if scaler is not None:  # a loaded model goes on from the scale its run reached (see record_loss_scale)
        scaler.load_state(getattr(model, _SAVED_SCALE, None))
    state = AmpState(mode, device_type, scaler)
    for module in networks.compute:
        setattr(module, "_sb3_gpu_amp_module", state)  # noqa: B010 - plain attributes, not nn.Module state
        setattr(module, "_sb3_gpu_amp_scaled", any(module is m for m in networks.loss_facing))  # noqa: B010
        module.forward = types.MethodType(_amp_forward, module)
    for head in networks.value_heads:
        setattr(head, "_sb3_gpu_amp_module", state)  # noqa: B010
        head.forward = types.MethodType(_full_precision_forward, head)
    policy._sb3_gpu_amp = state
    if scaler is not None:
        if networks.loss_methods:  # evaluate_actions: its outputs feed PPO's loss
            policy.evaluate_actions = types.MethodType(_scaled_evaluate_actions, policy)
        step = optimizer_step(policy.optimizer, policy)
        step.scale_losses(scaler)
        step.listeners.append(_scale_logger(model, scaler))
    return state


def _scale_logger(model: BaseAlgorithm, scaler: LossScale) -> Any:
    owner = weakref.ref(model)

    def log() -> None:
        algo = owner()
        if algo is None or getattr(algo, "_logger", None) is None:
            return
        log = getattr(algo, "_device_log", None)
        if scaler.tensors is not None and log is not None:  # read with the other figures, when the logs are written
            log.latest("amp/scale", scaler.tensors[0])
            log.latest("amp/skipped_steps", scaler.tensors[2])
            return
        algo.logger.record("amp/scale", scaler.scale)
        algo.logger.record("amp/skipped_steps", scaler.skipped_steps)

    return log


# A model attribute: SB3 saves a model's attributes in its zip, but of the policy only its weights.
_SAVED_SCALE = "_sb3_gpu_loss_scale"


def record_loss_scale(model: BaseAlgorithm) -> None:
    """Before a save: keep fp16's loss scale where the zip keeps it, so that a resumed run goes on from the scale its
    run had settled at (from the initial one, it would skip steps again until the scale fell back) and its count of
    skipped steps. None where the model trains without a loss scale."""
    state = amp_state(model)
    setattr(model, _SAVED_SCALE, state.scaler.state() if state is not None and state.scaler is not None else None)


def amp_state(model: BaseAlgorithm) -> AmpState | None:
    """The AMP settings attached to ``model``'s policy, or None."""
    return getattr(model.policy, "_sb3_gpu_amp", None)
