"""Training a plan into a run directory: what ``python -m sb3_gpu.train`` does, as a library call."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import SubprocVecEnv, VecEnv, VecNormalize, sync_envs_normalization

from sb3_gpu._io import write_json, write_yaml
from sb3_gpu.callbacks import AtomicCheckpointCallback, NanGuard, ProgressCallback, SaveVecNormalizeCallback, StopOnSignal
from sb3_gpu.checkpoint import (
    SavedState,
    first_non_finite,
    load_plan_model,
    restore_model,
    restore_vecnormalize,
    run_dir_lock,
    save_state,
    saved_states,
    set_monitor_files_aside,
)
from sb3_gpu.errors import ConfigError, EnvWorkerError, StopNow, closest
from sb3_gpu.plan import Plan, build_env, build_model, load_config, make_plan
from sb3_gpu.presets import get_algo
from sb3_gpu.telemetry import ThroughputCallback, TimedEvalCallback


def new_run_dir(requested: str | None, plan: Plan) -> Path:
    """Create the run dir; an existing one is never reused, so no run overwrites another."""
    if requested is not None:
        path = Path(requested)
        if path.exists():
            raise ConfigError(f"run dir {path} already exists; choose a new --run-dir (runs are never overwritten)")
        path.mkdir(parents=True)
        return path
    env = re.sub(r"[^A-Za-z0-9_.-]+", "_", plan.env.name)
    base = Path("runs") / f"{plan.algo}-{env}-{datetime.now():%Y%m%d-%H%M%S}"
    for i in range(1, 1000):
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"could not find a free run dir name beside {base}")  # pragma: no cover


def train_run(
    plan: Plan,
    run_dir: str | Path,
    *,
    eval_freq: int | None = None,
    eval_episodes: int = 10,
    checkpoint_freq: int | None = None,
    save_replay_buffer: bool = False,
    progress: bool = True,
    console: Console | None = None,
    report_s: float | None = 30.0,
) -> dict[str, Any]:
    """Train per the plan into ``run_dir`` (config, checkpoints, best and final model, TensorBoard, summary).

    SIGINT or SIGTERM stops training after the current step and saves everything (``summary["stopped_by"]``
    names the signal); a second one raises :class:`StopNow` (a KeyboardInterrupt) at once. An env error or a
    diverged loss saves the model (when its weights are finite) and re-raises, with a note saying where. Every
    file is written atomically.

    :param eval_freq: evaluate every N timesteps (default: a tenth of the run)
    :param checkpoint_freq: checkpoint every N timesteps (default: a fifth of the run)
    :param save_replay_buffer: save the replay buffer (with PER priorities) with the model and each checkpoint
    :param report_s: print a throughput line every N seconds (None: never)
    :return: the summary, also written as ``summary.json``
    """
    options = RunOptions(eval_freq, eval_episodes, checkpoint_freq, save_replay_buffer)
    options.check(plan)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return _train(plan, run_dir, options, None, progress, console, report_s)


def resume_run(
    run_dir: str | Path,
    *,
    timesteps: int | None = None,
    save_replay_buffer: bool | None = None,
    progress: bool = True,
    console: Console | None = None,
    report_s: float | None = 30.0,
) -> dict[str, Any]:
    """Continue a run from its newest model or checkpoint, with its config, replay buffer, VecNormalize statistics
    and evaluation history, into the same TensorBoard run (schedules and exploration go on from the saved step).

    :param timesteps: the new total length (default: the run's own)
    :param save_replay_buffer: from now on save the replay buffer too (default: as the run did)
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--resume: no such run dir: {run_dir}")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume: {run_dir} holds no config.yaml; is it a run dir written by sb3_gpu.train?")
    config = load_config(run_dir)
    options = RunOptions.from_config(config.run, config.path)
    states = saved_states(run_dir)
    if not states:
        raise ConfigError(f"--resume: {run_dir} holds no readable model.zip or checkpoint to continue from")
    state = states[0]
    # Seeded runs continue on fresh seeds: replaying the first episodes' seeds would repeat them.
    seed = None if config.seed is None else (config.seed + state.timesteps) % 2**32
    plan = make_plan(
        config.algo, config.env, config.device, vec_env=config.vec_env, seed=seed, config=config, n_timesteps=timesteps
    )
    total = plan.preset.n_timesteps
    if state.timesteps >= total:
        raise ConfigError(
            f"--resume: {run_dir} already trained {state.timesteps:,} of {total:,} timesteps; "
            f"pass --timesteps with a larger total to train on"
        )
    if save_replay_buffer is not None:
        options = dataclasses.replace(options, save_replay_buffer=save_replay_buffer)
    options.check(plan)
    return _train(plan, run_dir, options, state, progress, console, report_s)


@dataclass(frozen=True)
class RunOptions:
    """How a run evaluates and saves; kept in ``config.yaml`` so that ``--resume`` goes on the same way."""

    eval_freq: int | None = None
    eval_episodes: int = 10
    checkpoint_freq: int | None = None
    save_replay_buffer: bool = False

    def check(self, plan: Plan) -> None:
        for name in ("eval_freq", "eval_episodes", "checkpoint_freq"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.save_replay_buffer, bool):
            raise ConfigError(f"save_replay_buffer must be true or false, got {self.save_replay_buffer!r}")
        if self.save_replay_buffer and get_algo(plan.algo).on_policy:
            raise ConfigError(
                f"--save-replay-buffer is for off-policy algorithms (dqn, qrdqn); {plan.algo} keeps no replay buffer"
            )

    @classmethod
    def from_config(cls, data: dict[str, Any], where: str) -> RunOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise ConfigError(f"{where}: unknown key 'run.{key}'{closest(str(key), names)}")
        return cls(**data)


def _train(
    plan: Plan,
    run_dir: Path,
    options: RunOptions,
    state: SavedState | None,
    progress: bool,
    console: Console | None,
    report_s: float | None,
) -> dict[str, Any]:
    with run_dir_lock(run_dir):
        if state is not None:
            set_monitor_files_aside(run_dir / "monitor")
        env = build_env(plan, monitor_dir=str(run_dir / "monitor"))
        eval_env = build_env(plan, evaluation=True)
        try:
            if state is None:
                model = build_model(plan, env, tensorboard_log=str(run_dir / "tb"))
            else:
                env = restore_vecnormalize(plan, env, state, run_dir)
                model = restore_model(plan, env, state, run_dir, console)
        except BaseException:
            _close(env, eval_env)
            raise
        return _learn(plan, run_dir, options, state, model, env, eval_env, progress, console, report_s)


def _learn(
    plan: Plan,
    run_dir: Path,
    options: RunOptions,
    state: SavedState | None,
    model: BaseAlgorithm,
    env: VecEnv,
    eval_env: VecEnv,
    progress: bool,
    console: Console | None,
    report_s: float | None,
) -> dict[str, Any]:
    preset = plan.preset
    total = preset.n_timesteps
    config = plan.to_config()
    if state is not None:
        config["seed"] = plan.seed if plan.seed is None else (plan.seed - state.timesteps) % 2**32
    config["run"] = dataclasses.asdict(options)
    config["resolved"]["vec_env_class"] = type(env.unwrapped).__name__  # after any fallback to DummyVecEnv
    write_yaml(run_dir / "config.yaml", config)

    eval_freq = options.eval_freq or max(total // 10, 1)
    checkpoint_freq = options.checkpoint_freq or max(total // 5, 1)
    evaluator = TimedEvalCallback(
        eval_env,
        n_eval_episodes=options.eval_episodes,
        eval_freq=max(eval_freq // preset.n_envs, 1),
        best_model_save_path=str(run_dir),
        log_path=str(run_dir / "eval"),
        callback_on_new_best=SaveVecNormalizeCallback(run_dir / "best_vecnormalize.pkl") if preset.normalize else None,
        verbose=0,
    )
    if state is not None:
        evaluator.restore_history(state.timesteps)
    stop, guard = StopOnSignal(), NanGuard()
    callbacks: list[BaseCallback] = [
        stop,
        guard,
        evaluator,
        AtomicCheckpointCallback(
            max(checkpoint_freq // preset.n_envs, 1),
            str(run_dir / "checkpoints"),
            name_prefix="model",
            save_vecnormalize=True,
            save_replay_buffer=options.save_replay_buffer,
        ),
    ]
    bar = ProgressCallback(total, console=console) if progress else None
    if bar is not None:
        callbacks.append(bar)
    printer = (console or Console()).log if progress else print
    throughput = ThroughputCallback(report_s=report_s, print_fn=printer, eval_callback=evaluator)
    callbacks.append(throughput)

    start_steps, start = model.num_timesteps, time.perf_counter()
    error: BaseException | None = None
    with stop:
        try:
            model.learn(total - model.num_timesteps, callback=callbacks, tb_log_name="run", reset_num_timesteps=state is None)
        except StopNow:  # the second signal: quit at once, writing nothing more
            _release(bar, throughput, guard)
            _close(env, eval_env)
            raise
        except KeyboardInterrupt:
            stop.received = signal.SIGINT  # not the main thread, so Python's own Ctrl-C: stop and save
        except Exception as e:
            error = _explain(e, env)
        finally:
            _release(bar, throughput, guard)
        wall = time.perf_counter() - start
        # Still inside `stop`: a second signal during the saves aborts them, and atomic writes keep the old files.
        try:
            summary = _finish(
                plan, run_dir, options, model, env, eval_env, evaluator, throughput, stop, error, wall, start_steps
            )
        except StopNow:
            _close(env, eval_env)
            raise
    _close(env, eval_env)
    if error is not None:
        if hasattr(error, "add_note"):  # Python 3.11+; summary.json says the same on 3.10
            error.add_note(summary["saved"])
        raise error
    return summary


def _finish(
    plan: Plan,
    run_dir: Path,
    options: RunOptions,
    model: BaseAlgorithm,
    env: VecEnv,
    eval_env: VecEnv,
    evaluator: TimedEvalCallback,
    throughput: ThroughputCallback,
    stop: StopOnSignal,
    error: BaseException | None,
    wall: float,
    start_steps: int,
) -> dict[str, Any]:
    """Save the model (unless its weights are NaN), evaluate a completed run, and write the summary."""
    bad = first_non_finite(model.policy)
    model_path = run_dir / "model.zip"
    if bad is None:
        replay = run_dir / "replay_buffer.pkl" if options.save_replay_buffer else None
        save_state(model, model_path, run_dir / "vecnormalize.pkl", replay)
        saved = f"model saved to {model_path} at {model.num_timesteps:,} timesteps"
    else:
        newest = saved_states(run_dir)
        kept = f"{newest[0].model} ({newest[0].timesteps:,} timesteps)" if newest else "none (no checkpoint was written yet)"
        saved = f"the weights are NaN ({bad}), so no model was saved; the last good model is {kept}"
    if error is not None or stop.received is not None:
        saved += f"; continue with: python -m sb3_gpu.train --resume {run_dir}"
    stopped_by = signal.Signals(stop.received).name if stop.received is not None else None
    steps = model.num_timesteps - start_steps
    summary: dict[str, Any] = {
        "algo": plan.algo,
        "env": plan.env.name,
        "device": plan.device.device,
        "vec_env": type(env.unwrapped).__name__,
        "timesteps": int(model.num_timesteps),
        "wall_time_s": round(wall, 2),
        "steps_per_s": round(steps / wall, 1) if wall > 0 else None,
        "interrupted": stopped_by is not None or error is not None,
        "stopped_by": stopped_by,
        "error": f"{type(error).__name__}: {error}" if error is not None else None,
        "saved": saved,
        "model": str(model_path) if bad is None else None,
        "throughput": {k: round(v, 4) for k, v in throughput.latest.items()},
    }
    if not summary["interrupted"]:
        sync_envs_normalization(env, eval_env)
        mean, std = evaluate(model, eval_env, options.eval_episodes)
        summary.update(final_eval_mean=mean, final_eval_std=std, eval_episodes=options.eval_episodes)
        best = evaluator.best_mean_reward
        summary["best_eval_mean"] = float(best) if best > -float("inf") else None
    if (run_dir / "best_model.zip").exists():
        summary["best_model"] = str(run_dir / "best_model.zip")
    from sb3_gpu.plot import plot_runs  # here, so that `python -m sb3_gpu.plot` is not imported twice

    try:
        summary["curves"] = str(plot_runs([run_dir], run_dir / "curves.png", labels=[f"{plan.algo} {plan.env.name}"]))
    except Exception as e:  # matplotlib is an optional extra; a picture must never cost the run its summary
        summary["curves"] = f"not drawn: {e}"
    write_json(run_dir / "summary.json", summary)
    return summary


def _release(bar: ProgressCallback | None, throughput: ThroughputCallback, guard: NanGuard) -> None:
    # SB3 skips on_training_end when learn() raises: release the terminal and the hooks here.
    if bar is not None:
        bar.stop()
    throughput.close()
    guard.close()


def _explain(error: Exception, env: VecEnv) -> Exception:
    """Name the env behind a closed pipe: SB3's SubprocVecEnv only reports EOFError when a worker dies."""
    base = env.unwrapped
    if not isinstance(error, (EOFError, ConnectionError)) or not isinstance(base, SubprocVecEnv):
        return error
    for index, process in enumerate(base.processes):
        process.join(timeout=1)
        if process.exitcode is not None:
            code = process.exitcode
            cause = (
                f"was killed by {signal.Signals(-code).name}"
                if code < 0
                else f"exited with code {code} (its traceback is above)"
            )
            return EnvWorkerError(f"env {index} (SubprocVecEnv worker, pid {process.pid}) {cause}", env_index=index)
    return error


def _close(*envs: VecEnv) -> None:
    # After a worker died, closing must neither raise over the summary nor leave the others running or unreaped.
    for env in envs:
        base = env.unwrapped
        processes = getattr(base, "processes", [])
        if isinstance(base, SubprocVecEnv) and not all(p.is_alive() for p in processes):
            # SB3's close() would wait for a reply from every worker still owing one: stop them instead.
            for process in processes:
                process.terminate()
            base.closed = True
        with contextlib.suppress(EOFError, BrokenPipeError, ConnectionError, OSError, EnvWorkerError):
            env.close()
        for process in processes:
            process.join(timeout=5)


def evaluate(model: BaseAlgorithm, env: VecEnv, episodes: int, deterministic: bool = True) -> tuple[float, float]:
    """Mean and std of the episode return."""
    mean, std = evaluate_policy(model, env, n_eval_episodes=episodes, deterministic=deterministic)
    return float(mean), float(std)  # type: ignore[arg-type]


def _find_model(target: Path, which: str) -> tuple[Path, Path]:
    """Return (model zip, run dir) for a run dir or a zip somewhere inside one."""
    if target.is_dir():
        names = ["best_model.zip", "model.zip"] if which == "best" else ["model.zip"]
        for name in names:
            if (target / name).is_file():
                return target / name, target
        raise ConfigError(f"{target} holds no {' or '.join(names)}; is it a run dir written by sb3_gpu.train?")
    if not target.is_file():
        raise ConfigError(f"no such run dir or model file: {target}")
    for parent in target.resolve().parents:
        if (parent / "config.yaml").is_file():
            return target, parent
    raise ConfigError(f"{target}: no config.yaml beside it or above it, so its algorithm and env are unknown")


def _stats_for(model_path: Path, run_dir: Path) -> Path | None:
    """The VecNormalize statistics saved with this model, if the run normalised."""
    candidates = [run_dir / "best_vecnormalize.pkl"] if model_path.name == "best_model.zip" else []
    if model_path.parent.name == "checkpoints":
        steps = model_path.stem.removeprefix("model_")
        candidates.append(model_path.with_name(f"model_vecnormalize_{steps}.pkl"))
    candidates.append(run_dir / "vecnormalize.pkl")
    return next((c for c in candidates if c.is_file()), None)


def evaluate_run(
    target: str | Path,
    episodes: int = 10,
    *,
    deterministic: bool = True,
    which: str = "best",
    device: str = "cpu",
    seed: int | None = None,
) -> dict[str, Any]:
    """Load a model from a run and return ``{"mean", "std", "episodes", "model"}``."""
    if which not in ("best", "final"):
        raise ConfigError(f"which must be 'best' or 'final', got {which!r}")
    model_path, run_dir = _find_model(Path(target), which)
    config = load_config(run_dir)
    # Evaluation trains nothing: the training run's speed switches (fp16 on its GPU, say) must not block it here.
    speed_off = {"amp": "off", "compile": "false", "threads": "auto"}
    plan: Plan = make_plan(config.algo, config.env, device, vec_env="dummy", seed=seed, config=config, overrides=speed_off)
    env = build_env(plan, evaluation=True)
    if isinstance(env, VecNormalize):
        stats = _stats_for(model_path, run_dir)
        if stats is None:
            raise ConfigError(f"{run_dir} normalised its observations but holds no vecnormalize.pkl for {model_path.name}")
        env = VecNormalize.load(str(stats), env.venv)
        env.training, env.norm_reward = False, False
    model = load_plan_model(plan, model_path, env)
    mean, std = evaluate(model, env, episodes, deterministic)
    env.close()
    return {
        "mean": mean,
        "std": std,
        "episodes": episodes,
        "deterministic": deterministic,
        "model": str(model_path),
    }
