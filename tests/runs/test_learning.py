"""Presets really learn: train the bundled CartPole presets as `train` does and evaluate what the run keeps.

DQN's final network on CartPole can still collapse late in a run (seen here: seed 0 ended at 452 with two torch
threads and at 500 with one), which is why a run keeps its best model by periodic evaluation and `evaluate` uses
it by default. The test re-evaluates that best model on 20 fresh episodes, so selection noise cannot pass it.
"""

from __future__ import annotations

import json

import pytest

from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.evaluation import evaluate_run
from sb3_gpu.runs.training import train_run

pytestmark = pytest.mark.slow


# bf16 autocast on the CPU (AMP's CPU twin of the GPU path): the presets still learn in lower precision.
@pytest.mark.parametrize(("algo", "amp"), [("ppo", "auto"), ("dqn", "auto"), ("ppo", "bf16"), ("dqn", "bf16")])
def test_cartpole_preset_reaches_475(algo, amp, tmp_path):
    plan = make_plan(algo, "CartPole-v1", device="cpu" if amp == "bf16" else "auto", seed=0, overrides={"amp": amp})
    assert plan.speed is not None and (amp == "auto" or plan.speed.amp == amp)
    summary = train_run(plan, tmp_path / "run", eval_episodes=5, progress=False)
    assert summary["timesteps"] >= plan.preset.n_timesteps
    best = evaluate_run(tmp_path / "run", episodes=20, seed=123)
    assert best["model"].endswith("best_model.zip")
    assert best["mean"] >= 475, f"{algo}: best model {best['mean']:.1f} +/- {best['std']:.1f}; {json.dumps(summary)}"
    if algo == "ppo":  # PPO's final model is reliable too: the quick start promises it
        assert summary["final_eval_mean"] >= 475, summary
