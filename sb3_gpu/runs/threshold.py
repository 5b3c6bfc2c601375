"""Training until a confirmed evaluation reaches a return: the time to threshold that ``bench train`` reports and that
``tune --threshold`` minimises, measured one way for both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import StopTrainingOnRewardThreshold
from stable_baselines3.common.vec_env import VecEnv

from sb3_gpu.runs.evaluation import TimedEvalCallback
from sb3_gpu.runs.session import Session

# Evaluations in a run timed to a threshold, unless told otherwise: fine enough that the time is not rounded up to a
# tenth of the budget (PPO CartPole gets there in 10,000-15,000 of 100,000 steps).
THRESHOLD_EVALUATIONS = 50
# A run that never reaches the threshold costs its whole training time plus this many seconds (about eleven days),
# more than any run that reaches it takes: runs then rank by whether they got there, then by time. A multiple of the
# run's own time could not promise that, as runs train at different speeds: a trial whose settings train three times
# faster would beat, without ever getting there, a slow one that did.
UNREACHED_PENALTY_S = 1e6


@dataclass(frozen=True)
class ThresholdRun:
    """One training to a threshold.

    :ivar timesteps: the model's timesteps when the threshold was reached (else at the end of the budget)
    :ivar train_seconds: wall time minus evaluation (periodic and confirming)
    :ivar best: the best (confirmed) mean return, None where no evaluation ran
    :ivar stopped_by: ``SIGINT`` or ``SIGTERM`` where a signal stopped the training
    """

    reached: bool
    timesteps: int
    train_seconds: float
    best: float | None
    stopped_by: str | None = None

    @property
    def steps_per_s(self) -> float:
        return self.timesteps / max(self.train_seconds, 1e-9)

    @property
    def cost_seconds(self) -> float:
        """Seconds to the threshold; a run that never reached it adds :data:`UNREACHED_PENALTY_S` to its time."""
        return self.train_seconds if self.reached else self.train_seconds + UNREACHED_PENALTY_S


def train_to_threshold(
    model: BaseAlgorithm,
    eval_env: VecEnv,
    threshold: float,
    max_timesteps: int,
    *,
    eval_freq: int,
    episodes: int,
    confirm_episodes: int,
    evaluator_class: type[TimedEvalCallback] = TimedEvalCallback,
    **evaluator_kwargs: Any,
) -> tuple[ThresholdRun, TimedEvalCallback]:
    """Train ``model`` through a :class:`~sb3_gpu.runs.session.Session` until its best, confirmed on
    ``confirm_episodes`` fresh episodes, reaches ``threshold``, or for ``max_timesteps``.

    An error out of training (an env crash, a diverged loss) is raised; a signal ends it with ``stopped_by`` set.

    :param eval_freq: env steps between evaluations
    :param evaluator_class: a :class:`~sb3_gpu.runs.evaluation.TimedEvalCallback` subclass (``evaluator_kwargs`` go to it)
    :return: the run's figures, and the evaluator (for what a subclass recorded)
    """
    evaluator = evaluator_class(
        eval_env,
        eval_freq=max(eval_freq // model.n_envs, 1),
        n_eval_episodes=episodes,
        confirm_episodes=confirm_episodes,
        callback_on_new_best=StopTrainingOnRewardThreshold(threshold),
        verbose=0,
        **evaluator_kwargs,
    )
    with Session(model, evaluator=evaluator) as session:
        outcome = session.learn(max_timesteps)
    if outcome.error is not None:
        raise outcome.error
    best = evaluator.best.mean if evaluator.best is not None else None
    run = ThresholdRun(
        reached=best is not None and best >= threshold,
        timesteps=outcome.timesteps,
        train_seconds=outcome.wall_s - evaluator.seconds,
        best=best,
        stopped_by=outcome.stopped_by,
    )
    return run, evaluator
