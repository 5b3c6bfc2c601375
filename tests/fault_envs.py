"""Envs that fail on purpose, importable as ``tests.fault_envs:FaultyCartPole`` by the training CLI."""

from __future__ import annotations

import time
from typing import Any

from gymnasium.envs.classic_control import CartPoleEnv


class FaultyCartPole(CartPoleEnv):
    """CartPole that, counting its own steps, raises at ``raise_at``, returns NaN rewards from ``nan_at`` on,
    and sleeps ``sleep`` seconds per step (so that a test can land a signal inside a step)."""

    def __init__(self, raise_at: int = 0, nan_at: int = 0, sleep: float = 0.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.raise_at, self.nan_at, self.sleep = raise_at, nan_at, sleep
        self.steps = 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.raise_at and self.steps >= self.raise_at:
            raise RuntimeError(f"boom at step {self.steps}")
        if self.sleep:
            time.sleep(self.sleep)
        obs, reward, terminated, truncated, info = super().step(action)
        if self.nan_at and self.steps >= self.nan_at:
            reward = float("nan")
        return obs, reward, terminated, truncated, info


def faulty_cartpole(**kwargs: Any) -> Any:
    """:class:`FaultyCartPole` with CartPole-v1's 500-step limit."""
    from gymnasium.wrappers import TimeLimit

    return TimeLimit(FaultyCartPole(**kwargs), max_episode_steps=500)
