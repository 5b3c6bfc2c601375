"""Prioritized experience replay (Schaul et al. 2015, proportional variant): SB3's ReplayBuffer sampling by priority."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu.common.checks import PER_CHECKS
from sb3_gpu.common.errors import ConfigError, TrainingDiverged
from sb3_gpu.extensions.per.tree import SumMinTree
from sb3_gpu.extensions.replay import check_n_steps, ready_to_sample


def check_per_values(alpha: float, beta: float, eps: float) -> tuple[float, float, float]:
    """The preset's checks of ``per.alpha``, ``per.beta0`` and ``per.eps``, for buffers built by hand."""
    return (
        PER_CHECKS["alpha"](alpha, "per.alpha"),
        PER_CHECKS["beta0"](beta, "per.beta0"),
        PER_CHECKS["eps"](eps, "per.eps"),
    )


class PrioritizedReplayBufferSamples(NamedTuple):
    """SB3's ReplayBufferSamples plus the importance weights and the flat indices for priority updates."""

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: np.ndarray


class PrioritizedReplayBuffer(ReplayBuffer):
    """SB3's ReplayBuffer with proportional prioritized sampling.

    Transition ``(pos, env)`` has flat index ``pos * n_envs + env``. New transitions get the largest priority seen,
    so each is replayed at least once soon; ``update_priorities`` sets ``(|td| + eps) ** alpha``. Importance weights
    are at most 1, so they only ever scale a step down.

    :param alpha: how much prioritization is used (0: uniform)
    :param beta: importance-sampling correction (0: none, 1: full); the algorithm anneals it to 1
    :param eps: added to ``|td|`` so that no transition's probability reaches zero
    :param normalize: importance weights divided by the largest in their ``"batch"``, or by the largest any transition
        in the ``"buffer"`` could have, that of the smallest priority (OpenAI Baselines' choice). With ``"buffer"``, one
        transition fit to a TD error near zero shrinks every weight, and the step size with it, by orders of magnitude
        when ``eps`` is small (measured on DQN CartPole with eps 1e-6: a mean weight of 0.001; per batch, about 0.15)
    :param n_steps: n-step returns as SB3's NStepReplayBuffer computes them (``discounts`` per sample); a transition
        keeps its own priority, that of the n-step target it was trained on
    :param gamma: the discount of the n-step returns (the algorithm's ``gamma``)
    """

    n_steps: int = 1  # class defaults: buffers pickled before n-step returns existed load with one-step returns
    gamma: float = 0.99
    normalize: str = "buffer"  # and before the choice of normalisation, with the one they had

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        n_steps: int = 1,
        gamma: float = 0.99,
        normalize: str = "batch",
    ):
        alpha, beta, eps = check_per_values(alpha, beta, eps)
        self.normalize = PER_CHECKS["normalize"](normalize, "per.normalize")
        if optimize_memory_usage:
            raise ConfigError("prioritized replay does not support optimize_memory_usage=True; set it to false")
        self.n_steps, self.gamma = check_n_steps(n_steps), float(gamma)
        super().__init__(
            buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage, handle_timeout_termination
        )
        self.alpha, self.beta, self.eps = alpha, beta, eps
        self.tree = SumMinTree(self.buffer_size * self.n_envs)
        self.max_priority = 1.0  # before alpha
        self.last_max_weight = 1.0

    def reset(self) -> None:
        """Empty the buffer: its priorities too, or it would sample the old transitions' slots."""
        super().reset()
        if getattr(self, "tree", None) is not None:  # SB3's __init__ resets before the tree exists
            self.tree.clear()
            self.max_priority, self.last_max_weight = 1.0, 1.0

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        first = self.pos * self.n_envs
        super().add(obs, next_obs, action, reward, done, infos)
        self.tree.update_range(first, np.full(self.n_envs, self.max_priority**self.alpha))

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> PrioritizedReplayBufferSamples:  # type: ignore[override]
        """Stratified sampling: one draw from each of ``batch_size`` equal slices of the priority total."""
        ready_to_sample(self)
        total = self.tree.total
        prefix = (np.arange(batch_size) + np.random.random(batch_size)) * (total / batch_size)
        indices, priorities = self.tree.find(prefix)
        # w_i = (N * P(i)) ** -beta divided by the largest weight, that of the smallest priority: (p_i / p_min) ** -beta,
        # p_min the batch's or the buffer's (see normalize).
        smallest = self.tree.min
        weights = (priorities / (priorities.min() if self.normalize == "batch" else smallest)) ** -self.beta
        self.last_max_weight = (self.size() * self.n_envs * smallest / total) ** -self.beta
        # With one env, a scalar env index makes the gathers below cheaper than an array of zeros.
        batch_inds, env_inds = (indices, 0) if self.n_envs == 1 else np.divmod(indices, self.n_envs)
        samples = self._get_samples_at(batch_inds, env_inds, env)
        return PrioritizedReplayBufferSamples(
            *samples, weights=self.to_torch(weights.astype(np.float32), copy=False), indices=indices
        )

    def _get_samples_at(
        self, batch_inds: np.ndarray, env_inds: np.ndarray | int, env: VecNormalize | None
    ) -> ReplayBufferSamples:
        # SB3's _get_samples draws the env index at random; here it is the one the tree chose.
        if self.n_steps > 1:
            return self._n_step_samples_at(batch_inds, env_inds, env)
        data = (
            self._normalize_obs(self.observations[batch_inds, env_inds, :], env),
            self.actions[batch_inds, env_inds, :],
            self._normalize_obs(self.next_observations[batch_inds, env_inds, :], env),
            (self.dones[batch_inds, env_inds] * (1 - self.timeouts[batch_inds, env_inds])).reshape(-1, 1),
            self._normalize_reward(self.rewards[batch_inds, env_inds].reshape(-1, 1), env),
        )
        # Fancy indexing already made fresh arrays, so the tensors may share their memory (SB3 copies once more).
        return ReplayBufferSamples(*(self.to_torch(array, copy=False) for array in data))  # type: ignore[arg-type]

    def _n_step_samples_at(
        self, batch_inds: np.ndarray, env_inds: np.ndarray | int, env: VecNormalize | None
    ) -> ReplayBufferSamples:
        """Each transition's return over its next ``n_steps`` slots of the same env, cut after the first that ends an
        episode (termination or time limit) and before the newest slot's successor, which is not written yet (or, in a
        full buffer, is the oldest data). The target bootstraps from the last slot's next observation with
        ``gamma ** k`` for ``k`` slots taken."""
        steps = np.arange(self.n_steps)
        rows = (batch_inds[:, None] + steps) % self.buffer_size  # [batch, n]
        envs = env_inds if isinstance(env_inds, int) else env_inds[:, None]
        ends = np.logical_or(self.dones[rows, envs], self.timeouts[rows, envs]) | (rows == (self.pos - 1) % self.buffer_size)
        taken = np.where(ends.any(axis=1), ends.argmax(axis=1), self.n_steps - 1) + 1  # slots in each return
        inside = steps < taken[:, None]
        returns = (self._normalize_reward(self.rewards[rows, envs], env) * self.gamma**steps * inside).sum(axis=1)
        last = rows[np.arange(len(rows)), taken - 1]
        data = (
            self._normalize_obs(self.observations[batch_inds, env_inds, :], env),
            self.actions[batch_inds, env_inds, :],
            self._normalize_obs(self.next_observations[last, env_inds, :], env),
            (self.dones[last, env_inds] * (1 - self.timeouts[last, env_inds])).reshape(-1, 1),
            returns.reshape(-1, 1).astype(np.float32),
            (self.gamma**taken).reshape(-1, 1).astype(np.float32),
        )
        return ReplayBufferSamples(*(self.to_torch(array, copy=False) for array in data))  # type: ignore[arg-type]

    def update_priorities(self, indices: np.ndarray, td_errors: np.ndarray) -> None:
        """Set the priorities of sampled transitions from their new TD errors."""
        priorities = np.abs(np.asarray(td_errors, dtype=np.float64)).reshape(-1) + self.eps
        if not np.isfinite(priorities).all():
            # A NaN priority would poison the sum tree (its total, so every later sample); refuse before writing.
            raise TrainingDiverged(
                "a TD error is NaN or inf, so priorities and weights were left unchanged (the loss diverged: "
                "look for NaN or inf in rewards or observations, or lower the learning rate)"
            )
        self.max_priority = max(self.max_priority, float(priorities.max()))
        self.tree.update(indices, priorities**self.alpha)
