"""A rollout buffer for PPO and A2C whose storage, advantages and minibatches stay on the model's device:
``PPO(..., rollout_buffer_class=DeviceRolloutBuffer)``."""

from __future__ import annotations

from collections.abc import Generator

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.type_aliases import RolloutBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.handoff import ObservationHandOff
from sb3_gpu.extensions.hostcopy import copy_into


class DeviceRolloutBuffer(ObservationHandOff, RolloutBuffer):
    """SB3's RolloutBuffer with torch tensors on ``device`` for storage, GAE and minibatch sampling.

    Observations keep the observation space's dtype (uint8 frames stay uint8, as in SB3, and the policy scales
    them); everything else is float32. Each ``add`` copies each array to the device once, the observations not at
    all where :meth:`stage` handed it the copy made for the policy. Minibatches follow ``torch.randperm`` on the
    device, seeded from numpy's global RNG, so SB3's ``set_random_seed`` repeats a run.

    ``values`` and ``returns`` read as host numpy arrays, because SB3's ``PPO.train`` and ``A2C.train`` pass them to
    the numpy ``explained_variance``; their device tensors are ``value_tensor`` and ``return_tensor``.
    Dict observations are refused: use SB3's DictRolloutBuffer.
    """

    observations: th.Tensor  # type: ignore[assignment]
    actions: th.Tensor  # type: ignore[assignment]
    rewards: th.Tensor  # type: ignore[assignment]
    advantages: th.Tensor  # type: ignore[assignment]
    episode_starts: th.Tensor  # type: ignore[assignment]
    log_probs: th.Tensor  # type: ignore[assignment]
    value_tensor: th.Tensor
    return_tensor: th.Tensor

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        gae_lambda: float = 1,
        gamma: float = 0.99,
        n_envs: int = 1,
    ):
        if isinstance(observation_space, spaces.Dict):
            raise ConfigError(
                "DeviceRolloutBuffer does not support Dict observations;"
                " use SB3's DictRolloutBuffer (rollout_buffer_class=None)"
            )
        super().__init__(buffer_size, observation_space, action_space, device, gae_lambda, gamma, n_envs)
        self._generator = th.Generator(device=self.device)

    def reset(self) -> None:
        if self._storage_kept():
            # The same storage, zeroed: minibatches are copies (index_select), and on the CPU the host views of it
            # stay valid (making them anew would read every tensor back).
            for t in (self.observations, self.actions, self.rewards, self.episode_starts, self.value_tensor, self.log_probs):
                t.zero_()
            self.advantages.zero_()
            self.return_tensor = th.zeros_like(self.advantages)
            self.generator_ready = False
            self.pos, self.full = 0, False
            return

        def zeros(*shape: int, dtype: th.dtype = th.float32) -> th.Tensor:
            return th.zeros((self.buffer_size, self.n_envs, *shape), dtype=dtype, device=self.device)

        obs_dtype = th.from_numpy(np.empty(0, dtype=self.observation_space.dtype)).dtype
        self.observations = zeros(*self.obs_shape, dtype=obs_dtype)
        self.actions = zeros(self.action_dim)
        self.rewards, self.episode_starts = zeros(), zeros()
        self.value_tensor, self.log_probs = zeros(), zeros()
        self.advantages, self.return_tensor = zeros(), zeros()
        self.generator_ready = False
        self.pos, self.full = 0, False
        # On the CPU the tensors are host memory, and add() writes each step through numpy views of it: a numpy
        # write costs a fraction of a torch indexing call, which matters at every env step.
        self._host_rows: tuple[np.ndarray, ...] | None = None
        if self.device.type == "cpu":
            stored = (self.observations, self.actions, self.rewards, self.episode_starts, self.value_tensor, self.log_probs)
            self._host_rows = tuple(t.numpy() for t in stored)

    def _storage_kept(self) -> bool:
        """Whether reset can zero the storage in place: made already, and on the CPU its host views still its own (a
        copy or an unpickled buffer has arrays of its own)."""
        if not isinstance(getattr(self, "value_tensor", None), th.Tensor):
            return False
        rows = getattr(self, "_host_rows", None)
        return rows is None or rows[0].ctypes.data == self.observations.data_ptr()

    @property
    def values(self) -> np.ndarray:  # type: ignore[override]
        """The value estimates on the host (a view on the CPU, a copy from a GPU)."""
        return self.value_tensor.cpu().numpy()

    @property
    def returns(self) -> np.ndarray:  # type: ignore[override]
        """The TD(lambda) returns on the host (a view on the CPU, a copy from a GPU)."""
        return self.return_tensor.cpu().numpy()

    def add(
        self,
        obs: np.ndarray | th.Tensor,
        action: np.ndarray,
        reward: np.ndarray,
        episode_start: np.ndarray,
        value: th.Tensor,
        log_prob: th.Tensor,
    ) -> None:
        """Store one step of ``n_envs`` transitions, as SB3's ``collect_rollouts`` passes them.

        Where ``obs`` is the array last passed to :meth:`stage`, the staged device copy is stored instead: one
        crossing to the device per step, not two.
        """
        obs = self._observations_to_store(obs, self._host_rows is not None)  # type: ignore[arg-type]
        row = self.pos
        # reshape covers Discrete observations and actions, and the 0-d log_prob of one env, as SB3's add does.
        new = (
            obs.reshape(self.observations.shape[1:]),
            action.reshape(self.n_envs, self.action_dim),
            reward.reshape(self.n_envs),
            episode_start.reshape(self.n_envs),
            value.detach().reshape(self.n_envs),
            log_prob.detach().reshape(self.n_envs),
        )
        storages = (self.observations, self.actions, self.rewards, self.episode_starts, self.value_tensor, self.log_probs)
        if self._host_rows is not None:
            for stored, storage, array in zip(self._host_rows, storages, new, strict=True):
                if isinstance(array, th.Tensor):  # the value and log-prob: a numpy write would read them back
                    storage[row].copy_(array)
                else:
                    stored[row] = array
        else:
            for storage, array in zip(storages, new, strict=True):
                # into the preallocated row; a device tensor (the value, the staged observations) is not copied twice
                if isinstance(array, th.Tensor):
                    storage[row].copy_(array)
                else:
                    copy_into(storage[row], array)
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True

    def compute_returns_and_advantage(self, last_values: th.Tensor, dones: np.ndarray) -> None:
        """GAE(lambda) advantages and TD(lambda) returns, SB3's recursion in the same float32 operations."""
        last_values = last_values.detach().reshape(1, self.n_envs).to(self.device)
        last_done = th.as_tensor(dones).reshape(1, self.n_envs).to(self.device, th.float32)
        next_non_terminal = 1.0 - th.cat((self.episode_starts[1:], last_done))
        next_values = th.cat((self.value_tensor[1:], last_values))
        # The step-independent part is one batched op; only the recursion below runs step by step.
        deltas = self.rewards + self.gamma * next_values * next_non_terminal - self.value_tensor
        discounts = self.gamma * self.gae_lambda * next_non_terminal
        last_gae_lam = th.zeros(self.n_envs, device=self.device)
        for step in reversed(range(self.buffer_size)):
            last_gae_lam = deltas[step] + discounts[step] * last_gae_lam
            self.advantages[step] = last_gae_lam
        self.return_tensor = self.advantages + self.value_tensor

    def get(self, batch_size: int | None = None) -> Generator[RolloutBufferSamples, None, None]:
        """One epoch of minibatches of ``batch_size`` (all at once when None), each index once, on the device."""
        assert self.full, "the rollout buffer is not full"
        n_samples = self.buffer_size * self.n_envs
        indices = self._permutation(n_samples)
        # SB3's flag for "flattened for sampling"; here the flat index addresses the (step, env) storage directly.
        self.generator_ready = True
        batch_size = batch_size or n_samples
        for start in range(0, n_samples, batch_size):
            yield self._get_samples(indices[start : start + batch_size])

    def _permutation(self, n: int) -> th.Tensor:
        # SB3's buffer draws np.random.permutation; drawing the seed from the same global RNG keeps set_random_seed
        # in charge, while the permutation itself is made on the device.
        self._generator.manual_seed(int(np.random.randint(np.iinfo(np.int64).max)))
        return th.randperm(n, generator=self._generator, device=self.device)

    def _get_samples(self, batch_inds: np.ndarray | th.Tensor, env: VecNormalize | None = None) -> RolloutBufferSamples:
        """The transitions at flat indices ``step * n_envs + env`` (SB3 orders its flat indices env-major)."""
        inds = th.as_tensor(batch_inds, device=self.device)

        def rows(storage: th.Tensor) -> th.Tensor:
            # index_select, not storage[inds]: on the CPU it is ~15x faster for frames (whole-row copies)
            return storage.flatten(0, 1).index_select(0, inds)

        return RolloutBufferSamples(
            observations=rows(self.observations),
            actions=rows(self.actions),
            old_values=rows(self.value_tensor),
            old_log_prob=rows(self.log_probs),
            advantages=rows(self.advantages),
            returns=rows(self.return_tensor),
        )
