"""Training a plan into a run directory: what ``python -m sb3_gpu.train`` does, as a library call."""

from __future__ import annotations

import contextlib
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback, EvalCallback
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import VecEnv, VecNormalize, sync_envs_normalization

from sb3_gpu._io import save_model, write_json, write_yaml
from sb3_gpu.callbacks import ProgressCallback, SaveVecNormalizeCallback
from sb3_gpu.errors import ConfigError
from sb3_gpu.plan import Plan, build_env, build_model, load_config, make_plan
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
    progress: bool = True,
    console: Console | None = None,
    report_s: float | None = 30.0,
) -> dict[str, Any]:
    """Train per the plan into ``run_dir`` (config, checkpoints, best and final model, TensorBoard, summary).

    :param eval_freq: evaluate every N timesteps (default: a tenth of the run)
    :param checkpoint_freq: checkpoint every N timesteps (default: a fifth of the run)
    :param report_s: print a throughput line every N seconds (None: never)
    :return: the summary, also written as ``summary.json``
    """
    run_dir = Path(run_dir)
    preset = plan.preset
    total = preset.n_timesteps
    env = build_env(plan, monitor_dir=str(run_dir / "monitor"))
    eval_env = build_env(plan, evaluation=True)
    try:
        model = build_model(plan, env, tensorboard_log=str(run_dir / "tb"))
    except ConfigError:
        _close(env, eval_env)
        raise
    config = plan.to_config()
    config["resolved"]["vec_env_class"] = type(env.unwrapped).__name__  # after any fallback to DummyVecEnv
    write_yaml(run_dir / "config.yaml", config)

    eval_freq = eval_freq or max(total // 10, 1)
    checkpoint_freq = checkpoint_freq or max(total // 5, 1)
    callbacks: list[BaseCallback] = [
        TimedEvalCallback(
            eval_env,
            n_eval_episodes=eval_episodes,
            eval_freq=max(eval_freq // preset.n_envs, 1),
            best_model_save_path=str(run_dir),
            log_path=str(run_dir / "eval"),
            callback_on_new_best=SaveVecNormalizeCallback(run_dir / "best_vecnormalize.pkl") if preset.normalize else None,
            verbose=0,
        ),
        CheckpointCallback(
            max(checkpoint_freq // preset.n_envs, 1), str(run_dir / "checkpoints"), name_prefix="model", save_vecnormalize=True
        ),
    ]
    bar = ProgressCallback(total, console=console) if progress else None
    if bar is not None:
        callbacks.append(bar)
    printer = (console or Console()).log if progress else print
    assert isinstance(callbacks[0], TimedEvalCallback)
    throughput = ThroughputCallback(report_s=report_s, print_fn=printer, eval_callback=callbacks[0])
    callbacks.append(throughput)

    start = time.perf_counter()
    interrupted = False
    try:
        model.learn(total, callback=callbacks, tb_log_name="run")
    except KeyboardInterrupt:
        interrupted = True
        if bar is not None:
            bar.stop()  # SB3 skips on_training_end when learn() is interrupted
    finally:
        throughput.close()
    wall = time.perf_counter() - start

    model_path = save_model(model, run_dir / "model.zip")
    vec_normalize = model.get_vec_normalize_env()
    if vec_normalize is not None:
        vec_normalize.save(str(run_dir / "vecnormalize.pkl"))
    summary: dict[str, Any] = {
        "algo": plan.algo,
        "env": plan.env.name,
        "device": plan.device.device,
        "vec_env": type(env.unwrapped).__name__,
        "timesteps": int(model.num_timesteps),
        "wall_time_s": round(wall, 2),
        "steps_per_s": round(model.num_timesteps / wall, 1) if wall > 0 else None,
        "interrupted": interrupted,
        "model": str(model_path),
        "throughput": {k: round(v, 4) for k, v in throughput.latest.items()},
    }
    if not interrupted:
        sync_envs_normalization(env, eval_env)
        mean, std = evaluate(model, eval_env, eval_episodes)
        summary.update(final_eval_mean=mean, final_eval_std=std, eval_episodes=eval_episodes)
        best = callbacks[0]
        assert isinstance(best, EvalCallback)
        summary["best_eval_mean"] = float(best.best_mean_reward) if best.best_mean_reward > -float("inf") else None
    if (run_dir / "best_model.zip").exists():
        summary["best_model"] = str(run_dir / "best_model.zip")
    from sb3_gpu.plot import plot_runs  # here, so that `python -m sb3_gpu.plot` is not imported twice

    try:
        summary["curves"] = str(plot_runs([run_dir], run_dir / "curves.png", labels=[f"{plan.algo} {plan.env.name}"]))
    except Exception as e:  # matplotlib is an optional extra; a picture must never cost the run its summary
        summary["curves"] = f"not drawn: {e}"
    write_json(run_dir / "summary.json", summary)
    _close(env, eval_env)
    return summary


def _close(*envs: VecEnv) -> None:
    # After Ctrl-C, subprocess workers got the signal too and may be gone: closing must not raise over the summary.
    for env in envs:
        with contextlib.suppress(EOFError, BrokenPipeError, ConnectionError, OSError):
            env.close()


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
    try:
        model = plan.preset.model_class.load(str(model_path), device=plan.device.device)
    except Exception as e:  # a truncated or foreign zip fails in many ways inside SB3
        raise ConfigError(
            f"{model_path} is not a loadable {plan.preset.model_class.__name__} model ({type(e).__name__}: {e})"
        ) from None
    mean, std = evaluate(model, env, episodes, deterministic)
    env.close()
    return {
        "mean": mean,
        "std": std,
        "episodes": episodes,
        "deterministic": deterministic,
        "model": str(model_path),
    }
