"""Evaluation: periodic (SB3's EvalCallback, timed, its files written atomically into a run dir) and of a finished
run's saved model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.type_aliases import TrainFreq, TrainFrequencyUnit
from stable_baselines3.common.vec_env import VecEnv, VecNormalize, VecTransposeImage, is_vecenv_wrapped

from sb3_gpu.common.checks import bool_arg, count_arg, seed_arg
from sb3_gpu.common.errors import ConfigError, warn
from sb3_gpu.common.io import (
    check_dir_creatable,
    keep_previous,
    put_back_cut_short,
    refuse_links,
    replace,
    save_model,
    write_json,
)
from sb3_gpu.config.runconfig import config_env, load_config
from sb3_gpu.envs.spec import EnvSpec, channel_last_images
from sb3_gpu.extensions.amp import record_loss_scale
from sb3_gpu.planning.build import EVAL_SEED_OFFSET, build_env, offset_seed
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.rundir import RunDir
from sb3_gpu.runs.saving import calls_from_the_models_steps, load_plan_model, load_vecnormalize, settle_training
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


@dataclass(frozen=True)
class BestModel:
    """How the best model was chosen, and its figure.

    :ivar mean: the figure that made it the best: the mean of the confirming episodes (without confirmation, of
        the periodic ones)
    :ivar periodic_mean: the periodic evaluation's mean that made it a candidate
    :ivar confirmed: whether ``mean`` comes from fresh confirming episodes
    :ivar checked_mean: the best model evaluated once more after training, on fresh episodes: the best of several
        confirmed figures still leans high, a figure taken after the choice does not (None: not checked)
    """

    timesteps: int
    mean: float
    std: float | None
    episodes: int
    periodic_mean: float
    confirmed: bool
    checked_mean: float | None = None
    checked_std: float | None = None
    checked_episodes: int | None = None

    @property
    def figure(self) -> tuple[float, float | None, int]:
        """The figure to report: mean, std and episodes of the check after training where there is one, else of the
        evaluation that chose it."""
        if self.checked_mean is not None and self.checked_episodes:
            return self.checked_mean, self.checked_std, self.checked_episodes
        return self.mean, self.std, self.episodes

    @classmethod
    def read(cls, path: Path) -> BestModel | None:
        """The record a run wrote beside its best model; None where there is none or it cannot be read."""
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None

    def describe(self) -> str:
        spread = f" +/- {self.std:.2f}" if self.std is not None else ""
        how = (
            f"{self.episodes} confirming episodes; its periodic evaluation read {self.periodic_mean:.2f}"
            if self.confirmed
            else f"{self.episodes} periodic episodes, not confirmed"
        )
        chosen = f"{self.mean:.2f}{spread} at {self.timesteps:,} timesteps ({how})"
        if self.checked_mean is None:
            return chosen
        checked_spread = f" +/- {self.checked_std:.2f}" if self.checked_std is not None else ""
        return (
            f"{self.checked_mean:.2f}{checked_spread} on {self.checked_episodes} fresh episodes after training; "
            f"chosen with {chosen}"
        )


def confirm_count(eval_episodes: int) -> int:
    """Fresh episodes that confirm a new best: three times a periodic evaluation's, so that a lucky evaluation (the
    best of many noisy ones) is not taken for a better model."""
    return 3 * eval_episodes


def hold_writes(logger: Any, at: int | None = None) -> Callable[[bool], None]:
    """Skip the logger's writes until the function returned is called (``release(write)``, True: and write what waits
    at step ``at``, unless a write ended the hold first). What is recorded meanwhile waits for the next write.

    :param at: skip only writes at this step: a write at another one ends the hold and is made (a ``learn()`` that
        raised before the hold's end, and the next one on the same logger)
    """
    own = logger.__dict__.get("dump")  # an instance's own write (sb3_gpu's, which adds the device's figures) is kept
    held = True

    def release(write: bool = False) -> None:
        nonlocal held
        if held:
            held = False
            if own is None:
                logger.__dict__.pop("dump", None)
            else:
                logger.dump = own
            if write:
                logger.dump(at or 0)

    def skipped(step: int = 0) -> None:  # SB3 names it
        if at is not None and step != at:
            release()
            logger.dump(step)

    logger.dump = skipped
    return release


@contextlib.contextmanager
def _writes_held(logger: Any) -> Iterator[None]:
    """The logger's writes skipped inside the block."""
    release = hold_writes(logger)
    try:
        yield
    finally:
        release(False)


class TimedEvalCallback(EvalCallback):
    """SB3's EvalCallback (same arguments), with a best model that holds up, and its time added up so that telemetry
    can split it out.

    A periodic evaluation that beats the best so far only names a candidate: with ``confirm_episodes``, the
    candidate is evaluated again on that many fresh episodes, and it becomes the best (saved, ``best``,
    ``best_mean_reward``, ``callback_on_new_best`` called) only if that mean beats the best's own confirmed mean.
    The best of many noisy evaluations is an optimistic figure; a fresh evaluation of the one chosen is not. With
    ``confirm_episodes=0`` a candidate is taken as it is, as SB3 does.

    With ``run_dir``, the best model, its record and ``evaluations.npz`` go there, each written whole: SB3 writes
    ``evaluations.npz`` in place, where a crash mid-write would leave half a file, so here it writes into a scratch
    folder and the complete file is renamed over the real one.

    ``should_stop`` (set by the training Session) is asked after every evaluation step: when it answers True, the
    evaluation is abandoned (the best so far stays the best) and training stops, so a signal never waits for the
    remaining episodes.

    Before each evaluation, an overlapped training still running is waited for and the NaN guard's device-side flags
    are read (:func:`~sb3_gpu.runs.saving.settle_training`): a step skipped since the last log write stops the run
    there, so a model that missed updates is never evaluated or kept as the best.
    """

    def __init__(
        self,
        eval_env: Any,
        *,
        run_dir: RunDir | None = None,
        confirm_episodes: int = 0,
        callback_on_new_best: BaseCallback | None = None,
        **kwargs: Any,
    ):
        self.run_dir = run_dir
        if run_dir is not None:
            kwargs["log_path"] = str(run_dir.eval / RunDir.SCRATCH)
        if kwargs.get("best_model_save_path") is not None:
            raise ValueError("TimedEvalCallback saves the best model into run_dir, not best_model_save_path")
        super().__init__(eval_env, **kwargs)  # SB3 neither saves the best model nor calls callback_on_new_best: we do
        self.on_new_best = callback_on_new_best
        if callback_on_new_best is not None:
            callback_on_new_best.parent = self
        self.confirm_episodes = confirm_episodes
        self.best: BestModel | None = None
        self.rejected = 0  # candidates whose confirmation fell short
        self.seconds = 0.0
        self.should_stop: Callable[[], bool] | None = None
        self.stopped = False  # an evaluation was abandoned: last_mean_reward is not its result
        self.evaluate_first = False  # a resume owes the evaluation its stop abandoned: run it before the first step
        # Set by a callback that writes the logger as learn() ends (ThroughputCallback): an evaluation at the run's
        # last step leaves its figures to that write, so that the step gets one point, with the last training in it.
        self.last_write_elsewhere = False
        self._learn_start = 0  # the model's timesteps as the learn() under way began

    def _init_callback(self) -> None:
        with warnings.catch_warnings():
            # SB3 warns where the two classes differ; here they do by design (an in-process eval env beside worker
            # processes, or EnvPool's), and its wrappers (VecNormalize's statistics, frame stacking) are matched.
            warnings.filterwarnings("ignore", "Training and eval env are not of the same type", UserWarning)
            super()._init_callback()
        # SB3 moves channel-last images first for the model, wrapping the training env in VecTransposeImage, and
        # syncs VecNormalize's statistics down both chains level by level: the eval env must be wrapped the same.
        # (Not where the user's own wrapper already moved them.)
        trained_transposed = is_vecenv_wrapped(self.training_env, VecTransposeImage)
        if (
            trained_transposed
            and not is_vecenv_wrapped(self.eval_env, VecTransposeImage)
            and channel_last_images(self.eval_env.observation_space)
        ):
            self.eval_env = VecTransposeImage(self.eval_env)
        calls_from_the_models_steps(self)
        if self.on_new_best is not None:
            self.on_new_best.init_callback(self.model)

    def _on_training_start(self) -> None:
        super()._on_training_start()
        self._learn_start = self.num_timesteps
        if self.evaluate_first:
            self.evaluate_first = False
            self._on_step()  # at the calls the model's timesteps stand for: the evaluation due there
            if self.stopped:  # end learn() before its first env step, so the next resume still owes this evaluation
                raise EvaluationStopped

    def _on_step(self) -> bool:
        if self.eval_freq > 0 and self.n_calls % self.eval_freq == 0:
            # A step skipped on the device stops the run here, before it is evaluated. Waiting for the steps training
            # still runs (in the background, or queued on the GPU) is training's time, so the clock starts after it.
            settle_training(self.model)
        start = time.perf_counter()
        bar = self.best_mean_reward
        try:
            with _writes_held(self.logger) if self._written_at_the_end() else contextlib.nullcontext():
                return self._evaluate(bar)
        except EvaluationStopped:
            self.best_mean_reward = bar
            self.stopped = True
            return False  # ends learn(); the session then saves the model as for any stop
        finally:
            if self.eval_freq > 0 and self.n_calls % self.eval_freq == 0:
                self._publish()
            self.seconds += time.perf_counter() - start

    def _written_at_the_end(self) -> bool:
        """Whether an evaluation is due at the last step of a ``learn()`` whose end is written by another callback:
        SB3 writes it before the last training, and that write would give the step a second point. (The last step is
        known where rollouts have a fixed length: PPO's n_steps, or an off-policy train_freq counted in steps.)"""
        if not (self.last_write_elsewhere and self.eval_freq > 0 and self.n_calls % self.eval_freq == 0):
            return False
        freq = getattr(self.model, "train_freq", None)
        if isinstance(self.model, OnPolicyAlgorithm):
            rollout = self.model.n_steps
        elif isinstance(freq, TrainFreq) and freq.unit == TrainFrequencyUnit.STEP:
            rollout = freq.frequency
        else:
            return False
        block, start = rollout * self.training_env.num_envs, self._learn_start
        return self.num_timesteps == start + math.ceil((self.model._total_timesteps - start) / block) * block

    def _evaluate(self, bar: float) -> bool:
        keep_going = super()._on_step()
        if self.best_mean_reward > bar:  # SB3 took this evaluation for a new best: a candidate, until confirmed
            keep_going = self._candidate(bar) and keep_going
        return keep_going

    def _candidate(self, bar: float) -> bool:
        periodic = self.best_mean_reward
        self.best_mean_reward = bar  # until the candidate is confirmed
        std: float | None
        if self.confirm_episodes > 0:
            mean, std = evaluate(self.model, self.eval_env, self.confirm_episodes, self.deterministic, self.should_stop)
            self.logger.record("eval/confirmed_mean_reward", mean)
            self.logger.dump(self.num_timesteps)
            if mean <= bar:
                self.rejected += 1
                return True
            best = BestModel(self.num_timesteps, mean, std, self.confirm_episodes, periodic, confirmed=True)
        else:
            last = self.evaluations_results[-1] if self.evaluations_results else None
            std = float(np.std(last)) if last is not None else None
            best = BestModel(self.num_timesteps, periodic, std, self.n_eval_episodes, periodic, confirmed=False)
        self.best_mean_reward = best.mean  # before on_new_best: SB3's StopTrainingOnRewardThreshold reads it
        # The companions first (on_new_best saves the VecNormalize statistics), then the model, then its record, and
        # self.best once all are written: a failed or stopped write never pairs the new model with the old statistics,
        # nor a record or a summary with a model that is not on disk; the old statistics go back where the model's
        # write fails (an OSError here ends the run).
        restore = self._companions_restorer()
        try:
            go_on = self.on_new_best.on_step() if self.on_new_best is not None else True
            if self.run_dir is not None:
                record_loss_scale(self.model)
                save_model(self.model, self.run_dir.best_model)
        except BaseException:
            restore(True)
            raise
        restore(False)
        if self.run_dir is not None:
            write_json(self.run_dir.best_record, dataclasses.asdict(best))
        self.best = best
        return go_on

    def _companions_restorer(self) -> Callable[[bool], None]:
        """What, called with True, puts the best model's VecNormalize statistics back as they are now (or removes new
        ones), and with False forgets them."""
        if self.run_dir is None:
            return lambda failed: None
        put_back_cut_short(self.run_dir.best_vecnormalize, self.run_dir.best_model)
        return keep_previous(self.run_dir.best_vecnormalize)

    def _log_success_callback(self, locals_: dict[str, Any], globals_: dict[str, Any]) -> None:
        # evaluate_policy calls this after every step of the evaluation env: the one place to stop it midway.
        if self.should_stop is not None and self.should_stop():
            raise EvaluationStopped
        super()._log_success_callback(locals_, globals_)

    def _publish(self) -> None:
        """Move SB3's ``evaluations.npz``, written in place, over the run's, unless its write was cut short (a full
        disk, a second Ctrl-C inside ``np.savez``): then the run's stays as it was."""
        if self.run_dir is None:
            return
        scratch = self.run_dir.eval / RunDir.SCRATCH / RunDir.EVALUATIONS
        if not scratch.exists():
            return
        try:
            with np.load(scratch) as data:
                complete = {"timesteps", "results", "ep_lengths"} <= set(data.files)
        except Exception:  # a truncated zip fails in many ways
            complete = False
        if complete:
            replace(scratch, self.run_dir.evaluations)
        else:
            scratch.unlink(missing_ok=True)

    def _on_training_end(self) -> None:
        super()._on_training_end()
        if self.run_dir is not None:
            with contextlib.suppress(OSError):  # SB3 made it at start and writes into it until the end
                (self.run_dir.eval / RunDir.SCRATCH).rmdir()

    def restore_history(self, up_to_timesteps: int, n_envs: int) -> bool:
        """Continue a resumed run's ``evaluations.npz`` (its entries up to the resumed model's timesteps) and its
        best (the best model may be newer than the model resumed from).

        :return: whether an evaluation is owed: one is due at ``up_to_timesteps`` and none is recorded there (a stop
            abandoned it, or its write failed). Training then runs it before its first env step.
        """
        if self.run_dir is None:
            return False
        self._load_history(up_to_timesteps)
        every = self.eval_freq * n_envs
        due = every > 0 and up_to_timesteps > 0 and up_to_timesteps % every == 0
        self.evaluate_first = due and up_to_timesteps not in self.evaluations_timesteps
        return self.evaluate_first

    def _load_history(self, up_to_timesteps: int) -> None:
        assert self.run_dir is not None
        self.best = BestModel.read(self.run_dir.best_record)
        if self.best is not None:
            self.best_mean_reward = self.best.mean
        if not self.run_dir.evaluations.is_file():
            return
        try:
            with np.load(self.run_dir.evaluations) as data:
                timesteps, results, lengths = data["timesteps"], data["results"], data["ep_lengths"]
                successes = data["successes"] if "successes" in data.files else None  # envs that report is_success
        except Exception as e:  # damaged outside sb3_gpu's writes: the history is lost, the run is not
            warn(
                f"{self.run_dir.evaluations} is not readable ({type(e).__name__}), so the resumed run's evaluation "
                "history starts empty (its best model and best.json are kept)",
                RuntimeWarning,
            )
            return
        if len(results) and self.best is None:  # a run from before best records: its best periodic figure
            self.best_mean_reward = float(np.max(np.mean(results, axis=1)))
        keep = timesteps <= up_to_timesteps
        self.evaluations_timesteps = [int(t) for t in timesteps[keep]]
        self.evaluations_results = [list(r) for r in results[keep]]
        self.evaluations_length = [list(n) for n in lengths[keep]]
        if successes is not None and len(successes) == len(timesteps):  # SB3 writes them beside, one row per evaluation
            self.evaluations_successes = [list(s) for s in successes[keep]]


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


_PAIR_READS = 3


def _identities(paths: list[Path]) -> list[tuple[int, int, int] | None]:
    """Each file's identity (inode, mtime, size): an atomic write that replaced one changes it."""
    found: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
            found.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            found.append(None)
    return found


def evaluate_run(
    target: str | Path,
    episodes: int = 10,
    *,
    deterministic: bool = True,
    which: str = "auto",
    device: str | th.device = "cpu",
    seed: int | None = None,
    video: bool = False,
    video_length: int = 0,
    should_stop: Callable[[], bool] | None = None,
    env: str | Callable[[], gym.Env] | EnvSpec | None = None,
) -> dict[str, Any]:
    """Load a model from a run and return ``{"mean", "std", "episodes", "deterministic", "model"}``, and ``"video"``
    (its path, frames and fps) where asked for.

    :param target: a run dir or a model zip inside one
    :param which: in a run dir, ``auto`` (its best model, else its final one), ``best`` or ``final`` (that one only)
    :param video: also record an mp4 of the model (its first episode, or ``video_length`` frames) into the run dir's
        ``videos/``, named after the model
    :param should_stop: asked after every env step; True abandons the evaluation with :class:`EvaluationStopped`
    :param env: the env to evaluate on (default: the one the run's config names); needed where the run trained on a
        factory given in Python, whose name the config cannot rebuild
    """
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"target is a run dir or a model zip inside one (a str or a path), got {target!r}")
    count_arg(episodes, "episodes")
    bool_arg(deterministic, "deterministic")
    bool_arg(video, "video")
    count_arg(video_length, "video_length (0: the first episode)", low=0)
    if video_length and not video:
        raise ConfigError(f"video_length={video_length} is for the video: pass video=True too")
    seed_arg(seed)
    if should_stop is not None and not callable(should_stop):
        raise TypeError(f"should_stop takes a callable that returns True to stop, got {should_stop!r}")
    model_path, run = RunDir.find_model(target, which)
    config = load_config(run.config)
    if not deterministic and config.algo == "td3":  # SB3's TD3 policy ignores the flag: the figures would be mislabelled
        raise ConfigError(
            "td3's policy has no stochastic actions (its exploration noise is training's); evaluate it with deterministic=True"
        )
    # Evaluation trains nothing: the training run's speed switches (fp16 on its GPU, say) must not block it here.
    speed_off = {"amp": "off", "compile": "false", "threads": "auto"}
    plan = make_plan(
        config.algo,
        config_env(
            config,
            env,
            "pass it again: evaluate_run(run, env=the_factory)",
            "--env {env} (from Python: evaluate_run(run, env={env!r}))",
        ),
        device,
        vec_env="dummy",
        seed=seed,
        config=config,
        overrides=speed_off,
        training=False,
    )
    if video:  # a video that cannot be made or written is refused now, not after the evaluation
        recordable(plan.env)
        # The folder a run dir brings along (handed over, say) must not send the video, or the recording's scratch
        # folder that is removed after it, elsewhere.
        if run.videos.is_symlink():
            raise ConfigError(
                f"{run.videos} is a symbolic link; sb3_gpu does not write through links in a run dir (remove it)"
            )
        if run.videos.is_dir():
            refuse_links(run.videos, "run dir's video folder")
        check_dir_creatable(run.videos, "video folder")
    built = venv = build_env(plan, evaluation=True, n_envs=eval_envs(episodes))
    result: dict[str, Any] = {"episodes": episodes, "deterministic": deterministic, "model": str(model_path)}
    try:
        # A run at work in the run dir may save a new best between the statistics read and the model's: the pair
        # is read again then, so that no model is evaluated with another's statistics.
        for _ in range(_PAIR_READS):
            read = [model_path]
            if isinstance(built, VecNormalize):
                stats = run.vecnormalize_for(model_path)
                if stats is None:
                    hint = "; which='final' evaluates model.zip with its own" if model_path.name == run.BEST_MODEL else ""
                    raise ConfigError(f"{run} trained under VecNormalize, but {run.missing_vecnormalize(model_path)}{hint}")
                read.append(stats)
            before = _identities(read)
            try:
                if isinstance(built, VecNormalize):
                    venv = load_vecnormalize(read[1], built.venv)
                    venv.training, venv.norm_reward = False, False
                model = load_plan_model(plan, model_path, venv)
            except ConfigError:
                if _identities(read) == before:
                    raise
                continue  # a file it read was replaced or removed (a kept pair's old statistics, say) as it read it
            if _identities(read) == before:
                break
        else:
            raise ConfigError(f"{model_path} was replaced as it was read, {_PAIR_READS} times in a row; run again")
        # SB3's load seeds the model's generators and its env with the seed the run trained with, so the episodes
        # would be the training env's first ones, whatever seed was asked for: seed them again, as the evaluation asks
        # (the process's generators too, as SB3's load did); asked for none, the env alone, from the OS.
        if plan.seed is not None:
            first_seed = offset_seed(plan.seed, EVAL_SEED_OFFSET)
            model.set_random_seed(first_seed)
        else:
            first_seed = secrets.randbits(31)
            venv.seed(first_seed)
        result["mean"], result["std"] = evaluate(model, venv, episodes, deterministic, should_stop)
        if video:
            recorded = record_video(
                model,
                plan.env,
                run.video_for(model_path),
                video_length=video_length,
                deterministic=deterministic,
                seed=first_seed,  # the first evaluated episode's seed, seeded or not: the video plays that episode
                frame_stack=plan.preset.frame_stack,
                max_episode_steps=plan.eval_step_cap,
                normalization=venv if isinstance(venv, VecNormalize) else None,
            )
            result["video"] = {"path": str(recorded.path), "frames": recorded.frames, "fps": recorded.fps}
    finally:
        venv.close()
    return result
