"""The Python API refuses bad arguments in one line, before anything is built or written: the import-API twin of the
CLIs' bad-input tests (which go through argparse and never reach most of these)."""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3.common.vec_env import SubprocVecEnv

from sb3_gpu import (
    ConfigError,
    ReturnFreeMemory,
    ThroughputCallback,
    build_env,
    build_model,
    choose_device,
    detect_hardware,
    enable_amp,
    evaluate_run,
    make_model,
    make_plan,
    make_vec_env,
    record_video,
    resume_run,
    train_run,
)

NO_PROBE = {"probe": False}


class _OldGymReset(gym.Env):
    """Written for the old Gym API: reset() returns the observation alone."""

    observation_space = gym.spaces.Box(-1, 1, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return np.zeros(3, np.float32)

    def step(self, action: Any) -> Any:
        return np.zeros(3, np.float32), 0.0, False, False, {}


class _WrongShape(_OldGymReset):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return np.zeros(5, np.float32), {}


class _OldGymStep(_OldGymReset):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return np.zeros(3, np.float32), {}

    def step(self, action: Any) -> Any:
        return np.zeros(3, np.float32), 0.0, False, {}


class _NoSpaces(gym.Env):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return np.zeros(3, np.float32), {}


def _plan() -> Any:
    return make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy", overrides=NO_PROBE)


CASES = [
    # Envs that break the Gymnasium API: found by the plan, not by SB3 once learn() has started.
    (lambda: make_plan("ppo", _OldGymReset, "cpu", overrides=NO_PROBE), "reset() returned a value of type ndarray; a Gym"),
    (lambda: make_plan("ppo", _WrongShape, "cpu", overrides=NO_PROBE), "an observation of shape (5,), but its observation_s"),
    (lambda: make_plan("ppo", _OldGymStep, "cpu", overrides=NO_PROBE), "four values: the old Gym API"),
    (lambda: make_plan("ppo", _NoSpaces, "cpu", overrides=NO_PROBE), "env '_NoSpaces' sets no observation_space"),
    # Arguments of the wrong type or out of range.
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", seed=1.5, overrides=NO_PROBE), "seed must be an int from 0 to 2**32"),
    (lambda: make_model("ppo", "CartPole-v1", "cpu", seed=-1, probe=False), "seed must be an int from 0 to 2**32 - 1"),
    (lambda: make_plan("ppo", "CartPole-v1", None), "device must be a string: auto, cpu, cuda, cuda:N or mps; got None"),
    (lambda: make_plan(None, "CartPole-v1", "cpu"), "the algorithm is a name (ppo, dqn, qrdqn, sac, td3, tqc); got None"),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", overrides=[("probe", False)]), "overrides must be a mapping"),
    (lambda: make_model("ppo", "CartPole-v1", "cpu", verbose="loud", probe=False), "verbose must be 0, 1 or 2"),
    # policy_kwargs that SB3 refuses in words about its own code: said about the keys given.
    (
        lambda: make_plan("ppo", "CartPole-v1", "cpu", overrides={**NO_PROBE, "policy_kwargs": {"optimizer_class": dict}}),
        "override: policy_kwargs.optimizer_class must be a subclass of Optimizer, got <class 'dict'>",
    ),
    (
        lambda: make_plan("ppo", "CartPole-v1", "cpu", overrides={**NO_PROBE, "policy_kwargs.optimizer_kwargs": {"betas": 1}}),
        "policy_kwargs.optimizer_kwargs {'betas': 1}: Adam refused them (TypeError: 'int' object is not subscriptable)",
    ),
    (
        lambda: make_plan(
            "ppo", "CartPole-v1", "cpu", overrides={**NO_PROBE, "policy_kwargs.optimizer_kwargs": {"weight_decy": 0}}
        ),
        "policy_kwargs.optimizer_kwargs of Adam: unknown key 'weight_decy'; did you mean 'weight_decay'",
    ),
    (
        lambda: make_plan("dqn", "CartPole-v1", "cpu", overrides={**NO_PROBE, "policy_kwargs.optimizer_kwargs": {"lr": 0.1}}),
        "policy_kwargs.optimizer_kwargs.lr comes from dqn's learning_rate; set that",
    ),
    (lambda: make_model("ppo", "CartPole-v1", "cpu", tensorboard_log=123, probe=False), "tensorboard_log must be a fol"),
    # make_vec_env's auto choice times one env step: a broken env is named before it is timed.
    (lambda: make_vec_env(_OldGymStep, 2), "env '_OldGymStep' failed on its first reset or step: ValueError: not enough"),
    (lambda: make_vec_env(_OldGymReset, 2), "env '_OldGymReset': reset() returned a value of type ndarray; a Gymnasium"),
    (lambda: build_env(_plan(), evaluation="no"), "evaluation must be True or False, got 'no'"),
    (lambda: make_vec_env("CartPole-v1", 2, max_episode_steps=0), "max_episode_steps must be a positive int or None"),
    (lambda: make_vec_env("CartPole-v1", 2, frame_stack=0), "frame_stack must be a positive int or None, got 0"),
    (lambda: make_vec_env("CartPole-v1", 2, seed="x"), "seed must be an int from 0 to 2**32 - 1 or None, got 'x'"),
    (lambda: make_vec_env("CartPole-v1", 2, env_kwargs="x"), "env_kwargs must be a mapping of keyword arguments"),
    (lambda: make_vec_env("CartPole-v1", 2, wrapper_class=5), "wrapper_class must be callable"),
    (lambda: make_vec_env("CartPole-v1", 2, vec_env_cls="subproc"), "vec_env_cls must be a VecEnv class"),
    (lambda: make_vec_env("CartPole-v1", 2, vec_env=SubprocVecEnv), "a VecEnv class goes in vec_env_cls, got <class"),
    (lambda: make_vec_env("CartPole-v1", 2, vec_env=None), "vec_env must be one of auto, dummy, subproc"),
    (lambda: make_model("ppo", "CartPole-v1", "cpu", vec_env=3, probe=False), "vec_env must be one of auto, dummy, "),
    (lambda: make_vec_env("CartPole-v1", 2, atari_wrapper=True), "atari_wrapper=True wraps ALE Atari games; 'CartPole-v1'"),
    (lambda: make_vec_env("CartPole-v1", 2, atari_wrapper="yes"), "atari_wrapper (or None: Atari games only) must be True"),
    (lambda: choose_device("auto", "mlp", True, None), "hardware must be a HardwareProfile (from detect_hardware())"),
    (lambda: choose_device("auto", "MLP", True, detect_hardware()), "policy must be 'mlp', 'cnn' or 'multi'"),
    (lambda: choose_device("auto", "mlp", 1, detect_hardware()), "on_policy must be True or False, got 1"),
    (
        lambda: make_vec_env("CartPole-v1", 2, vec_env="subproc", vec_env_kwargs={"start_method": "bogus"}),
        "start_method 'bogus' is not one this platform has: ",
    ),
    (lambda: build_env(_plan(), n_envs=0), "n_envs must be a positive int, got 0"),
    (lambda: build_env("ppo"), "build_env takes a Plan from make_plan(...), got 'ppo'"),
    (lambda: build_model(_plan(), None), "build_model needs the VecEnv that build_env(plan) makes, got None"),
    (lambda: train_run("ppo", "run"), "train_run takes a Plan from make_plan(...), got 'ppo'"),
    (lambda: train_run(_plan(), 5), "run dir: expected a folder path, got 5"),
    (lambda: evaluate_run(None), "target is a run dir or a model zip inside one (a str or a path), got None"),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", preset=123), "preset: expected a preset file's path or zoo:ALGO, got 123"),
    (lambda: train_run(_plan(), "run", report_s="30"), "report_s must be a number of seconds > 0 or None, got '30'"),
    (lambda: train_run(_plan(), "run", report_s=0), "report_s must be a number of seconds > 0 or None, got 0"),
    (lambda: resume_run("run", timesteps="2048"), "timesteps (the new total) must be a positive int or None"),
    (lambda: evaluate_run("run", episodes=0), "episodes must be a positive int, got 0"),
    (lambda: evaluate_run("run", episodes="3"), "episodes must be a positive int, got '3'"),
    (lambda: evaluate_run("run", deterministic="no"), "deterministic must be True or False, got 'no'"),
    (lambda: evaluate_run("run", video_length=50), "video_length=50 is for the video: pass video=True too"),
    (lambda: evaluate_run("run", seed=1.5), "seed must be an int from 0 to 2**32 - 1 or None, got 1.5"),
    (lambda: evaluate_run("run", should_stop=True), "should_stop takes a callable"),
    (lambda: record_video("run/model.zip", "CartPole-v1", "v.mp4"), "record_video takes a loaded SB3 model"),
    (lambda: enable_amp("ppo", "bf16"), "enable_amp takes an SB3 model, got 'ppo'"),
    (lambda: ThroughputCallback(window_s=-1), "window_s must be a finite number of seconds > 0, got -1"),
    (lambda: ThroughputCallback(window_s=float("nan")), "window_s must be a finite number of seconds > 0, got nan"),
    (lambda: ThroughputCallback(warmup_s=-3), "warmup_s must be a finite number of seconds >= 0, got -3"),
    (lambda: ThroughputCallback(record_s="1"), "record_s must be a finite number of seconds >= 0, got '1'"),
    (lambda: ThroughputCallback(report_s=-5), "report_s must be a finite number of seconds >= 0, got -5"),
    (lambda: ReturnFreeMemory(every_s=-1), "every_s must be a finite number of seconds >= 0, got -1"),
    (lambda: ReturnFreeMemory(clock=5), "clock must be a callable that returns seconds"),
    (lambda: ThroughputCallback(print_fn=5), "print_fn must be a callable that takes a line of text"),
    (lambda: ThroughputCallback(eval_callback=5), "eval_callback must be a TimedEvalCallback"),
    (lambda: ThroughputCallback(dashboard="no"), "dashboard must be True or False, got 'no'"),
    # make_vec_env's own arguments, and envs that fail to build in whichever vec env was asked for.
    (lambda: make_vec_env("CartPole-v1", 2, monitor_kwargs=[1]), "monitor_kwargs must be a mapping of keyword argum"),
    (lambda: make_vec_env("CartPole-v1", 2, vec_env_kwargs=[1]), "vec_env_kwargs must be a mapping of keyword argum"),
    (lambda: make_vec_env("CartPole-v1", 2, start_index=-1), "start_index must be an int >= 0, got -1"),
    (lambda: make_vec_env("CartPole-v1", 2, start_index=1.5), "start_index must be an int >= 0, got 1.5"),
    (lambda: make_vec_env("CartPole-v1", 2, wrapper_kwargs={"a": 1}), "wrapper_kwargs ['a'] are for a wrapper_class, and"),
    (
        lambda: make_vec_env("CartPole-v1", 2, vec_env="envpool", vec_env_kwargs={"seed": 1}),
        "vec_env_kwargs ['seed'] are not arguments of EnvPoolVecEnv; accepted: num_threads",
    ),
    (lambda: make_vec_env(_raises, 2, vec_env="dummy"), "env '_raises' failed to build: ZeroDivisionError: division by zero"),
    (lambda: make_vec_env(lambda: 42, 1, vec_env="dummy"), "failed to build: TypeError: Expected env to be a `gymnasium.Env`"),
    # An env kwarg the env does not take is named with those it does (gym.make's own too, for an id).
    (
        lambda: make_vec_env("CartPole-v1", 1, env_kwargs={"render_mod": 1}, vec_env="dummy"),
        "env 'CartPole-v1' takes no keyword argument 'render_mod'; did you mean 'render_mode'? (env_kwargs accepted: "
        "sutton_barto_reward, render_mode, max_episode_steps, disable_env_checker)",
    ),
    (
        lambda: make_plan("ppo", _sized, "cpu", overrides={**NO_PROBE, "env_kwargs": {"sise": 4}}),
        "env '_sized' takes no keyword argument 'sise'; did you mean 'size'? (env_kwargs accepted: size)",
    ),
    (
        lambda: make_plan("ppo", "gymnasium.envs.classic_control:PendulumEnv", "cpu", overrides={"env_kwargs": {"render": 1}}),
        "env 'gymnasium.envs.classic_control:PendulumEnv' takes no keyword argument 'render'; did you mean 'render_mode'? ("
        "env_kwargs accepted: render_mode, g)",
    ),
    (
        lambda: make_vec_env(_cartpole_factory, 1, atari_wrapper=True, vec_env="dummy"),
        "env '_cartpole_factory' failed to build: AttributeError: 'CartPoleEnv' object has no attribute 'get_action_mean",
    ),
    # make_plan's less common arguments, and an env built for another plan.
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", profile=None), "profile must be a name: auto, cpu, gpu, large; got None"),
    (lambda: make_model("ppo", "CartPole-v1", "cpu", n_envs="4", probe=False), "n_envs must be a positive int or None, got"),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", n_timesteps=2.5), "n_timesteps must be a positive int or None, got 2.5"),
    (
        lambda: make_plan("ppo", "CartPole-v1", "cpu", n_timesteps="1e5"),
        "n_timesteps must be a positive int or None, got '1e5'",
    ),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", steps_left=-5), "steps_left must be a positive int or None, got -5"),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", override_source=3), "override_source must be a label, or a mapping"),
    (
        lambda: make_plan("ppo", "CartPole-v1", "cpu", overrides=NO_PROBE, override_source={"x": "y"}),
        "override_source names no source for the overrides ['probe']",
    ),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", config={"algo": "ppo"}), "config must be a run's RunConfig (from load"),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", training="no"), "training must be True or False, got 'no'"),
    (
        lambda: make_plan("ppo", "CartPole-v1", "cpu", n_envs=2, overrides={"n_envs": 4}),
        "n_envs=2 and overrides['n_envs']=4 both set n_envs; give one",
    ),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", overrides={1: 2}), "overrides' keys must be preset key names (str)"),
    (lambda: make_plan("dqn", "CartPole-v1", "cpu", overrides={"learning_rat": 1}), "overrides: unknown key 'learning_rat';"),
    (  # the closest key is one policy_kwargs takes, not use_sde (a preset key of its own)
        lambda: make_plan("ppo", "CartPole-v1", "cpu", overrides={"policy_kwargs": {"use_expl": True}}),
        "policy_kwargs of MlpPolicy: unknown key 'use_expl'; did you mean 'use_expln'? (valid: ",
    ),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", n_envs=2**40), "n_envs must be a positive int up to 2,147,483,647"),
    (lambda: make_plan("ppo", "CartPole-v1", "cpu", prober=3), "prober must be a Prober or None, got 3"),
    (
        lambda: build_model(_plan(), make_vec_env("Pendulum-v1", 1, vec_env="dummy")),
        "the env given to build_model has actions Box(-2.0, 2.0, (1,), float32), but the plan's env (CartPole-v1) has "
        "Discrete(2)",
    ),
    (
        lambda: build_model(_plan(), make_vec_env("Acrobot-v1", 1, vec_env="dummy")),
        "the env given to build_model has actions Discrete(3), but the plan's env (CartPole-v1) has Discrete(2)",
    ),
    (lambda: train_run(_plan(), "run", console="stdout"), "console must be a rich Console or None, got 'stdout'"),
    (lambda: train_run(_plan(), "run", progress="no"), "progress must be True or False, got 'no'"),
    (lambda: resume_run(5), "run dir: expected a folder path, got 5"),
    (lambda: record_video(_ppo(), "CartPole-v1", 5), "path: expected the mp4 file's path, got 5"),
]


def _raises() -> gym.Env:
    return 1 / 0  # type: ignore[return-value]


def _ppo() -> Any:
    return make_model("ppo", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", probe=False, n_steps=32, batch_size=32).model


@pytest.mark.parametrize("call, message", CASES)
def test_bad_arguments_are_refused_in_one_line_before_anything_is_written(call, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ConfigError, TypeError), match=re.escape(message)) as raised:
        call()
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()  # nothing was made for a call refused


def test_enable_amp_refuses_a_loss_scale_that_cannot_scale():
    model, _ = make_model("ppo", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", probe=False, n_steps=32, batch_size=32)
    with pytest.raises(ConfigError, match=r"init_scale must be a finite number > 0, got -1"):
        enable_amp(model, "fp16", init_scale=-1)
    with pytest.raises(ConfigError, match=r"growth_interval must be a positive int, got 0"):
        enable_amp(model, "fp16", growth_interval=0)
    assert getattr(model.policy, "_sb3_gpu_amp", None) is None  # refused before anything was switched


def test_train_run_refuses_a_run_dir_that_holds_files(tmp_path):
    """An empty run dir may exist (the CLI makes it first, and trains into it); one that holds files is another run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.zip").write_bytes(b"PK")
    (run / "config.yaml").write_text("algo: ppo\n")
    with pytest.raises(ConfigError, match=r"run dir .*run already holds config.yaml, model.zip; runs are never overwrit"):
        train_run(_plan(), run, progress=False, report_s=None)
    assert (run / "model.zip").read_bytes() == b"PK" and sorted(p.name for p in run.iterdir()) == ["config.yaml", "model.zip"]


def test_train_run_refuses_a_run_dir_tensorboard_cannot_name_before_training(tmp_path):
    run = tmp_path / b"run\xff".decode("utf-8", "surrogateescape")  # bytes that are no UTF-8, as Linux's argv gives them
    with pytest.raises(ConfigError, match=r"^cannot use run dir '.*run\\udcff': its name is not valid UTF-8"):
        train_run(_plan(), run, progress=False, report_s=None)
    assert list(tmp_path.iterdir()) == []


def test_train_run_refuses_a_python_object_its_config_cannot_hold_before_making_anything(tmp_path):
    plan = make_plan(
        "ppo",
        "CartPole-v1",
        "cpu",
        n_envs=1,
        n_timesteps=64,
        overrides={
            "probe": False,
            "n_steps": 32,
            "batch_size": 32,
            "policy_kwargs": {"optimizer_class": th.optim.RMSprop, "optimizer_kwargs": {"alpha": 0.9}},
        },
    )
    message = r"^train_run cannot save this plan: config.yaml holds plain data only .*, and policy_kwargs.optimizer_class is "
    with pytest.raises(ConfigError, match=message + r"<class 'torch.optim.rmsprop.RMSprop'>; train it with build_"):
        train_run(plan, tmp_path / "run", progress=False, report_s=None)
    assert list(tmp_path.iterdir()) == []  # it wrote monitor files, then failed on the config: a dir nothing could resume


def test_numpy_numbers_deep_in_policy_kwargs_are_written_as_plain_ones():
    import numpy as np

    from sb3_gpu.runs.training import _python_object

    kwargs = {"optimizer_kwargs": {"betas": (np.float64(0.9), 0.99), "amsgrad": np.bool_(True)}}
    plan = make_plan("ppo", "CartPole-v1", "cpu", overrides={"probe": False, "policy_kwargs": kwargs})
    written = plan.to_config()["hyperparameters"]["policy_kwargs"]["optimizer_kwargs"]
    assert written == {"betas": (0.9, 0.99), "amsgrad": True} and type(written["betas"][0]) is float
    assert _python_object(plan.to_config()["hyperparameters"]) is None  # train_run takes it


def test_a_ppo_batch_over_one_rollout_is_said_in_the_plans_words_once():
    """The plan table flags it; a caller of make_model, who sees no table, gets it as a warning (not SB3's garbled
    "after every 0 untruncated mini-batches")."""
    with pytest.warns(UserWarning) as caught:
        make_model("ppo", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", probe=False)
    messages = [str(w.message) for w in caught]
    assert messages == [
        "batch_size 256 (ppo.yaml:CartPole-v1) is more than one rollout (n_steps * n_envs = 32 * 1 = 32): each minibatch "
        "is the whole rollout; give batch_size=32 or less"
    ]
    with pytest.warns(UserWarning) as caught:  # SB3's own words for it ("untruncated mini-batches") are not repeated
        make_model("ppo", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", probe=False, batch_size=7)
    assert [str(w.message) for w in caught] == [
        "batch_size 7 (override) is not a factor of the rollout (n_steps * n_envs = 32): each epoch ends on a minibatch of 4"
    ]


def _cartpole_factory() -> gym.Env:
    return gym.make("CartPole-v1")


@pytest.mark.heavy
def test_a_run_trained_on_a_factory_is_evaluated_and_resumed_with_it_and_says_so_without(tmp_path, call_main):
    from sb3_gpu.train import main as train_main

    overrides = {"probe": False, "threads": 1, "n_steps": 64, "batch_size": 64, "n_epochs": 1}
    plan = make_plan("ppo", _cartpole_factory, "cpu", seed=0, n_envs=1, vec_env="dummy", n_timesteps=128, overrides=overrides)
    run = tmp_path / "run"
    train_run(plan, run, eval_freq=64, eval_episodes=1, progress=False, report_s=None)
    said = r"run/config.yaml: the run trained on an env factory given in Python \(_cartpole_factory\), which a config file"
    with pytest.raises(ConfigError, match=said + r" cannot rebuild; pass it again: evaluate_run\(run, env=the_factory\)"):
        evaluate_run(run, episodes=1)
    with pytest.raises(ConfigError, match=said + r" cannot rebuild; pass it again: resume_run\(run, env=the_factory\)"):
        resume_run(run, timesteps=256, progress=False, report_s=None)
    assert evaluate_run(run, episodes=1, env=_cartpole_factory)["episodes"] == 1
    assert resume_run(run, timesteps=256, progress=False, report_s=None, env=_cartpole_factory)["timesteps"] >= 256
    out = call_main(train_main, "--config", str(run / "config.yaml"), "--plan")
    assert out.returncode == 2 and "give --env to replay it on a registered env" in out.stderr
    assert call_main(train_main, "--config", str(run / "config.yaml"), "--env", "CartPole-v1", "--plan").returncode == 0


def test_a_whole_float_count_is_taken_as_configs_write_it():
    plan = make_plan("ppo", "CartPole-v1", "cpu", n_envs=2.0, n_timesteps=1e5, vec_env="dummy", overrides=NO_PROBE)
    assert plan.preset.n_envs == 2 and plan.preset.n_timesteps == 100_000


def test_a_torch_device_is_taken_as_sb3_takes_it():
    plan = make_plan("ppo", "CartPole-v1", th.device("cpu", 0), vec_env="dummy", overrides=NO_PROBE)
    assert plan.device.device == "cpu" and plan.to_config()["device"] == "cpu"  # its text: config.yaml holds no object
    with pytest.raises(ConfigError, match="device 'cuda' asked for a CUDA GPU") if not th.cuda.is_available() else _no_error():
        make_plan("ppo", "CartPole-v1", th.device("cuda"), vec_env="dummy", overrides=NO_PROBE)
    assert choose_device(th.device("cpu", 0), "mlp", True, detect_hardware()).device == "cpu"  # the same in each
    with pytest.raises(ConfigError, match="no such run dir") as refused:
        evaluate_run("nowhere", device=th.device("cpu"))  # the run is what it refuses, not the device
    assert "device" not in str(refused.value)


def _no_error() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _sized(size: int = 3) -> gym.Env:
    return gym.make("CartPole-v1")


def test_a_factory_is_named_by_its_function_with_env_kwargs_or_through_a_partial():
    # Its name is all a run's config keeps of it, and what an error or evaluate_run says to pass again: it read
    # "partial" where env_kwargs were given.
    import functools

    by_kwargs = make_plan("ppo", _sized, "cpu", vec_env="dummy", overrides={**NO_PROBE, "env_kwargs": {"size": 4}})
    through_partial = make_plan("ppo", functools.partial(_sized, 4), "cpu", vec_env="dummy", overrides=NO_PROBE)
    assert by_kwargs.env.name == through_partial.env.name == "_sized"


def _with_difficulty(make):
    import functools

    @functools.wraps(make)
    def made(*args, difficulty=0, **kwargs):
        env = make(*args, **kwargs)
        env.difficulty = difficulty
        return env

    return made


@_with_difficulty
def _decorated(length: int = 10) -> gym.Env:
    return gym.make("CartPole-v1")


def test_env_kwargs_a_decorator_takes_are_not_judged_by_the_function_it_wraps():
    gym.register("DecoratedCartPole-v0", entry_point=_decorated)
    try:
        for env in (_decorated, "DecoratedCartPole-v0"):
            plan = make_plan("ppo", env, "cpu", vec_env="dummy", overrides={**NO_PROBE, "env_kwargs": {"difficulty": 2}})
            made = plan.env.make()
            assert made.get_wrapper_attr("difficulty") == 2
    finally:
        gym.registry.pop("DecoratedCartPole-v0")
