"""Gradient accumulation: k minibatches per optimizer step, for PPO here and for the DQN family in
:mod:`sb3_gpu.extensions.per`, both through the model's :class:`~sb3_gpu.extensions.stepping.OptimizerStep`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3 import PPO

from sb3_gpu.common.checks import POS_INT
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.compile import forgiving_recompiles, python_int_spaces
from sb3_gpu.extensions.devicelog import DeviceLog
from sb3_gpu.extensions.graphstep import CompiledFunction, CompiledUpdate, Descent, refusal
from sb3_gpu.extensions.hostcopy import queued_observation_copies
from sb3_gpu.extensions.hostreads import no_argument_checks
from sb3_gpu.extensions.networks import narrow_linears
from sb3_gpu.extensions.rollout import DeviceRolloutBuffer
from sb3_gpu.extensions.stepping import (
    DeviceFigures,
    OptimizerStep,
    optimizer_step,
    optimizer_steps,
)

if TYPE_CHECKING:
    from stable_baselines3.common.type_aliases import MaybeCallback
    from typing_extensions import Self


def check_accumulation(grad_accum_steps: Any, n_steps: int, n_envs: int, batch_size: int) -> int:
    """``grad_accum_steps`` as an int; with more than one, PPO's minibatches must be of one size (``batch_size``
    divides ``n_steps * n_envs``) and a whole number of accumulation windows per epoch."""
    grad_accum_steps = POS_INT(grad_accum_steps, "grad_accum_steps")
    if grad_accum_steps > 1 and n_steps * n_envs % batch_size:
        # The step takes the micro-batches' mean gradient: a short last one would weigh as much as a full one.
        raise ConfigError(
            f"grad_accum_steps={grad_accum_steps} needs minibatches of one size: batch_size={batch_size} must divide "
            f"n_steps * n_envs = {n_steps} * {n_envs} = {n_steps * n_envs:,}"
        )
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


class _StagingCallback:
    """The run's callback, which SB3's ``collect_rollouts`` hands its locals after each env step and before the
    buffer's ``add``: there it tells the buffer that ``obs_tensor`` (the device copy made for the policy) holds
    ``_last_obs``, so that the observations cross to the device once, not twice."""

    def __init__(self, callback: Any, buffer: DeviceRolloutBuffer):
        self._callback, self._buffer = callback, buffer

    def update_locals(self, locals_: dict[str, Any]) -> None:
        host, device = getattr(locals_.get("self"), "_last_obs", None), locals_.get("obs_tensor")
        if isinstance(host, np.ndarray) and isinstance(device, th.Tensor):
            self._buffer.stage(host, device)
        self._callback.update_locals(locals_)

    def __getattr__(self, name: str) -> Any:  # on_step, on_rollout_start, ...: the callback's own
        return getattr(self._callback, name)


class GradAccumPPO(DeviceFigures, PPO):
    """SB3's PPO whose optimizer steps on the mean gradient of ``grad_accum_steps`` minibatches of ``batch_size``.

    With ``grad_accum_steps=1`` it computes what plain PPO computes (a test pins this). Its ``train()`` follows SB3's
    step for step, but reads nothing back from the device to log: the losses, clip fraction, approx KL, explained
    variance and std stay tensors until ``dump_logs`` reads them in one go; and the action distributions it builds skip
    torch's argument checks (each a wait for the device). With ``target_kl`` set, torch's step reads each minibatch's
    approx KL, as SB3 reads it, to stop early. The minibatches per epoch must be a multiple of ``grad_accum_steps``.
    With :meth:`compile_step` each minibatch's step after the slicing is one compiled graph (``extensions.graphstep``),
    and ``target_kl`` stops on the device: once a minibatch's KL is too large, its step and the epoch's later ones are
    held back there, and the flag is read once per epoch, where SB3's loop would have stopped. The held-back minibatches
    still run their forward and backward passes: a policy with dropout or batch norm would see them (SB3's have
    neither).
    """

    def __init__(self, *args: Any, grad_accum_steps: int = 1, **kwargs: Any):
        self.grad_accum_steps = grad_accum_steps  # read by _setup_model, which PPO.__init__ calls
        super().__init__(*args, **kwargs)
        if kwargs.get("_init_setup_model", True):  # a new model: refused at once (load checks when it trains)
            self._check_accumulation()

    def _setup_model(self) -> None:
        super()._setup_model()
        self.grad_accum_steps = POS_INT(self.grad_accum_steps, "grad_accum_steps")
        self._accumulator = accumulating_step(self, self.grad_accum_steps)
        self._device_log = DeviceLog()
        self._compiled_step: CompiledUpdate | None = None
        self._compiled_act: CompiledFunction | None = None
        for step in optimizer_steps(self):
            step.defer_checks = True  # dump_logs reads the NaN guard's flags: a fused optimizer skips on the device

    def _check_accumulation(self) -> None:
        """The windows must fit this env count's minibatches: a model loaded to act with fewer envs (an evaluation's)
        need not, so it is checked where it trains."""
        check_accumulation(self.grad_accum_steps, self.n_steps, self.n_envs, self.batch_size)

    def learn(
        self,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "PPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> Self:
        self._check_accumulation()
        with forgiving_recompiles(self):
            return super().learn(total_timesteps, callback, log_interval, tb_log_name, reset_num_timesteps, progress_bar)

    def _excluded_save_params(self) -> list[str]:
        excluded = ["_accumulator", "_device_log", "_compiled_step", "_compiled_act", "_descent", "_step_state"]
        return [*super()._excluded_save_params(), *excluded]

    def compile_step(self, mode: str = "default", collect: bool = True) -> str | None:
        """Run each minibatch's gradient step (after the slicing) as one compiled graph, a CUDA graph on CUDA with
        ``mode="reduce-overhead"``; ``mode="eager"`` runs the same step uncompiled. Returns why the step stays
        torch's own, or None. With ``collect`` the rollout's forward pass (observations to actions, values and
        log-probabilities) is compiled too. Call it again after ``load``."""
        python_int_spaces(self.policy)
        narrow_linears(self.policy)
        self._compiled_act = CompiledFunction(self._act, mode, "rollout forward pass") if collect else None
        optimizer = self.policy.optimizer
        guard = optimizer_step(optimizer, self.policy)
        reason = refusal(optimizer, guard, self.policy.obs_to_tensor(self.observation_space.sample())[0])
        if reason is None:
            self._descent = Descent(optimizer, guard, lambda: self.max_grad_norm)  # read at each step, as SB3's
            self._compiled_step = CompiledUpdate(self._graph_step, [self._descent], mode)
            # The clip ranges and the KL limit as tensors (a schedule's new float each train() would compile the step
            # anew), and target_kl's stop: [clip range, clip range vf, 1.5 * target_kl, stopped, KL at the stop, steps
            # held back since].
            self._step_state = th.zeros(6, device=self.device)
            th._dynamo.mark_static_address(self._step_state)  # changed in place: a CUDA graph keeps it where it is
        return reason

    def collect_rollouts(self, env: Any, callback: Any, rollout_buffer: Any, n_rollout_steps: int) -> bool:
        if isinstance(rollout_buffer, DeviceRolloutBuffer):
            callback = _StagingCallback(callback, rollout_buffer)
        # Building each step's distribution would read it back twice; the observations cross in one queued copy.
        with no_argument_checks(), queued_observation_copies():
            if self._compiled_act is None:
                return super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps)
            self.policy.forward = self._compiled_act  # type: ignore[method-assign,assignment]  # what SB3's rollout calls
            try:
                return super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps)
            finally:
                del self.policy.forward

    def _act(self, obs: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
        """The policy's own forward pass (sampled actions, values, log-probabilities), for one compiled graph."""
        out = type(self.policy).forward(self.policy, obs)
        self.policy.action_dist.distribution = None  # type: ignore[assignment]  # kept, it would leave the graph
        return out

    def train(self) -> None:
        if self._accumulator is not None:
            self._accumulator.reset()
        with no_argument_checks():
            self._train()
        if self._accumulator is not None:
            self._accumulator.reset()  # target_kl may stop an epoch between micro-batches

    def _minibatch_loss(
        self,
        observations: th.Tensor,
        actions: th.Tensor,
        old_values: th.Tensor,
        old_log_prob: th.Tensor,
        advantages: th.Tensor,
        returns: th.Tensor,
        clip_range: float | th.Tensor,
        clip_range_vf: float | th.Tensor | None,
    ) -> tuple[th.Tensor, tuple[th.Tensor, th.Tensor]]:
        """SB3's PPO loss of a minibatch, with the figures it logs (stacked in ``_FIGURES``' order) and the approx KL."""
        values, log_prob, entropy = self.policy.evaluate_actions(observations, actions)
        values = values.flatten()
        if self.normalize_advantage and len(advantages) > 1:  # one sample has no spread (SB3 issue #325)
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        ratio = th.exp(log_prob - old_log_prob)
        policy_loss = -th.min(advantages * ratio, advantages * th.clamp(ratio, 1 - clip_range, 1 + clip_range)).mean()  # type: ignore[arg-type]
        clip_fraction = th.mean((th.abs(ratio - 1) > clip_range).float())
        if clip_range_vf is None:
            values_pred = values
        else:  # the value's change from the rollout's, clipped (this depends on the reward scale)
            values_pred = old_values + th.clamp(values - old_values, -clip_range_vf, clip_range_vf)  # type: ignore[arg-type]
        value_loss = F.mse_loss(returns, values_pred)
        entropy_loss = -th.mean(-log_prob) if entropy is None else -th.mean(entropy)
        loss = policy_loss + self.ent_coef * entropy_loss + self.vf_coef * value_loss
        with th.no_grad():  # the approximate reverse KL (Schulman's k3 estimator), as SB3 computes it
            log_ratio = log_prob - old_log_prob
            approx_kl = th.mean((th.exp(log_ratio) - 1) - log_ratio)
        figures = th.stack([policy_loss, clip_fraction, value_loss, entropy_loss]).detach()
        return loss, (figures, approx_kl)

    def _graph_step(self, minibatch: _Minibatch, vf_clipped: bool, kl_stop: bool) -> tuple[th.Tensor, ...]:
        """A minibatch's whole step, for one compiled graph: the loss, the descent and, with ``kl_stop``, target_kl's
        stop on the device. Returns the loss, the logged figures, the approx KL and, with ``kl_stop``, whether SB3
        would have computed this minibatch (False after a stop earlier in the epoch)."""
        state = self._step_state
        loss, (figures, approx_kl) = self._minibatch_loss(*minibatch, state[0], state[1] if vf_clipped else None)
        # SB3's evaluate_actions keeps the distribution on the policy: a tensor of the graph's autograd graph that
        # would leave the compiled step (which dynamo refuses). Nothing reads it after the step.
        self.policy.action_dist.distribution = None  # type: ignore[assignment]
        if not kl_stop:
            self._descent(loss)
            return loss, figures, approx_kl
        # As SB3: the minibatch whose KL is too large is computed and logged, and neither it nor a later one steps.
        counted = state[3] == 0
        stop = counted & (approx_kl > state[2])
        stepping = counted & ~stop
        self._descent(loss, stepping)
        state[3:5].copy_(th.where(stop, th.stack([th.ones_like(approx_kl), approx_kl]), state[3:5]))
        state[5].add_((~stepping).float())
        return loss, figures, approx_kl, counted

    def _train(self) -> None:
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        clip_range = self.clip_range(self._current_progress_remaining)  # type: ignore[operator]
        clip_range_vf = None if self.clip_range_vf is None else self.clip_range_vf(self._current_progress_remaining)  # type: ignore[operator]
        log = self._device_log
        compiled = self._compiled_step
        if compiled is not None and not compiled.usable():
            compiled = None  # an extension set since compile_step: torch's step, which honours it
        if compiled is not None:  # fill_, not a copy from a host tensor: that copy would wait for the device
            self._step_state[0].fill_(clip_range)
            self._step_state[1].fill_(clip_range_vf or 0.0)
            if self.target_kl is not None:
                self._step_state[2].fill_(1.5 * self.target_kl)
        continue_training, loss = True, th.zeros(())  # the loss of the last minibatch SB3 would compute
        for epoch in range(self.n_epochs):
            kl_sum: Any = None  # SB3 logs the approx KL of the last epoch only
            kl_count: Any = 0
            if compiled is not None and self.target_kl is not None:
                self._step_state[3:].zero_()
            for rollout_data in self.rollout_buffer.get(self.batch_size):
                actions = rollout_data.actions
                if isinstance(self.action_space, spaces.Discrete):
                    actions = rollout_data.actions.long().flatten()
                inputs: _Minibatch = (
                    rollout_data.observations,
                    actions,
                    rollout_data.old_values,
                    rollout_data.old_log_prob,
                    rollout_data.advantages,
                    rollout_data.returns,
                )
                if compiled is not None:
                    kl_stop = self.target_kl is not None
                    step_loss, figures, approx_kl, *gate = compiled(inputs, clip_range_vf is not None, kl_stop)
                    counted = gate[0] if kl_stop else None
                    if counted is not None and kl_sum is not None:  # after a stop the epoch's later ones count nowhere
                        step_loss, approx_kl = th.where(counted, step_loss, loss), th.where(counted, approx_kl, 0.0)
                    loss = step_loss
                    log.mean(_FIGURES, figures, counts=counted)
                    kl_sum = approx_kl if kl_sum is None else kl_sum + approx_kl
                    kl_count = kl_count + (counted.long() if counted is not None else 1)
                    continue
                loss, (figures, approx_kl) = self._minibatch_loss(*inputs, clip_range, clip_range_vf)
                log.mean(_FIGURES, figures)
                kl_sum, kl_count = approx_kl if kl_sum is None else kl_sum + approx_kl, kl_count + 1
                if self.target_kl is not None and float(approx_kl) > 1.5 * self.target_kl:  # the one read allowed
                    continue_training = False
                    if self.verbose >= 1:
                        print(f"Early stopping at step {epoch} due to reaching max kl: {float(approx_kl):.2f}")
                    break
                self.policy.optimizer.zero_grad()
                loss.backward()
                th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                self.policy.optimizer.step()
            if compiled is not None and self.target_kl is not None:
                stopped, kl_at_stop, held = self._step_state[3:].tolist()  # the one read allowed, once per epoch
                self._descent.guard.steps -= int(held)  # counted as taken when called: SB3 never took them
                if stopped:
                    continue_training = False
                    if self.verbose >= 1:
                        print(f"Early stopping at step {epoch} due to reaching max kl: {kl_at_stop:.2f}")
            self._n_updates += 1
            if not continue_training:
                break
        if kl_sum is not None:
            log.latest("train/approx_kl", kl_sum / kl_count)
        log.latest("train/loss", loss)
        buffer = self.rollout_buffer
        if isinstance(buffer, DeviceRolloutBuffer):  # its tensors where they are (values and returns copy to the host)
            log.latest("train/explained_variance", _explained_variance(buffer.value_tensor, buffer.return_tensor))
        else:
            log.latest("train/explained_variance", _explained_variance(buffer.values, buffer.returns))
        if hasattr(self.policy, "log_std"):
            log.latest("train/std", th.exp(self.policy.log_std).mean())
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/clip_range", clip_range)
        if clip_range_vf is not None:
            self.logger.record("train/clip_range_vf", clip_range_vf)


# A minibatch as the loss takes it: observations, actions, old values, old log-probs, advantages, returns.
_Minibatch = tuple[th.Tensor, th.Tensor, th.Tensor, th.Tensor, th.Tensor, th.Tensor]

# What each minibatch logs (their means over the minibatches since the last write), in _minibatch_loss's order.
_FIGURES = ("train/policy_gradient_loss", "train/clip_fraction", "train/value_loss", "train/entropy_loss")


def _explained_variance(predicted: th.Tensor | np.ndarray, returns: th.Tensor | np.ndarray) -> th.Tensor:
    """SB3's ``explained_variance`` (1 - Var[returns - predicted] / Var[returns]; NaN where the returns do not vary),
    as a tensor where the rollout lives: on the host for SB3's buffer, on the device for ours."""
    y_pred, y_true = th.as_tensor(predicted).flatten().double(), th.as_tensor(returns).flatten().double()
    var_y = th.var(y_true, correction=0)
    return th.where(var_y == 0, th.nan, 1 - th.var(y_true - y_pred, correction=0) / var_y)
