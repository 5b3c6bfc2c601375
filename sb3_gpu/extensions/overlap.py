"""Off-policy training overlapped with collection: the gradient steps of one rollout run on a trainer thread while
the envs step the next one, so the device trains while Python steps the envs.

The schedule keeps SB3's counts: the ``gradient_steps`` earned by rollout k run while rollout k+1 is collected, and
``learn`` waits for the last of them before it returns. What the overlap changes, and how it is kept exact:

- The envs act with a copy of the policy taken when the previous training finished, so a training never changes the
  weights under an inference (the "actor"; refreshed after every wait). Any other ``predict`` (an evaluation
  callback) first waits for the training and uses the learner's weights: the ones a save writes.
- Transitions collected while a training runs are staged and added to the replay buffer when it has finished: a
  training samples exactly the buffer SB3's schedule would give it, and the buffer is never read and written at once.
- ``_on_step`` (the DQN family's target-network copies and exploration rate) is deferred the same way, so a target
  never changes under a training; it runs, in order, when the training has finished.
- The trainer's log records are kept and written by the collecting thread.

- A training reads the progress of ``learn`` (the learning-rate schedule's, PER's beta's) as it was when the
  training was submitted, which is when SB3 would have run it, not as collection has moved it since.
- The envs' exploration draws (DQN's epsilon) come from a generator of the ``learn``'s own, seeded from NumPy's
  global one when it starts: the trainer thread is then the only one that draws from the global generator while a
  training runs, so thread timing cannot reorder the draws, and a seeded run is reproducible.

The one departure from SB3's schedule: the policy that acts lags one rollout (``train_freq`` steps) behind, and so do
the exploration rate and target copies. ``overlap_training=False`` (the class's default) is SB3's exact schedule; a
plan's ``overlap: auto`` overlaps where the model trains on CUDA (:func:`sb3_gpu.planning.buffers.choose_overlap`).
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu.extensions.compile import forgiving_recompiles
from sb3_gpu.extensions.replay import gate_samples
from sb3_gpu.extensions.stepping import policy_optimizers

if TYPE_CHECKING:
    from stable_baselines3.common.type_aliases import MaybeCallback
    from typing_extensions import Self


class _DeferredLogger:
    """What the trainer thread records, kept for the collecting thread to write (SB3's Logger is not thread-safe)."""

    def __init__(self, logger: Any):
        self._logger = logger
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def record(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("record", args, kwargs))

    def record_mean(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("record_mean", args, kwargs))

    def __getattr__(self, name: str) -> Any:  # read-only attributes (level, dir, ...) are the real logger's
        return getattr(self._logger, name)

    def replay(self, logger: Any) -> None:
        calls, self.calls = self.calls, []
        for method, args, kwargs in calls:
            getattr(logger, method)(*args, **kwargs)


class _StagedBuffer:
    """Stands in for the replay buffer while a training runs: ``add`` keeps a private copy of each transition."""

    def __init__(self) -> None:
        self.adds: list[tuple[Any, ...]] = []

    def add(self, *args: Any) -> None:
        self.adds.append(tuple(_copied(a) for a in args))


def _copied(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value  # infos: read, never written, by the buffers


class _Overlap:
    """The state of one overlapped ``learn``: the trainer thread, the actor, and what waits for the training."""

    def __init__(self, learner: th.nn.Module, logger: Any):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sb3_gpu-trainer")
        self.pending: Future[None] | None = None
        self.local = threading.local()  # `acting` on the collecting thread, `training` on the trainer thread
        self.logger = _DeferredLogger(logger)
        self.staged = _StagedBuffer()
        self.deferred_steps = 0
        self.actor = _actor_copy(learner)
        self.rng = np.random.default_rng(np.random.randint(2**63 - 1, dtype=np.int64))  # the envs' exploration draws
        self.progress = 1.0  # the training's progress remaining, taken when it was submitted
        self.normalization: VecNormalize | None = None  # VecNormalize's statistics as they were then (a copy)

    def role(self, name: str) -> bool:
        return bool(getattr(self.local, name, False))


def _actor_copy(policy: th.nn.Module) -> th.nn.Module:
    """A copy of ``policy`` for acting: no optimizer, no gradients, not compiled (a compiled module's call would still
    run the original's weights)."""
    actor = copy.deepcopy(policy, memo={id(o): None for o in policy_optimizers(policy)})
    for module in actor.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    for p in actor.parameters():
        p.grad = None
    return actor.requires_grad_(False)


class _LearnerCallbacks:
    """The callback of ``collect_rollouts``, called with the learner as ``model.policy`` (not the actor): a NaN
    check or a checkpoint in a callback sees the weights that a save writes."""

    def __init__(self, callback: Any, model: OverlappedTraining):
        self.callback, self.model = callback, model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.callback, name)

    def update_locals(self, locals_: dict[str, Any]) -> None:
        self.callback.update_locals(locals_)

    def on_step(self) -> bool:
        with self.model._as("acting", False):
            return bool(self.callback.on_step())

    def on_rollout_start(self) -> None:
        with self.model._as("acting", False):
            self.callback.on_rollout_start()

    def on_rollout_end(self) -> None:
        with self.model._as("acting", False):
            self.callback.on_rollout_end()


class OverlappedTraining:
    """Mixin for SB3's off-policy algorithms: with ``overlap_training`` on, ``learn`` trains on a thread of its own
    while collection goes on (see the module docstring for what that keeps and what it changes)."""

    overlap_training: bool

    # ------------------------------------------------------------------ who sees what
    def _state(self) -> _Overlap | None:
        """The running overlapped ``learn``'s state (None outside one)."""
        return self.__dict__.get("_overlap")

    @property
    def policy(self) -> Any:
        state = self._state()
        if state is not None and state.role("acting"):
            return state.actor
        return self.__dict__["policy"]

    @policy.setter
    def policy(self, value: Any) -> None:
        self.__dict__["policy"] = value

    @property
    def _current_progress_remaining(self) -> float:
        state = self._state()
        if state is not None and state.role("training"):
            return state.progress
        return float(self.__dict__.get("_current_progress_remaining", 1.0))

    @_current_progress_remaining.setter
    def _current_progress_remaining(self, value: float) -> None:
        self.__dict__["_current_progress_remaining"] = value

    @property
    def _vec_normalize_env(self) -> VecNormalize | None:
        # SB3 trains on statistics as they stand at the end of a rollout; the live ones change as the envs step on
        # (mean and var assigned one after the other): a training normalises with a copy taken when it was submitted.
        state = self._state()
        if state is not None and state.role("training"):
            return state.normalization
        return self.__dict__.get("_vec_normalize_env")

    @_vec_normalize_env.setter
    def _vec_normalize_env(self, value: VecNormalize | None) -> None:
        self.__dict__["_vec_normalize_env"] = value

    @property
    def logger(self) -> Any:
        state = self._state()
        if state is not None and state.role("training"):
            return state.logger
        return self._logger  # type: ignore[attr-defined]

    @contextmanager
    def _as(self, role: str, on: bool = True) -> Iterator[None]:
        state = self._state()
        if state is None:
            yield
            return
        before = state.role(role)
        setattr(state.local, role, on)
        try:
            yield
        finally:
            setattr(state.local, role, before)

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_overlap"]  # type: ignore[misc]

    # ------------------------------------------------------------------ the loop
    def learn(
        self,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 4,
        tb_log_name: str | None = None,
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> Self:
        with forgiving_recompiles(self):  # type: ignore[arg-type]
            return self._learn(total_timesteps, callback, log_interval, tb_log_name, reset_num_timesteps, progress_bar)

    def _learn(
        self,
        total_timesteps: int,
        callback: Any,
        log_interval: int,
        tb_log_name: str | None,
        reset_num_timesteps: bool,
        progress_bar: bool,
    ) -> Any:
        sup: Any = super()
        if tb_log_name is None:  # the algorithm's own name, as SB3 gives it ("DQN", "QRDQN")
            tb_log_name = inspect.signature(sup.learn).parameters["tb_log_name"].default
        if not self.overlap_training:
            return sup.learn(total_timesteps, callback, log_interval, tb_log_name, reset_num_timesteps, progress_bar)
        s: Any = self
        # SB3's OffPolicyAlgorithm.learn, with the training started on the trainer thread and waited for one rollout on.
        total_timesteps, callback = s._setup_learn(total_timesteps, callback, reset_num_timesteps, tb_log_name, progress_bar)
        callback.on_training_start(locals(), globals())
        assert s.env is not None, "You must set the environment before calling learn()"
        self.__dict__["_overlap"] = state = _Overlap(self.__dict__["policy"], s._logger)
        in_collection = _LearnerCallbacks(callback, self)
        buffer = s.replay_buffer
        gate_samples(buffer, self._sample_elsewhere)
        try:
            while s.num_timesteps < total_timesteps:
                with self._as("acting"):
                    rollout = s.collect_rollouts(
                        s.env,
                        train_freq=s.train_freq,
                        action_noise=s.action_noise,
                        callback=in_collection,
                        learning_starts=s.learning_starts,
                        replay_buffer=s.replay_buffer,
                        log_interval=log_interval,
                    )
                self.sync_training()
                if not rollout.continue_training:
                    break
                if s.num_timesteps > 0 and s.num_timesteps > s.learning_starts:
                    gradient_steps = s.gradient_steps if s.gradient_steps >= 0 else rollout.episode_timesteps
                    if gradient_steps > 0:
                        state.progress = s._current_progress_remaining
                        state.normalization = copy.deepcopy(self.__dict__.get("_vec_normalize_env"))  # not its envs
                        state.pending = state.pool.submit(self._train_on_thread, gradient_steps)
            self.sync_training()
        finally:
            # After an error here, the training still running is finished (a thread cannot be stopped) and what it
            # held back is applied; its own error, if any, is not the one to report.
            state.pool.shutdown(wait=True)
            self._drain(state)
            self.__dict__["_overlap"] = None
            gate_samples(buffer, None)
        callback.on_training_end()
        return self

    def _sample_elsewhere(self) -> None:
        """Before a sample of the replay buffer from outside the training (a callback's): the running training done,
        since a sample changes the draw state that it reads."""
        state = self._state()
        if state is not None and not state.role("training"):
            self.sync_training()

    def _train_on_thread(self, gradient_steps: int) -> None:
        with self._as("training"), forgiving_recompiles(self):  # type: ignore[arg-type]  # dynamo's: per thread in 2.13
            self.train(batch_size=self.batch_size, gradient_steps=gradient_steps)  # type: ignore[attr-defined]

    def sync_training(self) -> None:
        """Wait for the training that runs in the background (if any), then add the transitions, target updates and
        log records it held back. ``save``, ``save_replay_buffer`` and ``predict`` call it; a callback that reads
        the weights of a model in ``learn`` may too. A training error is raised here."""
        state = self._state()
        future = state.pending if state is not None else None
        if state is None or future is None:
            return
        try:
            future.result()
        except BaseException:
            if not future.done():  # a signal while waiting: the training still runs, and stays pending
                raise
            self._drain(state)
            raise
        self._drain(state)
        state.actor.load_state_dict(self.__dict__["policy"].state_dict())

    def _drain(self, state: _Overlap) -> None:
        """Apply what a finished training held back (its error, if any, is its caller's to raise)."""
        future, state.pending = state.pending, None
        if future is not None:
            assert future.done(), "drained while training"
            self._release(state)

    def _release(self, state: _Overlap) -> None:
        state.logger.replay(self._logger)  # type: ignore[attr-defined]
        adds, state.staged.adds = state.staged.adds, []
        for args in adds:
            self.replay_buffer.add(*args)  # type: ignore[attr-defined]
        steps, state.deferred_steps = state.deferred_steps, 0
        for _ in range(steps):
            super()._on_step()  # type: ignore[misc]

    # ------------------------------------------------------------------ held back while a training runs
    def _store_transition(self, replay_buffer: Any, *args: Any) -> None:
        state = self._state()
        if state is not None and state.pending is not None:
            replay_buffer = state.staged
        super()._store_transition(replay_buffer, *args)  # type: ignore[misc]

    def _on_step(self) -> None:
        state = self._state()
        if state is not None and state.pending is not None:
            state.deferred_steps += 1
        else:
            super()._on_step()  # type: ignore[misc]

    # ------------------------------------------------------------------ the learner's weights, whole
    def _sample_action(self, *args: Any, **kwargs: Any) -> Any:
        with self._as("sampling"):
            return super()._sample_action(*args, **kwargs)  # type: ignore[misc]

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state()
        if state is not None and state.role("sampling") and hasattr(self, "exploration_rate"):
            return self._explore(state.rng, *args, **kwargs)
        if state is None or state.role("sampling"):
            return super().predict(*args, **kwargs)  # type: ignore[misc]
        # Anything but the envs' own actions (an evaluation callback, say) sees the weights a save would write, so that
        # a best model is the model that was evaluated.
        self.sync_training()
        with self._as("acting", False):
            return super().predict(*args, **kwargs)  # type: ignore[misc]

    def _explore(
        self,
        rng: np.random.Generator,
        observation: Any,
        state: Any = None,
        episode_start: Any = None,
        deterministic: bool = False,
    ) -> Any:
        """DQN's epsilon-greedy ``predict``, its one draw taken from ``rng``: random actions for every env at once, with
        probability ``exploration_rate``."""
        s: Any = self
        if deterministic or rng.random() >= s.exploration_rate:
            return s.policy.predict(observation, state, episode_start, deterministic)
        if not s.policy.is_vectorized_observation(observation):
            return np.array(s.action_space.sample()), state
        first = next(iter(observation.values())) if isinstance(observation, dict) else observation
        return np.array([s.action_space.sample() for _ in range(len(first))]), state

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.sync_training()
        with self._as("acting", False):
            super().save(*args, **kwargs)  # type: ignore[misc]

    def get_parameters(self) -> dict[str, dict]:
        self.sync_training()
        with self._as("acting", False):
            return super().get_parameters()  # type: ignore[misc]

    def set_parameters(self, *args: Any, **kwargs: Any) -> None:
        self.sync_training()
        with self._as("acting", False):
            super().set_parameters(*args, **kwargs)  # type: ignore[misc]
        state = self._state()
        if state is not None:
            state.actor.load_state_dict(self.__dict__["policy"].state_dict())

    def save_replay_buffer(self, *args: Any, **kwargs: Any) -> None:
        self.sync_training()
        super().save_replay_buffer(*args, **kwargs)  # type: ignore[misc]
