"""The training extensions: AMP (bf16 autocast, fp16 loss scaling, on the CPU), gradient accumulation, torch.compile;
with all of them off, plain SB3 bit for bit."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch as th
from sb3_contrib import QRDQN
from stable_baselines3 import DQN, PPO
from stable_baselines3.common.logger import KVWriter, Logger
from stable_baselines3.common.utils import explained_variance

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.accumulate import GradAccumPPO
from sb3_gpu.extensions.amp import amp_state, enable_amp
from sb3_gpu.extensions.compile import compile_policy
from sb3_gpu.extensions.hostreads import HostReads, no_argument_checks
from sb3_gpu.extensions.networks import NarrowLinear, narrow_linears
from sb3_gpu.extensions.per import PrioritizedDQN
from sb3_gpu.extensions.rollout import DeviceRolloutBuffer
from sb3_gpu.extensions.stepping import LossScale, optimizer_step, settle_guards
from sb3_gpu.planning.build import build_env, build_model, model_class, model_kwargs
from sb3_gpu.planning.optimizers import fused
from sb3_gpu.planning.plan import make_plan
from tests.conftest import DEVICES

SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2, "policy_kwargs": {"net_arch": [32, 32]}}


def _params(model) -> list[th.Tensor]:
    return [p.detach().clone() for p in model.policy.parameters()]


# --------------------------------------------------------------------------- all switches off: plain SB3
@pytest.mark.parametrize("algo", ["ppo", "dqn"])
def test_switches_off_train_bit_identical_to_plain_sb3(algo):
    overrides = {"amp": "off", "compile": False, "net_arch": [32, 32], "n_envs": 2}
    overrides |= {"n_steps": 64, "batch_size": 32, "n_epochs": 2} if algo == "ppo" else {"learning_starts": 50, "per": False}
    plan = make_plan(algo, "CartPole-v1", "cpu", seed=3, overrides=overrides, vec_env="dummy")
    ours = build_model(plan, build_env(plan))
    ours.learn(512)
    kwargs = plan.preset.sb3_kwargs()
    kwargs.pop("grad_accum_steps", None)
    plain_class = PPO if algo == "ppo" else DQN
    plain = plain_class(plan.preset.policy, build_env(plan), device="cpu", seed=3, **kwargs)
    plain.learn(512)
    assert type(ours) is plain_class
    assert ours._n_updates == plain._n_updates > 0
    for a, b in zip(_params(ours), _params(plain), strict=True):
        assert th.equal(a, b)


@pytest.mark.parametrize("clip_range_vf", [None, 0.2])
def test_grad_accum_of_one_is_plain_ppo_and_logs_the_same_figures_without_reading_the_device(clip_range_vf):
    models = []
    for cls, extra in ((GradAccumPPO, {"grad_accum_steps": 1}), (PPO, {})):
        model = cls("MlpPolicy", "CartPole-v1", seed=1, device="cpu", clip_range_vf=clip_range_vf, **SMALL_PPO, **extra)
        model.learn(128)  # its last train() ran after the last log write: its figures are pending
        models.append(model)
    ours, plain = models
    for a, b in zip(_params(ours), _params(plain), strict=True):
        assert th.equal(a, b)
    pending = ours._device_log.read()
    for key in ("policy_gradient_loss", "value_loss", "entropy_loss", "clip_fraction", "approx_kl", "loss"):
        assert pending[f"train/{key}"] == pytest.approx(float(plain.logger.name_to_value[f"train/{key}"]), rel=1e-5), key
    assert pending["train/explained_variance"] == pytest.approx(plain.logger.name_to_value["train/explained_variance"])
    with HostReads() as reads:
        ours.train()
    assert reads.total == 0, reads.sites


@pytest.mark.parametrize("step", ["torch", "graph"])
def test_ppos_clipping_and_entropy_bonus_where_they_take_effect_update_as_sb3s(step):
    # The defaults leave them idle in a short run (the ratio stays inside a clip of 0.2; no entropy bonus): a
    # flipped min, a value clip read from the policy's or a bonus of the wrong sign updated as SB3's there.
    ppo = {**SMALL_PPO, "n_epochs": 4, "clip_range": 0.02, "clip_range_vf": 0.05, "ent_coef": 0.01, "learning_rate": 3e-3}
    ours = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=1, device="cpu", **ppo)
    if step == "graph":
        assert ours.compile_step("eager") is None  # the compiled step's function, run uncompiled
    ours.learn(128)
    plain = PPO("MlpPolicy", "CartPole-v1", seed=1, device="cpu", **ppo).learn(128)
    assert plain.logger.name_to_value["train/clip_fraction"] > 0
    for a, b in zip(_params(ours), _params(plain), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    pending = ours._device_log.read()
    for key in ("policy_gradient_loss", "value_loss", "entropy_loss", "clip_fraction", "loss"):
        assert pending[f"train/{key}"] == pytest.approx(plain.logger.name_to_value[f"train/{key}"], rel=1e-4, abs=1e-6), key


def test_ppo_on_the_device_rollout_buffer_reads_nothing_back_either():
    model = GradAccumPPO(
        "MlpPolicy", "CartPole-v1", seed=1, device="cpu", rollout_buffer_class=DeviceRolloutBuffer, **SMALL_PPO
    )
    model.learn(128)
    model._device_log.read()
    with HostReads() as reads:
        model.train()
    assert reads.total == 0, reads.sites  # explained variance too, from the buffer's tensors
    buffer = model.rollout_buffer
    expected = explained_variance(buffer.values.flatten(), buffer.returns.flatten())
    assert model._device_log.read()["train/explained_variance"] == pytest.approx(expected, rel=1e-6)


def test_a_fused_optimizer_what_gpu_plans_take_updates_as_sb3s_does():
    fused_kwargs = fused(SMALL_PPO["policy_kwargs"], on_policy=True)
    assert fused_kwargs["optimizer_kwargs"] == {"eps": 1e-5, "fused": True}  # SB3's PPO default eps is kept
    # Each built and trained in turn: a model's seed sets NumPy's global generator, which the minibatches draw from.
    ours = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=1, device="cpu", **{**SMALL_PPO, "policy_kwargs": fused_kwargs})
    ours.learn(128)
    plain = PPO("MlpPolicy", "CartPole-v1", seed=1, device="cpu", **SMALL_PPO).learn(128)
    assert ours.policy.optimizer.defaults["fused"] and not plain.policy.optimizer.defaults["fused"]
    for a, b in zip(_params(ours), _params(plain), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_qrdqn_keeps_the_optimizer_kwargs_given_and_a_gpu_plans_fused_adam(gpu_machine):
    # sb3-contrib's QR-DQN replaced any optimizer_kwargs by its eps=0.01/batch_size where no optimizer_class was named.
    small = {"batch_size": 32, "net_arch": [16], "learning_starts": 10, "per": False}
    defaults = build_model(plan := make_plan("qrdqn", "CartPole-v1", "cpu", overrides=small), build_env(plan))
    assert defaults.policy.optimizer.defaults["eps"] == 0.01 / 32  # the paper's, as sb3-contrib gives it
    given = {**small, "policy_kwargs": {"optimizer_kwargs": {"eps": 1e-3, "weight_decay": 1e-4}}}
    model = build_model(plan := make_plan("qrdqn", "CartPole-v1", "cpu", overrides=given), build_env(plan))
    assert (model.policy.optimizer.defaults["eps"], model.policy.optimizer.defaults["weight_decay"]) == (1e-3, 1e-4)
    gpu = make_plan("qrdqn", "CartPole-v1", "cuda", hardware=gpu_machine, overrides=small)
    kwargs = model_kwargs(gpu)
    assert kwargs["policy_kwargs"]["optimizer_kwargs"] == {"eps": 0.01 / 32, "fused": True}
    built = QRDQN("MlpPolicy", "CartPole-v1", device="cpu", **{k: v for k, v in kwargs.items() if k != "overlap_training"})
    assert built.policy.optimizer.defaults["fused"]  # what sb3-contrib builds from them (the class on the GPU is ours)


@pytest.mark.parametrize("algo, env", [("ppo", "CartPole-v1"), ("sac", "Pendulum-v1"), ("qrdqn", "CartPole-v1")])
def test_a_cpu_run_resumed_under_a_gpu_plan_trains_with_its_fused_optimizers_from_where_it_was(
    gpu_machine, tmp_path, algo, env
):
    # The zip's policy_kwargs, and the saved groups' flags, came back unfused: the NaN guard read the gradients on
    # the host at every step of a GPU run resumed from a CPU one.
    from sb3_gpu.extensions.stepping import entropy_optimizer, optimizer_steps, policy_optimizers
    from sb3_gpu.runs.saving import load_model

    small = {"n_envs": 1, "probe": False, "batch_size": 16, "net_arch": [16], "learning_rate": 1e-3}  # no schedule to 0
    small |= {"n_steps": 32} if algo == "ppo" else {"learning_starts": 20}
    small |= {"per": False} if algo == "qrdqn" else {}
    plans = {d: make_plan(algo, env, d, seed=3, hardware=gpu_machine, profile="gpu", overrides=small) for d in ("cpu", "cuda")}
    saved = build_model(plans["cpu"], build_env(plans["cpu"]))
    saved.learn(64)
    saved.save(tmp_path / "model.zip")

    def optimizers(model):
        return [*policy_optimizers(model.policy), *filter(None, [entropy_optimizer(model)])]

    plan = plans["cuda"]
    kwargs = {"policy": plan.preset.policy, "model_kwargs": model_kwargs(plan), "env": build_env(plan), "device": "cpu"}
    resumed = load_model(model_class(plan), tmp_path / "model.zip", **kwargs)
    assert all(g["fused"] for o in optimizers(resumed) for g in o.param_groups)
    assert all(step.skips_on_device for step in optimizer_steps(resumed))
    for theirs, ours in zip(optimizers(saved), optimizers(resumed), strict=True):  # Adam's moments and counts go on
        for a, b in zip(theirs.state.values(), ours.state.values(), strict=True):
            assert a.keys() == b.keys() and all(th.equal(a[k].float(), b[k].float()) for k in a)
    before = [p.detach().clone() for p in resumed.policy.parameters()]
    resumed.learn(32, reset_num_timesteps=False)
    after = list(resumed.policy.parameters())
    assert all(th.isfinite(p).all() for p in after) and any(not th.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer_class", [th.optim.Adam, th.optim.AdamW, th.optim.SGD])
def test_fusing_a_loaded_optimizer_moves_its_step_counts_where_the_fused_kernels_read_them(device, optimizer_class):
    # torch loads a plain optimizer's step counts as saved: on the host, where a fused kernel on a GPU cannot group
    # them with their parameters.
    from sb3_gpu.planning.optimizers import fuse_loaded

    layer = th.nn.Linear(3, 2).to(device)
    extra = {"momentum": 0.9} if optimizer_class is th.optim.SGD else {}
    plain = optimizer_class(layer.parameters(), lr=0.01, **extra)
    layer(th.ones(1, 3, device=device)).sum().backward()
    plain.step()
    state = copy.deepcopy(plain.state_dict())
    for saved in state["state"].values():
        if "step" in saved:
            saved["step"] = saved["step"].cpu().double()  # as a foreign save may hold it
    loaded = optimizer_class(layer.parameters(), lr=0.01, **extra)
    loaded.load_state_dict(state)
    fuse_loaded(loaded)
    assert all(group["fused"] and not group["foreach"] for group in loaded.param_groups)
    for param, kept in loaded.state.items():
        if "step" in kept:
            assert kept["step"].device == param.device and kept["step"].dtype == th.float32
    reference = optimizer_class(layer.parameters(), lr=0.01, **extra)
    reference.load_state_dict(copy.deepcopy(plain.state_dict()))
    before = [p.detach().clone() for p in layer.parameters()]
    loaded.step()  # the fused kernel takes the moved counts
    fused_after = [p.detach().clone() for p in layer.parameters()]
    with th.no_grad():
        for p, b in zip(layer.parameters(), before, strict=True):
            p.copy_(b)
    reference.step()
    for a, b in zip(fused_after, layer.parameters(), strict=True):
        th.testing.assert_close(a, b)


def test_ppo_with_target_kl_reads_each_minibatchs_kl_as_sb3_does_and_stops_where_it_stops():
    common = {"seed": 4, "device": "cpu", "target_kl": 0.001, "learning_rate": 0.01, **SMALL_PPO}
    ours = GradAccumPPO("MlpPolicy", "CartPole-v1", **common).learn(128)
    plain = PPO("MlpPolicy", "CartPole-v1", **common).learn(128)
    assert ours._n_updates == plain._n_updates < 2 * SMALL_PPO["n_epochs"], "an early stop happened"
    for a, b in zip(_params(ours), _params(plain), strict=True):
        assert th.equal(a, b)


# --------------------------------------------------------------------------- PPO gradient accumulation
def _adam_state(model) -> list[th.Tensor]:
    """Adam's moments, parameter by parameter: the first one is the gradient's scale, which the weights alone hide
    (Adam's update is nearly the same for a gradient k times as large)."""
    state = model.policy.optimizer.state
    return [state[p][key] for p in model.policy.parameters() for key in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("max_grad_norm", [0.05, 1e6], ids=["clipped", "unclipped"])
def test_ppo_accumulating_two_half_batches_equals_one_full_batch(max_grad_norm):
    # normalize_advantage normalises per minibatch, so it would differ between half and full batches. Clipping (on the
    # summed gradient, not on each micro-batch's) would also bring a gradient of the wrong scale back to the same norm.
    common = {"n_steps": 64, "n_epochs": 3, "normalize_advantage": False, "max_grad_norm": max_grad_norm, "seed": 2}
    accumulated = GradAccumPPO("MlpPolicy", "CartPole-v1", batch_size=16, grad_accum_steps=4, device="cpu", **common)
    accumulated.learn(64)
    full = PPO("MlpPolicy", "CartPole-v1", batch_size=64, device="cpu", **common)
    full.learn(64)
    for a, b in zip(_params(accumulated), _params(full), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(_adam_state(accumulated), _adam_state(full), strict=True):
        th.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
    moved = sum(
        (a - b).abs().sum().item()
        for a, b in zip(_params(full), _params(PPO("MlpPolicy", "CartPole-v1", device="cpu", **common)), strict=True)
    )
    assert moved > 0, "training changed the parameters"


def test_ppo_grad_accum_must_divide_the_minibatches():
    with pytest.raises(ConfigError, match="must divide the 2 minibatches"):
        GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, grad_accum_steps=3)
    # 48 samples in minibatches of 32 and 16: the step's mean gave the 16 as much weight as the 32 (SB3's one batch
    # of 48 weighs each sample alike).
    with pytest.raises(ConfigError, match=r"needs minibatches of one size: batch_size=32 must divide n_steps \* n_envs"):
        GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=48, batch_size=32, grad_accum_steps=2)
    GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=48, batch_size=32, grad_accum_steps=1)  # no mean to weigh: SB3's


def test_grad_accum_ppo_saves_and_loads(tmp_path):
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, grad_accum_steps=2, seed=0)
    model.learn(64)
    model.save(tmp_path / "m.zip")
    loaded = GradAccumPPO.load(tmp_path / "m.zip", env=model.get_env())
    assert loaded.grad_accum_steps == 2 and loaded._accumulator is not None
    loaded.learn(64)  # its hooks are in place again


def test_a_grad_accum_ppo_loads_to_act_with_any_env_count_and_is_checked_where_it_trains(tmp_path):
    from sb3_gpu.envs.build import make_vec_env

    one_env = make_vec_env("CartPole-v1", 1)
    four = make_vec_env("CartPole-v1", 4)
    model = GradAccumPPO("MlpPolicy", four, n_steps=64, batch_size=32, grad_accum_steps=4, seed=0)  # 8 minibatches
    model.save(tmp_path / "m4.zip")
    loaded = GradAccumPPO.load(tmp_path / "m4.zip", env=one_env)  # 2 minibatches: it acts, it does not train
    action, _ = loaded.predict(one_env.reset(), deterministic=True)
    assert action.shape == (1,)
    with pytest.raises(ConfigError, match=r"grad_accum_steps=4 must divide the 2 minibatches per epoch"):
        loaded.learn(64)


def test_ppo_grad_accum_is_a_preset_key():
    plan = make_plan("ppo", "CartPole-v1", "cpu", overrides={"grad_accum_steps": 2, "n_steps": 64, "batch_size": 32})
    model = build_model(plan, build_env(plan))
    assert isinstance(model, GradAccumPPO) and model.grad_accum_steps == 2


# --------------------------------------------------------------------------- bf16 autocast
def test_bf16_runs_the_networks_in_bf16_and_hands_back_float32():
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)
    enable_amp(model, "bf16")
    seen = []
    model.policy.mlp_extractor.policy_net[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    obs = th.zeros(4, 4)
    values, log_prob, entropy = model.policy.evaluate_actions(obs, th.zeros(4))
    assert seen == [th.bfloat16]
    assert values.dtype == log_prob.dtype == entropy.dtype == th.float32
    assert amp_state(model).scaler is None, "bf16 needs no loss scaling"
    with pytest.raises(ConfigError, match="already enabled"):
        enable_amp(model, "bf16")


@pytest.mark.parametrize("cls", [DQN, QRDQN])
def test_bf16_dqn_family_trains(cls):
    model = cls("MlpPolicy", "CartPole-v1", learning_starts=32, batch_size=16, policy_kwargs={"net_arch": [32]}, seed=0)
    enable_amp(model, "bf16")
    hidden = next(m for m in model.policy.modules() if isinstance(m, th.nn.Linear))
    seen = set()
    hidden.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    before = _params(model)
    model.learn(200)
    assert seen == {th.bfloat16}, "the networks ran in bf16 while it trained"
    assert math.isfinite(model.logger.name_to_value["train/loss"])
    assert any(not th.equal(a, b) for a, b in zip(before, _params(model), strict=True))


@pytest.mark.parametrize("cls, head", [(DQN, "q_net"), (QRDQN, "quantile_net")])
def test_bf16_keeps_the_q_values_in_float32(cls, head):
    """The hidden layers run in bf16; the layer that gives the Q-values runs in float32, as without AMP: a bf16
    Q-value of 50 moves in steps of 0.25, coarser than the gap between two actions' values."""
    model = cls("MlpPolicy", "CartPole-v1", policy_kwargs={"net_arch": [32]}, device="cpu", seed=0)
    network = getattr(model.policy, head)
    plain = copy.deepcopy(network)
    enable_amp(model, "bf16")
    layers = [m for m in getattr(network, head).modules() if isinstance(m, th.nn.Linear)]
    seen = []
    for layer in layers:
        layer.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    obs = th.as_tensor(np.random.default_rng(0).normal(size=(64, 4)), dtype=th.float32) * 30
    values = network(obs)
    assert seen == [th.bfloat16, th.float32]
    with th.autocast("cpu", dtype=th.bfloat16):
        hidden = th.relu(layers[0](obs)).float()  # what the bf16 hidden layer hands the head
    th.testing.assert_close(values.view(64, -1), th.nn.functional.linear(hidden, layers[1].weight, layers[1].bias))
    assert not th.equal(values, values.bfloat16().float()), "full float32 precision, not bf16 values cast up"
    assert (values - plain(obs)).abs().max() < 0.5  # the same network, up to the hidden layer's bf16 rounding


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_bf16_keeps_ppos_value_and_action_heads_in_float32(env_id):
    """The hidden layers run in bf16; the value and the distribution's parameters (logits, Gaussian mean) come out of
    float32 layers: a bf16 value of 80 moves in steps of 0.5, noise in every advantage, and a bf16 mean makes the
    probability ratio jump in steps."""
    model = PPO("MlpPolicy", env_id, device="cpu", seed=0, **SMALL_PPO)
    policy = model.policy
    enable_amp(model, "bf16")
    seen: dict[str, th.dtype] = {}
    for name in ("value_net", "action_net"):
        getattr(policy, name).register_forward_hook(lambda m, i, out, name=name: seen.__setitem__(name, out.dtype))
    policy.mlp_extractor.value_net[0].register_forward_hook(lambda m, i, out: seen.__setitem__("hidden", out.dtype))
    with th.no_grad():
        policy.value_net.bias.fill_(80.0)
    obs = th.as_tensor(np.random.default_rng(0).normal(size=(256, *model.observation_space.shape)), dtype=th.float32)
    actions = th.as_tensor(np.stack([model.action_space.sample() for _ in range(256)]))
    values, log_prob, _ = policy.evaluate_actions(obs, actions)
    assert seen == {"hidden": th.bfloat16, "value_net": th.float32, "action_net": th.float32}
    assert len(th.unique(values)) > 250  # in bf16: a handful, 0.5 apart
    assert len(th.unique(log_prob)) > 100


def test_a_deep_copy_of_an_amp_policy_runs_its_own_weights():
    model = DQN("MlpPolicy", "CartPole-v1", policy_kwargs={"net_arch": [16]}, device="cpu")  # bf16 autocast on the CPU
    enable_amp(model, "bf16")
    clone = copy.deepcopy(model.policy)
    for p in clone.q_net.parameters():
        p.data.zero_()
    obs = th.ones(2, 4)
    assert th.equal(clone.q_net(obs), th.zeros(2, 2)) and not th.equal(model.policy.q_net(obs), th.zeros(2, 2))
    assert clone.q_net(obs).dtype == th.float32


# --------------------------------------------------------------------------- fp16 loss scaling, on the CPU
@pytest.mark.parametrize("on_device", [False, True])
def test_a_saved_fp16_model_goes_on_from_the_loss_scale_its_run_reached(tmp_path, on_device):
    # From the initial scale again, a resumed run would skip steps until the scale fell back, and count from 0.
    from sb3_gpu.common.io import save_model
    from sb3_gpu.extensions.amp import record_loss_scale

    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0, **SMALL_PPO)
    scaler = enable_amp(model, "fp16", init_scale=2.0**40).scaler
    if on_device:  # where a fused or compiled step keeps it
        scaler.to_device(th.device("cpu"))
    model.learn(128)
    reached = scaler.state()
    assert reached["skipped_steps"] > 0 and reached["scale"] < 2.0**40  # fp16 overflowed at 2**40 and backed off
    record_loss_scale(model)
    save_model(model, tmp_path / "model.zip")
    loaded = PPO.load(tmp_path / "model.zip", device="cpu")
    assert enable_amp(loaded, "fp16", init_scale=2.0**40).scaler.state() == reached
    # A model saved without a loss scale (bf16, or none) starts from the initial one.
    plain = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)
    record_loss_scale(plain)
    save_model(plain, tmp_path / "plain.zip")
    started = enable_amp(PPO.load(tmp_path / "plain.zip", device="cpu"), "fp16", init_scale=2.0**40).scaler.state()
    assert started == {"scale": 2.0**40, "good_steps": 0, "skipped_steps": 0}


@pytest.mark.parametrize(
    "state",
    [
        None,
        {},
        {"scale": "big"},
        {"scale": float("nan"), "good_steps": 0, "skipped_steps": 0},
        {"scale": 2.0**128, "good_steps": 0, "skipped_steps": 0},  # inf as float32, the device scale's dtype
        {"scale": 8.0, "good_steps": -1, "skipped_steps": 0},
        {"scale": 8.0, "good_steps": True, "skipped_steps": 0},
    ],
)
def test_a_loss_scale_state_that_is_not_one_changes_nothing(state):
    scaler = LossScale(init_scale=2.0**16)
    assert scaler.load_state(state) is False
    assert scaler.state() == {"scale": 2.0**16, "good_steps": 0, "skipped_steps": 0}


def _ppo_batch(model, n=32):
    rng = np.random.default_rng(0)
    return th.as_tensor(rng.normal(size=(n, 4)), dtype=th.float32), th.as_tensor(rng.integers(0, 2, n))


def _sb3_step(model, obs, actions, inject_inf=False, max_grad_norm=0.5):
    """What SB3's train() does around a loss: zero_grad, backward, clip, step."""
    optimizer = model.policy.optimizer
    optimizer.zero_grad()
    values, log_prob, _ = model.policy.evaluate_actions(obs, actions)
    (values.pow(2).mean() - log_prob.mean()).backward()
    if inject_inf:
        next(model.policy.parameters()).grad[0] = math.inf  # what an fp16 overflow leaves behind
    norm = th.nn.utils.clip_grad_norm_(model.policy.parameters(), max_grad_norm)
    optimizer.step()
    return norm


def _fused_ppo():
    """PPO whose optimizer is fused and whose step skips on the device (as CUDA plans train)."""
    kwargs = dict(SMALL_PPO, policy_kwargs={**SMALL_PPO["policy_kwargs"], "optimizer_kwargs": {"fused": True}})
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **kwargs)
    optimizer_step(model.policy.optimizer, model.policy).defer_checks = True
    return model


@pytest.mark.parametrize("where", ["host", "device"])
def test_fp16_overflow_skips_the_step_halves_the_scale_and_grows_it_back(where):
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO) if where == "host" else _fused_ppo()
    state = enable_amp(model, "fp16", init_scale=1024.0, growth_interval=2)
    obs, actions = _ppo_batch(model)
    before = _params(model)
    with HostReads() as reads, no_argument_checks():  # (torch.distributions' own checks read too)
        _sb3_step(model, obs, actions, inject_inf=True)
    assert (reads.total == 0) == (where == "device"), reads.sites  # on the device: decided without a wait
    assert (state.scaler.tensors is not None) == (where == "device")
    assert all(th.equal(a, b) for a, b in zip(before, _params(model), strict=True)), "the overflowed step was skipped"
    assert state.scaler.scale == 512.0 and state.scaler.skipped_steps == 1
    _sb3_step(model, obs, actions)
    assert any(not th.equal(a, b) for a, b in zip(before, _params(model), strict=True)), "a good step is taken"
    assert state.scaler.scale == 512.0
    _sb3_step(model, obs, actions)
    assert state.scaler.scale == 1024.0, "after growth_interval good steps the scale doubles"


def test_a_real_fp16_overflow_is_caught_and_the_scale_backs_off():
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)
    state = enable_amp(model, "fp16", init_scale=2.0**40)  # gradients * 2^40 overflow fp16 (max 65504)
    obs, actions = _ppo_batch(model)
    before = _params(model)
    for _ in range(40):
        _sb3_step(model, obs, actions)
        if state.scaler.skipped_steps and any(not th.equal(a, b) for a, b in zip(before, _params(model), strict=True)):
            break
    assert state.scaler.skipped_steps >= 1 and state.scaler.scale < 2.0**40
    assert all(th.isfinite(p).all() for p in model.policy.parameters())


def test_clipping_sees_unscaled_gradients():
    fp32 = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0, **SMALL_PPO)
    fp16 = copy.deepcopy(fp32)
    enable_amp(fp16, "fp16", init_scale=2.0**12)
    obs, actions = _ppo_batch(fp32)
    norms = [_sb3_step(model, obs, actions, max_grad_norm=1e9).item() for model in (fp32, fp16)]
    assert norms[1] == pytest.approx(norms[0], rel=0.05), "the norm clip_grad_norm_ saw is the true one, not 4096x it"


def test_fp16_training_logs_scale_and_skipped_steps():
    model = DQN("MlpPolicy", "CartPole-v1", learning_starts=32, batch_size=16, policy_kwargs={"net_arch": [32]}, seed=0)
    state = enable_amp(model, "fp16", init_scale=2.0**40)  # overflows fp16 at first: steps are skipped, the scale halves
    model.learn(200)
    logged = model.logger.name_to_value
    assert 1 <= logged["amp/skipped_steps"] <= state.scaler.skipped_steps  # logged as the steps went
    assert state.scaler.scale <= logged["amp/scale"] < 2.0**40 and math.isfinite(logged["train/loss"])


def test_fp16_with_ppo_accumulation_counts_only_real_optimizer_steps():
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, n_epochs=1, grad_accum_steps=2, seed=0)
    state = enable_amp(model, "fp16", init_scale=64.0, growth_interval=2)
    model.learn(64)  # 4 micro-batches: 2 optimizer steps, so the scale doubles once (not twice)
    assert state.scaler.skipped_steps == 0 and state.scaler.scale == 128.0


class _Kept(KVWriter):
    """A log output that keeps what each write wrote."""

    def __init__(self):
        self.rows: list[dict] = []

    def write(self, key_values, key_excluded, step=0):
        self.rows.append(dict(key_values))


def test_fp16_scale_on_the_device_is_logged_when_the_logs_are_written():
    model = GradAccumPPO(
        "MlpPolicy",
        "CartPole-v1",
        seed=0,
        device="cpu",
        **{**SMALL_PPO, "policy_kwargs": {"net_arch": [32, 32], "optimizer_kwargs": {"fused": True}}},
    )
    state = enable_amp(model, "fp16", init_scale=2.0**40, growth_interval=2)  # overflows fp16 at first
    kept = _Kept()
    model.set_logger(Logger(None, [kept]))
    model.learn(128)
    assert state.scaler.tensors is not None
    logged = kept.rows[-1]  # written before the last train(), as SB3's PPO writes its logs
    assert 2.0**40 > logged["amp/scale"] >= state.scaler.scale and logged["amp/skipped_steps"] >= 1
    assert all(th.isfinite(p).all() for p in model.policy.parameters())


@pytest.mark.heavy
@pytest.mark.parametrize("algo", ["ppo", "dqn", "dqn-accumulating"])
def test_the_compiled_step_scales_fp16_losses_on_the_device_as_the_eager_step(algo):
    from sb3_gpu.extensions.per import PrioritizedDQN

    def make():
        if algo == "ppo":
            return GradAccumPPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu", **SMALL_PPO)
        return PrioritizedDQN(  # accumulating: each micro-batch's backward pass at the full scale, as torch's step
            "MlpPolicy",
            "CartPole-v1",
            grad_accum_steps=2 if algo == "dqn-accumulating" else 1,
            learning_starts=32,
            batch_size=16,
            seed=0,
            device="cpu",
            policy_kwargs={"net_arch": [32]},
        )

    # A scale that grows (PPO trains 8 steps here, DQN 24) but stays far from fp16's overflow: the same steps taken.
    interval = 3 if algo == "ppo" else 10
    models, states = [], []
    for compile_it in (False, True):  # each seeded, set up and trained in turn: the same data for both
        model = make()
        states.append(enable_amp(model, "fp16", init_scale=2.0**8, growth_interval=interval))
        assert not compile_it or model.compile_step() is None  # fp16 scaling no longer keeps torch's step
        models.append(model.learn(128))
    eager, compiled = models
    assert compiled._compiled_step.fallback is None
    eager_scale, compiled_scale = (s.scaler for s in states)
    assert compiled_scale.tensors is not None and not compiled_scale.hooks_off  # off only during a compiled step
    assert (compiled_scale.scale, compiled_scale.skipped_steps) == (eager_scale.scale, eager_scale.skipped_steps)
    assert compiled_scale.scale > 2.0**8  # it grew
    for a, b in zip(eager.policy.parameters(), compiled.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp16 against fp32 moves them by about 3e-5
    # A scale that overflows fp16 at first: skipped steps back it off on the device; no NaN guard error.
    overflowing = make()
    state = enable_amp(overflowing, "fp16", init_scale=2.0**40)
    assert overflowing.compile_step() is None
    overflowing.learn(128)
    assert state.scaler.skipped_steps >= 1 and state.scaler.scale < 2.0**40
    assert all(th.isfinite(p).all() for p in overflowing.policy.parameters())
    settle_guards(overflowing)  # overflows are the scale's to handle, not the guard's


def test_loss_scaler_never_steps_on_nan():
    param = th.nn.Parameter(th.ones(3))
    optimizer = th.optim.SGD([param], lr=1.0)
    param.grad = th.tensor([1.0, math.nan, 1.0])
    scaler = LossScale(init_scale=8.0)
    optimizer_step(optimizer).scale_losses(scaler)
    optimizer.step()
    assert th.equal(param.detach(), th.ones(3)) and scaler.scale == 4.0


# --------------------------------------------------------------------------- torch.compile
def test_compile_failure_falls_back_with_the_reason(monkeypatch):
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)

    def broken(*args):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr("sb3_gpu.extensions.compile._trial_step", broken)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        reason = compile_policy(model, "default", 32)
    assert reason is not None and "RuntimeError: no C++ compiler found" in reason
    assert all(m._compiled_call_impl is None for m in (model.policy.mlp_extractor, model.policy.action_net))
    assert "forward" not in vars(model.policy.mlp_extractor)  # the class's own again
    model.learn(64)  # trains uncompiled


def test_a_compile_failure_keeps_amps_forward(monkeypatch):
    # apply_speed enables AMP, then compiles: a fallback must leave the autocast wrapper, or the run trains in fp32
    # while its plan says bf16.
    from sb3_gpu.extensions.amp import _amp_forward, _full_precision_forward

    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)
    enable_amp(model, "bf16")

    def broken(*args):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr("sb3_gpu.extensions.compile._trial_step", broken)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        compile_policy(model, "default", 32)
    for module, forward in ((model.policy.mlp_extractor, _amp_forward), (model.policy.action_net, _full_precision_forward)):
        assert module._compiled_call_impl is None and vars(module)["forward"].__func__ is forward
    model.learn(64)


@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("users", [False, True])
def test_compiling_leaves_dynamos_suppress_errors_as_the_process_had_it(monkeypatch, fails, users):
    # It was left True for the whole process after a compile (a user's own failing compile then ran eager without an
    # error), and False after a failed one.
    def trial(*args):
        if fails:
            raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr("sb3_gpu.extensions.compile._trial_step", trial)
    with th._dynamo.config.patch(suppress_errors=users), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_policy(PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO), "default", 32)
        assert th._dynamo.config.suppress_errors is users


def test_a_failed_compile_after_a_good_one_leaves_training_unforgiving(monkeypatch):
    # The first compile marked the policy; the second failed and put its networks back to eager, but the mark stayed,
    # so training went on with dynamo's errors suppressed for networks that were no longer compiled.
    from sb3_gpu.extensions.compile import forgiving_recompiles

    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)
    monkeypatch.setattr("sb3_gpu.extensions.compile._trial_step", lambda *args: None)
    with monkeypatch.context() as m:
        m.setattr(th.nn.Module, "compile", lambda self, **kwargs: None)  # a compile that "succeeds" at once
        assert compile_policy(model, "default", 32) is None
    assert _forgiven(model, forgiving_recompiles) is True

    def broken(*args):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr("sb3_gpu.extensions.compile._trial_step", broken)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        compile_policy(model, "default", 32)
    assert _forgiven(model, forgiving_recompiles) is False


def _forgiven(model, forgiving_recompiles) -> bool:
    with th._dynamo.config.patch(suppress_errors=False), forgiving_recompiles(model):
        return th._dynamo.config.suppress_errors


@pytest.mark.heavy
def test_compile_for_real_keeps_state_dict_keys_and_trains():
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=3, **SMALL_PPO)
    keys = set(model.policy.state_dict())
    drawn = (th.get_rng_state(), model.action_space.np_random.bit_generator.state)
    assert compile_policy(model, "default", 32) is None
    # A seeded run draws the same actions and minibatches compiled or not: the trial's draws were its own.
    assert th.equal(drawn[0], th.get_rng_state()) and drawn[1] == model.action_space.np_random.bit_generator.state
    assert model.policy.mlp_extractor._compiled_call_impl is not None
    assert set(model.policy.state_dict()) == keys, "saved models load in plain SB3"
    model.learn(128)


@pytest.mark.heavy
@pytest.mark.parametrize("amp", [None, "bf16"])
def test_the_networks_compiled_by_the_trial_are_the_ones_training_runs_not_compiled_again(amp):
    # The compiled gradient step narrows the heads (NarrowLinear); done after the trial, the class change failed each
    # compiled network's type guard and compiled it again on its first use.
    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", policy_kwargs={"net_arch": [16]}, learning_starts=0)
    if amp:
        enable_amp(model, amp)
    assert compile_policy(model, "default", 32) is None
    graphs = th._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    narrow_linears(model.policy)  # what compile_step does first: the heads are narrow already
    with th.no_grad():
        model.policy.q_net(th.zeros(1, 4))  # a rollout's forward, as the trial ran it
    model.policy.q_net(th.zeros(32, 4)).sum().backward()  # a training batch's
    assert graphs["unique_graphs"] == before
    assert type(model.policy.q_net.q_net[-1]) is NarrowLinear


@pytest.mark.heavy
def test_models_compiled_one_after_another_each_compile_past_the_recompile_limit():
    # tune's trials build model after model in one process: with networks sharing their forward's code, dynamo's
    # recompile limit (8; 1 here) would leave the later ones uncompiled without a word.
    graphs = th._dynamo.utils.counters["stats"]
    with th._dynamo.config.patch(recompile_limit=1):
        for depth in (1, 2, 3):
            model = DQN("MlpPolicy", "CartPole-v1", device="cpu", policy_kwargs={"net_arch": [8] * depth}, learning_starts=0)
            before = graphs["unique_graphs"]
            assert compile_policy(model, "default", 32) is None
            assert graphs["unique_graphs"] > before, f"depth {depth}: its networks ran uncompiled"
            model.learn(64)


@pytest.mark.heavy
def test_a_real_compiler_failure_falls_back_and_training_goes_on(tmp_path):
    # No working C++ compiler for inductor: compilation fails for real, in its own process and cache dir.
    code = (
        "from stable_baselines3 import PPO\n"
        "from sb3_gpu.extensions.compile import compile_policy\n"
        # On the CPU: on a GPU, inductor's kernels need no C++ compiler, so nothing would fail.
        "m = PPO('MlpPolicy', 'CartPole-v1', n_steps=64, batch_size=32, device='cpu')\n"
        "print('REASON', compile_policy(m, 'default', 32))\n"
        "m.learn(128)\n"
        "print('TRAINED', m.num_timesteps)\n"
    )
    env = {**os.environ, "CXX": "/nonexistent/g++", "CC": "/nonexistent/gcc", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REASON torch.compile failed (" in result.stdout and "training uncompiled" in result.stdout
    assert "TRAINED 128" in result.stdout


@pytest.mark.heavy
def test_torchs_step_after_a_compiled_one_keeps_the_device_scale_moving_and_logs_it():
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu", **SMALL_PPO)
    state = enable_amp(model, "fp16", init_scale=2.0**40)  # overflows fp16 at first
    assert model.compile_step() is None  # the scale now lives on the device
    model._compiled_step = None  # torch's step runs (as after a load), with the outputs' hooks scaling the gradients
    kept = _Kept()
    model.set_logger(Logger(None, [kept]))
    model.learn(192)
    assert state.scaler.tensors is not None and not state.scaler.hooks_off
    assert state.scaler.skipped_steps >= 1 and state.scaler.scale < 2.0**40  # it backed off, on the device
    assert all(th.isfinite(p).all() for p in model.policy.parameters())
    assert kept.rows[-1]["amp/skipped_steps"] >= 1


@pytest.mark.heavy
def test_a_compiled_fp16_step_logs_its_scale():
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu", **SMALL_PPO)
    state = enable_amp(model, "fp16", init_scale=2.0**40)
    assert model.compile_step() is None
    kept = _Kept()
    model.set_logger(Logger(None, [kept]))
    model.learn(192)
    assert model._compiled_step.fallback is None
    assert 2.0**40 > kept.rows[-1]["amp/scale"] >= state.scaler.scale and kept.rows[-1]["amp/skipped_steps"] >= 1


def test_a_torch_whose_module_compile_cannot_be_undone_trains_uncompiled(monkeypatch):
    # The fallback (and overlap's acting copy) clears Module.compile's _compiled_call_impl: under another name, a
    # failed trial would have left the networks compiled while the warning said "training uncompiled".
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", **SMALL_PPO)
    monkeypatch.delattr(th.nn.Module, "_compiled_call_impl")
    with pytest.warns(UserWarning, match=r"Module.compile cannot be undone here; training uncompiled"):
        assert compile_policy(model, "default", 32) is not None
    assert "_sb3_gpu_compiled" not in vars(model.policy)
