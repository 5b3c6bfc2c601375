"""Host reads counted (the waits a GPU would see, counted on the CPU), and logged figures that wait for the log write."""

from __future__ import annotations

import copy
import csv
import pickle

import numpy as np
import pytest
import torch as th
from stable_baselines3.common import on_policy_algorithm, policies, utils
from stable_baselines3.common.callbacks import EvalCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure
from stable_baselines3.common.type_aliases import TrainFreq, TrainFrequencyUnit

from sb3_gpu.extensions import devicelog, hostcopy
from sb3_gpu.extensions.accumulate import GradAccumPPO
from sb3_gpu.extensions.continuous import SyncFreeSAC
from sb3_gpu.extensions.devicelog import DeviceLog, GraphSums
from sb3_gpu.extensions.hostcopy import copy_into, queued_observation_copies, to_device
from sb3_gpu.extensions.hostreads import HostReads, _copies_to_host
from sb3_gpu.extensions.per import PrioritizedDQN, PrioritizedQRDQN
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.extensions.rollout import DeviceRolloutBuffer


def test_every_kind_of_read_is_counted_at_its_line_and_transfers_to_the_device_are_not():
    t = th.arange(4.0)
    with HostReads() as reads:
        t.sum().item()
        bool(t.sum() > 0)
        float(t[0])
        int(t[1])
        t.numpy()
        t.cpu()
        t.tolist()
        np.asarray(t)
        t.nonzero()
        t.to("cpu", dtype=th.float64)  # on the CPU twin, as `.to(device)` to the device looks: a transfer
        t * 2 + 1
    assert reads.kinds == {
        "item": 1,
        "__bool__": 1,
        "__float__": 1,
        "__int__": 1,
        "cpu": 1,
        "numpy": 1,
        "tolist": 1,
        "__array__": 1,
        "nonzero": 1,
    }
    assert reads.total == 9 and all(site.split(" at ")[1].startswith(__file__) for site in reads.sites)


def test_a_blocking_copy_from_a_device_to_the_host_is_a_read():
    device = th.empty(2, device="meta")  # a tensor off the host, as a GPU's is
    host = th.empty(2)
    assert _copies_to_host((device, "cpu"), {})
    assert _copies_to_host((device,), {"device": th.device("cpu"), "dtype": th.float64})
    assert _copies_to_host((device, host), {})  # to(other): other's device
    assert _copies_to_host((device, "cpu", th.float64), {})
    assert not _copies_to_host((device, "cpu"), {"non_blocking": True})  # the host goes on; a later read waits
    assert not _copies_to_host((device, "cpu", th.float64, True), {})
    assert _copies_to_host((device, "cpu", th.float64, False, True), {})  # copy=True: still waits
    assert _copies_to_host((device, host, False, True), {})
    assert not _copies_to_host((device, th.float16), {})  # stays on its device
    assert not _copies_to_host((device, "meta"), {})
    assert not _copies_to_host((host, "cpu"), {})  # on the CPU twin: `.to(device)` of the data, not a read


def test_the_numpy_view_of_a_host_copy_is_not_a_second_read():
    t = th.arange(4.0)
    with HostReads() as reads:
        t.argmax().cpu().numpy()  # a GPU's actions for the envs: one wait
        t.sum().cpu().numpy()
    assert reads.kinds == {"cpu": 2}


def test_an_optimizers_host_step_counters_are_not_reads_but_the_loss_is():
    weight = th.nn.Parameter(th.ones(3))
    optimizer = th.optim.Adam([weight])
    with HostReads() as reads:
        for _ in range(3):
            optimizer.zero_grad()
            loss = (weight**2).sum()
            loss.backward()
            optimizer.step()  # reads state["step"], which torch keeps on the host
        loss.item()
    assert reads.kinds == {"item": 1}


def test_the_log_keeps_means_and_latest_values_and_reads_them_all_at_once():
    log = DeviceLog()
    for loss in (1.0, 2.0, 6.0):
        log.mean("train/loss", th.tensor(loss))
    log.latest("per/max_priority", th.tensor(3.0, dtype=th.float64))
    log.latest("per/max_priority", th.tensor(4.0, dtype=th.float64))
    with HostReads() as reads:
        values = log.read()
    assert values == {"train/loss": 3.0, "per/max_priority": 4.0}
    assert reads.total == 1  # one stacked tensor read, however many figures
    assert log.read() == {}  # the next write starts a new mean
    log.mean("train/loss", th.tensor(5.0))
    assert log.read() == {"train/loss": 5.0}


def test_the_log_copies_and_pickles_with_its_pending_figures():
    log = DeviceLog()
    log.mean("train/loss", th.tensor(2.0))
    for other in (copy.deepcopy(log), pickle.loads(pickle.dumps(log))):
        other.mean("train/loss", th.tensor(4.0))
        assert other.read() == {"train/loss": 3.0}
    assert log.read() == {"train/loss": 2.0}


def test_graph_sums_log_the_means_of_what_was_added_since_the_last_read_and_leave_out_keys_never_added():
    sums = GraphSums(("train/actor_loss", "train/critic_loss"), "cpu")
    add = th.compile(sums.add, fullgraph=True)  # as a compiled step adds: inside its graph, in place
    log = DeviceLog()
    add({"train/critic_loss": th.tensor(1.0)})
    add({"train/critic_loss": th.tensor(2.0), "train/actor_loss": th.tensor(-4.0)})
    log.take(sums)
    add({"train/critic_loss": th.tensor(6.0)})  # after the take: read at the next one
    with HostReads() as reads:
        assert log.read() == {"train/critic_loss": 1.5, "train/actor_loss": -4.0}
    assert reads.total == 1
    assert log.read() == {}  # nothing taken since
    log.take(sums)
    assert log.read() == {"train/critic_loss": 6.0}  # the actor's: none added since the last read, none logged
    for _ in range(3):
        add({"train/critic_loss": th.tensor(1e8), "train/actor_loss": th.tensor(0.1)})
    log.take(sums)
    # Running sums read as differences keep a small figure's digits after large ones.
    assert log.read() == {"train/critic_loss": 1e8, "train/actor_loss": pytest.approx(0.1, rel=1e-7)}


def test_float32_graph_sums_as_on_mps_start_again_at_each_take_and_keep_their_digits_past_2_24_steps(monkeypatch):
    monkeypatch.setattr(devicelog, "_wide", lambda device: th.float32)  # what MPS, which has no float64, gets
    sums = GraphSums(("train/loss",), "cpu")
    add = th.compile(sums.add, fullgraph=True)
    log = DeviceLog()
    sums.state.copy_(th.tensor([[2.0**24 * 0.5], [2.0**24]]))  # where 16.8M steps at a loss of 0.5 left it
    log.take(sums)
    assert log.read() == {"train/loss": 0.5}
    assert sums.state.count_nonzero() == 0  # from zero again
    for _ in range(1000):
        add({"train/loss": th.tensor(0.01)})
    log.take(sums)  # two takes before one read: both are logged
    add({"train/loss": th.tensor(2.0)})
    log.take(sums)
    # The run-long float32 sums logged 0.009765625 here, and nothing at all once their count stopped at 2**24.
    assert log.read() == {"train/loss": pytest.approx((10.0 + 2.0) / 1001, rel=1e-4)}  # float32 adds
    assert log.read() == {}


@pytest.mark.parametrize(
    "make",
    [
        lambda: GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, grad_accum_steps=2, device="cpu"),
        lambda: PrioritizedDQN("MlpPolicy", "CartPole-v1", learning_starts=50, batch_size=16, device="cpu"),
        lambda: SyncFreeSAC("MlpPolicy", "Pendulum-v1", learning_starts=50, batch_size=16, device="cpu"),
    ],
    ids=["ppo", "dqn", "sac"],
)
def test_the_losses_kept_on_the_device_reach_every_dump_not_only_the_models_own(make, tmp_path):
    # SB3's train() records each loss at once: an EvalCallback's rows, and the user's own dump after learn, carry them.
    model = make()
    model.set_logger(configure(str(tmp_path), ["csv"]))
    evaluation = EvalCallback(make_vec_env(model.env.envs[0].spec.id, 1, seed=1), eval_freq=200, n_eval_episodes=1)
    model.learn(600, callback=evaluation, log_interval=10**6)  # the model's own log writes: none
    model.logger.dump(model.num_timesteps)
    rows = list(csv.DictReader((tmp_path / "progress.csv").read_text().splitlines()))
    loss = next(k for k in rows[0] if k in ("train/loss", "train/critic_loss"))
    assert len(rows) == 4 and all(row[loss] for row in rows), rows
    with HostReads() as reads:
        model.logger.dump(model.num_timesteps)  # nothing waits: no read
    assert reads.total == 0


def test_a_figure_an_overlapped_training_adds_while_the_log_writes_joins_the_row_and_replaces_nothing(tmp_path):
    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", learning_starts=50, batch_size=16, device="cpu")
    model.set_logger(configure(str(tmp_path), ["csv"]))
    model._setup_learn(100, None)
    log, record = model._device_log, model.logger.record
    log.mean("train/loss", th.tensor(1.0))

    def record_meanwhile(key, value, exclude=None):
        record(key, value, exclude)
        if key == "time/fps":  # SB3's dump_logs at work: the trainer thread adds a step's figure meanwhile
            log.mean("train/loss", th.tensor(5.0))

    model.logger.record = record_meanwhile
    model.dump_logs()
    model.logger.dump(2)
    rows = list(csv.DictReader((tmp_path / "progress.csv").read_text().splitlines()))
    # Read twice (by dump_logs, then by the dump), the row had 5.0 alone and the window's 1.0 was never written.
    assert [row["train/loss"] for row in rows] == ["3.0", ""]


def _collect(model, vec_steps):
    """``vec_steps`` steps of the model's own collection (SB3's ``collect_rollouts``), as ``learn`` runs it."""
    _, callback = model._setup_learn(vec_steps * model.n_envs, None)
    callback.on_training_start(locals(), globals())
    if hasattr(model, "rollout_buffer"):
        return model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=vec_steps)
    freq = TrainFreq(vec_steps, TrainFrequencyUnit.STEP)
    return model.collect_rollouts(model.env, callback, freq, model.replay_buffer, learning_starts=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_collection_reads_the_device_once_per_vec_step_for_the_envs_actions(compiled):
    # PPO on the device rollout buffer: values and log-probs stay tensors, distributions are built unchecked.
    two_envs = make_vec_env("CartPole-v1", n_envs=2, seed=0)
    ppo = GradAccumPPO("MlpPolicy", two_envs, n_steps=32, batch_size=32, rollout_buffer_class=DeviceRolloutBuffer, seed=0)
    if compiled:  # the rollout's forward pass in one compiled graph
        assert ppo.compile_step() is None
    # Greedy: every action from the network (QR-DQN's quantiles averaged into Q-values on the device first).
    dqn, qrdqn = (
        cls(
            "MlpPolicy",
            "CartPole-v1",
            exploration_initial_eps=0.0,
            exploration_final_eps=0.0,
            seed=0,
            replay_buffer_class=DeviceReplayBuffer,
        )
        for cls in (PrioritizedDQN, PrioritizedQRDQN)
    )
    for model in (ppo, dqn, qrdqn):
        with HostReads() as reads:
            _collect(model, 32)
        assert reads.total == 32, reads.sites
        assert all("stable_baselines3/common/" in site for site in reads.sites), reads.sites  # the actions' read
    assert not compiled or ppo._compiled_act.fallback is None
    # The observations crossed once, for the policy; the buffers stored that copy.
    assert ppo.rollout_buffer.host_observation_copies == dqn.replay_buffer.host_observation_copies == 0
    assert qrdqn.replay_buffer.host_observation_copies == 0


def test_to_device_is_torchs_own_copy_off_cuda_and_converts_reversed_views():
    frames = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    out = to_device(frames, "cpu")
    assert out.dtype == th.uint8 and th.equal(out, th.from_numpy(frames))
    for view in (frames[:, ::-1], frames[:, ::2], np.broadcast_to(frames[:1], frames.shape)):  # reversed, strided, ...
        assert th.equal(to_device(view, "cpu", th.float32), th.from_numpy(view.copy()).float())
    row = th.zeros(3, 4)
    copy_into(row, frames[1, ::-1])
    assert th.equal(row, th.from_numpy(frames[1, ::-1].copy()).float())


def test_to_device_on_cuda_copies_from_pinned_memory_without_waiting(monkeypatch):
    # No GPU here: pinning and the copy to "cuda" are faked, to see which calls the CUDA path makes, in which order.
    calls, to = [], th.Tensor.to

    def pin_memory(tensor):
        calls.append("pin_memory")
        return tensor.clone()

    def fake_to(tensor, *args, **kwargs):
        if args and th.device(args[0]).type == "cuda":
            calls.append(("to", str(args[0]), kwargs.get("non_blocking")))
            return tensor.clone()
        return to(tensor, *args, **kwargs)

    monkeypatch.setattr(th.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(th.Tensor, "to", fake_to)
    out = to_device(np.arange(6, dtype=np.float64), th.device("cuda:0"), th.float32)
    assert calls == ["pin_memory", ("to", "cuda:0", True)]
    assert out.dtype == th.float32 and out.tolist() == [0, 1, 2, 3, 4, 5]


def test_sb3s_observation_copy_is_swapped_while_any_block_runs_and_restored_after_the_last(monkeypatch):
    sb3s = utils.obs_as_tensor
    with queued_observation_copies():
        with queued_observation_copies():
            assert on_policy_algorithm.obs_as_tensor is policies.obs_as_tensor is hostcopy.observations_to_device
        assert on_policy_algorithm.obs_as_tensor is hostcopy.observations_to_device  # the outer block still runs
        with pytest.raises(RuntimeError), queued_observation_copies():
            raise RuntimeError
        assert policies.obs_as_tensor is hostcopy.observations_to_device
    assert on_policy_algorithm.obs_as_tensor is policies.obs_as_tensor is sb3s

    def users_own(obs, device):
        return sb3s(obs, device)

    monkeypatch.setattr(policies, "obs_as_tensor", users_own)  # a replacement made before or during a block stays
    monkeypatch.setattr(on_policy_algorithm, "obs_as_tensor", sb3s)  # (monkeypatch puts SB3's back after the test)
    with queued_observation_copies():
        assert policies.obs_as_tensor is hostcopy.observations_to_device
        on_policy_algorithm.obs_as_tensor = users_own
    assert policies.obs_as_tensor is on_policy_algorithm.obs_as_tensor is users_own
    obs = {"image": np.zeros((2, 3), np.uint8), "vector": np.ones(2, np.float32)}
    out = hostcopy.observations_to_device(obs, th.device("cpu"))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in out.items()} == {
        "image": (th.uint8, (2, 3)),
        "vector": (th.float32, (2,)),
    }
    with pytest.raises(TypeError, match="Unrecognized type of observation"):
        hostcopy.observations_to_device([1, 2], th.device("cpu"))


@pytest.mark.parametrize("algo", ["ppo", "dqn", "sac"])
def test_collection_copies_each_vec_steps_observations_once_by_the_queued_copy(monkeypatch, algo):
    copies = []

    def counted(obs, device):
        copies.append(obs.shape)
        return to_device(obs, device)

    monkeypatch.setattr(hostcopy, "observations_to_device", counted)
    if algo == "ppo":
        envs = make_vec_env("CartPole-v1", n_envs=2, seed=0)
        model = GradAccumPPO("MlpPolicy", envs, n_steps=16, batch_size=32, rollout_buffer_class=DeviceRolloutBuffer)
    elif algo == "dqn":
        model = PrioritizedDQN(
            "MlpPolicy",
            "CartPole-v1",
            exploration_initial_eps=0.0,
            exploration_final_eps=0.0,
            replay_buffer_class=DeviceReplayBuffer,
        )
    else:
        model = SyncFreeSAC("MlpPolicy", "Pendulum-v1", learning_starts=0, replay_buffer_class=DeviceReplayBuffer)
    _collect(model, 16)
    # One per vec step, the envs' batch; PPO's rollout ends with one more, the last observations' values.
    assert copies == [(model.n_envs, *model.observation_space.shape)] * (17 if algo == "ppo" else 16)
    assert on_policy_algorithm.obs_as_tensor is policies.obs_as_tensor is utils.obs_as_tensor  # SB3's, after
    buffer = model.rollout_buffer if algo == "ppo" else model.replay_buffer
    assert buffer.host_observation_copies == 0  # the buffer stored the policy's copy
