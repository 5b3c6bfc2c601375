"""``python -m sb3_gpu.bench SUBCOMMAND``: sb3_gpu and its SB3 baseline measured side by side, in one process.

Sub-commands:
  per    replay sampling and DQN gradient steps, prioritized vs uniform; ``--learn`` trains presets with PER on/off
  speed  training-iteration time and env steps/s with each speed switch (bf16, compile, threads) off and on
  telemetry  env steps/s of ``learn`` with and without the ThroughputCallback, or ``--callback guard`` the
             NaN guard and signal handling that ``train`` adds (their overhead)
  envs   env steps/s of each vec env backend (SB3's two, batched, EnvPool, auto) and worker start-up
  train  a preset against plain SB3 with rl-zoo3's values: time and steps to a reward threshold
"""

from __future__ import annotations

import argparse
import os
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
from stable_baselines3.common.callbacks import BaseCallback

from sb3_gpu._bench_envs import ZOO, bench_envs, bench_startup, bench_train, envs_markdown, train_markdown, write_results
from sb3_gpu._cli import Parser, positive_int, print_error, seed_int
from sb3_gpu.callbacks import NanGuard, StopOnSignal
from sb3_gpu.envs import probe_env, resolve_env
from sb3_gpu.errors import ConfigError
from sb3_gpu.hardware import detect_hardware
from sb3_gpu.per import PrioritizedReplayBuffer, SumMinTree, _kernels
from sb3_gpu.plan import build_env, build_model, make_plan
from sb3_gpu.run import evaluate_run, train_run
from sb3_gpu.telemetry import ThroughputCallback


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


def tree_backends() -> list[str]:
    """The sum-tree backends this install can run, the default first."""
    default = SumMinTree(1).backend
    return [default] + [b for b in ("numba", "numpy") if b != default and (b == "numpy" or _kernels is not None)]


def bench_per(args: argparse.Namespace) -> list[tuple[str, float, float, float, float]]:
    """Rows of (case, uniform s, PER s, ratio, target ratio)."""
    rows = []
    batch = args.batch_size
    for capacity in args.capacities:
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

            u, p = paired_medians(uniform_step, per_step, args.repeats, 200)
            default = backend == tree_backends()[0]
            case = f"sample({batch}) + update @ {capacity:.0e}, {backend} tree" + ("" if default else " (fallback)")
            rows.append((case, u, p, p / u, 2.0 if default else float("inf")))
            del per

    steps = []
    for per_on in (False, True):
        plan = make_plan("dqn", "CartPole-v1", "cpu", seed=0, overrides={"per": per_on, "learning_starts": 0})
        model: Any = build_model(plan, build_env(plan))
        model.learn(2_000)  # fill the buffer and set up the logger
        steps.append(lambda model=model: model.train(gradient_steps=1, batch_size=model.batch_size))
    base, step = paired_medians(steps[0], steps[1], args.repeats, 100)
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


# (label, algo, env, overrides): the bundled CartPole presets, and the large-MLP PPO case.
SPEED_CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("PPO CartPole preset (64x64, batch 256)", "ppo", "CartPole-v1", {}),
    ("PPO 256x256, batch 256, 1024 steps/rollout", "ppo", "CartPole-v1", {"net_arch": [256, 256], "n_steps": 128}),
    ("DQN CartPole preset (256x256, batch 64)", "dqn", "CartPole-v1", {"per": False}),
]
BASELINE = {"amp": "off", "compile": False, "threads": 1}


def _speed_model(algo: str, env: str, overrides: dict[str, Any]) -> tuple[Any, Callable[[], object], Callable[[], object]]:
    """A model warmed up on its own data, with (one training iteration, one learn segment) callables.

    The callables set the model's thread count first, since ``torch.set_num_threads`` is process-wide.
    """
    plan = make_plan(algo, env, "cpu", seed=0, overrides=overrides, vec_env="dummy")
    threads = plan.speed.threads if plan.speed else 1
    model: Any = build_model(plan, build_env(plan))
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
            model.train(gradient_steps=model.gradient_steps if model.gradient_steps > 0 else 1, batch_size=model.batch_size)

    def learn() -> None:
        th.set_num_threads(threads)
        model.learn(segment, reset_num_timesteps=False)

    model.bench_segment = segment
    return model, iteration, learn


def bench_speed(repeats: int, threads: int) -> list[tuple[str, str, float, float, float, float]]:
    """Rows of (case, switch, baseline iteration s, switched iteration s, baseline steps/s, switched steps/s)."""
    rows = []
    switches: list[tuple[str, dict[str, Any]]] = [
        ("bf16 autocast", {"amp": "bf16"}),
        ("torch.compile", {"compile": "default"}),
    ]
    switches.append((f"{threads} threads", {"threads": threads}))
    for label, algo, env, overrides in SPEED_CASES:
        _, base_iter, base_learn = _speed_model(algo, env, {**overrides, **BASELINE})
        for name, switch in switches:
            model, iteration, learn = _speed_model(algo, env, {**overrides, **BASELINE, **switch})
            fallback = getattr(model, "compile_fallback", None)
            if fallback:
                print(f"  {label}, {name}: {fallback}", flush=True)
                continue
            it_base, it_switch = paired_medians(base_iter, iteration, repeats, 1)
            learn_base, learn_switch = paired_medians(base_learn, learn, max(3, repeats // 2), 1)
            segment = model.bench_segment
            rows.append((label, name, it_base, it_switch, segment / learn_base, segment / learn_switch))
            print(f"  {label}, {name}: done", flush=True)
    return rows


def _matmul_ratio(repeats: int) -> tuple[float, float]:
    """Median seconds of a 4096x256 @ 256x256 matmul in fp32 and bf16 (one thread)."""
    th.set_num_threads(1)
    a32, b32 = th.randn(4096, 256), th.randn(256, 256)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    return paired_medians(lambda: a32 @ b32, lambda: a16 @ b16, repeats, 20)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m sb3_gpu.bench", description="Measure sb3_gpu against plain SB3 on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    per = sub.add_parser("per", help="prioritized vs uniform replay: sampling, updates, DQN gradient steps")
    per.add_argument("--repeats", type=positive_int, default=7, help="repeats; medians are printed (default 7)")
    per.add_argument("--batch-size", type=positive_int, default=256)
    per.add_argument("--capacities", type=positive_int, nargs="+", default=[100_000, 1_000_000], help="buffer sizes")
    per.add_argument("--learn", action="store_true", help="also train the preset of --algo/--env for each --seeds")
    per.add_argument("--algo", choices=["dqn", "qrdqn"], default="dqn", help="with --learn (default dqn)")
    per.add_argument("--env", default="CartPole-v1", help="with --learn (default CartPole-v1)")
    per.add_argument("--ablate", action="store_true", help="with --learn: train with PER off as well, for comparison")
    per.add_argument("--no-timing", action="store_true", help="skip the sampling and gradient-step timings")
    per.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2])
    speed = sub.add_parser("speed", help="speed switches off and on: bf16, torch.compile, threads (PPO and DQN presets)")
    speed.add_argument("--repeats", type=positive_int, default=9, help="repeats; medians are printed (default 9)")
    speed.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1, help="the N of '1 vs N threads'")
    telemetry = sub.add_parser("telemetry", help="a callback's cost: env steps/s with and without it")
    telemetry.add_argument(
        "--callback",
        choices=("telemetry", "guard"),
        default="telemetry",
        help="telemetry: the ThroughputCallback (default); guard: NanGuard and StopOnSignal",
    )
    telemetry.add_argument("--repeats", type=positive_int, default=9, help="repeats; medians are printed (default 9)")
    envs = sub.add_parser("envs", help="env steps/s per vec env backend vs SB3's DummyVecEnv/SubprocVecEnv; start-up")
    envs.add_argument("--envs", nargs="+", default=["CartPole-v1", "LunarLander-v3", "ALE/Pong-v5"], help="env ids")
    envs.add_argument("--n-envs", type=positive_int, nargs="+", default=[8, 32, 64], help="vec env sizes")
    envs.add_argument("--seconds", type=float, default=0.25, help="seconds per measurement (default 0.25)")
    envs.add_argument(
        "--repeats", type=positive_int, default=15, help="rounds in shuffled order; medians are reported (default 15)"
    )
    envs.add_argument("--startup-workers", type=int, default=8, help="start-up bench size; 0 skips it (default 8)")
    envs.add_argument("--out", default="bench-results", help="folder for envs.json and envs.md")
    train = sub.add_parser("train", help="a preset vs plain SB3 with rl-zoo3's values: time to a reward threshold")
    train.add_argument("--algo", choices=sorted({a for a, _ in ZOO}), default="ppo")
    train.add_argument("--env", default="CartPole-v1", help=f"one of: {', '.join(sorted({e for _, e in ZOO}))}")
    train.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2])
    train.add_argument("--threshold", type=float, help="mean eval return to reach (default: the env's reward_threshold)")
    train.add_argument("--max-timesteps", type=positive_int, help="budget per run (default: the preset's n_timesteps)")
    train.add_argument("--eval-freq", type=positive_int, default=5_000, help="evaluate every N env steps (default 5000)")
    train.add_argument("--eval-episodes", type=positive_int, default=10)
    train.add_argument("--out", default="bench-results", help="folder for train.json and train.md")
    args = parser.parse_args(argv)
    if args.command == "envs":
        return _main_envs(args, argv)
    if args.command == "train":
        return _main_train(args, argv)
    if args.command == "speed":
        return _main_speed(args)
    if args.command == "telemetry":
        return _main_telemetry(args)

    if args.learn:
        try:  # bad names fail now, not after the timings
            make_plan(args.algo, args.env, "auto", overrides={"per": True})
        except ConfigError as exc:
            print_error(str(exc))
            return 2
    print(f"machine: {platform.processor() or platform.machine()}, torch {th.__version__}, {th.get_num_threads()} threads")
    if not args.no_timing:
        rows = bench_per(args)
        width = max(len(r[0]) for r in rows)
        print(f"{'case':<{width}}  {'uniform':>10}  {'PER':>10}  {'ratio':>6}  target")
        for case, u, p, ratio, target in rows:
            verdict = "-" if target == float("inf") else f"<= {target:.2f}x " + ("ok" if ratio <= target else "MISSED")
            print(f"{case:<{width}}  {u * 1e6:>8.1f}us  {p * 1e6:>8.1f}us  {ratio:>5.2f}x  {verdict}")
    if args.learn:
        print(f"{args.algo} {args.env} preset (final: 10 episodes; best: 20 fresh episodes; deterministic):")
        results = bench_per_learning(args.algo, args.env, args.seeds, [True, False] if args.ablate else [True])
        for per_on in sorted({r[0] for r in results}, reverse=True):
            mine = [r for r in results if r[0] == per_on]
            print(
                f"PER {'on ' if per_on else 'off'}: median final {statistics.median(r[2] for r in mine):.1f},"
                f" median best {statistics.median(r[3] for r in mine):.1f},"
                f" median wall {statistics.median(r[4] for r in mine):.0f} s over {len(mine)} seeds"
            )
    return 0


TELEMETRY_CASES = [
    ("PPO CartPole preset", "ppo", "CartPole-v1", {}),
    ("DQN CartPole preset", "dqn", "CartPole-v1", {"per": False}),
]


def _callbacks(which: str) -> list[BaseCallback]:
    if which == "guard":
        return [NanGuard(), StopOnSignal()]  # outside its `with`, StopOnSignal only adds its per-step check
    return [ThroughputCallback(warmup_s=0.0, record_s=1.0, dashboard=False)]


def bench_telemetry(repeats: int, which: str = "telemetry") -> list[tuple[str, float, float]]:
    """Rows of (case, env steps/s without the callback, with it); alternating ``learn`` segments of one model."""
    rows = []
    for label, algo, env, overrides in TELEMETRY_CASES:
        plan = make_plan(algo, env, "cpu", seed=0, overrides=overrides, vec_env="dummy")
        model: Any = build_model(plan, build_env(plan))
        segment = model.n_steps * model.n_envs * 4 if algo == "ppo" else 2_048
        model.learn(model.learning_starts + segment if algo != "ppo" else segment)  # warm-up, fills the buffer
        plain = lambda m=model, n=segment: m.learn(n, reset_num_timesteps=False)  # noqa: E731
        timed = lambda m=model, n=segment: m.learn(n, reset_num_timesteps=False, callback=_callbacks(which))  # noqa: E731
        without, with_ = paired_medians(plain, timed, repeats, 1)
        rows.append((label, segment / without, segment / with_))
        print(f"  {label}: done", flush=True)
    return rows


def _main_telemetry(args: argparse.Namespace) -> int:
    print(f"machine: {platform.processor() or platform.machine()}, torch {th.__version__}, {th.get_num_threads()} threads")
    rows = bench_telemetry(args.repeats, args.callback)
    print(f"{'case':<22} {'without':>10} {'with':>10}  overhead (env steps/s of learn, medians)")
    for label, without, with_ in rows:
        print(f"{label:<22} {without:>10.0f} {with_:>10.0f}  {1 - with_ / without:+.1%}")
    return 0


def _main_speed(args: argparse.Namespace) -> int:
    hw = detect_hardware()
    flags = ", ".join(f for f, on in (("AVX512-BF16", hw.cpu_bf16 and not hw.cpu_amx), ("AMX", hw.cpu_amx)) if on) or "none"
    print(f"machine: {hw.cpu_model}; {hw.describe()}; native bf16: {flags}; torch {th.__version__}")
    fp32, bf16 = _matmul_ratio(args.repeats)
    print(f"4096x256 @ 256x256 matmul, 1 thread: fp32 {fp32 * 1e3:.2f} ms, bf16 {bf16 * 1e3:.2f} ms ({fp32 / bf16:.2f}x)")
    print("baseline of every row: fp32, uncompiled, 1 thread; speed-up = baseline time / switched time (>1 is faster)")
    rows = bench_speed(args.repeats, args.threads)
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'switch':<14} {'iteration':>21} {'speed-up':>8}  {'env steps/s':>17} {'ratio':>6}")
    for case, name, it_base, it_switch, sps_base, sps_switch in rows:
        print(
            f"{case:<{width}}  {name:<14} {it_base * 1e3:>8.1f} -> {it_switch * 1e3:>7.1f} ms {it_base / it_switch:>7.2f}x"
            f"  {sps_base:>7.0f} -> {sps_switch:>7.0f} {sps_switch / sps_base:>5.2f}x"
        )
    return 0


def _command(argv: Sequence[str] | None) -> str:
    return "python -m sb3_gpu.bench " + " ".join(sys.argv[1:] if argv is None else argv)


def _main_envs(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    if args.seconds <= 0 or args.startup_workers < 0:
        print_error("--seconds must be > 0 and --startup-workers >= 0")
        return 2
    try:
        for env_id in args.envs:
            probe_env(resolve_env(env_id)).close()
    except ConfigError as exc:
        print_error(str(exc))
        return 2
    print(f"machine: {detect_hardware().describe()}")
    rows = bench_envs(args.envs, args.n_envs, args.seconds, args.repeats)
    startup = None
    if args.startup_workers:
        times = bench_startup(args.envs[0], args.startup_workers, max(1, min(args.repeats, 3)))
        startup = {"workers": args.startup_workers, "env": args.envs[0], **times}
    command = _command(argv)
    markdown = envs_markdown(rows, startup, command)
    print(markdown)
    paths = write_results(Path(args.out), "envs", {"command": command, "rows": rows, "startup": startup}, markdown)
    print("written:", *paths)
    return 0


def _main_train(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    if (args.algo, args.env) not in ZOO:
        have = ", ".join(f"{a} {e}" for a, e in sorted(ZOO))
        print_error(f"no rl-zoo3 baseline for {args.algo} {args.env} (have: {have})")
        return 2
    threshold = args.threshold
    if threshold is None:
        threshold = gym.spec(args.env).reward_threshold
    print(f"machine: {detect_hardware().describe()}")
    summary = bench_train(
        args.algo, args.env, args.seeds, float(threshold), args.max_timesteps, args.eval_freq, args.eval_episodes
    )
    command = _command(argv)
    markdown = train_markdown(summary, command)
    print(markdown)
    paths = write_results(Path(args.out), "train", {"command": command, **summary}, markdown)
    print("written:", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
