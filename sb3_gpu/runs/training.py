"""Training a plan into a run directory, and resuming one: what ``python -m sb3_gpu.train`` does, as library calls."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch as th
import yaml
from rich.console import Console
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.vec_env import VecEnv

from sb3_gpu.common.checks import bool_arg, count_arg, seconds_arg
from sb3_gpu.common.cli import shell_line
from sb3_gpu.common.errors import ConfigError, closest, named
from sb3_gpu.common.hardware import detect_hardware
from sb3_gpu.common.io import check_dir_creatable, make_dir, write_json, write_yaml
from sb3_gpu.config.presets import Preset
from sb3_gpu.config.runconfig import config_env, load_config
from sb3_gpu.config.schema import get_algo
from sb3_gpu.envs.build import close_vec_envs
from sb3_gpu.envs.spec import EnvSpec
from sb3_gpu.planning.build import build_env, build_model, offset_seed, resumed_seed
from sb3_gpu.planning.device import requested_device
from sb3_gpu.planning.plan import Plan, make_plan
from sb3_gpu.runs.callbacks import SaveVecNormalizeCallback
from sb3_gpu.runs.curves import plot_runs
from sb3_gpu.runs.evaluation import (
    EvaluationStopped,
    TimedEvalCallback,
    confirm_count,
    eval_envs,
    evaluate_run,
)
from sb3_gpu.runs.rundir import RunDir, SavedState, zip_saved_at
from sb3_gpu.runs.saving import HYPERPARAMETERS, hyperparameters_record, restore_model, restore_vecnormalize
from sb3_gpu.runs.session import Outcome, Session


@dataclass(frozen=True)
class RunOptions:
    """How a run evaluates and saves; kept in ``config.yaml`` so that ``--resume`` goes on the same way.

    :ivar eval_freq: evaluate every N timesteps (None: the preset's ``eval_freq``, else a tenth of the run)
    :ivar confirm_episodes: fresh episodes that confirm a new best before it is kept (None: three times
        ``eval_episodes``; 0: a periodic evaluation's best is kept as it is)
    :ivar checkpoint_freq: checkpoint every N timesteps (None: a fifth of the run)
    """

    eval_freq: int | None = None
    eval_episodes: int = 10
    checkpoint_freq: int | None = None
    save_replay_buffer: bool = False
    confirm_episodes: int | None = None

    def check(self, algo: str) -> None:
        """Refuse options that no run of ``algo`` can take (before the plan, whose probe may compile for a minute)."""
        for name in ("eval_freq", "eval_episodes", "checkpoint_freq", "confirm_episodes"):
            value = getattr(self, name)
            least, what = (0, "an int >= 0") if name == "confirm_episodes" else (1, "a positive int")
            if value is None and name == "eval_episodes":  # the one option without a default that None stands for
                raise ConfigError(f"eval_episodes must be {what}, got None")
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ConfigError(f"{name} must be {what}, got {value!r}")
        if not isinstance(self.save_replay_buffer, bool):
            raise ConfigError(f"save_replay_buffer must be true or false, got {self.save_replay_buffer!r}")
        algo_ = get_algo(algo)
        if self.save_replay_buffer and algo_.on_policy:
            name = algo_.name
            raise ConfigError(
                f"save_replay_buffer=True (--save-replay-buffer) is for off-policy algorithms (dqn, qrdqn, sac, td3, "
                f"tqc); {name} keeps no replay buffer"
            )

    @classmethod
    def from_config(cls, data: dict[str, Any], where: str) -> RunOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise ConfigError(f"{where}: unknown key 'run.{key}'{closest(str(key), names)}")
        return cls(**data)

    def frequencies(self, preset: Preset) -> tuple[int, int]:
        """Env steps between evaluations (these options', else the preset's ``eval_freq``, else a tenth of the run)
        and between checkpoints."""
        timesteps = preset.n_timesteps
        return self.eval_freq or preset.eval_freq or max(timesteps // 10, 1), self.checkpoint_freq or max(timesteps // 5, 1)

    def eval_every(self, preset: Preset) -> int:
        """Steps of the vec env between evaluations (SB3's EvalCallback counts those, each ``n_envs`` env steps)."""
        return max(self.frequencies(preset)[0] // preset.n_envs, 1)

    @property
    def confirming(self) -> int:
        """Episodes that confirm a new best (0: none)."""
        return confirm_count(self.eval_episodes) if self.confirm_episodes is None else self.confirm_episodes


def train_run(
    plan: Plan,
    run_dir: str | Path,
    *,
    eval_freq: int | None = None,
    eval_episodes: int = 10,
    confirm_episodes: int | None = None,
    checkpoint_freq: int | None = None,
    save_replay_buffer: bool = False,
    progress: bool = True,
    console: Console | None = None,
    report_s: float | None = 30.0,
) -> dict[str, Any]:
    """Train per the plan into ``run_dir`` (config, checkpoints, best and final model, TensorBoard, summary).

    SIGINT or SIGTERM stops training after the current step and saves everything (``summary["stopped_by"]``
    names the signal); a second one raises :class:`~sb3_gpu.common.errors.StopNow` (a KeyboardInterrupt) at once.
    An env error or a diverged loss saves the model (when its weights are finite) and re-raises, with a note saying
    where. Every file is written atomically.

    :param eval_freq: evaluate every N timesteps (default: the preset's ``eval_freq``, else a tenth of the run)
    :param confirm_episodes: a periodic evaluation that beats the best so far is evaluated again on this many fresh
        episodes, and becomes ``best_model.zip`` only if that mean beats the best's (default: 3x ``eval_episodes``;
        0: kept as it is)
    :param checkpoint_freq: checkpoint every N timesteps (default: a fifth of the run)
    :param save_replay_buffer: save the replay buffer (with PER priorities) with the model and each checkpoint
    :param report_s: print a throughput line every N seconds (None: never)
    :return: the summary, also written as ``summary.json``
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"train_run takes a Plan from make_plan(...), got {plan!r}")
    options = RunOptions(eval_freq, eval_episodes, checkpoint_freq, save_replay_buffer, confirm_episodes)
    options.check(plan.algo)
    output = _Output(progress, console, report_s)
    if (found := _python_object(plan.to_config()["hyperparameters"])) is not None:
        raise ConfigError(
            "train_run cannot save this plan: config.yaml holds plain data only (no classes or functions, so that a "
            f"resume never runs code a file names), and {found[0]} is {found[1]!r}; train it with "
            "build_model(plan, build_env(plan)).learn(...) instead"
        )
    if isinstance(run_dir, (str, os.PathLike)):  # make_dir refuses the rest
        check_dir_creatable(run_dir, "run dir", utf8=True)
    run = RunDir(make_dir(run_dir, "run dir"))
    # An empty folder may be made first (the CLI makes it, to claim its name); one that holds files is another run's.
    if held := sorted(p.name for p in run.path.iterdir()):
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(
            f"run dir {run} already holds {shown}; runs are never overwritten: give a new run_dir, or "
            f"resume_run({str(run)!r}) to continue it"
        )
    return _train(plan, run, options, None, output, plan.seed)


def resume_run(
    run_dir: str | Path,
    *,
    timesteps: int | None = None,
    save_replay_buffer: bool | None = None,
    device: str | th.device | None = None,
    progress: bool = True,
    console: Console | None = None,
    report_s: float | None = 30.0,
    env: str | Callable[[], gym.Env] | EnvSpec | None = None,
) -> dict[str, Any]:
    """Continue a run from its newest model or checkpoint, with its config, replay buffer, VecNormalize statistics
    and evaluation history, into the same TensorBoard run (schedules and exploration go on from the saved step).

    :param timesteps: the new total length (default: the run's own)
    :param save_replay_buffer: from now on save the replay buffer too (default: as the run did)
    :param device: where to train from now on (default: the run's own ``device``), with the run's hyperparameters:
        a run started on a GPU can go on on a CPU, and the other way round
    :param env: the env to train on (default: the one the run's config names); needed where the run trained on a
        factory given in Python, whose name the config cannot rebuild, or on ``package.module:EnvClass`` whose module
        lies inside the run dir (a name given must be the run's own)
    """
    count_arg(timesteps, "timesteps (the new total)", optional=True)
    output = _Output(progress, console, report_s)
    run = RunDir(run_dir)
    run.check_resumable()
    config = load_config(run.config)
    # module:EnvId names the config's id with the module that registers it (a run dir written before sb3_gpu kept it).
    if isinstance(env, str) and not config.env_factory and config.env not in (env, env.partition(":")[2]):
        raise ConfigError(
            f"--resume continues {run} on its own env {config.env!r}; --env (resume_run's env=) may only repeat that "
            f"name (to allow importing its module), not {env!r}"
        )
    options = RunOptions.from_config(config.run, config.path)
    skipped: list[str] = []
    states = run.saved_states(on_skip=skipped.append)
    if not states:
        why = f" ({skipped[0]})" if skipped else ""
        raise ConfigError(f"cannot resume {run}: it holds no readable model.zip or checkpoint to continue from{why}")
    for message in skipped:
        output.warn(message)
    state = states[0]
    total = timesteps if timesteps is not None else int(config.hyperparameters.get("n_timesteps", 0))
    if state.timesteps >= total:
        raise ConfigError(
            f"cannot resume {run}: it already trained {state.timesteps:,} of {total:,} timesteps; "
            f"pass --timesteps (resume_run's timesteps=) with a larger total to train on"
        )
    seed = resumed_seed(config.seed, state.timesteps)
    if save_replay_buffer is not None:
        options = dataclasses.replace(options, save_replay_buffer=save_replay_buffer)
    options.check(config.algo)
    if device is None and config.device.strip().lower() not in ("auto", "cpu"):  # a GPU this machine may lack
        try:
            requested_device(config.device, detect_hardware())
        except ConfigError as e:  # a run moved to another machine: say how to go on here
            raise ConfigError(
                f"cannot resume {run}: its config.yaml: {e}; give --device (resume_run's device=) for where it trains now"
            ) from None
    env = config_env(
        config,
        env,
        "pass it again: resume_run(run, env=the_factory)",
        "--env {env} (from Python: resume_run(run, env={env!r}))",
    )
    try:
        plan = make_plan(
            config.algo,
            env,
            config.device if device is None else device,
            vec_env=config.vec_env,
            seed=seed,
            config=config,
            n_timesteps=timesteps,
            override_source={"n_timesteps": "--timesteps (resume_run's timesteps=)"},
            steps_left=total - state.timesteps,
        )
    except ConfigError as e:  # most come from the config's values, which the user never typed: say where they are
        raise ConfigError(f"{e} (resuming from {config.path})") from None
    return _train(plan, run, options, state, output, config.seed)


@dataclass(frozen=True)
class _Output:
    """Where a run's progress goes: a bar and rich log lines on a console, or plain prints."""

    progress: bool
    console: Console | None
    report_s: float | None

    def __post_init__(self) -> None:
        bool_arg(self.progress, "progress")
        if self.console is not None and not isinstance(self.console, Console):
            raise ConfigError(f"console must be a rich Console or None, got {self.console!r}")
        seconds_arg(self.report_s, "report_s")

    def say(self, text: str) -> None:
        (self.console or Console()).print(text, highlight=False, markup=False)  # paths: "runs[b]" is no markup

    def warn(self, text: str) -> None:
        Console(stderr=True).print(f"warning: {text}", highlight=False, markup=False, soft_wrap=True)


def _set_retrained_episodes_aside(run: RunDir, state: SavedState, output: _Output) -> None:
    """Once a resume has its model back: the episodes that ended after that model was saved (a checkpoint, or the
    model.zip of a pass killed later) leave the curves, since the resumed run trains their steps again; they are kept
    beside them in ``*.dropped.csv``. After a plain stop none ended after the final save."""
    saved_at, by = zip_saved_at(state.model), ""
    if saved_at is None and state.model != run.final.model:  # a checkpoint of an older sb3_gpu: its file's time
        saved_at, by = state.model.stat().st_mtime, " (by the file's time: the zip records none)"
    moved = run.set_episodes_aside_after(saved_at) if saved_at is not None else 0
    if moved:
        output.say(
            f"{moved:,} episodes that ended after {state.model.name} was saved set aside{by} (trained again): "
            f"{run.monitor}/*.dropped.csv"
        )


def _train(
    plan: Plan, run: RunDir, options: RunOptions, state: SavedState | None, output: _Output, seed: int | None
) -> dict[str, Any]:
    # seed: the run's own, which config.yaml keeps; a resumed plan's is derived from it and the timesteps.
    with run.locked():
        if state is not None:
            # Read before the lock: a process that trained the run may have saved and finished since.
            newest = run.saved_states()
            if not newest or (newest[0].model, newest[0].timesteps) != (state.model, state.timesteps):
                raise ConfigError(f"{run} was saved by another sb3_gpu process as this resume began; run it again")
            run.set_monitor_files_aside()
        env: VecEnv = build_env(plan, monitor_dir=str(run.monitor))
        eval_env: VecEnv | None = None
        model: BaseAlgorithm | None = None
        try:
            eval_env = build_env(plan, evaluation=True, n_envs=eval_envs(options.eval_episodes))
            if state is None:
                model = build_model(plan, env, tensorboard_log=str(run.tensorboard))
            else:
                env = restore_vecnormalize(env, state, run)
                model = restore_model(plan, env, state, run, output.say)
                _set_retrained_episodes_aside(run, state, output)
            setattr(model, HYPERPARAMETERS, hyperparameters_record(plan))  # saved in each zip it writes
            _write_config(plan, run, options, env, seed)
            return _learn(plan, run, options, state, model, eval_env, output)
        finally:
            close_vec_envs(env, eval_env)
            # The run's model goes no further: its TensorBoard writer (a thread of its own) is closed, not left to
            # pile up with each run of a notebook.
            logger = getattr(model, "_logger", None)
            if logger is not None:
                with contextlib.suppress(OSError):  # a last flush to a full disk: the run's outcome is reported
                    logger.close()


def _python_object(value: Any, path: str = "") -> tuple[str, Any] | None:
    """The first value in ``value`` that YAML's plain data cannot hold (a class in policy_kwargs), with its key path."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        try:
            yaml.safe_dump(value)
        except yaml.YAMLError:
            return path, value
        return None
    for key, item in items:
        found = _python_object(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _write_config(plan: Plan, run: RunDir, options: RunOptions, env: VecEnv, seed: int | None) -> None:
    config = plan.to_config()
    config["seed"] = seed  # the run's own, not a resumed segment's
    config["run"] = dataclasses.asdict(options)
    config["resolved"]["vec_env_class"] = type(env.unwrapped).__name__  # after any fallback to DummyVecEnv
    write_yaml(run.config, config)


def _learn(
    plan: Plan,
    run: RunDir,
    options: RunOptions,
    state: SavedState | None,
    model: BaseAlgorithm,
    eval_env: VecEnv,
    output: _Output,
) -> dict[str, Any]:
    preset = plan.preset
    checkpoint_freq = options.frequencies(preset)[1]
    evaluator = TimedEvalCallback(
        eval_env,
        run_dir=run,
        n_eval_episodes=options.eval_episodes,
        confirm_episodes=options.confirming,
        eval_freq=options.eval_every(preset),
        callback_on_new_best=SaveVecNormalizeCallback(run.best_vecnormalize) if preset.normalize else None,
        verbose=0,
    )
    if state is not None and evaluator.restore_history(state.timesteps, model.n_envs):
        output.say(f"no evaluation is recorded at {state.timesteps:,} timesteps, where one is due: running it first")
    console = output.console or Console()
    session = Session(
        model,
        evaluator=evaluator,
        run_dir=run,
        checkpoint_freq=checkpoint_freq,
        save_replay_buffer=options.save_replay_buffer,
        progress=console if output.progress else None,
        report_s=output.report_s,
        print_fn=console.log if output.progress else print,
    )
    # Everything below runs inside the session: a second signal during the saves aborts them, and atomic writes
    # keep the old files.
    failed: Exception | None = None  # an env that crashed in the final evaluation, raised once the summary is written
    with session:
        outcome = session.learn(preset.n_timesteps - model.num_timesteps, reset_num_timesteps=state is None)
        summary = _summary(plan, model, outcome)
        if not outcome.interrupted:
            try:
                mean, std = session.evaluate(options.eval_episodes)
            except EvaluationStopped:  # training is complete and saved: only the final evaluation is missing
                summary.update(interrupted=True, stopped_by=session.stopped_by)
                summary["saved"] = (
                    f"{outcome.saved}; training was complete and its final evaluation was stopped "
                    f"(to evaluate: {shell_line('-m', 'sb3_gpu.evaluate', run)})"
                )
            except Exception as e:
                failed = e
                summary["saved"] = f"{outcome.saved}; training was complete and its final evaluation failed ({named(e)})"
            else:
                summary.update(final_eval_mean=mean, final_eval_std=std, eval_episodes=options.eval_episodes)
                if not _check_best(plan, run, evaluator, options.confirming, session):
                    summary.update(interrupted=True, stopped_by=session.stopped_by)
                    summary["saved"] = (
                        f"{outcome.saved}; training and its final evaluation were complete, and the check of the best "
                        "model after them was stopped (the best keeps the figure it was chosen by)"
                    )
        summary["best_eval_mean"] = evaluator.best.figure[0] if evaluator.best is not None else None
        if evaluator.best is not None:
            summary["best"] = {**dataclasses.asdict(evaluator.best), "chosen": evaluator.best.describe()}
        if run.best_model.exists():
            summary["best_model"] = str(run.best_model)
        summary["curves"] = _draw_curves(plan, run)
        try:
            write_json(run.summary, summary)
        except OSError as e:  # a full disk: where the model went (and what failed before) is still said
            if hasattr(e, "add_note"):
                e.add_note(str(summary["saved"]))
            raise
    if failed is not None:
        raise failed
    if outcome.error is not None:
        if hasattr(outcome.error, "add_note"):  # Python 3.11+; summary.json says the same on 3.10
            outcome.error.add_note(str(outcome.saved))
        raise outcome.error
    return summary


# The check after training starts from seeds that neither the periodic evaluations nor the confirmations used.
CHECK_SEED_OFFSET = 20_000


def _check_best(plan: Plan, run: RunDir, evaluator: TimedEvalCallback, episodes: int, session: Session) -> bool:
    """Evaluate the confirmed best model once more, on fresh episodes, and record that figure with it; False where a
    signal stopped the check (the best then keeps the figure it was chosen by).

    The confirmed mean chose the best among several candidates, so it leans high, and more so the noisier the returns;
    a figure taken after the choice is what ``evaluate`` will see."""
    best = evaluator.best
    if best is None or not best.confirmed or not episodes or not run.best_model.is_file():
        return True
    if session.stopping():
        return False
    seed = offset_seed(plan.seed, CHECK_SEED_OFFSET)
    try:
        checked = evaluate_run(
            run.best_model, episodes, device=plan.device.device, seed=seed, should_stop=session.stopping, env=plan.env
        )
    except EvaluationStopped:
        return False
    except Exception as error:  # training and its saves are done: a failed check must not cost the summary
        print(f"warning: the best model was not checked after training ({type(error).__name__}: {error})", file=sys.stderr)
        return True
    evaluator.best = dataclasses.replace(
        best, checked_mean=checked["mean"], checked_std=checked["std"], checked_episodes=episodes
    )
    write_json(run.best_record, dataclasses.asdict(evaluator.best))
    return True


def _summary(plan: Plan, model: BaseAlgorithm, outcome: Outcome) -> dict[str, Any]:
    env = model.get_env()
    return {
        "algo": plan.algo,
        "env": plan.env.name,
        "device": plan.device.device,
        "vec_env": type(env.unwrapped).__name__ if env is not None else None,
        "timesteps": outcome.timesteps,
        "steps": outcome.steps,  # this pass's: fewer than timesteps after a resume
        "wall_time_s": round(outcome.wall_s, 2),
        "steps_per_s": round(outcome.steps_per_s, 1) if outcome.steps_per_s is not None else None,
        "interrupted": outcome.interrupted,
        "stopped_by": outcome.stopped_by,
        "error": f"{type(outcome.error).__name__}: {outcome.error}" if outcome.error is not None else None,
        "saved": outcome.saved,
        "model": str(outcome.model_path) if outcome.model_path is not None else None,
        "throughput": outcome.throughput,
    }


def _draw_curves(plan: Plan, run: RunDir) -> str:
    try:
        return str(plot_runs([run], run.curves, labels=[f"{plan.algo} {plan.env.name}"]))
    except Exception as e:  # matplotlib is an optional extra; a picture must never cost the run its summary
        return f"not drawn: {e}"
