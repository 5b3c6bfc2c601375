"""``bench per``: prioritized against uniform replay (sampling, priority updates, DQN gradient steps), and training
presets with PER on and off."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.buffers import ReplayBuffer

from sb3_gpu.benches.base import paired_medians
from sb3_gpu.extensions.per import PrioritizedReplayBuffer, SumMinTree, tree_backends
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.evaluation import evaluate_run
from sb3_gpu.runs.training import train_run


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


def bench_per_learning(
    algo: str, env_id: str, seeds: Sequence[int], per_settings: Sequence[bool]
) -> list[tuple[bool, int, float, float, float]]:
    """Train the preset as ``train`` does, with PER on and/or off: rows of (per, seed, final mean, best mean, wall s).

    The best model (chosen by periodic 5-episode evaluations) is re-evaluated on 20 fresh episodes.
    """
    results = []
    for per_on in per_settings:
        for seed in seeds:
            plan = make_plan(algo, env_id, "auto", seed=seed, overrides={"per": per_on})
            with tempfile.TemporaryDirectory(prefix="sb3_gpu_bench_") as tmp:
                summary = train_run(plan, Path(tmp) / "run", eval_episodes=5, progress=False, report_s=None)
                best = evaluate_run(Path(tmp) / "run", episodes=20, seed=123)["mean"]
            final = summary["final_eval_mean"]
            results.append((per_on, seed, final, best, summary["wall_time_s"]))
            print(
                f"  PER {'on ' if per_on else 'off'} seed {seed}: final model {final:.1f}, best model {best:.1f}"
                f" in {summary['wall_time_s']:.0f} s",
                flush=True,
            )
    return results
