"""``bench telemetry``: what the callbacks that every sb3_gpu training adds cost, in env steps/s of ``learn``."""

from __future__ import annotations

import functools
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback

from sb3_gpu.benches.base import paired_times
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.callbacks import NanGuard, StopOnSignal
from sb3_gpu.runs.telemetry import ThroughputCallback

TELEMETRY_CASES = [
    ("PPO CartPole preset", "ppo", "CartPole-v1", {}),
    ("DQN CartPole preset", "dqn", "CartPole-v1", {"per": False}),
]


def callbacks_for(which: str) -> list[BaseCallback]:
    """``telemetry``: the ThroughputCallback; ``guard``: the NaN guard and the signal check; ``session``: all three,
    what a training Session adds besides evaluation and checkpoints."""
    telemetry: list[BaseCallback] = [ThroughputCallback(warmup_s=0.0, record_s=1.0, dashboard=False)]
    guard: list[BaseCallback] = [NanGuard(), StopOnSignal()]  # outside its `with`, StopOnSignal only checks per step
    sets: dict[str, list[BaseCallback]] = {"telemetry": telemetry, "guard": guard, "session": [*guard, *telemetry]}
    return sets[which]


def bench_telemetry(repeats: int, which: str = "telemetry") -> list[tuple[str, float, float, float, float]]:
    """Rows of (case, env steps/s without the callbacks, with them, wall-time overhead, CPU-time overhead).

    Two models built alike train in ``learn`` segments, one with the callbacks and one without, in ABBA order; the
    two swap roles every round, so that a difference between the models themselves cancels out. The
    overheads are medians of the per-round ratios.
    """
    rows = []
    for label, algo, env, overrides in TELEMETRY_CASES:
        models: list[Any] = []
        for _ in range(2):
            plan = make_plan(algo, env, "cpu", seed=0, overrides=overrides, vec_env="dummy")
            models.append(build_model(plan, build_env(plan)))
        segment = models[0].n_steps * models[0].n_envs * 4 if algo == "ppo" else 2_048
        for m in models:  # warm-up, fills the buffer
            m.learn(m.learning_starts + segment if algo != "ppo" else segment)
        swap = _Swapping(models, segment, which)
        wall, cpu = paired_times(functools.partial(swap.learn, False), functools.partial(swap.learn, True), repeats)
        without, with_ = wall.medians()
        rows.append((label, segment / without, segment / with_, wall.median_ratio() - 1, cpu.median_ratio() - 1))
        print(f"  {label}: done", flush=True)
    return rows


class _Swapping:
    """Two models that take turns at running with the callbacks: each round (two calls) swaps their roles."""

    def __init__(self, models: list[Any], segment: int, which: str):
        self.models, self.segment, self.which, self.calls = models, segment, which, 0

    def learn(self, with_callbacks: bool) -> None:
        round_, self.calls = self.calls // 2, self.calls + 1
        model = self.models[(round_ + with_callbacks) % 2]
        callbacks = callbacks_for(self.which) if with_callbacks else None
        model.learn(self.segment, reset_num_timesteps=False, callback=callbacks)
