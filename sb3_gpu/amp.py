"""Mixed precision for SB3 models without copying their ``train()``.

``enable_amp(model, "bf16" | "fp16")`` wraps the networks' forward passes (PPO's feature extractor, MLP extractor
and heads; the DQN family's online and target networks) in ``torch.autocast`` and hands their outputs back as
float32, so distributions and losses are computed in full precision. fp16 also gets dynamic loss scaling through three
seams: a gradient hook on each network output multiplies the incoming gradient by the scale (before it is cast to
fp16, where small gradients would underflow); a hook on each parameter divides it back before it is accumulated
(so SB3's gradient clipping sees true gradients); and the optimizer's ``step`` is wrapped to skip steps whose
gradients overflowed, halve the scale, and grow it again after a run of good steps.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.errors import ConfigError

AMP_MODES = ("auto", "off", "bf16", "fp16")
# What a wrapped ``optimizer.step`` returns when gradient accumulation held it back (see accumulate.py).
MICRO_BATCH = object()
_DTYPES = {"bf16": th.bfloat16, "fp16": th.float16}


class LossScaler:
    """Dynamic loss scale for fp16: halve on overflow, double after ``growth_interval`` good steps in a row."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000, min_scale: float = 1.0):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def step(self, optimizer: th.optim.Optimizer, original_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``original_step`` unless a gradient is inf/NaN; update the scale either way."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads and not th.stack(th._foreach_norm(grads)).isfinite().all():
            self.skipped_steps += 1
            self.good_steps = 0
            self.scale = max(self.scale / 2.0, self.min_scale)
            return None
        out = original_step(*args, **kwargs)
        if out is MICRO_BATCH:  # gradient accumulation held this step back: no optimizer step was taken
            return None
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0
        return out


class AmpState:
    """What ``enable_amp`` attached to a policy: the dtype, the device type, and the loss scaler for fp16."""

    def __init__(self, mode: str, device_type: str, scaler: LossScaler | None):
        self.mode, self.device_type, self.scaler = mode, device_type, scaler
        self.dtype = _DTYPES[mode]


def _networks(model: BaseAlgorithm) -> tuple[list[th.nn.Module], list[th.nn.Module], list[str]]:
    """(modules run under autocast, modules whose outputs feed the loss, policy methods whose outputs do).

    PPO's distribution math (log-probabilities, entropy) stays in float32: only its networks are autocast.
    """
    policy: Any = model.policy
    candidates = [getattr(policy, n, None) for n in ("q_net", "q_net_target", "quantile_net", "quantile_net_target")]
    q_nets = [m for m in candidates if isinstance(m, th.nn.Module)]
    if q_nets:
        return q_nets, q_nets, []
    if hasattr(policy, "evaluate_actions") and hasattr(policy, "mlp_extractor"):
        names = [
            *("features_extractor", "pi_features_extractor", "vf_features_extractor"),
            *("mlp_extractor", "action_net", "value_net"),
        ]
        found = {id(m): m for n in names if isinstance(m := getattr(policy, n, None), th.nn.Module)}
        compute = [m for m in found.values() if any(True for _ in m.parameters())]
        return compute, [], ["evaluate_actions"]
    raise ConfigError(f"AMP supports actor-critic (PPO, A2C) and DQN-family policies, not {type(policy).__name__}")


def _to_float(out: Any) -> Any:
    if isinstance(out, th.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, tuple):
        return tuple(_to_float(o) for o in out)
    return out


def _scale_gradients(out: Any, scaler: LossScaler) -> Any:
    """Make each float output that carries a gradient multiply it by the loss scale on the way back."""
    if isinstance(out, th.Tensor) and out.is_floating_point() and out.requires_grad:
        out.register_hook(lambda grad: grad * scaler.scale)
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


def _scaled_evaluate_actions(self: Any, *args: Any, **kwargs: Any) -> Any:
    scaler = self._sb3_gpu_amp.scaler
    return _scale_gradients(type(self).evaluate_actions(self, *args, **kwargs), scaler)


def _parameters(optimizer: th.optim.Optimizer) -> Iterable[th.nn.Parameter]:
    return (p for group in optimizer.param_groups for p in group["params"] if p.requires_grad)


def enable_amp(model: BaseAlgorithm, mode: str, *, init_scale: float = 2.0**16, growth_interval: int = 2000) -> AmpState:
    """Switch ``model``'s training step to ``bf16`` or ``fp16`` autocast (``fp16`` with dynamic loss scaling).

    Call it again after ``load`` made a new policy; it refuses a policy set up twice. Logs ``amp/scale`` and
    ``amp/skipped_steps`` for fp16. fp16 runs on the CPU too (slowly: it is there so that the scaling logic can be
    tested without a GPU); the plan only picks it for CUDA.
    """
    if mode not in _DTYPES:
        raise ConfigError(f"enable_amp: mode must be bf16 or fp16, got {mode!r}")
    policy: Any = model.policy
    if getattr(policy, "_sb3_gpu_amp", None) is not None:
        raise ConfigError("AMP is already enabled on this model's policy")
    device_type = model.device.type
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"AMP runs on cpu (bf16) or cuda, not {device_type}")
    state = AmpState(mode, device_type, LossScaler(init_scale, growth_interval) if mode == "fp16" else None)
    compute, loss_facing, methods = _networks(model)
    for module in compute:
        setattr(module, "_sb3_gpu_amp_module", state)  # noqa: B010 - plain attributes, not nn.Module state
        setattr(module, "_sb3_gpu_amp_scaled", any(module is m for m in loss_facing))  # noqa: B010
        module.forward = types.MethodType(_amp_forward, module)
    policy._sb3_gpu_amp = state
    if state.scaler is not None:
        if methods:  # evaluate_actions: its outputs feed PPO's loss
            policy.evaluate_actions = types.MethodType(_scaled_evaluate_actions, policy)
        _install_unscaling(model, policy.optimizer, state.scaler)
    return state


def _install_unscaling(model: BaseAlgorithm, optimizer: th.optim.Optimizer, scaler: LossScaler) -> None:
    for param in _parameters(optimizer):
        # A leaf's hook runs before its gradient is accumulated into .grad: divide the scale back out there.
        param.register_hook(lambda grad: grad / scaler.scale)
    original_step = optimizer.step
    owner = weakref.ref(model)

    @functools.wraps(original_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        held_back: list[bool] = []
        out = scaler.step(optimizer, lambda *a, **k: _note(original_step(*a, **k), held_back), *args, **kwargs)
        algo = owner()
        if not held_back and algo is not None and getattr(algo, "_logger", None) is not None:
            algo.logger.record("amp/scale", scaler.scale)
            algo.logger.record("amp/skipped_steps", scaler.skipped_steps)
        return out

    optimizer.step = step  # type: ignore[method-assign]


def _note(out: Any, held_back: list[bool]) -> Any:
    if out is MICRO_BATCH:
        held_back.append(True)
    return out


def amp_state(model: BaseAlgorithm) -> AmpState | None:
    """The AMP settings attached to ``model``'s policy, or None."""
    return getattr(model.policy, "_sb3_gpu_amp", None)
