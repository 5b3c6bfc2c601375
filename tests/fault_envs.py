"""Envs that fail on purpose, named ``tests.fault_envs:FaultyCartPoleV1`` on the training CLI."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

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
