from __future__ import annotations

import weakref

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from sb3_contrib import QRDQN
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.logger import configure
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.io import save_pickle
from sb3_gpu.extensions import replay
from sb3_gpu.extensions.per import PrioritizedDQN, PrioritizedReplayBuffer
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.runs import saving
from sb3_gpu.runs.saving import load_replay_buffer

SPACES = {
    "vector-discrete": (gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3)),
    "frames-discrete": (gym.spaces.Box(0, 255, (4, 12, 12), np.uint8), gym.spaces.Discrete(4)),
    # float64 actions are stored as float32, as SB3 stores them
    "vector-box": (gym.spaces.Box(-1, 1, (2,), np.float64), gym.spaces.Box(-1, 1, (2,), np.float64)),
}
FIELDS = ("observations", "actions", "next_observations", "dones", "rewards")


def record(obs_space, action_space, n_envs, steps, seed=0, p_done=0.25):
    """Transitions as SB3's _store_transition passes them: next_obs is the terminal observation where an episode
    ended (some by timeout), and the next step's obs is then a fresh reset observation."""
    rng = np.random.default_rng(seed)
    obs_space.seed(seed)
    action_space.seed(seed)

    def observations():
        return np.stack([obs_space.sample() for _ in range(n_envs)])

    obs, transitions = observations(), []
    for _ in range(steps):
        next_obs = observations()
        action = np.stack([action_space.sample() for _ in range(n_envs)])
        reward = rng.normal(size=n_envs).astype(np.float32)
        done = rng.random(n_envs) < p_done
        truncated = done & (rng.random(n_envs) < 0.5)
        infos = [{"TimeLimit.truncated": True} if t else {} for t in truncated]
        transitions.append((obs.copy(), next_obs.copy(), action, reward, done, infos))
        obs = np.where(done.reshape(-1, *[1] * (obs.ndim - 1)), observations(), next_obs)
    return transitions


def fill(buffers, transitions):
    for transition in transitions:
        for buffer in buffers:
            buffer.add(*transition)


def assert_samples_equal(ours, theirs):
    for field in FIELDS:
        a, b = getattr(ours, field), getattr(theirs, field)
        assert a.dtype == b.dtype and a.device == b.device, field
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=field)


def valid_slots(buffer):
    """Every (slot, env) a sample may return: all filled slots, less slot pos of a full one-copy buffer."""
    slots = np.arange(buffer.buffer_size if buffer.full else buffer.pos)
    if buffer.optimize_memory_usage and buffer.full:
        slots = slots[slots != buffer.pos]
    return np.repeat(slots, buffer.n_envs), np.tile(np.arange(buffer.n_envs), len(slots))


def gpu_writes(buffer: DeviceReplayBuffer) -> DeviceReplayBuffer:
    """Make add() write as on a GPU (a tensor copy into the storage) rather than through numpy views of it."""
    buffer._host_views = {}
    return buffer


WRITES = {"numpy views": lambda buffer: buffer, "tensor copies": gpu_writes}


@pytest.mark.parametrize("spaces", SPACES.values(), ids=SPACES.keys())
@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("writes", WRITES.values(), ids=WRITES.keys())
def test_stores_the_same_data_as_sb3_at_every_slot_through_wrap_around(spaces, n_envs, writes):
    ours, theirs = (
        writes(DeviceReplayBuffer(30, *spaces, device="cpu", n_envs=n_envs)),
        ReplayBuffer(30, *spaces, "cpu", n_envs),
    )
    assert ours.buffer_size == theirs.buffer_size == 30 // n_envs
    for transition in record(*spaces, n_envs, steps=75 // n_envs):
        ours.add(*transition)
        theirs.add(*transition)
        assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size())
    assert ours.full
    for name in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts"):
        assert getattr(ours, name).device == th.device("cpu")
        np.testing.assert_array_equal(getattr(ours, name).numpy(), getattr(theirs, name), err_msg=name)
    assert ours.observations.dtype == th.from_numpy(theirs.observations).dtype  # uint8 frames stay uint8


def test_reversed_views_are_stored_as_sb3_stores_them_by_tensor_copies():
    spaces = SPACES["vector-box"]
    ours, theirs = gpu_writes(DeviceReplayBuffer(12, *spaces, "cpu", 2)), ReplayBuffer(12, *spaces, "cpu", 2)
    # An env that returns views with negative strides, which torch cannot wrap without a copy.
    fill([ours, theirs], [(o[:, ::-1], n[:, ::-1], a[:, ::-1], *rest) for o, n, a, *rest in record(*spaces, 2, 8)])
    for name in ("observations", "next_observations", "actions"):
        np.testing.assert_array_equal(getattr(ours, name).numpy(), getattr(theirs, name), err_msg=name)


def test_in_graph_draws_reach_every_slot_of_a_buffer_past_a_floats_resolution():
    buffer = DeviceReplayBuffer(20, *SPACES["vector-discrete"], "cpu")
    buffer._get_samples_at = lambda batch_inds, env_inds, newest: batch_inds  # the slots picked, not their data
    filled = 2**26  # float32 draws (2**24 values in [0, 1)) would pick only every fourth slot of these
    slots = buffer.samples_at_draws(buffer.draws(4096), th.tensor([filled, 0]))
    assert int(slots.min()) >= 0 and int(slots.max()) < filled
    assert bool((slots % 4 != 0).any())


def test_a_buffer_saved_on_a_gpu_this_machine_lacks_loads_on_the_cpu(monkeypatch):
    buffer = DeviceReplayBuffer(20, *SPACES["vector-discrete"], "cpu")
    fill([buffer], record(*SPACES["vector-discrete"], 1, steps=5))
    state = buffer.__getstate__()
    state["_device"] = th.device("cuda", 1)  # saved on a machine's second GPU; this one has one
    monkeypatch.setattr(th.cuda, "is_available", lambda: True)
    monkeypatch.setattr(th.cuda, "device_count", lambda: 1)
    loaded = DeviceReplayBuffer.__new__(DeviceReplayBuffer)
    loaded.__setstate__(state)
    assert loaded.device == th.device("cpu")
    np.testing.assert_array_equal(loaded.observations.numpy(), buffer.observations.numpy())


@pytest.mark.parametrize("n_steps", [0, 1.5, None, "3", True, float("nan"), float("inf")])
def test_n_steps_other_than_a_positive_int_is_refused_in_one_line(n_steps):
    with pytest.raises(ConfigError, match=r"n_steps must be an int >= 1, got "):
        replay.check_n_steps(n_steps)
    assert replay.check_n_steps(3.0) == replay.check_n_steps(np.int64(3)) == 3


@pytest.mark.parametrize("spaces", SPACES.values(), ids=SPACES.keys())
@pytest.mark.parametrize("n_envs", [1, 3])
def test_samples_at_given_indices_equal_sb3s_in_values_and_dtypes(spaces, n_envs):
    ours, theirs = (cls(24, *spaces, device="cpu", n_envs=n_envs) for cls in (DeviceReplayBuffer, ReplayBuffer))
    fill([ours, theirs], record(*spaces, n_envs, steps=60 // n_envs))
    batch_inds = np.random.default_rng(1).integers(0, ours.size(), 64)
    np.random.seed(7)  # SB3's _get_samples draws the env indices from numpy's global RNG
    expected = theirs._get_samples(batch_inds)
    np.random.seed(7)
    env_inds = np.random.randint(0, n_envs, size=len(batch_inds))
    assert_samples_equal(ours._get_samples_at(batch_inds, env_inds), expected)


@pytest.mark.parametrize("optimize_memory_usage", [False, True])
@pytest.mark.parametrize("n_envs", [1, 3])
def test_sample_draws_every_valid_transition_and_nothing_else(optimize_memory_usage, n_envs):
    buffer = DeviceReplayBuffer(
        10 * n_envs, gym.spaces.Box(0, 1e6, (1,), np.float32), gym.spaces.Discrete(2), "cpu", n_envs, optimize_memory_usage
    )
    for step in range(23):  # each observation is its own (step, env) number
        obs = np.arange(step * n_envs, (step + 1) * n_envs, dtype=np.float32).reshape(-1, 1)
        buffer.add(obs, obs + n_envs, np.zeros(n_envs), np.zeros(n_envs), np.zeros(n_envs), [{}] * n_envs)
    slots, envs = valid_slots(buffer)
    expected = buffer.observations[slots, envs, 0]
    drawn = buffer.sample(4000).observations[:, 0]
    assert set(drawn.tolist()) == set(expected.tolist())
    assert buffer.sample(8).observations.device == th.device("cpu")


@pytest.mark.parametrize("spaces", SPACES.values(), ids=SPACES.keys())
@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("steps", [17, 75])  # partly written; wrapped around
def test_n_step_samples_equal_sb3s_n_step_buffer_in_both_layouts(spaces, n_envs, steps):
    theirs = NStepReplayBuffer(30, *spaces, "cpu", n_envs, n_steps=3, gamma=0.9)
    plain, one_copy = (
        DeviceReplayBuffer(30, *spaces, "cpu", n_envs, optimize, n_steps=3, gamma=0.9) for optimize in (False, True)
    )
    fill([theirs, plain, one_copy], record(*spaces, n_envs, steps=steps // n_envs, p_done=0.3))
    batch_inds = np.repeat(np.arange(plain.size()), 4)
    np.random.seed(7)  # SB3's _get_samples draws the env indices from numpy's global RNG
    expected = theirs._get_samples(batch_inds)
    np.random.seed(7)
    env_inds = np.random.randint(0, n_envs, size=len(batch_inds))
    got = plain._get_samples_at(batch_inds, env_inds)
    for field in (*FIELDS, "discounts"):
        th.testing.assert_close(getattr(got, field), getattr(expected, field), msg=field)
    assert (expected.discounts < 0.9**2).any() and (expected.discounts > 0.9**2).any()  # ends cut some returns
    slots, envs = valid_slots(one_copy)
    for field in (*FIELDS, "discounts"):
        th.testing.assert_close(
            getattr(one_copy._get_samples_at(slots, envs), field), getattr(plain._get_samples_at(slots, envs), field)
        )


@pytest.mark.parametrize("spaces", SPACES.values(), ids=SPACES.keys())
@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("writes", WRITES.values(), ids=WRITES.keys())
def test_one_copy_layout_samples_exactly_what_the_plain_one_does_with_timeouts(spaces, n_envs, writes):
    # Short episodes, many of them timeouts, through several wrap-arounds: the store of episode ends grows and
    # frees its rows, and every next observation (a timeout's terminal one included) stays exact.
    plain, one_copy = (writes(DeviceReplayBuffer(120, *spaces, "cpu", n_envs, optimize)) for optimize in (False, True))
    for step, transition in enumerate(record(*spaces, n_envs, steps=300 // n_envs, p_done=0.6)):
        plain.add(*transition)
        one_copy.add(*transition)
        slots, envs = valid_slots(one_copy)
        if step % 5 == 1 or step == 300 // n_envs - 1:
            assert_samples_equal(one_copy._get_samples_at(slots, envs), plain._get_samples_at(slots, envs))
    live_rows = (one_copy._terminal_row_host >= 0).sum()
    assert live_rows > replay._TERMINAL_ROWS  # the store grew
    assert live_rows + len(one_copy._free_rows) == len(one_copy._terminal_obs)  # and leaked no row


def test_one_copy_layout_stores_observations_as_sb3s_does():
    spaces = SPACES["frames-discrete"]
    ours, theirs = (
        cls(20, *spaces, device="cpu", n_envs=2, optimize_memory_usage=True, handle_timeout_termination=False)
        for cls in (DeviceReplayBuffer, ReplayBuffer)
    )
    fill([ours, theirs], record(*spaces, n_envs=2, steps=27))
    for name in ("observations", "actions", "rewards", "dones", "timeouts"):
        np.testing.assert_array_equal(getattr(ours, name).numpy(), getattr(theirs, name), err_msg=name)
    assert ours.next_observations is None


def test_reset_empties_it_as_sb3s_does_and_frees_the_store_of_episode_ends():
    spaces = SPACES["vector-discrete"]
    plain, one_copy = (DeviceReplayBuffer(12, *spaces, "cpu", 2, optimize) for optimize in (False, True))
    theirs = ReplayBuffer(12, *spaces, "cpu", 2)
    fill([plain, one_copy, theirs], record(*spaces, 2, steps=9, p_done=0.5))
    for buffer in (plain, one_copy, theirs):
        buffer.reset()
        assert (buffer.pos, buffer.full, buffer.size()) == (0, False, 0)
    assert len(one_copy._free_rows) == len(one_copy._terminal_obs)
    fill([plain, one_copy], record(*spaces, 2, steps=4, seed=2, p_done=0.5))
    slots, envs = valid_slots(one_copy)
    assert_samples_equal(one_copy._get_samples_at(slots, envs), plain._get_samples_at(slots, envs))


def test_normalises_with_vecnormalize_statistics_as_sb3s_numpy_path_does():
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")] * 2), clip_obs=1.0, clip_reward=0.5)
    venv.seed(0)
    venv.reset()
    for _ in range(60):  # running statistics of observations and returns
        venv.step(np.array([venv.action_space.sample() for _ in range(2)]))
    ours, theirs = (cls(40, venv.observation_space, venv.action_space, "cpu", 2) for cls in (DeviceReplayBuffer, ReplayBuffer))
    fill([ours, theirs], record(venv.observation_space, venv.action_space, 2, steps=20))
    batch_inds = np.arange(20).repeat(3)
    np.random.seed(3)
    expected = theirs._get_samples(batch_inds, env=venv)
    np.random.seed(3)
    got = ours._get_samples_at(batch_inds, np.random.randint(0, 2, size=len(batch_inds)), env=venv)
    assert_samples_equal(got, expected)
    assert got.observations.dtype == th.float32 and got.observations.abs().max() == 1.0  # clipped


def test_refuses_a_buffer_larger_than_the_free_memory_before_allocating(monkeypatch):
    frames = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    with pytest.raises(ConfigError, match=r"of 1,000,000,000 transitions needs [\d.]+ GiB on cpu; [\d.]+ GiB is free"):
        DeviceReplayBuffer(10**9, frames, gym.spaces.Discrete(4), "cpu")  # the real query of the host's memory
    monkeypatch.setattr(replay, "_free_bytes", lambda device: 1000)
    message = r"a device replay buffer of 1,000 transitions needs 27.3 KiB on cpu; 1000 bytes is free: lower buffer_size"
    with pytest.raises(ConfigError, match=message):
        DeviceReplayBuffer(1000, gym.spaces.Box(-1, 1, (1,), np.float32), gym.spaces.Discrete(2), "cpu")


def test_the_free_memory_query_asks_cuda_on_a_gpu_and_the_host_on_the_cpu(monkeypatch):
    asked = []
    monkeypatch.setattr(th.cuda, "mem_get_info", lambda device: asked.append(device) or (123, 456))
    monkeypatch.setattr(th.cuda, "memory_reserved", lambda device: 50)  # 20 of them held by torch, unused
    monkeypatch.setattr(th.cuda, "memory_allocated", lambda device: 30)
    assert replay._free_bytes(th.device("cuda", 1)) == 143 and asked == [1]
    # The plan asks the same question, one answer for both.
    from sb3_gpu.common.hardware import gpu_free_bytes

    assert gpu_free_bytes(1) == 143
    assert 0 < replay._free_bytes(th.device("cpu")) <= __import__("psutil").virtual_memory().total


def test_setting_the_device_moves_the_storage():
    buffer = DeviceReplayBuffer(20, *SPACES["vector-discrete"], "cpu", optimize_memory_usage=True)
    buffer.device = "meta"  # a device with no memory: the CPU twin of a move to the GPU
    assert buffer.device == th.device("meta")
    assert {t.device.type for t in (buffer.observations, buffer.actions, buffer.dones, buffer._terminal_obs)} == {"meta"}


@pytest.mark.parametrize("optimize_memory_usage", [False, True])
def test_pickle_holds_arrays_and_loads_through_sb3_gpus_allowlist(tmp_path, monkeypatch, optimize_memory_usage):
    venv = DummyVecEnv([lambda: gym.make("CartPole-v1")] * 3)  # a buffer is refused by a model of other envs
    spaces = (venv.observation_space, venv.action_space)
    buffer = DeviceReplayBuffer(30, *spaces, "cpu", 3, optimize_memory_usage)
    fill([buffer], record(*spaces, 3, steps=14, p_done=0.5))
    # The allowlist admits no torch tensor, so loading proves the pickle holds numpy arrays.
    path = save_pickle(tmp_path / "replay_buffer.pkl", buffer)
    kwargs = {"buffer_size": 30, "device": "cpu", "policy_kwargs": {"net_arch": [8]}}
    model = PrioritizedDQN("MlpPolicy", venv, replay_buffer_class=DeviceReplayBuffer, **kwargs)
    assert model.compile_step() is None  # as a resumed run compiles before it loads: the step holds the buffer too
    assert model._fixed_buffer is model.replay_buffer
    fresh = weakref.ref(model.replay_buffer)
    real = saving.load_pickle

    def load_pickle(*args, **kwargs):  # the model's own empty buffer is gone before the saved one is read
        assert fresh() is None
        return real(*args, **kwargs)

    monkeypatch.setattr(saving, "load_pickle", load_pickle)
    load_replay_buffer(model, path)
    loaded = model.replay_buffer
    assert isinstance(loaded, DeviceReplayBuffer) and loaded.device == th.device("cpu")
    assert (loaded.pos, loaded.full, loaded.optimize_memory_usage) == (buffer.pos, buffer.full, optimize_memory_usage)
    slots, envs = valid_slots(buffer)
    assert_samples_equal(loaded._get_samples_at(slots, envs), buffer._get_samples_at(slots, envs))
    # Its views and generator were rebuilt: it adds and samples as the original does.
    more = record(*spaces, 3, steps=5, seed=1)
    fill([buffer, loaded], more)
    np.testing.assert_array_equal(loaded.dones.numpy(), buffer.dones.numpy())
    loaded.sample(4)


def test_sb3s_save_and_load_replay_buffer_round_trip(tmp_path):
    kwargs = dict(replay_buffer_class=DeviceReplayBuffer, learning_starts=50, device="cpu", policy_kwargs=dict(net_arch=[8]))
    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=500, seed=0, **kwargs).learn(200)
    model.save_replay_buffer(tmp_path / "buffer.pkl")
    other = DQN("MlpPolicy", "CartPole-v1", buffer_size=500, seed=1, **kwargs)
    other.load_replay_buffer(tmp_path / "buffer.pkl")
    assert isinstance(other.replay_buffer, DeviceReplayBuffer) and other.replay_buffer.pos == 200
    for name in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts"):
        np.testing.assert_array_equal(getattr(other.replay_buffer, name), getattr(model.replay_buffer, name))
    other.learn(100, reset_num_timesteps=False)


class RecordingBuffer(DeviceReplayBuffer):
    def sample(self, batch_size, env=None):
        samples = super().sample(batch_size, env)
        self.drawn = [*getattr(self, "drawn", []), samples]
        return samples


@pytest.mark.heavy
def test_dqn_trains_on_it_and_a_seed_repeats_the_sampled_batches():
    def train():
        model = DQN(
            "MlpPolicy",
            "CartPole-v1",
            replay_buffer_class=RecordingBuffer,
            learning_starts=100,
            train_freq=4,
            batch_size=32,
            seed=5,
            device="cpu",
            policy_kwargs=dict(net_arch=[16]),
        )
        return model.learn(2000)

    first, second = train(), train()
    assert first.replay_buffer.size() == 2000 and len(first.replay_buffer.drawn) == (2000 - 100) // 4
    for a, b in zip(first.replay_buffer.drawn[:5], second.replay_buffer.drawn[:5], strict=True):
        assert_samples_equal(a, b)
    for p, q in zip(first.policy.parameters(), second.policy.parameters(), strict=True):
        assert th.equal(p, q)


@pytest.mark.filterwarnings("ignore:The last trajectory in the replay buffer will be truncated")
@pytest.mark.parametrize(
    "algo, policy_kwargs", [(PrioritizedDQN, {}), (QRDQN, dict(n_quantiles=5))], ids=["PrioritizedDQN", "QRDQN"]
)
@pytest.mark.parametrize("optimize_memory_usage", [False, True])
def test_prioritized_dqn_and_qrdqn_train_on_it_in_both_layouts(algo, policy_kwargs, optimize_memory_usage):
    model = algo(
        "MlpPolicy",
        "CartPole-v1",
        replay_buffer_class=DeviceReplayBuffer,
        optimize_memory_usage=optimize_memory_usage,
        learning_starts=50,
        buffer_size=300,
        device="cpu",
        policy_kwargs=dict(net_arch=[8], **policy_kwargs),
    )
    model.learn(400)
    # A second learn() truncates the last episode of a one-copy buffer (SB3 writes through the dones view).
    model.learn(100)
    assert isinstance(model.replay_buffer, DeviceReplayBuffer) and model.replay_buffer.full


class _RecordingAdds(DeviceReplayBuffer):
    """Keeps a copy of each observation passed to add."""

    def add(self, obs, *rest):
        self.added = [*getattr(self, "added", []), obs.copy()]
        super().add(obs, *rest)


@pytest.mark.parametrize("optimize_memory_usage", [False, True])
@pytest.mark.parametrize("writes", WRITES.values(), ids=WRITES.keys())
def test_collection_stores_the_policys_device_copy_of_greedy_steps_observations(optimize_memory_usage, writes):
    model = PrioritizedDQN(
        "MlpPolicy",
        DummyVecEnv([lambda: gym.make("CartPole-v1")] * 2),
        replay_buffer_class=_RecordingAdds,
        optimize_memory_usage=optimize_memory_usage,
        replay_buffer_kwargs=dict(handle_timeout_termination=False),
        learning_starts=0,
        exploration_fraction=0.5,
        buffer_size=1000,
        seed=3,
        device="cpu",
        policy_kwargs=dict(net_arch=[8]),
    )
    buffer = writes(model.replay_buffer)
    model.learn(300)
    adds = len(buffer.added)
    # Random actions skip the policy, so their steps copy from the host; greedy ones store the policy's copy.
    assert 2 * adds == model.num_timesteps and 0 < buffer.host_observation_copies < adds
    np.testing.assert_array_equal(buffer.observations[:adds].numpy(), np.stack(buffer.added))


def test_the_store_of_episode_ends_grows_no_larger_than_the_buffer_and_checks_the_free_memory_first(monkeypatch):
    spaces = SPACES["vector-discrete"]
    # 100 transitions: 50 steps of 2 envs, as SB3 splits a buffer_size among the envs
    one_copy, plain = (DeviceReplayBuffer(100, *spaces, "cpu", 2, optimize) for optimize in (True, False))
    fill([one_copy, plain], record(*spaces, 2, steps=130, p_done=1.0))  # every step ends an episode, past a wrap
    assert len(one_copy._terminal_obs) == 100 > replay._TERMINAL_ROWS  # 64 doubled, cut to one row per transition
    slots, envs = valid_slots(one_copy)
    assert_samples_equal(one_copy._get_samples_at(slots, envs), plain._get_samples_at(slots, envs))

    short = DeviceReplayBuffer(100, *spaces, "cpu", 2, optimize_memory_usage=True)
    monkeypatch.setattr(replay, "_free_bytes", lambda device: 100)
    message = r"the store of episode ends' next observations grows to 100 rows, which needs 1.2 KiB on cpu; 100 bytes"
    with pytest.raises(ConfigError, match=message):
        fill([short], record(*spaces, 2, steps=40, p_done=1.0))


def test_seeding_numpys_global_rng_again_repeats_the_draws_that_follow_as_sb3s_buffer_does():
    # SB3's set_random_seed seeds numpy's global RNG, from which SB3's buffer draws at every sample: a model seeded
    # again mid-life repeats its draws. The device buffers' generator must follow it at every draw, not only the first.
    from sb3_gpu.extensions.per import DevicePrioritizedReplayBuffer

    spaces = SPACES["vector-discrete"]
    for cls in (DeviceReplayBuffer, DevicePrioritizedReplayBuffer):
        buffer = cls(64, *spaces, "cpu", n_envs=2)
        fill([buffer], record(*spaces, 2, steps=30))
        np.random.seed(4)
        first, other = buffer.sample(16), buffer.sample(16)
        first_draws = buffer.draws(16)
        np.random.seed(4)
        again = buffer.sample(16)
        assert_samples_equal(again, first)
        assert not th.equal(other.observations, first.observations)
        buffer.sample(16)
        assert th.equal(buffer.draws(16), first_draws)


def test_sampling_an_empty_buffer_says_so():
    from sb3_gpu.extensions.per import DevicePrioritizedReplayBuffer, PrioritizedReplayBuffer

    spaces = SPACES["vector-discrete"]
    for cls in (DeviceReplayBuffer, DevicePrioritizedReplayBuffer, PrioritizedReplayBuffer):
        buffer = cls(16, *spaces, "cpu")
        with pytest.raises(ValueError, match=f"cannot sample from an empty {cls.__name__}: add transitions first"):
            buffer.sample(4)
        fill([buffer], record(*spaces, 1, steps=2))
        assert buffer.sample(4).observations.shape == (4, *spaces[0].shape)


@pytest.mark.parametrize("algo", ["dqn", "sac"])
def test_a_step_that_samples_inside_its_graph_refuses_an_empty_buffer_as_sample_does(algo):
    # learn() never trains on an empty buffer, but a direct train() after compile_step() may: inside the graph the
    # index would be -1, an opaque error on the CPU and a device-side assert on a GPU.
    from sb3_gpu.extensions.continuous import SyncFreeSAC

    cls, env = (PrioritizedDQN, "CartPole-v1") if algo == "dqn" else (SyncFreeSAC, "Pendulum-v1")
    model = cls("MlpPolicy", env, replay_buffer_class=DeviceReplayBuffer, policy_kwargs={"net_arch": [8]}, device="cpu")
    assert model.compile_step("eager") is None
    model.set_logger(configure(None, [""]))
    with pytest.raises(ValueError, match="cannot sample from an empty DeviceReplayBuffer: add transitions first"):
        model.train(gradient_steps=1, batch_size=8)


RESUMED_BUFFERS = {
    "device": lambda spaces: DeviceReplayBuffer(10, *spaces, "cpu", 2, n_steps=3, gamma=0.5),
    "device one-copy": lambda spaces: DeviceReplayBuffer(10, *spaces, "cpu", 2, True, n_steps=3, gamma=0.5),
    "host PER": lambda spaces: PrioritizedReplayBuffer(10, *spaces, "cpu", 2, n_steps=3, gamma=0.5),
    "SB3 n-step": lambda spaces: NStepReplayBuffer(10, *spaces, "cpu", 2, n_steps=3, gamma=0.5),
}


@pytest.mark.parametrize("make", RESUMED_BUFFERS.values(), ids=RESUMED_BUFFERS.keys())
def test_a_resumed_buffer_ends_the_saved_episodes_where_they_were_saved(tmp_path, make):
    # The resumed run resets its envs. Unless the episodes under way end at the save, as a time limit ends them, an
    # n-step return runs on from a saved episode into a new one, and in one-copy storage the last saved transition
    # bootstraps from the reset observation that overwrote its next one.
    from types import SimpleNamespace

    spaces = SPACES["vector-discrete"]
    saved, reference = make(spaces), make(spaces)
    episodes = record(*spaces, 2, steps=5, p_done=0.0)
    fill([saved], episodes)
    model = SimpleNamespace(device=th.device("cpu"), n_envs=2, observation_space=spaces[0], action_space=spaces[1])
    load_replay_buffer(model, save_pickle(tmp_path / "replay_buffer.pkl", saved))
    resumed = model.replay_buffer
    # Uninterrupted, with the same episodes cut by a time limit at their fifth step, then the new ones.
    obs, next_obs, action, reward, _, _ = episodes[-1]
    episodes[-1] = (obs, next_obs, action, reward, np.ones(2, bool), [{"TimeLimit.truncated": True}] * 2)
    fill([reference], episodes)
    fill([resumed, reference], record(*spaces, 2, steps=4, seed=1, p_done=0.0))
    batch = np.repeat(np.arange(reference.size()), 2)
    if isinstance(reference, NStepReplayBuffer):
        np.random.seed(3)  # the env indices it draws
        expected, got = reference._get_samples(batch), (np.random.seed(3), resumed._get_samples(batch))[1]
    else:
        envs = np.tile([0, 1], reference.size())
        expected, got = reference._get_samples_at(batch, envs, None), resumed._get_samples_at(batch, envs, None)
    for field in (*FIELDS, "discounts"):
        th.testing.assert_close(getattr(got, field), getattr(expected, field), msg=field)


def test_a_buffer_resumed_twice_before_a_step_is_cut_once_and_keeps_its_store_whole(tmp_path):
    # Saved again before the resumed run took a step (its budget reached, a Ctrl-C): the second load finds the
    # episodes already cut and leaves them, so the store of episode ends loses no row.
    from types import SimpleNamespace

    spaces = SPACES["vector-discrete"]
    buffer = DeviceReplayBuffer(10, *spaces, "cpu", 2, True, n_steps=3)
    fill([buffer], record(*spaces, 2, steps=4, p_done=0.0))
    model = SimpleNamespace(device=th.device("cpu"), n_envs=2, observation_space=spaces[0], action_space=spaces[1])
    for round_ in range(2):
        load_replay_buffer(model, save_pickle(tmp_path / f"replay_buffer_{round_}.pkl", buffer))
        buffer = model.replay_buffer
    in_use = {int(r) for r in buffer._terminal_row_host.reshape(-1) if r >= 0}
    assert len(in_use) == 2 and len(in_use) + len(buffer._free_rows) == len(buffer._terminal_obs)
