"""DQN and QR-DQN with prioritized replay, gradient accumulation and overlapped training, each of which may be off."""

from __future__ import annotations

from typing import Any

import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from sb3_contrib import QRDQN
from stable_baselines3 import DQN

from sb3_gpu.common.checks import PER_CHECKS, POS_INT, bool_arg
from sb3_gpu.extensions.accumulate import accumulating_step
from sb3_gpu.extensions.compile import python_int_spaces
from sb3_gpu.extensions.devicelog import DeviceLog, GraphSums
from sb3_gpu.extensions.graphstep import Batch, CompiledStep, refusal
from sb3_gpu.extensions.handoff import StagedObservations
from sb3_gpu.extensions.networks import narrow_linears
from sb3_gpu.extensions.overlap import OverlappedTraining
from sb3_gpu.extensions.per.buffer import PrioritizedReplayBuffer
from sb3_gpu.extensions.per.device import DevicePrioritizedReplayBuffer
from sb3_gpu.extensions.quantile import quantile_huber
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.extensions.stepping import DeviceFigures, optimizer_step, optimizer_steps, record_with_guards

_PRIORITIZED = (PrioritizedReplayBuffer, DevicePrioritizedReplayBuffer)  # the host's trees, and the device's


class _PrioritizedTraining(DeviceFigures, StagedObservations):
    """``train()`` for the DQN family with importance-weighted losses and priority updates.

    It follows SB3's ``DQN.train`` step for step; subclasses supply only ``_per_sample_loss``. Each gradient step
    takes ``grad_accum_steps`` micro-batches, accumulated by the optimizer's step wrapper as PPO's are. With a plain
    ReplayBuffer and ``grad_accum_steps=1`` it computes exactly what SB3 computes (a test pins this).

    Unlike SB3's, it reads nothing back from the device to log: the losses (their mean since the last write) and the
    device PER figures stay tensors until ``dump_logs``, which reads them in one go. With :meth:`compile_step` each
    gradient step, all its micro-batches, is one compiled graph (``extensions.graphstep``), with the sampling inside
    where the buffer allows it.
    """

    grad_accum_steps: int
    per_beta_fraction: float
    replay_buffer_kwargs: dict[str, Any]

    def __init__(
        self,
        *args: Any,
        grad_accum_steps: int = 1,
        per_beta_fraction: float = 1.0,
        overlap_training: bool = False,
        **kwargs: Any,
    ):
        # Set before SB3's __init__, which calls _setup_model (as load does, after restoring the saved attributes).
        self.grad_accum_steps = POS_INT(grad_accum_steps, "grad_accum_steps")
        self.per_beta_fraction = PER_CHECKS["beta_fraction"](per_beta_fraction, "per.beta_fraction")
        self.overlap_training = bool_arg(overlap_training, "overlap_training")
        super().__init__(*args, **kwargs)

    def _setup_model(self) -> None:
        actions = self.action_space  # type: ignore[attr-defined]
        if isinstance(actions, spaces.Discrete) and actions.start != 0:
            # SB3's loss fails on such actions only once a warm-up sample of n is drawn; the mask of _at_actions
            # would take its Q-value as 0 and train on without a word.
            raise ValueError(f"{type(self).__name__} takes Discrete actions numbered from 0; the env has {actions}")
        super()._setup_model()  # type: ignore[misc]
        self._accumulator = accumulating_step(self, self.grad_accum_steps)
        self._device_log = DeviceLog()
        self._compiled_step: CompiledStep | None = None
        for step in optimizer_steps(self):  # type: ignore[arg-type]
            step.defer_checks = True  # dump_logs reads the NaN guard's flags: a fused optimizer skips on the device

    def _excluded_save_params(self) -> list[str]:
        excluded = ["_accumulator", "_device_log", "_compiled_step", "_position", "_fixed_buffer", "_graph_sums"]
        return [*super()._excluded_save_params(), *excluded]  # type: ignore[misc]

    @property
    def per_beta0(self) -> float:
        """Beta at the start of training: the buffer's ``beta`` argument."""
        return float((self.replay_buffer_kwargs or {}).get("beta", 0.4))

    def _per_sample_loss(self, data: Any, discounts: th.Tensor | float) -> tuple[th.Tensor, th.Tensor]:
        """The loss of each sample of ``data`` and its TD error."""
        raise NotImplementedError

    def compile_step(self, mode: str = "default", collect: bool = True) -> str | None:
        """Run each gradient step (its ``grad_accum_steps`` micro-batches, and their sampling where the buffer can
        sample inside a graph) as one compiled graph, a CUDA graph on CUDA with ``mode="reduce-overhead"``;
        ``mode="eager"`` runs the same step uncompiled. Returns why the step stays torch's own, or None. Collection
        runs the Q-network as it is (``compile_policy`` compiles it), whatever ``collect`` says. Call it again after
        ``load``."""
        python_int_spaces(self.policy)  # type: ignore[attr-defined]
        narrow_linears(self.policy)  # type: ignore[attr-defined]
        optimizer = self.policy.optimizer  # type: ignore[attr-defined]
        guard = optimizer_step(optimizer, self.policy)  # type: ignore[attr-defined]
        obs = self.policy.obs_to_tensor(self.observation_space.sample())[0]  # type: ignore[attr-defined]
        reason = refusal(optimizer, guard, obs, accumulates=True) or self._host_trees_refusal(self.replay_buffer)  # type: ignore[attr-defined]
        if reason is None:

            def clip() -> float | None:  # read at each step, as SB3 reads it
                return self.max_grad_norm  # type: ignore[attr-defined]

            self._compiled_step = CompiledStep(self._graph_loss, optimizer, guard, clip, mode, accumulates=True)
            self._graph_sums = GraphSums(("train/loss",), self.device)  # type: ignore[attr-defined]
            self._position = th.zeros(2, dtype=th.long, device=self.device)  # type: ignore[attr-defined]
            th._dynamo.mark_static_address(self._position)
            self._fixed_buffer: Any = None
            self._fix_buffer(self.replay_buffer)  # type: ignore[attr-defined]
        return reason

    def _host_trees_refusal(self, buffer: Any) -> str | None:
        """Why ``buffer`` rules out a compiled step: with accumulation, each micro-batch's priorities are updated
        before the next one is sampled, which one graph can do only where it samples and updates the trees itself."""
        if self.grad_accum_steps == 1 or not isinstance(buffer, _PRIORITIZED) or self._samples_in_graph(buffer):
            return None
        return (
            "gradient accumulation with prioritized replay whose trees are searched on the host: each micro-batch's "
            "priorities are updated before the next one is sampled, between graphs"
        )

    def _samples_in_graph(self, buffer: Any) -> bool:
        env = self._vec_normalize_env  # type: ignore[attr-defined]
        return type(buffer) in (DeviceReplayBuffer, DevicePrioritizedReplayBuffer) and buffer.samples_in_graph(env)

    def _fix_buffer(self, buffer: Any) -> None:
        """Fix the addresses of what the compiled step samples from (and with PER, updates) inside its graph, so that
        a CUDA graph reads and writes them in place: once per buffer (a resumed run loads another one)."""
        if buffer is self._fixed_buffer or type(buffer) not in (DeviceReplayBuffer, DevicePrioritizedReplayBuffer):
            return
        if isinstance(buffer, DevicePrioritizedReplayBuffer):
            buffer.size_strata(self.batch_size)  # type: ignore[attr-defined]
        for t in buffer.storage():
            th._dynamo.mark_static_address(t)
        self._fixed_buffer = buffer

    def _graph_loss(
        self, source: str, micro_batches: tuple[tuple[Any, ...], ...], *shared: Any
    ) -> tuple[th.Tensor, tuple[th.Tensor, ...]]:
        """The compiled step's loss: the mean of its micro-batches' losses (whose gradient is the mean of theirs, as
        the accumulating torch step takes it), and each one's TD errors. Each micro-batch's inputs, by ``source``:
        ``batch`` (a sampled batch: ``batch, discounts, weights``), ``uniform`` (the batch that ``draws`` and the
        shared ``position`` pick from a uniform device buffer) or ``prioritized`` (the batch that ``uniforms`` and
        ``position`` pick from a prioritized device buffer, whose priorities its TD errors then update, before the
        next micro-batch is drawn): the last two sampled inside the graph."""
        losses, td_errors = [], []
        for inputs in micro_batches:
            loss, (td,) = self._micro_batch_loss(source, *inputs, *shared)
            losses.append(loss)
            td_errors.append(td)
        loss = losses[0] if len(losses) == 1 else th.stack(losses).mean()
        self._graph_sums.add({"train/loss": loss})
        # Sampled inside the graph, the TD errors were used there: no output to copy out of a CUDA graph's pool.
        return loss, tuple(td_errors) if source == "batch" else ()

    def _micro_batch_loss(self, source: str, *inputs: Any) -> tuple[th.Tensor, tuple[th.Tensor, ...]]:
        if source == "batch":
            return self._weighted_loss(*inputs)
        buffer = self.replay_buffer  # type: ignore[attr-defined]
        data = buffer.samples_at_draws(*inputs) if source == "uniform" else buffer.samples_at_uniforms(*inputs)
        batch = Batch(data.observations, data.actions, data.next_observations, data.dones, data.rewards)
        discounts = data.discounts if data.discounts is not None else self.gamma  # type: ignore[attr-defined]
        if source == "uniform":
            return self._weighted_loss(batch, discounts, None)
        loss, (td_errors,) = self._weighted_loss(batch, discounts, data.weights.flatten())
        # Before the backward pass, as the eager step: a NaN TD error is refused before it reaches the tree.
        buffer.update_priorities(data.indices, td_errors.detach())
        return loss, (td_errors,)

    def _weighted_loss(
        self, batch: Batch, discounts: th.Tensor | float, weights: th.Tensor | None
    ) -> tuple[th.Tensor, tuple[th.Tensor, ...]]:
        """The loss of a batch, its mean importance-weighted with PER; and the TD errors."""
        per_sample, td_errors = self._per_sample_loss(batch, discounts)
        return (per_sample * weights).mean() if weights is not None else per_sample.mean(), (td_errors,)

    def _anneal_beta(self) -> float:
        progress = 1.0 - self._current_progress_remaining  # type: ignore[attr-defined]
        return self.per_beta0 + (1.0 - self.per_beta0) * min(1.0, progress / self.per_beta_fraction)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        self.policy.set_training_mode(True)  # type: ignore[attr-defined]
        optimizer = self.policy.optimizer  # type: ignore[attr-defined]
        self._update_learning_rate(optimizer)  # type: ignore[attr-defined]
        buffer = self.replay_buffer  # type: ignore[attr-defined]
        per = buffer if isinstance(buffer, _PRIORITIZED) else None
        if per is not None:
            per.beta = self._anneal_beta()
        if self._accumulator is not None:
            self._accumulator.reset()
        compiled = self._compiled_step
        if compiled is not None and (not compiled.usable() or self._host_trees_refusal(buffer)):
            # Accumulation or fp16 scaling switched on since compile_step, or a loaded buffer whose trees are searched
            # on the host where micro-batches must see each other's priorities: torch's step does them.
            compiled = None
        micro = self.grad_accum_steps
        if compiled is not None and self._samples_in_graph(buffer):
            self._fix_buffer(buffer)
            buffer.fill_position(self._position)  # where the envs have written to, as each sample() would read it
            if per is not None:
                buffer.prepare_graph_sampling(batch_size)
            source, draw = ("uniform", buffer.draws) if per is None else ("prioritized", buffer.uniforms)
            # The one op outside the graphs: every micro-batch's draws, from the buffer's generator.
            draws = draw(batch_size, gradient_steps * micro)
            for step in range(gradient_steps):
                compiled(source, tuple((draws[step * micro + i],) for i in range(micro)), self._position)
            self._device_log.take(self._graph_sums)
            self._n_updates += gradient_steps  # type: ignore[attr-defined]
            self._log(per)
            return
        if compiled is not None:
            for _ in range(gradient_steps):
                # Drawn one after the other, as torch's step draws them (with PER only one micro-batch: see above).
                samples = [buffer.sample(batch_size, env=self._vec_normalize_env) for _ in range(micro)]  # type: ignore[attr-defined]
                inputs = tuple(self._batch_inputs(data, per is not None) for data in samples)
                each = compiled("batch", inputs)
                if per is not None:  # a non-finite TD error is refused by the tree as it skipped the step
                    self._update_priorities(per, samples[0].indices, each[0])
            self._device_log.take(self._graph_sums)
            self._n_updates += gradient_steps  # type: ignore[attr-defined]
            self._log(per)
            return
        for _ in range(gradient_steps * micro):
            data = buffer.sample(batch_size, env=self._vec_normalize_env)  # type: ignore[attr-defined]
            discounts = data.discounts if data.discounts is not None else self.gamma  # type: ignore[attr-defined]
            loss, (td_errors,) = self._weighted_loss(data, discounts, data.weights.flatten() if per is not None else None)
            if per is not None:
                # Before the backward pass: a NaN TD error is refused before anything reaches the tree or the weights.
                self._update_priorities(per, data.indices, td_errors.detach())
            self._device_log.mean("train/loss", loss)
            optimizer.zero_grad()
            loss.backward()
            if self.max_grad_norm is not None:  # type: ignore[attr-defined]
                th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)  # type: ignore[attr-defined]
            optimizer.step()
        self._n_updates += gradient_steps  # type: ignore[attr-defined]
        self._log(per)

    def _batch_inputs(self, data: Any, per: bool) -> tuple[Batch, th.Tensor | float, th.Tensor | None]:
        """A sample as the compiled step's ``batch`` source takes it."""
        discounts = data.discounts if data.discounts is not None else self.gamma  # type: ignore[attr-defined]
        batch = Batch(data.observations, data.actions, data.next_observations, data.dones, data.rewards)
        return batch, discounts, data.weights.flatten() if per else None

    @staticmethod
    def _update_priorities(per: Any, indices: Any, td_errors: th.Tensor) -> None:
        if isinstance(per, DevicePrioritizedReplayBuffer):  # takes the tensor where it is: no copy to the host
            per.update_priorities(indices, td_errors)
        else:
            per.update_priorities(indices, td_errors.cpu().numpy())

    def _log(self, per: PrioritizedReplayBuffer | DevicePrioritizedReplayBuffer | None) -> None:
        logger = self.logger  # type: ignore[attr-defined]
        logger.record("train/n_updates", self._n_updates, exclude="tensorboard")  # type: ignore[attr-defined]
        if per is None:
            return
        logger.record("per/beta", per.beta)
        # Leaves hold priority ** alpha; O(1) figures, since train() may run every env step.
        if isinstance(per, DevicePrioritizedReplayBuffer):  # 0-dim tensors, read when the logs are written
            self._device_log.latest("per/mean_priority", per.tree.total / (per.size() * per.n_envs))
            self._device_log.latest("per/max_priority", per.max_priority**per.alpha)
            self._device_log.latest("per/max_weight_unnormalized", per.last_max_weight)
            return
        logger.record("per/mean_priority", float(per.tree.total) / (per.size() * per.n_envs))
        logger.record("per/max_priority", float(per.max_priority**per.alpha))
        logger.record("per/max_weight_unnormalized", float(per.last_max_weight))

    def _record_device_figures(self) -> None:
        """Read the figures kept on the device with one wait (and refuse a diverged PER update), and record them."""
        buffer = getattr(self, "replay_buffer", None)
        if isinstance(buffer, DevicePrioritizedReplayBuffer):
            self._device_log.latest(REFUSED, buffer.refused_updates)
        held = record_with_guards(self, self._device_log, hold=(REFUSED,))  # type: ignore[arg-type]
        if isinstance(buffer, DevicePrioritizedReplayBuffer):
            buffer.check(held.get(REFUSED))


REFUSED = "per/refused_updates"


def _at_actions(values: th.Tensor, actions: th.Tensor) -> th.Tensor:
    """``values[i, ..., a_i]`` for each sample's action ``a_i`` (``values``: samples first, actions last), picked with
    a mask, not ``gather``: compiled, its backward pass fuses into its neighbours' kernels, where gather's is a scatter
    of its own. Exact: the other actions' values are replaced by zeros, not multiplied by them."""
    chosen = actions.reshape(-1, *(1,) * (values.dim() - 1)).long() == th.arange(values.shape[-1], device=values.device)
    return th.where(chosen, values, 0.0).sum(dim=-1)


class PrioritizedDQN(_PrioritizedTraining, OverlappedTraining, DQN):
    """SB3's DQN trained with prioritized replay, gradient accumulation and/or overlapped training (each may be off).

    :param grad_accum_steps: micro-batches of ``batch_size`` whose gradients make one optimizer step
    :param per_beta_fraction: share of training over which beta rises from its start to 1
    :param overlap_training: train on a thread of its own while the envs step (``extensions.overlap``)
    """

    def _per_sample_loss(self, data: Any, discounts: th.Tensor | float) -> tuple[th.Tensor, th.Tensor]:
        with th.no_grad():
            next_q, _ = self.q_net_target(data.next_observations).max(dim=1)
            target = data.rewards + (1 - data.dones) * discounts * next_q.reshape(-1, 1)
        current = _at_actions(self.q_net(data.observations), data.actions).reshape(-1, 1)
        return F.smooth_l1_loss(current, target, reduction="none").flatten(), (target - current).flatten()


class PrioritizedQRDQN(_PrioritizedTraining, OverlappedTraining, QRDQN):
    """sb3-contrib's QR-DQN with PrioritizedDQN's extensions (each may be off)."""

    def _per_sample_loss(self, data: Any, discounts: th.Tensor | float) -> tuple[th.Tensor, th.Tensor]:
        batch = data.actions.shape[0]  # observations may be a dict
        with th.no_grad():
            next_quantiles = self.quantile_net_target(data.next_observations)
            greedy = next_quantiles.mean(dim=1, keepdim=True).argmax(dim=2, keepdim=True)
            next_quantiles = next_quantiles.gather(dim=2, index=greedy.expand(batch, self.n_quantiles, 1)).squeeze(dim=2)
            target = data.rewards + (1 - data.dones) * discounts * next_quantiles
        current = _at_actions(self.quantile_net(data.observations), data.actions)
        # sb3-contrib's quantile Huber loss summed over the quantiles, per sample: PER weights it before the mean
        return quantile_huber(current, target).sum(dim=-1), (target.mean(dim=1) - current.mean(dim=1))
