from __future__ import annotations

import dataclasses
import io
import re

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import DQN, PPO
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

from sb3_gpu import make_model, make_plan
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.io import write_yaml
from sb3_gpu.config.presets import resolve_preset
from sb3_gpu.config.runconfig import load_config
from sb3_gpu.config.schema import get_algo, validate_entry
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.table import plan_table
from tests.envs.test_envs import cartpole


def test_plan_for_cartpole_ppo_uses_its_entry_and_the_cpu(cpu_machine, monkeypatch):
    monkeypatch.setattr("sb3_gpu.envs.choice.envpool_available", lambda: False)
    monkeypatch.setattr("sb3_gpu.planning.plan.measure_step_seconds", lambda env: 20e-6)  # CartPole's, on a quiet machine
    plan = make_plan("ppo", "CartPole-v1", hardware=cpu_machine)
    assert plan.preset.entry == "ppo.yaml:CartPole-v1"
    assert plan.device.device == "cpu" and plan.preset.profile == "cpu"
    assert plan.preset.n_envs == 8 and plan.preset.params.n_steps == 32
    assert plan.vec_env == "dummy" and "env step" in plan.vec_env_reason


def test_plan_takes_envpool_where_installed_and_says_why(cpu_machine, monkeypatch):
    monkeypatch.setattr("sb3_gpu.envs.choice.envpool_available", lambda: True)
    monkeypatch.setattr("sb3_gpu.planning.plan.measure_step_seconds", lambda env: 100e-6)  # 32 x 100 us: 3.2 ms a step
    plan = make_plan("ppo", "LunarLander-v3", hardware=cpu_machine, n_envs=32)
    assert plan.vec_env == "envpool" and "EnvPool" in plan.vec_env_reason
    assert make_plan("ppo", cartpole, hardware=cpu_machine).vec_env != "envpool"  # a factory: EnvPool never applies


def test_on_policy_mlp_stays_on_cpu_with_a_gpu_present(gpu_machine):
    plan = make_plan("ppo", "Pendulum-v1", hardware=gpu_machine)
    assert plan.device.device == "cpu" and plan.preset.profile == "cpu"
    assert plan.preset.params.batch_size == 64 and plan.preset.net_arch == [128, 128]


def test_off_policy_takes_the_gpu_profile_on_a_gpu_machine(gpu_machine):
    plan = make_plan("dqn", "Acrobot-v1", hardware=gpu_machine)
    assert plan.device.device == "cuda:0" and plan.preset.profile == "gpu"
    assert "off-policy" in plan.device.reason


def test_unknown_env_takes_the_default_entry_and_its_gpu_profile(gpu_machine):
    plan = make_plan("dqn", "gymnasium.envs.classic_control.acrobot:AcrobotEnv", hardware=gpu_machine)
    assert plan.preset.entry == "dqn.yaml:default"
    assert (plan.preset.params.batch_size, plan.preset.params.buffer_size, plan.preset.net_arch) == (
        128,
        50_000,
        [256, 256, 256],
    )
    assert plan.preset.sources["batch_size"] == "dqn.yaml:default/gpu"


def test_atari_takes_the_cnn_policy_and_the_gpu_when_there_is_one(gpu_machine):
    plan = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine)
    assert plan.preset.policy == "CnnPolicy" and plan.device.device == "cuda:0"
    assert plan.preset.n_envs == 16 and plan.preset.frame_stack == 4
    assert "CNN" in plan.device.reason


def test_auto_policy_follows_the_observation_space(cpu_machine):
    plan = make_plan("ppo", "Pendulum-v1", hardware=cpu_machine)
    assert plan.preset.policy == "MlpPolicy" and plan.preset.sources["policy"] == "auto (observation space)"


def test_overrides_and_cli_counts_win_with_their_sources(cpu_machine):
    plan = make_plan(
        "ppo",
        "CartPole-v1",
        n_envs=2,
        n_timesteps=500,
        hardware=cpu_machine,
        overrides={"batch_size": 16},
        override_source="--set",
    )
    assert (plan.preset.n_envs, plan.preset.n_timesteps, plan.preset.params.batch_size) == (2, 500, 16)
    assert plan.preset.sources["n_envs"] == "n_envs=" and plan.preset.sources["batch_size"] == "--set"  # named as given


def test_dqn_refuses_continuous_actions(cpu_machine):
    with pytest.raises(ConfigError, match="dqn needs a Discrete action space; Pendulum-v1 has Box"):
        make_plan("dqn", "Pendulum-v1", hardware=cpu_machine)


@pytest.mark.parametrize(
    "algo, env, overrides, message",
    [
        ("ppo", "Blackjack-v1", None, "SB3's policies cannot take Blackjack-v1's observation space Tuple(Discrete(32)"),
        ("dqn", "FrozenLake-v1", {"frame_stack": 4}, "frame_stack stacks Box or Dict observations; FrozenLake-v1 has"),
        # SB3 refuses these only when it builds the model, naming its feature extractor and the Box's every bound.
        (
            "ppo",
            "CartPole-v1",
            {"policy": "CnnPolicy"},
            "policy=CnnPolicy (override) takes images, a Box of shape (height, width, channels) or (channels, height, "
            "width); the observations are a Box of shape (4,), float32: use MlpPolicy, or leave policy auto",
        ),
        (
            "dqn",
            "CartPole-v1",
            {"policy": "MultiInputPolicy"},
            "policy=MultiInputPolicy (override) does not take a Box of shape (4,), float32; use MlpPolicy or CnnPolicy",
        ),
    ],
)
def test_observations_sb3_cannot_take_are_refused_by_the_plan(cpu_machine, algo, env, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan(algo, env, hardware=cpu_machine, overrides=overrides)


class _Spaces(gym.Env):
    """An env of the observation space it is given (and two actions)."""

    def __init__(self, observation_space: gym.spaces.Space, action_space: gym.spaces.Space | None = None):
        self.observation_space, self.action_space = observation_space, action_space or gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


SMALL_IMAGE = gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)


def test_images_too_small_for_nature_cnn_get_mlp_policy_and_train(cpu_machine):
    plan = make_plan(
        "ppo", lambda: _Spaces(SMALL_IMAGE), hardware=cpu_machine, overrides={"n_steps": 32, "n_envs": 1, "batch_size": 32}
    )
    assert plan.preset.policy == "MlpPolicy"  # SB3's NatureCNN: "Kernel size can't be greater than actual input size"
    assert plan.preset.sources["policy"] == "auto (observation space: 16x16 images, too small for CnnPolicy's NatureCNN)"
    build_model(plan, build_env(plan)).learn(64)
    big = gym.spaces.Box(0, 255, (3, 36, 36), np.uint8)  # channels first, and as small as NatureCNN takes
    assert make_plan("ppo", lambda: _Spaces(big), hardware=cpu_machine).preset.policy == "CnnPolicy"


@pytest.mark.parametrize(
    "observations, actions, message",
    [
        (gym.spaces.Box(-1, 1, ()), None, "SB3's policies take a Box of one dimension or more, none of size 0; "),
        (gym.spaces.Dict({"x": gym.spaces.Box(-1, 1, (0,))}), None, "has the Dict's 'x' of shape (0,): give it a shape"),
        (
            gym.spaces.Box(-1, 1, (2,)),
            gym.spaces.MultiBinary([2, 2]),
            "SB3's policies take MultiBinary actions of one dimension; <lambda> has MultiBinary((2, 2)): flatten them",
        ),
        (gym.spaces.Box(-1, 1, (2,)), gym.spaces.MultiDiscrete([[2, 3], [2, 2]]), "take MultiDiscrete actions of one"),
        # PPO was offered for them ("for it: ppo"), and the plan printed; SB3 refused them as the model was built.
        (
            gym.spaces.Box(-1, 1, (2,)),
            gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))),
            "ppo needs a Box, Discrete, MultiDiscrete or MultiBinary action space; <lambda> has Tuple(Discrete(2), "
            "Discrete(3)) (no SB3 algorithm takes it: a gymnasium.ActionWrapper can map",
        ),
        (gym.spaces.Box(-1, 1, (2,)), gym.spaces.Dict({"a": gym.spaces.Discrete(2)}), "ppo needs a Box, Discrete, Mul"),
        # SB3's policies act 0..n-1 whatever the start: the env got actions outside its space, and a DQN trained on
        # without a word where SB3's own failed (sb3_gpu's loss matches actions by mask, not by index).
        (
            gym.spaces.Box(-1, 1, (2,)),
            gym.spaces.Discrete(3, start=1),
            "SB3 numbers Discrete and MultiDiscrete choices from 0; <lambda> has actions Discrete(3, start=1): shift them "
            "to start at 0 (a gymnasium.ActionWrapper)",
        ),
        (gym.spaces.Discrete(4, start=-2), None, "has its observations of Discrete(4, start=-2): shift them to start at 0"),
        (gym.spaces.Dict({"x": gym.spaces.MultiDiscrete([2, 3], start=[0, 1])}), None, "has the Dict's 'x' of MultiDisc"),
    ],
)
def test_spaces_that_sb3s_policies_cannot_build_on_are_refused_by_the_plan(cpu_machine, observations, actions, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan("ppo", lambda: _Spaces(observations, actions), hardware=cpu_machine)


@pytest.mark.parametrize(
    "space, overrides, message",
    [
        (
            SMALL_IMAGE,
            {"policy": "CnnPolicy"},
            "policy=CnnPolicy (override) runs NatureCNN, which needs images of at "
            "least 36x36 pixels; the observations are 16x16: use MlpPolicy, leave policy auto, or pass policy_kwargs",
        ),
        (
            gym.spaces.Dict({"img": SMALL_IMAGE}),
            None,
            "MultiInputPolicy runs NatureCNN, which needs images of at least "
            "36x36 pixels, on the Dict's image 'img', which is 16x16: make that key's dtype float",
        ),
        (
            gym.spaces.Discrete(5),
            {"normalize": True},
            "normalize (override) scales Box observations; the observations "
            "are Discrete(5): set normalize.norm_obs=false (rewards only), or normalize=false",
        ),
        (
            gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,)), "b": gym.spaces.Discrete(4)}),
            {"normalize": True},
            "normalize (override) scales Box observations; the Dict's 'b' is Discrete(4): set "
            "normalize.norm_obs_keys=['a'] (the Dict's Box keys), or normalize.norm_obs=false (rewards only)",
        ),
        (
            gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,)), "b": gym.spaces.Discrete(4)}),
            {"normalize": {"norm_obs_keys": ["po"]}},
            "normalize.norm_obs_keys (override): the observations have no key 'po'; did you mean 'pos'? (keys: b, pos)",
        ),
        (
            gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,)), "b": gym.spaces.Discrete(4)}),
            {"normalize": {"norm_obs_keys": ["a", "b"]}},
            "normalize (override) scales Box observations; the Dict's 'b' is Discrete(4): set normalize.norm_obs_keys=['a']",
        ),
        (
            gym.spaces.Box(-1, 1, (2,)),
            {"normalize": {"norm_obs_keys": ["a"]}},
            "normalize.norm_obs_keys (override) names keys of a Dict observation, but these observations are a Box of ",
        ),
        (
            gym.spaces.Box(0, 255, (128,), np.uint8),  # Atari's RAM: VecNormalize keeps its space, the buffer its dtype
            {"normalize": True},
            "normalize (override) scales the observations into floats, which ppo's rollout buffer would store as their "
            "uint8: give the env float32 observations (gymnasium.wrappers.DtypeObservation), or set normalize.norm_obs",
        ),
        (
            gym.spaces.Dict({"count": gym.spaces.Box(0, 9, (2,), np.int64), "pos": gym.spaces.Box(-1, 1, (2,))}),
            {"normalize": True},
            "normalize (override) scales the Dict's 'count' into floats, which ppo's rollout buffer would store as their "
            "int64",
        ),
        (
            gym.spaces.Box(0, 255, (40, 40, 3), np.uint8),
            {"normalize": {"clip_obs": 5.0}},
            "normalize (override) would turn the channel-last images into floats, which SB3 then no longer moves",
        ),
        (
            gym.spaces.Box(0, 255, (3, 40, 40), np.uint8),
            {"normalize": True},
            "normalize (override) would turn the images into floats, which CnnPolicy's NatureCNN takes only with "
            "policy_kwargs normalize_images=false: set it, or set normalize.norm_obs=false",
        ),
    ],
)
def test_what_sb3_refuses_only_as_it_builds_the_envs_or_model_the_plan_refuses(cpu_machine, space, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan("ppo", lambda: _Spaces(space), hardware=cpu_machine, overrides=overrides)
    if overrides and "normalize" in overrides:  # its observations kept as they are, the rewards still normalised
        rewards_only = {**overrides, "normalize": {"norm_obs": False}}
        make_plan("ppo", lambda: _Spaces(space), hardware=cpu_machine, overrides=rewards_only)


class _Extractor(BaseFeaturesExtractor):
    def __init__(self, observation_space):
        super().__init__(observation_space, features_dim=8)
        self.linear = th.nn.Linear(int(np.prod(observation_space.shape)), 8)

    def forward(self, observations):
        return self.linear(observations.flatten(1).float())


@pytest.mark.parametrize(
    "space, overrides",
    [
        (gym.spaces.Box(0, 255, (3, 40, 40), np.uint8), {"policy_kwargs": {"normalize_images": False}}),  # SB3's advice
        (gym.spaces.Box(0, 255, (40, 40, 3), np.uint8), {"policy_kwargs": {"features_extractor_class": _Extractor}}),
        (gym.spaces.Dict({"img": SMALL_IMAGE}), {}),  # floats once normalised: flattened, no NatureCNN
    ],
    ids=["channels-first-normalised", "own-extractor", "dict-small-image"],
)
def test_normalised_images_that_sb3_trains_on_are_planned_built_and_trained(cpu_machine, space, overrides):
    small = {"n_steps": 16, "batch_size": 16, "n_envs": 1, "normalize": True, **overrides}
    policy = "MultiInputPolicy" if isinstance(space, gym.spaces.Dict) else "CnnPolicy"
    plan = make_plan("ppo", lambda: _Spaces(space), hardware=cpu_machine, overrides={**small, "policy": policy})
    build_model(plan, build_env(plan)).learn(32)


LAST = gym.spaces.Box(0, 255, (40, 40, 3), np.uint8)  # channel-last images
VECTOR = gym.spaces.Box(-1, 1, (2,), np.float32)


@pytest.mark.parametrize(
    "space, normalize, left",
    [
        (LAST, {"norm_obs": False}, "the observations"),
        (gym.spaces.Dict({"img": LAST}), {"norm_obs": False}, "the Dict's 'img'"),
        (gym.spaces.Dict({"img": LAST, "pos": VECTOR}), {"norm_obs_keys": ["pos"]}, "the Dict's 'img'"),
    ],
    ids=["box-rewards-only", "dict-rewards-only", "dict-image-left-out"],
)
def test_off_policy_normalisation_that_leaves_channel_last_images_is_refused_as_sb3_cannot_store_them(
    cpu_machine, space, normalize, left
):
    # SB3's off-policy _store_transition takes VecNormalize's original observations, channel-last, into a buffer of
    # the channel-first ones VecTransposeImage gives the model: a broadcasting error at the first step.
    small = {"learning_starts": 8, "buffer_size": 64, "n_envs": 1}
    message = f"normalize (override) leaves {left} channel-last images, which dqn cannot store"
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan("dqn", lambda: _Spaces(space), hardware=cpu_machine, overrides={**small, "normalize": normalize})
    make_plan("ppo", lambda: _Spaces(space), hardware=cpu_machine, overrides={"normalize": normalize})


@pytest.mark.parametrize(
    "space, normalize",
    [
        (gym.spaces.Box(0, 255, (3, 40, 40), np.uint8), {"norm_obs": False}),  # stored as the model sees them
        (LAST, True),  # scaled into float32: no image left to move, nothing moved
        (gym.spaces.Dict({"img": SMALL_IMAGE, "pos": VECTOR}), True),  # the same, per key
    ],
    ids=["channel-first", "box-scaled", "dict-scaled"],
)
def test_off_policy_normalisation_that_leaves_no_channel_last_image_is_planned_and_trains(cpu_machine, space, normalize):
    overrides = {"learning_starts": 8, "buffer_size": 64, "n_envs": 1, "normalize": normalize}
    if space is LAST:
        overrides["policy"] = "MlpPolicy"  # NatureCNN takes no float channel-last images: refused on its own
    plan = make_plan("dqn", lambda: _Spaces(space), hardware=cpu_machine, overrides=overrides)
    build_model(plan, build_env(plan)).learn(16)


def test_a_dict_whose_box_keys_are_named_is_normalised_there_only_as_vecnormalize_does(cpu_machine, tmp_path):
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_gpu.runs.video import _normalized

    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,)), "mode": gym.spaces.Discrete(3)})
    overrides = {"n_steps": 16, "batch_size": 16, "n_envs": 1, "normalize": {"norm_obs_keys": ["pos"], "epsilon": 1e-6}}
    plan = make_plan("ppo", lambda: _Spaces(space), hardware=cpu_machine, overrides=overrides)
    model = build_model(plan, build_env(plan))
    model.learn(32)
    norm = model.get_vec_normalize_env()
    assert isinstance(norm, VecNormalize) and norm.norm_obs_keys == ["pos"] and norm.epsilon == 1e-6
    assert set(norm.obs_rms) == {"pos"}
    frozen = _normalized(build_env(plan, evaluation=True), norm)  # a video's env: the same keys, frozen
    assert frozen.norm_obs_keys == ["pos"] and frozen.obs_rms is norm.obs_rms


def test_unknown_algorithm_suggests_one():
    with pytest.raises(ConfigError, match="unknown algorithm 'ppo2'; did you mean 'ppo'"):
        make_plan("ppo2", "CartPole-v1")


def test_cuda_request_without_a_gpu_fails_before_anything_is_built(cpu_machine):
    with pytest.raises(ConfigError, match="CUDA GPU"):
        make_plan("ppo", "CartPole-v1", "cuda", hardware=cpu_machine)


def test_plan_table_lists_decisions_and_every_hyperparameter(cpu_machine):
    plan = make_plan("dqn", "CartPole-v1", hardware=cpu_machine)
    table = plan_table(plan)
    settings = [str(cell) for cell in table.columns[0].cells]  # plain Text cells
    assert {"hardware", "device", "vec_env", "batch_size", "target_update_interval", "n_timesteps"} <= set(settings)


@pytest.mark.parametrize(
    ("algo", "env", "overrides"),
    [
        ("ppo", "CartPole-v1", {}),  # two tanh heads
        ("dqn", "CartPole-v1", {"net_arch": None}),
        ("td3", "Pendulum-v1", {"net_arch": None}),  # [400, 300], unlike SAC's and TQC's [256, 256]
        ("tqc", "Pendulum-v1", {"net_arch": None, "critic_layer_norm": True}),
        ("qrdqn", "CartPole-v1", {"net_arch": None}),
        ("sac", "Pendulum-v1", {"net_arch": None}),
        ("ppo", "ALE/Pong-v5", {"activation_fn": "relu"}),  # NatureCNN's features feed the heads
    ],
)
def test_the_table_shows_the_network_sb3_builds_where_the_preset_sets_none(cpu_machine, algo, env, overrides):
    fit = {"n_envs": 1, "n_timesteps": 4096, "probe": False}
    th.manual_seed(0)
    expected = th.rand(1)
    th.manual_seed(0)
    plan = make_plan(algo, env, hardware=cpu_machine, vec_env="dummy", overrides={**fit, **overrides})
    assert th.equal(th.rand(1), expected)  # the plan's look at the policy drew none of the caller's random numbers
    model = build_model(plan, build_env(plan))
    table = plan_table(plan)
    rows = dict(zip(map(str, table.columns[0].cells), map(str, table.columns[1].cells), strict=True))
    if plan.preset.net_arch is None:
        assert rows["net_arch"] == f"SB3 default: {model.policy.net_arch}"
    activation = "relu" if model.policy.activation_fn is th.nn.ReLU else "tanh"
    assert model.policy.activation_fn in (th.nn.ReLU, th.nn.Tanh)
    assert rows["activation_fn"] == (activation if plan.preset.activation_fn else f"SB3 default: {activation}")
    model.env.close()


def test_the_plans_look_at_the_policy_builds_no_set_layers_and_a_policy_it_cannot_build_shows_less(cpu_machine, monkeypatch):
    from sb3_gpu.planning import plan as planning

    built = []
    monkeypatch.setattr(planning, "_no_optimizer", lambda params, **kwargs: built.append(sum(p.numel() for p in params)))
    wide = {"net_arch": [4096, 4096, 4096], "probe": False}  # only the activation is read: SB3's default relu
    plan = make_plan("td3", "Pendulum-v1", hardware=cpu_machine, vec_env="dummy", overrides=wide)
    assert plan.sb3_network == ([], "relu") and built and max(built) < 1_000

    def cannot(*args, **kwargs):
        raise RuntimeError("a features extractor that fails here")

    monkeypatch.setattr(planning, "_no_optimizer", cannot)
    plan = make_plan("ppo", "CartPole-v1", hardware=cpu_machine, vec_env="dummy", overrides={"probe": False})
    rows = dict(zip(map(str, plan_table(plan).columns[0].cells), map(str, plan_table(plan).columns[1].cells), strict=True))
    assert plan.sb3_network is None and rows["net_arch"] == rows["activation_fn"] == "SB3 default"


def test_the_table_shows_the_evaluation_interval_a_run_takes_not_none(cpu_machine):
    def eval_freq_row(overrides: dict) -> tuple[str, str]:
        table = plan_table(make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides=overrides))
        i = [str(cell) for cell in table.columns[0].cells].index("eval_freq")
        return str(list(table.columns[1].cells)[i]), str(list(table.columns[2].cells)[i])

    assert eval_freq_row({"n_timesteps": 2000}) == ("200", "a tenth of n_timesteps (sb3_gpu default)")
    assert eval_freq_row({"n_timesteps": 2000, "eval_freq": 500, "n_envs": 4}) == ("500", "override")
    # EvalCallback counts steps of the vec env: the row showed 409 above an evaluation line that said every 408.
    assert eval_freq_row({"n_timesteps": 4096, "n_envs": 8}) == (
        "408",
        "a tenth of n_timesteps (sb3_gpu default); 409 rounded to whole steps of 8 envs",
    )
    assert eval_freq_row({"n_envs": 8, "eval_freq": 4}) == ("8", "override; 4 rounded to whole steps of 8 envs")


def test_on_a_narrow_console_the_reasons_take_the_room_and_no_setting_name_wraps(cpu_machine):
    from rich.console import Console

    plan = make_plan("dqn", "CartPole-v1", hardware=cpu_machine)

    def lines(width: int, told: bool) -> list[str]:
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(plan_table(plan, console.width if told else None))
        return console.export_text().splitlines()

    def names(rendered: list[str]) -> list[str]:
        return [line.split("│")[1].strip() for line in rendered if line.startswith("│") and line.split("│")[1].strip()]

    narrow, as_before = lines(80, True), lines(80, False)
    assert len(narrow) < len(as_before) and max(map(len, narrow)) <= 80
    header = next(line for line in narrow if "why / source" in line)
    assert len(header.split("┃")[3]) > len(header.split("┃")[2])  # the reasons' column is the wider one
    settings = [str(cell) for cell in plan_table(plan).columns[0].cells]
    assert names(narrow) == settings  # each name whole, on one line
    assert lines(200, True) == lines(200, False)  # a wide console: as it was
    assert lines(50, True) == lines(50, False)  # too narrow for whole names: as it was too


def test_the_table_warns_where_learning_would_never_start(cpu_machine):
    def learning_starts_row(timesteps: int) -> tuple[str, str | None]:
        plan = make_plan("dqn", "CartPole-v1", hardware=cpu_machine, overrides={"n_timesteps": timesteps})
        table = plan_table(plan)
        i = [str(cell) for cell in table.columns[0].cells].index("learning_starts")
        return str(list(table.columns[2].cells)[i]), table.rows[i].style

    starts = make_plan("dqn", "CartPole-v1", hardware=cpu_machine).preset.params.learning_starts
    why, style = learning_starts_row(starts)
    assert f"warning: not below n_timesteps ({starts:,}): no gradient step" in why and style == "yellow"
    why, style = learning_starts_row(starts + 1)
    assert "warning" not in why and style is None


def test_the_table_says_where_a_run_trains_past_n_timesteps(cpu_machine):
    def row(algo: str, env: str, **overrides: object) -> str:
        table = plan_table(make_plan(algo, env, hardware=cpu_machine, overrides={"n_timesteps": 300, **overrides}))
        i = [str(cell) for cell in table.columns[0].cells].index("n_timesteps")
        return str(list(table.columns[2].cells)[i])

    assert "SB3 completes the episodes of each train_freq" in row("td3", "Pendulum-v1", train_freq=[1, "episode"])
    assert "past" not in row("td3", "Pendulum-v1", train_freq=[4, "step"]) and "past" not in row("td3", "Pendulum-v1")
    assert "trains 512: SB3 completes each rollout" in row("ppo", "CartPole-v1", n_steps=32, n_envs=8, batch_size=64)
    # Off-policy collection runs whole train_freq blocks too: 16 vec steps of 8 envs trained 3,072 for 3,000.
    assert "trains 384: SB3 completes each train_freq of vec steps * n_envs" in row(
        "dqn", "CartPole-v1", train_freq=16, n_envs=8
    )


@pytest.mark.parametrize(
    ("algo", "overrides", "trained"),
    [
        ("dqn", {"train_freq": 3, "n_envs": 4, "learning_starts": 10_000}, 60),
        ("dqn", {"train_freq": [5, "step"], "n_envs": 2, "learning_starts": 10_000}, 50),
        ("ppo", {"n_steps": 16, "n_envs": 2, "batch_size": 32}, 64),
    ],
)
def test_a_run_trains_the_timesteps_the_plan_says(cpu_machine, algo, overrides, trained):
    plan = make_plan(algo, "CartPole-v1", hardware=cpu_machine, overrides={"n_timesteps": 50, **overrides})
    assert plan.preset.timesteps_trained == trained
    model = build_model(plan, build_env(plan))
    model.learn(plan.preset.n_timesteps)
    assert model.num_timesteps == trained


def test_a_batch_larger_than_what_it_is_drawn_from_is_refused_or_flagged(cpu_machine):
    with pytest.raises(ConfigError, match=r"^batch_size \(2,000\) is more than buffer_size \(1,000\): every batch"):
        make_plan("dqn", "CartPole-v1", hardware=cpu_machine, overrides={"batch_size": 2000, "buffer_size": 1000})
    # PPO's minibatch is then the whole rollout: allowed (a study may draw it), and flagged in the table.
    plan = make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides={"n_steps": 16, "n_envs": 4, "batch_size": 128})
    table = plan_table(plan)
    i = [str(cell) for cell in table.columns[0].cells].index("batch_size")
    assert "warning: more than one rollout (64): each minibatch is the whole rollout" in str(list(table.columns[2].cells)[i])
    assert table.rows[i].style == "yellow"
    # A batch that does not divide the rollout leaves a short minibatch at the end of each epoch: flagged too.
    plan = make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides={"n_steps": 16, "n_envs": 4, "batch_size": 7})
    table = plan_table(plan)
    assert "warning: not a factor of the rollout: each epoch ends on a minibatch of 1" in str(list(table.columns[2].cells)[i])
    assert table.rows[i].style == "yellow"


def test_host_memory_bounds_a_replay_buffer_only_where_it_lives_on_the_host(cpu_machine, gpu_machine, monkeypatch):
    import psutil

    small = psutil.virtual_memory()._replace(available=2**20)  # 1 MiB free: a million CartPole transitions do not fit
    monkeypatch.setattr(psutil, "virtual_memory", lambda: small)
    big = {"buffer_size": 1_000_000}
    with pytest.raises(ConfigError, match=r"^buffer_size=1,000,000 needs 49.6 MiB of memory for its transitions"):
        make_plan("dqn", "CartPole-v1", "cpu", overrides={**big, "probe": False})  # this machine: its free memory
    # A what-if machine: its own RAM, not this one's free memory.
    tiny_ram = dataclasses.replace(cpu_machine, ram_gb=0.01)
    with pytest.raises(ConfigError, match=r"needs 49.6 MiB of memory for its transitions \(observation and next obse"):
        make_plan("dqn", "CartPole-v1", hardware=tiny_ram, overrides=big)
    assert make_plan("dqn", "CartPole-v1", hardware=cpu_machine, overrides=big).preset.params.buffer_size == 1_000_000
    small_gpu = dataclasses.replace(gpu_machine, ram_gb=0.01)
    with pytest.raises(ConfigError, match="MiB of memory for its transitions"):  # SB3's host buffer beside a GPU
        make_plan("dqn", "CartPole-v1", hardware=small_gpu, overrides={**big, "device_buffers": False})
    plan = make_plan("dqn", "CartPole-v1", hardware=small_gpu, overrides=big)  # on the GPU, which it checks itself
    assert plan.buffers == "device" and plan.device.device == "cuda:0"


def test_a_buffer_leaves_a_fifth_of_the_memory_to_the_rest_of_the_run_and_ppos_rollout_is_checked_too(cpu_machine):
    from sb3_gpu.planning.plan import HOST_MEMORY_SHARE

    per_transition = make_plan("dqn", "CartPole-v1", hardware=cpu_machine).buffers_reason  # its size is shown
    assert per_transition.startswith("SB3's buffers (") and " in host memory): " in per_transition
    big = {"buffer_size": 1_000_000}
    shown = make_plan("dqn", "CartPole-v1", hardware=cpu_machine, overrides=big).buffers_reason
    needed = 2**20 * float(re.search(r"\(([\d.]+) MiB in host memory\)", shown).group(1))  # 49.6 MiB
    # The OOM killer ends a run whose buffer fills past the memory, hours in and unsaved: 90% is refused, 75% is not.
    crowded = dataclasses.replace(cpu_machine, ram_gb=needed / 0.9 / 2**30)
    refused = r"^buffer_size=1,000,000 needs 49.6 MiB of memory for its transitions .*, more than 80% of the 55.1 MiB of RAM "
    with pytest.raises(ConfigError, match=refused + r"given \(the networks, envs and evaluations need the rest\)"):
        make_plan("dqn", "CartPole-v1", hardware=crowded, overrides=big)
    roomy = dataclasses.replace(cpu_machine, ram_gb=needed / 0.75 / 2**30)
    assert make_plan("dqn", "CartPole-v1", hardware=roomy, overrides=big).preset.params.buffer_size == 1_000_000
    assert HOST_MEMORY_SHARE == 0.8
    # PPO's rollout on the host: 8 envs * 2**20 steps of CartPole (about 0.5 GiB) on 0.25 GiB of RAM.
    rollout = {"n_steps": 2**20, "n_envs": 8, "batch_size": 2**20, "n_timesteps": 2**24}
    with pytest.raises(
        ConfigError,
        match=r"^a rollout of n_steps \* n_envs = 1,048,576 \* 8 steps needs .* of memory for "
        r"its observations \(twice while SB3 flattens them for sampling\), .*: lower n_steps or n_envs$",
    ):
        make_plan("ppo", "CartPole-v1", hardware=dataclasses.replace(cpu_machine, ram_gb=0.25), overrides=rollout)
    assert make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides=rollout).preset.params.n_steps == 2**20
    # SB3 flattens the envs of a rollout for sampling with a copy of its observations (about 0.2 GiB more here): with
    # 0.7 GiB the rollout alone would fit, not the two together. One env, or the device buffer (which samples the
    # storage as it lies), makes no copy.
    tight = dataclasses.replace(cpu_machine, ram_gb=0.7)
    with pytest.raises(ConfigError, match=r"its observations \(twice while SB3 flattens them for sampling\), more than"):
        make_plan("ppo", "CartPole-v1", hardware=tight, overrides=rollout)
    one_env = {**rollout, "n_steps": 2**23, "n_envs": 1}
    assert make_plan("ppo", "CartPole-v1", hardware=tight, overrides=one_env).preset.params.n_steps == 2**23
    on_device = make_plan("ppo", "CartPole-v1", hardware=tight, overrides={**rollout, "device_buffers": True})
    assert on_device.buffers == "device"


def test_a_device_buffer_stays_on_the_host_where_other_processes_hold_the_gpus_memory(gpu_machine, monkeypatch):
    from sb3_gpu.planning import plan as planning

    # This machine, seen as a GPU machine whose cuda:0 another process has filled but for 2 GiB.
    monkeypatch.setattr(planning, "detect_hardware", lambda: gpu_machine)
    monkeypatch.setattr(planning, "gpu_free_bytes", lambda index: 2 * 2**30)
    crowd = {"buffer_size": 1_000_000, "probe": False}  # 49.6 MiB: 2 GiB free holds it
    assert make_plan("dqn", "CartPole-v1", "cuda", overrides=crowd).buffers == "device"
    # The buffer may take 80% of what is free, no more: the networks and their activations need the rest.
    monkeypatch.setattr(planning, "gpu_free_bytes", lambda index: 64 * 2**20)  # 78% of it
    assert make_plan("dqn", "CartPole-v1", "cuda", overrides=crowd).buffers == "device"
    monkeypatch.setattr(planning, "gpu_free_bytes", lambda index: 55 * 2**20)  # 90% of it
    assert make_plan("dqn", "CartPole-v1", "cuda", overrides=crowd).buffers == "host"
    monkeypatch.setattr(planning, "gpu_free_bytes", lambda index: 2**25)  # 32 MiB free
    plan = make_plan("dqn", "CartPole-v1", "cuda", overrides=crowd)
    assert plan.buffers == "host" and plan.device.device == "cuda:0"
    assert re.search(
        r"would take more than 80% of the 32.0 MiB free on .* \(of .* GiB in all\)",
        plan.buffers_reason,
    ), plan.buffers_reason
    # A what-if GPU is taken as empty: nothing on it can be asked.
    assert make_plan("dqn", "CartPole-v1", hardware=gpu_machine, overrides=crowd).buffers == "device"


def test_a_device_buffer_that_would_crowd_the_gpu_stays_on_the_host(gpu_machine):
    from sb3_gpu.common.hardware import GPUInfo

    small = dataclasses.replace(gpu_machine, gpus=(GPUInfo(0, "Fake T4", 4.0, (7, 5)),), ram_gb=512.0)
    huge = {"buffer_size": 100_000_000}  # about 5 GiB of CartPole transitions: over 80% of the GPU's 4 GiB
    plan = make_plan("dqn", "CartPole-v1", hardware=small, overrides=huge)
    assert plan.device.device == "cuda:0" and plan.buffers == "host"
    assert "would take more than 80% of the 4.0 GiB on Fake T4, which the networks and their activations need" in (
        plan.buffers_reason
    )
    with pytest.raises(ConfigError, match=r"device_buffers=true \(override\): .* more than 80% of the 4.0 GiB on Fake T4"):
        make_plan("dqn", "CartPole-v1", hardware=small, overrides={**huge, "device_buffers": True})
    # Nor does the host's 2 GB hold it: the refusal names both (it named the host's memory only).
    gpu_too = r"\(the networks, envs and evaluations need the rest\); nor does the GPU hold it: .* on Fake T4, .*: lower"
    with pytest.raises(ConfigError, match=r"GiB of memory for its transitions .*" + gpu_too):
        make_plan("dqn", "CartPole-v1", hardware=dataclasses.replace(small, ram_gb=2.0), overrides=huge)
    cpu_only = dataclasses.replace(small, ram_gb=2.0, gpus=())
    with pytest.raises(ConfigError, match=r"need the rest\): lower buffer_size$"):  # no GPU to name
        make_plan("dqn", "CartPole-v1", hardware=cpu_only, overrides=huge)
    assert make_plan("dqn", "CartPole-v1", hardware=small, overrides={"buffer_size": 10_000_000}).buffers == "device"


@pytest.mark.parametrize(
    "action_space",
    [gym.spaces.Discrete(3), gym.spaces.Box(-1, 1, (4,)), gym.spaces.Box(-1, 1, (2,), dtype=np.float64)],
    ids=["discrete", "box-float32", "box-float64"],
)
def test_the_planned_transition_size_is_what_sb3_replay_buffer_allocates(action_space):
    from stable_baselines3.common.buffers import ReplayBuffer

    from sb3_gpu.planning.plan import _transition_bytes

    obs_space = gym.spaces.Box(-1, 1, (8,))
    buffer = ReplayBuffer(100, obs_space, action_space, device="cpu")
    stores = (buffer.observations, buffer.next_observations, buffer.actions, buffer.rewards, buffer.dones, buffer.timeouts)
    assert _transition_bytes(obs_space, action_space, 1) * 100 == sum(a.nbytes for a in stores)


def test_make_model_returns_a_plain_sb3_model_in_three_lines(tmp_path):
    model, timesteps = make_model("ppo", "CartPole-v1", device="auto", n_steps=16, n_envs=2, batch_size=16, n_epochs=1, seed=0)
    # SB3's PPO, or sb3_gpu's subclass of it where the plan compiles the step (a loaded machine's probe may): its zip
    # loads with SB3's own load either way.
    assert isinstance(model, PPO) and timesteps == 100_000
    model.learn(64)
    model.save(tmp_path / "m.zip")
    loaded = PPO.load(tmp_path / "m.zip")  # SB3's own load, no sb3_gpu class involved
    assert loaded.n_steps == 16 and loaded.learning_rate(1.0) == pytest.approx(1e-3)


def test_make_model_accepts_an_env_factory_and_nested_overrides():
    model, _ = make_model(
        "dqn", lambda: gym.make("CartPole-v1"), device="cpu", net_arch=[8], buffer_size=500, learning_starts=10
    )
    assert isinstance(model, DQN) and model.buffer_size == 500  # sb3_gpu's subclass where the plan compiles the step
    assert [m.out_features for m in model.q_net.q_net if isinstance(m, th.nn.Linear)] == [8, 2]


def test_config_round_trip_reproduces_the_hyperparameters(tmp_path, cpu_machine):

    plan = make_plan("ppo", "Acrobot-v1", seed=3, hardware=cpu_machine, overrides={"n_epochs": 2})
    write_yaml(tmp_path / "config.yaml", plan.to_config())
    config = load_config(tmp_path)
    again = make_plan(config.algo, config.env, config.device, seed=config.seed, config=config, hardware=cpu_machine)
    assert again.preset.values() == plan.preset.values() and again.seed == 3
    assert again.preset.normalize is True


def test_a_replayed_config_names_where_each_value_first_came_from(tmp_path, cpu_machine):
    plan = make_plan("ppo", "Acrobot-v1", hardware=cpu_machine, overrides={"n_epochs": 2}, override_source="--set")
    write_yaml(tmp_path / "config.yaml", plan.to_config())
    config = load_config(tmp_path)
    again = make_plan(
        "ppo", "Acrobot-v1", config=config, hardware=cpu_machine, overrides={"batch_size": 32}, override_source="--set"
    )
    first, now = plan.preset.sources, again.preset.sources
    assert (first["n_epochs"], first["n_steps"], first["frame_stack"]) == ("--set", "ppo.yaml:Acrobot-v1", "sb3_gpu default")
    assert {k: v for k, v in now.items() if k != "batch_size"} == {k: v for k, v in first.items() if k != "batch_size"}
    assert now["batch_size"] == "--set" and first["batch_size"] != "--set"
    # A config written without sources (by hand) names itself.
    written = plan.to_config()
    del written["resolved"]
    write_yaml(tmp_path / "config.yaml", written)
    bare = make_plan("ppo", "Acrobot-v1", config=load_config(tmp_path), hardware=cpu_machine)
    assert bare.preset.sources["n_steps"] == str(tmp_path / "config.yaml")


def test_a_config_written_before_per_normalize_existed_keeps_the_buffer_normalisation(tmp_path, cpu_machine):
    plan = make_plan("dqn", "CartPole-v1", hardware=cpu_machine, overrides={"per": {"normalize": "batch"}})
    written = plan.to_config()
    write_yaml(tmp_path / "config.yaml", written)
    assert load_config(tmp_path).hyperparameters["per"]["normalize"] == "batch"  # as written
    del written["hyperparameters"]["per"]["normalize"]
    write_yaml(tmp_path / "config.yaml", written)
    config = load_config(tmp_path)
    assert config.hyperparameters["per"]["normalize"] == "buffer"  # the only normalisation there was then
    again = make_plan("dqn", "CartPole-v1", hardware=cpu_machine, config=config)
    assert again.preset.sb3_kwargs()["replay_buffer_kwargs"]["normalize"] == "buffer"


def test_normalized_envs_are_wrapped_and_eval_env_is_frozen(cpu_machine):
    from stable_baselines3.common.vec_env import VecNormalize

    plan = make_plan("ppo", "Acrobot-v1", hardware=cpu_machine, n_envs=2)
    train_env, eval_env = build_env(plan), build_env(plan, evaluation=True)
    assert isinstance(train_env, VecNormalize) and train_env.training
    assert isinstance(eval_env, VecNormalize) and not eval_env.training and not eval_env.norm_reward
    assert train_env.gamma == plan.preset.params.gamma


@pytest.mark.parametrize("normalize", [{}, "{}", "dict()"])
def test_normalize_with_no_options_is_vecnormalize_with_its_defaults(cpu_machine, tmp_path, normalize):
    # As rl-zoo3 reads an empty mapping; the plan showed normalize {} and built no VecNormalize.
    from stable_baselines3.common.vec_env import VecNormalize

    if isinstance(normalize, dict):
        plan = make_plan("ppo", "Pendulum-v1", hardware=cpu_machine, overrides={"normalize": normalize})
    else:  # an rl-zoo3 file's string
        (tmp_path / "ppo.yml").write_text(f'Pendulum-v1:\n  n_timesteps: 10000\n  normalize: "{normalize}"\n')
        plan = make_plan("ppo", "Pendulum-v1", hardware=cpu_machine, preset=f"zoo:{tmp_path / 'ppo.yml'}")
    assert plan.preset.normalize is True
    assert isinstance(build_env(plan), VecNormalize)


def test_an_empty_normalize_adds_nothing_to_its_entrys_options_and_an_old_runs_empty_one_stays_off(tmp_path, cpu_machine):
    # A profile's empty mapping replaced the entry's options with VecNormalize's defaults; a run written while an
    # empty mapping meant off trained without VecNormalize, and must resume and evaluate so.
    algo = get_algo("ppo")
    entry = validate_entry(algo, {"normalize": {"norm_reward": False}, "cpu": {"normalize": {}}}, "t")
    assert resolve_preset(algo, entry, "f:e", "cpu").normalize == {"norm_reward": False}
    plan = make_plan("ppo", "Pendulum-v1", hardware=cpu_machine, overrides={"normalize": {}})
    written = plan.to_config()
    assert written["hyperparameters"]["normalize"] is True
    written["hyperparameters"]["normalize"] = {}  # as sb3_gpu wrote it then
    write_yaml(tmp_path / "config.yaml", written)
    config = load_config(tmp_path)
    assert config.hyperparameters["normalize"] is False
    assert make_plan("ppo", "Pendulum-v1", hardware=cpu_machine, config=config).preset.normalize is False


def test_config_with_unknown_keys_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("algo: ppo\nenv: CartPole-v1\nhyperparameters: {}\nextra: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'extra'"):
        load_config(tmp_path / "config.yaml")


def test_config_of_a_newer_layout_is_refused_not_misread(tmp_path):
    (tmp_path / "config.yaml").write_text("version: 2\nalgo: ppo\nenv: CartPole-v1\nhyperparameters: {}\n")
    with pytest.raises(ConfigError, match="config version 2; this sb3_gpu reads version 1"):
        load_config(tmp_path / "config.yaml")
    (tmp_path / "config.yaml").write_text("version: true\nalgo: ppo\nenv: CartPole-v1\nhyperparameters: {}\n")
    with pytest.raises(ConfigError, match="config version True; this sb3_gpu reads version 1"):
        load_config(tmp_path / "config.yaml")


@pytest.mark.parametrize("seed", ["-5", "4294967296", "true", "1.5"])
def test_a_config_seed_outside_what_sb3_takes_is_refused_naming_the_file(tmp_path, seed):
    (tmp_path / "config.yaml").write_text(f"algo: ppo\nenv: CartPole-v1\nhyperparameters: {{}}\nseed: {seed}\n")
    with pytest.raises(ConfigError, match=r"config.yaml: seed must be an integer in \[0, 2\*\*32\) or null, got"):
        load_config(tmp_path / "config.yaml")


def test_one_rollout_may_be_the_whole_run_but_not_more(cpu_machine):
    # SB3 always completes a rollout: one longer than the run overshoots it; one exactly as long is one update.
    whole = {"n_envs": 2, "n_steps": 64, "batch_size": 64, "n_timesteps": 128, "probe": False}
    make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides=whole)
    message = "one rollout is n_steps * n_envs = 64 * 2 = 128 env steps, more than the 127 timesteps to train"
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides={**whole, "n_timesteps": 127})
    with pytest.raises(ConfigError, match=re.escape("one rollout is train_freq * n_envs = 8 * 2 = 16 env steps")):
        make_plan("dqn", "CartPole-v1", hardware=cpu_machine, overrides={"n_envs": 2, "train_freq": 8, "n_timesteps": 15})


@pytest.mark.parametrize("algo", ["dqn", "ppo"])
def test_images_that_vecnormalize_scales_are_sized_as_the_float32_it_stores(cpu_machine, algo):
    # VecNormalize turns the uint8 frames into float32, which the buffers then hold: a plan sized at a byte each
    # let a buffer four times the memory it checked through, to be OOM-killed as it filled.
    frames = gym.spaces.Box(0, 255, (4, 40, 40), np.uint8)
    size = {"buffer_size": 10_000} if algo == "dqn" else {"n_steps": 1024, "batch_size": 64}
    common = {"policy_kwargs": {"normalize_images": False}, "n_envs": 1, "probe": False, **size}

    def mib(normalize):
        plan = make_plan(algo, lambda: _Spaces(frames), hardware=cpu_machine, overrides={**common, "normalize": normalize})
        return float(re.search(r"\(([\d.]+) MiB in host memory\)", plan.buffers_reason).group(1))

    raw, rewards_only, scaled = mib(False), mib({"norm_obs": False}), mib(True)
    assert rewards_only == raw and scaled == pytest.approx(4 * raw, rel=0.01)


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Box(-1, 1, (32,), np.float64), gym.spaces.Box(0, 255, (128,), np.uint8)],
    ids=["float64-vector", "uint8-ram"],
)
def test_observations_vecnormalize_scales_but_that_are_no_image_are_sized_in_their_own_dtype(cpu_machine, space):
    # SB3's VecNormalize keeps a Box's space unless it is an image: MuJoCo's float64 stays float64 in the buffers.
    common = {"n_envs": 1, "probe": False, "buffer_size": 100_000, "policy": "MlpPolicy"}

    def mib(normalize):
        plan = make_plan("dqn", lambda: _Spaces(space), hardware=cpu_machine, overrides={**common, "normalize": normalize})
        return float(re.search(r"\(([\d.]+) MiB in host memory\)", plan.buffers_reason).group(1))

    assert mib(True) == mib(False)


def test_a_dict_image_that_vecnormalize_scales_is_planned_as_the_flattened_input_sb3_gives_it(gpu_machine):
    # CombinedExtractor runs NatureCNN only on images; a scaled one is float32, flattened: no convolutions to place.
    space = gym.spaces.Dict({"img": gym.spaces.Box(0, 255, (40, 40, 3), np.uint8), "pos": VECTOR})
    raw, scaled = (
        make_plan("dqn", lambda: _Spaces(space), hardware=gpu_machine, overrides={"normalize": normalize, "probe": False})
        for normalize in (False, True)
    )
    assert raw.device.reason.startswith("CNN policy") and not scaled.device.reason.startswith("CNN policy")


def test_optimize_memory_usage_is_planned_on_sb3_gpus_device_buffer_and_refused_on_sb3s(cpu_machine):
    # SB3's host buffer refuses it beside the handling of time limits; sb3_gpu's device buffer takes both.
    asked = {"probe": False, "optimize_memory_usage": True, "buffer_size": 1_000, "learning_starts": 64}
    with pytest.raises(ConfigError, match=r"^optimize_memory_usage=true \(override\) needs device_buffers=true: SB3's host"):
        make_plan("dqn", "CartPole-v1", "cpu", hardware=cpu_machine, overrides=asked)
    plain = make_plan("dqn", "CartPole-v1", "cpu", hardware=cpu_machine, overrides={**asked, "optimize_memory_usage": False})
    plan = make_plan("sac", "Pendulum-v1", "cpu", hardware=cpu_machine, overrides={**asked, "device_buffers": True})
    assert plan.buffers == "device"
    # One observation a transition (and where an episode end's next one is kept aside), not two: 4 floats of 4 bytes,
    # an int64 action, 3 scalars; 8 bytes of row index.
    plan = make_plan("dqn", "CartPole-v1", "cpu", hardware=cpu_machine, overrides={**asked, "device_buffers": True})
    assert "; 43.0 KiB on cpu" in plan.buffers_reason and "(50.8 KiB in host memory)" in plain.buffers_reason
    model = build_model(plan, build_env(plan))
    model.learn(128)
    assert model.replay_buffer.optimize_memory_usage and model._n_updates > 0
    # Where the device buffer cannot be (Apple's MPS), the refusal does not send the user back to the first one.
    mac = dataclasses.replace(cpu_machine, mps=True)
    with pytest.raises(ConfigError, match=r"and optimize_memory_usage to false \(sb3_gpu's device buffer is what takes it\)$"):
        make_plan("dqn", "CartPole-v1", "mps", hardware=mac, overrides={**asked, "device_buffers": True})
