"""``python -m sb3_gpu.tune ALGO --env ID --trials N``: an optuna study that many processes and machines can share.

Every worker runs the same command with the same ``--storage`` URL; the study lives in that storage, so workers
join it, a killed worker's trial is marked failed (heartbeats), and running the command again resumes it. The
default storage is an SQLite file in the study dir: nothing to start.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sb3_gpu.common.checks import ALGO_NAMES, VEC_ENV_KINDS, default_env
from sb3_gpu.common.cli import (
    Parser,
    Terminated,
    algo_arg,
    finite_float,
    interrupted,
    name_arg,
    positive_int,
    print_error,
    seed_int,
    shell_line,
    sigterm_as_interrupt,
    threads_arg,
)
from sb3_gpu.common.cli import console as cli_console
from sb3_gpu.common.errors import ConfigError, named
from sb3_gpu.tuning import PRUNERS, SAMPLERS

# optuna, torch and SB3 are imported inside main, so that --help is quick and a Ctrl-C while they load is one line.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from sb3_gpu.tuning.study import TrialSettings

# Paths, URLs and commands: one line each whatever the terminal's width, printed as they are (a folder named
# "runs[b]" is no rich markup).
_PLAIN: dict[str, Any] = {"soft_wrap": True, "highlight": False, "markup": False}


def best_table(study: Any, top: int = 5) -> Table:
    """The study's ``top`` best trials for the terminal, in the columns of ``summary.md``'s table (which lists 10)."""
    from rich.table import Table

    from sb3_gpu.tuning.study import ranked_trials, seed_cells, state_counts

    threshold = study.user_attrs.get("threshold")
    table = Table(title=f"study {study.study_name}: {state_counts(study)}", title_justify="left")
    for column in ("trial", "score", "per seed" if threshold is None else "seconds to threshold, per seed", "params"):
        table.add_column(column)
    for t, params in ranked_trials(study, top):
        table.add_row(str(t.number), f"{t.value:.2f}", seed_cells(t, threshold), params)
    return table


def _seed_count(text: str) -> int:
    """``--seeds N``: a count (bench's --seeds lists seeds; here the first is --seed)."""
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected how many seeds each trial trains (a positive integer; the first seed is --seed), got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m sb3_gpu.tune", description="Tune a preset with optuna; share one storage across machines.")
    p.add_argument("algo", type=algo_arg, help=f"algorithm: {', '.join(ALGO_NAMES)}")
    p.add_argument(
        "--env", help="Gymnasium id or 'package.module:EnvClass' (default CartPole-v1; Pendulum-v1 for sac, td3, tqc)"
    )
    p.add_argument("--trials", type=positive_int, default=20, help="finished trials the study should reach (default 20)")
    p.add_argument("--storage", help="optuna storage URL shared by all workers (default: sqlite in the study dir)")
    p.add_argument("--study-name", help="default: ALGO-ENV")
    p.add_argument("--study-dir", help="results: preset, plots, default storage (default: tune/STUDY_NAME)")
    p.add_argument("--sampler", type=name_arg, choices=SAMPLERS, default="tpe", help="default tpe")
    p.add_argument("--sampler-seed", type=seed_int, help="seed of the sampler, for a study that draws the same trials")
    p.add_argument("--pruner", type=name_arg, choices=PRUNERS, default="median", help="default median")
    p.add_argument(
        "--seeds",
        type=_seed_count,
        default=1,
        help="how many seeds each trial trains, from --seed on; the score is their mean (default 1)",
    )
    p.add_argument(
        "--threshold",
        type=finite_float,
        help="score the time to this mean return instead of the final return: each seed trains until its best, "
        "confirmed on fresh episodes, reaches it, and scores minus its training seconds (a seed that never does ranks "
        "behind every seed that does)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="first seed (default 0)")
    p.add_argument("--timesteps", type=positive_int, help="timesteps per seed (default: the preset's)")
    p.add_argument("--eval-episodes", type=positive_int, default=10, help="episodes per evaluation (default 10)")
    p.add_argument(
        "--eval-freq",
        type=positive_int,
        help="evaluate (and maybe prune) every N timesteps (default: a fifth; a fiftieth with --threshold)",
    )
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    p.add_argument("--vec-env", type=name_arg, choices=VEC_ENV_KINDS, default="auto", help="default auto")
    p.add_argument(
        "--threads",
        type=threads_arg,
        help="torch CPU threads of each trial: auto (default) or N (a --threshold study scores seconds: give every "
        "worker the same)",
    )
    p.add_argument("--space", metavar="FILE", help="a search-space YAML (default: the bundled one for ALGO)")
    p.add_argument(
        "--heartbeat",
        type=positive_int,
        default=60,
        help="seconds; a silent worker's trial fails after 2x (RDB storages; default 60)",
    )
    return p


def settings_from_args(args: argparse.Namespace) -> TrialSettings:
    from sb3_gpu.tuning.study import TrialSettings

    return TrialSettings(
        algo=args.algo,
        env=args.env or default_env(args.algo),
        device=args.device,
        vec_env=args.vec_env,
        timesteps=args.timesteps,
        seeds=args.seeds,
        seed=args.seed,
        eval_episodes=args.eval_episodes,
        eval_freq=args.eval_freq,
        threshold=args.threshold,
        threads=args.threads,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seed + args.seeds > 2**32:  # each trial trains seeds --seed .. --seed + --seeds - 1, and numpy takes < 2**32
        last = args.seed + args.seeds - 1
        parser.error(f"--seed {args.seed} with --seeds {args.seeds} would train seed {last:,}; seeds stop at 2**32 - 1")
    args.env = args.env or default_env(args.algo)  # as settings_from_args() fills it in
    # SIGTERM (a preempted node, docker stop) stops the worker as Ctrl-C does, wherever it lands: while a trial plans
    # or builds its envs too, where its default action would end the process past optuna's marking the trial failed.
    with sigterm_as_interrupt():
        opened: list[Any] = []  # the storages _main makes: their connections are closed as it returns
        try:
            return _main(args, argv, opened)
        except KeyboardInterrupt as e:  # outside a trial: failing dead workers' trials, counting, writing the report
            print_error(f"{_stopped(e)}; run the same command to go on")
            return interrupted(_stop_code(e))
        finally:
            if opened:  # (a notebook calling main() again and again kept two handles on study.db per call)
                from sb3_gpu.tuning.storage import close_storage

                for storage in opened:
                    close_storage(storage)


def _stopped_in_trials(e: KeyboardInterrupt, url: str, heartbeat_s: int, name: str, started: list[int]) -> int:
    """Say that ``e`` stopped the worker and return its exit status, once the trials it started and stopped are marked
    failed (optuna's own record of it may have failed); a storage that cannot be reached now leaves them to the next
    worker's heartbeat or dead-worker check."""
    from sb3_gpu.tuning.storage import fail_left_running

    marked = "a running trial was marked failed"
    for wait in (0.5, 1.0, 2.0, None):  # a storage busy with another worker's (or this one's heartbeat's) write
        try:
            fail_left_running(url, heartbeat_s, name, started)
            break
        except (Exception, KeyboardInterrupt) as failure:
            if wait is None:
                marked = f"its running trial is left to the next worker's check (marking it failed: {named(failure)})"
                break
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(wait)
    print_error(f"{str(e) or _stopped(e)}; {marked}. Run the same command to go on")
    return interrupted(_stop_code(e))


def _stopped(e: KeyboardInterrupt) -> str:
    return "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"


def _stop_code(e: KeyboardInterrupt) -> int:
    """The exit status of a worker stopped by ``e``: 128 + the signal's number."""
    # A TrialInterrupted (sb3_gpu.tuning.study) says its signal; read by name, since the Ctrl-C at hand may have cut
    # that module's import short, and importing it again here could meet a second one.
    signal_name = getattr(e, "signal_name", None)
    if isinstance(signal_name, str):
        return 128 + int(signal.Signals[signal_name])
    return 128 + int(signal.SIGTERM) if isinstance(e, Terminated) else 130


def _main(args: argparse.Namespace, argv: Sequence[str] | None, opened: list[Any]) -> int:
    new_folder: Path | None = None  # a study dir this call made, removed again if the study cannot open
    try:
        from sb3_gpu.common.io import check_dir_creatable, check_utf8, make_dir, refuse_links
        from sb3_gpu.config.schema import get_algo
        from sb3_gpu.config.search import check_policy_kwargs_space, fit_to_budget, load_space
        from sb3_gpu.planning.plan import make_plan
        from sb3_gpu.tuning.storage import fail_dead_local_trials, import_optuna, journal_lock, make_storage, mask_url
        from sb3_gpu.tuning.study import finished_trials, make_objective, open_study, run_trials

        console = cli_console()
        optuna = import_optuna()
        # Before the plan, whose probe may take a minute.
        if args.study_name is not None and (
            not re.fullmatch(r"[A-Za-z0-9_.-]+", args.study_name) or set(args.study_name) == {"."}
        ):
            raise ConfigError(
                f"--study-name {args.study_name!r}: it names a folder under tune/; accepted: letters, digits, '_', '.', '-' "
                "(--study-dir chooses another folder)"
            )
        # A database server is reached before the plan, so that a wrong address is said at once, not after the probe
        # (a file storage is opened below, once the study dir it may lie in exists).
        remote = args.storage is not None and not args.storage.startswith(("sqlite:", "journal:"))
        given_storage = make_storage(args.storage, args.heartbeat) if remote else None
        opened.extend([given_storage] if given_storage is not None else [])
        threads = {} if args.threads is None else {"threads": args.threads}
        plan = make_plan(args.algo, args.env, args.device, n_timesteps=args.timesteps, vec_env=args.vec_env, overrides=threads)
        budget = plan.preset.n_timesteps
        if args.eval_freq is not None and args.eval_freq > budget and args.threshold is not None:
            raise ConfigError(
                f"--eval-freq {args.eval_freq:,} is above the {budget:,} timesteps of each seed: no evaluation could see "
                f"--threshold reached; give at most {budget:,} (default: a fiftieth of the run)"
            )
        loaded = load_space(args.algo, args.space)
        check_policy_kwargs_space(args.algo, plan.preset.policy, loaded, str(args.space or "the bundled space"))
        space, narrowed = fit_to_budget(
            loaded,
            plan.preset.n_timesteps,
            plan.preset.n_envs,
            get_algo(args.algo).on_policy,
            learning_starts=getattr(plan.preset.params, "learning_starts", None),
        )
        name = args.study_name or re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{args.algo}-{plan.env.name}")
        wanted = Path(args.study_dir or Path("tune") / name)
        new_folder = None if wanted.exists() else wanted
        check_utf8(wanted, "study dir")  # its summary names it: hours of trials, then no results
        folder = check_dir_creatable(make_dir(wanted, "study dir"), "study dir")  # hours of trials, then no results
        url = args.storage or f"sqlite:///{(folder / 'study.db').resolve()}"
        refuse_links(folder, "study dir", allowed=journal_lock(url))  # another worker may hold the journal's lock
        if (storage := given_storage) is None:
            storage = make_storage(url, args.heartbeat)
            opened.append(storage)
        study = open_study(
            name,
            storage,
            sampler=args.sampler,
            pruner=args.pruner,
            timesteps=plan.preset.n_timesteps,
            algo=args.algo,
            env=plan.env.name,
            space=space,
            where=mask_url(url),
            threshold=args.threshold,
            sampler_seed=args.sampler_seed,
            scoring={
                "--timesteps": plan.preset.n_timesteps,
                "--seeds": args.seeds,
                "--seed": args.seed,
                "--eval-episodes": args.eval_episodes,
                "--eval-freq": args.eval_freq,
            },
        )
    except ConfigError as e:
        _remove_if_empty(new_folder)
        print_error(str(e))
        return 2
    except KeyboardInterrupt as e:
        print_error(f"{_stopped(e)} before any trial began")
        return interrupted(_stop_code(e))
    except Exception as e:  # the env raising while the plan probes it, say: its traceback, then one line, as train does
        import traceback

        from sb3_gpu.common.errors import named
        from sb3_gpu.tuning.storage import mask_url

        _remove_if_empty(new_folder)
        trace, message = "".join(traceback.format_exception(e)), named(e)
        sys.stderr.write(mask_url(args.storage, trace) if args.storage else trace)
        print_error(mask_url(args.storage, message) if args.storage else message)
        return 1
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for note in narrowed:
        console.print(f"search space: {note}", **_PLAIN)
    if args.eval_freq is not None and args.eval_freq > plan.preset.n_timesteps:
        console.print(
            f"note: --eval-freq {args.eval_freq:,} is above the {plan.preset.n_timesteps:,} timesteps of each seed: no "
            "trial is evaluated before its end, so none is pruned",
            highlight=False,
            soft_wrap=True,  # one line, whatever the terminal's width
        )
    if url.startswith("journal:") and (dead := fail_dead_local_trials(study)):
        console.print(f"marked {dead} trial(s) of dead workers on this host as failed")
    done = finished_trials(study)
    console.print(f"study {name} in {mask_url(url)}: {done} of {args.trials} trials finished; this worker joins in", **_PLAIN)
    if done < args.trials:
        optuna.logging.set_verbosity(optuna.logging.INFO)
    for handler in logging.getLogger("optuna").handlers:
        handler.addFilter(_LogFilter(url))
    objective = make_objective(settings_from_args(args), space)
    started: list[int] = []  # this worker's trials, by number
    stops: list[KeyboardInterrupt] = []

    def worker_objective(trial: Any) -> Any:
        started.append(trial.number)
        try:
            return objective(trial)
        except KeyboardInterrupt as e:
            stops.append(e)
            raise

    try:
        run = run_trials(study, worker_objective, args.trials)
    except KeyboardInterrupt as e:  # SIGINT, SIGTERM or a second signal: optuna marked the running trial failed
        return _stopped_in_trials(e, url, args.heartbeat, name, started)
    except Exception as e:  # the storage failing between trials, say; its message may hold the URL
        if stops:
            # A signal stopped the trial, and optuna then failed to record it: the signal landed inside a storage
            # write (sampling a parameter, say) and left this worker's connection unusable.
            return _stopped_in_trials(stops[0], url, args.heartbeat, name, started)
        print_error(mask_url(url, f"the study stopped: {type(e).__name__}: {str(e).strip().splitlines()[0]}"))
        return 1
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        code = _report(study, args, argv, plan.env.name, folder, plan.preset.n_timesteps, console)
    except OSError as e:  # a full disk, say: the trials are safe in the storage, and the same command reports again
        print_error(f"cannot write the study's results into {folder}: {e.strerror or e}; its trials are in {mask_url(url)}")
        return 1
    if run.gave_up:  # last, below the results: why this worker ended short of --trials
        print_error(
            f"this worker stopped after {run.misses} trials in a row that failed or drew an invalid combination (the "
            f"lines above say why); the study has {finished_trials(study)} of {args.trials} trials finished"
        )
        return 1
    return code


def _remove_if_empty(folder: Path | None) -> None:
    """Remove the study dir this call made, where the study could not open in it."""
    if folder is not None and folder.is_dir() and not any(folder.iterdir()):
        with contextlib.suppress(OSError):  # another worker has just written into it: it stays, as theirs
            folder.rmdir()


class _LogFilter(logging.Filter):
    """What optuna logs, with the storage's password masked, and no traceback for a stop asked for by a signal."""

    def __init__(self, url: str):
        super().__init__()
        self.url = url

    def filter(self, record: logging.LogRecord) -> bool:
        from sb3_gpu.tuning.storage import mask_url

        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            record.exc_info = None  # a stop is no crash: its one line is enough
        if record.exc_info and not record.exc_text:
            record.exc_text = mask_url(self.url, logging.Formatter().formatException(record.exc_info))
        record.msg, record.args = mask_url(self.url, record.getMessage()), None
        return True


def _report(
    study: Any, args: argparse.Namespace, argv: Sequence[str], env: str, folder: Path, timesteps: int, console: Console
) -> int:
    from sb3_gpu.common.io import atomic_write_text
    from sb3_gpu.tuning.storage import import_optuna
    from sb3_gpu.tuning.study import export_preset, study_markdown, write_plots

    optuna = import_optuna()
    console.print(best_table(study))
    summary = atomic_write_text(folder / "summary.md", study_markdown(study, f"python -m sb3_gpu.tune {shlex.join(argv)}"))
    console.print(f"summary: {summary}", **_PLAIN)
    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        print_error("no trial completed, so there is no best preset to export")
        return 1
    preset = export_preset(study, args.algo, env, folder / "best_preset.yaml", timesteps)
    command = shell_line("-m", "sb3_gpu.train", args.algo, "--env", env, "--preset", preset)
    console.print(f"best preset: {preset}  ({command})", **_PLAIN)
    for note in write_plots(study, folder):
        console.print(f"plot: {note}", **_PLAIN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
