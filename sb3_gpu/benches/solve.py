"""``bench solve``: do the presets solve their envs, seed after seed? Each case is trained as ``train`` trains it, and
its best model is then evaluated on fresh episodes, as a user would with ``evaluate``."""

from __future__ import annotations

import signal
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from multiprocessing import active_children, get_context
from pathlib import Path
from typing import Any

from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.evaluation import BestModel, evaluate_run
from sb3_gpu.runs.training import train_run

# The fresh episodes of the final check start from seeds that training's evaluations never used.
FRESH_SEED_OFFSET = 1_000_000


@dataclass(frozen=True)
class Case:
    algo: str
    env: str
    per: bool | None  # None: the preset's own choice
    amp: str
    seed: int
    timesteps: int | None = None
    preset: str | None = None  # a preset YAML file instead of the bundled one
    eval_freq: int | None = None  # None: train's default (the preset's eval_freq, else a tenth of the run)

    def label(self) -> str:
        per = "" if self.per is None else f", PER {'on' if self.per else 'off'}"
        preset = f", preset {Path(self.preset).name}" if self.preset else ""
        every = f", evaluated every {self.eval_freq:,} steps" if self.eval_freq else ""
        return f"{self.algo} {self.env}{per}, amp {self.amp}{preset}{every}"


CASE_FIELDS = ("algo", "env", "per", "amp", "seed", "timesteps", "preset", "eval_freq")


def solve_case(case: Case, episodes: int) -> dict[str, Any]:
    """Train ``case`` into a temporary run dir and evaluate its best model on ``episodes`` fresh episodes."""
    overrides: dict[str, Any] = {"amp": case.amp}
    if case.per is not None:
        overrides["per"] = case.per
    plan = make_plan(
        case.algo, case.env, "auto", seed=case.seed, n_timesteps=case.timesteps, preset=case.preset, overrides=overrides
    )
    with tempfile.TemporaryDirectory(prefix="sb3_gpu_solve_") as tmp:
        summary = train_run(plan, Path(tmp) / "run", eval_freq=case.eval_freq, progress=False, report_s=None)
        if summary.get("stopped_by") is not None:  # a signal stops the bench, not only this case's training
            raise KeyboardInterrupt(f"stopped by {summary['stopped_by']}")
        fresh = evaluate_run(Path(tmp) / "run", episodes=episodes, seed=case.seed + FRESH_SEED_OFFSET)
    chosen = BestModel(**{k: v for k, v in summary["best"].items() if k != "chosen"}) if summary.get("best") else None
    mean, std, count = chosen.figure if chosen is not None else (None, None, None)
    return {
        **asdict(case),
        "amp_used": plan.speed.amp if plan.speed is not None else None,
        "compile_used": plan.speed.compile_label if plan.speed is not None else None,  # the plan's choice
        "evaluated": fresh["mean"],
        "evaluated_std": fresh["std"],
        "model": Path(fresh["model"]).name,
        "reported_best": mean,
        "reported_best_std": std,
        "reported_best_episodes": count,
        "confirmed_best": chosen.mean if chosen is not None else None,
        "best_at": chosen.timesteps if chosen is not None else None,
        "trained": summary["timesteps"],
        "wall_s": summary["wall_time_s"],
    }


def agrees(row: dict[str, Any], episodes: int) -> bool:
    """Whether the fresh evaluation reaches the reported best minus two standard errors of their difference."""
    if row["reported_best"] is None:
        return False
    spread = row["evaluated_std"] ** 2 / episodes
    if row["reported_best_std"] is not None and row["reported_best_episodes"]:
        spread += row["reported_best_std"] ** 2 / row["reported_best_episodes"]
    return bool(row["evaluated"] >= row["reported_best"] - 2 * spread**0.5)


def bench_solve(
    cases: Sequence[Case], episodes: int, jobs: int, print_fn: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Every case, ``jobs`` at a time in processes of their own (one at a time in this process with ``jobs=1``)."""
    rows: list[dict[str, Any]] = []

    def done(row: dict[str, Any]) -> None:
        rows.append(row)
        best = "none" if row["reported_best"] is None else f"{row['reported_best']:.1f}"
        print_fn(
            f"  {Case(**{k: row[k] for k in CASE_FIELDS}).label()}, seed "
            f"{row['seed']}: {row['model']} {row['evaluated']:.1f} +/- {row['evaluated_std']:.1f} on {episodes} fresh "
            f"episodes (reported best {best}) in {row['wall_s']:.0f} s"
        )

    if jobs == 1:
        for case in cases:
            done(solve_case(case, episodes))
    else:
        _solve_in_pool(cases, episodes, jobs, done)
    order = {case: i for i, case in enumerate(cases)}
    return sorted(rows, key=lambda r: order[Case(**{k: r[k] for k in CASE_FIELDS})])


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _worker_start() -> None:
    # A worker stopped before its training handles signals (building envs, say) unwinds as from Ctrl-C, so that its
    # case's temporary run dir is removed, not left behind by a process that SIGTERM's default action killed.
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


def _solve_in_pool(cases: Sequence[Case], episodes: int, jobs: int, done: Callable[[dict[str, Any]], None]) -> None:
    """``jobs`` cases at a time. Only as many are submitted as run: the pool's call queue would otherwise hold cases
    that cancelling cannot reach, and a worker would start one after a signal."""

    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # a SIGTERM to this process alone must reach the workers
    waiting: Iterator[Case] = iter(cases)
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=_worker_start) as pool:
            running: set[Future[dict[str, Any]]] = set()

            def submit() -> None:
                case = next(waiting, None)
                if case is not None:
                    running.add(pool.submit(solve_case, case, episodes))

            for _ in range(jobs):
                submit()
            try:
                while running:
                    finished, pending = wait(running, return_when=FIRST_COMPLETED)
                    running.clear()
                    running.update(pending)
                    for future in finished:
                        done(future.result())
                        submit()
            except BaseException:  # a signal: each training saves and stops, and nothing more starts
                for worker in active_children():
                    worker.terminate()  # SIGTERM, which a training session handles as Ctrl-C
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def solve_markdown(rows: Sequence[dict[str, Any]], targets: dict[str, float], episodes: int, command: str) -> str:
    """One line per algo, env, PER and amp: seeds that compiled, seeds that reached the target, the fresh evaluations,
    the agreement."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["algo"], row["env"], row["per"], row["amp"]), []).append(row)
    lines = [
        f"`{command}`: each seed trained as `train` trains it, then its best model evaluated on {episodes} fresh "
        "episodes (deterministic). Agreement: the fresh mean reaches the run's reported best minus two standard errors.",
        "",
        "| algo | env | PER | amp | compiled | seeds reaching the target | fresh evaluation: median [min-max] | agrees "
        "| wall, median |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for (algo, env, per, amp), group in groups.items():
        target = targets[env]
        values = [r["evaluated"] for r in group]
        reached = sum(v >= target for v in values)
        per_text = "preset" if per is None else ("on" if per else "off")
        compiled = sum(r.get("compile_used") not in (None, "false") for r in group)
        lines.append(
            f"| {algo} | {env} | {per_text} | {amp} | {compiled}/{len(group)} | {reached}/{len(group)} (>= {target:g}) "
            f"| {statistics.median(values):.1f} [{min(values):.1f} - {max(values):.1f}] "
            f"| {sum(agrees(r, episodes) for r in group)}/{len(group)} "
            f"| {statistics.median(r['wall_s'] for r in group):.0f} s |"
        )
    return "\n".join(lines) + "\n"
