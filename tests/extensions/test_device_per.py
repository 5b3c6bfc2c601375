from __future__ import annotations

from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from stable_baselines3.common.logger import configure

from sb3_gpu.common.errors import ConfigError, TrainingDiverged
from sb3_gpu.common.io import save_pickle
from sb3_gpu.extensions.hostreads import HostReads
from sb3_gpu.extensions.per import (
    DevicePrioritizedReplayBuffer,
    DeviceSumMinTree,
    PrioritizedDQN,
    PrioritizedQRDQN,
    PrioritizedReplayBuffer,
    SumMinTree,
    tree_backends,
)
from sb3_gpu.runs.saving import load_replay_buffer

OBS = gym.spaces.Box(-1, 1, (3,), np.float32)
ACT = gym.spaces.Discrete(2)

# Multiples of 1/16 add up exactly in any order, so trees of any shape and either backend agree to the bit.
dyadic = st.lists(st.integers(0, 1600).map(lambda k: k / 16), min_size=1, max_size=300)

# The tensor ops are what runs on a GPU; numba's loops are what the CPU runs where the fast extra is installed.
BACKENDS = ["torch", *(["numba"] if "numba" in tree_backends() else [])]


@pytest.fixture(params=BACKENDS, autouse=True)
def backend(request, monkeypatch):
    """Every tree built in a test, also by a buffer, uses this backend, in a small shape: several levels below a
    top of two nodes, as a million leaves have below a top of thousands."""
    monkeypatch.setattr(DeviceSumMinTree.__init__, "__defaults__", ("cpu", 4, 2, request.param))
    return request.param


def device_tree(values: np.ndarray) -> DeviceSumMinTree:
    tree = DeviceSumMinTree(len(values))
    tree.update(th.arange(len(values)), th.as_tensor(values))
    return tree


def test_the_backend_and_shape_asked_for_are_used(backend):
    tree = DeviceSumMinTree(100)
    assert tree.backend == backend and tree._sizes == [128, 32, 8, 2]  # 100 leaves padded to 2 * 4**3


@settings(max_examples=80, deadline=None)
@given(values=dyadic, data=st.data())
def test_total_minimum_and_prefix_search_equal_the_host_trees(values, data):
    v = np.array(values)
    host = SumMinTree(len(v), fanout=4, top=2)  # a small top: several levels below it, as in a large tree
    host.update(np.arange(len(v)), v)
    tree = device_tree(v)
    assert float(tree.total) == host.total and float(tree.min) == host.min
    if v.sum() == 0:
        return
    fractions = [*data.draw(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50)), 0.0, 1.0]
    prefix = np.array(fractions) * host.total  # 1.0: the total itself, where the last non-empty leaf answers
    found, priorities = tree.find(th.as_tensor(prefix))
    expected, expected_priorities = host.find(prefix)
    np.testing.assert_array_equal(found.numpy(), expected)
    np.testing.assert_array_equal(priorities.numpy(), expected_priorities)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 200),
    batches=st.lists(
        st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 10_000), st.floats(0.0, 50.0)), min_size=1, max_size=9)),
        min_size=1,
        max_size=12,
    ),
)
def test_updates_with_repeats_and_range_writes_leave_the_tree_equal_to_one_rebuilt_from_its_leaves(size, batches):
    tree, reference = DeviceSumMinTree(size), np.zeros(size)
    for as_range, writes in batches:
        values = np.array([p for _, p in writes])
        if as_range:  # as add() writes: consecutive leaves, their ancestors refreshed on the next read
            start = writes[0][0] % size
            values = values[: size - start]
            tree.update_range(start, th.as_tensor(values))
            reference[start : start + len(values)] = values
        else:
            indices = np.array([i % size for i, _ in writes])
            tree.update(th.as_tensor(indices), th.as_tensor(values))
            reference[indices] = values  # the CPU keeps the last of repeated writes, as the host tree does
    rebuilt = DeviceSumMinTree(size)
    rebuilt.update_range(0, th.as_tensor(reference))
    assert float(tree.total) == float(rebuilt.total)
    assert th.equal(tree.sums, rebuilt.sums) and th.equal(tree.mins, rebuilt.mins)


def fill(buffer, n: int, n_envs: int = 1) -> None:
    """Transition ``(pos, env)`` has observation ``pos + env / 10`` and reward ``pos``."""
    for i in range(n):
        obs = np.full((n_envs, 3), i, np.float32) + np.arange(n_envs, dtype=np.float32)[:, None] / 10
        buffer.add(obs, obs + 0.5, np.zeros((n_envs, 1)), np.full(n_envs, float(i)), np.zeros(n_envs), [{}] * n_envs)


def twin_buffers(n: int = 28, n_envs: int = 2, size: int = 64, **kwargs):
    """A host and a device buffer holding the same transitions with the same priorities."""
    host = PrioritizedReplayBuffer(size, OBS, ACT, "cpu", n_envs=n_envs, **kwargs)
    ours = DevicePrioritizedReplayBuffer(size, OBS, ACT, "cpu", n_envs=n_envs, **kwargs)
    td = np.random.default_rng(0).normal(size=n * n_envs) * 3
    for buffer in (host, ours):
        fill(buffer, n, n_envs)
        buffer.update_priorities(np.arange(len(td)), td)
    return host, ours


def draw_like_the_host(buffer: DevicePrioritizedReplayBuffer) -> None:
    """Make the device buffer's uniform draws those of numpy's global RNG, which the host buffer uses."""
    buffer._uniforms = lambda n: th.as_tensor(np.random.random(n))


@pytest.mark.parametrize(("n_steps", "normalize"), [(1, "batch"), (3, "batch"), (1, "buffer")])
def test_samples_weights_and_indices_equal_the_host_buffers_for_the_same_draws(n_steps, normalize):
    host, ours = twin_buffers(alpha=0.6, beta=0.7, n_steps=n_steps, gamma=0.9, normalize=normalize)
    draw_like_the_host(ours)
    for seed in range(5):
        np.random.seed(seed)
        theirs = host.sample(48)
        np.random.seed(seed)
        mine = ours.sample(48)
        assert isinstance(mine.indices, th.Tensor) and mine.weights.dtype == th.float32
        np.testing.assert_array_equal(mine.indices.numpy(), theirs.indices)
        th.testing.assert_close(mine.weights, theirs.weights, rtol=1e-6, atol=0)
        for field in ("observations", "next_observations", "rewards", "actions", "dones"):
            th.testing.assert_close(getattr(mine, field), getattr(theirs, field))
        if n_steps > 1:  # no episode ends here: a return takes three slots, or fewer where it meets the newest
            th.testing.assert_close(mine.discounts, theirs.discounts)
            discounts = theirs.discounts.numpy().ravel()
            assert np.isclose(discounts[:, None], [0.9, 0.81, 0.729]).any(axis=1).all() and np.isclose(discounts, 0.729).any()
        else:
            assert mine.discounts is None and theirs.discounts is None
        assert float(ours.last_max_weight) == pytest.approx(host.last_max_weight, rel=1e-12)
    assert float(ours.max_priority) == host.max_priority


def test_sampling_frequencies_follow_priority_to_the_alpha():
    np.random.seed(0)
    buffer = DevicePrioritizedReplayBuffer(64, OBS, ACT, "cpu", alpha=0.7)
    fill(buffer, 16)
    priority = np.arange(1, 17, dtype=float)
    buffer.update_priorities(th.arange(16), th.as_tensor(priority - buffer.eps))
    counts = th.zeros(16)
    for _ in range(400):
        counts += th.bincount(buffer.sample(64).indices, minlength=16)
    expected = priority**0.7 / (priority**0.7).sum() * float(counts.sum())
    # Stratified sampling is less variable than multinomial, so the chi-square bound is conservative.
    assert stats.chisquare(counts.numpy(), expected).pvalue > 1e-3


def test_new_transitions_get_the_largest_priority_seen():
    buffer = DevicePrioritizedReplayBuffer(8, OBS, ACT, "cpu")
    fill(buffer, 10)  # wraps: slots 0 and 1 rewritten
    buffer.update_priorities(th.arange(8), th.full((8,), 0.1))
    buffer.update_priorities(th.tensor([5]), th.tensor([9.0]))
    fill(buffer, 1)
    assert isinstance(buffer.max_priority, th.Tensor)
    assert float(buffer.tree[[2]][0]) == pytest.approx((9.0 + buffer.eps) ** buffer.alpha)
    assert float(buffer.tree.total) == pytest.approx(6 * 0.1**buffer.alpha + 2 * 9.0**buffer.alpha, rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_td_error_is_refused_on_the_device_and_raised_by_check(bad, backend):
    buffer = DevicePrioritizedReplayBuffer(8, OBS, ACT, "cpu")
    fill(buffer, 8)
    buffer.update_priorities(th.arange(2), th.tensor([3.0, 4.0]))
    buffer.check()  # nothing refused
    sums, mins, max_priority = buffer.tree.sums.clone(), buffer.tree.mins.clone(), buffer.max_priority.clone()
    with HostReads() as reads:
        buffer.update_priorities(th.arange(3), th.tensor([1.0, bad, 2.0]))
    assert reads.total == 0 or backend == "numba", reads.sites  # numba's loops run on host views (CPU only)
    assert th.equal(buffer.tree.sums, sums) and th.equal(buffer.tree.mins, mins)
    assert th.equal(buffer.max_priority, max_priority) and int(buffer.refused_updates) == 1
    with pytest.raises(TrainingDiverged, match="a TD error is NaN or inf"):
        buffer.check()
    buffer.update_priorities(th.arange(3), th.tensor([1.0, 5.0, 2.0]))  # later updates are written again
    assert float(buffer.tree[[1]][0]) == pytest.approx((5.0 + buffer.eps) ** buffer.alpha)


def test_one_copy_layout_never_draws_the_slot_whose_observation_was_overwritten():
    buffer = DevicePrioritizedReplayBuffer(10, OBS, ACT, "cpu", n_envs=2, optimize_memory_usage=True)
    for i in range(13):  # full, with slot 3 holding the next observation of slot 2 (whose own next is i + 1)
        obs = np.full((2, 3), i, np.float32)
        buffer.add(obs, obs + 1, np.zeros((2, 1)), np.zeros(2), np.zeros(2), [{}] * 2)
    samples = [buffer.sample(64) for _ in range(50)]
    slots = set((th.cat([s.indices for s in samples]) // 2).tolist())
    assert buffer.pos == 3 and slots == {0, 1, 2, 4}
    for s in samples:
        th.testing.assert_close(s.next_observations, s.observations + 1)


def test_pickle_holds_arrays_and_loads_through_sb3_gpus_allowlist_with_its_priorities(tmp_path):
    buffer = DevicePrioritizedReplayBuffer(30, OBS, ACT, "cpu", n_envs=2, alpha=0.5)
    fill(buffer, 12, n_envs=2)
    buffer.update_priorities(th.arange(10), th.linspace(0, 4, 10))
    buffer.sample(8)
    sums = buffer.tree.sums.clone()
    buffer.update_priorities(th.arange(2), th.tensor([float("nan"), 1.0]))  # refused: the trees stay as they were
    assert int(buffer.refused_updates) == 1 and th.equal(buffer.tree.sums, sums)
    # The allowlist admits no torch tensor, so loading proves the pickle holds numpy arrays.
    path = save_pickle(tmp_path / "replay_buffer.pkl", buffer)
    model = SimpleNamespace(device=th.device("cpu"), n_envs=2, observation_space=OBS, action_space=ACT)  # its spaces
    load_replay_buffer(model, path)
    loaded = model.replay_buffer
    assert isinstance(loaded, DevicePrioritizedReplayBuffer) and loaded.alpha == 0.5
    assert th.equal(loaded.tree.sums, buffer.tree.sums) and th.equal(loaded.tree.mins, buffer.tree.mins)
    assert th.equal(loaded.max_priority, buffer.max_priority)
    assert th.equal(loaded.last_max_weight, buffer.last_max_weight)
    loaded.check()  # the saving run's refusal was its own to report: a resumed run does not stop for it
    assert int(loaded.refused_updates) == 0
    fill(loaded, 3, n_envs=2)
    assert loaded.sample(8).indices.max() < 30


def test_setting_the_device_moves_the_trees():
    buffer = DevicePrioritizedReplayBuffer(20, OBS, ACT, "cpu")
    buffer.device = "meta"  # a device with no memory: the CPU twin of a move to the GPU
    devices = {t.device.type for t in (buffer.observations, buffer.tree.sums, buffer.tree.mins, buffer.max_priority)}
    assert devices == {"meta"}


@pytest.mark.parametrize("cls", [PrioritizedReplayBuffer, DevicePrioritizedReplayBuffer])
def test_reset_empties_the_priorities_and_samples_only_what_is_added_after(cls):
    # SB3's reset only rewinds the position: the old priorities would draw the old transitions' slots, or slots past
    # the new size.
    buffer = cls(16, OBS, ACT, "cpu")
    fill(buffer, 10)
    buffer.update_priorities(np.arange(10), np.full(10, 50.0))
    buffer.reset()
    assert float(buffer.tree.total) == 0 and float(buffer.tree.min) == np.inf
    assert float(buffer.max_priority) == 1.0  # the old transitions' largest TD error is not the new ones' start
    fill(buffer, 2)
    samples = buffer.sample(64)
    assert set(np.asarray(samples.indices).tolist()) <= {0, 1}
    assert set(samples.observations[:, 0].tolist()) <= {0.0, 1.0}
    assert float(buffer.tree.total) == pytest.approx(2.0)  # two new leaves at max_priority ** alpha = 1


def test_bad_per_values_are_the_host_buffers_errors():
    with pytest.raises(ConfigError, match=r"per\.alpha: expected a number >= 0"):
        DevicePrioritizedReplayBuffer(8, OBS, ACT, "cpu", alpha=-0.1)


def test_training_steps_on_the_device_buffer_equal_those_on_the_host_buffer(backend):
    common = dict(learning_rate=1e-3, batch_size=16, learning_starts=0, policy_kwargs={"net_arch": [16]}, seed=3, device="cpu")
    per = dict(replay_buffer_kwargs={"alpha": 0.6, "beta": 0.5})
    host = PrioritizedDQN("MlpPolicy", "CartPole-v1", replay_buffer_class=PrioritizedReplayBuffer, **common, **per)
    ours = PrioritizedDQN("MlpPolicy", "CartPole-v1", replay_buffer_class=DevicePrioritizedReplayBuffer, **common, **per)
    ours.policy.load_state_dict(host.policy.state_dict())
    ours.policy.optimizer.load_state_dict(host.policy.optimizer.state_dict())
    draw_like_the_host(ours.replay_buffer)
    rng = np.random.default_rng(0)
    for _ in range(64):
        obs, nxt = rng.normal(size=(1, 4)).astype(np.float32), rng.normal(size=(1, 4)).astype(np.float32)
        args = (obs, nxt, rng.integers(0, 2, (1, 1)), rng.normal(size=1), rng.integers(0, 2, 1).astype(float), [{}])
        host.replay_buffer.add(*args)
        ours.replay_buffer.add(*args)
    for model in (host, ours):
        model._current_progress_remaining = 0.5
        model.set_logger(configure(None, [""]))
        np.random.seed(0)
        with HostReads() as reads:
            model.train(gradient_steps=4, batch_size=16)
        model._device_log.write(model.logger)  # what dump_logs reads: the losses and the device buffer's figures
    # The device buffer's training reads nothing back (the NaN guard is off); numba's trees run on host views.
    assert reads.total == 0 or backend == "numba", reads.sites
    for a, b in zip(host.policy.parameters(), ours.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    th.testing.assert_close(ours.replay_buffer.tree[th.arange(64)], th.as_tensor(host.replay_buffer.tree[np.arange(64)]))
    for key in ("train/loss", "per/beta", "per/mean_priority", "per/max_priority", "per/max_weight_unnormalized"):
        assert isinstance(ours.logger.name_to_value[key], float)
        assert ours.logger.name_to_value[key] == pytest.approx(host.logger.name_to_value[key], rel=1e-5)


@pytest.mark.heavy
@pytest.mark.parametrize("algo, policy_kwargs", [(PrioritizedDQN, {}), (PrioritizedQRDQN, {"n_quantiles": 5})])
def test_prioritized_dqn_and_qrdqn_train_on_it_and_write_back_priorities(algo, policy_kwargs):
    model = algo(
        "MlpPolicy",
        "CartPole-v1",
        replay_buffer_class=DevicePrioritizedReplayBuffer,
        replay_buffer_kwargs={"alpha": 0.6, "beta": 0.4},
        learning_starts=100,
        buffer_size=5000,
        device="cpu",
        seed=0,
        policy_kwargs=dict(net_arch=[16], **policy_kwargs),
    )
    model.learn(2500)
    buffer = model.replay_buffer
    assert isinstance(buffer, DevicePrioritizedReplayBuffer) and buffer.size() == 2500
    assert model._n_updates > 500 and len(th.unique(buffer.tree[th.arange(2500)])) > 100, "TD errors became priorities"
    assert 0.4 < buffer.beta <= 1.0


def test_a_nan_td_error_in_training_raises_training_diverged_when_the_logs_are_written():
    model = PrioritizedDQN(
        "MlpPolicy",
        "CartPole-v1",
        replay_buffer_class=DevicePrioritizedReplayBuffer,
        learning_starts=50,
        device="cpu",
        policy_kwargs=dict(net_arch=[8]),
    )
    original = model._per_sample_loss

    def poisoned(data, discounts):
        loss, td = original(data, discounts)
        return loss, td * th.nan

    model._per_sample_loss = poisoned
    written = []
    model.dump_logs = lambda: (written.append(model.num_timesteps), type(model).dump_logs(model))  # type: ignore[method-assign]
    with pytest.raises(TrainingDiverged, match="NaN or inf"):
        model.learn(400)
    assert int(model.replay_buffer.refused_updates) > 0 and written, "refused on the device, raised at a log write"


def test_a_tree_pickled_by_the_earlier_binary_layout_loads_with_its_leaves():
    leaves = np.array([0.5, 0.0, 2.0, 1.25, 0.25])
    sums = np.zeros(16)  # the earlier layout: root at 1, leaves from index 8 (the capacity padded to 2 ** 3)
    sums[8:13] = leaves
    tree = DeviceSumMinTree.__new__(DeviceSumMinTree)
    tree.__setstate__({"capacity": 5, "depth": 3, "leaves": 8, "sums": sums, "mins": np.full(16, np.inf), "_stale": None})
    np.testing.assert_array_equal(tree[np.arange(5)].numpy(), leaves)
    assert float(tree.total) == leaves.sum() and float(tree.min) == 0.25
