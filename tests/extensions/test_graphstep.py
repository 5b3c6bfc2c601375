"""The DQN family's gradient step compiled whole (inductor on the CPU): the same updates as SB3's, no graph breaks, no
host reads, and a non-finite gradient skipped on the device and named at the next log write."""

from __future__ import annotations

import copy
import types
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from sb3_contrib import QRDQN
from stable_baselines3 import DQN, PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure

from sb3_gpu.common.errors import TrainingDiverged
from sb3_gpu.extensions.accumulate import GradAccumPPO
from sb3_gpu.extensions.amp import enable_amp
from sb3_gpu.extensions.compile import CompileFallbackWarning
from sb3_gpu.extensions.graphstep import Descent
from sb3_gpu.extensions.hostreads import HostReads
from sb3_gpu.extensions.per import (
    DevicePrioritizedReplayBuffer,
    DeviceSumMinTree,
    PrioritizedDQN,
    PrioritizedQRDQN,
    PrioritizedReplayBuffer,
    SumMinTree,
)
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.extensions.rollout import DeviceRolloutBuffer
from sb3_gpu.extensions.stepping import LossScale, optimizer_step, settle_guards
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.callbacks import NanGuard
from tests.conftest import DEVICES, compiled_mode, no_syncs

COMMON = dict(learning_rate=1e-3, batch_size=16, learning_starts=0, seed=3, device="cpu")
ALGOS = {
    "dqn": (DQN, PrioritizedDQN, {"net_arch": [16]}),
    "qrdqn": (QRDQN, PrioritizedQRDQN, {"net_arch": [16], "n_quantiles": 5}),
}


@pytest.fixture(autouse=True)
def torch_trees(monkeypatch):
    """Device PER trees run their tensor ops, as on a GPU (numba's loops, the CPU's default, read host views)."""
    monkeypatch.setattr(DeviceSumMinTree.__init__, "__defaults__", ("cpu", 16, None, "torch"))


def _cartpole_observations(rng):
    return rng.normal(size=(1, 4)).astype(np.float32)


def _fill(*models, n=64, observations=_cartpole_observations, actions=2):
    """The same ``n`` random transitions into each model's buffer (``observations(rng)`` draws one)."""
    rng = np.random.default_rng(0)
    for _ in range(n):
        obs, nxt = observations(rng), observations(rng)
        args = (obs, nxt, rng.integers(0, actions, (1, 1)), rng.normal(size=1), rng.integers(0, 2, 1).astype(float), [{}])
        for m in models:
            m.replay_buffer.add(*args)
    for m in models:
        m._current_progress_remaining = 1.0
        m.set_logger(configure(None, [""]))


def _train(model, seed, steps=1):
    np.random.seed(seed)  # the replay buffers draw from NumPy's global generator: both models get the same batches
    model.train(gradient_steps=steps, batch_size=16)


def _train_drawing_as_compiled(model, seed, steps=1):
    """``_train`` for an eager model on the prioritized device buffer whose ``sample()`` calls take, one by one, the
    rows of one draw of all the steps' (and micro-batches') uniforms: the draws a compiled step that samples in its
    graph makes."""
    np.random.seed(seed)
    rows = iter(model.replay_buffer.uniforms(16, steps * model.grad_accum_steps))
    model.replay_buffer._uniforms = lambda batch_size: next(rows)
    try:
        model.train(gradient_steps=steps, batch_size=16)
    finally:
        del model.replay_buffer._uniforms
    assert next(rows, None) is None  # each row drawn once


# On CUDA the weights are held less tightly: cuBLAS and the compiled kernels sum in orders of their own.
TOLERANCE = {"cpu": {"rtol": 1e-5, "atol": 1e-6}, "cuda": {"rtol": 1e-4, "atol": 1e-5}}


def test_the_graph_steps_adam_decays_weights_as_torchs():
    # The written-out Adam's weight decay (optimizer_kwargs weight_decay, which it takes): no test gave it one.
    policy_kwargs = {"net_arch": [16], "optimizer_kwargs": {"weight_decay": 0.1}}
    plain = DQN("MlpPolicy", "CartPole-v1", **COMMON, policy_kwargs=policy_kwargs)
    ours = PrioritizedDQN("MlpPolicy", "CartPole-v1", **COMMON, policy_kwargs=policy_kwargs)
    ours.policy.load_state_dict(plain.policy.state_dict())
    assert ours.compile_step("eager") is None
    _fill(plain, ours)
    for i in range(5):
        _train(plain, i)
        _train(ours, i)
    for a, b in zip(plain.policy.parameters(), ours.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, **TOLERANCE["cpu"])


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("algo", list(ALGOS))
def test_the_compiled_step_updates_as_sb3s_train(algo, compiled, device):
    plain_cls, ours_cls, policy_kwargs = ALGOS[algo]
    # A small max_grad_norm, so that clipping takes part; a learning-rate schedule, read at each train().
    kwargs = dict(COMMON, policy_kwargs=policy_kwargs, max_grad_norm=0.05, learning_rate=lambda p: 1e-3 * p, device=device)
    plain, ours = plain_cls("MlpPolicy", "CartPole-v1", **kwargs), ours_cls("MlpPolicy", "CartPole-v1", **kwargs)
    ours.policy.load_state_dict(plain.policy.state_dict())
    assert ours.compile_step(compiled_mode(device) if compiled else "eager") is None
    _fill(plain, ours)
    losses = []
    # The clipping norm changed after compile_step, as SB3 reads it at each step: the compiled step kept 0.05. QR-DQN
    # takes None (no clipping; SB3's DQN refuses it).
    norms = {3: 0.01, 5: None if algo == "qrdqn" else 1e3}
    for i in range(6):
        for m in (plain, ours):
            m._current_progress_remaining = 1.0 - i / 10
            m.max_grad_norm = norms.get(i, m.max_grad_norm)
            _train(m, seed=i)
        losses.append(plain.logger.name_to_value["train/loss"])
    assert ours._compiled_step.fallback is None  # compiled with fullgraph=True: no graph breaks
    tolerance = TOLERANCE[device]
    for a, b in zip(plain.policy.parameters(), ours.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, **tolerance)
    # Summed on the device over six train() calls (on CUDA, inside the replayed graph) and read once.
    assert ours._device_log.read()["train/loss"] == pytest.approx(np.mean(losses), rel=tolerance["rtol"])
    # Adam's state is the optimizer's own: it saves and loads as torch's Adam does, and carries on there.
    theirs, mine = plain.policy.optimizer.state_dict(), ours.policy.optimizer.state_dict()
    for p in theirs["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            # check_device off: on CUDA torch's Adam counts its steps on the host, the capturable one on the device.
            theirs_value, mine_value = theirs["state"][p][key], mine["state"][p][key]
            th.testing.assert_close(theirs_value, mine_value, rtol=tolerance["rtol"], atol=1e-7, check_device=False)
    plain.policy.optimizer.load_state_dict(mine)
    _train(plain, seed=9)
    assert int(plain.policy.optimizer.state_dict()["state"][0]["step"]) == 7


def _device_per_dqn(**kwargs):
    model = PrioritizedDQN(
        "MlpPolicy",
        "CartPole-v1",
        replay_buffer_class=DevicePrioritizedReplayBuffer,
        replay_buffer_kwargs={"alpha": 0.6, "beta": 0.5},
        policy_kwargs={"net_arch": [16]},
        **{**COMMON, **kwargs},
    )
    _fill(model)
    return model


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_step_with_device_per_reads_nothing_back_and_equals_the_eager_one(device):
    eager, compiled = _device_per_dqn(device=device), _device_per_dqn(device=device)
    compiled.policy.load_state_dict(eager.policy.state_dict())
    assert compiled.compile_step(compiled_mode(device)) is None
    for m in (eager, compiled):
        train = _train if m is compiled else _train_drawing_as_compiled
        train(m, seed=0)  # compiles, and sets the optimizer's state up
        for seed in (1, 2):  # under the counting mode, which dynamo guards on: compiled, on CUDA recorded, again
            with HostReads():
                train(m, seed=seed)
        with HostReads() as reads, no_syncs(device if m is compiled else "cpu"):
            train(m, seed=3, steps=4)
        if m is compiled:
            assert reads.total == 0, reads.sites
    assert compiled._compiled_step.fallback is None  # a failure inside the graph (a sync refused) would fall back
    tolerance = TOLERANCE[device]
    for a, b in zip(eager.policy.parameters(), compiled.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, **tolerance)
    leaves = th.arange(64, device=device)
    # A priority is |TD error| ** alpha: a TD error near zero (a difference of two close Q-values) turns float
    # rounding into a large relative difference, so the leaves are held to an absolute tolerance too.
    tree_tolerance = {"rtol": tolerance["rtol"], "atol": 1e-4}
    th.testing.assert_close(eager.replay_buffer.tree[leaves], compiled.replay_buffer.tree[leaves], **tree_tolerance)


@pytest.mark.heavy
def test_a_non_finite_gradient_is_skipped_on_the_device_and_named_when_the_flags_are_read():
    model = _device_per_dqn()
    assert model.compile_step() is None
    guard = optimizer_step(model.policy.optimizer, model.policy)
    guard.on_non_finite = lambda name: TrainingDiverged(f"[{name}]")
    _train(model, seed=0)
    before = [p.detach().clone() for p in model.policy.parameters()]
    state = {k: v.clone() for k, v in model.policy.optimizer.state_dict()["state"][0].items()}
    model.replay_buffer.rewards[:] = float("nan")  # every TD error, loss and gradient is NaN from here
    with HostReads() as reads:
        _train(model, seed=1, steps=3)
    assert reads.total == 0, reads.sites
    for a, b in zip(before, model.policy.parameters(), strict=True):
        assert th.equal(a, b)
    for key, value in model.policy.optimizer.state_dict()["state"][0].items():
        assert th.equal(value, state[key]), key
    assert int(model.replay_buffer.refused_updates) == 3  # PER refused the TD errors, on the device too
    # Compiled, smooth L1's backward takes the sign of a NaN as 0 (inductor's), so the gradients can come out finite
    # and only the loss is named; where they are NaN, the first parameter is.
    with pytest.raises(TrainingDiverged, match=r"^\[(q_net\.q_net\.0\.weight)?\]$"):
        settle_guards(model)
    assert int(model._compiled_step.skipped) == 3 and guard.steps == 4


@pytest.mark.heavy
def test_the_compiled_step_follows_a_replaced_optimizer_state():
    model = _device_per_dqn()
    model.compile_step()
    _train(model, seed=0, steps=2)
    saved = copy.deepcopy(model.policy.optimizer.state_dict())  # state_dict() holds the live tensors
    _train(model, seed=1, steps=3)
    model.policy.optimizer.load_state_dict(saved)  # as loading a run does: new state tensors
    _train(model, seed=2)
    assert int(model.policy.optimizer.state_dict()["state"][0]["step"]) == 3


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"policy_kwargs": {"optimizer_class": th.optim.SGD}}, "runs Adam's update, and this optimizer is SGD"),
        ({"policy_kwargs": {"optimizer_kwargs": {"amsgrad": True}}}, "plain Adam"),
        ({"policy_kwargs": {"optimizer_kwargs": {"weight_decay": 0.1, "decoupled_weight_decay": True}}}, "plain Adam"),
        (
            {"grad_accum_steps": 2, "replay_buffer_class": PrioritizedReplayBuffer},
            "gradient accumulation with prioritized replay whose trees are searched on the host",
        ),
    ],
)
def test_what_the_compiled_step_cannot_run_stays_torchs_own_step_with_the_reason(kwargs, reason):
    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", **COMMON, **kwargs)
    assert reason in model.compile_step()
    assert model._compiled_step is None


def test_a_step_that_fails_to_compile_runs_uncompiled_with_a_warning(monkeypatch):
    model = _device_per_dqn()
    model.compile_step()

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(model._compiled_step, "_compiled", broken)
    with pytest.warns(CompileFallbackWarning, match="no C.. compiler"):
        _train(model, seed=0, steps=2)
    assert model._n_updates == 2 and model._compiled_step.fallback is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, seed=1)  # warned once


def test_a_device_out_of_memory_inside_the_compiled_step_is_raised_not_run_again_uncompiled(monkeypatch):
    # A CUDA graph's first call runs the step: part of the update may have landed before the device ran out.
    model = _device_per_dqn()
    model.compile_step()
    calls = []

    def out_of_memory(*args, **kwargs):
        calls.append(1)
        raise th.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model._compiled_step, "_compiled", out_of_memory)
    before = [p.detach().clone() for p in model.policy.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        with pytest.raises(th.cuda.OutOfMemoryError):
            _train(model, seed=0, steps=1)
    assert calls == [1] and model._compiled_step.fallback is None
    assert all(th.equal(a, b) for a, b in zip(before, model.policy.parameters(), strict=True))  # nothing run again


@pytest.mark.heavy
@pytest.mark.parametrize("algo", list(ALGOS))
def test_the_compiled_step_runs_under_bf16_autocast_as_the_eager_one(algo):
    _, cls, policy_kwargs = ALGOS[algo]
    eager, compiled = (cls("MlpPolicy", "CartPole-v1", policy_kwargs=policy_kwargs, **COMMON) for _ in range(2))
    compiled.policy.load_state_dict(eager.policy.state_dict())
    start = [p.detach().clone() for p in eager.policy.parameters()]
    for m, mode in ((eager, "eager"), (compiled, "default")):
        enable_amp(m, "bf16")
        assert m.compile_step(mode) is None
    _fill(eager, compiled)
    for i in range(4):
        for m in (eager, compiled):
            _train(m, seed=i)
    assert compiled._compiled_step.fallback is None
    moved = 0
    for a, b, s in zip(eager.policy.parameters(), compiled.policy.parameters(), start, strict=True):
        if not th.equal(a, s):  # the online network moved (by about 4e-3), the same in both up to rounding
            moved += 1
            th.testing.assert_close(a, b, rtol=0, atol=1e-5)
        else:  # the target network, updated by neither step in 4 gradient steps
            assert th.equal(b, s)
    assert moved >= 2  # the online network's weights and biases at least


@pytest.mark.heavy
def test_a_plan_that_compiles_dqn_compiles_its_gradient_step_and_learns():
    plan = make_plan(
        "dqn",
        "CartPole-v1",
        "cpu",
        seed=3,
        overrides={"compile": "default", "net_arch": [32], "learning_starts": 50, "per": False},
        vec_env="dummy",
    )
    model = build_model(plan, build_env(plan))
    assert isinstance(model, PrioritizedDQN) and model._compiled_step is not None
    model.learn(400)
    assert model._n_updates > 0 and model._compiled_step.fallback is None
    assert int(model.policy.optimizer.state_dict()["state"][0]["step"]) == model._n_updates


SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2, "policy_kwargs": {"net_arch": [32, 32]}}


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip_range_vf", [None, 0.2])
def test_ppos_compiled_step_updates_and_logs_as_sb3s_train(clip_range_vf, device):
    # One rollout each, then one train() (4 minibatch steps): the same actions, so the same data for both.
    kwargs = dict(SMALL_PPO, clip_range_vf=clip_range_vf, clip_range=lambda p: 0.1 + 0.1 * p, seed=1, device=device)
    ours = GradAccumPPO("MlpPolicy", "CartPole-v1", **kwargs)
    assert ours.compile_step(compiled_mode(device)) is None
    ours.learn(64)
    plain = PPO("MlpPolicy", "CartPole-v1", **kwargs).learn(64)
    assert ours._compiled_step.fallback is None and ours._n_updates == plain._n_updates == 2
    _assert_ppo_updated_and_logged_as(ours, plain, **TOLERANCE[device], log_rel=1e-4)


def test_ppos_graph_step_clips_to_the_norm_the_model_has_at_each_train():
    # Its Descent kept the norm it was built with: a max_grad_norm changed later clipped to the old one, where SB3's
    # train() reads the attribute at each step. The graph step run eagerly is the compiled one's function.
    def learn(model):
        model.learn(64)
        model.max_grad_norm = 1e-4  # every minibatch's gradient clipped far below the default 0.5's
        return model.learn(64, reset_num_timesteps=False)

    kwargs = dict(SMALL_PPO, seed=1, device="cpu")
    ours = GradAccumPPO("MlpPolicy", "CartPole-v1", **kwargs)
    assert ours.compile_step("eager") is None
    learn(ours)
    plain = learn(PPO("MlpPolicy", "CartPole-v1", **kwargs))  # built after: its seed sets torch's generator anew
    _assert_ppo_updated_and_logged_as(ours, plain, **TOLERANCE["cpu"], log_rel=1e-4)


def _assert_ppo_updated_and_logged_as(ours, plain, rtol, atol, log_rel):
    """``ours`` (a GradAccumPPO) holds ``plain``'s weights and logs its last train()'s figures."""
    for a, b in zip(ours.policy.parameters(), plain.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=rtol, atol=atol)
    pending = ours._device_log.read()
    for key in ("policy_gradient_loss", "value_loss", "entropy_loss", "clip_fraction", "approx_kl", "loss"):
        expected = float(plain.logger.name_to_value[f"train/{key}"])
        assert pending[f"train/{key}"] == pytest.approx(expected, rel=log_rel, abs=1e-6), key


@pytest.mark.heavy
def test_ppos_compiled_rollout_forward_collects_what_sb3s_forward_collects():
    # Random ops as torch's own (inductor would otherwise draw from its own generator on some devices).
    kwargs = dict(SMALL_PPO, rollout_buffer_class=DeviceRolloutBuffer)
    ours = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=2, device="cpu", **kwargs)
    assert ours.compile_step() is None
    with th._inductor.config.patch(fallback_random=True):
        ours.learn(64)  # one rollout (then one train())
    plain = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=2, device="cpu", **kwargs).learn(64)  # seeded as ours was
    assert ours._compiled_act.fallback is None and "forward" not in vars(ours.policy)  # put back after the rollout
    for name in ("observations", "actions", "value_tensor", "log_probs", "rewards", "episode_starts"):
        th.testing.assert_close(getattr(ours.rollout_buffer, name), getattr(plain.rollout_buffer, name), msg=name)


@pytest.mark.heavy
def test_a_rollout_forward_that_fails_to_compile_runs_uncompiled_with_a_warning(monkeypatch):
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu", **SMALL_PPO)
    assert model.compile_step() is None

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(model._compiled_act, "_compiled", broken)
    with pytest.warns(CompileFallbackWarning, match=r"the compiled rollout forward pass failed \(RuntimeError: no C"):
        model.learn(64)
    assert model.num_timesteps == 64 and model._compiled_act._compiled is None


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
def test_ppos_compiled_step_on_the_device_rollout_buffer_reads_nothing_back(device):
    kwargs = dict(SMALL_PPO, rollout_buffer_class=DeviceRolloutBuffer)
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=1, device=device, **kwargs)
    assert model.compile_step(compiled_mode(device)) is None
    model.learn(64)
    for _ in range(2):  # under the counting mode, which dynamo guards on: compiled, on CUDA recorded, again
        with HostReads():
            model.train()
    with HostReads() as reads, no_syncs(device):
        model.train()
    assert reads.total == 0, reads.sites
    assert model._compiled_step.fallback is None  # a failure inside the graph (a sync refused) would fall back


def _adam_steps(model):
    return [int(state["step"]) for state in model.policy.optimizer.state_dict()["state"].values()]


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["eager", "default"])
def test_ppos_compiled_step_with_target_kl_stops_where_sb3_stops(mode):
    # Eight minibatches an epoch: SB3 stops in the middle of one, where a minibatch's KL is too large. The compiled
    # step computes the epoch's later ones but holds their steps back on the device, and logs none of them.
    kwargs = dict(n_steps=128, batch_size=16, n_epochs=4, target_kl=0.01, learning_rate=3e-3, seed=4, device="cpu")
    kwargs["policy_kwargs"] = {"net_arch": [32, 32]}
    ours = GradAccumPPO("MlpPolicy", "CartPole-v1", **kwargs)
    assert ours.compile_step(mode) is None
    ours.learn(256)
    plain = PPO("MlpPolicy", "CartPole-v1", **kwargs).learn(256)
    assert ours._compiled_step.fallback is None and int(ours._descent.skipped) == 0, "no held step counted as a NaN"
    assert ours._n_updates == plain._n_updates < 2 * 4, "an early stop happened"
    steps = _adam_steps(plain)
    assert _adam_steps(ours) == steps and steps[0] % 8, "the same steps taken, the last epoch stopped midway"
    # The case the logged figures below check: the last train() stops at the first minibatch of its third epoch (2 + 3
    # updates; 15 + 16 steps), so the means must leave out that epoch's other seven.
    assert (plain._n_updates, steps[0]) == (5, 31)
    assert optimizer_step(ours.policy.optimizer).steps == steps[0], "held-back steps are not counted as taken"
    th.testing.assert_close(th.as_tensor(ours.rollout_buffer.actions), th.as_tensor(plain.rollout_buffer.actions))
    _assert_ppo_updated_and_logged_as(ours, plain, rtol=1e-4, atol=1e-5, log_rel=1e-3)


def test_the_descents_learning_rate_follows_the_optimizers_and_is_filled_only_when_it_changes():
    net = th.nn.Linear(3, 1)
    optimizer = th.optim.Adam(net.parameters(), lr=0.1)
    descent = Descent(optimizer, optimizer_step(optimizer, net), max_grad_norm=None)
    descent.prepare()
    assert float(descent.lr) == pytest.approx(0.1)
    with th.profiler.profile() as prof:
        descent.prepare()  # the same rate: no fill, a kernel of its own on a GPU at every step
    assert not [e for e in prof.events() if e.name == "aten::fill_"]
    optimizer.param_groups[0]["lr"] = 0.05  # a schedule's next value
    descent.prepare()
    assert float(descent.lr) == pytest.approx(0.05)


@pytest.mark.parametrize("loss_value", [1.0, float("nan")], ids=["finite", "nan"])
def test_a_step_held_back_by_its_gate_changes_nothing_and_counts_as_no_skip(loss_value):
    net = th.nn.Linear(3, 1)
    optimizer = th.optim.Adam(net.parameters(), lr=0.1)
    guard = optimizer_step(optimizer, net)
    guard.loss_scale = LossScale(init_scale=4.0, growth_interval=1)  # fp16's scale: a taken step grows it
    descent = Descent(optimizer, guard, max_grad_norm=None)
    before = [p.detach().clone() for p in net.parameters()]

    def step(gate):
        descent.prepare()
        descent(net(th.ones(2, 3)).pow(2).mean() * loss_value, th.tensor(gate))
        descent.finish(True)

    step(False)
    assert all(th.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    assert int(descent.skipped) == 0 and float(optimizer.state[net.weight]["step"]) == 0
    assert guard.loss_scale.scale == 4.0 and int(guard.loss_scale.tensors[1]) == 0  # neither backed off nor grown
    step(True)
    finite = loss_value == 1.0
    assert float(optimizer.state[net.weight]["step"]) == int(finite)
    assert guard.loss_scale.scale == (8.0 if finite else 2.0)  # a NaN above a scale of 1: an overflow, the scale's
    assert int(descent.skipped) == 0


@pytest.mark.heavy
@pytest.mark.parametrize(("target_kl", "epochs"), [(1e-12, 1), (1e9, 2)], ids=["stops-at-once", "never-stops"])
def test_ppos_compiled_step_with_target_kl_reads_once_per_epoch(target_kl, epochs):
    kwargs = dict(SMALL_PPO, rollout_buffer_class=DeviceRolloutBuffer)
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", seed=1, device="cpu", **kwargs)
    assert model.compile_step() is None
    model.learn(64)
    model.target_kl = target_kl  # read at each train(): set late, it holds from the next one
    updates = model._n_updates
    with HostReads() as reads:
        model.train()
    assert model._n_updates - updates == epochs
    assert reads.total == epochs, reads.sites


@pytest.mark.heavy
def test_ppos_compiled_step_with_target_kl_says_where_it_stopped(capsys):
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", device="cpu", target_kl=1e-12, verbose=1, **SMALL_PPO)
    assert model.compile_step() is None
    model.learn(64)
    assert model._n_updates == 1
    assert "Early stopping at step 0 due to reaching max kl: 0.00" in capsys.readouterr().out


@pytest.mark.heavy
def test_many_models_in_one_process_each_compile_their_step():
    # Dynamo's recompile limit (8) is per code object: each step has one of its own, as a tuning study needs.
    for _ in range(9):
        model = _device_per_dqn()
        assert model.compile_step() is None
        _train(model, seed=0)
        assert model._compiled_step.fallback is None


@pytest.mark.heavy
def test_a_step_that_would_overflow_a_weight_is_skipped_and_the_guard_needs_no_read_per_rollout():
    model = _device_per_dqn(learning_rate=1e38)  # finite gradients, but an update far beyond float32's range
    model.compile_step()
    guard = NanGuard()
    guard.init_callback(model)
    guard.on_training_start(locals(), globals())
    before = [p.detach().clone() for p in model.policy.parameters()]
    _train(model, seed=0, steps=2)
    assert all(th.equal(a, b) for a, b in zip(before, model.policy.parameters(), strict=True))
    with HostReads() as reads:
        guard.on_rollout_start()  # the weights cannot have turned non-finite: nothing read
    assert reads.total == 0
    with pytest.raises(TrainingDiverged, match=r"the update of q_net\.q_net\.0\.weight is NaN or inf"):
        settle_guards(model)


def _uniform_dqn(n_steps=3, **kwargs):
    """A DQN on the uniform device buffer, with 3-step returns and two envs, filled past a wrap-around."""
    model = PrioritizedDQN(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=2, seed=0),
        replay_buffer_class=DeviceReplayBuffer,
        replay_buffer_kwargs={"n_steps": n_steps, "gamma": 0.99},
        buffer_size=300,
        policy_kwargs={"net_arch": [16]},
        **{**COMMON, "learning_starts": 400, **kwargs},
    )
    model.learn(800)  # 400 vec steps into 150 slots of two envs: full, the write position inside the buffer
    return model


def test_samples_drawn_inside_the_graph_are_the_buffers_own():
    buffer = _uniform_dqn().replay_buffer
    assert buffer.full and 0 < buffer.pos < buffer.buffer_size == 150
    draws = buffer.draws(64)
    position = th.zeros(2, dtype=th.long)
    buffer.fill_position(position)
    ours = buffer.samples_at_draws(draws, position)
    slots, envs = (draws[0] * 150).long(), (draws[1] * 2).long()
    theirs = buffer._get_samples_at(slots, envs)  # the n-step returns stop at the newest slot, read from buffer.pos
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None and b is None) or th.equal(a, b)


@pytest.mark.heavy
@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_a_step_that_samples_inside_its_graph_equals_the_same_step_run_eagerly(grad_accum_steps):
    # Accumulating, each micro-batch is drawn inside the one graph of its step.
    compiled, eager = _uniform_dqn(grad_accum_steps=grad_accum_steps), _uniform_dqn(grad_accum_steps=grad_accum_steps)
    for model, mode in ((compiled, "default"), (eager, "eager")):
        assert model.compile_step(mode) is None
        with HostReads() as reads:
            _train(model, seed=0, steps=8)
        assert reads.total == 0, reads.sites
    assert compiled._compiled_step.fallback is None
    _assert_same_training(compiled, eager)


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("size", "fanout", "top", "sizes"),
    [(90, 4, 7, [96, 24, 6]), (10, 4, 16, [10]), (300, 16, 4096, [300])],  # tops of 6 and 10 pad to whole groups
)
def test_the_compiled_search_equals_the_host_trees(size, fanout, top, sizes):
    """Compiled, the search takes its running sums as masked sums and the top as groups of ``fanout``: the same
    leaves as the host tree's search, also past the total and with empty leaves and empty groups around them."""
    rng = np.random.default_rng(size)
    values = rng.integers(0, 1600, size) / 16
    values[rng.random(size) < 0.3] = 0.0
    values[-(size // 3) :] = 0.0  # empty groups at the end: a prefix at the total takes the last non-empty leaf
    host = SumMinTree(size, fanout=fanout, top=top)
    host.update(np.arange(size), values)
    tree = DeviceSumMinTree(size, "cpu", fanout, top, "torch")
    tree.update(th.arange(size), th.as_tensor(values))
    assert tree._sizes == sizes
    search = th.compile(tree.find, fullgraph=True, dynamic=False)
    for _ in range(3):
        prefix = np.array([0.0, 1.0, *rng.random(62)]) * host.total
        found, priorities = search(th.as_tensor(prefix))
        expected, expected_priorities = host.find(prefix)
        np.testing.assert_array_equal(found.numpy(), expected)
        np.testing.assert_array_equal(priorities.numpy(), expected_priorities)


def _prioritized_dqn(cls=PrioritizedDQN, **kwargs):
    """A DQN on the prioritized device buffer, with 3-step returns and two envs, filled past a wrap-around."""
    model = cls(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=2, seed=0),
        replay_buffer_class=DevicePrioritizedReplayBuffer,
        replay_buffer_kwargs={"n_steps": 3, "gamma": 0.99, "alpha": 0.6, "beta": 0.5, "normalize": "buffer"},
        buffer_size=300,
        **{**COMMON, "learning_starts": 400, "policy_kwargs": {"net_arch": [16]}, **kwargs},
    )
    model.learn(800)
    return model


@pytest.mark.heavy
def test_prioritized_sampling_and_updates_inside_the_graph_equal_the_buffers_own_sample_and_update():
    compiled, eager = _prioritized_dqn(), _prioritized_dqn()
    assert compiled.compile_step() is None
    compiled.replay_buffer.sample = None  # the in-graph draws, never the buffer's sample()
    for model in (compiled, eager):
        model._current_progress_remaining = 0.5  # beta annealed half-way: a tensor in the graph, a float eagerly
        with HostReads() as reads:
            (_train if model is compiled else _train_drawing_as_compiled)(model, seed=0, steps=8)
        assert reads.total == 0 or model is eager, reads.sites
    assert compiled._compiled_step.fallback is None
    for a, b in zip(eager.policy.parameters(), compiled.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mine, theirs = compiled.replay_buffer, eager.replay_buffer
    leaves = th.arange(300)
    th.testing.assert_close(mine.tree[leaves], theirs.tree[leaves], rtol=1e-5, atol=0)
    th.testing.assert_close(mine.tree.total, theirs.tree.total, rtol=1e-6, atol=0)  # the ancestors follow the leaves
    th.testing.assert_close(mine.tree.total, mine.tree[leaves].sum(), rtol=1e-12, atol=0)
    th.testing.assert_close(mine.max_priority, theirs.max_priority, rtol=1e-5, atol=0)
    assert int(mine.refused_updates) == int(theirs.refused_updates) == 0
    assert not th.equal(mine.tree[leaves], mine._new_leaf.expand(300))  # the priorities did move


@pytest.mark.heavy
def test_a_buffer_loaded_after_compile_step_is_the_one_fixed_and_sampled():
    model = _prioritized_dqn()
    assert model.compile_step() is None
    first = model.replay_buffer
    model.replay_buffer = copy.deepcopy(first)  # what a resumed run's load_replay_buffer does after compile_step
    _train(model, seed=0, steps=2)
    assert model._fixed_buffer is model.replay_buffer is not first and model._compiled_step.fallback is None


def test_a_non_finite_loss_with_finite_gradients_names_no_parameter():
    # Compiled, a NaN can reach the gradients as zeros (inductor's sign of NaN is 0): the step is skipped, and the
    # message must not blame the first parameter, whose gradient was finite.
    net = th.nn.Linear(3, 2)
    optimizer = th.optim.Adam(net.parameters(), lr=1e-2)
    guard = optimizer_step(optimizer, net)
    names: list[str] = []
    guard.on_non_finite = lambda name: names.append(name) or TrainingDiverged(f"[{name}]")
    descent = Descent(optimizer, guard, max_grad_norm=None)
    before = [p.detach().clone() for p in net.parameters()]
    descent.prepare()
    descent(net(th.ones(1, 3)).sum() * 0.0 + float("nan"))  # gradients 0, the loss NaN
    descent.finish(stepped=True)
    for a, b in zip(before, net.parameters(), strict=True):
        assert th.equal(a, b)
    net.optimizer = optimizer  # where settle_guards finds a policy's optimizers
    with pytest.raises(TrainingDiverged, match=r"^\[\]$"):
        settle_guards(types.SimpleNamespace(policy=net))
    assert names == [""]


def test_a_non_finite_gradient_names_its_parameter():
    net = th.nn.Sequential(th.nn.Linear(3, 2), th.nn.Linear(2, 1))
    optimizer = th.optim.Adam(net.parameters(), lr=1e-2)
    guard = optimizer_step(optimizer, net)
    guard.on_non_finite = lambda name: TrainingDiverged(f"[{name}]")
    descent = Descent(optimizer, guard, max_grad_norm=None)
    descent.prepare()
    net[1].bias.register_hook(lambda g: g * float("nan"))  # the second layer's bias only
    descent(net(th.ones(1, 3)).sum())
    descent.finish(stepped=True)
    net.optimizer = optimizer
    with pytest.raises(TrainingDiverged, match=r"^\[1\.bias\]$"):
        settle_guards(types.SimpleNamespace(policy=net))


def test_an_fp16_step_whose_update_overflows_a_weight_is_the_guards_not_the_loss_scales():
    # Finite loss and gradients, a float32 weight made infinite by the update: a divergence, not an fp16 overflow. The
    # scale must not back off (it would hide the divergence until it fell to 1) and the guard names the weight.
    weight = th.nn.Parameter(th.full((1,), 3.0e38))
    optimizer = th.optim.Adam([weight], lr=1e38)
    guard = optimizer_step(optimizer, names={id(weight): "w"})
    scale = LossScale(init_scale=2.0**16)
    guard.scale_losses(scale)
    guard.on_non_finite = lambda name: TrainingDiverged(f"[{name}]")
    descent = Descent(optimizer, guard, max_grad_norm=None)
    descent.prepare()
    descent(-(weight.sum() * 1e-30))  # loss -3e8, gradient -1e-30 per unit: Adam's step of lr overflows the weight
    descent.finish(stepped=True)
    assert th.equal(weight.detach(), th.full((1,), 3.0e38))  # skipped
    assert scale.scale == 2.0**16 and scale.skipped_steps == 0
    with pytest.raises(TrainingDiverged, match=r"^\[update of w\]$"):
        settle_guards(types.SimpleNamespace(policy=_holder(optimizer)))


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_an_fp16_nan_at_a_scale_of_one_is_named_at_once_however_many_micro_batches_accumulate(micro_batches):
    # At a scale of 1 a non-finite gradient is no overflow: the eager step's rule, which must not read the scale
    # multiplied by the micro-batches (at 4, a real NaN went unnamed until the scale fell to a quarter).
    weight = th.nn.Parameter(th.ones(3))
    optimizer = th.optim.Adam([weight], lr=1e-3)
    guard = optimizer_step(optimizer, names={id(weight): "w"})
    if micro_batches > 1:
        guard.accumulate(micro_batches)
    guard.scale_losses(LossScale(init_scale=1.0))
    guard.on_non_finite = lambda name: TrainingDiverged(f"[{name}]")
    descent = Descent(optimizer, guard, None, accumulates=micro_batches > 1)
    descent.prepare()
    descent(weight.sum() * float("nan"))
    descent.finish(stepped=True)
    with pytest.raises(TrainingDiverged, match=r"^\[w\]$"):
        settle_guards(types.SimpleNamespace(policy=_holder(optimizer)))


def _holder(optimizer: th.optim.Optimizer) -> th.nn.Module:
    """A module holding ``optimizer``, where settle_guards looks for a policy's optimizers."""
    holder = th.nn.Module()
    holder.optimizer = optimizer  # type: ignore[assignment]
    return holder


@pytest.mark.parametrize("poisoned_first", ["compiled", "fused"])
def test_the_guard_names_the_right_parameter_when_a_run_switches_between_the_compiled_and_the_fused_step(poisoned_first):
    # A run can leave the compiled step for torch's fused one (accumulation switched on, a loss scale swapped) and come
    # back after a load; a skipped step's position, read only at the next log write, must still name its parameter,
    # whichever step recorded it, and even where the fused step saw gradients for some parameters only.
    net = th.nn.Sequential(th.nn.Linear(3, 2), th.nn.Linear(2, 1))
    optimizer = th.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    guard = optimizer_step(optimizer, net)
    guard.defer_checks = True
    guard.on_non_finite = lambda name: TrainingDiverged(f"[{name}]")
    descent = Descent(optimizer, guard, max_grad_norm=None)

    def compiled(poison):
        descent.prepare()
        hook = net[1].bias.register_hook(lambda g: g * float("nan")) if poison else None
        descent(net(th.ones(1, 3)).sum())
        descent.finish(stepped=True)
        if hook is not None:
            hook.remove()

    def fused(poison):
        optimizer.zero_grad()
        hook = net[1].bias.register_hook(lambda g: g * float("nan")) if poison else None
        net[1](th.ones(1, 2)).sum().backward()  # the first layer gets no gradient
        optimizer.step()
        if hook is not None:
            hook.remove()

    first, then = (compiled, fused) if poisoned_first == "compiled" else (fused, compiled)
    first(poison=True)
    then(poison=False)
    assert guard.steps == 2
    net.optimizer = optimizer
    with pytest.raises(TrainingDiverged, match=r"^\[1\.bias\]$"):
        settle_guards(types.SimpleNamespace(policy=net))


class _Frames(gym.Env):
    """Random uint8 frames, as an Atari env's observations (SB3's image checks: a Box bounded by 0 and 255)."""

    observation_space = gym.spaces.Box(0, 255, (1, 36, 36), np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self._frame(), {}

    def step(self, action):
        self._t += 1
        return self._frame(), float(action == 1), False, self._t >= 16, {}

    def _frame(self):
        return self.np_random.integers(0, 256, (1, 36, 36), dtype=np.uint8)


@pytest.mark.heavy
def test_a_cnn_policys_step_and_forward_pass_compile_without_a_graph_break():
    # SB3's preprocess_obs asks is_image_space about the frames' bounds with NumPy comparisons: a data-dependent branch
    # in the graph unless sb3_gpu makes the answer a constant.
    kwargs = dict(n_steps=16, batch_size=16, n_epochs=1, policy_kwargs={"features_extractor_kwargs": {"features_dim": 32}})
    ours = GradAccumPPO("CnnPolicy", make_vec_env(_Frames, n_envs=2), seed=1, device="cpu", **kwargs)
    assert ours.compile_step() is None
    with warnings.catch_warnings(), th._inductor.config.patch(fallback_random=True):  # actions sampled as torch's
        warnings.simplefilter("error", CompileFallbackWarning)
        ours.learn(32)
    plain = PPO("CnnPolicy", make_vec_env(_Frames, n_envs=2), seed=1, device="cpu", **kwargs).learn(32)  # seeded anew
    assert ours._compiled_step.fallback is None and ours._compiled_act.fallback is None
    th.testing.assert_close(th.as_tensor(ours.rollout_buffer.actions), th.as_tensor(plain.rollout_buffer.actions))
    _assert_ppo_updated_and_logged_as(ours, plain, rtol=1e-4, atol=1e-5, log_rel=1e-3)


def _assert_same_training(ours, theirs):
    for a, b in zip(ours.policy.parameters(), theirs.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for mine, other in zip(_adam_state(ours), _adam_state(theirs), strict=True):
        th.testing.assert_close(mine, other, rtol=1e-5, atol=1e-7)
    assert ours._n_updates == theirs._n_updates


def _adam_state(model):
    return [t for state in model.policy.optimizer.state_dict()["state"].values() for t in state.values()]


@pytest.mark.heavy
@pytest.mark.parametrize("algo", list(ALGOS))
def test_a_compiled_step_takes_a_whole_accumulation_window_as_torchs_step_does(algo):
    # Three micro-batches per step, drawn from SB3's host buffer one after the other as torch's step draws them; a
    # small max_grad_norm, so that clipping (of the mean gradient) takes part.
    _, cls, policy_kwargs = ALGOS[algo]
    kwargs = dict(COMMON, policy_kwargs=policy_kwargs, max_grad_norm=0.05, grad_accum_steps=3)
    compiled, eager = cls("MlpPolicy", "CartPole-v1", **kwargs), cls("MlpPolicy", "CartPole-v1", **kwargs)
    compiled.policy.load_state_dict(eager.policy.state_dict())
    assert compiled.compile_step() is None
    _fill(compiled, eager)
    losses = []
    for i in range(4):
        for m in (compiled, eager):
            _train(m, seed=i, steps=2)
        losses.append(eager._device_log.read()["train/loss"])
        losses[-1] = (losses[-1], compiled._device_log.read()["train/loss"])
    assert compiled._compiled_step.fallback is None
    _assert_same_training(compiled, eager)
    assert int(_adam_state(compiled)[0]) == 8  # one Adam step per window of three micro-batches
    for theirs, mine in losses:  # the mean over the micro-batches
        assert mine == pytest.approx(theirs, rel=1e-5)


@pytest.mark.heavy
@pytest.mark.parametrize("cls", [PrioritizedDQN, PrioritizedQRDQN])
def test_a_compiled_step_samples_each_micro_batch_after_the_last_ones_priority_update(cls):
    # Prioritized device buffer, sampled inside the graph: the second micro-batch is drawn from the priorities the
    # first one left, as torch's accumulating step draws it, with no read from the device.
    extra = {"policy_kwargs": {"net_arch": [16], "n_quantiles": 5}} if cls is PrioritizedQRDQN else {}
    compiled, eager = _prioritized_dqn(cls, grad_accum_steps=2, **extra), _prioritized_dqn(cls, grad_accum_steps=2, **extra)
    assert compiled.compile_step() is None
    compiled.replay_buffer.sample = None  # the in-graph draws, never the buffer's sample()
    for model in (compiled, eager):
        with HostReads() as reads:
            (_train if model is compiled else _train_drawing_as_compiled)(model, seed=0, steps=4)
        assert reads.total == 0 or model is eager, reads.sites
    assert compiled._compiled_step.fallback is None
    _assert_same_training(compiled, eager)
    mine, theirs = compiled.replay_buffer, eager.replay_buffer
    leaves = th.arange(300)
    th.testing.assert_close(mine.tree[leaves], theirs.tree[leaves], rtol=1e-5, atol=0)
    th.testing.assert_close(mine.max_priority, theirs.max_priority, rtol=1e-5, atol=0)


def test_sb3s_image_check_is_a_graph_constant_where_this_torch_takes_a_space_as_its_argument():
    from stable_baselines3.common import preprocessing

    from sb3_gpu.extensions import compile as compile_module

    compile_module.own_code(lambda: None)
    # torch 2.13's dynamo guards on the space's identity: a marked function with a space argument traces.
    assert compile_module._constants_take_objects()
    assert getattr(preprocessing.is_image_space, "_dynamo_marked_constant", False)


def test_an_accumulating_fp16_step_backpropagates_each_micro_batch_at_the_full_scale(monkeypatch):
    # The loss is the micro-batches' mean: scaled by the scale times their number, each one's backward pass runs at
    # the scale torch's accumulating step runs it at, so the two overflow alike.
    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", grad_accum_steps=2, policy_kwargs={"net_arch": [16]}, **COMMON)
    enable_amp(model, "fp16", init_scale=2.0**8)
    assert model.compile_step("eager") is None
    _fill(model)
    backpropagated = []
    grad = th.autograd.grad

    def recorded(outputs, *args, **kwargs):
        backpropagated.append(float(outputs))
        return grad(outputs, *args, **kwargs)

    monkeypatch.setattr(th.autograd, "grad", recorded)
    _train(model, seed=0)
    assert backpropagated == [pytest.approx(model._device_log.read()["train/loss"] * 2.0**8 * 2, rel=1e-3)]


@pytest.mark.heavy
@pytest.mark.parametrize("algo", list(ALGOS))
def test_a_discrete_observation_space_compiles_its_step_whole_and_updates_as_sb3s_train(algo):
    # SB3 one-hot encodes the observation with int(observation_space.n), a NumPy integer: a graph break unless the
    # policy's space has a Python int (the env's own space keeps its NumPy one).
    plain_cls, ours_cls, policy_kwargs = ALGOS[algo]
    kwargs = dict(COMMON, policy_kwargs=policy_kwargs)
    plain, ours = plain_cls("MlpPolicy", "FrozenLake-v1", **kwargs), ours_cls("MlpPolicy", "FrozenLake-v1", **kwargs)
    ours.policy.load_state_dict(plain.policy.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        assert ours.compile_step() is None
        _fill(plain, ours, observations=lambda rng: rng.integers(0, 16, (1,)), actions=4)  # FrozenLake's 16 cells
        for i in range(3):
            for m in (plain, ours):
                _train(m, seed=i)
    assert ours._compiled_step.fallback is None and not isinstance(ours.observation_space.n, int)
    for a, b in zip(plain.policy.parameters(), ours.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_missing_cxx_compiler_found_by_one_graph_is_not_looked_for_again_by_the_step():
    """SAC traced its gradient step for most of a minute, to fail on the compiler its action pass had not found."""
    from torch._inductor.exc import InductorError, InvalidCxxCompiler

    from sb3_gpu.extensions.graphstep import CompiledFunction, CompiledUpdate

    def no_compiler(*inputs):
        inner = InvalidCxxCompiler()
        raise InductorError(inner, None) from inner

    def never(*inputs):
        raise AssertionError("the step was compiled")

    act = CompiledFunction(lambda x: (x + 1,), "default", "action forward pass")
    act._compiled = no_compiler
    step = CompiledUpdate(lambda x: (x * 2,), [], "default", siblings=[act])
    step._compiled = never
    with pytest.warns(CompileFallbackWarning) as caught:
        assert act(th.ones(1))[0].item() == 2.0 and act.no_compiler
        assert step(th.ones(1))[0].item() == 2.0
    assert [str(w.message) for w in caught][1] == (
        "no C++ compiler was found as the action forward pass compiled, so the gradient step runs uncompiled too "
        "(install g++ or clang to compile, or set compile false)"
    )
    assert step(th.ones(1))[0].item() == 2.0  # uncompiled from then on, with no warning more
    other = CompiledFunction(lambda x: (x,), "default", "action forward pass")
    other._compiled = lambda x: (_ for _ in ()).throw(RuntimeError("an op inductor does not know"))
    with pytest.warns(CompileFallbackWarning):
        other(th.ones(1))
    assert not other.no_compiler  # another failure of one graph says nothing of the others
