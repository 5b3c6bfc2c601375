"""SAC, TD3 and TQC: planned from their presets, trained with SB3's own train(), and refused where sb3_gpu's speed
machinery (AMP, compiled steps, device buffers, PER, overlap) does not apply to them yet."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sb3_contrib import TQC
from stable_baselines3 import SAC, TD3
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.noise import NormalActionNoise

from sb3_gpu import make_model, make_plan
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.evaluate import main as evaluate_main
from sb3_gpu.extensions.compile import CompileFallbackWarning
from sb3_gpu.extensions.continuous import SyncFreeSAC, SyncFreeTD3, SyncFreeTQC
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.planning.build import model_class, model_kwargs
from sb3_gpu.runs.telemetry import ThroughputCallback
from sb3_gpu.train import main as train_main

CLASSES = {"sac": SAC, "td3": TD3, "tqc": TQC}
SYNC_FREE = {"sac": SyncFreeSAC, "td3": SyncFreeTD3, "tqc": SyncFreeTQC}


@pytest.mark.parametrize("algo", list(CLASSES))
@pytest.mark.parametrize("machine", ["cpu_machine", "gpu_machine"])
def test_the_plan_takes_the_env_entry_and_says_why_amp_and_compile_stay_off(algo, machine, request):
    plan = make_plan(algo, "Pendulum-v1", hardware=request.getfixturevalue(machine))
    assert plan.preset.entry == f"{algo}.yaml:Pendulum-v1" and plan.preset.n_timesteps == 20_000
    speed = plan.speed
    assert speed is not None and speed.amp == "off" and speed.compile == "false"
    assert "AMP is for ppo, dqn and qrdqn so far" in speed.amp_reason
    assert f"the probe does not time {algo}'s step yet); compile=default compiles" in speed.compile_reason
    assert plan.training == "sync" and f"not {algo}" in plan.training_reason
    assert plan.action_shape == (1,)
    kwargs = model_kwargs(plan)
    optimizer_kwargs = kwargs["policy_kwargs"].get("optimizer_kwargs") or {}
    if machine == "gpu_machine":  # the rules' choice, and the plan says that nothing timed it
        assert plan.device.device == "cuda:0" and "the probe times ppo, dqn and qrdqn only" in plan.device.reason
        # On the GPU: the replay buffer there, sb3_gpu's sync-free step, fused Adam (the NaN guard skips on the device)
        assert plan.buffers == "device" and kwargs["replay_buffer_class"] is DeviceReplayBuffer
        assert model_class(plan) is SYNC_FREE[algo] and optimizer_kwargs == {"fused": True}
    else:  # on the CPU, SB3's own classes, as nothing is compiled
        assert plan.buffers == "host" and "replay_buffer_class" not in kwargs and "fused" not in optimizer_kwargs
        assert model_class(plan) is CLASSES[algo]


class _NoProbe:
    """A prober that fails the test if the plan asks it anything: nothing is timed for these algorithms."""

    def __getattr__(self, name):
        raise AssertionError(f"the plan called the prober's {name}")


@pytest.mark.parametrize("algo", list(CLASSES))
def test_the_plan_times_nothing_for_them_even_where_it_could(algo, cpu_machine):
    plan = make_plan(algo, "Pendulum-v1", hardware=cpu_machine, prober=_NoProbe())  # type: ignore[arg-type]
    assert plan.probe is None and plan.preset.probe is False and plan.preset.sources["probe"] == f"{algo}: not probed yet"


def test_td3s_action_noise_is_sb3s_gaussian_noise_of_the_action_shape():
    plan = make_plan("td3", "LunarLanderContinuous-v3", "cpu", overrides={"probe": False})
    noise = model_kwargs(plan)["action_noise"]
    assert isinstance(noise, NormalActionNoise) and noise().shape == (2,)
    np.testing.assert_allclose(noise._sigma, [0.1, 0.1])
    assert "action_noise" not in model_kwargs(make_plan("sac", "Pendulum-v1", "cpu", overrides={"probe": False}))


@pytest.mark.parametrize(
    "algo, env, overrides, message",
    [
        ("sac", "CartPole-v1", {}, r"sac needs a Box action space; CartPole-v1 has Discrete\(2\)"),
        ("dqn", "Pendulum-v1", {}, "dqn needs a Discrete action space; Pendulum-v1 has Box"),
        ("sac", "Pendulum-v1", {"per": True}, "'per' is for dqn, qrdqn, not sac"),
        ("td3", "Pendulum-v1", {"exploration_fraction": 0.1}, "'exploration_fraction' is for dqn, qrdqn, not td3"),
        ("dqn", "CartPole-v1", {"action_noise_std": 0.1}, "'action_noise_std' is for sac, td3, tqc, not dqn"),
        ("tqc", "Pendulum-v1", {"amp": "bf16"}, "amp=bf16 .*the probe and AMP are for ppo, dqn and qrdqn so far, not tqc"),
        ("sac", "Pendulum-v1", {"probe": True}, "probe=True .*not sac; leave probe unset"),
        ("sac", "Pendulum-v1", {"train_freq": [1, "episode"], "n_envs": 2}, r"train_freq \[1, episode\] needs n_envs=1"),
        ("sac", "Pendulum-v1", {"ent_coef": "auto_x"}, "ent_coef: expected auto, auto_<initial value> or a positive"),
        ("sac", "Pendulum-v1", {"ent_coef": 0}, "ent_coef: expected auto"),
        ("tqc", "Pendulum-v1", {"target_entropy": "max"}, "target_entropy: expected auto or a finite number"),
        ("sac", "Pendulum-v1", {"overlap_training": True}, "'overlap_training' is for dqn, qrdqn, not sac"),
    ],
)
def test_what_does_not_apply_is_refused_in_one_line(algo, env, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        make_plan(algo, env, "cpu", overrides={"probe": False, **overrides})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ent_coef", ["auto", "auto_0.1", 0.05])
def test_sacs_entropy_coefficient_forms_reach_sb3(ent_coef):
    model, _ = make_model("sac", "Pendulum-v1", "cpu", ent_coef=ent_coef, learning_starts=0, batch_size=32, probe=False)
    if ent_coef == 0.05:
        assert model.ent_coef_optimizer is None and float(model.ent_coef_tensor) == pytest.approx(0.05)
    else:
        start = 0.1 if ent_coef == "auto_0.1" else 1.0
        assert float(model.log_ent_coef.detach().exp()) == pytest.approx(start)


@pytest.mark.parametrize("algo", list(CLASSES))
def test_each_learns_a_few_hundred_steps_and_counts_one_gradient_step_per_env_step(algo):
    overrides = {"learning_starts": 100, "batch_size": 32, "net_arch": [32, 32], "probe": False}
    model, timesteps = make_model(algo, "Pendulum-v1", "cpu", seed=0, **overrides)
    assert type(model) is CLASSES[algo] and timesteps == 20_000
    assert type(model.replay_buffer) is ReplayBuffer and model.device.type == "cpu"
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    model.learn(400, callback=callback)
    assert model.num_timesteps == 400
    # The actor and the critic each have an optimizer (TD3's actor steps every second time): one gradient step per env
    # step after learning_starts, counted once, 300 in 400 env steps.
    assert callback.latest["grad_steps_per_1k_env_steps"] == pytest.approx(750, rel=0.02)
    weights = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(100, reset_num_timesteps=False)
    assert any(not np.allclose(a, b.detach()) for a, b in zip(weights, model.policy.parameters(), strict=True))


@pytest.mark.parametrize("algo", list(CLASSES))
def test_asked_to_compile_each_trains_with_its_whole_step_compiled_on_a_device_buffer(algo):
    overrides = {"learning_starts": 100, "batch_size": 32, "net_arch": [32, 32], "probe": False}
    model, _ = make_model(algo, "Pendulum-v1", "cpu", seed=0, compile="default", device_buffers=True, **overrides)
    assert type(model) is SYNC_FREE[algo] and type(model.replay_buffer) is DeviceReplayBuffer
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # a graph break or a failure would warn
        model.learn(400, callback=callback)
    assert model._compiled is not None and model._compiled.fallback is None
    assert callback.latest["grad_steps_per_1k_env_steps"] == pytest.approx(750, rel=0.02)
    assert all(p.isfinite().all() for p in model.policy.parameters())


def test_td3_trains_resumes_with_its_replay_buffer_and_evaluates(tmp_path, call_main):
    run = str(tmp_path / "run")
    common = ["--vec-env", "dummy", "--eval-episodes", "1", "--no-progress", "--device", "cpu"]
    tiny = ["--set", "learning_starts=100", "--set", "batch_size=32", "--set", "net_arch=[32, 32]"]
    tiny += ["--set", "compile=default", "--set", "device_buffers=true"]  # resumed: compiled anew, buffer restored
    first = call_main(train_main, "td3", *tiny, *common, "--timesteps", "300", "--save-replay-buffer", "--run-dir", run)
    assert first.returncode == 0, first.stderr
    assert "Pendulum-v1" in first.stdout and "td3.yaml:Pendulum-v1" in first.stdout.replace("\n", "")
    resumed = call_main(train_main, "--resume", run, "--timesteps", "450", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "replay buffer restored from" in resumed.stdout.replace("\n", "")
    evaluated = call_main(evaluate_main, run, "--episodes", "1")
    assert evaluated.returncode == 0, evaluated.stderr


@pytest.mark.parametrize("algo, env", [("sac", "HalfCheetah-v5"), ("tqc", "Hopper-v5"), ("td3", "BipedalWalker-v3")])
def test_the_mujoco_and_box2d_entries_plan_and_train(algo, env):
    plan = make_plan(algo, env, "cpu", overrides={"probe": False})
    assert plan.preset.entry == f"{algo}.yaml:{env}" and plan.preset.n_timesteps == 1_000_000
    assert plan.preset.params.learning_starts == 10_000
    if env == "Hopper-v5":  # the entry's own value over the MuJoCo defaults it shares with HalfCheetah
        assert plan.preset.params.top_quantiles_to_drop_per_net == 5
    tiny = {"learning_starts": 50, "batch_size": 32, "net_arch": [32, 32], "probe": False}
    model, _ = make_model(algo, env, "cpu", seed=0, **tiny)
    model.learn(100)
    assert model.num_timesteps == 100 and model._n_updates > 0
