"""``python -m sb3_gpu.bench SUBCOMMAND``: sb3_gpu and its SB3 baseline measured side by side, in one process.

Sub-commands:
  per   replay sampling and DQN gradient steps, prioritized vs uniform; ``--learn`` adds PER-DQN CartPole seeds
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3.common.buffers import ReplayBuffer

from sb3_gpu._cli import Parser, positive_int, seed_int
from sb3_gpu.per import PrioritizedReplayBuffer
from sb3_gpu.plan import build_env, build_model, make_plan
from sb3_gpu.run import evaluate_run, train_run


def paired_medians(
    baseline: Callable[[], object], ours: Callable[[], object], repeats: int, inner: int
) -> tuple[float, float]:
    """Median seconds per call of each, over ``repeats`` rounds that alternate the two (so drift hits both alike)."""
    baseline(), ours()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((baseline, times[0]), (ours, times[1])):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - start) / inner)
    return statistics.median(times[0]), statistics.median(times[1])


def _filled(buffer_class: type[ReplayBuffer], capacity: int, **kwargs: object) -> ReplayBuffer:
    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    buffer = buffer_class(capacity, obs_space, gym.spaces.Discrete(2), "cpu", **kwargs)  # type: ignore[arg-type]
    # Fill in chunks straight into the arrays (adding a million transitions one by one would dominate the bench).
    rng = np.random.default_rng(0)
    buffer.observations[:] = rng.normal(size=buffer.observations.shape)
    buffer.next_observations[:] = rng.normal(size=buffer.next_observations.shape)
    buffer.rewards[:] = 1.0
    buffer.full, buffer.pos = True, 0
    if isinstance(buffer, PrioritizedReplayBuffer):
        buffer.tree.update(np.arange(capacity), rng.uniform(0.01, 2.0, capacity) ** buffer.alpha)
    return buffer


def bench_per(args: argparse.Namespace) -> list[tuple[str, float, float, float, float]]:
    """Rows of (case, uniform s, PER s, ratio, target ratio)."""
    rows = []
    batch = args.batch_size
    for capacity in (100_000, 1_000_000):
        uniform = _filled(ReplayBuffer, capacity)
        per = _filled(PrioritizedReplayBuffer, capacity)
        assert isinstance(per, PrioritizedReplayBuffer)
        td = np.random.default_rng(1).normal(size=batch)

        def per_step(per: PrioritizedReplayBuffer = per, td: np.ndarray = td) -> None:
            sample = per.sample(batch)
            per.update_priorities(sample.indices, td)

        def uniform_step(uniform: ReplayBuffer = uniform) -> None:
            uniform.sample(batch)

        u, p = paired_medians(uniform_step, per_step, args.repeats, 200)
        rows.append((f"sample({batch}) [+ update] @ {capacity:.0e}", u, p, p / u, 2.0))

    steps = []
    for per_on in (False, True):
        plan = make_plan("dqn", "CartPole-v1", "cpu", seed=0, overrides={"per": per_on, "learning_starts": 0})
        model: Any = build_model(plan, build_env(plan))
        model.learn(2_000)  # fill the buffer and set up the logger
        steps.append(lambda model=model: model.train(gradient_steps=1, batch_size=model.batch_size))
    base, step = paired_medians(steps[0], steps[1], args.repeats, 100)
    rows.append((f"DQN gradient step (CartPole preset, batch {model.batch_size})", base, step, step / base, 1.25))
    return rows


def bench_per_learning(seeds: Sequence[int]) -> list[tuple[int, float, float, float]]:
    """PER-DQN with the CartPole-v1 preset, trained as ``train`` does: (seed, final mean, best mean, wall s).

    The best model (chosen by periodic 5-episode evaluations) is re-evaluated on 20 fresh episodes.
    """
    results = []
    for seed in seeds:
        plan = make_plan("dqn", "CartPole-v1", "auto", seed=seed, overrides={"per": True})
        with tempfile.TemporaryDirectory(prefix="sb3_gpu_bench_") as tmp:
            summary = train_run(plan, Path(tmp) / "run", eval_episodes=5, progress=False)
            best = evaluate_run(Path(tmp) / "run", episodes=20, seed=123)["mean"]
        final = summary["final_eval_mean"]
        results.append((seed, final, best, summary["wall_time_s"]))
        print(f"  seed {seed}: final model {final:.1f}, best model {best:.1f} in {summary['wall_time_s']:.0f} s", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m sb3_gpu.bench", description="Measure sb3_gpu against plain SB3 on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    per = sub.add_parser("per", help="prioritized vs uniform replay: sampling, updates, DQN gradient steps")
    per.add_argument("--repeats", type=positive_int, default=7, help="repeats; medians are printed (default 7)")
    per.add_argument("--batch-size", type=positive_int, default=256)
    per.add_argument("--learn", action="store_true", help="also train PER-DQN on CartPole-v1 for each --seeds")
    per.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)

    print(f"machine: {platform.processor() or platform.machine()}, torch {th.__version__}, {th.get_num_threads()} threads")
    rows = bench_per(args)
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'uniform':>10}  {'PER':>10}  {'ratio':>6}  target")
    for case, u, p, ratio, target in rows:
        verdict = "ok" if ratio <= target else "MISSED"
        print(f"{case:<{width}}  {u * 1e6:>8.1f}us  {p * 1e6:>8.1f}us  {ratio:>5.2f}x  <= {target:.2f}x {verdict}")
    if args.learn:
        print("PER-DQN, CartPole-v1 preset (final: 10 episodes; best: 20 fresh episodes; deterministic):")
        results = bench_per_learning(args.seeds)
        final = sum(r[1] >= 475 for r in results)
        best = sum(r[2] >= 475 for r in results)
        print(f"reached 475: best model on {best} of {len(results)} seeds, final model on {final} of {len(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
