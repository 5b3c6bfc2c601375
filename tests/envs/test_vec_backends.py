"""The batched subprocess VecEnv and the EnvPool adapter: DummyVecEnv's semantics, failures named, no leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
import pytest
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from sb3_gpu import make_model, make_vec_env
from sb3_gpu.common.errors import ConfigError, EnvWorkerError
from sb3_gpu.envs.batched import BatchedSubprocVecEnv
from sb3_gpu.envs.build import explain_env_error
from sb3_gpu.envs.choice import VecEnvFallbackWarning
from sb3_gpu.envs.envpool_vec import EnvPoolVecEnv, envpool_available
from tests.conftest import REPO

needs_envpool = pytest.mark.skipif(not envpool_available(), reason="EnvPool is not installed (the envpool extra)")


def short_cartpole() -> gym.Env:
    # A 20-step limit, so that truncations happen as often as terminations.
    return Monitor(gym.make("CartPole-v1", max_episode_steps=20, render_mode="rgb_array"))


class DictObs(gym.ObservationWrapper):
    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({"state": env.observation_space, "count": gym.spaces.Discrete(1000)})
        self.count = 0

    def observation(self, observation):
        self.count += 1
        return {"state": observation, "count": self.count % 1000}


def dict_cartpole() -> gym.Env:
    return DictObs(short_cartpole())


class FailsAtStep(gym.Wrapper):
    def __init__(self, env: gym.Env, at: int):
        super().__init__(env)
        self.at, self.steps = at, 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.at:
            raise ValueError(f"simulator diverged at step {self.steps}")
        return super().step(action)


class FailingFactory:
    def __init__(self, fail: bool):
        self.fail = fail

    def __call__(self) -> gym.Env:
        env = gym.make("CartPole-v1")
        return FailsAtStep(env, 5) if self.fail else env


class LockInInfo(gym.Wrapper):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "lock": threading.Lock()}  # SB3 deep-copies the infos


class InfoFactory:
    """CartPole whose info holds a lock (which cannot be pickled) where ``lock``."""

    def __init__(self, lock: bool):
        self.lock = lock

    def __call__(self) -> gym.Env:
        env = gym.make("CartPole-v1")
        return LockInInfo(env) if self.lock else env


class ClosesNoted(gym.Wrapper):
    """Writes ``path`` as it closes; raises after that where ``raises``."""

    def __init__(self, env: gym.Env, path: str, raises: bool, slow: bool, exits: bool = False):
        super().__init__(env)
        self.path, self.raises, self.slow, self.exits = path, raises, slow, exits

    def close(self):
        if self.exits:
            os._exit(3)  # its worker dies as it closes
        if self.slow:
            time.sleep(1)  # still closing as another worker's env fails
        with open(self.path, "w") as f:
            f.write("closed")
        if self.raises:
            raise RuntimeError("could not flush its log")


class CloseFactory:
    def __init__(self, path: str, raises: bool, slow: bool = False, exits: bool = False):
        self.path, self.raises, self.slow, self.exits = path, raises, slow, exits

    def __call__(self) -> gym.Env:
        return ClosesNoted(gym.make("CartPole-v1"), self.path, self.raises, self.slow, self.exits)


class WrongShape(gym.ObservationWrapper):
    def observation(self, observation):
        return np.zeros(7, dtype=np.float32)  # the space says 4: SB3's DummyVecEnv fails storing it, not the env


def test_an_in_process_env_that_raises_is_named_with_its_own_exception_as_the_cause():
    venv = VecNormalize(DummyVecEnv([FailingFactory(i == 2) for i in range(3)]))
    venv.reset()
    with pytest.raises(ValueError) as info:
        for _ in range(10):
            venv.step(np.zeros(3, dtype=int))
    named = explain_env_error(info.value, venv)
    assert isinstance(named, EnvWorkerError) and named.env_index == 2
    assert str(named) == "env 2 raised ValueError: simulator diverged at step 5"
    assert named.__cause__ is info.value and "in step" in named.worker_traceback
    # An error SB3's loop raises itself is left as it is: the env did not raise it.
    bad = DummyVecEnv([lambda: WrongShape(gym.make("CartPole-v1"))])
    with pytest.raises(ValueError) as info:
        bad.reset()
    assert explain_env_error(info.value, bad) is info.value
    assert explain_env_error(RuntimeError("elsewhere"), venv).args == ("elsewhere",)
    # Nor is one SB3 raises after the loop (copying the infos): no env raised it, whatever env the loop ended at.
    locked = DummyVecEnv([lambda: LockInInfo(gym.make("CartPole-v1")), lambda: gym.make("CartPole-v1")])
    locked.reset()
    with pytest.raises(TypeError) as info:
        locked.step(np.zeros(2, dtype=int))
    assert explain_env_error(info.value, locked) is info.value


def assert_same_step(ours, theirs):
    (o1, r1, d1, i1), (o2, r2, d2, i2) = ours, theirs
    if isinstance(o1, dict):
        assert o1.keys() == o2.keys() and all(np.array_equal(o1[k], o2[k]) for k in o1)
    else:
        assert np.array_equal(o1, o2)
    assert r1.dtype == r2.dtype == np.float32 and np.array_equal(r1, r2)
    assert d1.dtype == d2.dtype == bool and np.array_equal(d1, d2)
    assert len(i1) == len(i2)
    for a, b in zip(i1, i2, strict=False):
        assert a.keys() == b.keys()
        for key in a:
            if key == "terminal_observation":
                if isinstance(a[key], dict):
                    assert all(np.array_equal(a[key][k], b[key][k]) for k in a[key])
                else:
                    assert np.array_equal(a[key], b[key])
            elif key == "episode":
                assert a[key]["r"] == b[key]["r"] and a[key]["l"] == b[key]["l"]
            else:
                assert a[key] == b[key], key


@pytest.mark.heavy
@pytest.mark.parametrize("factory", [short_cartpole, dict_cartpole], ids=["box", "dict"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_batched_matches_dummy_step_for_step(factory, workers):
    n = 5  # uneven slices across 2 and 3 workers
    ours, theirs = BatchedSubprocVecEnv([factory] * n, n_workers=workers), DummyVecEnv([factory] * n)
    try:
        rng = np.random.default_rng(0)
        for _round in range(2):  # the second round checks that seeding again restarts the same episodes
            ours.seed(7), theirs.seed(7)
            o1, o2 = ours.reset(), theirs.reset()
            assert_same_step(
                (o1, np.zeros(1, np.float32), np.zeros(1, bool), []), (o2, np.zeros(1, np.float32), np.zeros(1, bool), [])
            )
            assert ours.reset_infos == theirs.reset_infos
            dones = truncations = 0
            for _ in range(60):
                actions = rng.integers(0, 2, n)
                step = ours.step(actions)
                assert_same_step(step, theirs.step(actions))
                assert all(ours.observation_space.contains(_single(step[0], i)) for i in range(n))
                dones += step[2].sum()
                truncations += sum(info["TimeLimit.truncated"] for info in step[3])
            assert dones > n and truncations > 0, "episodes must end both ways (and auto-reset) during the comparison"
    finally:
        ours.close(), theirs.close()


def _single(obs, i):
    return {k: v[i] for k, v in obs.items()} if isinstance(obs, dict) else obs[i]


@pytest.mark.heavy
def test_batched_attrs_methods_seed_and_render_reach_the_right_envs():
    venv = BatchedSubprocVecEnv([short_cartpole] * 5, n_workers=2)
    try:
        assert venv.render_mode == "rgb_array"
        venv.set_attr("tag", "x", indices=[1, 4])
        assert venv.get_attr("tag", indices=[4, 1]) == ["x", "x"]
        with pytest.raises(EnvWorkerError, match=r"env 0 \(worker 0\) raised AttributeError"):
            venv.get_attr("tag")
    finally:
        venv.close()
    venv = BatchedSubprocVecEnv([short_cartpole] * 5, n_workers=2)
    try:
        venv.reset()
        assert venv.env_is_wrapped(Monitor) == [True] * 5 and venv.has_attr("spec")
        first = venv.env_method("reset", seed=3, indices=[0, 3])
        assert np.array_equal(first[0][0], first[1][0])  # same seed, same start
        frames = venv.get_images()
        assert len(frames) == 5 and frames[0].ndim == 3
        assert venv.render().ndim == 3  # SB3 tiles the frames
    finally:
        venv.close()
    assert venv.closed and all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie" for pid in venv.pids)


def _gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        zombies = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() == psutil.STATUS_ZOMBIE]
        if not alive and not zombies:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.heavy
def test_an_env_that_raises_is_named_and_no_worker_is_left():
    venv = BatchedSubprocVecEnv([FailingFactory(i == 3) for i in range(4)], n_workers=2)
    pids = venv.pids
    venv.reset()
    with pytest.raises(EnvWorkerError, match=r"env 3 \(worker 1\) raised ValueError: simulator diverged at step 5") as info:
        for _ in range(10):
            venv.step(np.zeros(4, dtype=int))
    assert info.value.env_index == 3 and "simulator diverged" in info.value.worker_traceback
    assert _gone(pids)
    with pytest.raises(EnvWorkerError, match="closed"):
        venv.step(np.zeros(4, dtype=int))
    venv.close()  # closing a failed vec env is a no-op


@pytest.mark.heavy
def test_ctrl_c_while_a_worker_starts_leaves_no_worker_behind(monkeypatch):
    # Ctrl-C in a notebook cell lands, in a fresh kernel, while the forkserver forks a worker: the worker runs, but its
    # start never returned its pid. It waited on its pipe for good, the pipe's parent end held by the traceback.
    import multiprocessing as mp

    real_start, started = mp.context.ForkServerProcess.start, []

    def interrupted(self):
        real_start(self)
        started.append(self.pid)
        mp.process._children.discard(self)  # as where start() is interrupted: neither recorded nor known here
        self._popen = None
        raise KeyboardInterrupt

    monkeypatch.setattr(mp.context.ForkServerProcess, "start", interrupted)
    with pytest.raises(KeyboardInterrupt) as kept:  # kept: the traceback holds the constructor's frame, as a kernel does
        BatchedSubprocVecEnv([short_cartpole] * 2, n_workers=2, start_method="forkserver")
    assert len(started) == 1 and _gone(started, timeout=30), f"worker {started} still running"
    assert kept.traceback


@pytest.mark.heavy
def test_a_killed_worker_is_named_and_the_rest_are_stopped():
    venv = BatchedSubprocVecEnv([short_cartpole] * 4, n_workers=2)
    pids = venv.pids
    venv.reset()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(EnvWorkerError, match=r"env worker 1 \(envs 2-3, pid \d+\) was killed by SIGKILL"):
        venv.step(np.zeros(4, dtype=int))
    assert _gone(pids)


SCRIPT = """
import sys, time
import numpy as np
from sb3_gpu import make_vec_env
if __name__ == "__main__":
    venv = make_vec_env("CartPole-v1", 4, vec_env="batched")
    print("PIDS", *venv.unwrapped.pids, flush=True)
    venv.reset()
    if sys.argv[1] == "exit":
        sys.exit(0)  # no close(): the exit must still stop the workers
    try:
        venv.step(np.zeros(4, dtype=int))
        print("STEPPING", flush=True)  # inside the try: a signal from now on lands where it is caught
        while True:
            venv.step(np.zeros(4, dtype=int))
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        raise
"""


@pytest.mark.heavy
@pytest.mark.parametrize("how", ["exit", "sigint", "sigterm"])
def test_no_worker_outlives_its_parent(tmp_path, how):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "exit" if how == "exit" else "loop"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )

    def stderr() -> str:  # for a failed check's message: the script may still be stepping, so stop it first
        proc.kill()
        return proc.communicate()[1]

    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), stderr()
        pids = [int(p) for p in line.split()[1:]]
        if how != "exit":
            assert proc.stdout.readline().strip() == "STEPPING", stderr()
            proc.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
        out, _err = proc.communicate(timeout=60)
        if how == "sigint":
            assert "INTERRUPTED" in out and proc.returncode != 0
        assert _gone(pids), f"workers {pids} outlived their parent ({how})"
    finally:  # a failed check leaves no script stepping envs for the rest of the session (its workers follow it)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _sleep(started: Any) -> None:
    started.set()  # the target runs: the fork's hooks (SIGTERM's default back) have run
    time.sleep(60)


@pytest.mark.heavy
@pytest.mark.parametrize("vec_env", ["subproc", "batched"])
def test_sigterm_still_stops_the_programs_an_env_starts_and_others_processes_from_the_forkserver(vec_env):
    # Workers and the forkserver let SIGTERM pass (it reaches a whole job, and the run stops them itself); the
    # programs an env starts, and processes others start from the same forkserver, must still stop on it.
    import multiprocessing as mp

    from tests.fault_envs import Launcher

    venv = make_vec_env(Launcher, 2, vec_env=vec_env)
    try:
        assert type(venv).__name__ == {"subproc": "SubprocVecEnv", "batched": "BatchedSubprocVecEnv"}[vec_env]
        assert venv.env_method("stop_a_program", indices=[1]) == [-signal.SIGTERM]
        context = mp.get_context("forkserver")
        started = context.Event()
        process = context.Process(target=_sleep, args=(started,), daemon=True)
        process.start()
        assert started.wait(60)  # a signal before then would test nothing of the process's own handling
        process.terminate()
        process.join(20)
        assert process.exitcode == -signal.SIGTERM
    finally:
        venv.close()


@pytest.mark.parametrize(
    ("kind", "kwargs", "message"),
    [
        ("subproc", {"n_workers": 2}, r"\['n_workers'\] are not arguments of SubprocVecEnv; accepted: start_method"),
        ("batched", {"start_metod": "fork"}, r"\['start_metod'\] are not arguments of BatchedSubprocVecEnv; accepted: n_"),
    ],
)
def test_a_keyword_the_subprocess_class_does_not_take_is_refused_not_taken_for_a_failed_start(kind, kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("error", VecEnvFallbackWarning)  # no fallback: the caller's mistake is said as such
        with pytest.raises(ConfigError, match=message):
            make_vec_env("CartPole-v1", 2, vec_env=kind, vec_env_kwargs=kwargs)


def test_unpicklable_factory_falls_back_to_dummy_with_a_warning():
    import threading

    lock = threading.Lock()

    def factory():  # a closure over a lock: not picklable
        assert lock is not None
        return gym.make("CartPole-v1")

    with pytest.warns(UserWarning, match="BatchedSubprocVecEnv could not start .*falling back to DummyVecEnv"):
        venv = make_vec_env(factory, 2, vec_env="batched")
    assert isinstance(venv, DummyVecEnv)


# --- EnvPool --------------------------------------------------------------------------------------------------


@needs_envpool
def test_envpool_steps_like_an_sb3_vec_env():
    venv = EnvPoolVecEnv("Pendulum-v1", 3, seed=0)  # Pendulum always truncates, at 200 steps
    obs = venv.reset()
    assert obs.shape == (3, 3) and venv.observation_space.contains(obs[0].astype(np.float32))
    total = np.zeros(3)
    for _t in range(200):
        obs, rewards, dones, infos = venv.step(np.zeros((3, 1), dtype=np.float32))
        total += rewards
        assert rewards.dtype == np.float32 and dones.dtype == bool
    assert dones.all()
    for i, info in enumerate(infos):
        assert info["TimeLimit.truncated"] is True
        assert info["episode"]["l"] == 200 and info["episode"]["r"] == pytest.approx(total[i], rel=1e-5)
        assert not np.array_equal(info["terminal_observation"], obs[i])  # obs is already the next episode's
    venv.close()


@needs_envpool
def test_envpool_cartpole_episodes_match_gymnasium_in_distribution():
    # EnvPool draws its start states with its own RNG, so seeds can't match step for step; the dynamics can.
    def lengths(venv, n_episodes=300):
        venv.seed(0)
        venv.reset()
        rng, out = np.random.default_rng(0), []
        while len(out) < n_episodes:
            _, _, dones, infos = venv.step(rng.integers(0, 2, venv.num_envs))
            out += [info["episode"]["l"] for info, done in zip(infos, dones, strict=False) if done]
            for info, done in zip(infos, dones, strict=False):
                if done:
                    assert not info["TimeLimit.truncated"] and "terminal_observation" in info
        return np.array(out)

    pool = lengths(EnvPoolVecEnv("CartPole-v1", 8, seed=0))
    gym_ = lengths(make_vec_env("CartPole-v1", 8, vec_env="dummy"))
    assert abs(pool.mean() - gym_.mean()) < 3.0, (pool.mean(), gym_.mean())  # random play: ~22 steps either way


@needs_envpool
def test_envpool_atari_keeps_episodic_life_and_whole_game_statistics():
    venv = make_vec_env("ALE/Breakout-v5", 2, vec_env="envpool", seed=0, frame_stack=4)
    obs = venv.reset()
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8  # stacked channel-first, as SB3's CNN takes them
    life_losses, games = 0, []
    rng = np.random.default_rng(0)
    while len(games) < 2:
        _, _, dones, infos = venv.step(rng.integers(0, 4, 2))
        for info, done in zip(infos, dones, strict=False):
            if done and "episode" in info:
                games.append(info["episode"])
            elif done:
                life_losses += 1
    assert life_losses >= 4 * len(games) - 4  # 5 lives: each game reports its life losses as dones first
    assert all(g["l"] > 50 for g in games)
    venv.close()


@needs_envpool
def test_envpool_refuses_what_it_cannot_stand_in_for():
    with pytest.raises(ConfigError, match="no faithful twin of 'FrozenLake-v1'"):
        make_vec_env("FrozenLake-v1", 2, vec_env="envpool")
    with pytest.raises(ConfigError, match="needs a registered Gymnasium id without env kwargs"):
        make_vec_env("CartPole-v1", 2, vec_env="envpool", env_kwargs={"sutton_barto_reward": True})


def test_envpool_missing_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr("sb3_gpu.envs.envpool_vec.envpool_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs EnvPool: pip install 'envpool>=[\d.]+' \(sb3_gpu's \[envpool\] extra\)"):
        make_vec_env("CartPole-v1", 2, vec_env="envpool")


# --- learning ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("vec_env", ["batched", pytest.param("envpool", marks=needs_envpool)])
def test_ppo_learns_cartpole_on_each_backend(vec_env):
    from stable_baselines3.common.evaluation import evaluate_policy

    model = make_model("ppo", "CartPole-v1", device="cpu", vec_env=vec_env, seed=0, compile="false").model  # as seeded
    assert type(model.get_env().unwrapped).__name__ == {"batched": "BatchedSubprocVecEnv", "envpool": "EnvPoolVecEnv"}[vec_env]
    model.learn(60_000)
    eval_env = make_vec_env("CartPole-v1", 1, vec_env="dummy", seed=123)
    mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=20)
    model.get_env().close()
    assert mean >= 400, f"PPO on {vec_env} reached only {mean:.0f}"


@pytest.mark.heavy
def test_close_after_a_step_cut_short_does_not_hang():
    # Ctrl-C while step_wait had read worker 0 but not worker 1: close() must collect only what is still owed.
    venv = BatchedSubprocVecEnv([short_cartpole] * 4, n_workers=2)
    pids = venv.pids
    venv.reset()
    venv.step_async(np.zeros(4, dtype=int))
    venv._recv(0)
    venv.close()
    assert venv.closed and _gone(pids)


@pytest.mark.heavy
def test_a_fallback_leaves_this_process_threads_alone():
    import torch as th

    from tests.envs.test_envs import fails_in_worker

    threads = th.get_num_threads()
    with pytest.warns(UserWarning, match="falling back to DummyVecEnv"):
        venv = make_vec_env(fails_in_worker, 2, vec_env="batched")
    assert isinstance(venv, DummyVecEnv) and th.get_num_threads() == threads


@pytest.mark.parametrize(
    "env_id, sticky",
    [("ALE/Pong-v5", 0.25), ("PongNoFrameskip-v4", 0.0), ("PongNoFrameskip-v0", 0.25), ("Pong-v4", None), ("Pong-v0", None)],
)
def test_envpool_twins_only_atari_ids_that_leave_frame_skipping_to_sb3(env_id, sticky):
    from sb3_gpu.envs.envpool_vec import envpool_task
    from sb3_gpu.envs.spec import resolve_env

    resolve_env(env_id)  # registers the ALE ids
    task = envpool_task(env_id, True)
    if sticky is None:
        assert task is None  # frame skip 2-5 inside the env: no faithful twin
    else:
        assert task[0] == "Pong-v5" and task[1]["repeat_action_probability"] == sticky


@needs_envpool
def test_envpool_reseeding_restarts_the_same_episodes():
    venv = EnvPoolVecEnv("CartPole-v1", 3, seed=5)
    venv.seed(5)
    first = venv.reset()  # the pool already holds seed 5: same start as a rebuilt one
    for _ in range(10):
        venv.step(np.ones(3, dtype=int))
    venv.seed(5)
    assert np.array_equal(venv.reset(), first)
    venv.close()


@pytest.mark.parametrize("vec_env", ["subproc", "batched"])
def test_a_stop_while_the_workers_start_leaves_none_running(monkeypatch, vec_env):
    # The VecEnv is never returned, so nothing else could close its workers: they ran on, writing their monitor files
    # into the run dir that the stopped run was removing.
    import multiprocessing as mp

    from sb3_gpu.envs import build

    def stopped(venv, seed):
        raise KeyboardInterrupt

    before = set(mp.active_children())
    monkeypatch.setattr(build, "_seed", stopped)  # after the workers started, before the first reset
    with pytest.raises(KeyboardInterrupt):
        make_vec_env("CartPole-v1", 2, vec_env=vec_env, seed=0)
    assert not [p for p in set(mp.active_children()) - before if p.is_alive()]


_FORKSERVER_STOPPED_AS_IT_STARTS = """
import multiprocessing as mp, os, signal, sys, time
from multiprocessing import forkserver
from sb3_gpu.envs.batched import worker_start_method

def handler(queue):
    queue.put({signal.default_int_handler: "python", signal.SIG_IGN: "ignored"}.get(signal.getsignal(signal.SIGINT)))

def sigint_set(pid):  # the server's SIGINT caught (Python's handler: its imports run) or ignored
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    return bool((int(status["SigCgt"], 16) | int(status["SigIgn"], 16)) & 1 << (signal.SIGINT - 1))

if __name__ == "__main__":
    if sys.argv[1] == "ignored":  # as a job started with & from a script
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    started_with = signal.getsignal(signal.SIGINT)
    worker_start_method("forkserver")
    server = forkserver._forkserver._forkserver_pid
    while not sigint_set(server):
        time.sleep(0.001)
    for signum in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C, a job's stop, as it imports torch (seconds)
        os.kill(server, signum)
    context = mp.get_context("forkserver")
    queue = context.Queue()
    context.Process(target=handler, args=(queue,)).start()  # a dead server would be started anew here
    print(queue.get(timeout=60), signal.getsignal(signal.SIGINT) is started_with)
    print(forkserver._forkserver._forkserver_pid == server)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's signal masks in /proc")
@pytest.mark.parametrize("sigint", ["python", "ignored"])
def test_the_forkserver_outlives_a_stop_signal_as_it_imports_and_its_workers_get_ctrl_c_as_the_process_had_it(
    tmp_path, sigint
):
    # It took Python's SIGINT handler as it started, so a Ctrl-C during its imports ended it with a traceback (and a
    # SIGTERM without one): the workers could not start. Processes it forks must still stop on Ctrl-C, as from any
    # forkserver (ignored, where the process ignored it), and the starting process gets its own handlers back.
    script = tmp_path / "stopped.py"  # a file: the worker imports its __main__ for the target
    script.write_text(_FORKSERVER_STOPPED_AS_IT_STARTS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(script), sigint], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.split() == [sigint, "True", "True"], result.stderr
    assert "Traceback" not in result.stderr


def test_an_info_that_cannot_be_sent_names_its_own_env():
    # The reply is pickled once the worker's envs have all run: the error named the worker's last env, not env 0.
    venv = BatchedSubprocVecEnv([InfoFactory(i == 0) for i in range(4)], n_workers=1)
    venv.reset()
    with pytest.raises(EnvWorkerError, match=r"env 0 \(worker 0\) raised TypeError: cannot pickle '_thread.lock'") as info:
        venv.step(np.zeros(4, dtype=int))
    assert info.value.env_index == 0
    venv.close()


def test_an_env_whose_close_raises_is_named_and_the_others_are_still_closed(tmp_path):
    # The worker stopped at the first env whose close() raised, and the error was dropped without a word: the envs
    # after it never closed (their files unflushed), as SB3's SubprocVecEnv closes them.
    venv = BatchedSubprocVecEnv([CloseFactory(str(tmp_path / f"{i}"), i == 0, slow=i >= 2) for i in range(4)], n_workers=2)
    venv.reset()
    with pytest.warns(UserWarning, match=r"^env 0 \(worker 0\) raised RuntimeError: could not flush its log while closing$"):
        venv.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3"]


def test_a_worker_that_dies_as_it_closes_cuts_short_no_other_and_drops_no_warning(tmp_path):
    # Its closed pipe ended the reading of answers: the errors read so far were dropped, and the workers still
    # closing theirs were killed.
    factories = [CloseFactory(str(tmp_path / f"{i}"), i == 0, slow=i >= 4, exits=i == 2) for i in range(6)]
    venv = BatchedSubprocVecEnv(factories, n_workers=3)
    venv.reset()
    with pytest.warns(UserWarning, match=r"^env 0 \(worker 0\) raised RuntimeError: could not flush its log while closing$"):
        venv.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "4", "5"]


def test_a_worker_stuck_in_its_env_at_close_is_terminated_with_the_others():
    # A worker that owed a step's answer and gave none within the wait: close() returned with every worker running.
    venv = BatchedSubprocVecEnv([FailingFactory(False) for _ in range(4)], n_workers=2)
    pids = venv.pids
    venv.reset()
    venv.step_async(np.zeros(4, dtype=int))  # a step cut short by Ctrl-C: both workers owe its answer
    venv.conns[0].poll = lambda timeout=0.0: False  # as a worker still stuck in its env after the wait
    venv.close()
    assert venv.closed and _gone(pids)
