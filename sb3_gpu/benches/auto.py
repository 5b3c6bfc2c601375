"""``bench auto``: the plan's automatic device, precision and thread choices against every alternative it passed
over, each trained for a short run in rotating rounds in one process: once on an idle machine and once beside
competing CPU-bound processes (as when a user trains several seeds at once)."""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sb3_gpu.common.errors import BenchCannotRun
from sb3_gpu.common.torch_settings import synchronize
from sb3_gpu.envs.build import close_vec_envs
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import COMPILE_TIMED, Plan, auto_compile_mode, make_plan
from sb3_gpu.planning.probe import Candidate
from sb3_gpu.planning.speed import compile_label

# (algo, env): the cases `bench auto` runs by default; the Atari ones where ale-py is installed.
AUTO_CASES: list[tuple[str, str]] = [
    ("ppo", "CartPole-v1"),
    ("dqn", "CartPole-v1"),
    ("ppo", "LunarLander-v3"),
    ("ppo", "ALE/Pong-v5"),
    ("dqn", "ALE/Pong-v5"),
]


def default_cases() -> list[tuple[str, str]]:
    have_atari = importlib.util.find_spec("ale_py") is not None
    have_box2d = importlib.util.find_spec("Box2D") is not None
    return [(a, e) for a, e in AUTO_CASES if (have_atari or not e.startswith("ALE/")) and (have_box2d or "Lunar" not in e)]


@contextmanager
def competing(processes: int) -> Iterator[None]:
    """``processes`` CPU-bound Python processes (busy loops) running beside the block."""
    spinners: list[subprocess.Popen[bytes]] = []
    try:  # a start that fails part way (a process limit) or Ctrl-C still stops those already spinning
        for i in range(processes):
            try:
                spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            except OSError as e:
                raise BenchCannotRun(f"cannot start busy process {i + 1} of {processes} for --compete: {e}") from None
        if spinners:
            time.sleep(0.5)  # running before the plan looks at the cores
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _alternatives(plan: Plan) -> list[tuple[str, str, dict[str, Any], bool]]:
    """(label, device, overrides, whether collection compiles) of every candidate of the plan's probe, and on the CPU
    each of them with one thread and with every physical core, whether the probe took that count into account or
    not. Where the plan timed the compiled step, auto's device, precision and threads also run each compile choice:
    eager, the step compiled alone, and the step and collection's forward pass compiled."""
    assert plan.speed is not None
    options = plan.probe.options if plan.probe else ()
    speed = plan.speed
    auto = (plan.device.device, speed.amp, speed.threads, speed.compile, speed.compile_collect or speed.compile == "false")
    candidates = {(o.candidate.device, o.candidate.amp, o.candidate.threads, "false", True) for o in options} | {auto}
    for device, amp, _, _, _ in list(candidates):
        if device == "cpu":
            candidates |= {(device, amp, 1, "false", True), (device, amp, plan.hardware.physical_cores, "false", True)}
    if speed.compile_reason.startswith(COMPILE_TIMED):
        mode = auto_compile_mode(plan.device.device)
        candidates |= {(*auto[:3], c, collect) for c, collect in (("false", True), (mode, False), (mode, True))}
    ordered = sorted(candidates, key=lambda c: (c != auto, c))
    return [
        (Candidate(d, a, t).label + _compiled_label(c, collect), d, {"amp": a, "threads": t, "compile": c}, collect)
        for d, a, t, c, collect in ordered
    ]


def _compiled_label(compile_mode: str, collect: bool) -> str:
    return "" if compile_mode == "false" else f" compiled {compile_label(compile_mode, collect)}"


def _short(algo: str, steps: int) -> dict[str, Any]:
    """A short run trains as a long one does: off-policy training starts within it, on a buffer no larger than it."""
    return {} if algo == "ppo" else {"learning_starts": steps // 5, "buffer_size": steps}


def _run(algo: str, env: str, device: str, overrides: dict[str, Any], collect: bool, steps: int) -> float:
    overrides = {**_short(algo, steps), **overrides, "probe": False}
    plan = make_plan(algo, env, device, n_timesteps=steps, seed=0, overrides=overrides)
    if not collect:  # no preset key asks for this: auto's own choice, made here as auto makes it
        assert plan.speed is not None
        plan = dataclasses.replace(plan, speed=dataclasses.replace(plan.speed, compile_collect=False))
    venv = build_env(plan)
    try:
        model = build_model(plan, venv)
        start = time.perf_counter()
        model.learn(steps)
        synchronize(model.device)
        return model.num_timesteps / (time.perf_counter() - start)
    finally:
        close_vec_envs(venv)


def bench_auto(
    cases: Sequence[tuple[str, str]], steps: int, repeats: int, competitors: int, print_fn: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Per case and phase (idle, then beside ``competitors`` busy processes): auto's choice and env steps/s of every
    alternative, medians of rotating rounds, and auto's steps/s over the best alternative's."""
    rows = []
    phases = [("idle", 0)] + ([(f"beside {competitors} busy processes", competitors)] if competitors else [])
    for algo, env in cases:
        for phase, n in phases:
            with competing(n):
                # Only for the rollout's length: not the compile choice, which timing would compile for the whole run.
                plan = make_plan(algo, env, "auto", seed=0, overrides={**_short(algo, steps), "compile": False})
                params: Any = plan.preset.params
                # At least two PPO rollouts, so that every run trains.
                case_steps = max(steps, 2 * params.n_steps * plan.preset.n_envs) if algo == "ppo" else steps
                # Planned again for the short run it times: compile=auto weighs the compile time against its length.
                plan = make_plan(algo, env, "auto", n_timesteps=case_steps, seed=0, overrides=_short(algo, steps))
                assert plan.speed is not None
                alternatives = _alternatives(plan)
                runs: dict[str, list[float]] = {label: [] for label, *_ in alternatives}
                for round_ in range(repeats):
                    shift = round_ % len(alternatives)
                    for label, device, overrides, collect in alternatives[shift:] + alternatives[:shift]:
                        runs[label].append(_run(algo, env, device, overrides, collect, case_steps))
            medians = {label: statistics.median(v) for label, v in runs.items()}
            chosen = alternatives[0][0]  # auto's own choice comes first
            best = max(medians, key=lambda k: medians[k])
            row = {
                "algo": algo,
                "env": env,
                "steps": case_steps,
                "phase": phase,
                "busy_cores": plan.hardware.busy_cores,
                "auto": chosen,
                "steps_per_s": medians,
                "best": best,
                "ratio": medians[chosen] / medians[best],
            }
            print_fn(f"  {algo} {env}, {phase}: auto {chosen} {row['ratio']:.2f}x the best ({best})")
            rows.append(row)
    return rows


def auto_markdown(rows: list[dict[str, Any]], command: str, machine: str) -> str:
    lines = [
        f"`{command}` ({machine})",
        "",
        "| case | phase | auto's choice | env steps/s of each candidate (median) | auto / best |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        figures = ", ".join(f"{label} {v:,.0f}" for label, v in r["steps_per_s"].items())
        lines.append(f"| {r['algo']} {r['env']} | {r['phase']} | {r['auto']} | {figures} | {r['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"
