"""Prioritized replay whose priorities, like its storage, live on the model's device: trees searched and updated with
batched tensor ops, and no host round trip when sampling, adding or writing back TD errors."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu.common.errors import TrainingDiverged
from sb3_gpu.extensions.per.buffer import check_per_values
from sb3_gpu.extensions.replay import DeviceReplayBuffer


class DeviceSumMinTree:
    """Sums and minima over ``capacity`` non-negative leaves, as float64 tensors on ``device``; empty leaves count 0 in
    sums and +inf in minima.

    A binary tree in one flat array per statistic: node ``n`` has children ``2n`` and ``2n + 1``, the root is node 1
    and the leaves (padded to a power of two) are the second half. A batch is searched or updated one level at a
    time, so ``log2(capacity)`` steps of a few tensor ops each whatever the batch size. Leaves set by
    ``update_range`` (what each env step adds) refresh their ancestors only when the tree is next read, so the
    steps between two samples cost one refresh.
    """

    def __init__(self, capacity: int, device: th.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.depth = (capacity - 1).bit_length()
        self.leaves = 1 << self.depth  # index of the first leaf
        # float64 as the host tree: float32 sums carry ~7 digits, so over 10^6 leaves a small priority's share of
        # the total would be lost in rounding and the draws would no longer follow the priorities. The search and
        # updates are a few gathers per level, bound by launches and memory, not by float64 arithmetic.
        self.sums = th.zeros(2 * self.leaves, dtype=th.float64, device=device)
        self.mins = th.full((2 * self.leaves,), th.inf, dtype=th.float64, device=device)
        self._stale: tuple[int, int] | None = None  # leaves whose ancestors are out of date

    @property
    def device(self) -> th.device:
        return self.sums.device

    def to(self, device: th.device | str) -> None:
        self.sums, self.mins = self.sums.to(device), self.mins.to(device)

    def __getstate__(self) -> dict[str, Any]:
        self._refresh()
        return {**self.__dict__, "sums": self.sums.cpu().numpy(), "mins": self.mins.cpu().numpy()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.sums, self.mins = th.from_numpy(self.sums), th.from_numpy(self.mins)

    @property
    def total(self) -> th.Tensor:
        """The sum of the leaves, a 0-dim tensor (reading it as a number waits for the device)."""
        self._refresh()
        return self.sums[1]

    @property
    def min(self) -> th.Tensor:
        """The smallest non-empty leaf (+inf if none), a 0-dim tensor."""
        self._refresh()
        return self.mins[1]

    def __getitem__(self, indices: th.Tensor | np.ndarray) -> th.Tensor:
        return self.sums[self.leaves + th.as_tensor(indices, device=self.device)]

    def clear(self) -> None:
        self.sums.zero_()
        self.mins.fill_(th.inf)
        self._stale = None

    def update_range(self, start: int, values: th.Tensor) -> None:
        """Set the consecutive leaves from ``start``; their ancestors are refreshed when the tree is next read."""
        end = start + len(values)
        self.sums[self.leaves + start : self.leaves + end] = values
        self.mins[self.leaves + start : self.leaves + end] = th.where(values > 0, values, th.inf)
        # One span over all stale leaves: tight for a ring's consecutive adds; across its wrap, a whole rebuild.
        low, high = self._stale or (start, end)
        self._stale = (min(low, start), max(high, end))

    def _refresh(self) -> None:
        if self._stale is None:
            return
        low, high = self._stale[0] + self.leaves, self._stale[1] + self.leaves
        self._stale = None
        for _ in range(self.depth):
            low, high = low // 2, (high - 1) // 2 + 1
            # A level's nodes are contiguous and its children lie past it, so slices, and no overlap with ``out``.
            th.add(self.sums[2 * low : 2 * high : 2], self.sums[2 * low + 1 : 2 * high : 2], out=self.sums[low:high])
            th.minimum(self.mins[2 * low : 2 * high : 2], self.mins[2 * low + 1 : 2 * high : 2], out=self.mins[low:high])

    def update(self, indices: th.Tensor, values: th.Tensor) -> None:
        """Set leaves ``indices`` to ``values`` and recompute their ancestors from their children.

        Of repeated indices one write wins (the last on the CPU, any on CUDA); the ancestors are recomputed from the
        leaves as written, so the tree always equals one rebuilt from its leaves.
        """
        self._refresh()
        nodes = indices.to(device=self.device, dtype=th.int64).reshape(-1) + self.leaves
        values = values.to(device=self.device, dtype=th.float64).reshape(-1).expand(len(nodes))
        self.sums.index_copy_(0, nodes, values)
        self.mins.index_copy_(0, nodes, th.where(values > 0, values, th.inf))
        sum_pairs, min_pairs = self.sums.view(-1, 2), self.mins.view(-1, 2)  # row n: the children of node n
        for _ in range(self.depth):
            # Repeated parents are written repeatedly with one value: cheaper than deduplicating.
            nodes = nodes // 2
            self.sums.index_copy_(0, nodes, sum_pairs.index_select(0, nodes).sum(dim=1))
            self.mins.index_copy_(0, nodes, min_pairs.index_select(0, nodes).amin(dim=1))

    def find(self, prefix: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """For each ``u`` in ``[0, total)``, the leaf ``i`` with ``sum(leaves[:i]) <= u < sum(leaves[:i+1])``, and its value.

        Never an empty leaf, even where rounding puts ``u`` at or past the total: the search goes right only into a
        non-empty subtree. The tree must not be empty.
        """
        self._refresh()
        prefix = prefix.to(device=self.device, dtype=th.float64)
        nodes = th.ones(len(prefix), dtype=th.int64, device=self.device)
        pairs = self.sums.view(-1, 2)
        for _ in range(self.depth):
            children = pairs.index_select(0, nodes)
            left = children[:, 0]
            right = (prefix >= left) & (children[:, 1] > 0)
            prefix = th.where(right, prefix - left, prefix)
            nodes = 2 * nodes + right
        return nodes - self.leaves, self.sums.index_select(0, nodes)


class DevicePrioritizedReplayBufferSamples(NamedTuple):
    """SB3's ReplayBufferSamples plus the importance weights and the flat indices, both tensors on the device."""

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: th.Tensor


class DevicePrioritizedReplayBuffer(DeviceReplayBuffer):
    """``PrioritizedReplayBuffer`` on the device: the same arguments, draws and weights, with the trees as tensors.

    Transition ``(pos, env)`` has flat index ``pos * n_envs + env``; samples carry ``indices`` as a device tensor, and
    ``update_priorities`` takes them back with the TD errors as tensors. Nothing waits for the device except the
    finiteness check of each update's TD errors (one boolean read) and reading the statistics as numbers. Unlike the
    host buffer it takes ``optimize_memory_usage``: the slot whose observation the next step overwrote has priority 0.
    ``alpha``, ``beta`` and ``eps`` mean what they mean for :class:`PrioritizedReplayBuffer`.
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
        alpha, beta, eps = check_per_values(alpha, beta, eps)
        super().__init__(
            buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage, handle_timeout_termination
        )
        self.alpha, self.beta, self.eps = alpha, beta, eps
        self.tree = DeviceSumMinTree(self.buffer_size * self.n_envs, self.device)
        self.max_priority = th.ones((), dtype=th.float64, device=self.device)  # before alpha
        self._last_max_weight = th.ones((), dtype=th.float64, device=self.device)

    @property
    def last_max_weight(self) -> th.Tensor:
        """The largest unnormalised weight ``(N * p_min / total) ** -beta`` at the last sample, a 0-dim tensor."""
        return self._last_max_weight

    def _place(self, arrays: dict[str, th.Tensor | np.ndarray | None], device: th.device) -> None:
        super()._place(arrays, device)
        if getattr(self, "tree", None) is not None:  # absent while the base class allocates the storage
            self.tree.to(device)
            self.max_priority = self.max_priority.to(device)
            self._last_max_weight = self._last_max_weight.to(device)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in ("max_priority", "_last_max_weight"):
            state[name] = state[name].cpu().numpy()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("max_priority", "_last_max_weight"):
            state[name] = th.from_numpy(state[name])
        super().__setstate__(state)  # then _place moves them, and the tree, to the buffer's device

    def reset(self) -> None:
        super().reset()
        if getattr(self, "tree", None) is not None:
            self.tree.clear()

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
        self.tree.update_range(first, (self.max_priority**self.alpha).expand(self.n_envs))
        if self.optimize_memory_usage:
            # One-copy storage just wrote this step's next observation over slot pos's observation: never draw it.
            self.tree.update_range(self.pos * self.n_envs, self.max_priority.new_zeros(self.n_envs))

    def _uniforms(self, batch_size: int) -> th.Tensor:
        return th.rand(batch_size, generator=self._rng(), dtype=th.float64, device=self.device)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> DevicePrioritizedReplayBufferSamples:  # type: ignore[override]
        """Stratified sampling: one draw from each of ``batch_size`` equal slices of the priority total."""
        total = self.tree.total
        steps = th.arange(batch_size, dtype=th.float64, device=self.device)
        indices, priorities = self.tree.find((steps + self._uniforms(batch_size)) * (total / batch_size))
        # w_i = (N * P(i)) ** -beta divided by the largest weight, that of the smallest priority: (p_i / p_min) ** -beta.
        smallest = self.tree.min
        weights = (priorities / smallest).pow(-self.beta).float()
        self._last_max_weight = (self.size() * self.n_envs * smallest / total).pow(-self.beta)
        # With one env, a scalar env index makes the gathers cheaper than a tensor of zeros.
        batch_inds, env_inds = (indices, 0) if self.n_envs == 1 else (indices // self.n_envs, indices % self.n_envs)
        samples = self._get_samples_at(batch_inds, env_inds, env)
        return DevicePrioritizedReplayBufferSamples(*samples, weights=weights, indices=indices)

    def update_priorities(self, indices: th.Tensor | np.ndarray, td_errors: th.Tensor | np.ndarray) -> None:
        """Set the priorities of sampled transitions from their new TD errors (tensors, or arrays)."""
        priorities = th.as_tensor(td_errors, device=self.device).detach().to(th.float64).abs().reshape(-1) + self.eps
        # The one wait for the device per update: a NaN priority would poison the sum tree (its total, so every
        # later sample), so it is refused before writing. DQN's train() reads the loss at this point anyway.
        if not bool(th.isfinite(priorities).all()):
            raise TrainingDiverged(
                "a TD error is NaN or inf, so priorities and weights were left unchanged (the loss diverged: "
                "look for NaN or inf in rewards or observations, or lower the learning rate)"
            )
        self.max_priority = th.maximum(self.max_priority, priorities.max())
        self.tree.update(th.as_tensor(indices, device=self.device), priorities**self.alpha)
