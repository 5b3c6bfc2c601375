"""``bench envs``: env steps/s of each vec env backend (SB3's two, batched, EnvPool, auto) side by side, and the
start-up time of subprocess workers."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv

from sb3_gpu.envs.batched import worker_start_method
from sb3_gpu.envs.build import make_vec_env
from sb3_gpu.envs.choice import envpool_fits, vec_env_choice
from sb3_gpu.envs.spec import EnvFactory, resolve_env

BASELINES = ("dummy", "subproc")


def _build(kind: str, env_id: str, n_envs: int) -> VecEnv:
    spec = resolve_env(env_id)
    fns: list[Callable[[], Any]] = [EnvFactory(spec.make, None, spec.is_atari) for _ in range(n_envs)]
    if kind == "dummy":
        return DummyVecEnv(fns)
    if kind == "subproc":
        worker_start_method(None)  # a forkserver started here preloads what the batched workers after it need
        return SubprocVecEnv(fns)
    if kind == "auto w/o envpool":  # what auto picks where EnvPool is not installed
        kind = vec_env_choice("auto", spec, n_envs, envpool_allowed=False).kind
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
        kinds = ["dummy", "subproc", "batched", *(["envpool"] if pool else []), "auto"]
        kinds += ["auto w/o envpool"] if pool else []
        for n in sizes:
            venvs = {kind: _build(kind, env_id, n) for kind in kinds}
            try:
                alias = _aliases(venvs, kinds)
                medians = _medians(venvs, kinds, alias, n, seconds, repeats)
            finally:
                for venv in venvs.values():
                    with suppress(Exception):
                        venv.close()
            best_sb3 = max(medians[k] for k in BASELINES)
            for kind in kinds:
                rows.append(
                    {
                        "env": env_id,
                        "n_envs": n,
                        "backend": kind,
                        "class": alias.get(kind, (kind, ""))[1] or _class_name(venvs[kind]),
                        "steps_per_s": round(medians[kind], 1),
                        "vs_best_sb3": round(medians[kind] / best_sb3, 3),
                        "vs_sb3_subproc": round(medians[kind] / medians["subproc"], 3),
                        "same_as": alias[kind][0] if kind in alias else None,
                    }
                )
            print_fn(f"  {env_id} x{n}: " + ", ".join(f"{k} {medians[k]:,.0f}" for k in kinds))
    return rows


def _class_name(venv: VecEnv) -> str:
    return type(venv.unwrapped).__name__


def _aliases(venvs: dict[str, VecEnv], kinds: list[str]) -> dict[str, tuple[str, str]]:
    """An auto choice is one of the measured classes: report that row's figure rather than a second instance of the
    same class (two pools or two sets of workers in one process only measure each other's noise). Closes and drops
    those duplicates; returns ``auto kind -> (the backend it equals, its class name)``."""
    alias = {}
    for kind in [k for k in kinds if k.startswith("auto")]:
        cls = type(venvs[kind].unwrapped)
        same = [k for k in kinds if not k.startswith("auto") and type(venvs[k].unwrapped) is cls]
        if same:
            alias[kind] = (same[0], cls.__name__)
            venvs.pop(kind).close()
    return alias


def _medians(
    venvs: dict[str, VecEnv], kinds: list[str], alias: dict[str, tuple[str, str]], n: int, seconds: float, repeats: int
) -> dict[str, float]:
    """Median env steps/s of each kind over ``repeats`` rounds in shuffled order, on the same actions everywhere."""
    measured = [k for k in kinds if k not in alias]
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
    rates.update({kind: rates[target] for kind, (target, _) in alias.items()})
    return {kind: statistics.median(r) for kind, r in rates.items()}


_STARTUP = """
import sys, time
from stable_baselines3.common.vec_env import SubprocVecEnv
from sb3_gpu.envs.batched import BatchedSubprocVecEnv
from sb3_gpu.envs.spec import EnvFactory, resolve_env
if __name__ == "__main__":
    kind, env_id, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = resolve_env(env_id)
    fns = [EnvFactory(spec.make, None, spec.is_atari) for _ in range(n)]
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
            line = next(line for line in out.stdout.splitlines() if line.startswith("STARTUP"))
            times[kind].append(float(line.split()[1]))
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
