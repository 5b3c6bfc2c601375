"""Evaluation: periodic (SB3's EvalCallback, timed, its files written atomically into a run dir) and of a finished
run's saved model."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import EvalCallback
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.config.runconfig import load_config
from sb3_gpu.planning.build import EVAL_SEED_OFFSET, build_env
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.rundir import RunDir
from sb3_gpu.runs.saving import load_plan_model, load_vecnormalize
from sb3_gpu.runs.video import record_video, recordable

MAX_EVAL_ENVS = 5


def eval_envs(episodes: int) -> int:
    """Envs an evaluation of ``episodes`` runs on: up to 5 at once, so that one batched inference serves 5 env steps
    (on one env, evaluating took most of a short run's time). SB3's evaluate_policy gives each env its share of the
    episodes, so short episodes are not over-counted; the number of episodes is the same. A count that divides the
    episodes is preferred: an env done with its share keeps stepping until the others are."""
    most = min(episodes, MAX_EVAL_ENVS)
    return next((n for n in range(most, 1, -1) if episodes % n == 0), most)


class EvaluationStopped(Exception):
    """A signal arrived during an evaluation: it was abandoned at once, and nothing of it was recorded."""


class TimedEvalCallback(EvalCallback):
    """SB3's EvalCallback (same arguments), adding up the seconds its evaluations take so that telemetry can split
    them out.

    With ``run_dir``, the best model and ``evaluations.npz`` go there. SB3 writes them in place, where a crash
    mid-write would leave half a file; here it writes them into a scratch folder, and each complete file is renamed
    over the real one.

    ``should_stop`` (set by the training Session) is asked after every evaluation step: when it answers True, the
    evaluation is abandoned and training stops, so a signal never waits for the remaining episodes.
    """

    def __init__(self, eval_env: Any, *, run_dir: RunDir | None = None, **kwargs: Any):
        self.run_dir = run_dir
        if run_dir is not None:
            kwargs["best_model_save_path"] = str(run_dir.path / RunDir.SCRATCH)
            kwargs["log_path"] = str(run_dir.eval / RunDir.SCRATCH)
        super().__init__(eval_env, **kwargs)
        self.seconds = 0.0
        self.should_stop: Callable[[], bool] | None = None
        self.stopped = False  # an evaluation was abandoned: last_mean_reward is not its result

    def _on_step(self) -> bool:
        start = time.perf_counter()
        try:
            return super()._on_step()
        except EvaluationStopped:
            self.stopped = True
            return False  # ends learn(); the session then saves the model as for any stop
        finally:
            if self.eval_freq > 0 and self.n_calls % self.eval_freq == 0:
                self._publish()
            self.seconds += time.perf_counter() - start

    def _log_success_callback(self, locals_: dict[str, Any], globals_: dict[str, Any]) -> None:
        # evaluate_policy calls this after every step of the evaluation env: the one place to stop it midway.
        if self.should_stop is not None and self.should_stop():
            raise EvaluationStopped
        super()._log_success_callback(locals_, globals_)

    def _scratch_files(self) -> list[tuple[Path, Path]]:
        run = self.run_dir
        if run is None:
            return []
        return [
            (run.path / RunDir.SCRATCH / RunDir.BEST_MODEL, run.best_model),
            (run.eval / RunDir.SCRATCH / RunDir.EVALUATIONS, run.evaluations),
        ]

    def _publish(self) -> None:
        for scratch, final in self._scratch_files():
            if scratch.exists():
                os.replace(scratch, final)

    def _on_training_end(self) -> None:
        super()._on_training_end()
        for scratch, _ in self._scratch_files():
            with contextlib.suppress(OSError):  # SB3 made them at start and writes into them until the end
                scratch.parent.rmdir()

    def restore_history(self, up_to_timesteps: int) -> None:
        """Continue a resumed run's ``evaluations.npz`` (its entries up to the resumed model's timesteps) and its
        best score (over all entries, since the best model may be newer than the model resumed from)."""
        if self.run_dir is None or not self.run_dir.evaluations.is_file():
            return
        with np.load(self.run_dir.evaluations) as data:
            timesteps, results, lengths = data["timesteps"], data["results"], data["ep_lengths"]
        if len(results):
            self.best_mean_reward = float(np.max(np.mean(results, axis=1)))
        keep = timesteps <= up_to_timesteps
        self.evaluations_timesteps = [int(t) for t in timesteps[keep]]
        self.evaluations_results = [list(r) for r in results[keep]]
        self.evaluations_length = [list(n) for n in lengths[keep]]


def evaluate(
    model: BaseAlgorithm,
    env: VecEnv,
    episodes: int,
    deterministic: bool = True,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[float, float]:
    """Mean and std of the episode return; :class:`EvaluationStopped` as soon as ``should_stop()`` is True."""

    def check(locals_: dict[str, Any], globals_: dict[str, Any]) -> None:
        if should_stop is not None and should_stop():
            raise EvaluationStopped

    mean, std = evaluate_policy(model, env, n_eval_episodes=episodes, deterministic=deterministic, callback=check)
    return float(mean), float(std)  # type: ignore[arg-type]


def evaluate_run(
    target: str | Path,
    episodes: int = 10,
    *,
    deterministic: bool = True,
    which: str = "best",
    device: str = "cpu",
    seed: int | None = None,
    video: bool = False,
    video_length: int = 0,
) -> dict[str, Any]:
    """Load a model from a run and return ``{"mean", "std", "episodes", "deterministic", "model"}``, and ``"video"``
    (its path, frames and fps) where asked for.

    :param target: a run dir (its best model, else its final one; ``which="final"``: the final one) or a model zip
        inside a run dir
    :param video: also record an mp4 of the model (its first episode, or ``video_length`` frames) into the run dir's
        ``videos/``, named after the model
    """
    if which not in ("best", "final"):
        raise ConfigError(f"which must be 'best' or 'final', got {which!r}")
    model_path, run = RunDir.find_model(target, which)
    config = load_config(run.config)
    # Evaluation trains nothing: the training run's speed switches (fp16 on its GPU, say) must not block it here.
    speed_off = {"amp": "off", "compile": "false", "threads": "auto"}
    plan = make_plan(
        config.algo, config.env, device, vec_env="dummy", seed=seed, config=config, overrides=speed_off, training=False
    )
    if video:
        recordable(plan.env)  # a video that cannot be made is refused now, not after the evaluation
    env = build_env(plan, evaluation=True, n_envs=eval_envs(episodes))
    if isinstance(env, VecNormalize):
        stats = run.vecnormalize_for(model_path)
        if stats is None:
            raise ConfigError(f"{run} normalised its observations but holds no vecnormalize.pkl for {model_path.name}")
        env = load_vecnormalize(stats, env.venv)
        env.training, env.norm_reward = False, False
    result: dict[str, Any] = {"episodes": episodes, "deterministic": deterministic, "model": str(model_path)}
    try:
        model = load_plan_model(plan, model_path, env)
        result["mean"], result["std"] = evaluate(model, env, episodes, deterministic)
        if video:
            recorded = record_video(
                model,
                plan.env,
                run.path / "videos" / f"{model_path.stem}.mp4",
                video_length=video_length,
                deterministic=deterministic,
                seed=None if plan.seed is None else plan.seed + EVAL_SEED_OFFSET,
                frame_stack=plan.preset.frame_stack,
                max_episode_steps=plan.eval_step_cap,
                normalization=env if isinstance(env, VecNormalize) else None,
            )
            result["video"] = {"path": str(recorded.path), "frames": recorded.frames, "fps": recorded.fps}
    finally:
        env.close()
    return result
