"""DeviceRolloutBuffer against SB3's RolloutBuffer: the same stored data, GAE, minibatches and PPO updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3 import A2C, PPO
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.policies import ActorCriticCnnPolicy

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.accumulate import GradAccumPPO
from sb3_gpu.extensions.rollout import DeviceRolloutBuffer

VECTOR = spaces.Box(-1.0, 1.0, (4,), np.float32)
IMAGE = spaces.Box(0, 255, (4, 36, 36), np.uint8)
ACTIONS = spaces.Discrete(3)
SMALL_PPO = {"n_steps": 32, "batch_size": 32, "n_epochs": 2, "policy_kwargs": {"net_arch": [16]}}


def _buffers(n_steps=17, n_envs=3, obs_space=VECTOR, gamma=0.99, gae_lambda=0.95, seed=0, compute=True, gpu_writes=False):
    """SB3's buffer and ours, both filled with the same random steps (episode starts included); ``gpu_writes``: ours
    writes each step as on a GPU (tensor copies) rather than through numpy views of its storage."""
    rng = np.random.default_rng(seed)
    kwargs = {"device": "cpu", "gae_lambda": gae_lambda, "gamma": gamma, "n_envs": n_envs}
    pair = RolloutBuffer(n_steps, obs_space, ACTIONS, **kwargs), DeviceRolloutBuffer(n_steps, obs_space, ACTIONS, **kwargs)
    if gpu_writes:
        pair[1]._host_rows = None
    for _ in range(n_steps):
        if obs_space.dtype == np.uint8:
            obs = rng.integers(0, 256, (n_envs, *obs_space.shape), dtype=np.uint8)
        else:
            obs = rng.uniform(-1, 1, (n_envs, *obs_space.shape)).astype(obs_space.dtype)
        step = (
            obs,
            rng.integers(0, ACTIONS.n, (n_envs, 1)),
            rng.normal(size=n_envs).astype(np.float32),
            rng.random(n_envs) < 0.2,
            th.as_tensor(rng.normal(size=(n_envs, 1)), dtype=th.float32),
            th.as_tensor(rng.normal(size=n_envs), dtype=th.float32),
        )
        for buffer in pair:
            buffer.add(*step)
    if compute:
        last_values, dones = th.as_tensor(rng.normal(size=(n_envs, 1)), dtype=th.float32), rng.random(n_envs) < 0.3
        for buffer in pair:
            buffer.compute_returns_and_advantage(last_values, dones)
    return pair


def _same_permutation(monkeypatch, sb3_perm: np.ndarray, n_steps: int, n_envs: int) -> None:
    """Make both buffers draw ``sb3_perm``: SB3 numbers its flat indices env-major, ours step-major."""
    ours = th.as_tensor((sb3_perm % n_steps) * n_envs + sb3_perm // n_steps)
    monkeypatch.setattr(np.random, "permutation", lambda n: sb3_perm.copy())
    monkeypatch.setattr(DeviceRolloutBuffer, "_permutation", lambda self, n: ours.to(self.device))


@pytest.mark.parametrize("gae_lambda", [0.95, 1.0])
@pytest.mark.parametrize("n_envs", [1, 4])
def test_gae_matches_sb3_with_episode_starts(gae_lambda, n_envs):
    sb3, ours = _buffers(n_envs=n_envs, gae_lambda=gae_lambda)
    assert sb3.episode_starts.any()
    np.testing.assert_allclose(ours.advantages.numpy(), sb3.advantages, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.returns, sb3.returns, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gpu_writes", [False, True], ids=["numpy views", "tensor copies"])
def test_stored_data_matches_sb3(gpu_writes):
    sb3, ours = _buffers(gpu_writes=gpu_writes)
    assert ours.observations.dtype == th.float32 and ours.actions.dtype == th.float32
    np.testing.assert_array_equal(ours.observations.numpy(), sb3.observations)
    np.testing.assert_array_equal(ours.actions.numpy(), sb3.actions.astype(np.float32))
    for name in ("rewards", "episode_starts", "values", "log_probs"):
        np.testing.assert_array_equal(np.asarray(getattr(ours, name)), getattr(sb3, name), err_msg=name)


def test_values_and_returns_read_as_numpy_for_explained_variance():
    _, ours = _buffers()
    assert isinstance(ours.values, np.ndarray) and isinstance(ours.returns, np.ndarray)
    np.testing.assert_array_equal(ours.returns, (ours.advantages + ours.value_tensor).numpy())


def test_add_accepts_an_observation_tensor():
    sb3, ours = _buffers(compute=False)
    twin = DeviceRolloutBuffer(sb3.buffer_size, VECTOR, ACTIONS, device="cpu", n_envs=sb3.n_envs)
    for step in range(sb3.buffer_size):
        obs = th.as_tensor(sb3.observations[step])
        twin.add(
            obs, sb3.actions[step], sb3.rewards[step], sb3.episode_starts[step], ours.value_tensor[step], ours.log_probs[step]
        )
    for name in ("observations", "actions", "rewards", "episode_starts", "value_tensor", "log_probs"):
        assert th.equal(getattr(twin, name), getattr(ours, name)), name


def test_add_stores_the_staged_copy_of_the_same_array_only():
    sb3, _ = _buffers(compute=False)
    buffer = DeviceRolloutBuffer(sb3.buffer_size, VECTOR, ACTIONS, device="cpu", n_envs=sb3.n_envs)
    buffer._host_rows = None  # write as on a GPU: a CPU buffer stores the host array, which holds the same values
    host = sb3.observations[0]
    row = (sb3.actions[0], sb3.rewards[0], sb3.episode_starts[0], th.zeros(sb3.n_envs), th.zeros(sb3.n_envs))
    buffer.stage(host, th.full(host.shape, 7.0))  # stands for the device copy: told apart from the host array
    buffer.add(host, *row)
    buffer.stage(host, th.full(host.shape, 7.0))
    buffer.add(host.copy(), *row)  # another array: the staged copy is not its own
    buffer.add(host, *row)  # staged once, used once
    assert (buffer.observations[0] == 7).all() and buffer.host_observation_copies == 2
    for pos in (1, 2):
        np.testing.assert_array_equal(buffer.observations[pos].numpy(), host)


def test_minibatches_cover_each_index_once_per_epoch():
    n_steps, n_envs = 12, 5
    _, ours = _buffers(n_steps=n_steps, n_envs=n_envs, obs_space=spaces.Box(0, 100, (1,), np.float32))
    ours.observations[:, :, 0] = th.arange(n_steps * n_envs, dtype=th.float32).reshape(n_steps, n_envs)
    ours.value_tensor.copy_(ours.observations[:, :, 0])
    epochs = []
    for _ in range(2):
        batches = list(ours.get(16))
        assert [len(b.observations) for b in batches] == [16, 16, 16, 12]
        seen = th.cat([b.observations[:, 0] for b in batches])
        assert th.equal(th.cat([b.old_values for b in batches]), seen)
        assert th.equal(seen.sort().values, th.arange(n_steps * n_envs, dtype=th.float32))
        epochs.append(seen)
    assert not th.equal(*epochs)


def test_permutation_follows_numpys_global_seed():
    _, ours = _buffers(compute=False)
    draws = []
    for seed in (0, 0, 1):
        np.random.seed(seed)
        draws.append(ours._permutation(50))
    assert th.equal(draws[0], draws[1]) and not th.equal(draws[0], draws[2])


def test_uint8_images_stay_uint8_and_evaluate_like_sb3(monkeypatch):
    n_steps, n_envs = 4, 2
    sb3, ours = _buffers(n_steps=n_steps, n_envs=n_envs, obs_space=IMAGE)
    assert ours.observations.dtype == th.uint8
    _same_permutation(monkeypatch, np.random.default_rng(0).permutation(n_steps * n_envs), n_steps, n_envs)
    (theirs,), (mine,) = list(sb3.get()), list(ours.get())
    assert mine.observations.dtype == theirs.observations.dtype == th.uint8
    for a, b in zip(mine, theirs, strict=True):
        assert th.equal(a, b)

    th.manual_seed(0)
    policy = ActorCriticCnnPolicy(IMAGE, ACTIONS, lambda _: 1e-3, features_extractor_kwargs={"features_dim": 16})
    actions = mine.actions.long().flatten()
    with th.no_grad():
        ours_out = policy.evaluate_actions(mine.observations, actions)
        float_out = policy.evaluate_actions(theirs.observations.float(), actions)
    for a, b in zip(ours_out, float_out, strict=True):
        assert th.equal(a, b)


@pytest.mark.parametrize(("algo", "extra"), [(PPO, {}), (GradAccumPPO, {"grad_accum_steps": 2})])
def test_updates_equal_sb3_buffer_with_the_same_permutation(monkeypatch, algo, extra):
    n_envs = 4
    _same_permutation(monkeypatch, np.random.default_rng(0).permutation(32 * n_envs), 32, n_envs)
    models = []
    for buffer_class in (RolloutBuffer, DeviceRolloutBuffer):
        env = make_vec_env("CartPole-v1", n_envs=n_envs)
        model = algo("MlpPolicy", env, seed=5, device="cpu", rollout_buffer_class=buffer_class, **SMALL_PPO, **extra)
        model.learn(2 * 32 * n_envs)  # two rollouts and two updates: reset() is exercised too
        models.append(model)
    sb3, ours = models
    assert isinstance(ours.rollout_buffer, DeviceRolloutBuffer) and ours._n_updates == sb3._n_updates == 4
    # GradAccumPPO's rollout stores the policy's device copy of each step's observations; SB3's PPO copies them again.
    assert ours.rollout_buffer.host_observation_copies == (0 if algo is GradAccumPPO else 2 * 32)
    for a, b in zip(sb3.policy.parameters(), ours.policy.parameters(), strict=True):
        assert th.equal(a, b)
    logged = sb3.logger.name_to_value, ours.logger.name_to_value
    for key in ("train/loss", "train/value_loss", "train/policy_gradient_loss"):
        assert logged[1][key] == logged[0][key], key
    assert logged[1]["train/explained_variance"] == pytest.approx(logged[0]["train/explained_variance"], abs=1e-6)


@pytest.mark.parametrize(("algo", "kwargs", "updates"), [(PPO, SMALL_PPO, 6), (A2C, {"n_steps": 32}, 3)])
def test_trains_and_repeats_with_the_same_seed(algo, kwargs, updates):
    models = []
    for _ in range(2):
        model = algo("MlpPolicy", "CartPole-v1", seed=2, device="cpu", rollout_buffer_class=DeviceRolloutBuffer, **kwargs)
        model.learn(3 * 32)
        models.append(model)
    assert models[0]._n_updates == updates
    assert np.isfinite(models[0].logger.name_to_value["train/explained_variance"])
    for a, b in zip(models[0].policy.parameters(), models[1].policy.parameters(), strict=True):
        assert th.equal(a, b)


def test_reset_full_pos_and_generator_ready_as_in_sb3():
    pair = _buffers(n_steps=3, n_envs=2, compute=False)
    for buffer in pair:
        buffer.reset()

    def states():
        return [(b.pos, b.full, b.generator_ready) for b in pair]

    assert states() == [(0, False, False)] * 2
    for step in range(3):
        for buffer in pair:
            buffer.add(np.zeros((2, 4), np.float32), np.ones((2, 1)), np.ones(2), np.zeros(2), th.ones(2, 1), th.ones(2))
        assert states() == [(step + 1, step == 2, False)] * 2
    for buffer in pair:
        buffer.compute_returns_and_advantage(th.zeros(2, 1), np.zeros(2, dtype=bool))
        list(buffer.get(2))
    assert states() == [(3, True, True)] * 2
    for buffer in pair:
        buffer.reset()
    assert states() == [(0, False, False)] * 2
    assert not pair[1].rewards.any() and not pair[1].observations.any()


def test_dict_observations_refused():
    obs_space = spaces.Dict({"x": VECTOR})
    with pytest.raises(ConfigError, match=r"does not support Dict observations; use SB3's DictRolloutBuffer"):
        DeviceRolloutBuffer(8, obs_space, ACTIONS, device="cpu")


class _RecordingAdds(DeviceRolloutBuffer):
    def add(self, obs, *rest):
        self.added = [*getattr(self, "added", []), np.array(obs, copy=True)]
        super().add(obs, *rest)


class _ForwardInOnStep(BaseCallback):
    """A callback that runs the policy on other observations between SB3's forward pass and the buffer's add."""

    def _on_step(self) -> bool:
        with th.no_grad():
            self.model.policy(th.zeros((self.model.n_envs, *self.model.observation_space.shape)))
        return True


@pytest.mark.heavy
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("host_rows", [True, False], ids=["numpy views", "tensor copies"])
def test_rollout_stores_the_observations_it_was_given_whatever_a_callback_runs(compiled, host_rows):
    model = GradAccumPPO(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=2, seed=1),
        n_steps=16,
        batch_size=32,
        seed=1,
        rollout_buffer_class=_RecordingAdds,
        device="cpu",
    )
    if compiled:
        assert model.compile_step() is None
    if not host_rows:
        model.rollout_buffer._host_rows = None  # store as on a GPU, from the staged tensor
    model.learn(32, callback=_ForwardInOnStep())
    buffer = model.rollout_buffer
    assert buffer.host_observation_copies == 0
    np.testing.assert_array_equal(buffer.observations.numpy(), np.stack(buffer.added))
