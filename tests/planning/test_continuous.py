"""SAC, TD3 and TQC: planned from their presets (the probe timing their step for the device, bf16 and compile), trained
with SB3's classes or sb3_gpu's step, and refused where sb3_gpu's machinery (fp16, PER, overlap) does not apply yet."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from sb3_contrib import TQC
from stable_baselines3 import SAC, TD3
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.noise import NormalActionNoise

from sb3_gpu import make_model, make_plan
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.evaluate import main as evaluate_main
from sb3_gpu.extensions.amp import amp_state
from sb3_gpu.extensions.compile import CompileFallbackWarning
from sb3_gpu.extensions.continuous import SyncFreeSAC, SyncFreeTD3, SyncFreeTQC
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.planning.build import build_env, build_model, model_class, model_kwargs
from sb3_gpu.planning.probe import Candidate, Option, Workload, measure_compile, measure_option
from sb3_gpu.runs.rundir import RunDir
from sb3_gpu.runs.saving import restore_model, save_state
from sb3_gpu.runs.telemetry import ThroughputCallback
from sb3_gpu.train import main as train_main
from tests.conftest import machine, squashed
from tests.planning.test_probe import FakeCompile, FakeTimes, fake_prober
from tests.runs.test_video import read_back

CLASSES = {"sac": SAC, "td3": TD3, "tqc": TQC}
SYNC_FREE = {"sac": SyncFreeSAC, "td3": SyncFreeTD3, "tqc": SyncFreeTQC}


@pytest.mark.parametrize("algo", list(CLASSES))
@pytest.mark.parametrize("machine", ["cpu_machine", "gpu_machine"])
def test_the_plan_takes_the_env_entry_and_the_rules_choices_where_nothing_is_timed(algo, machine, request):
    plan = make_plan(algo, "Pendulum-v1", hardware=request.getfixturevalue(machine))  # an injected machine: no probe
    assert plan.preset.entry == f"{algo}.yaml:Pendulum-v1" and plan.preset.n_timesteps == 20_000
    speed = plan.speed
    assert speed is not None and speed.amp == "off" and speed.compile == "false"
    assert plan.training == "sync" and f"not {algo}" in plan.training_reason
    assert plan.action_shape == (1,)
    kwargs = model_kwargs(plan)
    optimizer_kwargs = kwargs["policy_kwargs"].get("optimizer_kwargs") or {}
    if machine == "gpu_machine":
        assert plan.device.device == "cuda:0" and speed.compile_reason == "auto: not probed (probe off), so not compiled"
        assert "too small for tensor cores" in speed.amp_reason
        # On the GPU: the replay buffer there, sb3_gpu's sync-free step, fused Adam (the NaN guard skips on the device)
        assert plan.buffers == "device" and kwargs["replay_buffer_class"] is DeviceReplayBuffer
        assert model_class(plan) is SYNC_FREE[algo] and optimizer_kwargs == {"fused": True}
    else:  # on the CPU, SB3's own classes, as nothing is compiled, except TQC's, whose eager step is faster
        assert "no native bf16" in speed.amp_reason and speed.compile_reason == "auto: not probed (probe off), so not compiled"
        assert plan.buffers == "host" and "replay_buffer_class" not in kwargs and "fused" not in optimizer_kwargs
        assert model_class(plan) is (SYNC_FREE if algo == "tqc" else CLASSES)[algo]


@pytest.mark.parametrize("algo", list(CLASSES))
def test_the_probe_times_their_step_and_takes_bf16_and_the_compiled_step_where_faster(algo, gpu_machine):
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.3), "cuda:0 bf16": (1.2, 0.3), "cpu fp32": (9.0, 0.5)})
    compile_times = FakeCompile(eager_ms=2.0, compiled_ms=0.4, compile_s=30.0)
    plan = make_plan(algo, "Pendulum-v1", hardware=gpu_machine, prober=fake_prober(times, compile_times))
    assert plan.probe is not None and {o.workload.algo for o in plan.probe.options} == {algo}
    assert not any("fp16" in label for label in times.asked)  # not a candidate: see the next test
    assert plan.device.device == "cuda:0" and plan.speed.amp == "bf16"
    assert plan.speed.amp_reason.startswith("probe: ") and "vs cuda:0 fp32" in plan.speed.amp_reason
    assert compile_times.asked == [("cuda:0 bf16", "reduce-overhead")] and plan.speed.compile == "reduce-overhead"
    assert model_class(plan) is SYNC_FREE[algo]
    # Slower in bf16: fp32 stays.
    slower = FakeTimes({"cuda:0 fp32": (1.0, 0.3), "cuda:0 bf16": (1.2, 0.3), "cpu fp32": (9.0, 0.5)})
    plan = make_plan(algo, "Pendulum-v1", hardware=gpu_machine, prober=fake_prober(slower, compile_times))
    assert plan.speed.amp == "off" and "vs cuda:0 bf16" in plan.speed.amp_reason


def test_a_gpu_with_fp16_only_leaves_them_in_float32_and_refuses_fp16_in_one_line():
    t4 = machine(gpus=1, capability=(7, 5), gpu_name="Fake T4")
    wide = {"net_arch": [1024, 1024]}  # wide enough that the rules would take fp16 for PPO or DQN
    plan = make_plan("sac", "Pendulum-v1", "cuda:0", hardware=t4, overrides=wide)
    assert plan.speed.amp == "off" and "sac steps several optimizers" in plan.speed.amp_reason
    assert make_plan("dqn", "CartPole-v1", "cuda:0", hardware=t4, overrides=wide).speed.amp == "fp16"
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.3), "cuda:0 fp16": (0.5, 0.3)})
    probed = make_plan("td3", "Pendulum-v1", "cuda:0", hardware=t4, overrides=wide, prober=fake_prober(times))
    # One candidate: no device probe (fp16 is not timed); its eager step is timed for compile=auto's gate.
    assert probed.speed.amp == "off" and probed.probe is None and times.asked == ["cuda:0 fp32"]
    refused = r"amp=fp16 \(.*\): tqc steps several optimizers .*; use off \(Fake T4 has no bf16\)"
    with pytest.raises(ConfigError, match=refused) as info:
        make_plan("tqc", "Pendulum-v1", "cuda:0", hardware=t4, overrides={"amp": "fp16"})
    assert "\n" not in str(info.value)
    # On the CPU too the refusal names the algorithm, not only the device (which would send the user to a GPU).
    refused = r"amp=fp16 \(.*\): sac steps several optimizers .*; use bf16 or off$"
    with pytest.raises(ConfigError, match=refused):
        make_plan("sac", "Pendulum-v1", "cpu", overrides={"amp": "fp16", "probe": False})


def test_bf16_asked_for_on_the_cpu_trains_with_its_networks_autocast():
    overrides = {"learning_starts": 100, "batch_size": 32, "net_arch": [32, 32], "probe": False}
    model, _ = make_model("sac", "Pendulum-v1", "cpu", seed=0, amp="bf16", **overrides)
    state = amp_state(model)
    assert state is not None and state.mode == "bf16"
    model.learn(300)
    assert all(p.isfinite().all() for p in model.policy.parameters())


@pytest.mark.parametrize("algo", list(CLASSES))
@pytest.mark.parametrize("action_shape", [(2,), (2, 2)], ids=["flat", "grid"])  # a grid's actions are kept flat
def test_measuring_times_their_real_step_eager_and_in_bf16(algo, action_shape):
    policy_class = CLASSES[algo].policy_aliases["MlpPolicy"]
    box, actions = spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-1, 1, action_shape, np.float32)
    workload = Workload(algo, policy_class, box, actions, {"net_arch": [8]}, 8, 2, 1.0)
    for amp in ("off", "bf16"):
        timing = measure_option(Option(Candidate("cpu", amp, 1), workload), 0.01)
        assert timing.train_s > 0 and timing.infer_s > 0


@pytest.mark.slow  # compiling a step takes half a minute or more on 2 cores
@pytest.mark.parametrize("algo", ["sac", "td3"])
def test_measuring_compile_runs_their_step_compiled_whole_on_this_cpu(algo):
    policy_class = CLASSES[algo].policy_aliases["MlpPolicy"]
    box = spaces.Box(-1, 1, (3,), np.float32)
    workload = Workload(algo, policy_class, box, spaces.Box(-1, 1, (2,), np.float32), {"net_arch": [8]}, 8, 2, 1.0)
    timing = measure_compile(Option(Candidate("cpu", "off", 1), workload), "default", seconds=0.05)
    assert timing.eager_s > 0 and timing.compiled_s > 0 and timing.compile_s > timing.compiled_s


def test_td3s_action_noise_is_sb3s_gaussian_noise_of_the_action_shape():
    plan = make_plan("td3", "LunarLanderContinuous-v3", "cpu", overrides={"probe": False, "action_noise_std": 0.3})
    noise = model_kwargs(plan)["action_noise"]
    assert isinstance(noise, NormalActionNoise) and noise().shape == (2,)
    np.testing.assert_allclose(noise._sigma, [0.3, 0.3])
    assert "action_noise" not in model_kwargs(make_plan("sac", "Pendulum-v1", "cpu", overrides={"probe": False}))


@pytest.mark.parametrize(
    "algo, env, overrides, message",
    [
        ("sac", "CartPole-v1", {}, r"sac needs a Box action space; CartPole-v1 has Discrete\(2\) \(for it: ppo, dqn, qrdqn\)"),
        ("dqn", "Pendulum-v1", {}, r"dqn needs a Discrete action space; Pendulum-v1 has Box.* \(for it: ppo, sac, td3, tqc\)"),
        ("sac", "Pendulum-v1", {"per": True}, "'per' is for dqn, qrdqn, not sac"),
        ("td3", "Pendulum-v1", {"exploration_fraction": 0.1}, "'exploration_fraction' is for dqn, qrdqn, not td3"),
        ("dqn", "CartPole-v1", {"action_noise_std": 0.1}, "'action_noise_std' is for sac, td3, tqc, not dqn"),
        ("sac", "Pendulum-v1", {"train_freq": [1, "episode"], "n_envs": 2}, r"train_freq \[1, episode\] needs n_envs=1"),
        ("sac", "Pendulum-v1", {"ent_coef": "auto_x"}, "ent_coef: expected auto, auto_<initial value above 0> or a num"),
        ("sac", "Pendulum-v1", {"ent_coef": "auto_0"}, "ent_coef: expected auto"),  # its logarithm is what is learned
        ("sac", "Pendulum-v1", {"ent_coef": -0.1}, "ent_coef: expected auto"),
        ("tqc", "Pendulum-v1", {"target_entropy": "max"}, "target_entropy: expected auto or a finite number"),
        ("sac", "Pendulum-v1", {"overlap_training": True}, "'overlap_training' is for dqn, qrdqn, not sac"),
        ("sac", "Pendulum-v1", {"use_sde": True, "grad_accum_steps": 2}, "grad_accum_steps=2 is not supported with use_sde"),
        ("tqc", "Pendulum-v1", {"top_quantiles_to_drop_per_net": 25}, r"drops every one of each critic's n_quant"),
        ("tqc", "Pendulum-v1", {"policy_kwargs": {"n_quantiles": 0}}, r"policy_kwargs.n_quantiles must be an int >= 1"),
        ("qrdqn", "CartPole-v1", {"policy_kwargs": {"n_quantiles": 0}}, r"n_quantiles must be an int >= 1 \(QR-DQN's"),
        ("qrdqn", "CartPole-v1", {"policy_kwargs.n_quantiles": -3}, r"policy_kwargs.n_quantiles must be an int >= 1"),
        ("sac", "Pendulum-v1", {"policy_kwargs": {"n_critics": 0}}, r"policy_kwargs.n_critics must be an int >= 1 \(SAC's"),
        ("td3", "Pendulum-v1", {"policy_kwargs.n_critics": -1}, r"policy_kwargs.n_critics must be an int >= 1 \(TD3's"),
        # Taken by SB3 and then ignored:
        ("sac", "Pendulum-v1", {"use_sde_at_warmup": True}, "use_sde_at_warmup=True applies with use_sde=true only"),
        ("tqc", "Pendulum-v1", {"sde_sample_freq": 4}, "sde_sample_freq=4 applies with use_sde=true only"),
        ("ppo", "Pendulum-v1", {"sde_sample_freq": 4}, "sde_sample_freq=4 applies with use_sde=true only"),
        ("sac", "Pendulum-v1", {"ent_coef": 0.1, "target_entropy": -2.0}, r"target_entropy=-2.0 applies where .* not with"),
    ],
)
def test_what_does_not_apply_is_refused_in_one_line(algo, env, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        make_plan(algo, env, "cpu", overrides={"probe": False, **overrides})
    assert "\n" not in str(info.value)


def test_a_run_saved_with_a_key_sb3_ignored_still_evaluates():
    ignored = {"probe": False, "use_sde_at_warmup": True, "ent_coef": 0.1, "target_entropy": -2.0}
    plan = make_plan("sac", "Pendulum-v1", "cpu", overrides=ignored, training=False)
    assert plan.preset.params.use_sde_at_warmup is True


class _Unbounded(gym.Env):
    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Box(-np.inf, np.inf, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, False, True, {}


@pytest.mark.parametrize("algo", ["sac", "ppo"])
def test_an_action_space_without_finite_bounds_is_refused_in_one_line_by_the_plan(algo):
    # SB3 asserts the bounds only when the model is built: after a run's folder exists, or after tune opened a study.
    with pytest.raises(ConfigError, match=r"SB3 needs finite action bounds; .* give its Box a finite low and high") as info:
        make_plan(algo, _Unbounded, "cpu", overrides={"probe": False})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ent_coef", ["auto", "auto_0.1", 0.05, 0])
def test_sacs_entropy_coefficient_forms_reach_sb3(ent_coef):
    model, _ = make_model("sac", "Pendulum-v1", "cpu", ent_coef=ent_coef, learning_starts=0, batch_size=32, probe=False)
    if not isinstance(ent_coef, str):  # fixed; 0: no entropy bonus, as SB3 allows
        assert model.ent_coef_optimizer is None and float(model.ent_coef_tensor) == pytest.approx(ent_coef)
    else:
        start = 0.1 if ent_coef == "auto_0.1" else 1.0
        assert float(model.log_ent_coef.detach().exp()) == pytest.approx(start)


@pytest.mark.heavy
@pytest.mark.parametrize("algo", list(CLASSES))
def test_each_learns_a_few_hundred_steps_and_counts_one_gradient_step_per_env_step(algo):
    overrides = {"learning_starts": 100, "batch_size": 32, "net_arch": [32, 32], "probe": False}
    model, timesteps = make_model(algo, "Pendulum-v1", "cpu", seed=0, **overrides)
    assert type(model) is (SYNC_FREE if algo == "tqc" else CLASSES)[algo] and timesteps == 20_000
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


@pytest.mark.heavy
@pytest.mark.parametrize("algo", list(CLASSES))
def test_accumulated_gradient_steps_count_once_and_the_plan_names_their_class(algo):
    overrides = {"learning_starts": 100, "batch_size": 16, "net_arch": [16, 16], "grad_accum_steps": 2, "probe": False}
    model, _ = make_model(algo, "Pendulum-v1", "cpu", seed=0, **overrides)
    assert type(model) is SYNC_FREE[algo] and model.grad_accum_steps == 2
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    model.learn(400, callback=callback)
    # Two backward passes per optimizer step: still one gradient step per env step after learning_starts.
    assert model._n_updates == 300
    assert callback.latest["grad_steps_per_1k_env_steps"] == pytest.approx(750, rel=0.02)
    assert all(p.isfinite().all() for p in model.policy.parameters())


@pytest.mark.heavy
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


@pytest.mark.heavy
def test_td3_trains_resumes_with_its_replay_buffer_and_evaluates_with_a_video(tmp_path, call_main):
    run = str(tmp_path / "run")
    common = ["--vec-env", "dummy", "--eval-episodes", "1", "--no-progress", "--device", "cpu"]
    tiny = ["--set", "learning_starts=100", "--set", "batch_size=32", "--set", "net_arch=[32, 32]"]
    tiny += ["--set", "compile=default", "--set", "device_buffers=true"]  # resumed: compiled anew, buffer restored
    first = call_main(train_main, "td3", *tiny, *common, "--timesteps", "300", "--save-replay-buffer", "--run-dir", run)
    assert first.returncode == 0, first.stderr
    assert "Pendulum-v1" in first.stdout and "td3.yaml:Pendulum-v1" in squashed(first.stdout)
    resumed = call_main(train_main, "--resume", run, "--timesteps", "450", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert squashed("replay buffer restored from") in squashed(resumed.stdout)
    assert (tmp_path / "run" / "replay_buffer.pkl").is_file()  # saved again, as the run did
    unsaved = call_main(train_main, "--resume", run, "--timesteps", "500", "--no-save-replay-buffer", "--no-progress")
    assert unsaved.returncode == 0, unsaved.stderr
    assert not (tmp_path / "run" / "replay_buffer.pkl").exists()  # the 450-step buffer is not left beside 500's model
    empty = call_main(train_main, "--resume", run, "--timesteps", "600", "--no-progress")  # no buffer was saved
    assert empty.returncode == 0, empty.stderr
    assert "it starts empty, and training goes on at once" in " ".join(empty.stdout.split())
    evaluated = call_main(evaluate_main, run, "--episodes", "1", "--video", "--video-length", "20")
    assert evaluated.returncode == 0, evaluated.stderr
    assert read_back(tmp_path / "run" / "videos" / "best_model.mp4") == (20, 500, 500)  # Pendulum draws 500x500
    # SB3's TD3 policy takes the same action either way: a "stochastic" figure would be its deterministic one.
    stochastic = call_main(evaluate_main, run, "--episodes", "1", "--stochastic")
    assert stochastic.returncode == 2 and "td3's policy has no stochastic actions" in stochastic.stderr


@pytest.mark.parametrize("algo", ["sac", "tqc"])
def test_a_resumed_sac_or_tqc_has_its_replay_buffer_and_entropy_coefficients_optimizer_back(tmp_path, algo):
    overrides = {"learning_starts": 50, "batch_size": 16, "net_arch": [16], "device_buffers": True, "probe": False}
    plan = make_plan(algo, "Pendulum-v1", "cpu", vec_env="dummy", seed=0, overrides=overrides)
    model = build_model(plan, build_env(plan))
    model.learn(200)
    run = RunDir(tmp_path)
    save_state(model, run.final, replay_buffer=True)
    (state,) = run.saved_states()
    resumed = restore_model(plan, build_env(plan), state, run, say=lambda _: None)
    old, new = model.replay_buffer, resumed.replay_buffer
    assert type(new) is DeviceReplayBuffer and (new.pos, new.full) == (old.pos, old.full) == (200, False)
    for name in ("observations", "actions", "rewards", "next_observations", "dones"):
        assert np.array_equal(np.asarray(getattr(new, name)), np.asarray(getattr(old, name))), name
    assert float(resumed.log_ent_coef.detach()) == float(model.log_ent_coef.detach()) != 0.0  # learned, and kept
    before, after = model.ent_coef_optimizer.state_dict()["state"], resumed.ent_coef_optimizer.state_dict()["state"]
    assert before and before.keys() == after.keys()
    for key in before:
        for name, value in before[key].items():
            assert np.array_equal(np.asarray(after[key][name]), np.asarray(value)), name
    resumed.learn(50, reset_num_timesteps=False)  # and trains on from there
    assert resumed.num_timesteps == 250


@pytest.mark.heavy
@pytest.mark.parametrize(
    "algo, env",
    [
        ("sac", "HalfCheetah-v5"),
        ("tqc", "Hopper-v5"),
        ("td3", "BipedalWalker-v3"),
        ("sac", "BipedalWalker-v3"),
        ("tqc", "BipedalWalker-v3"),
    ],
)
def test_the_mujoco_and_box2d_entries_plan_and_train(algo, env):
    plan = make_plan(algo, env, "cpu", overrides={"probe": False})
    gsde = algo != "td3" and env == "BipedalWalker-v3"  # rl-zoo3's SAC and TQC explore it with gSDE
    assert plan.preset.entry == f"{algo}.yaml:{env}" and plan.preset.n_timesteps == (500_000 if gsde else 1_000_000)
    assert plan.preset.params.learning_starts == 10_000
    if gsde:
        assert plan.preset.params.use_sde and plan.preset.policy_kwargs == {"log_std_init": -3, "use_expln": True}
    if env == "Hopper-v5":  # the entry's own value over the MuJoCo defaults it shares with HalfCheetah
        assert plan.preset.params.top_quantiles_to_drop_per_net == 5
    tiny = {"learning_starts": 50, "batch_size": 32, "net_arch": [32, 32], "probe": False}
    model, _ = make_model(algo, env, "cpu", seed=0, **tiny)
    if algo == "tqc":  # sb3_gpu's class, whose step compiles whole under gSDE too
        assert model.compile_step("eager") is None
    model.learn(128)  # two of the gSDE entries' rounds of 64 env steps
    assert model.num_timesteps == 128 and model._n_updates > 0
