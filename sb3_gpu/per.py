"""Prioritized experience replay (Schaul et al. 2015, proportional variant) for DQN and QR-DQN.

The sum and min trees are ``fanout``-ary trees kept as one numpy array per level, updated and searched for a
whole batch at once: with fanout 16 and a top level of at most 4096 nodes, a million leaves need two levels below
the top, so a batch costs a few numpy calls per level and no Python loop over samples.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from sb3_contrib import QRDQN
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu.errors import ConfigError, TrainingDiverged

try:
    from sb3_gpu import _tree_kernels as _kernels
except Exception:  # numba is the optional ``fast`` extra; a broken install (or no cache dir) means numpy
    _kernels = None  # type: ignore[assignment]


class SumMinTree:
    """Sums and minima over ``capacity`` non-negative leaves; empty leaves count 0 in sums and +inf in minima.

    Levels of ``fanout``-ary nodes are built up from the leaves until one has at most ``top`` nodes; a search
    starts there with one cumulative sum and binary searches, then descends one level per step. All levels live in
    one flat array (``sums`` holds views of it), with each group of ``fanout`` siblings contiguous. Minima are kept
    from the first level up (a leaf's minimum is itself). With numba installed (the ``fast`` extra) searches and
    updates run as compiled loops over the same arrays; otherwise as numpy calls over the whole batch, where a
    batch's groups are transposed to ``(fanout, batch)`` since numpy reduces across a batch far faster than along
    rows of 16.
    """

    def __init__(self, capacity: int, fanout: int = 16, top: int | None = None, backend: str = "auto"):
        if capacity < 1 or fanout < 2:
            raise ValueError(f"capacity must be >= 1 and fanout >= 2, got {capacity} and {fanout}")
        if backend not in ("auto", "numpy", "numba"):
            raise ValueError(f"backend must be auto, numpy or numba, got {backend!r}")
        if backend == "numba" and _kernels is None:
            raise ConfigError("the numba backend needs numba: pip install 'sb3-gpu[fast]'")
        self.capacity, self.fanout = capacity, fanout
        self.backend = "numba" if backend == "auto" and _kernels is not None else "numpy" if backend == "auto" else backend
        if top is None:  # a cumulative sum over the top costs numpy one call but compiled loops a pass per search
            top = 256 if self.backend == "numba" else 4096
        levels = 1
        while -(-capacity // fanout ** (levels - 1)) > top:
            levels += 1
        # Every level below the top is whole groups of whole groups: the leaves are padded (with empty leaves) to
        # top * fanout^(levels-1), so that a search running past the end still lands on a leaf, never outside.
        top_size = -(-capacity // fanout ** (levels - 1))
        sizes = [top_size * fanout**k for k in range(levels - 1, -1, -1)]
        self._sum_offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        self._min_offsets = np.cumsum([0, *sizes[1:-1]], dtype=np.int64)[: len(sizes) - 1]
        self._sizes = sizes
        self._sums = np.zeros(sum(sizes), dtype=np.float64)
        self._mins = np.full(sum(sizes[1:]), np.inf, dtype=np.float64)
        self._strict_lower = np.tril(np.ones((fanout, fanout)), -1)  # exclusive running sums as one small matmul
        self._make_views()

    def _make_views(self) -> None:
        self.sums = [self._sums[o : o + n] for o, n in zip(self._sum_offsets, self._sizes, strict=True)]
        self.mins = [self._mins[o : o + n] for o, n in zip(self._min_offsets, self._sizes[1:], strict=True)]

    def __getstate__(self) -> dict[str, Any]:
        # Pickle would copy each view apart from the flat arrays; keep only the arrays and rebuild the views.
        return {k: v for k, v in self.__dict__.items() if k not in ("sums", "mins")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.backend == "numba" and _kernels is None:  # saved where numba was installed, loaded where it is not
            self.backend = "numpy"
        self._make_views()

    @property
    def total(self) -> float:
        return float(self.sums[-1].sum())

    @property
    def min(self) -> float:
        if self.mins:
            return float(self.mins[-1].min())
        leaves = self.sums[0]
        return float(np.min(leaves, where=leaves > 0, initial=np.inf))

    def __getitem__(self, indices: np.ndarray) -> np.ndarray:
        return self.sums[0][indices]

    def _groups(self, level: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """The children of ``parents`` as a C-ordered ``(fanout, batch)`` array."""
        return np.ascontiguousarray(np.take(level.reshape(-1, self.fanout), parents, axis=0).T)

    def update(self, indices: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``indices`` to ``values`` (the last write wins for repeated indices) and refresh their ancestors."""
        nodes = np.asarray(indices, dtype=np.int64)
        values = np.asarray(values, dtype=np.float64)
        if self.backend == "numba":
            assert _kernels is not None
            values = np.ascontiguousarray(np.broadcast_to(values, nodes.shape))
            _kernels.update(self._sums, self._mins, self._sum_offsets, self._min_offsets, self.fanout, nodes, values)
            return
        self.sums[0][nodes] = values
        for level in range(1, len(self.sums)):
            # Repeated parents are written repeatedly with the same value: cheaper than np.unique.
            nodes = nodes // self.fanout
            children = self._groups(self.sums[level - 1], nodes)
            self.sums[level][nodes] = children.sum(axis=0)
            if level == 1:
                self.mins[0][nodes] = np.min(children, axis=0, where=children > 0, initial=np.inf)
            else:
                self.mins[level - 1][nodes] = self._groups(self.mins[level - 2], nodes).min(axis=0)

    def update_range(self, start: int, values: np.ndarray) -> None:
        """Set the consecutive leaves from ``start`` (what each env step adds): contiguous slices, no gathers."""
        if self.backend == "numba":
            self.update(np.arange(start, start + len(values)), values)
            return
        values = np.asarray(values, dtype=np.float64)
        low, high = start, start + len(values)
        self.sums[0][low:high] = values
        for level in range(1, len(self.sums)):
            low, high = low // self.fanout, (high - 1) // self.fanout + 1
            below = slice(low * self.fanout, high * self.fanout)
            children = self.sums[level - 1][below].reshape(-1, self.fanout)
            self.sums[level][low:high] = children.sum(axis=1)
            if level == 1:
                self.mins[0][low:high] = np.min(children, axis=1, where=children > 0, initial=np.inf)
            else:
                self.mins[level - 1][low:high] = self.mins[level - 2][below].reshape(-1, self.fanout).min(axis=1)

    def find(self, prefix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each value ``u`` in ``[0, total)``, the leaf ``i`` with ``sum(leaves[:i]) <= u < sum(leaves[:i+1])``.

        Returns the leaves' indices and values. Never a leaf of zero value, even where rounding puts ``u`` at or
        past the total.
        """
        prefix = np.array(prefix, dtype=np.float64)
        top = self.sums[-1]
        inclusive = np.cumsum(top)
        if self.backend == "numba":
            assert _kernels is not None
            nodes, values = np.empty(len(prefix), dtype=np.int64), np.empty(len(prefix))
            _kernels.find(self._sums, self._sum_offsets, self.fanout, inclusive, prefix, nodes, values)
        else:
            nodes = np.minimum(np.searchsorted(inclusive, prefix, side="right"), len(top) - 1)
            prefix -= inclusive[nodes] - top[nodes]
            np.maximum(prefix, 0.0, out=prefix)
            columns = np.arange(len(prefix))
            for level in range(len(self.sums) - 2, -1, -1):
                exclusive = self._strict_lower @ self._groups(self.sums[level], nodes)
                # The last child is taken when rounding runs past the others; repaired below if it is empty.
                child = (exclusive[1:] <= prefix).sum(axis=0)
                prefix -= np.take(exclusive, child * len(prefix) + columns)
                nodes = nodes * self.fanout + child
            values = self.sums[0][nodes]
        if not (values > 0).all():
            nodes, values = self._last_positive_before(nodes, values)
        return nodes, values

    def _last_positive_before(self, nodes: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Move empty picks (rounding past a group's end, rare) onto the nearest non-empty leaf before them."""
        positive = np.flatnonzero(self.sums[0] > 0)
        if not len(positive):
            raise ValueError("cannot search a tree whose leaves are all zero")
        empty = values <= 0
        nodes[empty] = positive[np.maximum(np.searchsorted(positive, nodes[empty]) - 1, 0)]
        return nodes, self.sums[0][nodes]


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
    so each is replayed at least once soon; ``update_priorities`` sets ``(|td| + eps) ** alpha``.

    :param alpha: how much prioritization is used (0: uniform)
    :param beta: importance-sampling correction (0: none, 1: full); the algorithm anneals it to 1
    :param eps: added to ``|td|`` so that no transition's probability reaches zero
    """

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
    ):
        check_per_values(alpha, beta, eps)
        if optimize_memory_usage:
            raise ConfigError("prioritized replay does not support optimize_memory_usage=True; set it to false")
        super().__init__(
            buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage, handle_timeout_termination
        )
        self.alpha, self.beta, self.eps = alpha, beta, eps
        self.tree = SumMinTree(self.buffer_size * self.n_envs)
        self.max_priority = 1.0  # before alpha
        self.last_max_weight = 1.0

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
        total = self.tree.total
        prefix = (np.arange(batch_size) + np.random.random(batch_size)) * (total / batch_size)
        indices, priorities = self.tree.find(prefix)
        # w_i = (N * P(i)) ** -beta divided by the largest weight, that of the smallest priority: (p_i / p_min) ** -beta.
        smallest = self.tree.min
        weights = (priorities / smallest) ** -self.beta
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
        data = (
            self._normalize_obs(self.observations[batch_inds, env_inds, :], env),
            self.actions[batch_inds, env_inds, :],
            self._normalize_obs(self.next_observations[batch_inds, env_inds, :], env),
            (self.dones[batch_inds, env_inds] * (1 - self.timeouts[batch_inds, env_inds])).reshape(-1, 1),
            self._normalize_reward(self.rewards[batch_inds, env_inds].reshape(-1, 1), env),
        )
        # Fancy indexing already made fresh arrays, so the tensors may share their memory (SB3 copies once more).
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


def check_per_values(alpha: float, beta: float, eps: float) -> None:
    if not alpha >= 0:
        raise ConfigError(f"per.alpha must be >= 0 (0 is uniform sampling), got {alpha}")
    if not 0 <= beta <= 1:
        raise ConfigError(f"per.beta0 must be in [0, 1], got {beta}")
    if not eps > 0:
        raise ConfigError(f"per.eps must be > 0, got {eps}")


class _PrioritizedTraining:
    """``train()`` for the DQN family with importance-weighted losses, priority updates and gradient accumulation.

    It follows SB3's ``DQN.train`` step for step; the class only supplies ``_per_sample_loss``. With a plain
    ReplayBuffer and ``grad_accum_steps=1`` it computes exactly what SB3 computes (a test pins this).
    """

    grad_accum_steps: int
    per_beta_fraction: float
    per_beta0: float

    def _per_sample_loss(self, data: Any, discounts: th.Tensor | float) -> tuple[th.Tensor, th.Tensor]:
        raise NotImplementedError

    def _anneal_beta(self) -> float:
        progress = 1.0 - self._current_progress_remaining  # type: ignore[attr-defined]
        return self.per_beta0 + (1.0 - self.per_beta0) * min(1.0, progress / self.per_beta_fraction)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        self.policy.set_training_mode(True)  # type: ignore[attr-defined]
        optimizer = self.policy.optimizer  # type: ignore[attr-defined]
        self._update_learning_rate(optimizer)  # type: ignore[attr-defined]
        buffer = self.replay_buffer  # type: ignore[attr-defined]
        per = buffer if isinstance(buffer, PrioritizedReplayBuffer) else None
        if per is not None:
            per.beta = self._anneal_beta()
        losses = []
        for _ in range(gradient_steps):
            optimizer.zero_grad()
            for _ in range(self.grad_accum_steps):
                data = buffer.sample(batch_size, env=self._vec_normalize_env)  # type: ignore[attr-defined]
                discounts = data.discounts if data.discounts is not None else self.gamma  # type: ignore[attr-defined]
                per_sample, td_errors = self._per_sample_loss(data, discounts)
                loss = (per_sample * data.weights.flatten()).mean() if per is not None else per_sample.mean()
                losses.append(loss.item())
                (loss / self.grad_accum_steps).backward()
                if per is not None:
                    per.update_priorities(data.indices, td_errors.detach().cpu().numpy())
            if self.max_grad_norm is not None:  # type: ignore[attr-defined]
                th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)  # type: ignore[attr-defined]
            optimizer.step()
        self._n_updates += gradient_steps  # type: ignore[attr-defined]
        logger = self.logger  # type: ignore[attr-defined]
        logger.record("train/n_updates", self._n_updates, exclude="tensorboard")  # type: ignore[attr-defined]
        logger.record("train/loss", np.mean(losses))
        if per is not None:
            # Leaves hold priority ** alpha; O(1) figures, since train() may run every env step.
            logger.record("per/beta", per.beta)
            logger.record("per/mean_priority", per.tree.total / (per.size() * per.n_envs))
            logger.record("per/max_priority", per.max_priority**per.alpha)
            logger.record("per/max_weight_unnormalized", per.last_max_weight)


def _setup_extensions(model: Any, grad_accum_steps: int, per_beta_fraction: float) -> None:
    if grad_accum_steps < 1:
        raise ConfigError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    if not 0 < per_beta_fraction <= 1:
        raise ConfigError(f"per.beta_fraction must be in (0, 1], got {per_beta_fraction}")
    model.grad_accum_steps = grad_accum_steps
    model.per_beta_fraction = per_beta_fraction
    model.per_beta0 = (model.replay_buffer_kwargs or {}).get("beta", 0.4)


class PrioritizedDQN(_PrioritizedTraining, DQN):
    """SB3's DQN trained with prioritized replay and/or gradient accumulation (each may be off).

    :param grad_accum_steps: micro-batches of ``batch_size`` whose gradients make one optimizer step
    :param per_beta_fraction: share of training over which beta rises from its start to 1
    """

    def __init__(self, *args: Any, grad_accum_steps: int = 1, per_beta_fraction: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _setup_extensions(self, grad_accum_steps, per_beta_fraction)

    def _per_sample_loss(self, data: Any, discounts: th.Tensor | float) -> tuple[th.Tensor, th.Tensor]:
        with th.no_grad():
            next_q, _ = self.q_net_target(data.next_observations).max(dim=1)
            target = data.rewards + (1 - data.dones) * discounts * next_q.reshape(-1, 1)
        current = th.gather(self.q_net(data.observations), dim=1, index=data.actions.long())
        return F.smooth_l1_loss(current, target, reduction="none").flatten(), (target - current).flatten()


class PrioritizedQRDQN(_PrioritizedTraining, QRDQN):
    """sb3-contrib's QR-DQN trained with prioritized replay and/or gradient accumulation (each may be off)."""

    def __init__(self, *args: Any, grad_accum_steps: int = 1, per_beta_fraction: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _setup_extensions(self, grad_accum_steps, per_beta_fraction)

    def _per_sample_loss(self, data: Any, discounts: th.Tensor | float) -> tuple[th.Tensor, th.Tensor]:
        batch = data.observations.shape[0]
        with th.no_grad():
            next_quantiles = self.quantile_net_target(data.next_observations)
            greedy = next_quantiles.mean(dim=1, keepdim=True).argmax(dim=2, keepdim=True).expand(batch, self.n_quantiles, 1)
            next_quantiles = next_quantiles.gather(dim=2, index=greedy).squeeze(dim=2)
            target = data.rewards + (1 - data.dones) * discounts * next_quantiles
        actions = data.actions[..., None].long().expand(batch, self.n_quantiles, 1)
        current = th.gather(self.quantile_net(data.observations), dim=2, index=actions).squeeze(dim=2)
        return _quantile_huber_per_sample(current, target), (target.mean(dim=1) - current.mean(dim=1))


def _quantile_huber_per_sample(current: th.Tensor, target: th.Tensor) -> th.Tensor:
    """sb3-contrib's quantile Huber loss (summed over quantiles) for each sample, before the batch mean."""
    n = current.shape[-1]
    cum_prob = ((th.arange(n, device=current.device, dtype=th.float) + 0.5) / n).view(1, -1, 1)
    delta = target.unsqueeze(-2) - current.unsqueeze(-1)
    abs_delta = th.abs(delta)
    huber = th.where(abs_delta > 1, abs_delta - 0.5, delta**2 * 0.5)
    return (th.abs(cum_prob - (delta.detach() < 0).float()) * huber).sum(dim=-2).mean(dim=-1)
