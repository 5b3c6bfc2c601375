"""Gradient accumulation: k minibatches per optimizer step, for PPO here and for the DQN family in
:mod:`sb3_gpu.extensions.per`, both through the model's :class:`~sb3_gpu.extensions.stepping.OptimizerStep`."""

from __future__ import annotations

from typing import Any

from stable_baselines3 import PPO

from sb3_gpu.common.checks import POS_INT
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.stepping import OptimizerStep, optimizer_step


def check_accumulation(grad_accum_steps: Any, n_steps: int, n_envs: int, batch_size: int) -> int:
    """``grad_accum_steps`` as an int; PPO's minibatches per epoch must be a whole number of accumulation windows."""
    grad_accum_steps = POS_INT(grad_accum_steps, "grad_accum_steps")
    minibatches = -(-n_steps * n_envs // batch_size)
    if minibatches % grad_accum_steps:
        raise ConfigError(
            f"grad_accum_steps={grad_accum_steps} must divide the {minibatches} minibatches per epoch"
            f" (n_steps * n_envs / batch_size = {n_steps} * {n_envs} / {batch_size})"
        )
    return grad_accum_steps


def accumulating_step(model: Any, grad_accum_steps: int) -> OptimizerStep | None:
    """Set ``model``'s optimizer to step once per ``grad_accum_steps`` backward passes (None when that is one)."""
    if grad_accum_steps == 1:
        return None
    step = optimizer_step(model.policy.optimizer, model.policy)
    step.accumulate(grad_accum_steps)
    return step


class GradAccumPPO(PPO):
    """SB3's PPO whose optimizer steps on the mean gradient of ``grad_accum_steps`` minibatches of ``batch_size``.

    With ``grad_accum_steps=1`` it is plain PPO. The minibatches per epoch must be a multiple of it.
    """

    def __init__(self, *args: Any, grad_accum_steps: int = 1, **kwargs: Any):
        self.grad_accum_steps = grad_accum_steps  # read by _setup_model, which PPO.__init__ calls
        super().__init__(*args, **kwargs)

    def _setup_model(self) -> None:
        super()._setup_model()
        self.grad_accum_steps = check_accumulation(self.grad_accum_steps, self.n_steps, self.n_envs, self.batch_size)
        self._accumulator = accumulating_step(self, self.grad_accum_steps)

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_accumulator"]

    def train(self) -> None:
        if self._accumulator is not None:
            self._accumulator.reset()
        super().train()
        if self._accumulator is not None:
            self._accumulator.reset()  # target_kl may stop an epoch between micro-batches
