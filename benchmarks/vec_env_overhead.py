"""DummyVecEnv vs SubprocVecEnv on this machine, side by side: per-step time, ratio, and start-up time.

    python benchmarks/vec_env_overhead.py [--n-envs 8] [--repeats 3]

Prints medians over repeats and the per-env IPC overhead that sb3_gpu.envs.SUBPROC_OVERHEAD_S models.
The full bench command (more backends, more envs) is issue 6's `python -m sb3_gpu.bench envs`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from sb3_gpu.envs import _EnvFactory, resolve_env


def per_step_seconds(venv, steps: int) -> float:
    venv.reset()
    actions = np.array([venv.action_space.sample() for _ in range(venv.num_envs)])
    start = time.perf_counter()
    for _ in range(steps):
        venv.step(actions)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "LunarLander-v3", "ALE/Pong-v5"])
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"{args.n_envs} envs, {cores} logical cores, median of {args.repeats}")
    header = f"{'env':<16}{'dummy us/step':>15}{'subproc us/step':>17}{'subproc/dummy speed':>21}"
    print(f"{header}{'start-up s':>12}{'overhead us/env':>17}")
    for env_id in args.envs:
        spec = resolve_env(env_id)
        steps = 200 if spec.is_atari else 2000
        fns = [_EnvFactory(spec.make, None, spec.is_atari) for _ in range(args.n_envs)]
        dummy, sub, start = [], [], []
        for _ in range(args.repeats):
            venv = DummyVecEnv(fns)
            dummy.append(per_step_seconds(venv, steps))
            venv.close()
            t0 = time.perf_counter()
            venv = SubprocVecEnv(fns)
            venv.reset()
            start.append(time.perf_counter() - t0)
            sub.append(per_step_seconds(venv, steps))
            venv.close()
        d, s = statistics.median(dummy), statistics.median(sub)
        # Subproc time = (env work spread over the cores) + overhead per env; solve for the overhead.
        overhead = (s - d / min(cores, args.n_envs)) / args.n_envs
        row = f"{env_id:<16}{d * 1e6:>15.0f}{s * 1e6:>17.0f}{d / s:>20.2f}x"
        print(f"{row}{statistics.median(start):>12.1f}{overhead * 1e6:>17.0f}")


if __name__ == "__main__":
    main()
