"""Presets really learn: train the bundled CartPole presets as `train` does and evaluate what the run keeps.

DQN's final network on CartPole can still collapse late in a run, which is why a run keeps its best model, confirmed
on fresh episodes, and `evaluate` uses it by default. The test re-evaluates that best model on 20 fresh episodes, so
a lucky evaluation cannot pass it, and checks that they agree with the figure the run reported.

The seed is 0; ``SB3_GPU_TEST_SEED=N`` runs the same tests on seed N (the presets must hold on every seed: run them
over many before trusting a change to a preset).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

from sb3_gpu.benches.solve import FRESH_SEED_OFFSET
from sb3_gpu.extensions.compile import CompileFallbackWarning
from sb3_gpu.extensions.graphstep import CompiledUpdate
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.evaluation import evaluate_run
from sb3_gpu.runs.training import train_run

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("SB3_GPU_TEST_SEED", "0"))
EPISODES = 20

# bf16 autocast on the CPU (AMP's CPU twin of the GPU path): the presets still learn in lower precision. The device
# data path on the CPU (the same tensor code as on a GPU): device buffers (DQN's with its PER trees on the device),
# and DQN's training overlapped with collection. DQN's CartPole preset uses prioritized replay; it must also solve
# with uniform replay.
CASES = {
    "ppo": ("ppo", "auto", {}),
    "dqn": ("dqn", "auto", {}),
    "dqn-no-per": ("dqn", "auto", {"per": False}),  # the preset's prioritized replay off: uniform replay
    "qrdqn": ("qrdqn", "auto", {}),
    "ppo-bf16": ("ppo", "bf16", {}),
    "dqn-bf16": ("dqn", "bf16", {}),
    "ppo-device-buffers": ("ppo", "auto", {"device_buffers": True}),
    "dqn-device-buffers": ("dqn", "auto", {"device_buffers": True}),  # with the preset's PER: the trees there too
    "dqn-overlapped": ("dqn", "auto", {"overlap_training": True}),
    # Each gradient step compiled whole (inductor on the CPU): the updates are SB3's, up to float rounding. (DQN's
    # compiled preset solved 19 of 20 seeds, seed 5 at 452.8, so it is not a test that cannot fail.)
    "ppo-compiled": ("ppo", "auto", {"compile": "default"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cartpole_preset_reaches_475(case, tmp_path):
    algo, amp, overrides = CASES[case]
    device = "cpu" if {"device_buffers", "overlap_training"} & set(overrides) else "auto"
    # Eager unless the case is about compiling, fp32 unless it is about bf16, and DummyVecEnv: the probe's choices and
    # the vec env's follow the machine's speed and load (a loaded one times a slower eager step, and compiles; slower
    # env steps take EnvPool), and the seed would not fix the trajectories. (On this CPU, auto takes fp32 and eager.)
    overrides = {"amp": "off" if amp == "auto" else amp, "compile": "false", **overrides}
    plan = make_plan(algo, "CartPole-v1", device=device, seed=SEED, vec_env="dummy", overrides=overrides)
    assert plan.speed is not None and plan.speed.amp == overrides["amp"]
    if "device_buffers" in overrides:
        assert plan.buffers == "device"
    if "overlap_training" in overrides:
        assert plan.training == "overlapped"
    if "compile" in overrides:
        assert plan.speed.compile == overrides["compile"]
    summary = train_run(plan, tmp_path / "run", progress=False, report_s=None)
    assert summary["timesteps"] >= plan.preset.n_timesteps
    fresh = evaluate_run(tmp_path / "run", episodes=EPISODES, seed=SEED + FRESH_SEED_OFFSET)
    assert fresh["model"].endswith("best_model.zip")
    report = f"{case}, seed {SEED}: best model {fresh['mean']:.1f} +/- {fresh['std']:.1f}; {json.dumps(summary)}"
    assert fresh["mean"] >= 475, report
    # The run's reported best is what a user gets: the fresh episodes agree with it within two standard errors.
    best = summary["best"]
    assert best["confirmed"], report
    assert best["checked_episodes"] == 30, report  # the figure reported: the best model evaluated after training
    error = (fresh["std"] ** 2 / EPISODES + best["checked_std"] ** 2 / best["checked_episodes"]) ** 0.5
    assert fresh["mean"] >= best["checked_mean"] - 2 * error, report
    if algo == "ppo":  # PPO's final model is reliable too: the quick start promises it
        assert summary["final_eval_mean"] >= 475, summary


# Short runs, stopped before they solve: returns are noisy there, and the best of several confirmed figures leans high
# (by up to two standard errors on these seeds). The figure a run reports is taken after the choice, so `evaluate`
# agrees with it. Both figures are unbiased then, so a two-standard-error bound on each seed alone would fail one
# comparison in 44 by chance: the bound of two holds for the seeds together, and each seed gets three.
SHORT_RUNS = {"dqn": 6000, "qrdqn": 6000, "ppo": 8000}


@pytest.mark.parametrize("algo", list(SHORT_RUNS))
def test_evaluate_agrees_with_the_reported_best_before_the_env_is_solved(algo, tmp_path):
    gaps, variances, unsolved = [], [], 0
    for seed in range(SEED, SEED + 4):
        # Eager, fp32 and DummyVecEnv whatever the machine's speed (as above)
        eager = {"compile": "false", "amp": "off"}
        plan = make_plan(algo, "CartPole-v1", "cpu", seed=seed, n_timesteps=SHORT_RUNS[algo], vec_env="dummy", overrides=eager)
        summary = train_run(plan, tmp_path / str(seed), progress=False, report_s=None)
        fresh = evaluate_run(tmp_path / str(seed), episodes=EPISODES, seed=seed + FRESH_SEED_OFFSET)
        best = summary["best"]
        assert summary["best_eval_mean"] == best["checked_mean"], summary
        gaps.append(fresh["mean"] - best["checked_mean"])
        variances.append(fresh["std"] ** 2 / EPISODES + best["checked_std"] ** 2 / best["checked_episodes"])
        assert gaps[-1] >= -3 * variances[-1] ** 0.5, f"seed {seed}: {fresh}; {best}"
        unsolved += best["checked_mean"] < 475
    assert sum(gaps) >= -2 * sum(variances) ** 0.5, f"fresh minus reported, by seed: {gaps}"
    assert unsolved >= 3  # the runs stop before most solve, or agreement would be trivial


# SAC and TD3 learn Pendulum-v1 (a random policy scores about -1,200; the presets reach -200 by 20,000 steps) on the
# GPU's data path run on the CPU: the replay buffer as device tensors, each gradient step one compiled graph sampled
# inside it. Cut to CI's time: 64-wide networks, 128-sample batches, learning from 1,000 steps (TD3's GPU profile
# waits 10,000), and 8,000 steps for SAC (at 6,000, seed 19 of 0-19 had not learned yet: -573), 10,000 for TD3, which
# learns more slowly with these small networks.
SMALL_PENDULUM = {"net_arch": [64, 64], "batch_size": 128, "learning_starts": 1_000}
PENDULUM = {"sac": {**SMALL_PENDULUM, "n_timesteps": 8_000}, "td3": {**SMALL_PENDULUM, "n_timesteps": 10_000}}


@pytest.mark.parametrize("algo", list(PENDULUM))
def test_pendulum_is_learned_by_the_compiled_step_on_a_device_buffer(algo, tmp_path, monkeypatch):
    # fp32, as measured over seeds 0-19 (on a CPU with AMX the probe could take bf16)
    overrides = {"compile": "default", "device_buffers": True, "amp": "off", **PENDULUM[algo]}
    plan = make_plan(algo, "Pendulum-v1", device="cpu", seed=SEED, overrides=overrides)
    assert plan.buffers == "device" and plan.speed is not None and plan.speed.compile == "default"
    compiled_calls: list[bool] = []  # per gradient step: whether it ran as the compiled graph
    call = CompiledUpdate.__call__

    def counted(self, *inputs, **kwargs):
        compiled_calls.append(self._compiled != self._run)
        return call(self, *inputs, **kwargs)

    monkeypatch.setattr(CompiledUpdate, "__call__", counted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        summary = train_run(plan, tmp_path / "run", progress=False, report_s=None)
    assert summary["timesteps"] >= PENDULUM[algo]["n_timesteps"]
    # What learned was the compiled step, every gradient step of it, not torch's eager fallback.
    assert not [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    n = PENDULUM[algo]["n_timesteps"] - SMALL_PENDULUM["learning_starts"]
    assert len(compiled_calls) >= n and all(compiled_calls), (len(compiled_calls), compiled_calls.count(False))
    fresh = evaluate_run(tmp_path / "run", episodes=EPISODES, seed=SEED + FRESH_SEED_OFFSET)
    report = f"{algo}, seed {SEED}: best model {fresh['mean']:.1f} +/- {fresh['std']:.1f}; {json.dumps(summary)}"
    assert fresh["model"].endswith("best_model.zip") and fresh["mean"] >= -400, report
