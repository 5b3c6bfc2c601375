from __future__ import annotations

import copy
import importlib.util
import io
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from hypothesis import given, settings
from hypothesis import strategies as st
from sb3_contrib import QRDQN
from scipy import stats
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.logger import configure
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from sb3_gpu import make_model, make_plan
from sb3_gpu.common.checks import per_config
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.per import PrioritizedDQN, PrioritizedQRDQN, PrioritizedReplayBuffer, SumMinTree
from sb3_gpu.planning.build import build_env, build_model

OBS = gym.spaces.Box(-1, 1, (3,), np.float32)
ACT = gym.spaces.Discrete(2)

# Priorities are (|td| + eps) ** alpha, never subnormal: a tree of subnormal floats cannot resolve a prefix.
priorities = st.lists(st.floats(0.0, 100.0, allow_nan=False, allow_subnormal=False), min_size=1, max_size=300)


# Small tops force several levels below the top even for a few hundred leaves.
# Each shape with each backend: numpy calls and, where numba is installed, the compiled loops.
BACKENDS = ["numpy"] + (["numba"] if importlib.util.find_spec("numba") else [])
shapes = st.tuples(st.sampled_from([(2, 1), (3, 2), (16, 4), (16, 4096), (4, 7)]), st.sampled_from(BACKENDS)).map(
    lambda shape: (*shape[0], shape[1])
)


@settings(max_examples=80, deadline=None)
@given(values=priorities, shape=shapes)
def test_tree_totals_and_minimum_match_brute_force(values, shape):
    tree = SumMinTree(len(values), *shape)
    tree.update(np.arange(len(values)), np.array(values))
    v = np.array(values)
    assert tree.total == pytest.approx(v.sum(), rel=1e-9, abs=1e-9)
    positive = v[v > 0]
    assert tree.min == (positive.min() if len(positive) else np.inf)


@settings(max_examples=80, deadline=None)
@given(values=priorities, shape=shapes, data=st.data())
def test_prefix_search_matches_brute_force_and_skips_empty_leaves(values, shape, data):
    v = np.array(values)
    if v.sum() <= 0:
        return
    tree = SumMinTree(len(v), *shape)
    tree.update(np.arange(len(v)), v)
    fractions = data.draw(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50))
    prefix = np.array(fractions) * tree.total
    found, values = tree.find(prefix)
    assert (v[found] > 0).all()
    np.testing.assert_array_equal(values, v[found])
    # Each answer's interval [sum before it, sum through it) holds the prefix, up to rounding of the sums.
    cumulative = np.cumsum(v)
    tolerance = 1e-9 * v.sum()
    assert (cumulative[found] - v[found] <= prefix + tolerance).all()
    assert (prefix < cumulative[found] + tolerance).all()


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 200),
    shape=shapes,
    updates=st.lists(st.tuples(st.integers(0, 10_000), st.floats(0.0, 50.0)), min_size=1, max_size=100),
)
def test_updates_with_repeats_and_wrap_around_keep_the_tree_exact(size, shape, updates):
    tree = SumMinTree(size, *shape)
    reference = np.zeros(size)
    for start in range(0, len(updates), 7):  # batches of seven, indices wrapping around the ring
        chunk = updates[start : start + 7]
        idx = np.array([i % size for i, _ in chunk])
        val = np.array([p for _, p in chunk])
        tree.update(idx, val)
        for i, p in zip(idx, val, strict=False):
            reference[i] = p
    assert tree.total == pytest.approx(reference.sum(), rel=1e-9, abs=1e-9)
    np.testing.assert_array_equal(tree[np.arange(size)], reference)
    positive = reference[reference > 0]
    assert tree.min == (positive.min() if len(positive) else np.inf)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 300),
    shape=shapes,
    start=st.integers(0, 299),
    values=st.lists(st.floats(0.0, 9.0), min_size=1, max_size=8),
)
def test_range_updates_equal_index_updates(size, shape, start, values):
    start = start % size
    values = values[: size - start]
    by_range, by_index = SumMinTree(size, *shape), SumMinTree(size, *shape)
    by_range.update_range(start, np.array(values))
    by_index.update(np.arange(start, start + len(values)), np.array(values))
    for a, b in zip(by_range.sums + by_range.mins, by_index.sums + by_index.mins, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)  # sums may differ in the last bit: other summation order


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba (the fast extra) is not installed")
def test_numba_and_numpy_backends_agree_on_a_large_tree():
    rng = np.random.default_rng(0)
    trees = [SumMinTree(50_000, top=256, backend=backend) for backend in ("numpy", "numba")]
    for tree in trees:
        tree.update_range(0, np.ones(40_000))
    for _ in range(20):
        idx, val = rng.integers(0, 40_000, 256), rng.uniform(0.01, 5.0, 256)
        for tree in trees:
            tree.update(idx, val)
    prefix = rng.uniform(0, trees[0].total, 512)
    (ours, ours_values), (theirs, theirs_values) = (tree.find(prefix) for tree in trees)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(ours_values, theirs_values)
    for a, b in zip(trees[0].sums + trees[0].mins, trees[1].sums + trees[1].mins, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pickled_tree_keeps_its_levels_joined(backend, monkeypatch):
    tree = SumMinTree(5000, top=64, backend=backend)
    tree.update(np.arange(5000), np.ones(5000))
    copy = pickle.loads(pickle.dumps(tree))
    copy.update(np.array([7]), np.array([101.0]))
    assert copy.total == pytest.approx(5100.0) and copy.sums[0][7] == 101.0
    monkeypatch.setattr("sb3_gpu.extensions.per.tree.kernels", None)  # loaded where numba is missing: numpy takes over
    elsewhere = pickle.loads(pickle.dumps(tree))
    elsewhere.update(np.array([8]), np.array([0.5]))
    assert elsewhere.backend == "numpy" and elsewhere.total == pytest.approx(4999.5) and elsewhere.min == 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity", [100_000, 70_001])
def test_prefixes_at_the_total_land_on_a_real_leaf(backend, capacity):
    # Three levels: a search running past the end must not reach padding nodes of the upper levels.
    tree = SumMinTree(capacity, backend=backend)
    tree.update(np.arange(capacity), np.ones(capacity))
    total = tree.total
    found, values = tree.find(np.array([total, np.nextafter(total, 0), 2 * total, 0.0]))
    assert (found < capacity).all() and (values == 1.0).all()
    assert found[0] == found[1] == found[2] == capacity - 1 and found[3] == 0
    tree.update(np.array([3, 4]), 0.5)  # a scalar value broadcasts in both backends
    assert tree.sums[0][3] == tree.sums[0][4] == 0.5


def test_numba_backend_without_numba_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("sb3_gpu.extensions.per.tree.kernels", None)
    with pytest.raises(ConfigError, match=r"needs numba: pip install .numba>=[\d.]+. \(sb3_gpu.s \[fast\] extra\)"):
        SumMinTree(10, backend="numba")
    assert SumMinTree(10).backend == "numpy"


def filled_buffer(n: int = 64, n_envs: int = 1, alpha: float = 0.6, beta: float = 0.4, size: int = 64):
    buffer = PrioritizedReplayBuffer(size, OBS, ACT, "cpu", n_envs=n_envs, alpha=alpha, beta=beta)
    for i in range(n):
        obs = np.full((n_envs, 3), i, np.float32)
        buffer.add(obs, obs + 0.5, np.zeros((n_envs, 1)), np.full(n_envs, float(i)), np.zeros(n_envs), [{}] * n_envs)
    return buffer


def test_sampling_frequencies_follow_priority_to_the_alpha():
    np.random.seed(0)
    buffer = filled_buffer(n=16, alpha=0.7)
    priority = np.arange(1, 17, dtype=float)
    buffer.update_priorities(np.arange(16), priority - buffer.eps)
    counts = np.zeros(16)
    for _ in range(400):
        np.add.at(counts, buffer.sample(64).indices, 1)
    expected = priority**0.7 / (priority**0.7).sum() * counts.sum()
    # Stratified sampling is less variable than multinomial, so the chi-square bound is conservative.
    assert stats.chisquare(counts, expected).pvalue > 1e-3


@pytest.mark.parametrize("normalize", ["batch", "buffer"])
def test_weights_match_the_formula(normalize):
    np.random.seed(1)
    buffer = filled_buffer(n=10, alpha=0.5, beta=0.7, size=32)
    buffer.normalize = normalize
    buffer.update_priorities(np.arange(10), np.linspace(0.1, 3.0, 10))
    sample = buffer.sample(8)
    p = buffer.tree[np.arange(10)]
    prob = p / p.sum()
    w = (10 * prob) ** -0.7
    drawn = w[sample.indices]
    largest = drawn.max() if normalize == "batch" else w.max()
    np.testing.assert_allclose(sample.weights.numpy().ravel(), drawn / largest, rtol=1e-5)
    assert buffer.last_max_weight == pytest.approx(w.max())


def test_one_tiny_priority_does_not_shrink_every_weight():
    # Normalising by the buffer's largest weight, one transition with a TD error of zero (priority eps ** alpha) would
    # scale every other weight down by (1 / eps) ** (alpha * beta): here 1e-6 ** 0.24, about 0.04.
    np.random.seed(0)
    buffer = filled_buffer(n=64, alpha=0.6, beta=0.4, size=64)
    buffer.update_priorities(np.arange(64), np.r_[0.0, np.ones(63)])
    sample = buffer.sample(16)
    assert 0 not in sample.indices  # drawn with probability 1e-6 ** 0.6 / 63
    np.testing.assert_allclose(sample.weights.numpy(), 1.0, rtol=1e-6)
    assert buffer.last_max_weight > 25  # the buffer's own spread, still reported (per/max_weight_unnormalized)
    buffer.normalize = "buffer"  # what that one transition does to the others' weights when normalising by the buffer
    np.testing.assert_allclose(buffer.sample(16).weights.numpy(), 1 / buffer.last_max_weight, rtol=2e-2)


def test_the_normalisation_is_a_preset_choice_and_old_buffers_keep_theirs():
    assert per_config(True, "per")["normalize"] == "batch"
    assert per_config({"normalize": "buffer"}, "per")["normalize"] == "buffer"
    with pytest.raises(ConfigError, match=r"per\.normalize"):
        per_config({"normalize": "global"}, "per")
    old = filled_buffer(n=4)
    del old.normalize  # as a buffer pickled before the choice existed
    assert old.normalize == "buffer"


def test_samples_and_priorities_land_on_the_right_transitions_with_several_envs():
    np.random.seed(2)
    buffer = filled_buffer(n=20, n_envs=3, size=60)  # SB3 keeps size // n_envs = 20 positions per env
    # Transition (pos, env) carries reward pos and observation pos: check the pairing the tree chose.
    sample = buffer.sample(32)
    pos, env = np.divmod(sample.indices, 3)
    np.testing.assert_array_equal(sample.rewards.numpy().ravel(), pos)
    np.testing.assert_array_equal(sample.observations.numpy()[:, 0], pos)
    buffer.update_priorities(np.array([3 * 7 + 2]), np.array([50.0]))
    leaf = buffer.tree[np.array([23])][0]
    assert leaf == pytest.approx((50.0 + buffer.eps) ** buffer.alpha)
    share = leaf / buffer.tree.total  # about 10.5 / 69.5: the other 59 keep priority 1
    assert (buffer.sample(256).indices == 23).mean() == pytest.approx(share, abs=0.01)
    assert set(env.tolist()) == {0, 1, 2}, "the first sample drew from every env's column"


def test_new_transitions_get_the_largest_priority_after_wrap_around():
    buffer = filled_buffer(n=10, size=8)  # wraps: positions 0 and 1 rewritten
    buffer.update_priorities(np.arange(8), np.full(8, 0.1))
    buffer.update_priorities(np.array([5]), np.array([9.0]))
    obs = np.zeros((1, 3), np.float32)
    buffer.add(obs, obs, np.zeros((1, 1)), np.zeros(1), np.zeros(1), [{}])
    assert buffer.tree[np.array([2])][0] == pytest.approx((9.0 + buffer.eps) ** buffer.alpha)
    assert buffer.size() == 8


def test_timeouts_are_not_terminal_in_prioritized_samples():
    buffer = PrioritizedReplayBuffer(4, OBS, ACT, "cpu", handle_timeout_termination=True)
    obs = np.zeros((1, 3), np.float32)
    buffer.add(obs, obs, np.zeros((1, 1)), np.zeros(1), np.ones(1), [{"TimeLimit.truncated": True}])
    assert buffer.sample(4).dones.sum() == 0


@pytest.mark.parametrize("n_envs, size, n", [(1, 40, 23), (1, 40, 97), (3, 30, 71)])
def test_n_step_samples_equal_sb3s_n_step_buffer(n_envs, size, n):
    """The same transitions (terminations, time limits, a wrapped buffer, a partly written one) give the same n-step
    returns, discounts, next observations and dones as SB3's NStepReplayBuffer, for every slot of every env."""
    from stable_baselines3.common.buffers import NStepReplayBuffer

    kwargs = {"n_envs": n_envs, "handle_timeout_termination": True}
    ours = PrioritizedReplayBuffer(size, OBS, ACT, "cpu", n_steps=3, gamma=0.9, **kwargs)
    sb3 = NStepReplayBuffer(size, OBS, ACT, "cpu", n_steps=3, gamma=0.9, **kwargs)
    rng = np.random.default_rng(n)
    for _ in range(n):
        obs, next_obs = rng.normal(size=(2, n_envs, 3)).astype(np.float32)
        action, reward = rng.integers(0, 2, (n_envs, 1)), rng.normal(size=n_envs).astype(np.float32)
        done = rng.random(n_envs) < 0.2
        infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
        for buffer in (ours, sb3):
            buffer.add(obs, next_obs, action, reward, done.astype(np.float32), infos)
    slots = np.arange(ours.size())
    for env in range(n_envs):
        # SB3 draws each sample's env at random: make it draw ``env``, the one given to ours.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(np.random, "randint", lambda low, high, size, env=env: np.full(size, env))
            expected = sb3._get_samples(slots)
        got = ours._get_samples_at(slots, np.full(slots.shape, env) if n_envs > 1 else 0, None)
        for name in ("observations", "actions", "next_observations", "dones", "rewards", "discounts"):
            th.testing.assert_close(getattr(got, name).float(), getattr(expected, name).float(), msg=name)


def test_n_step_prioritized_dqn_trains_on_n_step_targets():
    model = make_model("dqn", "CartPole-v1", device="cpu", per=True, n_steps=3, learning_starts=64, net_arch=[8], seed=0).model
    # The buffer computes the returns, so SB3 (which would warn that a custom buffer ignores n_steps) keeps one.
    assert model.n_steps == 1 and model.replay_buffer.n_steps == 3 and model.replay_buffer.gamma == model.gamma
    model.learn(300)
    discounts = model.replay_buffer.sample(64).discounts.numpy().ravel()
    powers = model.gamma ** np.arange(1, 4)  # a return of 1, 2 or 3 steps
    assert np.isclose(discounts[:, None], powers).any(axis=1).all() and np.isclose(discounts, powers[2]).any()


@pytest.mark.parametrize("cls", [PrioritizedDQN, PrioritizedQRDQN])
def test_a_step_weights_each_loss_by_its_importance_and_writes_back_its_td_error(cls):
    # With beta 0 every weight is 1, and the tests that compare with SB3 ran with it: dropping the weights, or
    # writing back another error than |target - current|, trained on unnoticed.
    from sb3_contrib.common.utils import quantile_huber_loss

    model = cls(
        "MlpPolicy", "CartPole-v1", learning_rate=1e-3, batch_size=16, learning_starts=0, seed=3, device="cpu",
        replay_buffer_class=PrioritizedReplayBuffer, replay_buffer_kwargs={"alpha": 0.6, "beta": 0.5},
        policy_kwargs={"net_arch": [16]},
    )  # fmt: skip
    buffer, rng = model.replay_buffer, np.random.default_rng(0)
    for _ in range(64):
        obs, nxt = rng.normal(size=(2, 1, 4)).astype(np.float32)
        buffer.add(obs, nxt, rng.integers(0, 2, (1, 1)), rng.normal(size=1), rng.integers(0, 2, 1).astype(float), [{}])
    buffer.update_priorities(np.arange(64), rng.exponential(size=64))
    model._current_progress_remaining = 1.0
    model.set_logger(configure(None, [""]))
    sample = buffer.sample(16)
    weights = sample.weights.flatten()
    assert not th.allclose(weights, th.ones_like(weights))
    buffer.sample = lambda batch_size, env=None: sample  # the step trains on this batch
    policy = copy.deepcopy(model.policy)  # SB3's update, by hand, on a copy
    with th.no_grad():
        if cls is PrioritizedDQN:
            following = policy.q_net_target(sample.next_observations).max(dim=1)[0].reshape(-1, 1)
        else:
            quantiles = policy.quantile_net_target(sample.next_observations)
            best = quantiles.mean(dim=1, keepdim=True).argmax(dim=2, keepdim=True).expand(16, model.n_quantiles, 1)
            following = quantiles.gather(dim=2, index=best).squeeze(dim=2)
        target = sample.rewards + (1 - sample.dones) * model.gamma * following
    if cls is PrioritizedDQN:
        current = policy.q_net(sample.observations).gather(dim=1, index=sample.actions.long())
        losses = th.nn.functional.smooth_l1_loss(current, target, reduction="none").flatten()
        errors = (target - current).flatten()
    else:
        index = sample.actions.long()[..., None].expand(16, model.n_quantiles, 1)
        current = policy.quantile_net(sample.observations).gather(dim=2, index=index).squeeze(dim=2)
        losses = th.stack([quantile_huber_loss(current[i : i + 1], target[i : i + 1]) for i in range(16)])
        errors = target.mean(dim=1) - current.mean(dim=1)
    loss = (losses * weights).mean()
    policy.optimizer.zero_grad()
    loss.backward()
    if model.max_grad_norm is not None:  # QR-DQN's default: none
        th.nn.utils.clip_grad_norm_(policy.parameters(), model.max_grad_norm)
    policy.optimizer.step()
    model.train(gradient_steps=1, batch_size=16)
    assert model._device_log.read()["train/loss"] == pytest.approx(loss.item(), rel=1e-5)
    for a, b in zip(policy.parameters(), model.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    expected = (np.abs(errors.detach().numpy()) + buffer.eps) ** buffer.alpha
    np.testing.assert_allclose(buffer.tree[sample.indices], expected, rtol=1e-5)


def test_saved_buffer_keeps_priorities(tmp_path):
    model = make_model("dqn", "CartPole-v1", device="cpu", per=True, learning_starts=50, net_arch=[8], seed=0).model
    model.learn(300)
    model.save_replay_buffer(tmp_path / "buffer.pkl")
    fresh = make_model("dqn", "CartPole-v1", device="cpu", per=True, net_arch=[8], seed=0).model
    fresh.load_replay_buffer(tmp_path / "buffer.pkl")
    assert isinstance(fresh.replay_buffer, PrioritizedReplayBuffer)
    for ours, theirs in zip(fresh.replay_buffer.tree.sums, model.replay_buffer.tree.sums, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert fresh.replay_buffer.max_priority == model.replay_buffer.max_priority


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # The preset checks of per.* are the buffer's checks: one owner, one message.
        ({"alpha": -0.1}, r"per\.alpha: expected a number >= 0"),
        ({"beta": 1.5}, r"per\.beta0: expected a number in \[0, 1\]"),
        ({"eps": 0.0}, r"per\.eps: expected a number > 0"),
    ],
)
def test_bad_per_values_are_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PrioritizedReplayBuffer(8, OBS, ACT, "cpu", **kwargs)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"per": {"alpha": -1}}, "alpha: expected a number >= 0"),
        ({"per": {"beta0": 2}}, r"beta0: expected a number in \[0, 1\]"),
        ({"per": {"eps": 0}}, "eps: expected a number > 0"),
        ({"per": {"alhpa": 0.5}}, "did you mean 'alpha'"),
    ],
)
def test_bad_per_preset_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        make_plan("dqn", "CartPole-v1", overrides=override)


def test_per_for_an_on_policy_algorithm_is_an_error():
    with pytest.raises(ConfigError, match=r"'per' is for off-policy algorithms .* ppo is on-policy"):
        make_plan("ppo", "CartPole-v1", overrides={"per": True})


def test_plain_dqn_is_plain_sb3_when_extensions_are_off():
    # compile off too: a loaded machine's probe may find the compiled step worth it, and that is an extension.
    model = make_model("dqn", "CartPole-v1", device="cpu", per=False, n_steps=1, net_arch=[8], compile="false").model
    assert type(model) is DQN and type(model.replay_buffer) is ReplayBuffer
    n_step = make_model("dqn", "CartPole-v1", device="cpu", per=False, net_arch=[8], compile="false").model  # n_steps 3
    assert type(n_step) is DQN and type(n_step.replay_buffer) is NStepReplayBuffer and n_step.n_steps == 3


def test_qrdqn_with_per_trains_and_logs_priorities():
    model = make_model("qrdqn", "CartPole-v1", device="cpu", per=True, learning_starts=64, net_arch=[16], seed=0).model
    assert isinstance(model, PrioritizedQRDQN)
    model.learn(600)
    buffer = model.replay_buffer
    leaves = buffer.tree[np.arange(buffer.size())]
    assert model._n_updates > 100 and len(np.unique(leaves)) > 10, "TD errors were written back as priorities"
    assert 0.4 < buffer.beta <= 1.0, "beta anneals from beta0 towards 1"


def _twin_models(per: bool, grad_accum_steps: int = 1, qrdqn: bool = False):
    """A plain SB3 DQN (QR-DQN) and an sb3_gpu one with identical weights and an identical replay buffer."""
    common = dict(learning_rate=1e-3, batch_size=16, learning_starts=0, policy_kwargs={"net_arch": [16]}, seed=3, device="cpu")
    if qrdqn:
        common["policy_kwargs"] = {"net_arch": [16], "n_quantiles": 5}
    plain = (QRDQN if qrdqn else DQN)("MlpPolicy", "CartPole-v1", **common)
    kwargs = dict(replay_buffer_class=PrioritizedReplayBuffer, replay_buffer_kwargs={"alpha": 0.0, "beta": 0.0}) if per else {}
    ours = (PrioritizedQRDQN if qrdqn else PrioritizedDQN)(
        "MlpPolicy", "CartPole-v1", grad_accum_steps=grad_accum_steps, per_beta_fraction=1.0, **common, **kwargs
    )
    ours.policy.load_state_dict(plain.policy.state_dict())
    ours.policy.optimizer.load_state_dict(plain.policy.optimizer.state_dict())
    rng = np.random.default_rng(0)
    for _ in range(64):
        obs, nxt = rng.normal(size=(1, 4)).astype(np.float32), rng.normal(size=(1, 4)).astype(np.float32)
        args = (obs, nxt, rng.integers(0, 2, (1, 1)), rng.normal(size=1), rng.integers(0, 2, 1).astype(float), [{}])
        plain.replay_buffer.add(*args)
        ours.replay_buffer.add(*args)
    for m in (plain, ours):
        m._current_progress_remaining = 1.0
        m.set_logger(configure(None, [""]))
    return plain, ours


def _same_batches(plain, ours):
    """Both models train on the same transitions: ours samples by priority, plain SB3 replays what ours drew."""
    original, drawn = ours.replay_buffer.sample, []

    def record(n, env=None):
        drawn.append(original(n, env))
        return drawn[-1]

    def replay(n, env=None):
        d = drawn.pop(0)
        return ReplayBufferSamples(d.observations, d.actions, d.next_observations, d.dones, d.rewards)

    ours.replay_buffer.sample, plain.replay_buffer.sample = record, replay
    return drawn


def test_alpha_and_beta_zero_reproduce_plain_dqn_updates():
    plain, ours = _twin_models(per=True)
    weights = ours.replay_buffer.sample(16).weights
    drawn, plain_losses = _same_batches(plain, ours), []
    for _ in range(5):
        ours.train(gradient_steps=1, batch_size=16)
        plain.train(gradient_steps=1, batch_size=16)
        plain_losses.append(plain.logger.name_to_value["train/loss"])
        assert not drawn
    # SB3 logs each train()'s loss; ours keeps them on the device and logs their mean when the logs are written.
    assert ours._device_log.read()["train/loss"] == pytest.approx(np.mean(plain_losses), rel=1e-6)
    for a, b in zip(plain.policy.parameters(), ours.policy.parameters(), strict=False):
        th.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert th.equal(weights, th.ones_like(weights)), "beta = 0 means importance weights of one"


@pytest.mark.parametrize("qrdqn", [False, True], ids=["dqn", "qrdqn"])
def test_n_step_discounts_enter_the_targets_as_in_sb3s_n_step_dqn(qrdqn):
    # An n-step sample carries each transition's discount (gamma ** the steps its return spans); SB3's DQN and
    # sb3-contrib's QR-DQN bootstrap with it. A step that used gamma instead would train on 3-step rewards with a
    # 1-step bootstrap.
    plain, ours = _twin_models(per=True, qrdqn=qrdqn)
    sample = ours.replay_buffer.sample(16)
    spans = np.random.default_rng(1).integers(1, 4, (16, 1))
    n_step = sample._replace(discounts=th.as_tensor(plain.gamma**spans, dtype=th.float32))
    ours.replay_buffer.sample = lambda n, env=None: n_step
    plain.replay_buffer.sample = lambda n, env=None: ReplayBufferSamples(*n_step[:6])
    ours.train(gradient_steps=1, batch_size=16)
    plain.train(gradient_steps=1, batch_size=16)
    assert ours._device_log.read()["train/loss"] == pytest.approx(plain.logger.name_to_value["train/loss"], rel=1e-6)
    for a, b in zip(plain.policy.parameters(), ours.policy.parameters(), strict=True):
        th.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        if a.requires_grad and a in plain.policy.optimizer.state:  # the online network's (the target's has none)
            th.testing.assert_close(ours.policy.optimizer.state[b]["exp_avg"], plain.policy.optimizer.state[a]["exp_avg"])


def test_gradient_accumulation_averages_micro_batches():
    plain, ours = _twin_models(per=False, grad_accum_steps=2)
    fixed = ours.replay_buffer.sample(32)
    halves = [type(fixed)(*(t[i * 16 : (i + 1) * 16] if isinstance(t, th.Tensor) else t for t in fixed)) for i in (0, 1)]
    ours.replay_buffer.sample = lambda n, env=None: halves.pop(0)
    plain.replay_buffer.sample = lambda n, env=None: fixed
    ours.train(gradient_steps=1, batch_size=16)
    plain.train(gradient_steps=1, batch_size=32)
    for a, b in zip(plain.policy.parameters(), ours.policy.parameters(), strict=False):
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # One Adam step moves a weight by about lr whatever the gradient's scale: its moments tell a sum from a mean.
    for a, b in zip(plain.policy.q_net.parameters(), ours.policy.q_net.parameters(), strict=True):
        mine, theirs = ours.policy.optimizer.state[b], plain.policy.optimizer.state[a]
        th.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=1e-5, atol=1e-9)
        th.testing.assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-4, atol=1e-12)


def test_prioritized_model_saves_and_loads_with_its_class(tmp_path):
    model = make_model(
        "dqn", "CartPole-v1", device="cpu", per=True, grad_accum_steps=2, net_arch=[8], learning_starts=10
    ).model
    model.learn(100)
    buffer = io.BytesIO()
    model.save(buffer)
    buffer.seek(0)
    loaded = PrioritizedDQN.load(buffer)
    assert loaded.grad_accum_steps == 2 and loaded.per_beta_fraction == 1.0


def test_large_profile_carries_the_seed_000_settings(cpu_machine):
    plan = make_plan("dqn", "gymnasium.envs.classic_control.acrobot:AcrobotEnv", profile="large", hardware=cpu_machine)
    params = plan.preset.params
    assert (params.buffer_size, params.batch_size, params.grad_accum_steps, params.train_freq) == (500_000, 1024, 2, 1)
    assert params.target_update_interval == 5000 and params.per["alpha"] == 0.6
    assert plan.preset.sources["batch_size"] == "dqn.yaml:default/large" and plan.profile_reason == "asked for"
    assert plan.preset.model_class is PrioritizedDQN


def test_profile_missing_from_the_entry_is_an_error(cpu_machine):
    with pytest.raises(ConfigError, match=r"dqn.yaml:CartPole-v1 has no 'large' profile"):
        make_plan("dqn", "CartPole-v1", profile="large", hardware=cpu_machine)


def test_each_per_setting_of_a_plan_reaches_the_buffer_and_the_model():
    overrides = {"per": True, "per.alpha": 0.7, "per.beta0": 0.3, "per.eps": 1e-5, "per.normalize": "batch"}
    overrides.update({"per.beta_fraction": 0.25, "compile": "false", "amp": "off", "learning_starts": 10})
    plan = make_plan("dqn", "CartPole-v1", "cpu", vec_env="dummy", overrides=overrides)
    model = build_model(plan, build_env(plan))
    buffer = model.replay_buffer
    assert (buffer.alpha, buffer.beta, buffer.eps, buffer.normalize) == (0.7, 0.3, 1e-5, "batch")
    assert model.per_beta_fraction == 0.25


@pytest.mark.heavy
def test_per_cli_switch_lands_in_the_plan(tmp_path):
    from tests.conftest import run_cli

    result = run_cli("sb3_gpu.train", "dqn", "--env", "CartPole-v1", "--per", "--set", "per.alpha=0.5", "--plan")
    assert result.returncode == 0, result.stderr
    assert "'alpha': 0.5" in result.stdout and "--set" in result.stdout


def test_per_statistics_are_logged(tmp_path):
    import csv

    model = make_model(
        "dqn", "CartPole-v1", device="cpu", per=True, learning_starts=32, net_arch=[8], train_freq=4, seed=0
    ).model
    model.set_logger(configure(str(tmp_path), ["csv"]))
    model.learn(600, log_interval=1)
    with open(tmp_path / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("per/beta")]
    assert logged, "per/ keys missing from the log"
    betas = [float(r["per/beta"]) for r in logged]
    assert betas == sorted(betas) and betas[0] >= 0.4 and betas[-1] <= 1.0
    last = logged[-1]
    assert float(last["per/max_priority"]) >= float(last["per/mean_priority"]) > 0
    assert float(last["per/max_weight_unnormalized"]) >= 1.0


def test_per_switch_keeps_the_presets_own_settings(cpu_machine):
    plan = make_plan("dqn", "CartPole-v1", overrides={"per": True}, hardware=cpu_machine)
    assert plan.preset.params.per["alpha"] == 0.4  # dqn.yaml:CartPole-v1, not the 0.6 default
    plan = make_plan("dqn", "Acrobot-v1", overrides={"per": True}, hardware=cpu_machine)
    assert plan.preset.params.per["alpha"] == 0.6


class _ShiftedActions(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,))
    action_space = gym.spaces.Discrete(3, start=1)

    def reset(self, *, seed=None, options=None):
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}


@pytest.mark.parametrize("cls", [PrioritizedDQN, PrioritizedQRDQN])
def test_discrete_actions_not_numbered_from_zero_are_refused(cls):
    # SB3's DQN fails (gather past n) once a warm-up action of n is sampled; the masked loss took its Q-value as 0
    # and trained on without a word.
    with pytest.raises(ValueError, match=r"takes Discrete actions numbered from 0; the env has Discrete\(3, start=1\)"):
        cls("MlpPolicy", _ShiftedActions(), device="cpu")


@pytest.mark.parametrize("fraction, progress, beta", [(0.5, 0.25, 0.7), (0.5, 0.5, 1.0), (0.5, 0.9, 1.0), (0.8, 0.2, 0.55)])
def test_beta_rises_from_its_start_to_one_over_its_fraction_of_training(fraction, progress, beta):
    # Every other test trains with beta_fraction 1, where dividing the progress by it or multiplying gives the same.
    model = PrioritizedDQN(
        "MlpPolicy",
        "CartPole-v1",
        replay_buffer_class=PrioritizedReplayBuffer,
        replay_buffer_kwargs={"alpha": 0.6, "beta": 0.4},
        per_beta_fraction=fraction,
        device="cpu",
    )
    model._current_progress_remaining = 1.0 - progress
    assert model._anneal_beta() == pytest.approx(beta)
