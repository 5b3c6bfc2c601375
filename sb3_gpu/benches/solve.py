"""``bench solve``: do the presets solve their envs, seed after seed? Each case is trained as ``train`` trains it, and
its best model is then evaluated on fresh episodes, as a user would with ``evaluate``.

Each case's row is saved as it ends (``solve-rows.json`` in the ``--out`` folder); the same case asked for again, with
the same preset file and episodes on the same machine, is kept rather than trained again."""

from __future__ import annotations

import json
import signal
import statistics
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from multiprocessing import active_children, get_context
from pathlib import Path
from typing import Any

from sb3_gpu.benches.base import machine_key, preset_sha256, save_json
from sb3_gpu.common.cli import keep_stops
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.hardware import logical_cores
from sb3_gpu.planning.build import offset_seed
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


def solve_case(case: Case, episodes: int, threads: int | None = None) -> dict[str, Any]:
    """Train ``case`` into a temporary run dir and evaluate its best model on ``episodes`` fresh episodes.

    :param threads: torch's threads for the training (None: the plan's choice)
    """
    preset_hash = preset_sha256(case.algo, case.preset)  # the bytes the plan reads next, kept with the row
    overrides: dict[str, Any] = {"amp": case.amp}
    if case.per is not None:
        overrides["per"] = case.per
    if threads is not None:
        overrides["threads"] = threads
    plan = make_plan(
        case.algo, case.env, "auto", seed=case.seed, n_timesteps=case.timesteps, preset=case.preset, overrides=overrides
    )
    with tempfile.TemporaryDirectory(prefix="sb3_gpu_solve_") as tmp:
        summary = train_run(plan, Path(tmp) / "run", eval_freq=case.eval_freq, progress=False, report_s=None)
        if summary.get("stopped_by") is not None:  # a signal stops the bench, not only this case's training
            raise KeyboardInterrupt(f"stopped by {summary['stopped_by']}")
        fresh = evaluate_run(Path(tmp) / "run", episodes=episodes, seed=offset_seed(case.seed, FRESH_SEED_OFFSET))
    chosen = BestModel(**{k: v for k, v in summary["best"].items() if k != "chosen"}) if summary.get("best") else None
    mean, std, count = chosen.figure if chosen is not None else (None, None, None)
    return {
        **asdict(case),
        "preset_sha256": preset_hash,
        "amp_used": plan.speed.amp if plan.speed is not None else None,
        "compile_used": plan.speed.compile_label if plan.speed is not None else None,  # the plan's choice
        "threads_used": plan.speed.threads if plan.speed is not None else None,
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


ROWS_FILE = "solve-rows.json"


class SavedRows:
    """Rows of ended cases, in ``folder/solve-rows.json``, each keyed by its case, the sha256 of the preset file it
    trained from, the fresh episodes and the machine: a row is kept only where all of these match."""

    def __init__(self, folder: Path | None, episodes: int) -> None:
        self.path = None if folder is None else folder / ROWS_FILE
        self.context = {"episodes": episodes, "machine": machine_key()}
        self.rows: list[dict[str, Any]] = []
        if self.path is not None and self.path.exists():
            try:
                rows = json.loads(self.path.read_text())["rows"]
                self.rows = [dict(r) for r in rows if isinstance(r, dict)]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{self.path} is not a saved bench solve ({exc}); remove it or pass another --out") from None

    def get(self, case: Case) -> dict[str, Any] | None:
        key = {**asdict(case), "preset_sha256": preset_sha256(case.algo, case.preset), **self.context}
        return next((r for r in self.rows if all(r.get(k) == v for k, v in key.items())), None)

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        """Save ``row`` (which names the preset file's sha256 it trained from) in place of any of the same key."""
        row = {**row, **self.context}
        key = [*CASE_FIELDS, "preset_sha256", *self.context]
        self.rows = [r for r in self.rows if any(r.get(k) != row[k] for k in key)] + [row]
        if self.path is not None:
            save_json(self.path, {"rows": self.rows}, "the ended cases")
        return row


def bench_solve(
    cases: Sequence[Case], episodes: int, jobs: int, print_fn: Callable[[str], None] = print, out: Path | None = None
) -> list[dict[str, Any]]:
    """Every case, ``jobs`` at a time in processes of their own (one at a time in this process with ``jobs=1``).

    :param out: where each row is saved as it ends, and where rows of the same cases saved earlier are kept
    """
    rows: list[dict[str, Any]] = []
    saved = SavedRows(out, episodes)

    def done(row: dict[str, Any], kept: bool = False) -> None:
        case = Case(**{k: row[k] for k in CASE_FIELDS})
        rows.append(row if kept else saved.add(row))
        best = "none" if row["reported_best"] is None else f"{row['reported_best']:.1f}"
        print_fn(
            f"  {case.label()}, seed {row['seed']}: {row['model']} {row['evaluated']:.1f} +/- "
            f"{row['evaluated_std']:.1f} on {episodes} fresh episodes (reported best {best}) in {row['wall_s']:.0f} s"
            + (f" (kept from {saved.path})" if kept else "")
        )

    todo = []
    for case in cases:
        row = saved.get(case)
        if row is None:
            todo.append(case)
        else:
            done(row, kept=True)
    if jobs == 1:
        for case in todo:
            done(solve_case(case, episodes))
    else:
        # Each job its share of the cores: each plan, probing while the others start, may take them all, and
        # trainings whose threads outnumber the cores spend their time waiting on each other.
        _solve_in_pool(todo, episodes, jobs, done, max(1, logical_cores() // jobs))
    order = {case: i for i, case in enumerate(cases)}
    return sorted(rows, key=lambda r: order[Case(**{k: r[k] for k in CASE_FIELDS})])


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


_case_under_way = threading.Event()  # in a pool worker: whether it is solving a case now


def _solve_in_worker(case: Case, episodes: int, threads: int) -> dict[str, Any]:
    _case_under_way.set()
    try:
        return solve_case(case, episodes, threads)
    finally:
        _case_under_way.clear()


def _worker_signal(signum: int, frame: Any) -> None:
    """A worker stopped before its training handles signals (building envs, say) unwinds as from Ctrl-C, so that its
    case's temporary run dir is removed, not left behind by a process that SIGTERM's default action killed; an idle
    one, waiting for a case, just exits (a KeyboardInterrupt there prints multiprocessing's traceback)."""
    if _case_under_way.is_set():
        raise KeyboardInterrupt(signal.Signals(signum).name)
    raise SystemExit(128 + signum)


def _worker_start() -> None:
    keep_stops()  # for the worker's life: a stop its handler raised inside a finalizer must still stop it
    signal.signal(signal.SIGTERM, _worker_signal)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a bench started in the background keeps ignoring it
        signal.signal(signal.SIGINT, _worker_signal)  # Ctrl-C in a terminal reaches the workers too


def _solve_in_pool(
    cases: Sequence[Case], episodes: int, jobs: int, done: Callable[[dict[str, Any]], None], threads: int
) -> None:
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
                    running.add(pool.submit(_solve_in_worker, case, episodes, threads))

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
