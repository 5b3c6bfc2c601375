"""EnvPool (C++ envs stepped by a thread pool) as an SB3 VecEnv with DummyVecEnv's semantics.

EnvPool resets a finished env on the *next* step and ignores that step's action; SB3 expects the first observation
of the new episode in the same step that reported ``done``. The adapter bridges the two by stepping the finished
envs once more at once (EnvPool's own reset step, so Atari's episodic-life continues the game as SB3's
EpisodicLifeEnv does), and keeps Monitor's episode statistics so that ``rollout/ep_rew_mean`` is right, also under
an outer VecMonitor, whose per-life statistics it keeps out of the infos.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.monitor import Monitor, ResultsWriter
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn

from sb3_gpu.common.errors import ConfigError, install_hint
from sb3_gpu.envs.batched import env_indices
from sb3_gpu.envs.spec import ATARI_FRAME_SKIP

# Gymnasium ids whose EnvPool twin has the same spaces, dynamics and time limit. Atari games map separately.
SUPPORTED_IDS = frozenset(
    {
        "CartPole-v0",
        "CartPole-v1",
        "Acrobot-v1",
        "MountainCar-v0",
        "MountainCarContinuous-v0",
        "Pendulum-v1",
        "LunarLander-v3",
        "LunarLanderContinuous-v3",
        "BipedalWalker-v3",
        "BipedalWalkerHardcore-v3",
    }
)


# EnvPool asserts that a seed fits an int32, while SB3's VecEnv.seed() draws seeds up to 2**32 (plus the env
# index). Folding them into [0, 2**31) keeps every SB3 seed valid and deterministic; s and s + 2**31 share streams.
_SEED_RANGE = 2**31


class _GameInfo(dict):
    """The info of a finished env, whose ``episode`` (present only when a whole game ended) no wrapper can replace.

    SB3's VecMonitor writes its own ``episode`` into a copy of every finished env's info. Over EnvPool's episodic
    life and clipped rewards those are per-life sums of clipped rewards, which SB3's ``rollout/ep_rew_mean`` and
    ``evaluate_policy`` would then report instead of the game scores this adapter already measures.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        if key != "episode":
            super().__setitem__(key, value)
        else:  # shown once per calling line (the warnings registry), and it contradicts VecMonitor's own warning
            warnings.warn(
                "EnvPoolVecEnv keeps its whole-game statistics in info['episode']; an outer VecMonitor's "
                "(per life, of clipped rewards) are dropped",
                UserWarning,
                stacklevel=2,
            )

    def copy(self) -> _GameInfo:
        return _GameInfo(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle and deepcopy would otherwise restore the items through __setitem__, which drops ``episode``.
        return _GameInfo, (dict(self),)


def envpool_available() -> bool:
    return importlib.util.find_spec("envpool") is not None


@functools.cache
def envpool_failure(env_id: str, is_atari: bool) -> str | None:
    """Why EnvPool cannot make this env here, in one line (None: a one-env pool was made and closed). Asked once
    per env and process: a one-env Atari pool takes about a second."""
    try:
        EnvPoolVecEnv(env_id, 1, is_atari=is_atari).close()
    except Exception as e:  # an import of envpool's own dependencies, a missing ROM, ...: any failure disqualifies it
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def no_twin(env_id: str) -> str:
    """Why ``vec_env='envpool'`` cannot run ``env_id`` (one that :func:`envpool_task` has no twin of)."""
    return (
        f"vec_env 'envpool' has no faithful twin of {env_id!r} (supported: {', '.join(sorted(SUPPORTED_IDS))} and Atari "
        "games as ALE/<Game>-v5 or <Game>NoFrameskip-v4 ids)"
    )


def envpool_task(env_id: str, is_atari: bool) -> tuple[str, dict[str, Any]] | None:
    """EnvPool's task id and config for a Gymnasium id, or None where EnvPool has no faithful twin."""
    if is_atari:
        # Only ids that leave frame skipping to SB3's wrapper: v5 (whose own skip sb3_gpu turns off) and NoFrameskip.
        registered = gym.registry[env_id].kwargs if env_id in gym.registry else {}
        if not (env_id.startswith("ALE/") and env_id.endswith("-v5")) and registered.get("frameskip") != 1:
            return None
        game = env_id.removeprefix("ALE/").split("-")[0].removesuffix("NoFrameskip")
        # SB3's AtariWrapper: 30 no-ops, skip 4 with max-pooling, life loss ends the episode, rewards clipped,
        # 84x84 grey, fire on reset. Sticky actions as the id registers them (0.25 for v5 and v0, 0 for v4).
        config = dict(
            episodic_life=True,
            reward_clip=True,
            stack_num=1,
            noop_max=30,
            frame_skip=ATARI_FRAME_SKIP,
            img_height=84,
            img_width=84,
            repeat_action_probability=float(registered.get("repeat_action_probability", 0.25)),
        )
        return f"{game[:1].upper()}{game[1:]}-v5", config
    if env_id in SUPPORTED_IDS:
        return env_id, {}
    return None


class EnvPoolVecEnv(VecEnv):
    """An EnvPool pool behind SB3's VecEnv interface.

    :param env_id: a Gymnasium id with an EnvPool twin (see :data:`SUPPORTED_IDS`) or an Atari game
    :param n_envs: number of envs
    :param seed: seed of the first env (env ``i`` gets ``seed + i``), any int; reseeding rebuilds the pool
    :param is_atari: apply SB3's Atari preprocessing inside EnvPool
    :param monitor_dir: write Monitor-format CSV files here, one per env
    :param start_index: the index of the first env, which names its Monitor file (as in SB3's ``make_vec_env``)
    :param num_threads: EnvPool's thread count (default: EnvPool's, one per core)
    :param channels_first: Atari frames as EnvPool makes them, (1, 84, 84), for a channel-first frame stack that
        SB3 then takes as it is (no transposes); otherwise (84, 84, 1), as SB3's AtariWrapper gives them
    """

    def __init__(
        self,
        env_id: str,
        n_envs: int,
        *,
        seed: int | None = None,
        is_atari: bool = False,
        monitor_dir: str | None = None,
        start_index: int = 0,
        num_threads: int = 0,
        channels_first: bool = False,
    ):
        task = envpool_task(env_id, is_atari)
        if task is None:
            raise ConfigError(no_twin(env_id))
        if not envpool_available():
            raise ConfigError(f"vec_env 'envpool' needs EnvPool: {install_hint('envpool')}")
        self.env_id, (self.task, self.config) = env_id, task
        self.is_atari, self.num_threads = is_atari, num_threads
        self._channels_last = is_atari and not channels_first
        self.pool = self._make_pool(n_envs, seed)
        self._pool_seed, self._fresh = seed, True  # a fresh pool already holds the seed: no rebuild on first reset
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # EnvPool's Box bounds are float64; gymnasium warns on cast
            space, action_space = self.pool.observation_space, self.pool.action_space
        if self._channels_last:  # EnvPool is channel-first; SB3's AtariWrapper gives (84, 84, 1), so match it
            space = gym.spaces.Box(0, 255, (*space.shape[1:], space.shape[0]), np.uint8)
        super().__init__(n_envs, space, action_space)
        self._frames_per_step = int(self.config.get("frame_skip", 1))
        self._returns = np.zeros(n_envs, dtype=np.float64)
        self._lengths = np.zeros(n_envs, dtype=np.int64)
        self._start = time.time()
        header: dict[str, float | str] = {"t_start": self._start, "env_id": env_id}
        names = [str(start_index + i) for i in range(n_envs)]
        self._writers = [ResultsWriter(os.path.join(monitor_dir, n), header=header) for n in names] if monitor_dir else []
        self._actions: np.ndarray | None = None

    def _make_pool(self, n_envs: int, seed: int | None) -> Any:
        import envpool

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # EnvPool's Box bounds are float64; gymnasium warns on cast
            return envpool.make(
                self.task,
                env_type="gymnasium",
                num_envs=n_envs,
                seed=int(np.random.randint(_SEED_RANGE)) if seed is None else seed % _SEED_RANGE,
                num_threads=self.num_threads,
                **self.config,
            )

    def _obs(self, obs: np.ndarray) -> np.ndarray:
        return np.moveaxis(obs, 1, -1) if self._channels_last else obs

    def reset(self) -> VecEnvObs:
        seed = self._seeds[0]
        if seed is not None and not (self._fresh and seed == self._pool_seed):  # EnvPool seeds when it builds a pool
            self.pool.close()
            self.pool = self._make_pool(self.num_envs, seed)
            self._pool_seed = seed
        self._fresh = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # EnvPool builds its Box spaces from float64 bounds
            obs, _ = self.pool.reset()
        self.reset_infos = [{} for _ in range(self.num_envs)]
        self._returns[:], self._lengths[:] = 0.0, 0
        self._reset_seeds()
        self._reset_options()
        return self._obs(obs)

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = np.asarray(actions)

    def step_wait(self) -> VecEnvStepReturn:
        assert self._actions is not None, "step_async first"
        obs, rewards, terminated, truncated, info = self.pool.step(self._actions)
        obs = self._obs(obs)
        dones = terminated | truncated
        # Monitor sits below SB3's Atari wrapper, so it counts whole games with unclipped rewards.
        self._returns += info.get("reward", rewards)
        # SB3's Monitor sits below the frame skip, so on Atari it counts frames; it also counts the reset no-ops and
        # FIRE steps of SB3's wrappers above it, which EnvPool takes inside its reset: this count leaves those out.
        self._lengths += self._frames_per_step
        infos: list[dict[str, Any]] = [
            {"TimeLimit.truncated": bool(tr and not te)} for te, tr in zip(terminated, truncated, strict=True)
        ]
        done_ids = np.flatnonzero(dones)
        if done_ids.size:
            game_over = truncated | (info["terminated"].astype(bool) if "terminated" in info else terminated)
            for i in done_ids:
                done_info = {**infos[i], "terminal_observation": obs[i].copy()}
                if game_over[i]:
                    episode = {
                        "r": float(self._returns[i]),
                        "l": int(self._lengths[i]),
                        "t": round(time.time() - self._start, 6),
                    }
                    done_info["episode"] = episode
                    if self._writers:
                        self._writers[i].write_row(episode)
                    self._returns[i], self._lengths[i] = 0.0, 0
                infos[i] = _GameInfo(done_info)
            # EnvPool's reset step for the finished envs (its action is ignored): the new episode's first obs.
            blank = np.zeros((done_ids.size, *self._actions.shape[1:]), dtype=self._actions.dtype)
            new_obs, _, _, _, new_info = self.pool.step(blank, done_ids.astype(np.int32))
            obs[new_info["env_id"]] = self._obs(new_obs)
        return obs, rewards.astype(np.float32), dones, infos

    def close(self) -> None:
        self.pool.close()
        for writer in self._writers:
            writer.close()

    def get_images(self) -> Sequence[np.ndarray | None]:
        warnings.warn("The render mode is None (EnvPool does not render), but get_images() needs 'rgb_array'", stacklevel=2)
        return [None] * self.num_envs

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        if attr_name == "render_mode":
            return [None] * len(env_indices(indices, self.num_envs))
        raise AttributeError(f"EnvPoolVecEnv has no per-env Python objects, so no attribute {attr_name!r}")

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        raise AttributeError(f"EnvPoolVecEnv cannot set {attr_name!r}: its envs are C++ objects")

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any
    ) -> list[Any]:
        raise AttributeError(f"EnvPoolVecEnv cannot call {method_name!r}: its envs are C++ objects")

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        # The infos carry Monitor's episode statistics, which is what callers asking about Monitor want (SB3's
        # evaluate_policy counts whole games by them; VecMonitor warns, and its statistics are kept out: _GameInfo).
        return [wrapper_class is Monitor] * len(env_indices(indices, self.num_envs))
