"""SB3's VecEnv contract, checked on each backend with SB3's DummyVecEnv as the reference that must pass too."""

from __future__ import annotations

import copy
import functools
import pickle
import warnings

import gymnasium as gym
import numpy as np
import pytest
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecMonitor

from sb3_gpu import make_vec_env
from sb3_gpu.common.errors import EnvWorkerError
from sb3_gpu.envs.batched import BatchedSubprocVecEnv
from sb3_gpu.envs.envpool_vec import EnvPoolVecEnv, envpool_available

N_ENVS = 3
needs_envpool = pytest.mark.skipif(not envpool_available(), reason="EnvPool is not installed (the envpool extra)")
# The batched ones start worker processes (seconds each): the default run keeps the in-process one.
PYTHON_BACKENDS = [
    "dummy",
    pytest.param("batched-1", marks=pytest.mark.heavy),
    pytest.param("batched-2", marks=pytest.mark.heavy),  # splits the 3 envs 2 + 1 (or 1 + 2)
]
ALL_BACKENDS = [*PYTHON_BACKENDS, pytest.param("envpool", marks=needs_envpool)]


class Numbered(gym.Wrapper):
    """CartPole that knows its index, so that attributes and method results show which env answered."""

    def __init__(self, env: gym.Env, number: int):
        super().__init__(env)
        self.number = number

    def whoami(self, suffix: str = "") -> str:
        return f"{self.number}{suffix}"


def numbered_cartpole(number: int, render_mode: str | None = None) -> gym.Env:
    # A 20-step limit, so that truncations happen as well as terminations.
    return Numbered(Monitor(gym.make("CartPole-v1", max_episode_steps=20, render_mode=render_mode)), number)


def build(kind: str, render_mode: str | None = None) -> VecEnv:
    if kind == "envpool":
        return EnvPoolVecEnv("CartPole-v1", N_ENVS)
    fns = [functools.partial(numbered_cartpole, i, render_mode) for i in range(N_ENVS)]
    if kind == "dummy":
        return DummyVecEnv(fns)  # type: ignore[arg-type]
    return BatchedSubprocVecEnv(fns, n_workers=int(kind.removeprefix("batched-")))  # type: ignore[arg-type]


@pytest.fixture
def make_venv():
    made: list[VecEnv] = []

    def make(kind: str, render_mode: str | None = None) -> VecEnv:
        made.append(build(kind, render_mode))
        return made[-1]

    yield make
    for venv in made:
        venv.close()


def random_actions(venv: VecEnv, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 2, venv.num_envs)


# --- reset and step ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_reset_and_step_return_sb3_shapes_and_dtypes(make_venv, kind):
    venv = make_venv(kind)
    space = venv.observation_space
    obs = venv.reset()
    assert obs.shape == (N_ENVS, *space.shape) and obs.dtype == space.dtype
    assert len(venv.reset_infos) == N_ENVS and all(isinstance(info, dict) for info in venv.reset_infos)
    obs, rewards, dones, infos = venv.step(random_actions(venv, np.random.default_rng(0)))
    assert obs.shape == (N_ENVS, *space.shape) and obs.dtype == space.dtype
    assert all(space.contains(o) for o in obs)
    assert rewards.shape == (N_ENVS,) and rewards.dtype == np.float32
    assert dones.shape == (N_ENVS,) and dones.dtype == bool
    assert len(infos) == N_ENVS and all(isinstance(info["TimeLimit.truncated"], bool) for info in infos)


@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_a_finished_env_starts_its_next_episode_in_the_same_step(make_venv, kind):
    venv = make_venv(kind)
    venv.reset()
    rng, finished = np.random.default_rng(0), 0
    for _ in range(100):
        obs, _, dones, infos = venv.step(random_actions(venv, rng))
        for i in np.flatnonzero(dones):
            terminal = infos[i]["terminal_observation"]
            assert terminal.shape == venv.observation_space.shape
            assert np.all(np.abs(obs[i]) <= 0.05)  # CartPole's start states, not the state that ended the episode
            assert not np.array_equal(terminal, obs[i])
            finished += 1
        assert all("terminal_observation" not in info for info, done in zip(infos, dones, strict=True) if not done)
    assert finished >= N_ENVS


@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_step_async_then_step_wait_is_step(make_venv, kind):
    venv = make_venv(kind)
    actions = np.ones(N_ENVS, dtype=np.int64)
    venv.seed(1)
    venv.reset()
    venv.step_async(actions)
    split = venv.step_wait()
    venv.seed(1)
    venv.reset()
    whole = venv.step(actions)
    assert np.array_equal(split[0], whole[0]) and np.array_equal(split[1], whole[1]) and np.array_equal(split[2], whole[2])


# --- seeds ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 2**31 - 1, 2**31, 3_000_000_000, 2**32 - 1])  # VecEnv.seed() draws up to 2**32
@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_any_sb3_seed_restarts_the_same_episodes(make_venv, kind, seed):
    venv = make_venv(kind)
    assert list(venv.seed(seed)) == [seed + i for i in range(N_ENVS)]
    first = venv.reset()
    for _ in range(5):
        venv.step(np.zeros(N_ENVS, dtype=np.int64))
    venv.seed(seed)
    assert np.array_equal(venv.reset(), first)


@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_different_seeds_start_different_episodes(make_venv, kind):
    venv = make_venv(kind)
    venv.seed(0)
    first = venv.reset()
    venv.seed(1000)
    assert not np.array_equal(venv.reset(), first)


# --- get_attr, set_attr, env_method, env_is_wrapped ----------------------------------------------------------

# SB3 indexes a Python list of envs: None is all, an int is one, negative ones count from the end.
INDICES = [
    pytest.param(None, [0, 1, 2], id="None"),
    pytest.param(1, [1], id="int"),
    pytest.param(-1, [2], id="negative"),
    pytest.param([0, 2], [0, 2], id="list"),
    pytest.param([2, -3], [2, 0], id="list-negative"),
    pytest.param(range(1, 3), [1, 2], id="range"),
]
OUT_OF_RANGE = [pytest.param(3, 3, id="int"), pytest.param(-4, -4, id="negative"), pytest.param([0, 3], 3, id="list")]


@pytest.mark.parametrize("indices, numbers", INDICES)
@pytest.mark.parametrize("kind", PYTHON_BACKENDS)
def test_get_attr_answers_for_the_indexed_envs_in_order(make_venv, kind, indices, numbers):
    assert make_venv(kind).get_attr("number", indices=indices) == numbers


@pytest.mark.parametrize("indices, numbers", INDICES)
@pytest.mark.parametrize("kind", PYTHON_BACKENDS)
def test_env_method_calls_the_indexed_envs_with_args_and_kwargs(make_venv, kind, indices, numbers):
    venv = make_venv(kind)
    assert venv.env_method("whoami", "!", indices=indices) == [f"{n}!" for n in numbers]
    assert venv.env_method("whoami", suffix="?", indices=indices) == [f"{n}?" for n in numbers]


@pytest.mark.parametrize("indices, numbers", INDICES)
@pytest.mark.parametrize("kind", PYTHON_BACKENDS)
def test_set_attr_changes_only_the_indexed_envs(make_venv, kind, indices, numbers):
    venv = make_venv(kind)
    venv.set_attr("number", 9, indices=indices)
    assert venv.get_attr("number") == [9 if i in numbers else i for i in range(N_ENVS)]


@pytest.mark.parametrize("indices, numbers", INDICES)
@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_env_is_wrapped_answers_for_the_indexed_envs(make_venv, kind, indices, numbers):
    venv = make_venv(kind)
    assert venv.env_is_wrapped(Monitor, indices=indices) == [True] * len(numbers)
    assert venv.env_is_wrapped(gym.wrappers.RecordVideo, indices=indices) == [False] * len(numbers)


@pytest.mark.parametrize("indices, bad", OUT_OF_RANGE)
@pytest.mark.parametrize("kind", PYTHON_BACKENDS)
def test_an_index_out_of_range_raises_before_any_env_changes(make_venv, kind, indices, bad):
    venv = make_venv(kind)
    message = "out of range" if kind == "dummy" else rf"env index {bad} is out of range for {N_ENVS} envs"
    with pytest.raises(IndexError, match=message):
        venv.set_attr("number", 9, indices=indices)
    with pytest.raises(IndexError, match=message):
        venv.env_method("whoami", indices=indices)
    assert venv.get_attr("number") == [0, 1, 2]
    venv.reset()  # still usable: no worker was left with an unanswered command
    venv.step(np.zeros(N_ENVS, dtype=np.int64))


@needs_envpool
@pytest.mark.parametrize("indices, numbers", INDICES)
def test_envpool_answers_render_mode_for_the_indexed_envs(make_venv, indices, numbers):
    assert make_venv("envpool").get_attr("render_mode", indices=indices) == [None] * len(numbers)


@needs_envpool
@pytest.mark.parametrize("indices, bad", OUT_OF_RANGE)
def test_envpool_refuses_an_index_out_of_range(make_venv, indices, bad):
    venv = make_venv("envpool")
    with pytest.raises(IndexError, match=rf"env index {bad} is out of range for {N_ENVS} envs"):
        venv.get_attr("render_mode", indices=indices)
    with pytest.raises(IndexError, match=rf"env index {bad} is out of range"):
        venv.env_is_wrapped(Monitor, indices=indices)


@needs_envpool
def test_envpool_says_its_cpp_envs_have_no_python_attributes(make_venv):
    venv = make_venv("envpool")
    with pytest.raises(AttributeError, match="no attribute 'number'"):
        venv.get_attr("number")
    with pytest.raises(AttributeError, match="cannot set 'number'"):
        venv.set_attr("number", 9)
    with pytest.raises(AttributeError, match="cannot call 'whoami'"):
        venv.env_method("whoami")


@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_has_attr_answers_without_raising(make_venv, kind):
    venv = make_venv(kind)
    assert venv.has_attr("render_mode") and not venv.has_attr("no_such_attribute")


# --- rendering and closing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", PYTHON_BACKENDS)
def test_get_images_gives_one_frame_per_env_in_rgb_array_mode(make_venv, kind):
    venv = make_venv(kind, render_mode="rgb_array")
    venv.reset()
    assert venv.render_mode == "rgb_array"
    frames = venv.get_images()
    assert len(frames) == N_ENVS and all(f.shape == (400, 600, 3) and f.dtype == np.uint8 for f in frames)
    assert venv.render().ndim == 3  # SB3 tiles the frames into one image


@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_get_images_without_rgb_array_warns_and_gives_none(make_venv, kind):
    venv = make_venv(kind)
    venv.reset()
    assert venv.render_mode is None
    with pytest.warns(UserWarning, match="render mode is None"):
        assert list(venv.get_images()) == [None] * N_ENVS


@pytest.mark.parametrize("kind", ALL_BACKENDS)
def test_close_twice_is_safe(kind):
    venv = build(kind)
    venv.reset()
    venv.close()
    venv.close()


@pytest.mark.parametrize("kind", PYTHON_BACKENDS)
def test_a_factory_that_returns_one_shared_env_is_refused(kind):
    shared = numbered_cartpole(0)
    # Distinct closures over one env, as make_vec_env(lambda: env) gives: one object stepped as four envs.
    fns = [lambda: shared for _ in range(4)]
    if kind == "dummy":
        with pytest.raises(ValueError, match="returned the same instance"):
            DummyVecEnv(fns)  # type: ignore[arg-type]
    else:
        message = r"env 1 \(worker 0\) raised ValueError: the env factory returned the same env object for envs 0 and 1; "
        with pytest.raises(EnvWorkerError, match=message + "return a new env on each call"):
            BatchedSubprocVecEnv(fns, n_workers=int(kind.removeprefix("batched-")))  # type: ignore[arg-type]


# --- EnvPool's episode statistics ----------------------------------------------------------------------------


def _games(venv: VecEnv, n_games: int) -> list[tuple[int, float, int]]:
    """(env, return, length) of the first ``n_games`` episodes that ``venv`` reports, under seeded random play."""
    venv.seed(0)
    venv.reset()
    rng, games = np.random.default_rng(0), []
    while len(games) < n_games:
        infos = venv.step(rng.integers(0, venv.action_space.n, venv.num_envs))[3]
        games += [(i, info["episode"]["r"], info["episode"]["l"]) for i, info in enumerate(infos) if "episode" in info]
    return games


def _breakout(n_envs: int) -> EnvPoolVecEnv:
    try:
        return EnvPoolVecEnv("ALE/Breakout-v5", n_envs, seed=0, is_atari=True)
    except Exception as e:  # an EnvPool build without its Atari games
        pytest.skip(f"EnvPool cannot make Breakout here ({type(e).__name__}: {e})")


@needs_envpool
def test_envpool_whole_game_statistics_survive_an_outer_vec_monitor():
    # Breakout has 5 lives: VecMonitor alone would report each life, with clipped rewards and agent steps.
    plain = _breakout(2)
    expected = _games(plain, 1)
    plain.close()
    with pytest.warns(UserWarning, match="already wrapped with a `Monitor`"):
        monitored = VecMonitor(_breakout(2))
    with pytest.warns(UserWarning, match="keeps its whole-game statistics"):
        assert _games(monitored, 1) == expected
    assert expected[0][2] > 200  # frames of a whole game (5 lives), not agent steps of one life
    monitored.close()


@needs_envpool
def test_envpool_episode_statistics_survive_copies_and_pickling():
    venv = EnvPoolVecEnv("CartPole-v1", 2, seed=0)
    venv.reset()
    while True:
        _, _, dones, infos = venv.step(np.zeros(2, dtype=np.int64))  # always left: episodes end in ~10 steps
        if dones.any():
            break
    venv.close()
    info = infos[int(np.flatnonzero(dones)[0])]
    episode = info["episode"]
    for again in (info.copy(), copy.deepcopy(info), pickle.loads(pickle.dumps(info))):
        assert again["episode"] == episode and again.keys() == info.keys()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info["terminal_observation"] = None  # other keys stay writable, as VecFrameStack and VecNormalize need
        info["episode"] = {"r": 0.0, "l": 1, "t": 0.0}
    assert info["episode"] == episode and info["terminal_observation"] is None


@needs_envpool
def test_envpool_atari_observations_match_sb3_atari_wrapper():
    pool = _breakout(2)
    reference = make_vec_env("ALE/Breakout-v5", 2, vec_env="dummy", seed=0)
    try:
        assert pool.observation_space == reference.observation_space and pool.action_space == reference.action_space
        for venv in (pool, reference):
            obs = venv.reset()
            assert obs.shape == (2, 84, 84, 1) and obs.dtype == np.uint8
            obs, rewards, dones, _ = venv.step(np.ones(2, dtype=np.int64))
            assert obs.shape == (2, 84, 84, 1) and rewards.dtype == np.float32 and dones.dtype == bool
    finally:
        pool.close()
        reference.close()


@needs_envpool
def test_envpool_atari_frames_stay_channel_first_and_match_the_transposed_dummy_stack():
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecTransposeImage, is_vecenv_wrapped

    try:
        pool = make_vec_env("ALE/Breakout-v5", 2, vec_env="envpool", seed=0, frame_stack=4)
    except Exception as e:  # an EnvPool build without its Atari games
        pytest.skip(f"EnvPool cannot make Breakout here ({type(e).__name__}: {e})")
    reference = make_vec_env("ALE/Breakout-v5", 2, vec_env="dummy", seed=0, frame_stack=4)
    try:
        models = [PPO("CnnPolicy", venv, n_steps=8, batch_size=16, device="cpu") for venv in (pool, reference)]
        # SB3 takes EnvPool's stack as it is and transposes the dummy one: the policy sees one layout from both.
        assert not is_vecenv_wrapped(models[0].get_env(), VecTransposeImage)
        assert is_vecenv_wrapped(models[1].get_env(), VecTransposeImage)
        assert models[0].observation_space == models[1].observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        for model in models:
            obs = model.get_env().reset()
            assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
            assert not obs[:, :3].any() and obs[:, 3].any()  # zeros before the first frame, which is the newest
            obs = model.get_env().step(np.ones(2, dtype=np.int64))[0]
            assert not obs[:, :2].any() and obs[:, 2:].any(axis=(2, 3)).all()  # one frame more
        assert models[0].get_env().reset().flags.c_contiguous  # one block: one copy to the device
    finally:
        pool.close()
        reference.close()
