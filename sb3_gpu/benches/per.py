"""``bench per``: prioritized against uniform replay (sampling, priority updates, DQN gradient steps). Whether PER
helps a preset learn is ``bench solve --per on off``'s question."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.buffers import ReplayBuffer

from sb3_gpu.benches.base import paired_medians
from sb3_gpu.extensions.per import PrioritizedReplayBuffer, SumMinTree, tree_backends
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan


def _filled(buffer_class: type[ReplayBuffer], capacity: int, backend: str = "auto") -> ReplayBuffer:
    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    buffer = buffer_class(capacity, obs_space, gym.spaces.Discrete(2), "cpu")
    # Fill in chunks straight into the arrays (adding a million transitions one by one would dominate the bench).
    rng = np.random.default_rng(0)
    buffer.observations[:] = rng.normal(size=buffer.observations.shape)
    buffer.next_observations[:] = rng.normal(size=buffer.next_observations.shape)
    buffer.rewards[:] = 1.0
    buffer.full, buffer.pos = True, 0
    if isinstance(buffer, PrioritizedReplayBuffer):
        buffer.tree = SumMinTree(capacity, backend=backend)
        buffer.tree.update(np.arange(capacity), rng.uniform(0.01, 2.0, capacity) ** buffer.alpha)
    return buffer


def bench_per(batch: int, capacities: Sequence[int], repeats: int) -> list[tuple[str, float, float, float, float]]:
    """Rows of (case, uniform s, PER s, ratio, target ratio): sampling plus priority updates per tree backend at each
    capacity, then one DQN gradient step with and without PER."""
    rows = []
    for capacity in capacities:
        uniform = _filled(ReplayBuffer, capacity)
        td = np.random.default_rng(1).normal(size=batch)

        def uniform_step(uniform: ReplayBuffer = uniform) -> None:
            uniform.sample(batch)

        for backend in tree_backends():
            per = _filled(PrioritizedReplayBuffer, capacity, backend)
            assert isinstance(per, PrioritizedReplayBuffer)

            def per_step(per: PrioritizedReplayBuffer = per, td: np.ndarray = td) -> None:
                sample = per.sample(batch)
                per.update_priorities(sample.indices, td)

            u, p = paired_medians(uniform_step, per_step, repeats, 200)
            default = backend == tree_backends()[0]  # the backend this install uses
            case = f"sample({batch}) + update @ {capacity:.0e}, {backend} tree" + ("" if default else " (fallback)")
            rows.append((case, u, p, p / u, 2.0 if default else float("inf")))
            del per

    steps = []
    for per_on in (False, True):
        plan = make_plan("dqn", "CartPole-v1", "cpu", seed=0, overrides={"per": per_on, "learning_starts": 0})
        model: Any = build_model(plan, build_env(plan))
        model.learn(2_000)  # fill the buffer and set up the logger
        steps.append(lambda model=model: model.train(gradient_steps=1, batch_size=model.batch_size))
    base, step = paired_medians(steps[0], steps[1], repeats, 100)
    rows.append((f"DQN gradient step (CartPole preset, batch {model.batch_size})", base, step, step / base, 1.25))
    return rows
