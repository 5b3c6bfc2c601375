"""Training overlapped with collection (extensions.overlap), on the CPU: the same tensor code and thread hand-offs a
GPU run takes. What must hold: SB3's counts, a training that sees the buffer and target network as SB3's schedule
would give them, an actor that a training never changes under an inference, and errors and saves that lose nothing."""

from __future__ import annotations

import csv
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from sb3_contrib import QRDQN
from stable_baselines3 import DQN
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure
from stable_baselines3.common.utils import get_linear_fn

from sb3_gpu.extensions.networks import policy_networks
from sb3_gpu.extensions.per import DevicePrioritizedReplayBuffer, PrioritizedDQN, PrioritizedQRDQN, PrioritizedReplayBuffer
from sb3_gpu.extensions.replay import DeviceReplayBuffer

SMALL = {"learning_starts": 64, "train_freq": 4, "batch_size": 16, "buffer_size": 2_000, "target_update_interval": 40}
POLICY = {"net_arch": [16]}


def dqn(cls=PrioritizedDQN, n_envs=1, seed=0, **kwargs):
    env = make_vec_env("CartPole-v1", n_envs=n_envs, seed=seed)
    kwargs = {**SMALL, "policy_kwargs": POLICY, **kwargs}
    return cls("MlpPolicy", env, seed=seed, device="cpu", **kwargs)


@pytest.mark.heavy
def test_a_seeded_overlapped_run_is_reproducible():
    # The envs explore with draws of their own: the trainer thread's draws from NumPy's global generator (the replay
    # buffer's) cannot be reordered by thread timing; and a training reads the learning rate's schedule as it was
    # when the training was submitted.
    kwargs = {"exploration_fraction": 0.5, "learning_rate": get_linear_fn(1e-3, 1e-4, 1.0)}
    first, second = (dqn(overlap_training=True, n_envs=2, **kwargs).learn(3000) for _ in range(2))
    assert first._n_updates > 100
    for a, b in zip(first.policy.state_dict().values(), second.policy.state_dict().values(), strict=True):
        assert th.equal(a, b)


def test_overlapped_exploration_acts_at_random_with_probability_exploration_rate():
    # The envs' epsilon-greedy draws come from a generator of their own: an inverted test of the draw went unnoticed.
    model = dqn(overlap_training=True, n_envs=4)
    observation = model.env.reset()
    greedy, _ = model.policy.predict(observation, deterministic=True)
    rng = np.random.default_rng(0)
    model.exploration_rate = 0.0
    assert all(np.array_equal(model._explore(rng, observation)[0], greedy) for _ in range(20))
    model.exploration_rate = 1.0
    drawn = np.stack([model._explore(rng, observation)[0] for _ in range(200)])
    assert drawn.shape == (200, 4) and 0.35 < (drawn == greedy).mean() < 0.65  # two actions, each drawn half the time


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("cls", "name"), [(PrioritizedDQN, "DQN"), (PrioritizedQRDQN, "QRDQN")])
def test_tensorboard_runs_take_sb3s_name_for_the_algorithm(cls, name, overlap, tmp_path):
    dqn(cls, overlap_training=overlap, tensorboard_log=str(tmp_path)).learn(100)
    dqn(cls, overlap_training=overlap, tensorboard_log=str(tmp_path)).learn(100, tb_log_name="mine")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}_1", "mine_1"]


def trainer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("sb3_gpu-trainer")]


def test_off_is_sb3s_exact_schedule():
    ours, theirs = dqn(overlap_training=False).learn(600), dqn(DQN).learn(600)
    for a, b in zip(ours.policy.state_dict().values(), theirs.policy.state_dict().values(), strict=True):
        assert th.equal(a, b)


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (PrioritizedDQN, {}),
        (PrioritizedDQN, {"replay_buffer_class": PrioritizedReplayBuffer}),
        (PrioritizedDQN, {"replay_buffer_class": DeviceReplayBuffer, "n_envs": 3}),
        (PrioritizedDQN, {"replay_buffer_class": DevicePrioritizedReplayBuffer, "grad_accum_steps": 2}),
        (PrioritizedQRDQN, {"gradient_steps": -1}),
    ],
    ids=["dqn", "host-per", "device-buffer-3-envs", "device-per-accumulated", "qrdqn-one-step-per-env-step"],
)
def test_the_same_steps_gradient_steps_transitions_and_target_updates_as_sb3s_schedule(cls, kwargs):
    n_envs = kwargs.pop("n_envs", 1)
    sync = dqn(cls, n_envs=n_envs, **kwargs).learn(800)
    overlapped = dqn(cls, n_envs=n_envs, overlap_training=True, **kwargs).learn(800)
    for attr in ("num_timesteps", "_n_updates", "_n_calls", "exploration_rate"):
        assert getattr(overlapped, attr) == getattr(sync, attr), attr
    assert overlapped.replay_buffer.size() == sync.replay_buffer.size()
    assert overlapped.policy is overlapped.__dict__["policy"] and overlapped.__dict__.get("_overlap") is None
    assert trainer_threads() == []


class Watch(BaseCallback):
    """Notes, on the collecting thread, each env step and which policy a callback sees."""

    def __init__(self):
        super().__init__()
        self.stepped = threading.Event()
        self.actors: set[bool] = set()
        self.rollout_ends: list[int] = []

    def _on_step(self):
        self.actors.add(self.model.policy is self.model.__dict__["policy"])
        self.stepped.set()
        return True

    def _on_rollout_end(self):
        self.rollout_ends.append(self.num_timesteps)


def test_a_training_sees_the_buffer_and_targets_as_they_were_when_it_started_while_the_envs_step_on():
    model, watch, seen = dqn(overlap_training=True), Watch(), []
    train = model.train

    def held_train(gradient_steps, batch_size):
        # The training of the n-th rollout after learning_starts: `at` is where that rollout ended.
        at = [end for end in watch.rollout_ends if end > SMALL["learning_starts"]][len(seen)]
        size, calls = model.replay_buffer.size(), model._n_calls
        while at + 8 <= 600 and model.num_timesteps < at + 2:  # another rollout follows: hold this training
            watch.stepped.clear()  # until the envs have stepped twice
            if model.num_timesteps < at + 2:
                assert watch.stepped.wait(30)
        seen.append((at, size, calls, model.num_timesteps, model.replay_buffer.size(), model._n_calls))
        train(gradient_steps, batch_size)

    model.train = held_train
    predict, acting = model.predict, set()

    def watched_predict(*args, **kwargs):  # what _sample_action calls for the envs' actions
        state = model.__dict__.get("_overlap")
        acting.add(state is not None and model.policy is state.actor)
        return predict(*args, **kwargs)

    model.predict = watched_predict
    model.learn(600, callback=watch)
    assert len(seen) == model._n_updates  # one gradient step per rollout here
    held = [(at, after) for at, _, _, after, _, _ in seen if at + 8 <= 600]
    assert len(held) > 100 and all(after > at for at, after in held)  # the envs stepped while it trained ...
    assert all(size == at == size_after for at, size, _, _, size_after, _ in seen)  # ... into the staging area
    assert all(calls == calls_after for _, _, calls, _, _, calls_after in seen)  # targets untouched meanwhile
    assert model._n_calls == model.num_timesteps and model.replay_buffer.size() == 600
    assert acting == {True}  # the envs always acted with the actor copy ...
    assert watch.actors == {True}  # ... and callbacks saw the learner, whose weights a checkpoint saves


def test_the_actor_is_a_frozen_copy_that_catches_up_after_each_training():
    model, checks = dqn(overlap_training=True), []

    class Check(BaseCallback):
        def _on_step(self):
            if self.num_timesteps == 300:
                actor, learner = self.model.__dict__["_overlap"].actor, self.model.policy  # a callback sees the learner
                model.sync_training()
                checks.append(actor is not learner and actor.optimizer is None and learner is model.__dict__["policy"])
                checks.append(not any(p.requires_grad for p in actor.parameters()))
                checks.append(
                    all(
                        th.equal(a, b) for a, b in zip(actor.state_dict().values(), learner.state_dict().values(), strict=True)
                    )
                )
                with th.no_grad():  # a change to the learner does not reach the actor until the next wait
                    next(learner.parameters()).add_(1.0)
                checks.append(not th.equal(next(actor.parameters()), next(learner.parameters())))
            return True

    model.learn(400, callback=Check())
    assert checks == [True] * 4


def test_an_evaluation_during_learn_sees_the_weights_a_save_writes():
    model, checks = dqn(overlap_training=True), []
    obs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)

    class Evaluate(BaseCallback):
        def _on_step(self):
            if self.num_timesteps == 300:
                state = self.model.__dict__["_overlap"]
                checks.append(state.pending is not None)  # a training runs now
                with th.no_grad():
                    for p in state.actor.parameters():
                        p.zero_()  # an actor that answers differently from the learner
                actions, _ = self.model.predict(obs, deterministic=True)
                checks.append(state.pending is None)  # predict waited for the training ...
                learner = self.model.__dict__["policy"]
                checks.append(np.array_equal(actions, learner.predict(obs, deterministic=True)[0]))  # ... and used it
                checks.append(actions.any())  # not the zeroed actor's answer (action 0 everywhere)
            return True

    model.learn(400, callback=Evaluate())
    assert checks == [True] * 4


def test_the_trainers_log_records_are_written_by_the_collecting_thread(tmp_path):
    model = dqn(overlap_training=True)
    model.set_logger(configure(str(tmp_path), ["csv"]))
    model.learn(1_000, log_interval=1)
    with open(tmp_path / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 3 and all(np.isfinite(losses))
    assert int(rows[-1]["train/n_updates"]) <= model._n_updates


def test_a_training_error_is_raised_by_learn_and_the_model_saves_and_loads(tmp_path):
    model, calls = dqn(overlap_training=True), []
    train = model.train

    def failing_train(gradient_steps, batch_size):
        calls.append(1)
        if len(calls) == 5:
            raise FloatingPointError("the loss is NaN")
        train(gradient_steps, batch_size)

    model.train = failing_train
    with pytest.raises(FloatingPointError, match="the loss is NaN"):
        model.learn(2_000)
    assert trainer_threads() == [] and model.__dict__.get("_overlap") is None
    assert model.replay_buffer.size() == model.num_timesteps  # the staged transitions were kept
    model.save(tmp_path / "model.zip")
    loaded = PrioritizedDQN.load(tmp_path / "model.zip", device="cpu")
    assert loaded.overlap_training is True and loaded.num_timesteps == model.num_timesteps


def test_a_collection_error_is_the_one_reported_and_the_training_is_waited_for():
    model = dqn(overlap_training=True)

    class Crash(BaseCallback):
        def _on_step(self):
            if self.num_timesteps == 200:
                raise ConnectionError("env worker died")
            return True

    with pytest.raises(ConnectionError, match="env worker died"):
        model.learn(1_000, callback=Crash())
    assert trainer_threads() == []
    # Every step before the crash was stored and counted (the crashing step's callback ran first, as in SB3).
    assert model._n_calls == model.replay_buffer.size() == model.num_timesteps - 1


def test_a_save_during_learn_holds_the_learners_weights_as_they_are_then(tmp_path):
    model, saved = dqn(overlap_training=True), {}

    class SaveAt(BaseCallback):
        def _on_step(self):
            if self.num_timesteps == 300:
                self.model.save(tmp_path / "mid.zip")
                saved.update({k: v.clone() for k, v in self.model.__dict__["policy"].state_dict().items()})
            return True

    model.learn(500, callback=SaveAt())
    loaded = PrioritizedDQN.load(tmp_path / "mid.zip", device="cpu")
    for key, value in loaded.policy.state_dict().items():
        assert th.equal(value, saved[key]), key
    assert not th.equal(loaded.policy.state_dict()["q_net.q_net.0.weight"], model.policy.state_dict()["q_net.q_net.0.weight"])


def test_qrdqn_overlapped_learns_as_its_plain_class_is_built():
    model = dqn(PrioritizedQRDQN, overlap_training=True, policy_kwargs={"net_arch": [16], "n_quantiles": 5})
    assert isinstance(model, QRDQN)
    model.learn(300)
    assert model._n_updates == (300 - 64) // 4


class _DictObs(gym.ObservationWrapper):
    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({"state": env.observation_space, "flag": gym.spaces.Discrete(2)})

    def observation(self, observation):
        return {"state": observation, "flag": int(observation[0] > 0)}


@pytest.mark.parametrize("cls", [PrioritizedDQN, PrioritizedQRDQN])
def test_the_dqn_family_trains_on_dict_observations_in_sb3s_dict_buffer(cls):
    # QR-DQN's loss took the batch size from the observations, which a Dict space gives as a dict.
    env = make_vec_env(lambda: _DictObs(gym.make("CartPole-v1")), n_envs=1, seed=0)
    model = cls("MultiInputPolicy", env, seed=0, device="cpu", overlap_training=True, **SMALL, policy_kwargs=POLICY)
    before = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(200)
    assert model._n_updates == (200 - 64) // 4
    after = list(model.policy.parameters())
    assert all(th.isfinite(p).all() for p in after) and not all(th.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_checkpoint_during_learn_waits_for_the_training_and_keeps_every_transition(tmp_path):
    from sb3_gpu.runs.rundir import StateFiles
    from sb3_gpu.runs.saving import load_replay_buffer, save_state

    model, seen = dqn(overlap_training=True, replay_buffer_class=PrioritizedReplayBuffer), {}
    files = StateFiles(tmp_path / "model.zip", tmp_path / "vecnormalize.pkl", tmp_path / "replay_buffer.pkl")

    class Checkpoint(BaseCallback):
        def _on_step(self):
            if self.num_timesteps == 301:
                seen["pending"] = self.model.__dict__["_overlap"].pending is not None
                save_state(self.model, files, replay_buffer=True)
                seen["after"] = self.model.__dict__["_overlap"].pending is None
                seen["stored"] = self.model.num_timesteps - 1  # this step's transition is stored after its callback
            return True

    model.learn(400, callback=Checkpoint())
    assert seen["pending"] and seen["after"]
    restored = dqn(replay_buffer_class=PrioritizedReplayBuffer)
    load_replay_buffer(restored, files.replay_buffer)
    assert restored.replay_buffer.size() == seen["stored"]  # the staged transitions were in the saved buffer


@pytest.mark.parametrize("buffer_class", [DevicePrioritizedReplayBuffer, PrioritizedReplayBuffer, DeviceReplayBuffer])
def test_a_callbacks_sample_waits_for_the_running_training_whose_draw_state_it_would_change(buffer_class):
    # A sample draws with the buffer's own state (PER's strata and last draw, its generator): taken while a training
    # samples on its thread, a batch of 4 broke the training's batch of 16 (a size mismatch in the device PER buffer).
    seen = []

    class Sampling(BaseCallback):
        def _on_step(self):
            if self.num_timesteps > 100:  # trainings began at 64
                state = self.model.__dict__["_overlap"]
                running = state.pending is not None
                self.model.replay_buffer.sample(4)
                seen.append((running, state.pending is None))
            return True

    model = dqn(overlap_training=True, replay_buffer_class=buffer_class)
    model.learn(400, callback=Sampling())
    assert all(after for _, after in seen) and any(running for running, _ in seen)
    if buffer_class is DevicePrioritizedReplayBuffer:
        assert len(model.replay_buffer._strata) == SMALL["batch_size"]  # the training's, whose address a graph fixes
    model.replay_buffer.sample(4)  # after learn: at once


def test_a_signal_while_waiting_leaves_the_training_pending():
    model = dqn(overlap_training=True)

    class Interrupted:
        def result(self):
            raise KeyboardInterrupt

        def done(self):
            return False

    class Check(BaseCallback):
        def _on_step(self):
            if self.num_timesteps == 200:
                state = self.model.__dict__["_overlap"]
                real, state.pending = state.pending, Interrupted()
                with pytest.raises(KeyboardInterrupt):
                    self.model.sync_training()
                assert isinstance(state.pending, Interrupted)  # nothing was released under a running training
                state.pending = real
            return True

    model.learn(300, callback=Check())
    assert model._n_calls == model.num_timesteps and model.replay_buffer.size() == 300


def test_a_resumed_model_follows_this_plans_schedule_not_the_saved_ones(tmp_path):
    from sb3_gpu.planning.build import build_env, build_model
    from sb3_gpu.planning.plan import make_plan
    from sb3_gpu.runs.saving import load_plan_model

    def plan(overlap):
        overrides = {"overlap_training": overlap, "per": True, "buffer_size": 500, "learning_starts": 32}
        return make_plan("dqn", "CartPole-v1", "cpu", vec_env="dummy", overrides=overrides)

    saved = build_model(plan(True), build_env(plan(True)))
    saved.save(tmp_path / "model.zip")
    assert load_plan_model(plan(False), tmp_path / "model.zip", build_env(plan(False))).overlap_training is False
    assert load_plan_model(plan(True), tmp_path / "model.zip", build_env(plan(True))).overlap_training is True


def test_a_training_normalises_with_the_statistics_of_its_submission_while_the_envs_update_theirs():
    # SB3 trains after a rollout on VecNormalize's statistics as they then are. Overlapped, the envs step on (and
    # update the statistics, mean and var one after the other) while the training samples: it takes a copy.
    import time

    from stable_baselines3.common.vec_env import VecNormalize

    env = VecNormalize(make_vec_env("CartPole-v1", n_envs=2, seed=0))
    model = PrioritizedDQN("MlpPolicy", env, seed=0, device="cpu", overlap_training=True, policy_kwargs=POLICY, **SMALL)
    live = model.get_vec_normalize_env()
    seen: list[tuple[bool, float, float, float]] = []
    train = model.train

    def waiting_train(gradient_steps, batch_size=100):
        used = model._vec_normalize_env  # on the trainer thread: what this training normalises with
        start, deadline = live.obs_rms.count, time.monotonic() + 2.0
        while live.obs_rms.count == start and time.monotonic() < deadline:  # let the envs step on meanwhile
            time.sleep(0.001)
        train(gradient_steps, batch_size)
        after = model._vec_normalize_env.obs_rms.count
        seen.append((used is live, float(used.obs_rms.count), float(after), float(live.obs_rms.count)))

    model.train = waiting_train
    model.learn(200)
    assert len(seen) > 10 and model._vec_normalize_env is live  # outside a training: the envs' own
    # Each training's statistics are a copy, and stayed as they were at its start while the live ones moved on (all
    # but the last training, after which the envs stop).
    assert all(not is_live and before == after for is_live, before, after, _ in seen), seen[:3]
    assert all(now > after for _, _, after, now in seen[:-1]), seen[:3]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_skipped_on_the_device_for_a_nan_stops_the_run_at_a_log_write_overlapped_or_not(overlap):
    # SB3 writes its logs from inside the collection, where the overlapped model's policy is the actor copy, which has
    # no optimizers: the NaN guard's flags must still be read there (from the learner's), not at the end of learn.
    from sb3_gpu.common.errors import TrainingDiverged
    from sb3_gpu.extensions.stepping import optimizer_steps
    from sb3_gpu.runs.callbacks import NanGuard
    from tests.fault_envs import FaultyCartPoleV1

    env = make_vec_env(FaultyCartPoleV1, n_envs=1, seed=0, env_kwargs={"nan_at": 600})
    policy_kwargs = {**POLICY, "optimizer_kwargs": {"fused": True}}  # a fused Adam skips a NaN step on the device
    model = PrioritizedDQN(
        "MlpPolicy", env, **SMALL, overlap_training=overlap, seed=0, device="cpu", policy_kwargs=policy_kwargs
    )
    assert all(step.skips_on_device for step in optimizer_steps(model))
    with pytest.raises(TrainingDiverged, match=r"NaN or inf at \d"):
        model.learn(20_000, callback=NanGuard(), log_interval=1)  # a log write at the end of every episode
    assert 600 <= model.num_timesteps < 1_500  # within a few episodes of the first NaN reward, not 20,000 steps on


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_model_forgives_a_failed_recompile_on_each_thread_that_trains_it_and_only_while_it_does(
    monkeypatch, overlap, compiled
):
    # dynamo keeps its settings per thread: the trainer thread of an overlapped run needs its own, and a user's own
    # compile outside learn keeps the process's (compile_policy once left it on for good).
    from sb3_gpu.extensions.compile import compile_policy

    model, seen = dqn(overlap_training=overlap), []
    if compiled:
        monkeypatch.setattr("sb3_gpu.extensions.compile._trial_step", lambda *args: None)
        assert compile_policy(model, "default", SMALL["batch_size"]) is None
        for module in policy_networks(model).compute:  # the trial's marks stay; the networks run uncompiled here
            module._compiled_call_impl = None
    train = model.train

    def watched(*args, **kwargs):
        seen.append((threading.current_thread().name, th._dynamo.config.suppress_errors))
        return train(*args, **kwargs)

    model.train = watched
    with th._dynamo.config.patch(suppress_errors=False):
        model.learn(200)
        assert th._dynamo.config.suppress_errors is False
    assert seen and all(flag is compiled for _, flag in seen)
    assert all(name.startswith("sb3_gpu-trainer") for name, _ in seen) == overlap
