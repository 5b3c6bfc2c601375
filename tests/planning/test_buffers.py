"""The data path: where replay and rollout data live and whether training overlaps collection; the plan's choice with
its reason, and models built, saved, resumed and reloaded with it."""

from __future__ import annotations

import json

import pytest
import torch as th
import yaml
from sb3_contrib import QRDQN
from stable_baselines3 import PPO
from stable_baselines3.common.buffers import NStepReplayBuffer, RolloutBuffer

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.accumulate import GradAccumPPO
from sb3_gpu.extensions.graphstep import saved_uncapturable
from sb3_gpu.extensions.per import DevicePrioritizedReplayBuffer, PrioritizedDQN, PrioritizedQRDQN
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.extensions.rollout import DeviceRolloutBuffer
from sb3_gpu.planning.build import build_env, build_model, model_class, model_kwargs
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.saving import load_plan_model
from sb3_gpu.train import main as train_main
from tests.conftest import squashed

TINY_DQN = ["--set", "buffer_size=500", "--set", "learning_starts=32", "--set", "train_freq=4", "--set", "batch_size=16"]


def test_on_a_gpu_the_data_stays_there_and_the_plan_says_how_much(gpu_machine):
    dqn = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine, overrides={"per": False})
    assert dqn.device.device == "cuda:0" and dqn.buffers == "device"
    assert dqn.buffers_reason.startswith("on cuda:0: ") and "MiB of rollout/replay data stays there" in dqn.buffers_reason
    pong = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine, vec_env="dummy")
    assert pong.device.device == "cuda:0" and pong.buffers == "device"
    per = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine, overrides={"per": True})
    assert per.buffers == "device" and model_kwargs(per)["replay_buffer_class"] is DevicePrioritizedReplayBuffer


def test_where_a_device_buffer_cannot_or_need_not_serve_sb3s_is_kept_with_the_reason(gpu_machine, cpu_machine):
    off = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine, overrides={"per": False, "device_buffers": False})
    assert (off.buffers, off.buffers_reason) == (
        "host",
        "SB3's buffers (3.2 MiB in host memory): device_buffers=false (override)",
    )
    cpu = make_plan("ppo", "CartPole-v1", hardware=cpu_machine)
    assert cpu.buffers == "host" and "no faster" in cpu.buffers_reason
    with pytest.raises(ConfigError, match="device_buffers: unknown value 'sometimes'"):
        make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides={"device_buffers": "sometimes"})
    # n-step returns: sb3_gpu's buffers compute them (SB3 would hand n_steps to its NStepReplayBuffer only, and
    # silently train one-step targets with any other buffer class).
    nstep = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine, overrides={"per": False, "n_steps": 3})
    kwargs = model_kwargs(nstep)
    assert nstep.buffers == "device" and kwargs["replay_buffer_class"] is DeviceReplayBuffer
    assert kwargs["n_steps"] == 1 and kwargs["replay_buffer_kwargs"] == {"n_steps": 3, "gamma": nstep.preset.params.gamma}
    per = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine, overrides={"per": True, "n_steps": 3})
    kwargs = model_kwargs(per)
    assert kwargs["replay_buffer_class"] is DevicePrioritizedReplayBuffer and kwargs["replay_buffer_kwargs"]["n_steps"] == 3
    pong = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine, vec_env="dummy", overrides={"n_steps": 64})
    assert pong.buffers == "device"  # PPO's n_steps is its rollout length


@pytest.mark.parametrize(
    "request_, rollout, replay",  # the DQN preset's 3-step returns: SB3's NStepReplayBuffer on the host
    [(True, DeviceRolloutBuffer, DeviceReplayBuffer), (False, RolloutBuffer, NStepReplayBuffer)],
)
def test_the_model_gets_the_buffers_the_plan_chose(request_, rollout, replay):
    ppo = make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy", overrides={"device_buffers": request_})
    assert type(build_model(ppo, build_env(ppo)).rollout_buffer) is rollout
    dqn = make_plan("dqn", "CartPole-v1", "cpu", vec_env="dummy", overrides={"device_buffers": request_, "per": False})
    assert type(build_model(dqn, build_env(dqn)).replay_buffer) is replay


@pytest.mark.heavy
@pytest.mark.parametrize(
    "args",
    [
        ["ppo", "--set", "n_steps=32", "--set", "batch_size=32", "--set", "n_epochs=1", "--set", "device_buffers=true"],
        ["dqn", "--no-per", *TINY_DQN, "--save-replay-buffer", "--set", "device_buffers=true"],
        ["dqn", "--per", *TINY_DQN, "--save-replay-buffer", "--set", "device_buffers=true"],
        # The preset's 3-step returns on the host: SB3's NStepReplayBuffer, which a resume once refused to unpickle.
        ["dqn", "--no-per", *TINY_DQN, "--save-replay-buffer", "--set", "device_buffers=false"],
    ],
    ids=["ppo", "dqn", "dqn-per", "dqn-host-nstep"],
)
def test_a_run_on_host_or_device_buffers_saves_resumes_and_evaluates(args, tmp_path, call_main):
    from sb3_gpu.evaluate import main as evaluate_main

    run_dir = str(tmp_path / "run")
    common = ["--n-envs", "1", "--vec-env", "dummy", "--eval-episodes", "1", "--no-progress"]
    first = call_main(train_main, *args, *common, "--timesteps", "64", "--run-dir", run_dir)
    assert first.returncode == 0, first.stderr
    resumed = call_main(train_main, "--resume", run_dir, "--timesteps", "128", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert squashed("resuming from") in squashed(resumed.stdout)
    if "--save-replay-buffer" in args:
        assert squashed("replay buffer restored from") in squashed(resumed.stdout)
    assert call_main(evaluate_main, run_dir, "--episodes", "1").returncode == 0


@pytest.mark.heavy
@pytest.mark.parametrize("saved, now", [("true", False), ("false", True)], ids=["device-to-host", "host-to-device"])
def test_a_resumed_run_whose_plan_picks_the_other_buffer_kind_keeps_its_own_and_says_so(saved, now, tmp_path, call_main):
    # As a run moved with --resume --device to a machine where the plan picks the other kind of buffer.
    run_dir = tmp_path / "run"
    common = ["--n-envs", "1", "--vec-env", "dummy", "--eval-episodes", "1", "--no-progress", "--save-replay-buffer"]
    args = ["dqn", "--no-per", *TINY_DQN, "--set", f"device_buffers={saved}", *common, "--run-dir", str(run_dir)]
    assert call_main(train_main, *args, "--timesteps", "64").returncode == 0
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["hyperparameters"]["device_buffers"] = now
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    resumed = call_main(train_main, "--resume", str(run_dir), "--timesteps", "128", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    kind = "SB3's host buffer" if now else "sb3_gpu's device buffer"
    assert f"kept as {kind}, as it was saved, where a new run here would use the other" in " ".join(resumed.stdout.split())
    assert json.loads((run_dir / "summary.json").read_text())["timesteps"] == 128


@pytest.mark.parametrize("per", [False, True])
def test_a_model_saved_from_a_device_buffer_with_n_step_returns_loads_into_the_evaluation_plans_buffer(per, tmp_path):
    # A GPU run's buffer computes its 3-step returns itself (the algorithm keeps n_steps=1); the evaluation plan on the
    # CPU, or on that GPU, loads it into SB3's host buffer, which takes them as the algorithm's n_steps.
    tiny = {"per": per, "buffer_size": 500, "learning_starts": 32}
    trained = make_plan("dqn", "CartPole-v1", "cpu", vec_env="dummy", overrides={**tiny, "device_buffers": True})
    model = build_model(trained, build_env(trained))
    assert (trained.buffers, model.n_steps, model.replay_buffer_kwargs["n_steps"]) == ("device", 1, 3)
    model.save(tmp_path / "model.zip")
    evaluation = make_plan(
        "dqn", "CartPole-v1", "cpu", vec_env="dummy", overrides={**tiny, "device_buffers": True}, training=False
    )
    assert (evaluation.buffers, evaluation.buffers_reason) == ("host", "SB3's buffers: evaluation fills none")
    loaded = load_plan_model(evaluation, tmp_path / "model.zip", build_env(evaluation))
    # SB3's n-step buffer, or the host PER buffer, which computes the returns itself as the device ones do.
    assert type(loaded.replay_buffer).__name__ == ("PrioritizedReplayBuffer" if per else "NStepReplayBuffer")
    assert loaded.replay_buffer.n_steps == 3
    for a, b in zip(model.policy.parameters(), loaded.policy.parameters(), strict=True):
        assert th.equal(a, b)


def test_a_gpu_runs_capturable_adam_is_never_saved_and_an_older_zip_holding_it_steps_on_a_cpu(tmp_path):
    # On a GPU the graph-captured step makes an unfused Adam capturable (its step counts live on the device); torch's
    # Adam on a CPU refuses to step with that flag.
    plan = make_plan(
        "sac", "Pendulum-v1", "cpu", vec_env="dummy", overrides={"learning_starts": 8, "batch_size": 8, "compile": False}
    )
    model = build_model(plan, build_env(plan))
    model.learn(16)  # Adam state in every optimizer
    optimizers = [model.actor.optimizer, model.critic.optimizer, model.ent_coef_optimizer]
    for optimizer in optimizers:
        optimizer.param_groups[0]["capturable"] = True  # what the GPU run set
    saved_uncapturable(model.actor.optimizer)
    saved_uncapturable(model.actor.optimizer)  # once per optimizer, however often its step is rebuilt
    saved = model.actor.optimizer.state_dict()["param_groups"][0]
    assert saved["capturable"] is False and model.actor.optimizer.param_groups[0]["capturable"] is True
    model.save(tmp_path / "model.zip")  # the critic's and the entropy's: as zips saved before the flag was left out
    loaded = load_plan_model(plan, tmp_path / "model.zip", build_env(plan))
    for optimizer in [loaded.actor.optimizer, loaded.critic.optimizer, loaded.ent_coef_optimizer]:
        assert [g["capturable"] for g in optimizer.param_groups] == [False]
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = th.zeros_like(p)
        optimizer.step()  # torch's own Adam on the CPU


def test_off_policy_training_overlaps_collection_on_a_gpu_and_keeps_sb3s_schedule_on_the_cpu(gpu_machine, cpu_machine):
    gpu = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine, overrides={"per": False})
    assert gpu.training == "overlapped" and gpu.training_reason.startswith("on cuda:0: the GPU trains on a thread")
    assert model_class(gpu) is PrioritizedDQN and model_kwargs(gpu)["overlap_training"] is True
    cpu = make_plan("qrdqn", "CartPole-v1", hardware=cpu_machine)
    assert cpu.training == "sync" and "compete with the envs" in cpu.training_reason
    assert model_class(cpu) is QRDQN and "overlap_training" not in model_kwargs(cpu)
    off = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine, overrides={"overlap_training": False})
    assert (off.training, off.training_reason) == ("sync", "SB3's schedule: overlap_training=false (override)")
    forced = make_plan("qrdqn", "CartPole-v1", "cpu", vec_env="dummy", overrides={"overlap_training": True})
    model = build_model(forced, build_env(forced))
    assert type(model) is PrioritizedQRDQN and model.overlap_training is True
    assert make_plan("ppo", "CartPole-v1", hardware=cpu_machine).training == "sync"
    # On a GPU every algorithm trains with sb3_gpu's train(), which spares the device SB3's reads of each loss.
    assert model_class(make_plan("ppo", "CartPole-v1", "cuda", hardware=gpu_machine)) is GradAccumPPO
    assert model_class(make_plan("ppo", "CartPole-v1", hardware=cpu_machine)) is PPO
    # ... with a fused optimizer, whose kernels let the NaN guard skip a step on the device.
    on_gpu = model_kwargs(make_plan("dqn", "CartPole-v1", "cuda", hardware=gpu_machine))["policy_kwargs"]
    assert on_gpu["optimizer_kwargs"] == {"fused": True}
    chosen = make_plan(
        "dqn", "CartPole-v1", "cuda", hardware=gpu_machine, overrides={"policy_kwargs.optimizer_kwargs": {"foreach": True}}
    )
    assert model_kwargs(chosen)["policy_kwargs"]["optimizer_kwargs"] == {"foreach": True}
    assert "optimizer_kwargs" not in model_kwargs(make_plan("dqn", "CartPole-v1", hardware=cpu_machine))["policy_kwargs"]
    with pytest.raises(ConfigError, match="'overlap_training' is for off-policy algorithms"):
        make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides={"overlap_training": True})


@pytest.mark.heavy
def test_an_overlapped_run_saves_resumes_and_evaluates(tmp_path, call_main):
    from sb3_gpu.evaluate import main as evaluate_main

    run_dir = str(tmp_path / "run")
    common = ["--n-envs", "2", "--vec-env", "dummy", "--eval-episodes", "1", "--no-progress", "--save-replay-buffer"]
    args = ["dqn", *TINY_DQN, "--set", "overlap_training=true", *common]
    first = call_main(train_main, *args, "--timesteps", "256", "--checkpoint-freq", "64", "--run-dir", run_dir)
    assert first.returncode == 0, first.stderr
    assert "overlapped" in first.stdout
    resumed = call_main(train_main, "--resume", run_dir, "--timesteps", "512", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert call_main(evaluate_main, run_dir, "--episodes", "1").returncode == 0
