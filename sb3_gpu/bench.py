"""``python -m sb3_gpu.bench SUBCOMMAND``: sb3_gpu and its SB3 baseline measured side by side, in one process.

Sub-commands:
  per        replay sampling and DQN gradient steps, prioritized vs uniform
  speed      training-iteration time and env steps/s with each speed switch (bf16, compile, threads) off and on
  telemetry  env steps/s of ``learn`` with and without the callbacks a training adds: the ThroughputCallback,
             ``--callback guard`` the NaN guard and signal handling, ``--callback session`` all of them
  envs       env steps/s of each vec env backend (SB3's two, batched, EnvPool, auto) and worker start-up
  train      a preset against plain SB3 with rl-zoo3's values: time and steps to a reward threshold
  solve      do the presets solve their envs, seed after seed: train, then evaluate the best model on fresh episodes
  step       a gradient step and a vec env step: host reads, ops launched, graph breaks and time; SB3's own, sb3_gpu
             eager and sb3_gpu compiled
  gpu        the device data path against SB3's: sample() of Atari frames, PPO and DQN env steps/s
  auto       auto's device, amp and threads against every alternative, idle and beside busy work
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sb3_gpu.benches import CALLBACK_SETS
from sb3_gpu.common.checks import ALGO_NAMES, AMP_MODES
from sb3_gpu.common.cli import (
    Parser,
    algo_arg,
    count_int,
    finite_float,
    interrupted,
    name_arg,
    positive_int,
    print_error,
    seed_int,
    stops_held,
)
from sb3_gpu.common.cli import command as command_name
from sb3_gpu.common.errors import BenchCannotRun, ConfigError, ResultsNotWritten
from sb3_gpu.common.hardware import logical_cores
from sb3_gpu.common.io import check_dir_creatable

# The most env processes `bench envs` starts at once (a 128-core machine runs a few per core).
MAX_BENCH_PROCESSES = 1024

# The benches (torch, SB3, gymnasium) are imported by the subcommand that runs, so that --help is quick and a Ctrl-C
# while they load is answered in one line.


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m sb3_gpu.bench", description="Measure sb3_gpu against plain SB3 on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    _per_parser(sub.add_parser("per", help="prioritized vs uniform replay: sampling, updates, DQN gradient steps"))
    speed = sub.add_parser("speed", help="speed switches off and on: bf16, torch.compile, threads (PPO and DQN presets)")
    speed.add_argument("--repeats", type=positive_int, default=9, help="repeats; medians are printed (default 9)")
    speed.add_argument(
        "--threads", type=positive_int, default=logical_cores(), help="the N of '1 vs N threads' (default: the logical cores)"
    )
    telemetry = sub.add_parser("telemetry", help="callbacks' cost: env steps/s of learn with and without them")
    telemetry.add_argument(
        "--callback",
        type=name_arg,
        choices=CALLBACK_SETS,
        default="telemetry",
        help="telemetry: the ThroughputCallback (default); guard: NanGuard and StopOnSignal; session: all three",
    )
    telemetry.add_argument("--repeats", type=positive_int, default=9, help="repeats; medians are printed (default 9)")
    _envs_parser(sub.add_parser("envs", help="env steps/s per vec env backend vs SB3's two; worker start-up"))
    _train_parser(sub.add_parser("train", help="a preset vs plain SB3 with rl-zoo3's values: time to a reward threshold"))
    _solve_parser(sub.add_parser("solve", help="presets trained seed after seed, each best model evaluated on fresh episodes"))
    _gpu_parser(sub.add_parser("gpu", help="the device data path vs SB3's: sample() of Atari frames, PPO and DQN env steps/s"))
    step = sub.add_parser("step", help="host reads, ops, graph breaks and time per gradient step and per vec step")
    step.add_argument(
        "--cases",
        nargs="+",
        metavar="ALGO:ENV[:PROFILE]",
        help="default: DQN (uniform and dqn+per), QR-DQN, PPO CartPole; SAC, TD3, TQC Pendulum (+ Pong on CUDA)",
    )
    step.add_argument("--device", default="auto", help="auto (default: cuda if there is one, else cpu), cpu, cuda, cuda:N")
    step.add_argument("--repeats", type=positive_int, default=7, help="timed calls; medians are printed (default 7)")
    step.add_argument("--vec-steps", type=positive_int, default=64, help="vec env steps per timed collection (default 64)")
    step.add_argument(
        "--buffer-size",
        type=positive_int,
        help="replay buffer of the off-policy cases (default: the preset's); uniform replay's counts do not depend on it, "
        "PER's tree has fewer levels in a smaller buffer",
    )
    step.add_argument(
        "--matmul-heads",
        action="store_true",
        help="also the compiled step with every linear layer a matrix product (variant compiled-mm), as it was before "
        "layers of at most 8 outputs became fused sums of products",
    )
    step.add_argument("--out", default="bench-results", help="folder for step.json and step.md (default bench-results)")
    auto = sub.add_parser("auto", help="auto's device, amp and threads against every alternative, idle and beside busy work")
    auto.add_argument("--cases", nargs="+", metavar="ALGO:ENV", help="default: PPO and DQN CartPole, PPO LunarLander, Pong")
    auto.add_argument("--steps", type=positive_int, default=5_000, help="env steps per run (default 5,000)")
    auto.add_argument("--repeats", type=positive_int, default=3, help="rounds; medians are printed (default 3)")
    auto.add_argument(
        "--compete",
        type=count_int,
        default=min(logical_cores(), MAX_BENCH_PROCESSES),
        help="busy processes beside the second phase (default: one per core; 0 skips that phase)",
    )
    auto.add_argument("--out", default="bench-results", help="folder for auto.json and auto.md (default bench-results)")
    return parser


def _gpu_parser(gpu: argparse.ArgumentParser) -> None:
    gpu.add_argument("--device", default="auto", help="auto (default: cuda if there is one, else cpu), cpu, cuda, cuda:N")
    gpu.add_argument("--capacity", type=positive_int, help="frames in the sampled buffer (default 100,000 on CUDA, 10,000)")
    gpu.add_argument("--batch", type=positive_int, default=1024, help="sample() batch size (default 1024)")
    gpu.add_argument("--envs", nargs="+", help="envs to train on (default ALE/Pong-v5 on CUDA, CartPole-v1 on the CPU)")
    gpu.add_argument(
        "--algos", nargs="+", type=name_arg, choices=("ppo", "dqn"), default=["ppo", "dqn"], help="default: ppo dqn"
    )
    gpu.add_argument(
        "--dqn-profiles", nargs="+", type=name_arg, help="dqn preset profiles (default auto and large on CUDA, auto)"
    )
    gpu.add_argument("--no-zoo", action="store_true", help="skip the plain SB3 + rl-zoo3 baseline (SubprocVecEnv)")
    gpu.add_argument("--steps", type=positive_int, help="env steps per training (default 50,000 on CUDA, 10,000)")
    gpu.add_argument("--repeats", type=positive_int, default=3, help="rounds; medians are printed (default 3)")
    gpu.add_argument("--out", default="bench-results", help="folder for gpu.json and gpu.md (default bench-results)")


def _per_parser(per: argparse.ArgumentParser) -> None:
    per.add_argument("--repeats", type=positive_int, default=7, help="repeats; medians are printed (default 7)")
    per.add_argument("--batch-size", type=positive_int, default=256, help="transitions per sample (default 256)")
    per.add_argument(
        "--capacities",
        type=positive_int,
        nargs="+",
        default=[100_000, 1_000_000],
        help="buffer sizes (default: 100000 1000000)",
    )


def _envs_parser(envs: argparse.ArgumentParser) -> None:
    envs.add_argument(
        "--envs",
        nargs="+",
        default=["CartPole-v1", "LunarLander-v3", "ALE/Pong-v5"],
        help="env ids (default: CartPole-v1 LunarLander-v3 ALE/Pong-v5)",
    )
    envs.add_argument("--n-envs", type=positive_int, nargs="+", default=[8, 32, 64], help="vec env sizes (default: 8 32 64)")
    envs.add_argument("--seconds", type=float, default=0.25, help="seconds per measurement (default 0.25)")
    envs.add_argument("--repeats", type=positive_int, default=15, help="rounds in shuffled order; medians (default 15)")
    envs.add_argument("--startup-workers", type=count_int, default=8, help="start-up bench size; 0 skips it (default 8)")
    envs.add_argument("--out", default="bench-results", help="folder for envs.json and envs.md (default bench-results)")


def _train_parser(train: argparse.ArgumentParser) -> None:
    train.add_argument("--algo", type=algo_arg, default="ppo", help=f"one of {', '.join(ALGO_NAMES)} (default ppo)")
    train.add_argument("--env", default="CartPole-v1", help="an env with an rl-zoo3 baseline (default CartPole-v1)")
    train.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2, 3, 4], help="default: 0 1 2 3 4")
    train.add_argument(
        "--threshold", type=finite_float, help="mean eval return to reach (default: the env's reward_threshold)"
    )
    train.add_argument(
        "--max-timesteps", type=positive_int, help="budget per run, planned for (default: the preset's n_timesteps)"
    )
    train.add_argument("--eval-freq", type=positive_int, help="evaluate every N env steps (default: a fiftieth of the budget)")
    train.add_argument("--eval-episodes", type=positive_int, default=10, help="episodes per evaluation (default 10)")
    train.add_argument("--out", default="bench-results", help="folder for train.json and train.md (default bench-results)")


def _solve_parser(solve: argparse.ArgumentParser) -> None:
    solve.add_argument("--algos", nargs="+", type=algo_arg, default=["dqn"], help=f"of {', '.join(ALGO_NAMES)} (default dqn)")
    solve.add_argument("--envs", nargs="+", default=["CartPole-v1"], help="env ids (default CartPole-v1)")
    solve.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2], help="default: 0 1 2")
    solve.add_argument(
        "--per",
        nargs="+",
        type=name_arg,
        choices=("preset", "on", "off"),
        default=["preset"],
        help="dqn, qrdqn (default preset)",
    )
    solve.add_argument(
        "--amp", nargs="+", type=name_arg, choices=AMP_MODES, default=["auto"], help="precisions (default auto)"
    )
    solve.add_argument("--timesteps", type=positive_int, help="training length (default: the preset's)")
    solve.add_argument("--preset", metavar="FILE", help="a preset YAML file to use instead of the bundled one")
    solve.add_argument(
        "--eval-freq", type=positive_int, help="evaluate every N env steps (default: the preset's eval_freq, else a tenth)"
    )
    solve.add_argument("--episodes", type=positive_int, default=20, help="fresh episodes per best model (default 20)")
    solve.add_argument("--target", type=finite_float, help="the return to reach (default: each env's reward_threshold)")
    # bench train's and tune's name for it; each flag's error names the one given
    solve.add_argument("--threshold", dest="target", type=finite_float, help=argparse.SUPPRESS)
    solve.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="trainings at once, each in a process on its share of the cores (default 1)",
    )
    solve.add_argument("--out", default="bench-results", help="folder for solve.json and solve.md (default bench-results)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = "python -m sb3_gpu.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        if getattr(args, "out", None) is not None:
            check_dir_creatable(args.out, "--out folder", utf8=True)  # before the work: an hour's results must have a place
        # One named twice would run a case twice, and count it twice.
        for flag in ("seeds", "algos", "envs", "per", "amp", "dqn_profiles", "cases", "n_envs", "capacities"):
            given = getattr(args, flag, None) or []
            if len(set(given)) < len(given):
                repeated = sorted({str(v) for v in given if given.count(v) > 1})
                raise ConfigError(f"--{flag.replace('_', '-')} names {', '.join(repeated)} more than once; give each once")
        if args.command == "envs":
            return _main_envs(args, command)
        if args.command == "train":
            return _main_train(args, command)
        if args.command == "solve":
            return _main_solve(args, command)
        if args.command == "speed":
            return _main_speed(args)
        if args.command == "telemetry":
            return _main_telemetry(args)
        if args.command == "gpu":
            return _main_gpu(args, command)
        if args.command == "auto":
            return _main_auto(args, command)
        if args.command == "step":
            return _main_step(args, command)
        return _main_per(args)
    except ConfigError as e:
        print_error(str(e))
        return 2
    except KeyboardInterrupt:
        print_error("interrupted; no results were written")
        return interrupted()
    except (ResultsNotWritten, BenchCannotRun) as e:
        print_error(str(e))
        return 1


def _interrupted_keeping(saved: Path, what: str) -> int:
    """After a signal: name the file that keeps what ended (re-raised to ``main``'s message where nothing did)."""
    if not saved.exists():
        raise KeyboardInterrupt
    print_error(f"interrupted; the {what} that ended are kept in {saved}, and the same command goes on from them")
    return interrupted()


def _check_batch(flag: str, batch: int, capacity: int) -> None:
    """Refuse a batch larger than the buffer: every sample would repeat frames, a case no preset trains."""
    if batch > capacity:
        raise ConfigError(f"{flag} {batch:,} is above the {capacity:,} frames the buffer holds; give at most {capacity:,}")


def _main_per(args: argparse.Namespace) -> int:
    from sb3_gpu.benches.base import machine_line
    from sb3_gpu.benches.per import bench_per

    _check_batch("--batch-size", args.batch_size, min(args.capacities))
    print(machine_line())
    rows = bench_per(args.batch_size, args.capacities, args.repeats)
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'uniform':>10}  {'PER':>10}  {'ratio':>6}  target")
    for case, u, p, ratio, target in rows:
        verdict = "-" if target == float("inf") else f"<= {target:.2f}x " + ("ok" if ratio <= target else "MISSED")
        print(f"{case:<{width}}  {u * 1e6:>8.1f}us  {p * 1e6:>8.1f}us  {ratio:>5.2f}x  {verdict}")
    print(f"whether PER helps a preset learn: {command_name()} -m sb3_gpu.bench solve --per on off")
    return 0


def _main_telemetry(args: argparse.Namespace) -> int:
    from sb3_gpu.benches.base import machine_line
    from sb3_gpu.benches.telemetry import bench_telemetry

    print(machine_line())
    rows = bench_telemetry(args.repeats, args.callback)
    print(f"{'case':<22} {'without':>10} {'with':>10}  {'wall':>7} {'CPU':>7}")
    for label, without, with_, wall, cpu in rows:
        print(f"{label:<22} {without:>10.0f} {with_:>10.0f}  {wall:>+7.1%} {cpu:>+7.1%}")
    print("env steps/s of learn (medians); overhead: median over rounds of the time ratio, by wall and by CPU time")
    return 0


def _main_speed(args: argparse.Namespace) -> int:
    import torch as th

    from sb3_gpu.benches.speed import bench_speed, matmul_ratio
    from sb3_gpu.common.hardware import detect_hardware

    hw = detect_hardware()
    flags = ", ".join(f for f, on in (("AVX512-BF16", hw.cpu_bf16 and not hw.cpu_amx), ("AMX", hw.cpu_amx)) if on) or "none"
    print(f"machine: {hw.cpu}; {hw.describe()}; native bf16: {flags}; torch {th.__version__}")
    fp32, bf16 = matmul_ratio(args.repeats)
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


def _main_envs(args: argparse.Namespace, command: str) -> int:
    from sb3_gpu.benches.base import write_results
    from sb3_gpu.benches.envs import bench_envs, bench_startup, envs_markdown
    from sb3_gpu.common.hardware import detect_hardware
    from sb3_gpu.envs.spec import probe_env, resolve_env

    if not (math.isfinite(args.seconds) and args.seconds > 0):
        print_error(f"--seconds must be a finite number > 0, got {args.seconds}")
        return 2
    most = max(args.startup_workers, *args.n_envs)
    if most > MAX_BENCH_PROCESSES:  # each subprocess env is a process: a typo must not fork thousands
        print_error(f"--n-envs and --startup-workers start one process per env: at most {MAX_BENCH_PROCESSES} (got {most})")
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
    markdown = envs_markdown(rows, startup, command)
    print(markdown)
    paths = write_results(Path(args.out), "envs", {"command": command, "rows": rows, "startup": startup}, markdown)
    print("written:", *paths)
    return 0


def _device(given: str) -> str | None:
    """``--device`` resolved, or None after saying why it cannot be used. Asked for by name, the plan's own check
    answers; ``auto`` here is the GPU where there is one (these benches measure the device, not the plan's choice)."""
    from sb3_gpu.common.hardware import detect_hardware
    from sb3_gpu.planning.device import requested_device

    hardware = detect_hardware()
    if given == "auto":
        return "cuda:0" if hardware.has_cuda else "cpu"
    try:
        chosen = requested_device(given, hardware)
    except ConfigError as e:
        print_error(f"--device: {e}")
        return None
    if chosen is None or chosen.device == "mps":
        print_error(f"--device: expected auto, cpu, cuda or cuda:N, got {given!r}")
        return None
    return chosen.device


def _main_step(args: argparse.Namespace, command: str) -> int:
    from sb3_gpu.benches.base import machine_line, write_results
    from sb3_gpu.benches.step import CPU_CASES, GPU_CASES, bench_step, plan_case, rows_json, step_markdown

    device = _device(args.device)
    if device is None:
        return 2
    cases = args.cases or (GPU_CASES if device.startswith("cuda") else CPU_CASES)
    try:
        for case in cases:
            plan_case(case, device, buffer_size=args.buffer_size)  # fails here, not after other cases ran
    except (ValueError, ConfigError) as e:
        hint = "; or count with a smaller --buffer-size" if "buffer_size=" in str(e) and args.buffer_size is None else ""
        print_error(f"--cases: {e}{hint}")
        return 2
    machine = machine_line() + f", device {device}"
    print(machine)
    rows: list[Any] = []
    try:
        bench_step(cases, device, args.repeats, args.vec_steps, args.buffer_size, matmul_heads=args.matmul_heads, rows=rows)
    except KeyboardInterrupt:
        return _write_partial(
            args.out,
            "step",
            {"command": command, "machine": machine, "rows": rows_json(rows)},
            step_markdown(rows, command, machine),
            len({r.case for r in rows}),
            len(cases),
        )
    markdown = step_markdown(rows, command, machine)
    print(markdown)
    paths = write_results(Path(args.out), "step", {"command": command, "machine": machine, "rows": rows_json(rows)}, markdown)
    print("written: " + " ".join(str(p) for p in paths))
    return 0


def _write_partial(out: str, name: str, data: dict[str, Any], markdown: str, done: int, cases: int) -> int:
    """After a signal: write the cases that ended (a GPU's minutes are not lost to the one it stopped), saying so in
    both files; none ended, an earlier run's files in ``out`` are left as they are."""
    from sb3_gpu.benches.base import write_results

    if not done:
        raise KeyboardInterrupt
    note = f"Interrupted after {done} of {cases} cases: the others were not measured."
    with stops_held():  # a second Ctrl-C (pressed twice) cannot cut short the files or the line that names them
        paths = write_results(Path(out), name, {**data, "interrupted": f"{done} of {cases} cases"}, f"{note}\n\n{markdown}")
        print(markdown)
        print_error(f"interrupted after {done} of {cases} cases; those are written: {' '.join(str(p) for p in paths)}")
    return interrupted()


def _main_gpu(args: argparse.Namespace, command: str) -> int:
    from sb3_gpu.benches.base import machine_line, write_results
    from sb3_gpu.benches.gpu import bench_sample, bench_training, check_cases, gpu_markdown

    device = _device(args.device)
    if device is None:
        return 2
    on_gpu = device.startswith("cuda")
    capacity = args.capacity or (100_000 if on_gpu else 10_000)
    _check_batch("--batch", args.batch, capacity)
    if args.dqn_profiles and "dqn" not in args.algos:
        raise ConfigError(f"--dqn-profiles {' '.join(args.dqn_profiles)}: they are DQN's, and --algos has no dqn")
    envs = args.envs or (["ALE/Pong-v5"] if on_gpu else ["CartPole-v1"])
    profiles = args.dqn_profiles or (["auto", "large"] if on_gpu else ["auto"])
    cases = [(algo, env, p) for env in envs for algo in args.algos for p in (profiles if algo == "dqn" else ["auto"])]
    check_cases(cases, device)
    print(machine_line())
    sample = bench_sample(device, capacity, args.batch, max(args.repeats, 5) * 4)
    training: list[dict[str, Any]] = []
    try:
        steps = args.steps or (50_000 if on_gpu else 10_000)
        bench_training(cases, device, steps, args.repeats, zoo=not args.no_zoo, rows=training)
    except ConfigError as exc:
        print_error(str(exc))
        return 2
    except KeyboardInterrupt:  # the sample's figures are in, and the cases that ended
        data = {"command": command, "sample": sample, "training": training}
        return _write_partial(
            args.out, "gpu", data, gpu_markdown(device, sample, training, command), len(training), len(cases)
        )
    markdown = gpu_markdown(device, sample, training, command)
    print(markdown)
    paths = write_results(Path(args.out), "gpu", {"command": command, "sample": sample, "training": training}, markdown)
    print("written:", *paths)
    return 0


def _main_auto(args: argparse.Namespace, command: str) -> int:
    from sb3_gpu.benches.auto import auto_markdown, bench_auto, default_cases
    from sb3_gpu.benches.base import machine_line, write_results
    from sb3_gpu.common.checks import ALGO_NAMES, algo_name
    from sb3_gpu.config.schema import PROFILES
    from sb3_gpu.planning.plan import make_plan

    cases = default_cases()
    if args.cases:
        cases = []
        for text in args.cases:
            algo, _, env = text.partition(":")
            if not env:
                print_error(f"--cases: expected ALGO:ENV with ALGO one of {', '.join(ALGO_NAMES)}, got {text!r}")
                return 2
            try:
                algo = algo_name(algo)
            except ConfigError as e:
                print_error(f"--cases {text!r}: {e}")
                return 2
            profile = env.rpartition(":")[2]
            if profile in PROFILES:  # bench step's ALGO:ENV:PROFILE; here the plan picks the profile
                print_error(f"--cases {text!r}: bench auto takes ALGO:ENV and chooses the profile; leave out ':{profile}'")
                return 2
            cases.append((algo, env))
    if args.compete > MAX_BENCH_PROCESSES:  # each is a busy process: a typo must not fork thousands
        print_error(f"--compete: expected a count from 0 to {MAX_BENCH_PROCESSES}, got {args.compete}")
        return 2
    for algo, env in cases:  # a bad env fails here, in one line, before anything is printed or timed
        make_plan(algo, env, "auto", training=False)
    machine = machine_line()  # before the runs set torch's thread count
    print(machine)
    try:
        rows = bench_auto(cases, args.steps, args.repeats, args.compete)
    except ConfigError as exc:
        print_error(str(exc))
        return 2
    markdown = auto_markdown(rows, command, machine)
    print(markdown)
    print("written:", *write_results(Path(args.out), "auto", {"command": command, "rows": rows}, markdown))
    return 0


def _main_solve(args: argparse.Namespace, command: str) -> int:
    import gymnasium as gym

    from sb3_gpu.benches.base import machine_line, write_results
    from sb3_gpu.benches.solve import ROWS_FILE, Case, bench_solve, solve_markdown
    from sb3_gpu.envs.spec import resolve_env
    from sb3_gpu.planning.plan import make_plan

    pers = [None if p == "preset" else p == "on" for p in dict.fromkeys(args.per)]
    if pers != [None] and not {"dqn", "qrdqn"} & set(args.algos):
        raise ConfigError(f"--per {' '.join(args.per)}: prioritized replay is for dqn and qrdqn, and --algos has neither")
    cases = [
        Case(algo, env, per, amp, seed, args.timesteps, args.preset, args.eval_freq)
        for algo in args.algos
        for env in args.envs
        for per in (pers if algo in ("dqn", "qrdqn") else [None])
        for amp in args.amp
        for seed in args.seeds
    ]
    targets: dict[str, float] = {}
    try:
        for case in {dataclasses.replace(c, seed=0) for c in cases}:  # bad names and combinations fail now, in one line
            overrides = {"amp": case.amp, **({} if case.per is None else {"per": case.per})}
            make_plan(
                case.algo,
                case.env,
                "auto",
                n_timesteps=case.timesteps,
                preset=case.preset,
                overrides=overrides,
                training=False,
            )
        for env in args.envs:
            # gym.spec reads no module:EnvId form: the id the plan above resolved it to
            target = args.target if args.target is not None else gym.spec(resolve_env(env).entry_name).reward_threshold
            if target is None:
                raise ConfigError(f"{env} registers no reward_threshold; pass --target")
            targets[env] = float(target)
    except (ConfigError, gym.error.Error) as exc:
        print_error(str(exc))
        return 2
    print(machine_line())
    out = Path(args.out)
    try:
        rows = bench_solve(cases, args.episodes, args.jobs, out=out)
    except KeyboardInterrupt:
        return _interrupted_keeping(out / ROWS_FILE, "cases")
    markdown = solve_markdown(rows, targets, args.episodes, command)
    print(markdown)
    print("written:", *write_results(Path(args.out), "solve", {"command": command, "rows": rows}, markdown))
    return 0


def _main_train(args: argparse.Namespace, command: str) -> int:
    import gymnasium as gym

    from sb3_gpu.benches.base import write_results
    from sb3_gpu.benches.train import ZOO, ZOO_ATARI, bench_train, has_zoo_baseline, runs_file, train_markdown
    from sb3_gpu.common.hardware import detect_hardware
    from sb3_gpu.envs.spec import register_ale

    if args.env not in gym.registry:
        register_ale()  # ale-py's ids, which looks_atari and gym.spec know only once registered
    if not has_zoo_baseline(args.algo, args.env):
        have = ", ".join([*(f"{a} {e}" for a, e in sorted(ZOO)), *(f"{a} on Atari games" for a in ZOO_ATARI)])
        print_error(f"no rl-zoo3 baseline for {args.algo} {args.env} (have: {have})")
        return 2
    threshold = args.threshold if args.threshold is not None else gym.spec(args.env).reward_threshold
    if threshold is None:
        print_error(f"{args.env} registers no reward_threshold; pass --threshold")
        return 2
    print(f"machine: {detect_hardware().describe()}")
    out = Path(args.out)
    try:
        summary = bench_train(
            args.algo, args.env, args.seeds, float(threshold), args.max_timesteps, args.eval_freq, args.eval_episodes, out=out
        )
    except KeyboardInterrupt:
        return _interrupted_keeping(out / runs_file(args.algo, args.env), "runs")
    markdown = train_markdown(summary, command)
    print(markdown)
    paths = write_results(Path(args.out), "train", {"command": command, **summary}, markdown)
    print("written:", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
