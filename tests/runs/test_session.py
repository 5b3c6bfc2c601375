"""The training Session that train, tune and bench share, on what it must not trip over."""

from __future__ import annotations

import json
import threading

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3.common.vec_env import VecTransposeImage

from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.training import train_run


class TinyImages(gym.Env):
    """36x36 RGB frames (the smallest the Nature CNN takes), episodes of 8 steps."""

    observation_space = gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), float(action), False, self.t >= 8, {}


def test_an_image_run_with_stacked_frames_ends_with_its_final_evaluation(tmp_path):
    # SB3 wraps image envs in VecTransposeImage for training only, so the training and eval env chains differ.
    overrides = {"frame_stack": 2, "n_steps": 16, "batch_size": 16, "n_epochs": 1, "n_envs": 2, "n_timesteps": 64}
    plan = make_plan("ppo", TinyImages, "cpu", vec_env="dummy", overrides=overrides)
    assert plan.preset.policy == "CnnPolicy"
    assert isinstance(build_model(plan, build_env(plan)).get_env(), VecTransposeImage), "the chains do differ"
    summary = train_run(plan, tmp_path / "run", eval_freq=32, eval_episodes=2, progress=False, report_s=None)
    assert summary["interrupted"] is False
    assert 0 <= summary["final_eval_mean"] <= 8, "a return of 8 steps' rewards of 0 or 1"
    assert summary["best"]["checked_mean"] is not None, "the check after training rebuilds an env given as a class"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["eval_episodes"] == 2


def test_a_run_leaves_no_tensorboard_writer_thread_behind(tmp_path):
    # train_run's model goes no further; its writer's thread, left open, piled up with each run of a notebook.
    def writers():
        return sum(
            "EventFileWriter" in type(t).__qualname__ or "AsyncWriter" in type(t).__name__ for t in threading.enumerate()
        )

    before = writers()
    small = {"n_steps": 32, "batch_size": 32, "n_envs": 1, "n_timesteps": 64, "probe": False}
    plan = make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy", overrides=small)
    for i in range(2):
        train_run(plan, tmp_path / f"run{i}", eval_freq=32, eval_episodes=1, progress=False, report_s=None)
    assert list((tmp_path / "run1").rglob("events.out.tfevents.*")), "it did write to TensorBoard"
    assert writers() == before


def test_a_session_forgives_a_failed_recompile_for_a_plain_sb3_model_compiled_by_hand(monkeypatch):
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    from sb3_gpu.extensions.compile import compile_policy
    from sb3_gpu.extensions.networks import policy_networks
    from sb3_gpu.runs.session import Session

    seen = []

    class Look(BaseCallback):
        def _on_step(self):
            seen.append(th._dynamo.config.suppress_errors)
            return True

    model = PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, device="cpu")
    monkeypatch.setattr("sb3_gpu.extensions.compile._trial_step", lambda *args: None)
    assert compile_policy(model, "default", 32) is None
    for module in policy_networks(model).compute:  # marked as compiled; run uncompiled here
        module._compiled_call_impl = None
    with th._dynamo.config.patch(suppress_errors=False):
        with Session(model, callbacks=[Look()]) as session:
            session.learn(32)
        assert seen and all(seen) and th._dynamo.config.suppress_errors is False
