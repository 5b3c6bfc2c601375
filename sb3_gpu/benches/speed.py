"""``bench speed``: training-iteration time and env steps/s with each speed switch (bf16, compile, threads) against
fp32, uncompiled, one thread, in one process."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch as th

from sb3_gpu.benches.base import paired_medians
from sb3_gpu.extensions.compile import CompileFallbackWarning
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan

# (label, algo, env, overrides): the bundled CartPole presets, and a large-MLP PPO case. Each row's label gets the
# network and batch size the plan built, so that it stays true when a preset changes.
SPEED_CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("PPO CartPole preset", "ppo", "CartPole-v1", {}),
    ("PPO, 1024 steps/rollout", "ppo", "CartPole-v1", {"net_arch": [256, 256], "n_steps": 128}),
    ("DQN CartPole preset", "dqn", "CartPole-v1", {"per": False}),
]
BASELINE = {"amp": "off", "compile": False, "threads": 1}


@dataclass(frozen=True)
class _Timed:
    """A model warmed up on its own data: one training iteration, one ``learn`` segment of ``segment`` env steps,
    and why compilation fell back (if it did)."""

    iteration: Callable[[], object]
    learn: Callable[[], object]
    segment: int
    compile_fallback: str | None
    shape: str  # "64x64, batch 256": the network and batch the plan built


def _speed_model(algo: str, env: str, overrides: dict[str, Any]) -> _Timed:
    # The callables set the model's thread count first, since torch.set_num_threads is process-wide.
    plan = make_plan(algo, env, "cpu", seed=0, overrides=overrides, vec_env="dummy")
    threads = plan.speed.threads if plan.speed else 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        model: Any = build_model(plan, build_env(plan))
    fallback = next((str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)), None)
    if algo == "ppo":
        segment = model.n_steps * model.n_envs
        model.learn(segment)  # fills the rollout buffer; also compiles, if asked
    else:
        segment = 1_000
        model.learn(model.learning_starts + 1_000)

    def iteration() -> None:
        th.set_num_threads(threads)
        if algo == "ppo":
            model.train()
        else:
            model.train(gradient_steps=max(model.gradient_steps, 1), batch_size=model.batch_size)

    def learn() -> None:
        th.set_num_threads(threads)
        model.learn(segment, reset_num_timesteps=False)

    arch = model.policy.net_arch  # SB3 builds a dict (pi, vf) for PPO, a list for DQN
    if isinstance(arch, dict) and arch.get("pi") == arch.get("vf"):
        arch = arch["pi"]
    shape = f"{'x'.join(map(str, arch)) if isinstance(arch, list) else arch}, batch {model.batch_size}"
    return _Timed(iteration, learn, segment, fallback, shape)


def bench_speed(repeats: int, threads: int) -> list[tuple[str, str, float, float, float, float]]:
    """Rows of (case, switch, baseline iteration s, switched iteration s, baseline steps/s, switched steps/s)."""
    rows = []
    switches: list[tuple[str, dict[str, Any]]] = [
        ("bf16 autocast", {"amp": "bf16"}),
        ("torch.compile", {"compile": "default"}),
        (f"{threads} threads", {"threads": threads}),
    ]
    for label, algo, env, overrides in SPEED_CASES:
        base = _speed_model(algo, env, {**overrides, **BASELINE})
        label = f"{label} ({base.shape})"
        for name, switch in switches:
            switched = _speed_model(algo, env, {**overrides, **BASELINE, **switch})
            if switched.compile_fallback:
                print(f"  {label}, {name}: {switched.compile_fallback}", flush=True)
                continue
            it_base, it_switch = paired_medians(base.iteration, switched.iteration, repeats, 1)
            learn_base, learn_switch = paired_medians(base.learn, switched.learn, max(3, repeats // 2), 1)
            rows.append((label, name, it_base, it_switch, switched.segment / learn_base, switched.segment / learn_switch))
            print(f"  {label}, {name}: done", flush=True)
    return rows


def matmul_ratio(repeats: int) -> tuple[float, float]:
    """Median seconds of a 4096x256 @ 256x256 matmul in fp32 and bf16 (one thread)."""
    th.set_num_threads(1)
    a32, b32 = th.randn(4096, 256), th.randn(256, 256)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    return paired_medians(lambda: a32 @ b32, lambda: a16 @ b16, repeats, 20)
