"""Envs that fail on purpose, named ``tests.fault_envs:FaultyCartPoleV1`` (or ``:Endless``) on the training CLI."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.classic_control import CartPoleEnv
from gymnasium.wrappers import TimeLimit


class FaultyCartPole(CartPoleEnv):
    """CartPole that, counting its own steps, raises at ``raise_at``, returns NaN rewards from ``nan_at`` on,
    sleeps ``sleep`` seconds per step, and at step ``block_at`` creates the file ``marker`` and then sleeps for a
    minute (so that a test can land signals inside that step, knowing it is there)."""

    def __init__(
        self, raise_at: int = 0, nan_at: int = 0, sleep: float = 0.0, block_at: int = 0, marker: str = "", **kwargs: Any
    ):
        super().__init__(**kwargs)
        self.raise_at, self.nan_at, self.sleep = raise_at, nan_at, sleep
        self.block_at, self.marker = block_at, marker
        self.steps = 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.raise_at and self.steps >= self.raise_at:
            raise RuntimeError(f"boom at step {self.steps}")
        if self.sleep:
            time.sleep(self.sleep)
        if self.block_at and self.steps == self.block_at:
            Path(self.marker).touch()
            time.sleep(60)  # a signal handler runs during the sleep; one that raises ends it
        obs, reward, terminated, truncated, info = super().step(action)
        if self.nan_at and self.steps >= self.nan_at:
            reward = float("nan")
        return obs, reward, terminated, truncated, info


class FaultyCartPoleV1(TimeLimit):
    """:class:`FaultyCartPole` with CartPole-v1's 500-step limit (a class: a name on the CLI may only be an env class)."""

    def __init__(self, **kwargs: Any):
        super().__init__(FaultyCartPole(**kwargs), max_episode_steps=500)


class SlowCartPoleV1(FaultyCartPoleV1):
    """:class:`FaultyCartPoleV1` that sleeps ``SB3_GPU_TEST_STEP_SLEEP`` seconds per step (none where it is unset):
    the same command, slow in one process and quick in another."""

    def __init__(self, **kwargs: Any):
        super().__init__(sleep=float(os.environ.get("SB3_GPU_TEST_STEP_SLEEP", "0")), **kwargs)


class NanPendulum(TimeLimit):
    """Pendulum-v1 (continuous actions, 200-step episodes) whose rewards (``what="observation"``: observations) turn
    NaN from its own step ``nan_at`` on; ``what="reset"``: whose first reset returns a NaN observation."""

    def __init__(self, nan_at: int = 0, what: str = "reward", **kwargs: Any):
        from gymnasium.envs.classic_control import PendulumEnv

        super().__init__(PendulumEnv(**kwargs), max_episode_steps=200)
        self.nan_at, self.steps, self.what = nan_at, 0, what

    def reset(self, **kwargs: Any) -> Any:
        obs, info = super().reset(**kwargs)
        if self.what == "reset" and self.steps == 0:
            obs = np.full_like(obs, np.nan)
        return obs, info

    def step(self, action: Any) -> Any:
        self.steps += 1
        obs, reward, terminated, truncated, info = super().step(action)
        if self.nan_at and self.steps >= self.nan_at:
            if self.what == "observation":
                obs = np.full_like(obs, np.nan)
            else:
                reward = float("nan")
        return obs, reward, terminated, truncated, info


class Endless(gym.Env):
    """An env with no time limit whose episodes never end, whatever the policy does (a corridor with no exit).

    Every instance in a process counts into ``Endless.steps``; at the ``signal_at``-th of those steps the env sends
    ``signum`` to its own process, so that a test can land a signal at a known point (training's first rollout, then
    an evaluation). An episode of ``give_up`` steps raises: without an evaluation step cap, that is a hang.
    """

    steps = 0  # over all instances in this process
    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, signal_at: int = 0, signum: int = int(signal.SIGINT), give_up: int = 20_000):
        self.signal_at, self.signum, self.give_up = signal_at, signum, give_up
        self.episode_steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.episode_steps = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> Any:
        Endless.steps += 1
        self.episode_steps += 1
        if self.episode_steps >= self.give_up:
            raise RuntimeError(f"an episode of {self.give_up:,} steps: nothing cut it")
        if Endless.steps == self.signal_at:
            os.kill(os.getpid(), self.signum)
        return np.full(2, float(action) - 0.5, np.float32), 0.0, False, False, {}


class Launcher(CartPoleEnv):
    """CartPole that starts a program and stops it with SIGTERM, as an env driving a simulator process does."""

    def stop_a_program(self) -> int:
        import subprocess
        import sys

        code = "import time; print('up', flush=True); time.sleep(60)"
        program = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert program.stdout is not None and program.stdout.readline() == "up\n"  # under way: its own process
        program.terminate()
        with program.stdout:
            return program.wait(timeout=20)


class ChannelLastImages(gym.Env):
    """Channel-last uint8 images (SB3 moves them channels first for the model, in VecTransposeImage), 36x36 as
    NatureCNN takes at least; reward 1 for action 1, episodes of 8 steps."""

    observation_space = spaces.Box(0, 255, (36, 36, 1), np.uint8)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action: Any) -> Any:
        self.t += 1
        return self.observation_space.sample(), float(action), False, self.t >= 8, {}
