"""``python -m sb3_gpu.train ALGO --env ID --device auto``: plan, print the plan, train, save, summarise."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sb3_gpu import __version__
from sb3_gpu.common.checks import ALGO_NAMES, AMP_MODES, COMPILE_MODES, VEC_ENV_KINDS, default_env
from sb3_gpu.common.cli import (
    OUTPUT_CLOSED,
    Parser,
    Terminated,
    algo_arg,
    count_int,
    interrupted,
    name_arg,
    positive_int,
    print_error,
    seed_int,
    shell_line,
    sigterm_as_interrupt,
    threads_arg,
    watched,
)
from sb3_gpu.common.cli import console as cli_console
from sb3_gpu.common.errors import ConfigError, EnvWorkerError, StopNow, TrainingDiverged, named
from sb3_gpu.common.io import out_of_space

# Torch, SB3 and rich are imported inside main (below), so that --help is quick and a Ctrl-C while they load is
# answered in one line, not a traceback.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from sb3_gpu.config.runconfig import RunConfig
    from sb3_gpu.planning.plan import Plan
    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.runs.training import RunOptions


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m sb3_gpu.train", description="Train an SB3 model with presets that fit this machine.")
    p.add_argument(
        "algo", nargs="?", type=algo_arg, help=f"algorithm: {', '.join(ALGO_NAMES)} (taken from --config if omitted)"
    )
    p.add_argument(
        "--env",
        help="Gymnasium id or 'package.module:EnvClass' (a gymnasium.Env) (default CartPole-v1; Pendulum-v1 for sac, "
        "td3, tqc)",
    )
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N or mps")
    p.add_argument("--timesteps", type=positive_int, help="training length (default: the preset's n_timesteps)")
    p.add_argument("--n-envs", type=positive_int, help="number of parallel envs (default: the preset's)")
    p.add_argument(
        "--vec-env",
        type=name_arg,
        choices=VEC_ENV_KINDS,
        default=None,
        help="auto (default), dummy, subproc (SB3's), batched or envpool",
    )
    p.add_argument("--seed", type=seed_int, default=None, help="random seed (default: none)")
    p.add_argument(
        "--preset",
        metavar="FILE",
        help="a preset YAML file to use instead of the bundled one; zoo:ppo (zoo:dqn, zoo:sac, ...) for an installed "
        "rl_zoo3's tuned values, zoo:PATH.yml for an rl-zoo3 file",
    )
    p.add_argument(
        "--profile",
        type=name_arg,
        default="auto",
        help="preset profile: auto (default; cpu or gpu by device), cpu, gpu or large",
    )
    p.add_argument(
        "--per",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prioritized replay on/off for dqn and qrdqn (default: the preset's)",
    )
    p.add_argument(
        "--amp", type=name_arg, choices=AMP_MODES, help="mixed precision: auto (the plan says why), off, bf16, fp16 (CUDA)"
    )
    p.add_argument(
        "--compile",
        type=name_arg,
        choices=(*COMPILE_MODES, "true", "on", "off"),
        help="torch.compile the gradient step and policy: auto (default: on CUDA or the CPU where the probe times it "
        "faster and the run earns its compile time back), false (or off), true (or on: the default mode) or a "
        "torch.compile mode",
    )
    p.add_argument("--threads", type=threads_arg, help="torch CPU threads: auto (default; chosen by policy size) or N")
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="decide auto device, amp and threads by the fixed rules, without timing the policy, and leave an auto "
        "compile off (preset key probe)",
    )
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], help="override a preset key (repeatable)")
    p.add_argument("--config", metavar="CONFIG", help="repeat a run: its run_dir/config.yaml (or the run dir)")
    p.add_argument("--run-dir", help="where to write the run (default: runs/ALGO-ENV-TIMESTAMP); must not exist")
    p.add_argument(
        "--eval-freq",
        type=positive_int,
        help="evaluate every N timesteps (default: the preset's eval_freq, else a tenth of the run)",
    )
    p.add_argument("--eval-episodes", type=positive_int, help="episodes per evaluation (default 10)")
    p.add_argument(
        "--confirm-episodes",
        type=count_int,
        help="fresh episodes that confirm a new best before it replaces best_model.zip (default: 3x --eval-episodes; "
        "0 keeps the periodic evaluation's best as it is)",
    )
    p.add_argument("--checkpoint-freq", type=positive_int, help="checkpoint every N timesteps (default: a fifth of the run)")
    p.add_argument(
        "--save-replay-buffer",
        action=argparse.BooleanOptionalAction,
        help="off-policy algorithms: save the replay buffer (and PER priorities) with the model and checkpoints, for "
        "--resume (default: as a replayed or resumed run did, else not)",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run from its newest model or checkpoint (with --timesteps: a new total; with "
        "--device: on another device)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plan", action="store_true", help="print the plan and exit without training")
    p.add_argument("--version", action="version", version=f"sb3_gpu {__version__}")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Turn parsed arguments (and a --config file) into a Plan; the CLI's only decision logic is which wins."""
    from sb3_gpu.config.presets import parse_override
    from sb3_gpu.config.runconfig import load_config

    # --per first, so that --set per.alpha=... refines it rather than being replaced by it. Each override's source
    # is the flag that set it, for the plan table; a key set by a flag and by --set is refused (argparse keeps no
    # order between them, so "the last one wins" could not be kept).
    overrides: dict[str, Any] = {} if args.per is None else {"per": args.per}
    overrides.update({k: v for k in ("amp", "compile", "threads", "eval_freq") if (v := getattr(args, k)) is not None})
    if args.no_probe:
        overrides["probe"] = False
    flags = {"probe": "--no-probe", "per": "--per" if args.per else "--no-per", "eval_freq": "--eval-freq"}
    sources = {key: flags.get(key, f"--{key}") for key in overrides}
    flagged = {**sources, "n_envs": args.n_envs and "--n-envs", "n_timesteps": args.timesteps and "--timesteps"}
    for item in args.set:
        key, value = parse_override(item)
        if flagged.get(key):
            raise ConfigError(f"{flagged[key]} and --set {key} both set {key}; give one")
        if sources.get(key) == "--set":  # which of two should win is a guess: refused, as a flag beside --set is
            raise ConfigError(f"--set {key} is given twice ({overrides[key]!r}, then {value!r}); give one")
        if args.per is False and key.startswith("per."):  # a PER value would turn PER back on
            raise ConfigError(f"--no-per turns prioritized replay off, and --set {key} sets one of its values; give one")
        overrides[key], sources[key] = value, "--set"
    values_of_per = sorted(key for key in overrides if key.startswith("per."))
    if overrides.get("per") is False and values_of_per:  # a PER value would turn PER back on, as with --no-per
        raise ConfigError(
            f"--set per=false turns prioritized replay off, and --set {values_of_per[0]} sets one of its values; give one"
        )
    config = load_config(args.config) if args.config else None
    if config is not None and args.preset:
        raise ConfigError("--config and --preset both give hyperparameters; use one (add --set to change a value)")
    if config is not None and args.profile.strip().lower() != "auto":
        raise ConfigError(
            f"--config replays its run's own hyperparameters, and --profile {args.profile} picks a preset's; leave "
            "--profile out (add --set to change a value)"
        )
    if config is not None and args.algo and args.algo != config.algo:
        raise ConfigError(f"algorithm {args.algo!r} differs from the config's {config.algo!r}; leave it out to replay")
    algo = args.algo or (config.algo if config else None)
    if algo is None:
        raise ConfigError(f"give an algorithm ({', '.join(ALGO_NAMES)}) or --config RUN_DIR/config.yaml")
    try:
        return _make_plan(args, algo, config, overrides, sources)
    except ConfigError as e:
        if config is None:
            raise
        raise ConfigError(f"{e} (replaying {config.path})") from None


# A run trained on a factory from Python is replayed where the factory is: Python.
_FACTORY_REPLAY = "give --env to replay it on a registered env, or from Python: make_plan(algo, the_factory, config=...)"


def _make_plan(
    args: argparse.Namespace, algo: str, config: RunConfig | None, overrides: dict[str, Any], sources: dict[str, str]
) -> Plan:
    from sb3_gpu.config.runconfig import config_env
    from sb3_gpu.planning.plan import make_plan

    return make_plan(
        algo,
        args.env or (config_env(config, None, _FACTORY_REPLAY, "--env {env}") if config else default_env(algo)),
        args.device or (config.device if config else "auto"),
        n_envs=args.n_envs,
        n_timesteps=args.timesteps,
        vec_env=args.vec_env or (config.vec_env if config else "auto"),
        seed=args.seed if args.seed is not None else (config.seed if config else None),
        preset=args.preset,
        profile=args.profile,
        overrides=overrides,
        override_source={"n_envs": "--n-envs", "n_timesteps": "--timesteps", **sources},
        config=config,
    )


def summary_table(summary: dict[str, Any], run: RunDir) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="sb3_gpu summary", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    stopped = f" (stopped by {summary['stopped_by']})" if summary.get("stopped_by") else ""
    # A resumed run's wall time and speeds are its last pass's, which the telemetry measured from the resume.
    steps = summary.get("steps", summary["timesteps"])
    resumed = steps < summary["timesteps"]
    whole = "since the resume" if resumed else "over the whole run"
    rows = [
        ("timesteps", f"{summary['timesteps']:,}{stopped}"),
        ("wall time", f"{summary['wall_time_s']:.1f} s" + (f" ({steps:,} steps since the resume)" if resumed else "")),
    ]
    if "final_eval_mean" in summary:
        rows.append(
            (
                "final eval",
                f"model.zip: {summary['final_eval_mean']:.2f} +/- {summary['final_eval_std']:.2f} "
                f"({summary['eval_episodes']} episodes, deterministic)",
            )
        )
    if summary.get("best") is not None:
        rows.append(("best eval", f"best_model.zip: {summary['best']['chosen']}"))
    tp = summary.get("throughput") or {}
    speed = f"{summary['steps_per_s']:,.0f} env steps/s {whole}" if summary.get("steps_per_s") else "-"
    if "env_steps_per_s" in tp:
        # The telemetry's window (30 s) leaves out the first seconds, and a short run is measured whole.
        if "window_s" in tp:
            span = whole if tp.get("window_whole") else f"over the last {tp['window_s']:,.0f} s"
        else:  # a summary written before the telemetry said its window
            wall = summary["wall_time_s"]
            span = "over the last 30 s" if wall >= 35 else "after the first 5 s" if wall >= 10 else whole
        now = f"{tp['env_steps_per_s']:,.0f} env steps/s {span}"
        speed = now if span == whole or speed == "-" else f"{speed}, {now}"
        speed += f"; {tp['episodes_per_s']:.1f} episodes/s"
    rows.append(("speed", speed))
    if "share_env" in tp:
        from sb3_gpu.runs.telemetry import SHARES

        split = ", ".join(f"{name} {tp['share_' + name]:.0%}" for name in SHARES)
        rows.append(("time split", split))
    rows += [("run dir", str(run)), ("model", summary["model"] or "not saved (NaN weights)")]
    if "best_model" in summary:
        rows.append(("best model", summary["best_model"]))
    if summary.get("curves"):
        rows.append(("curves", summary["curves"]))
    for row in rows:
        # Plain text (rich would read "[plot]" in a value as markup), folded rather than cut: paths are to be copied.
        table.add_row(*(Text(cell, overflow="fold") for cell in row))
    return table


def run_options(args: argparse.Namespace) -> RunOptions:
    """How a new run evaluates and saves: each flag given, else the replayed config's ``run:`` options, else the
    defaults. The interval is the preset key ``eval_freq`` (``--eval-freq`` sets it), which the plan shows."""
    from sb3_gpu.config.runconfig import load_config
    from sb3_gpu.runs.training import RunOptions

    options, replaying = RunOptions(), None
    if args.config:
        config = load_config(args.config)
        options, replaying = RunOptions.from_config(config.run, config.path), config.path
    given = {k: v for k in ("eval_episodes", "confirm_episodes", "checkpoint_freq") if (v := getattr(args, k)) is not None}
    if args.save_replay_buffer is not None:
        given["save_replay_buffer"] = args.save_replay_buffer
    options = dataclasses.replace(options, **given)
    algo = config.algo if args.config else args.algo
    if algo is None:
        return options  # plan_from_args says what is missing
    try:
        options.check(algo)
    except ConfigError as e:
        if replaying is None:
            raise
        raise ConfigError(f"{e} (replaying {replaying})") from None
    return options


def evaluation_line(plan: Plan, options: RunOptions) -> str:
    """What evaluating will cost, in the plan's terms: how often, how many episodes, on how many envs, how long each
    episode may run, and how the best model is chosen."""
    from sb3_gpu.runs.evaluation import eval_envs

    preset = plan.preset
    episodes = options.eval_episodes
    every = preset.n_envs * options.eval_every(preset)
    source = preset.sources.get("eval_freq", "preset")
    if preset.eval_freq is not None:  # run_options leaves RunOptions.eval_freq unset: the preset key is the interval
        chosen_by = source if source.startswith(("--eval-freq", "run.eval_freq")) else f"eval_freq, {source}"
    else:
        chosen_by = "a tenth of the run"
    asked = options.frequencies(preset)[0]
    if asked != every and chosen_by != "a tenth of the run":  # the callback counts steps of the vec env
        chosen_by += f", {asked:,} rounded to whole steps of {preset.n_envs} envs"
    times = preset.timesteps_trained // every  # PPO runs whole rollouts, and evaluates within the last one too
    bound = f"each cut at {plan.eval_step_cap:,} steps" if plan.eval_step_cap else plan.eval_step_cap_reason
    confirming = options.confirming
    best = (
        f"A periodic evaluation that beats the best so far is confirmed on {confirming} fresh episodes, and its model "
        "becomes best_model.zip only if their mean beats the best's own confirmed mean; after training it is evaluated "
        f"once more on {confirming} fresh episodes, the figure reported (the best of several confirmations leans high)."
        if confirming
        else "The best periodic evaluation's model is best_model.zip (--confirm-episodes 0: not confirmed)."
    )
    if times == 0:  # an interval longer than the run (a preset's eval_freq beside a short --timesteps, say)
        best = "No periodic evaluation falls within the run, so it names no best_model.zip: lower the interval."
    return (
        f"evaluation: every {every:,} env steps ({chosen_by}; {times:,} times) and at the end, "
        f"{episodes} deterministic episodes on {eval_envs(episodes)} envs at once (one batched inference per step); "
        f"{bound}. {best} The summary's time split shows the share of evaluation."
    )


def next_commands(run: RunDir, env: str | None = None, trained: int | None = None) -> list[str]:
    """What to run next, one command a line, each runnable as printed (outside the table, so never wrapped); no
    video for an env whose class says it cannot render frames; where the run finished its ``trained`` timesteps, how
    to train it on."""
    from sb3_gpu.envs.spec import declares_render_mode

    watch = [f"watch it:  {shell_line('-m', 'sb3_gpu.evaluate', run, '--video')}"]
    resume = ("-m", "sb3_gpu.train", "--resume", run, "--timesteps", 2 * trained) if trained else ()
    more = [f"train on:  {shell_line(*resume)}   (a new total)"] if trained else []
    return [
        *(watch if env is None or declares_render_mode(env) is not False else []),
        f"replay it: {shell_line('-m', 'sb3_gpu.train', '--config', run.config)}   (a new run, from scratch)",
        *more,
        f"dashboard: {shell_line('--logdir', run.tensorboard, program='tensorboard')}   (the Custom Scalars tab)",
    ]


# With --resume the run's config.yaml decides everything but these.
_RESUME_FLAGS = {"resume", "timesteps", "save_replay_buffer", "device", "no_progress", "env"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: RunDir | None = None  # once known, for the messages below
    started = time.time()
    try:
        with sigterm_as_interrupt():  # before training (planning, a compile, loading a buffer) as Ctrl-C
            from sb3_gpu.runs.rundir import RunDir  # light: a resume knows its run before torch is imported

            if args.resume is not None:
                run = RunDir(args.resume)
                run.check_resumable()  # first: a flag that --resume refuses is beside the point for a missing run
                _check_resume_flags(parser, args, run)
            from sb3_gpu.planning.table import plan_table
            from sb3_gpu.runs.training import resume_run

            console = cli_console()
            if run is not None:  # --resume
                summary = resume_run(
                    run.path,
                    timesteps=args.timesteps,
                    save_replay_buffer=args.save_replay_buffer,
                    device=args.device,
                    progress=_progress_bar(args, console),
                    console=console,
                    env=args.env,
                )
            else:
                if args.run_dir is not None:  # before the plan, whose probe may take a minute
                    RunDir.check_new(args.run_dir)
                elif not args.plan:
                    try:
                        RunDir.check_default()
                    except ConfigError as e:
                        raise ConfigError(f"{e}; give --run-dir for another place") from None
                options = run_options(args)  # first: the plan's probe may compile for a minute
                plan = plan_from_args(args)
                console.print(plan_table(plan, console.width))
                console.print(evaluation_line(plan, options), highlight=False, markup=False)
                if args.plan:
                    return 0
                run = RunDir.create(args.run_dir, plan.algo, plan.env.name)
                summary = _train_new(plan, run, options, _progress_bar(args, console), console)
    except ConfigError as e:
        print_error(str(e))
        return 2
    except StopNow as e:
        return _stopped_at_once(run, new=args.resume is None, code=128 + e.signum)
    except KeyboardInterrupt as e:  # outside the session's signal handlers: planning or building envs, say
        _remove_if_empty(run, new=args.resume is None)
        if run is not None and _written_since(run.summary, started):  # after training: closing the envs, say
            what = f"; {_saved_note(run, started)}"
        elif args.resume is not None:  # run is None where the signal came before the run dir was read
            last = run.last_good() if run is not None else f"{args.resume} is as it was"
            what = f" before training resumed; nothing new was saved, {last}"
        else:
            what = " before training began; nothing was saved"
        if isinstance(e, Terminated):
            print_error(f"stopped by SIGTERM{what}")
            return interrupted(128 + signal.SIGTERM)
        print_error(f"interrupted{what}")
        return interrupted()
    except (EnvWorkerError, TrainingDiverged) as e:
        cause = e.__cause__
        if isinstance(e, EnvWorkerError) and cause is not None and not out_of_space(cause):  # an env in this process:
            traceback.print_exception(cause)  # the trace of its code (none for its Monitor's write on a full disk)
        _remove_if_never_trained(run, new=args.resume is None, started=started)
        print_error(str(e).splitlines()[0])
        print_error(_saved_note(run, started))
        return 1
    except OSError as e:  # a full or read-only disk while saving: the atomic writes kept the earlier files whole
        _remove_if_never_trained(run, new=args.resume is None, started=started)
        if isinstance(e, BrokenPipeError) and e.filename is None:  # `| head`, a pager that quit: its reader is gone
            print_error(f"stopped: {OUTPUT_CLOSED}")
        else:
            print_error(f"could not write {e.filename or 'a file'}: {e.strerror or e}")
        notes = getattr(e, "__notes__", None)  # what the save said, where summary.json could not say it
        print_error(notes[-1] if notes else _saved_note(run, started))
        return 1
    except Exception as e:
        # An unexpected error: its traceback matters, less the note of where the model went, said once below.
        saved = _saved_note(run, started)
        with contextlib.suppress(AttributeError):
            e.__notes__ = [note for note in e.__notes__ if note != saved]  # type: ignore[attr-defined]
        traceback.print_exception(e)
        _remove_if_never_trained(run, new=args.resume is None, started=started)
        print_error(named(e))
        print_error(_saved_note(run, started))
        return 1
    assert run is not None
    console.print(summary_table(summary, run))
    trained = summary["timesteps"] if summary["stopped_by"] is None else None  # a stopped run says how to go on
    for line in next_commands(run, summary.get("env"), trained):
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    if summary["stopped_by"] is not None:
        print_error(f"stopped by {summary['stopped_by']}: {summary['saved']}")
        return 128 + int(signal.Signals[summary["stopped_by"]])
    return 0


def _progress_bar(args: argparse.Namespace, console: Console) -> bool:
    """A live progress bar where a person watches (a terminal, a notebook); in a log file (CI, nohup, a cluster's job
    log) its redraws would be cut and repeated, so there the run prints plain status lines instead."""
    return not args.no_progress and watched(console)


def _check_resume_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, run: RunDir) -> None:
    fixed = [k for k, v in vars(args).items() if k not in _RESUME_FLAGS and v != parser.get_default(k)]
    if fixed:
        flag = "--" + fixed[0].replace("_", "-") if fixed[0] != "algo" else f"the algorithm {args.algo!r}"
        raise ConfigError(
            f"--resume continues {run} with its own config.yaml, so {flag} cannot be given; "
            "accepted with --resume: --timesteps (a new total), --[no-]save-replay-buffer, --device (where it trains now), "
            "--env (the run's own, to confirm the import of its module), --no-progress"
        )


def _train_new(plan: Plan, run: RunDir, options: RunOptions, progress: bool, console: Console) -> dict[str, Any]:
    from sb3_gpu.runs.training import train_run

    try:
        return train_run(plan, run.path, **dataclasses.asdict(options), progress=progress, console=console)
    except ConfigError:  # refused before training began
        _remove_if_empty(run, new=True)
        raise


def _stopped_at_once(run: RunDir | None, *, new: bool, code: int) -> int:
    states = run.saved_states() if run is not None else []
    if not states:
        _remove_if_empty(run, new=new)
        if run is not None and run.best_model.exists():
            print_error(f"stopped at once by a second signal; the best model so far is {run.best_model}")
            print_error(f"to evaluate it: {shell_line('-m', 'sb3_gpu.evaluate', run)}")
        else:
            print_error("stopped at once by a second signal before any model was saved; nothing was kept")
        return interrupted(code)
    assert run is not None
    print_error(f"stopped at once by a second signal; nothing more was saved, the last good model is {states[0].model}")
    if _trained_to_the_end(run, states[0].timesteps):
        print_error(f"training was complete; to evaluate: {shell_line('-m', 'sb3_gpu.evaluate', run)}")
    else:
        print_error(
            f"continue with: {shell_line('-m', 'sb3_gpu.train', '--resume', run)} ({states[0].timesteps:,} timesteps done)"
        )
    return interrupted(code)


def _trained_to_the_end(run: RunDir, timesteps: int) -> bool:
    """Whether a model of ``timesteps`` completes the run (then --resume has nothing to continue)."""
    from sb3_gpu.config.runconfig import load_config

    try:
        return timesteps >= int(load_config(run.config).hyperparameters["n_timesteps"])
    except (ConfigError, KeyError):
        return False


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def _remove_if_empty(run: RunDir | None, *, new: bool) -> None:
    """A new run dir that holds no model is removed: it cannot be resumed, and keeping it would make the same
    --run-dir "already exist" on the next try."""
    if run is not None and new and not run.saved_states() and not run.best_model.exists():
        shutil.rmtree(run.path, ignore_errors=True)


def _remove_if_never_trained(run: RunDir | None, *, new: bool, started: float) -> None:
    """After an error: a new run dir whose training never began is removed as an empty one is; one that trained keeps
    its logs for a look at what went wrong (a run that diverged before its first save). Training began where it wrote
    a summary or TensorBoard logs: on a full disk the summary may be what failed."""
    if run is None or _written_since(run.summary, started):
        return
    with contextlib.suppress(OSError):
        if any(_written_since(path, started) for path in run.tensorboard.rglob("events.out.tfevents.*")):
            return
    _remove_if_empty(run, new=new)


def _saved_note(run: RunDir | None, started: float) -> str:
    """What the emergency save wrote, as this process recorded it in summary.json (a resumed run's file may be the
    last part's); else what the run dir holds."""
    if run is None or not run.path.is_dir():
        return "no model was saved"
    if not _written_since(run.summary, started):
        return run.last_good()
    try:
        return str(json.loads(run.summary.read_text(encoding="utf-8"))["saved"])
    except (OSError, ValueError, KeyError):
        return run.last_good()


if __name__ == "__main__":
    sys.exit(main())
