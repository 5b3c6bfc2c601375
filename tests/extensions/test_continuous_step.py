"""SAC, TD3 and TQC trained by sb3_gpu's step (extensions.continuous): SB3's updates, uncompiled and compiled, with
nothing read back from the device and every figure logged."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from sb3_contrib import TQC
from stable_baselines3 import SAC, TD3
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.type_aliases import TrainFreq, TrainFrequencyUnit
from stable_baselines3.common.utils import set_random_seed

from sb3_gpu.common.errors import ConfigError, TrainingDiverged
from sb3_gpu.config.schema import ALGOS
from sb3_gpu.extensions.amp import enable_amp
from sb3_gpu.extensions.compile import compile_policy
from sb3_gpu.extensions.continuous import SyncFreeSAC, SyncFreeTD3, SyncFreeTQC
from sb3_gpu.extensions.hostreads import HostReads
from sb3_gpu.extensions.networks import steps_one_optimizer
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.extensions.stepping import optimizer_step, optimizer_steps, settle_guards
from sb3_gpu.planning.optimizers import fused
from tests.conftest import DEVICES, compiled_mode, no_syncs

PAIRS = {"sac": (SAC, SyncFreeSAC), "td3": (TD3, SyncFreeTD3), "tqc": (TQC, SyncFreeTQC)}
SMALL = {"learning_starts": 40, "batch_size": 16, "gradient_steps": 3, "policy_kwargs": {"net_arch": [16, 16]}}
# Each variant reaches a branch the others do not: SAC's delayed target update and fixed entropy coefficient, TD3's
# delayed actor (3 gradient steps per call against a delay of 2: the due steps move between calls), TQC's quantiles.
EXTRA = {
    "sac": {"target_update_interval": 2},
    "sac-fixed": {"ent_coef": 0.05},
    "td3": {},
    "tqc": {"top_quantiles_to_drop_per_net": 1, "policy_kwargs": {"net_arch": [16, 16], "n_quantiles": 5}},
    # gSDE: the exploration matrix drawn before each step and reached by the actor's loss; expln's std on SAC's.
    "sac-sde": {"use_sde": True, "policy_kwargs": {"net_arch": [16, 16], "log_std_init": -1, "use_expln": True}},
    "tqc-sde": {"use_sde": True, "policy_kwargs": {"net_arch": [16, 16], "n_quantiles": 5, "log_std_init": -2}},
}
ACCUMULATING = [case for case in EXTRA if not case.endswith("-sde")]  # refused beside gSDE (a test below)


def _pair(case: str) -> tuple[type, type]:
    return PAIRS[case.split("-")[0]]


def _state(model) -> list[th.Tensor]:
    tensors = [t.detach().clone() for t in model.policy.state_dict().values()]
    if getattr(model, "log_ent_coef", None) is not None:
        tensors.append(model.log_ent_coef.detach().clone())
    return tensors


def _learned(
    cls: type, case: str, steps: int = 100, mode: str | None = None, env: Any = "Pendulum-v1", device: str = "cpu", **kwargs
):
    # Deep-copied: SB3 writes into the policy_kwargs it is given (SAC adds use_sde, which TD3's policy refuses).
    model = cls("MlpPolicy", env, seed=3, device=device, **copy.deepcopy({**SMALL, **EXTRA[case], **kwargs}))
    if mode is not None:
        assert model.compile_step(mode) is None
    return model.learn(steps)


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(EXTRA))
def test_the_uncompiled_step_updates_as_sb3s_train_and_logs_the_same_figures(case):
    plain_cls, ours_cls = _pair(case)
    plain, ours = _learned(plain_cls, case), _learned(ours_cls, case)
    assert ours._n_updates == plain._n_updates == 3 * 60
    for a, b in zip(_state(ours), _state(plain), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if case.endswith("-sde"):  # learn() ends on a train(): the matrices its last step drew, where the actor reads them
        for name in ("exploration_mat", "exploration_matrices"):
            mine, theirs = (getattr(m.actor.action_dist, name) for m in (ours, plain))
            th.testing.assert_close(mine, theirs.detach(), rtol=1e-5, atol=1e-6)
    # One more train() each, on the same draws: SB3 records that call's means, and they are what ours logs too.
    ours._device_log.read()
    for model in (plain, ours):
        set_random_seed(7)
        model.train(gradient_steps=3, batch_size=16)
    pending = ours._device_log.read()
    recorded = ("train/n_updates", "train/learning_rate")  # recorded on the host, as SB3 does
    keys = [k for k in plain.logger.name_to_value if k.startswith("train/") and k not in recorded]
    assert [ours.logger.name_to_value[k] for k in recorded] == [plain.logger.name_to_value[k] for k in recorded]
    assert sorted(pending) == sorted(keys)
    for key in keys:
        assert pending[key] == pytest.approx(plain.logger.name_to_value[key], rel=1e-4, abs=1e-6), key


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(EXTRA))
def test_the_compiled_step_updates_as_sb3s_train_without_a_graph_break(case, device):
    # 60 gradient steps: float rounding, which the written-out Adam orders otherwise than torch's, grows with
    # training (SAC and TD3 differ from SB3 by 3e-7 at 60 steps, by 1e-4 at 180).
    plain_cls, cls = _pair(case)
    plain = _learned(plain_cls, case, steps=60, device=device)
    eager = _learned(cls, case, steps=60, mode="eager", device=device)  # the graph's function run uncompiled
    compiled = _learned(cls, case, steps=60, mode=compiled_mode(device), device=device)  # on CUDA a CUDA graph
    assert compiled._compiled is not None and compiled._compiled.fallback is None  # fullgraph=True: no break
    for a, b, c in zip(_state(eager), _state(compiled), _state(plain), strict=True):
        th.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
        th.testing.assert_close(b, c, rtol=1e-4, atol=1e-5)
        th.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    # Adam's state is each optimizer's own, as torch's Adam keeps it (so it saves, loads and carries on there).
    for ours in (eager, compiled):
        for mine, theirs in zip(_optimizers(ours), _optimizers(plain), strict=True):
            assert list(mine["state"]) == list(theirs["state"])
            for p, state in theirs["state"].items():
                assert th.equal(mine["state"][p]["step"].cpu(), state["step"].cpu())  # on CUDA: device and host
                th.testing.assert_close(mine["state"][p]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-5)
                # Squared gradients are small: held relative to themselves, not to the weights' absolute tolerance.
                th.testing.assert_close(mine["state"][p]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-3, atol=1e-10)
    assert compiled._device_log.read() == pytest.approx(eager._device_log.read(), rel=1e-3, abs=1e-5)
    # Each optimizer's steps counted as taken: TD3's actor at every second step only, as SB3 steps it.
    counts = [step.steps for step in optimizer_steps(compiled)]
    assert counts == [step.steps for step in optimizer_steps(eager)]
    critic = optimizer_step(compiled.critic.optimizer).steps
    assert critic == compiled._n_updates == 60
    assert optimizer_step(compiled.actor.optimizer).steps == (30 if case == "td3" else 60)


def _optimizers(model) -> list[dict[str, Any]]:
    optimizers = [model.actor.optimizer, model.critic.optimizer]
    if getattr(model, "ent_coef_optimizer", None) is not None:
        optimizers.append(model.ent_coef_optimizer)
    return [optimizer.state_dict() for optimizer in optimizers]


class _GridActions(gym.Env):
    """Actions in a 2x2 box, which SB3's actors and buffers flatten to 4."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Box(-1.0, 1.0, (2, 2), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self._observation(), {}

    def _observation(self):  # from the env's seeded generator (the space's own is not seeded by reset)
        return self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)

    def step(self, action):
        self._t += 1
        reward = -float(np.square(action - 0.5).sum())
        return self._observation(), reward, False, self._t >= 20, {}


class _Ending(gym.Env):
    """Episodes that end (terminated, not truncated) every 7 steps: Pendulum only truncates, so the targets' ``1 -
    done`` and n-step returns cut short at an end were never reached."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32), {}

    def step(self, action):
        self._t += 1
        observation = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        return observation, float(np.abs(action).sum()), self._t >= 7, False, {}


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("case", "extra"),
    [
        ("sac", {}),
        # Noise as wide as the actions: TD3's clamp of its noisy target actions to [-1, 1] takes effect.
        ("td3", {"target_policy_noise": 1.0, "target_noise_clip": 1.0}),
        ("tqc", {}),
        ("sac", {"n_steps": 3}),  # SB3's NStepReplayBuffer: each target discounted by its own gamma ** k
        ("td3", {"n_steps": 3}),
        ("tqc", {"n_steps": 3}),
    ],
)
def test_episodes_that_end_and_n_step_returns_step_as_sb3s(case, extra):
    plain_cls, ours_cls = _pair(case)
    plain, ours = (_learned(cls, case, env=_Ending(), **extra) for cls in (plain_cls, ours_cls))
    assert plain.replay_buffer.dones.any()  # episodes ended
    for a, b in zip(_state(ours), _state(plain), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
@pytest.mark.parametrize("case", ["sac", "td3", "tqc", "tqc-sde"])
def test_actions_of_several_dimensions_step_as_sb3s(case):
    plain_cls, ours_cls = _pair(case)
    plain, ours = _learned(plain_cls, case, env=_GridActions()), _learned(ours_cls, case, env=_GridActions())
    for a, b in zip(_state(ours), _state(plain), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The draws made inside the graph, for a batch the device buffer samples there too: compiled, they are the
    # uncompiled function's (the buffer's generator is seeded from the model's seed, so both sample the same batches).
    in_graph, uncompiled = (
        _learned(ours_cls, case, env=_GridActions(), mode=mode, replay_buffer_class=DeviceReplayBuffer)
        for mode in ("default", "eager")
    )
    assert in_graph._compiled is not None and in_graph._compiled.fallback is None
    for a, b in zip(_state(in_graph), _state(uncompiled), strict=True):
        th.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    figures = in_graph._device_log.read()
    assert "train/critic_loss" in figures and all(np.isfinite(v) for v in figures.values())


@pytest.mark.heavy
def test_an_optimizer_state_saved_unfused_is_guarded_on_the_host():
    # A fused policy's entropy optimizer is made fused; a state saved by SB3's plain one unfuses its param group.
    model = _learned(SyncFreeSAC, "sac", policy_kwargs=fused(SMALL["policy_kwargs"], on_policy=False))
    model.ent_coef_optimizer.load_state_dict(_learned(SAC, "sac").ent_coef_optimizer.state_dict())
    assert model.ent_coef_optimizer.defaults["fused"] and not model.ent_coef_optimizer.param_groups[0]["fused"]
    _guarded(model)
    assert not optimizer_step(model.ent_coef_optimizer).skips_on_device
    assert optimizer_step(model.critic.optimizer).skips_on_device
    before = model.log_ent_coef.detach().clone()
    model.train(gradient_steps=2, batch_size=16)  # a fused kernel's skip flag, given to a plain Adam, would fail
    assert not th.equal(before, model.log_ent_coef)


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["sac", "td3", "tqc", "sac-sde"])
def test_a_step_sampled_inside_the_graph_from_a_device_buffer_reads_nothing_back(case, device):
    _, cls = _pair(case)
    kwargs = {"replay_buffer_class": DeviceReplayBuffer, "device": device}
    # On the CPU the graph's function run eagerly reads what the compiled one would (and spares a compile); on CUDA
    # the CUDA graph itself, under the sync debug mode.
    model = _learned(cls, case, mode=compiled_mode(device) if device != "cpu" else "eager", **kwargs)
    kwargs["policy_kwargs"] = fused(SMALL["policy_kwargs"], on_policy=False)
    uncompiled = _learned(cls, case, **kwargs)  # fused: the NaN guard skips a step on the device
    entropy = getattr(uncompiled, "ent_coef_optimizer", None)
    assert entropy is None or entropy.defaults["fused"]
    for m in (model, uncompiled):
        _guarded(m)  # as a run's: the NaN guard checks every step, here on the device
        for _ in range(2):  # under the counting mode, which dynamo guards on: compiled, on CUDA recorded, again
            with HostReads():
                m.train(gradient_steps=4, batch_size=16)
        m._device_log.read()
        before = [t.clone() for t in _state(m)]
        with HostReads() as reads, no_syncs(device):
            m.train(gradient_steps=4, batch_size=16)
        assert reads.total == 0, reads.sites
        assert any(not th.equal(a, b) for a, b in zip(before, _state(m), strict=True))
        figures = m._device_log.read()
        assert "train/critic_loss" in figures and all(np.isfinite(v) for v in figures.values())
    assert model._compiled is not None and model._compiled.fallback is None  # a sync refused in it would fall back


def _guarded(model) -> None:
    for step in optimizer_steps(model):
        step.on_non_finite = lambda name: TrainingDiverged(f"non-finite gradient in {name}")


@pytest.mark.parametrize("case", ["sac", "td3"])
def test_a_nan_reward_skips_the_critics_step_on_the_device_and_is_named_when_the_flags_are_read(case):
    _, cls = _pair(case)
    model = _learned(cls, case, mode="eager", replay_buffer_class=DeviceReplayBuffer)
    _guarded(model)
    settle_guards(model)
    critic = [p.detach().clone() for p in model.critic.parameters()]
    actor = [p.detach().clone() for p in model.actor.parameters()]
    model.replay_buffer.rewards[:] = float("nan")  # every critic target, loss and gradient is NaN from here
    with HostReads() as reads:
        model.train(gradient_steps=4, batch_size=16)
    assert reads.total == 0, reads.sites
    for a, b in zip(critic, model.critic.parameters(), strict=True):
        assert th.equal(a, b)  # skipped, on the device
    # The actor's steps read the untouched critics: still finite, and taken (TD3 at its delayed steps).
    assert any(not th.equal(a, b) for a, b in zip(actor, model.actor.parameters(), strict=True))
    with pytest.raises(TrainingDiverged, match=r"non-finite gradient in critic\.qf0\.0\.weight"):
        model.dump_logs()
    assert all(p.isfinite().all() for p in model.policy.parameters())


@pytest.mark.parametrize("case", ["sac", "sac-sde"])
def test_collection_reads_the_device_once_per_vec_step_for_the_envs_actions(case):
    model = _learned(SyncFreeSAC, case, replay_buffer_class=DeviceReplayBuffer)  # past learning_starts: the actor acts
    _, callback = model._setup_learn(1, None, reset_num_timesteps=False)
    copies = model.replay_buffer.host_observation_copies  # the warm-up's random actions used no device copy
    with HostReads() as reads:
        model.collect_rollouts(model.env, callback, TrainFreq(8, TrainFrequencyUnit.STEP), model.replay_buffer)
    assert reads.total == 8, reads.sites  # torch.distributions' argument checks would add two per step
    assert model.replay_buffer.host_observation_copies == copies  # each step stored the policy's device copy


@pytest.mark.parametrize("case", ["sac", "td3", "tqc"])
def test_the_compiled_action_forward_explores_as_sb3s_and_reads_once_per_vec_step(case):
    # Collection alone (no gradient step), past learning_starts, from the same weights and generators: the actions
    # of SB3's eager forward pass and of the compiled one agree, since the draws are SB3's, made outside the graph.
    # Two envs and two action dimensions: draws shared between envs, or laid out (dims, envs), would not agree.
    sb3_cls, cls = _pair(case)
    kwargs = {**SMALL, **EXTRA[case], "learning_starts": 0}
    if case == "td3":
        kwargs["action_noise"] = NormalActionNoise(np.zeros(2), np.full(2, 0.3))  # drawn by SB3 on the host
    env_id = "LunarLanderContinuous-v3"  # observations (8,), actions (2,)
    sb3, ours = (
        c("MlpPolicy", make_vec_env(env_id, n_envs=2, seed=3), seed=3, device="cpu", **copy.deepcopy(kwargs))
        for c in (sb3_cls, cls)
    )
    ours.policy.load_state_dict(sb3.policy.state_dict())
    assert ours.compile_step("default") is None
    compiled, calls = ours._compiled_act, []

    def counted(*inputs):
        calls.append(inputs[0].shape)
        return compiled(*inputs)

    ours._compiled_act = counted
    for model in (sb3, ours):
        _, callback = model._setup_learn(1, None)
        set_random_seed(5)
        with HostReads() as reads:
            model.collect_rollouts(model.env, callback, TrainFreq(12, TrainFrequencyUnit.STEP), model.replay_buffer)
        if model is ours:  # SB3's reads each action's distribution's arguments besides
            assert reads.total == 12, reads.sites
    assert calls == [th.Size([2, 8])] * 12 and compiled.fallback is None
    np.testing.assert_allclose(ours.replay_buffer.actions[:12], sb3.replay_buffer.actions[:12], rtol=1e-5, atol=1e-6)
    observation = np.full(8, 0.1, np.float32)
    np.testing.assert_allclose(
        ours.predict(observation, deterministic=True)[0], sb3.predict(observation, deterministic=True)[0], atol=1e-6
    )  # any other predict: the policy's own, outside collection
    assert "_predict" not in vars(ours.policy)


def _bf16(case: str, mode: str):
    _, cls = _pair(case)
    model = cls("MlpPolicy", "Pendulum-v1", seed=3, device="cpu", **copy.deepcopy({**SMALL, **EXTRA[case]}))
    enable_amp(model, "bf16")
    assert model.compile_step(mode) is None
    return model.learn(100)


@pytest.mark.heavy
@pytest.mark.parametrize("case", ["sac", "td3", "tqc"])
def test_bf16_autocasts_the_hidden_layers_and_keeps_the_heads_float32(case):
    model = _bf16(case, "eager")
    dtypes: dict[str, th.dtype] = {}

    def record(name: str):
        def hook(module, args, out) -> None:
            dtypes.setdefault(name, out.dtype)

        return hook

    linears = [(n, m) for n, m in model.policy.named_modules() if isinstance(m, th.nn.Linear)]
    hooks = [module.register_forward_hook(record(name)) for name, module in linears]
    model.train(gradient_steps=2, batch_size=16)
    for hook in hooks:
        hook.remove()
    # net_arch [16, 16]: Linear, ReLU, Linear, ReLU, Linear; the last gives the values themselves.
    assert dtypes["critic.qf0.0"] == dtypes["critic.qf1.2"] == th.bfloat16
    assert dtypes["critic.qf0.4"] == dtypes["critic_target.qf1.4"] == th.float32
    if case == "td3":
        assert dtypes["actor.mu.0"] == dtypes["actor_target.mu.2"] == th.bfloat16 and dtypes["actor.mu.4"] == th.float32
    else:  # the squashed Gaussian's mean and log-std, which the entropy term reads
        assert dtypes["actor.latent_pi.0"] == th.bfloat16 and dtypes["actor.mu"] == dtypes["actor.log_std"] == th.float32
    assert all(p.isfinite().all() for p in model.policy.parameters())


@pytest.mark.slow  # about a minute and a half of compiling on 2 cores
def test_bf16_compiles_whole_close_to_eager_and_reads_nothing_back():
    # TD3: the cheapest to compile on 2 cores; SAC's and TQC's autocast the same way and compile whole in float32.
    eager, compiled = _bf16("td3", "eager"), _bf16("td3", "default")
    assert compiled._compiled is not None and compiled._compiled.fallback is None
    # The compiled step rounds where inductor fuses, not where eager ops do: close, not equal; and closer to the eager
    # bf16 step than float32 is (so it did run in bf16).
    for a, b in zip(_state(compiled), _state(eager), strict=True):
        th.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    fp32 = _learned(SyncFreeTD3, "td3", mode="eager")

    def distance(x, y, network: str) -> float:
        pairs = zip(x.policy.state_dict().items(), y.policy.state_dict().values(), strict=True)
        return sum(float((a - b).abs().sum()) for (name, a), b in pairs if name.split(".")[0] == network)

    # Network by network: the critics' twice as many steps would hide an actor that trained in float32.
    for network in ("actor", "critic", "actor_target", "critic_target"):
        assert distance(compiled, eager, network) < distance(fp32, eager, network), network
    with HostReads() as reads:
        compiled.train(gradient_steps=4, batch_size=16)
    assert reads.total == 0, reads.sites
    assert all(p.isfinite().all() for p in compiled.policy.parameters())


def test_fp16_is_refused_in_one_line_for_their_several_optimizers():
    model = SyncFreeSAC("MlpPolicy", "Pendulum-v1", device="cpu", **copy.deepcopy(SMALL))
    with pytest.raises(ConfigError, match=r"amp=fp16 is for one-optimizer policies .* not SyncFreeSAC.*use bf16 or off"):
        enable_amp(model, "fp16")


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_the_plan_and_amp_agree_on_which_algorithms_take_fp16(name: str):
    """One rule answers both: the plan asks it of the algorithm's policy classes, AMP of the policy it is given."""
    algo = ALGOS[name]
    env = "Pendulum-v1" if spaces.Discrete not in algo.action_space else "CartPole-v1"
    extended: Any = algo.extended_class
    model = extended("MlpPolicy", env, device="cpu", policy_kwargs={"net_arch": [8]})
    assert algo.fp16 == steps_one_optimizer(type(model.policy)) == (name in ("ppo", "dqn", "qrdqn"))
    if algo.fp16:
        assert enable_amp(model, "fp16").mode == "fp16"
    else:
        with pytest.raises(ConfigError, match="amp=fp16 is for one-optimizer policies"):
            enable_amp(model, "fp16")


def test_compiling_their_networks_apart_is_refused_for_the_whole_step():
    model = SAC("MlpPolicy", "Pendulum-v1", device="cpu", **copy.deepcopy(SMALL))
    with pytest.raises(ConfigError, match=r"compile_policy is for PPO and the DQN family; SAC compiles its whole"):
        compile_policy(model, "default", 16)


def _accumulating(case: str, grad_accum_steps: int):
    _, cls = _pair(case)
    kwargs = copy.deepcopy({**SMALL, **EXTRA[case], "grad_accum_steps": grad_accum_steps})
    model = cls("MlpPolicy", "Pendulum-v1", seed=3, device="cpu", **kwargs)
    return model.learn(40)  # learning_starts: the buffer filled, nothing trained yet


@pytest.mark.parametrize("case", ACCUMULATING)
def test_two_micro_batches_step_as_one_batch_twice_their_size(case):
    whole, halves = _accumulating(case, 1), _accumulating(case, 2)
    assert halves.grad_accum_steps == 2 and halves.compile_step() == (
        "gradient accumulation steps once per several backward passes"
    )
    for a, b in zip(_state(whole), _state(halves), strict=True):
        assert th.equal(a, b)
    batch = whole.replay_buffer.sample(32)
    draws = whole._draws(32, batch.actions)

    def part(i: int) -> tuple:
        rows = slice(16 * i, 16 * (i + 1))
        data = type(batch)(*(t[rows] if isinstance(t, th.Tensor) else t for t in batch))
        return data, tuple(d[rows] for d in draws)

    parts: list[tuple] = []
    whole.replay_buffer.sample = lambda n, env=None: batch
    whole._draws = lambda n, actions: draws
    halves.replay_buffer.sample = lambda n, env=None: (parts.append(part(len(parts) % 2)), parts[-1][0])[1]
    halves._draws = lambda n, actions: parts[-1][1]
    for model in (whole, halves):
        model._device_log.read()
        # Four steps: TD3's second and fourth are due, so critics' windows also follow an actor stage's backward pass.
        model.train(gradient_steps=4, batch_size=32 if model is whole else 16)
    assert len(parts) == 8
    for a, b in zip(_state(whole), _state(halves), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Adam barely tells a gradient from twice it: the last step's gradients themselves must be the batch's mean. (Not
    # the critics': the actor's backward pass reaches them after their step.)
    last = [p for m in (whole, halves) for p in [*m.actor.parameters(), getattr(m, "log_ent_coef", None)] if p is not None]
    for a, b in zip(last[: len(last) // 2], last[len(last) // 2 :], strict=True):
        assert a.grad is not None and b.grad is not None
        th.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    assert halves._device_log.read() == pytest.approx(whole._device_log.read(), rel=1e-5, abs=1e-6)
    # One optimizer step per window of two backward passes: counted as the whole batch's.
    assert [s.steps for s in optimizer_steps(halves)] == [s.steps for s in optimizer_steps(whole)]
    assert halves._n_updates == whole._n_updates == 4


@pytest.mark.parametrize("case", ACCUMULATING)
def test_accumulation_keeps_one_micro_batch_of_activations_alive_at_a_time(case):
    """What accumulation is for: its peak of activations saved for backward is one micro-batch's, whatever k."""

    def peak(k: int) -> int:
        model = _accumulating(case, k)
        batches = []
        for _ in range(k):
            data = model.replay_buffer.sample(16)
            batches.append((data, model._draws(16, data.actions)))
        # Not activations: the weights, and the micro-batches themselves (the caller holds them all).
        inputs = [t for data, draws in batches for t in (*data, *draws)]
        held = [*model.policy.parameters(), getattr(model, "log_ent_coef", None), *inputs]
        ids = {id(t) for t in held}
        saved: dict[int, weakref.ref] = {}  # by identity: one tensor (the entropy coefficient) is saved by every loss

        def pack(t: th.Tensor) -> th.Tensor:
            if id(t) not in ids:
                saved[id(t)] = weakref.ref(t)
            return t

        counts = []

        def descend(i: int, loss: th.Tensor) -> None:
            counts.append(sum(ref() is not None for ref in saved.values()))
            optimizers = model._optimizers()
            optimizers[i].zero_grad()
            loss.backward()
            optimizers[i].step()

        with th.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model._update(descend, batches, due=True)
        assert len(counts) == k * len(model._optimizers())
        return max(counts)

    assert peak(3) == peak(1) > 0


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["sac-sde", "tqc-sde"])
def test_a_gsde_model_saved_and_loaded_compiles_and_trains_on(case, device, tmp_path):
    _, cls = _pair(case)
    model = _learned(cls, case, steps=60, device=device)
    model.save(tmp_path / "model.zip")
    loaded = cls.load(tmp_path / "model.zip", env=model.get_env(), device=device)
    assert loaded._exploration is not None and loaded._exploration[0].shape == model._exploration[0].shape
    assert loaded.compile_step(compiled_mode(device)) is None  # on CUDA, a CUDA graph over the loaded optimizers
    before = [t.clone() for t in _state(loaded)]
    loaded.learn(20, reset_num_timesteps=False)
    assert loaded._compiled is not None and loaded._compiled.fallback is None
    assert any(not th.equal(a, b) for a, b in zip(before, _state(loaded), strict=True))
    assert all(p.isfinite().all() for p in loaded.policy.parameters())


def test_accumulation_is_refused_beside_gsde_and_kept_by_save_and_load(tmp_path):
    refusal = r"grad_accum_steps=2 is not supported with use_sde=True.*set grad_accum_steps: 1 or use_sde: false"
    with pytest.raises(ConfigError, match=refusal):
        SyncFreeSAC("MlpPolicy", "Pendulum-v1", device="cpu", use_sde=True, grad_accum_steps=2)
    model = _accumulating("sac", 3)
    model.save(tmp_path / "sac")
    loaded = SyncFreeSAC.load(tmp_path / "sac", device="cpu")
    assert loaded.grad_accum_steps == 3
    assert all(s.micro_batches == 3 for s in optimizer_steps(loaded))


@pytest.mark.parametrize("case", ["sac", "td3", "tqc"])
def test_train_called_directly_takes_the_batch_size_sb3s_class_takes(case):
    import inspect

    theirs, ours = PAIRS[case]
    default = inspect.signature(theirs.train).parameters["batch_size"].default
    assert inspect.signature(ours.train).parameters["batch_size"].default == default  # TD3's 100, SAC's and TQC's 64
