"""A replay buffer whose storage, sampling and normalisation stay on the model's device, behind SB3's ReplayBuffer API."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.utils import get_device
from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.hardware import gpu_free_bytes, host_available_bytes
from sb3_gpu.extensions.handoff import ObservationHandOff
from sb3_gpu.extensions.hostcopy import copy_into, to_device

# The tensors a buffer owns (None where its layout has none); the rewards, dones and timeouts are views of _scalars.
_STORAGE = ("observations", "next_observations", "actions", "_scalars", "_terminal_obs", "_terminal_row")
_VIEWS = ("rewards", "dones", "timeouts")
_WRITTEN = ("observations", "next_observations", "actions", "_scalars")  # what add() writes at each step
_TERMINAL_ROWS = 64  # first size of the memory-optimised layout's store of episode-ending next observations


def _free_bytes(device: th.device) -> int | None:
    """Bytes free for new tensors on ``device``: CUDA's free memory, or the host's available RAM; None if unknown."""
    if device.type == "cuda":
        return gpu_free_bytes(device.index if device.index is not None else th.cuda.current_device())
    if device.type == "cpu":
        return host_available_bytes()
    return None


# Each buffer that an overlapped learn samples on a thread of its own: what a sample from any other thread (a user's
# callback) waits for first. A sample of sb3_gpu's buffers changes the draw state (PER's strata and last draw, the
# buffer's generator) that the running training reads; SB3's own buffers keep none but NumPy's global generator.
_SAMPLE_GATES: weakref.WeakKeyDictionary[BaseBuffer, Callable[[], None]] = weakref.WeakKeyDictionary()


def gate_samples(buffer: BaseBuffer | None, wait: Callable[[], None] | None) -> None:
    """Have :func:`ready_to_sample` call ``wait`` before each of ``buffer``'s samples (None: no longer)."""
    if buffer is None:
        return
    if wait is None:
        _SAMPLE_GATES.pop(buffer, None)
    else:
        _SAMPLE_GATES[buffer] = wait


def ready_to_sample(buffer: BaseBuffer) -> None:
    """Before a sample: wait where :func:`gate_samples` says, then refuse an empty buffer."""
    wait = _SAMPLE_GATES.get(buffer)
    if wait is not None:
        wait()
    refuse_empty(buffer)


def refuse_empty(buffer: BaseBuffer) -> None:
    """A clear error for sampling a buffer that holds nothing yet (the draws would fail in torch or numpy, or pick
    slots never written)."""
    if buffer.size() == 0:
        raise ValueError(f"cannot sample from an empty {type(buffer).__name__}: add transitions first")


def check_n_steps(n_steps: Any) -> int:
    """A buffer's ``n_steps`` (1: one-step targets), refused unless an int >= 1."""
    number = isinstance(n_steps, (int, float, np.integer, np.floating)) and not isinstance(n_steps, bool)
    if not number or not math.isfinite(n_steps) or int(n_steps) != n_steps or n_steps < 1:
        raise ConfigError(f"n_steps must be an int >= 1, got {n_steps!r}")
    return int(n_steps)


def size_text(n: float) -> str:
    """Bytes as the plan and the memory checks print them: GiB, MiB, KiB or bytes."""
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{int(n)} bytes"


def _torch_dtype(dtype: Any) -> th.dtype:
    return th.from_numpy(np.zeros(0, dtype=dtype)).dtype


def _resolve(device: th.device | str) -> th.device:
    device = get_device(device)
    if device.type == "cuda" and device.index is None:
        return th.device("cuda", th.cuda.current_device())  # so that equal devices compare equal
    return device


class DeviceReplayBuffer(ObservationHandOff, ReplayBuffer):
    """SB3's ReplayBuffer with its storage as tensors on ``device``, sampled and normalised there (no host round trip).

    Pass it as ``replay_buffer_class=DeviceReplayBuffer`` to DQN or QR-DQN. Observations keep their space's dtype
    (uint8 frames cross to the device once, as uint8) and samples have the dtypes SB3's buffer gives. Indices come from
    the buffer's own torch generator, seeded from numpy's global RNG at each draw, so ``set_random_seed`` repeats a run.
    Unlike SB3's, ``optimize_memory_usage`` works with ``handle_timeout_termination``: the next observation of each
    transition that ended an episode is kept aside, so sampled next observations are always exact.

    With ``n_steps`` > 1 samples carry n-step returns and their ``discounts``, as SB3's NStepReplayBuffer computes them.

    :raises ConfigError: when the storage does not fit in the device's free memory, or for Dict observations
    """

    n_steps: int = 1  # class defaults: buffers pickled before n-step returns existed load with one-step returns
    gamma: float = 0.99

    # The base class declares numpy arrays; here the same names hold tensors (and None where a layout has none).
    observations: th.Tensor  # type: ignore[assignment]
    next_observations: th.Tensor | None  # type: ignore[assignment]
    actions: th.Tensor  # type: ignore[assignment]
    rewards: th.Tensor  # type: ignore[assignment]
    dones: th.Tensor  # type: ignore[assignment]
    timeouts: th.Tensor  # type: ignore[assignment]
    _device: th.device
    _scalars: th.Tensor  # (slot, env, [reward, done, timeout])
    # The memory-optimised layout's only (None in the other): next observations of episode ends, and each slot's row.
    _terminal_obs: th.Tensor
    _terminal_row: th.Tensor

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        n_steps: int = 1,
        gamma: float = 0.99,
    ):
        if isinstance(observation_space, spaces.Dict):
            raise ConfigError("DeviceReplayBuffer does not take Dict observations; use SB3's (replay_buffer_class=None)")
        # BaseBuffer's __init__, not ReplayBuffer's: that one allocates numpy arrays of the full size.
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = optimize_memory_usage
        self.handle_timeout_termination = handle_timeout_termination
        self.n_steps, self.gamma = check_n_steps(n_steps), float(gamma)
        self._generator: th.Generator | None = None
        self._allocate()

    # -- storage and device ---------------------------------------------------------------------------------------

    @property
    def device(self) -> th.device:
        """The device of the storage and the samples; setting it moves the storage (as SB3's load_replay_buffer does)."""
        return self._device

    @device.setter
    def device(self, device: th.device | str) -> None:
        device = _resolve(device)
        if getattr(self, "_scalars", None) is not None and device != self._device:
            self._check_fits(self._storage_bytes(), device)
            self._place({name: getattr(self, name) for name in _STORAGE}, device)
        self._device = device

    def _specs(self) -> dict[str, tuple[tuple[int, ...], th.dtype]]:
        steps, envs = self.buffer_size, self.n_envs
        obs = ((steps, envs, *self.obs_shape), _torch_dtype(self.observation_space.dtype))
        specs = {
            "observations": obs,
            "actions": ((steps, envs, self.action_dim), _torch_dtype(self._maybe_cast_dtype(self.action_space.dtype))),
            "_scalars": ((steps, envs, 3), th.float32),  # rewards, dones, timeouts: one copy to the device per step
        }
        if self.optimize_memory_usage:
            specs["_terminal_obs"] = ((min(_TERMINAL_ROWS, steps * envs), *self.obs_shape), obs[1])
            specs["_terminal_row"] = ((steps, envs), th.int64)
        else:
            specs["next_observations"] = obs
        return specs

    def _allocate(self) -> None:
        specs = self._specs()
        needed = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
        self._check_fits(needed, self.device)
        arrays = {name: th.zeros(shape, dtype=dtype, device=self.device) for name, (shape, dtype) in specs.items()}
        self._place({name: arrays.get(name) for name in _STORAGE}, self.device)
        # The host's copy of _terminal_row and the store's free rows: adding reads them without asking the device.
        self._terminal_row_host = np.full((self.buffer_size if self.optimize_memory_usage else 0, self.n_envs), -1)
        self._free_rows: list[int] = []
        self.reset()

    def _check_fits(self, needed: int, device: th.device, what: str | None = None) -> None:
        free = _free_bytes(device)
        if free is not None and needed > free:
            what = what or f"a device replay buffer of {self.buffer_size * self.n_envs:,} transitions"
            raise ConfigError(
                f"{what} needs {size_text(needed)} on {device}; {size_text(free)} is free: lower buffer_size or use "
                "SB3's host buffer (--set device_buffers=false; replay_buffer_class=None for a model built by hand)"
            )

    def _storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for name in _STORAGE if (t := getattr(self, name)) is not None)

    def host_copy_bytes(self) -> int:
        """The host memory a save (a pickle) takes for the storage: all of it away from the CPU, none on it (there the
        pickle reads the storage's own memory)."""
        return 0 if self._device.type == "cpu" else self._storage_bytes()

    def _place(self, arrays: dict[str, th.Tensor | np.ndarray | None], device: th.device) -> None:
        """Set the storage from tensors or arrays, on ``device``, and bind the views of ``_scalars``."""
        for name, array in arrays.items():
            if isinstance(array, np.ndarray):
                array = th.from_numpy(array if array.flags.writeable else array.copy())
            setattr(self, name, None if array is None else array.to(device))
        self.rewards, self.dones, self.timeouts = self._scalars.unbind(dim=2)
        # On the CPU the tensors are host memory, and add() writes each step through numpy views of it: a numpy
        # write costs a fraction of a torch indexing call, which matters at every env step.
        self._host_views = {}
        if device.type == "cpu":
            self._host_views = {name: t.numpy() for name in _WRITTEN if (t := getattr(self, name)) is not None}
        self._generator = None  # a generator belongs to one device; the next sample seeds a new one

    def __getstate__(self) -> dict[str, Any]:
        # The pickle holds numpy arrays, which load anywhere (and through sb3_gpu's allowlist unpickler), not tensors.
        state = self.__dict__.copy()
        for name in _STORAGE:
            state[name] = None if state[name] is None else state[name].cpu().numpy()
        for name in (*_VIEWS, "_generator", "_host_views"):
            del state[name]
        state.pop("_staged", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        arrays = {name: state.pop(name) for name in _STORAGE}
        self.__dict__.update(state)
        device = self._device
        if device.type == "cuda" and (not th.cuda.is_available() or (device.index or 0) >= th.cuda.device_count()):
            # Saved on a GPU this machine lacks: build on the CPU; the loaders then move it to the model's device.
            device = self._device = th.device("cpu")
        if device.type != "cpu":  # on the CPU the unpickled arrays become the storage, taking no more memory
            self._check_fits(sum(a.nbytes for a in arrays.values() if a is not None), device)
        self._place(arrays, device)

    # -- adding ---------------------------------------------------------------------------------------------------

    def _write(self, name: str, pos: int, array: np.ndarray | th.Tensor) -> None:
        """``storage[pos] = array`` for the storage ``name``, converted to its dtype: one copy to the device, none
        from a tensor there already."""
        storage = getattr(self, name)
        if isinstance(array, th.Tensor):
            storage[pos] = array.reshape(storage.shape[1:])
            return
        view = self._host_views.get(name)
        if view is not None:
            view[pos] = array
        else:
            copy_into(storage[pos], array)

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        stored_obs = self._observations_to_store(obs, "observations" in self._host_views)
        if isinstance(self.observation_space, spaces.Discrete):
            stored_obs = stored_obs.reshape((self.n_envs, *self.obs_shape))
            next_obs = next_obs.reshape((self.n_envs, *self.obs_shape))
        timeouts = [info.get("TimeLimit.truncated", False) for info in infos] if self.handle_timeout_termination else 0.0
        scalars = np.empty((self.n_envs, 3), dtype=np.float32)
        scalars[:, 0], scalars[:, 1], scalars[:, 2] = reward, done, timeouts
        pos = self.pos

        self._write("observations", pos, stored_obs)
        if self.next_observations is not None:
            self._write("next_observations", pos, next_obs)
        else:
            self._write("observations", (pos + 1) % self.buffer_size, next_obs)
            self._keep_episode_ends(pos, next_obs, np.asarray(done))
        self._write("actions", pos, action.reshape((self.n_envs, self.action_dim)))
        self._write("_scalars", pos, scalars)

        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
            self.pos = 0

    def _keep_episode_ends(self, pos: int, next_obs: np.ndarray, done: np.ndarray) -> None:
        # In one-copy storage slot pos + 1 holds the next step's observation, which is the reset one where an episode
        # ended; so the true next observation of such a transition is stored aside, in a row that slot pos points to.
        old = self._terminal_row_host[pos]
        self._free_rows += old[old >= 0].tolist()
        ended = np.flatnonzero(done)
        if len(ended) == 0 and (old < 0).all():
            return  # nothing to write, so no copy to the device
        while len(self._free_rows) < len(ended):
            self._grow_terminal_store()
        rows = np.full(self.n_envs, -1, dtype=np.int64)
        for env in ended:
            rows[env] = row = self._free_rows.pop()
            copy_into(self._terminal_obs[row], next_obs[int(env)])
        self._terminal_row_host[pos] = rows
        copy_into(self._terminal_row[pos], rows)

    def _grow_terminal_store(self) -> None:
        old = self._terminal_obs
        # A slot keeps at most one row per env, so the store never needs more rows than the buffer has transitions.
        rows = min(2 * len(old), self.buffer_size * self.n_envs)
        if rows <= len(old):
            raise AssertionError(f"the store of episode ends is full at {len(old):,} rows, one per transition")
        self._check_fits(
            rows * old[0].numel() * old.element_size(),
            old.device,
            f"the store of episode ends' next observations grows to {rows:,} rows, which",
        )
        grown = th.empty((rows, *old.shape[1:]), dtype=old.dtype, device=old.device)
        grown[: len(old)] = old
        self._free_rows += range(len(old), len(grown))
        self._terminal_obs = grown

    def end_episodes_under_way(self) -> None:
        """See :func:`end_episodes_under_way`; in one-copy storage the next observations of the cut transitions, in
        slot ``pos`` that the resumed run's first step overwrites, are kept aside as an episode end's are."""
        if self.pos == 0 and not self.full:
            return
        last = (self.pos - 1) % self.buffer_size
        scalars = self._scalars[last]  # (env, [reward, done, timeout])
        under_way = (scalars[:, 1] == 0) & (scalars[:, 2] == 0)  # not cut already (a run saved again before a step)
        scalars[:, 2] = th.where(under_way, 1.0, scalars[:, 2])
        if self.next_observations is not None:
            return
        rows = self._terminal_row_host[last].copy()
        for env in np.flatnonzero(under_way.cpu().numpy()):
            while not self._free_rows:
                self._grow_terminal_store()
            rows[env] = row = self._free_rows.pop()
            self._terminal_obs[row] = self.observations[self.pos, env]
        self._terminal_row_host[last] = rows
        copy_into(self._terminal_row[last], rows)

    def episode_end_observations(self) -> th.Tensor | None:
        """The next observations kept aside for episode ends, the rows in use (the memory-optimised layout; None in the
        other, whose next observations are all in ``next_observations``)."""
        if self.next_observations is not None:
            return None
        rows = self._terminal_row_host[self._terminal_row_host >= 0]
        return self._terminal_obs[th.as_tensor(rows, device=self._terminal_obs.device)]

    def reset(self) -> None:
        super().reset()
        if self.optimize_memory_usage:
            self._terminal_row.fill_(-1)
            self._terminal_row_host.fill(-1)
            self._free_rows = list(range(len(self._terminal_obs)))

    # -- sampling -------------------------------------------------------------------------------------------------

    def _rng(self) -> th.Generator:
        # Seeded afresh from numpy's global RNG at every draw, as SB3's buffer draws its indices from it: a
        # set_random_seed repeats the samples that follow it, whenever it is called (seeding is a host write: no wait).
        if self._generator is None:
            self._generator = th.Generator(device=self.device)
        self._generator.manual_seed(int(np.random.randint(0, 2**63 - 1, dtype=np.int64)))
        return self._generator

    def _randint(self, low: int, high: int, n: int) -> th.Tensor:
        return th.randint(low, high, (n,), generator=self._rng(), device=self.device)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """``batch_size`` transitions drawn uniformly over filled slots and envs, as tensors on the buffer's device.

        As SB3's, with ``optimize_memory_usage`` a full buffer never draws slot ``pos``, whose observation was replaced.
        """
        ready_to_sample(self)
        if self.optimize_memory_usage and self.full:
            batch_inds = (self._randint(1, self.buffer_size, batch_size) + self.pos) % self.buffer_size
        else:
            batch_inds = self._randint(0, self.buffer_size if self.full else self.pos, batch_size)
        return self._get_samples(batch_inds, env)

    # -- sampling inside a compiled step ---------------------------------------------------------------------------

    def samples_in_graph(self, env: VecNormalize | None) -> bool:
        """Whether :meth:`samples_at_draws` can stand for ``sample``: both observations kept (the one-copy layout skips
        a slot by the write position) and no normalisation (its statistics change at every env step)."""
        return not self.optimize_memory_usage and env is None

    def fill_position(self, position: th.Tensor) -> None:
        """Write :meth:`samples_at_draws`'s ``position``: the slots filled, and the newest one (int64, on the device).
        Before a compiled step samples in its graph, as :meth:`sample` does before it draws: an empty buffer is refused
        here, in one line, not inside the graph (on a GPU, a device-side assert that ends the process's CUDA use)."""
        refuse_empty(self)
        position[0].fill_(self.size())  # fill_, not a copy from a host tensor: that copy would wait for the device
        position[1].fill_((self.pos - 1) % self.buffer_size)

    def storage(self) -> list[th.Tensor]:
        """The tensors the buffer owns (a compiled step that samples inside its graph keeps them at fixed addresses)."""
        return [t for name in _STORAGE if (t := getattr(self, name)) is not None]

    def draws(self, batch_size: int, samples: int | None = None) -> th.Tensor:
        """Uniform draws in [0, 1) for :meth:`samples_at_draws`, from the buffer's generator: one op; ``samples``:
        those of that many samples at once (the first dimension), still one op. Double precision: a float's 2**24
        values would favour some slots of a million by 6% and never reach some beyond."""
        shape = (2, batch_size) if samples is None else (samples, 2, batch_size)
        return th.rand(shape, generator=self._rng(), device=self.device, dtype=th.float64)

    def samples_at_draws(self, draws: th.Tensor, position: th.Tensor) -> ReplayBufferSamples:
        """The transitions that ``draws`` pick, uniformly over the filled slots and over the envs; ``position`` (see
        :meth:`fill_position`) is a tensor, so that the write position moving does not compile the step anew. Pure
        tensor ops, so that a compiled step can sample inside its graph."""
        filled = position[0]
        batch_inds = th.minimum((draws[0] * filled).long(), filled - 1)  # float rounding must not reach `filled`
        env_inds = (draws[1] * self.n_envs).long().clamp(max=self.n_envs - 1) if self.n_envs > 1 else 0
        return self._get_samples_at(batch_inds, env_inds, newest=position[1])

    def _get_samples(self, batch_inds: np.ndarray | th.Tensor, env: VecNormalize | None = None) -> ReplayBufferSamples:
        env_inds = self._randint(0, self.n_envs, len(batch_inds)) if self.n_envs > 1 else 0
        return self._get_samples_at(batch_inds, env_inds, env)

    def _get_samples_at(
        self,
        batch_inds: np.ndarray | th.Tensor,
        env_inds: np.ndarray | th.Tensor | int,
        env: VecNormalize | None = None,
        newest: th.Tensor | None = None,
    ) -> ReplayBufferSamples:
        """The transitions at slots ``batch_inds`` of envs ``env_inds``, gathered on the device."""
        batch = th.as_tensor(batch_inds, device=self.device)  # no copy for sample()'s indices, already there
        env_t = env_inds if isinstance(env_inds, int) else th.as_tensor(env_inds, device=self.device)
        flat = batch * self.n_envs + env_t

        def gather(storage: th.Tensor, rows: th.Tensor) -> th.Tensor:
            # index_select, not storage[rows]: on the CPU it copies whole rows, about ten times faster for frames.
            return storage.view(-1, *storage.shape[2:]).index_select(0, rows)

        # The slot whose next observation and done the target bootstraps from: the sampled one, or with n-step
        # returns the last one the return took.
        end, end_flat, returns, discounts = batch, flat, None, None
        if self.n_steps > 1:
            end, returns, discounts = self._n_step_returns(batch, env_t, env, newest)
            end_flat = end * self.n_envs + env_t
        if self.next_observations is not None:
            next_obs = gather(self.next_observations, end_flat)
        else:
            next_obs = gather(self.observations, (end + 1) % self.buffer_size * self.n_envs + env_t)
            rows = gather(self._terminal_row.unsqueeze(-1), end_flat).view(-1)
            kept = self._terminal_obs.index_select(0, rows.clamp(min=0))
            next_obs = th.where((rows >= 0).view(-1, *[1] * (next_obs.dim() - 1)), kept, next_obs)
        rewards, dones, timeouts = gather(self._scalars, end_flat).unbind(dim=1)
        if returns is None:
            returns = self._device_normalize_reward(rewards.unsqueeze(1).contiguous(), env)
        return ReplayBufferSamples(
            observations=self._device_normalize_obs(gather(self.observations, flat), env),
            actions=gather(self.actions, flat),
            next_observations=self._device_normalize_obs(next_obs, env),
            # Only dones that are not timeouts end the bootstrap (timeouts stay zero unless handle_timeout_termination,
            # but for the episodes a resumed buffer cut off).
            dones=(dones * (1 - timeouts)).view(-1, 1),
            rewards=returns,
            discounts=discounts,
        )

    def _n_step_returns(
        self, batch: th.Tensor, env_t: th.Tensor | int, env: VecNormalize | None, newest: th.Tensor | None = None
    ) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
        """For each sampled slot: the last slot of its n-step return, the return, and ``gamma ** k`` for its ``k``
        slots. A return stops after the first slot that ends an episode (termination or time limit) and at the newest
        slot, whose successor is not written yet (or, in a full buffer, is the oldest data)."""
        steps = th.arange(self.n_steps, device=self.device)
        slots = (batch.unsqueeze(1) + steps) % self.buffer_size  # [batch, n]
        rows = slots * self.n_envs + (env_t if isinstance(env_t, int) else env_t.unsqueeze(1))
        rewards, dones, timeouts = self._scalars.view(-1, 3).index_select(0, rows.view(-1)).view(*rows.shape, 3).unbind(-1)
        ends = (dones + timeouts > 0) | (slots == ((self.pos - 1) % self.buffer_size if newest is None else newest))
        # argmax finds the first end; a row without one takes all n slots.
        taken = th.where(ends.any(dim=1), ends.to(th.uint8).argmax(dim=1), self.n_steps - 1) + 1
        weights = self.gamma ** steps.float() * (steps < taken.unsqueeze(1))
        returns = (self._device_normalize_reward(rewards, env) * weights).sum(dim=1, keepdim=True)
        last = slots.gather(1, (taken - 1).unsqueeze(1)).squeeze(1)
        return last, returns, (self.gamma ** taken.float()).unsqueeze(1)

    def _device_normalize_obs(self, obs: th.Tensor, env: VecNormalize | None) -> th.Tensor:
        # VecNormalize.normalize_obs on the device: the same float64 arithmetic, then float32.
        if env is None or not env.norm_obs:
            return obs
        stats = env.obs_rms
        assert not isinstance(stats, dict)  # Dict observations are refused in __init__
        mean, std = to_device(np.stack([stats.mean, np.sqrt(stats.var + env.epsilon)]), self.device, th.float64)
        return ((obs.double() - mean) / std).clamp(-env.clip_obs, env.clip_obs).float()

    def _device_normalize_reward(self, reward: th.Tensor, env: VecNormalize | None) -> th.Tensor:
        if env is None or not env.norm_reward:
            return reward
        std = float(np.sqrt(env.ret_rms.var + env.epsilon))
        return (reward.double() / std).clamp(-env.clip_reward, env.clip_reward).float()


def end_episodes_under_way(buffer: ReplayBuffer) -> None:
    """End the episodes under way in a loaded buffer where it was saved, as a time limit ends them (their targets
    bootstrap from the next observation): the resumed run starts its envs anew, and an n-step return must not run on
    from a saved episode into a new one."""
    if isinstance(buffer, DeviceReplayBuffer):
        buffer.end_episodes_under_way()
    elif buffer.pos > 0 or buffer.full:  # SB3's buffers and the host PER's, numpy arrays
        last = (buffer.pos - 1) % buffer.buffer_size
        buffer.timeouts[last] = np.logical_or(buffer.timeouts[last], buffer.dones[last] == 0)
