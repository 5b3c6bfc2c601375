"""The speed switches' decisions on machines we do not have (faked hardware), applying them, and the CLI flags."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.envs.build import make_vec_env
from sb3_gpu.envs.spec import resolve_env
from sb3_gpu.extensions.amp import amp_state
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.planning.speed import SpeedPlan, apply_speed, choose_speed
from tests.conftest import machine

SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2, "policy_kwargs": {"net_arch": [32, 32]}}
PPO_PRESET = {"n_steps": 64, "batch_size": 32, "n_epochs": 2, "net_arch": [32, 32]}  # SMALL_PPO as preset keys


# --------------------------------------------------------------------------- decisions, on faked machines
def _speed(hw, device="cpu", policy="mlp", net_arch=(64, 64), batch=64, amp="auto", threads="auto", workers=0):
    return choose_speed(
        amp,
        "false",
        threads,
        device=device,
        policy=policy,
        net_arch=list(net_arch),
        batch_size=batch,
        env_workers=workers,
        hardware=hw,
    )


def test_amp_auto_on_cpus():
    assert _speed(machine(cpu_bf16=True), net_arch=[256, 256], batch=256).amp == "off"  # AVX512-BF16 only
    assert "no AMX" in _speed(machine(cpu_bf16=True)).amp_reason
    assert _speed(machine(cpu_amx=True), net_arch=[256, 256], batch=256).amp == "bf16"
    assert _speed(machine(cpu_amx=True), policy="cnn").amp == "bf16"
    small = _speed(machine(cpu_amx=True), net_arch=[64, 64], batch=64)
    assert small.amp == "off" and "too small" in small.amp_reason


def test_amp_auto_on_gpus():
    a100, t4, p100 = machine(gpus=1), machine(gpus=1, capability=(7, 5), gpu_name="T4"), machine(gpus=1, capability=(6, 0))
    assert _speed(a100, "cuda:0", "cnn").amp == "bf16"
    assert _speed(t4, "cuda:0", "cnn").amp == "fp16"
    assert "loss scaling" in _speed(t4, "cuda:0", "cnn").amp_reason
    assert _speed(p100, "cuda:0", "cnn").amp == "off"
    assert _speed(a100, "cuda:0", "mlp", [64, 64], 64).amp == "off"
    assert _speed(a100, "cuda:0", "mlp", [256, 256], 2048).amp == "bf16"


def test_amp_requests_that_cannot_work_are_errors():
    with pytest.raises(ConfigError, match="amp=fp16 needs a CUDA GPU"):
        _speed(machine(), amp="fp16")
    with pytest.raises(ConfigError, match=r"T4 .*no bf16 tensor cores; use fp16"):
        _speed(machine(gpus=1, capability=(7, 5), gpu_name="T4"), "cuda:0", amp="bf16")
    with pytest.raises(ConfigError, match="not supported on Apple MPS"):
        _speed(machine(mps=True), "mps", amp="bf16")
    assert "slower than fp32" in _speed(machine(), amp="bf16").amp_reason


def test_threads_follow_the_policy_size_and_the_env_workers():
    assert _speed(machine(cores=8)).threads == 1
    assert _speed(machine(cores=8), policy="cnn", workers=3).threads == 5
    assert _speed(machine(cores=8), net_arch=[512, 512], batch=512).threads == 8
    assert _speed(machine(cores=8), net_arch=[256, 256], batch=64).threads == 8
    assert _speed(machine(cores=16, gpus=1), "cuda:0", policy="cnn").threads == 4
    assert _speed(machine(cores=2), policy="cnn", workers=8).threads == 1
    assert _speed(machine(), threads=3).threads == 3


def test_a_users_omp_num_threads_caps_the_automatic_thread_count(monkeypatch):
    # A cluster job's OMP_NUM_THREADS=2 was replaced by every free core: torch then took the cores left to others.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    capped = _speed(machine(cores=8), policy="cnn", workers=3)
    assert capped.threads == 2 and capped.threads_reason.endswith("; at most OMP_NUM_THREADS=2")
    assert _speed(machine(cores=16, gpus=1), "cuda:0", policy="cnn").threads == 2
    assert _speed(machine(cores=8), threads=6).threads == 6  # a count asked for is the user's own word
    assert _speed(machine(cores=8)).threads == 1  # below the cap: as without one
    monkeypatch.setenv("OMP_NUM_THREADS", "many")  # not a count: no cap
    assert _speed(machine(cores=8), policy="cnn", workers=3).threads == 5


def test_cuda_math_flags_follow_the_gpu():
    a100 = _speed(machine(gpus=1), "cuda:0", "cnn")
    assert a100.cudnn_benchmark and a100.tf32 and "TF32" in a100.cuda_reason
    t4 = _speed(machine(gpus=1, capability=(7, 5)), "cuda:0", "mlp", [64], 64)
    assert not t4.cudnn_benchmark and not t4.tf32
    assert _speed(machine()).cuda_reason == "" and len(_speed(machine()).rows()) == 3


@pytest.mark.parametrize(("algo", "env"), [("ppo", "CartPole-v1"), ("ppo", "Pendulum-v1")])
def test_a_seeded_build_has_the_same_weights_whatever_threads_the_process_had_before(algo, env):
    # PPO's orthogonal init (a QR decomposition) depends on the thread count: a notebook's first make_model cell built
    # with the kernel's threads, every rerun with the ones the previous plan left, and the first run never repeated.
    from sb3_gpu.planning.build import make_model

    weights = []
    for before in (1, 2):
        th.set_num_threads(before)
        model = make_model(algo, env, "cpu", vec_env="dummy", seed=0, threads=1, compile="false", amp="off").model
        weights.append(th.nn.utils.parameters_to_vector(model.policy.parameters()).detach())
        model.get_env().close()
    assert th.equal(*weights)


def test_apply_speed_sets_threads_flags_and_amp():
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)
    plan = SpeedPlan("bf16", "test", "false", "test", 1, "test", cudnn_benchmark=True, tf32=True, cuda_reason="test")
    assert apply_speed(model, plan, 32) is None
    assert th.get_num_threads() == 1 and th.backends.cudnn.benchmark and th.backends.cuda.matmul.allow_tf32
    assert amp_state(model).mode == "bf16"


@pytest.mark.parametrize("collect", [True, False])
@pytest.mark.parametrize("algo", ["ppo", "dqn", "td3"])
def test_apply_speed_compiles_collection_only_where_the_plan_says(algo, collect, monkeypatch):
    from sb3_gpu.config.schema import get_algo
    from sb3_gpu.planning import speed as speed_module

    networks: list[str] = []
    monkeypatch.setattr(speed_module, "compile_policy", lambda model, mode, batch: networks.append(mode))
    env = "Pendulum-v1" if algo == "td3" else "CartPole-v1"
    model = get_algo(algo).extended_class("MlpPolicy", env, device="cpu", policy_kwargs={"net_arch": [8]})
    plan = SpeedPlan("off", "test", "eager", "test", 1, "test", compile_collect=collect)  # "eager": the step uncompiled
    assert apply_speed(model, plan, 32) is None
    # PPO's and the DQN family's collection runs their networks, compiled apart; SAC's family compiles its own pass.
    assert networks == (["eager"] if collect and algo != "td3" else [])
    assert (getattr(model, "_compiled_act", None) is not None) == (collect and algo != "dqn")


def test_plan_shows_and_saves_the_speed_decisions(cpu_machine):
    plan = make_plan("ppo", "CartPole-v1", "cpu", hardware=cpu_machine, overrides={"threads": 2, "amp": "off"})
    assert (plan.speed.amp, plan.speed.threads) == ("off", 2)
    config = plan.to_config()
    assert config["hyperparameters"]["threads"] == 2 and config["hyperparameters"]["amp"] == "off"
    assert config["resolved"]["speed.threads"] == "2 (asked for)"


def test_more_threads_than_cores_are_kept_as_asked_and_flagged_in_the_plan():
    from rich.console import Console

    from sb3_gpu.planning.table import plan_table

    four = machine(cores=4)
    plan = make_plan("ppo", "CartPole-v1", "cpu", hardware=four, overrides={"threads": 999, "amp": "off", "probe": False})
    assert plan.speed.threads == 999
    assert plan.speed.threads_reason == (
        "asked for; warning: more than the 4 logical cores this process may use, so the threads take turns and every op "
        "waits for the last"
    )
    assert make_plan("ppo", "CartPole-v1", "cpu", hardware=four, overrides={"threads": 4}).speed.threads_reason == "asked for"
    console = Console(record=True, width=300, color_system="truecolor")
    console.print(plan_table(plan))
    row = next(line for line in console.export_text(styles=True).splitlines() if "999" in line)
    assert "\x1b[33m" in row  # yellow, as the plan's other warnings


# --------------------------------------------------------------------------- env workers and CLI
class _ThreadsEnv(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        import os

        self.threads = th.get_num_threads()
        self.omp = os.environ.get("OMP_NUM_THREADS")

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, True, False, {}


@pytest.mark.heavy
def test_subprocess_env_workers_run_one_thread():
    venv = make_vec_env(resolve_env(_ThreadsEnv), 2, vec_env="subproc")
    try:
        assert venv.get_attr("threads") == [1, 1]
        assert venv.get_attr("omp") == ["1", "1"]
    finally:
        venv.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ppo", "--amp", "fp16", "--device", "cpu"], "amp=fp16 needs a CUDA GPU"),
        (["ppo", "--threads", "0"], "--threads"),
        (["ppo", "--compile", "fast"], "--compile"),
        (["ppo", "--set", "amp=fp8"], "amp: unknown value 'fp8' (valid: auto, off, bf16, fp16)"),
        (
            ["ppo", "--n-envs", "1", "--set", "grad_accum_steps=3", "--set", "n_steps=64", "--set", "batch_size=32"],
            "must divide",
        ),
    ],
)
def test_bad_speed_flags_exit_2_with_one_line(args, message, tmp_path, monkeypatch, call_main):
    from sb3_gpu.train import main

    monkeypatch.chdir(tmp_path)
    result = call_main(main, *args, "--plan")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_run_trained_with_gpu_only_switches_evaluates_on_the_cpu(tmp_path):
    import yaml

    from sb3_gpu.runs.evaluation import evaluate_run
    from sb3_gpu.runs.training import train_run

    plan = make_plan(
        "ppo", "CartPole-v1", "cpu", seed=0, overrides={"amp": "bf16", **PPO_PRESET, "n_envs": 1, "n_timesteps": 128}
    )
    train_run(plan, tmp_path / "run", eval_episodes=1, progress=False, eval_freq=64)
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    config["hyperparameters"]["amp"] = "fp16"  # as written on a CUDA machine
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    assert evaluate_run(tmp_path / "run", episodes=2)["episodes"] == 2


def test_a_baselines_optimizer_on_a_gpu_is_plain_sb3s_not_the_fused_one_sb3_gpu_plans():
    # bench step's SB3 row took the plan's fused Adam on CUDA: one kernel where plain SB3 launches foreach ones.
    from sb3_gpu.planning.optimizers import planned_policy_kwargs

    assert planned_policy_kwargs("dqn", {}, 32, "cuda:0") == {"optimizer_kwargs": {"fused": True}}
    assert planned_policy_kwargs("dqn", {}, 32, "cuda:0", fused_optimizer=False) == {}
    plain_qrdqn = planned_policy_kwargs("qrdqn", {}, 32, "cuda:0", fused_optimizer=False)  # sb3-contrib's own eps kept
    assert plain_qrdqn["optimizer_kwargs"] == {"eps": 0.01 / 32}
