"""Gradient accumulation for PPO through hooks, without copying PPO's ``train()``.

PPO's step is ``zero_grad(); loss.backward(); clip_grad_norm_(); step()`` per minibatch. With ``k`` micro-batches
per step, a post-accumulate-grad hook moves each non-final micro-batch's gradient aside (so clipping sees zeros and
the wrapped ``step`` does nothing); on the final one it adds the saved sum back and divides by ``k``, so clipping
and the optimizer see the mean gradient of ``k * batch_size`` samples, as one big minibatch would give them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch as th
from stable_baselines3 import PPO

from sb3_gpu.amp import MICRO_BATCH
from sb3_gpu.errors import ConfigError


class _Accumulator:
    def __init__(self, optimizer: th.optim.Optimizer, steps: int):
        self.steps = steps
        self.micro = -1  # index of the micro-batch being computed; advanced by zero_grad, which PPO calls first
        self.saved: dict[th.Tensor, th.Tensor] = {}
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._hook)
        zero_grad, step = optimizer.zero_grad, optimizer.step

        @functools.wraps(zero_grad)
        def counting_zero_grad(*args: Any, **kwargs: Any) -> None:
            self.micro += 1
            zero_grad(*args, **kwargs)

        @functools.wraps(step)
        def accumulating_step(*args: Any, **kwargs: Any) -> Any:
            if not self._last():
                return MICRO_BATCH
            for param, saved in self.saved.items():  # a parameter without a gradient in the last micro-batch
                param.grad = saved / self.steps
            self.saved.clear()
            return step(*args, **kwargs)

        optimizer.zero_grad = counting_zero_grad  # type: ignore[method-assign]
        optimizer.step = accumulating_step  # type: ignore[method-assign]

    def _last(self) -> bool:
        return self.micro % self.steps == self.steps - 1

    def _hook(self, param: th.Tensor) -> None:
        assert param.grad is not None
        saved = self.saved.pop(param, None)
        if self._last():
            if saved is not None:
                param.grad.add_(saved)
            param.grad.div_(self.steps)
        else:
            self.saved[param] = param.grad.clone() if saved is None else saved.add_(param.grad)
            param.grad.zero_()

    def reset(self) -> None:
        self.micro = -1
        self.saved.clear()


class GradAccumPPO(PPO):
    """SB3's PPO whose optimizer steps on the mean gradient of ``grad_accum_steps`` minibatches of ``batch_size``.

    With ``grad_accum_steps=1`` it is plain PPO. The minibatches per epoch must be a multiple of it.
    """

    def __init__(self, *args: Any, grad_accum_steps: int = 1, **kwargs: Any):
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ConfigError(f"grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}")
        self.grad_accum_steps = grad_accum_steps  # read by _setup_model, which PPO.__init__ calls
        self._accumulator: _Accumulator | None = None
        super().__init__(*args, **kwargs)

    def _setup_model(self) -> None:
        super()._setup_model()
        minibatches = -(-self.n_steps * self.n_envs // self.batch_size)
        if minibatches % self.grad_accum_steps:
            raise ConfigError(
                f"grad_accum_steps={self.grad_accum_steps} must divide the {minibatches} minibatches per epoch"
                f" (n_steps * n_envs / batch_size = {self.n_steps} * {self.n_envs} / {self.batch_size})"
            )
        self._accumulator = _Accumulator(self.policy.optimizer, self.grad_accum_steps) if self.grad_accum_steps > 1 else None

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_accumulator"]

    def train(self) -> None:
        if self._accumulator is not None:
            self._accumulator.reset()
        super().train()
        if self._accumulator is not None:
            self._accumulator.reset()  # target_kl may stop an epoch between micro-batches
