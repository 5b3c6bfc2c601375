"""``bench envs`` and ``bench train``: our vec envs and presets against plain SB3, measured in the same run."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from stable_baselines3.common.callbacks import StopTrainingOnRewardThreshold
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv

from sb3_gpu._io import atomic_write_text
from sb3_gpu.envs import _EnvFactory, envpool_fits, make_vec_env, resolve_env
from sb3_gpu.plan import build_env, build_model, make_plan
from sb3_gpu.telemetry import TimedEvalCallback

BASELINES = ("dummy", "subproc")


def _build(kind: str, env_id: str, n_envs: int) -> VecEnv:
    spec = resolve_env(env_id)
    fns: list[Callable[[], Any]] = [_EnvFactory(spec.make, None, spec.is_atari) for _ in range(n_envs)]
    if kind == "dummy":
        return DummyVecEnv(fns)
    if kind == "subproc":
        return SubprocVecEnv(fns)
    if kind == "auto w/o envpool":
        with mock.patch("sb3_gpu.envs.envpool_available", return_value=False):
            return make_vec_env(spec, n_envs, vec_env="auto")
    return make_vec_env(spec, n_envs, vec_env=kind)


def _rate(venv: VecEnv, actions: np.ndarray, seconds: float) -> float:
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < seconds:
        venv.step(actions[steps % len(actions)])
        steps += 1
    return steps * venv.num_envs / (time.perf_counter() - start)


def bench_envs(
    env_ids: list[str], sizes: list[int], seconds: float, repeats: int, print_fn: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Env steps/s with random actions per backend; rounds alternate the backends so drift hits all alike."""
    rows = []
    for env_id in env_ids:
        pool = envpool_fits(resolve_env(env_id))
        kinds = [
            "dummy",
            "subproc",
            "batched",
            *(["envpool"] if pool else []),
            "auto",
            *(["auto w/o envpool"] if pool else []),
        ]
        for n in sizes:
            venvs = {kind: _build(kind, env_id, n) for kind in kinds}
            # An auto choice is one of the measured classes: report that row's figure rather than a second instance
            # of the same class (two pools or two sets of workers in one process only measure each other's noise).
            alias: dict[str, str] = {}
            for kind in [k for k in kinds if k.startswith("auto")]:
                same = [
                    k for k in kinds if not k.startswith("auto") and type(venvs[k].unwrapped) is type(venvs[kind].unwrapped)
                ]
                if same:
                    alias[kind] = same[0]
                    venvs.pop(kind).close()
            measured = [k for k in kinds if k not in alias]
            try:
                rng = np.random.default_rng(0)
                space = venvs["dummy"].action_space
                space.seed(0)
                actions = np.array([[space.sample() for _ in range(n)] for _ in range(256)])
                rates: dict[str, list[float]] = {kind: [] for kind in measured}
                for venv in venvs.values():
                    venv.seed(0)  # the same episodes and actions everywhere, so equal classes do equal work
                    venv.reset()
                    _rate(venv, actions, 0.1 * seconds)  # warm-up
                for _ in range(repeats):
                    for kind in rng.permutation(measured):
                        rates[kind].append(_rate(venvs[kind], actions, seconds))
                rates.update({kind: rates[target] for kind, target in alias.items()})
                medians = {kind: statistics.median(r) for kind, r in rates.items()}
                best_sb3 = max(medians[k] for k in BASELINES)
                for kind in kinds:
                    chosen = type(venvs[alias.get(kind, kind)].unwrapped).__name__
                    rows.append(
                        {
                            "env": env_id,
                            "n_envs": n,
                            "backend": kind,
                            "class": chosen,
                            "steps_per_s": round(medians[kind], 1),
                            "vs_best_sb3": round(medians[kind] / best_sb3, 3),
                            "vs_sb3_subproc": round(medians[kind] / medians["subproc"], 3),
                            "same_as": alias.get(kind),
                        }
                    )
                print_fn(f"  {env_id} x{n}: " + ", ".join(f"{k} {medians[k]:,.0f}" for k in kinds))
            finally:
                for venv in venvs.values():
                    with suppress(Exception):
                        venv.close()
    return rows


_STARTUP = """
import sys, time
from stable_baselines3.common.vec_env import SubprocVecEnv
from sb3_gpu.batched import BatchedSubprocVecEnv
from sb3_gpu.envs import _EnvFactory, resolve_env
if __name__ == "__main__":
    kind, env_id, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = resolve_env(env_id)
    fns = [_EnvFactory(spec.make, None, spec.is_atari) for _ in range(n)]
    start = time.perf_counter()
    venv = SubprocVecEnv(fns) if kind == "subproc" else BatchedSubprocVecEnv(fns, n_workers=n)
    venv.reset()
    print("STARTUP", time.perf_counter() - start)
    venv.close()
"""


def bench_startup(env_id: str, workers: int, repeats: int) -> dict[str, float]:
    """Median seconds from constructor to first reset, each in a fresh interpreter (nothing preloaded)."""
    times: dict[str, list[float]] = {"subproc": [], "batched": []}
    for _ in range(repeats):
        for kind in times:
            out = subprocess.run(
                [sys.executable, "-c", _STARTUP, kind, env_id, str(workers)],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            times[kind].append(float(next(line for line in out.stdout.splitlines() if line.startswith("STARTUP")).split()[1]))
    return {kind: statistics.median(t) for kind, t in times.items()}


def envs_markdown(rows: list[dict[str, Any]], startup: dict[str, float] | None, command: str) -> str:
    lines = [
        f"`{command}` (env steps/s, random actions, medians; ratio to the better of SB3's DummyVecEnv/SubprocVecEnv)",
        "",
        "| env | n_envs | backend | class | steps/s | vs best SB3 | vs SB3 subproc |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        cls = f"{r['class']} (= {r['same_as']})" if r.get("same_as") else r["class"]
        lines.append(
            f"| {r['env']} | {r['n_envs']} | {r['backend']} | {cls} | {r['steps_per_s']:,.0f} "
            f"| {r['vs_best_sb3']:.2f}x | {r['vs_sb3_subproc']:.2f}x |"
        )
    if startup:
        lines += [
            "",
            f"Start-up to first reset, {startup['workers']} workers, fresh interpreter: SB3 SubprocVecEnv "
            f"{startup['subproc']:.2f} s, batched {startup['batched']:.2f} s "
            f"({startup['subproc'] / startup['batched']:.1f}x faster)",
        ]
    return "\n".join(lines) + "\n"


def write_results(out_dir: Path, name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    json_path = atomic_write_text(out_dir / f"{name}.json", json.dumps(data, indent=2) + "\n")
    md_path = atomic_write_text(out_dir / f"{name}.md", markdown)
    return json_path, md_path


# --- bench train -----------------------------------------------------------------------------------------------

# rl-zoo3's published hyperparameters (hyperparams/ppo.yml and dqn.yml in DLR-RM/rl-baselines3-zoo), the baseline
# that `bench train` runs with plain SB3. LunarLander-v3 takes the values rl-zoo3 lists for LunarLander-v2.
ZOO: dict[tuple[str, str], dict[str, Any]] = {
    ("ppo", "CartPole-v1"): dict(
        n_envs=8, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
        learning_rate=("lin", 1e-3), clip_range=("lin", 0.2),
    ),
    ("ppo", "LunarLander-v3"): dict(
        n_envs=16, n_steps=1024, batch_size=64, gae_lambda=0.98, gamma=0.999, n_epochs=4, ent_coef=0.01,
    ),
    ("dqn", "CartPole-v1"): dict(
        n_envs=1, learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1000, gamma=0.99,
        target_update_interval=10, train_freq=256, gradient_steps=128, exploration_fraction=0.16,
        exploration_final_eps=0.04, policy_kwargs=dict(net_arch=[256, 256]),
    ),
}  # fmt: skip


def zoo_model(algo: str, env_id: str, seed: int) -> Any:
    """Plain SB3 as an rl-zoo3 user runs it: the published hyperparameters, DummyVecEnv, SB3's default device."""
    from stable_baselines3 import DQN, PPO
    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    from stable_baselines3.common.utils import LinearSchedule

    kwargs = dict(ZOO[(algo, env_id)])
    n_envs = kwargs.pop("n_envs")
    for key, value in list(kwargs.items()):
        if isinstance(value, tuple):
            kwargs[key] = LinearSchedule(value[1], 0.0, 1.0)
    env = sb3_make_vec_env(env_id, n_envs=n_envs, seed=seed)
    return (PPO if algo == "ppo" else DQN)("MlpPolicy", env, seed=seed, verbose=0, **kwargs)


def train_once(
    model: Any, env_id: str, max_timesteps: int, threshold: float, eval_freq: int, episodes: int, seed: int
) -> dict[str, Any]:
    """Train until the deterministic eval mean reaches ``threshold``; time spent evaluating is kept apart."""
    eval_env = make_vec_env(env_id, 1, vec_env="dummy", seed=seed + 10_000)
    evaluator = TimedEvalCallback(
        eval_env,
        eval_freq=max(eval_freq // model.n_envs, 1),
        n_eval_episodes=episodes,
        callback_on_new_best=StopTrainingOnRewardThreshold(threshold),
        verbose=0,
    )
    start = time.perf_counter()
    model.learn(max_timesteps, callback=evaluator)
    seconds = time.perf_counter() - start - evaluator.seconds
    result = {
        "seed": seed,
        "reached": bool(evaluator.best_mean_reward >= threshold),
        "timesteps": int(model.num_timesteps),
        "train_seconds": round(seconds, 2),
        "steps_per_s": round(model.num_timesteps / max(seconds, 1e-9), 1),
    }
    with suppress(Exception):
        model.get_env().close()
    eval_env.close()
    return result


def bench_train(
    algo: str, env_id: str, seeds: list[int], threshold: float, max_timesteps: int | None, eval_freq: int, episodes: int,
    print_fn: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """Our preset (device, vec env and threads chosen by the plan) and plain SB3 with rl-zoo3's values, per seed."""
    results: dict[str, list[dict[str, Any]]] = {"sb3_gpu": [], "sb3_zoo": []}
    plan_text = ""
    for seed in seeds:
        plan = make_plan(algo, env_id, "auto", seed=seed)
        plan_text = f"device {plan.device.device}, vec_env {plan.vec_env}, {plan.preset.n_envs} envs"
        budget = max_timesteps or plan.preset.n_timesteps
        ours = build_model(plan, build_env(plan))
        results["sb3_gpu"].append(train_once(ours, env_id, budget, threshold, eval_freq, episodes, seed))
        results["sb3_zoo"].append(
            train_once(zoo_model(algo, env_id, seed), env_id, budget, threshold, eval_freq, episodes, seed)
        )
        print_fn(f"  seed {seed}: sb3_gpu {results['sb3_gpu'][-1]}, zoo {results['sb3_zoo'][-1]}")
    summary: dict[str, Any] = {"algo": algo, "env": env_id, "threshold": threshold, "seeds": seeds, "plan": plan_text}
    for name, runs in results.items():
        summary[name] = {
            "runs": runs,
            "reached": sum(r["reached"] for r in runs),
            "median_train_seconds": statistics.median(r["train_seconds"] for r in runs),
            "median_timesteps": statistics.median(r["timesteps"] for r in runs),
            "median_steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
        }
    return summary


def train_markdown(summary: dict[str, Any], command: str) -> str:
    ours, zoo = summary["sb3_gpu"], summary["sb3_zoo"]
    n = len(summary["seeds"])
    lines = [
        f"`{command}`: {summary['algo']} {summary['env']} to mean eval return {summary['threshold']:g} "
        f"(medians over {n} seeds; evaluation time excluded; ours: {summary['plan']})",
        "",
        "| run | reached | time to threshold | timesteps | steps/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in (("sb3_gpu preset", ours), ("SB3 + rl-zoo3 values", zoo)):
        lines.append(
            f"| {name} | {s['reached']}/{n} | {s['median_train_seconds']:.1f} s | {s['median_timesteps']:,.0f} "
            f"| {s['median_steps_per_s']:,.0f} |"
        )
    lines += [
        "",
        f"Speed-up: {zoo['median_train_seconds'] / max(ours['median_train_seconds'], 1e-9):.2f}x in time to threshold, "
        f"{ours['median_steps_per_s'] / max(zoo['median_steps_per_s'], 1e-9):.2f}x in steps/s "
        "(a run that never reached the threshold counts its whole time).",
    ]
    return "\n".join(lines) + "\n"
