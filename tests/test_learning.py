"""Presets really learn: train the bundled CartPole presets to the end and evaluate the final model."""

from __future__ import annotations

import pytest
from stable_baselines3.common.evaluation import evaluate_policy

from sb3_gpu.plan import build_env, build_model, make_plan

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("algo", ["ppo", "dqn"])
def test_cartpole_preset_reaches_475(algo):
    plan = make_plan(algo, "CartPole-v1", device="auto", seed=0)
    model = build_model(plan, build_env(plan))
    model.learn(model.preset_timesteps)
    mean, std = evaluate_policy(model, build_env(plan, evaluation=True), n_eval_episodes=10, deterministic=True)
    assert mean >= 475, f"{algo} on CartPole-v1: {mean:.1f} +/- {std:.1f} after {model.num_timesteps} steps"
