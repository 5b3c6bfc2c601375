"""rl-zoo3 hyperparameter files as presets: the real files of the installed rl_zoo3, the grammar, and hostile strings."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest

from sb3_gpu.common.checks import Schedule
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.config.presets import load_preset_file, select_entry
from sb3_gpu.config.schema import get_algo
from sb3_gpu.config.zoo import ZOO_ALGOS, convert_entry
from sb3_gpu.envs.spec import register_ale
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.train import main as train_main
from tests.conftest import machine

# The entries of rl_zoo3's files that are refused, and why: env wrappers that sb3_gpu does not apply (it applies only
# AtariWrapper, to Atari games), HER's buffer, Ornstein-Uhlenbeck noise. Every other entry must load.
REFUSED = {
    **{
        ("ppo", name): "env wrapper 'minigrid.wrappers.FlatObsWrapper' is not supported"
        for name in (
            "MiniGrid-Empty-Random-5x5-v0",
            "MiniGrid-FourRooms-v0",
            "MiniGrid-DoorKey-5x5-v0",
            "MiniGrid-MultiRoom-N4-S5-v0",
            "MiniGrid-Fetch-5x5-N2-v0",
            "MiniGrid-GoToDoor-5x5-v0",
            "MiniGrid-PutNear-6x6-N2-v0",
            "MiniGrid-RedBlueDoors-6x6-v0",
            "MiniGrid-LockedRoom-v0",
            "MiniGrid-KeyCorridorS3R1-v0",
            "MiniGrid-Unlock-v0",
            "MiniGrid-ObstructedMaze-2Dlh-v0",
        )
    },
    ("ppo", "CarRacing-v3"): "env wrapper 'rl_zoo3.wrappers.FrameSkip' is not supported",
    ("sac", "CarRacing-v3"): "env wrapper 'rl_zoo3.wrappers.FrameSkip' is not supported",
    ("sac", "donkey-generated-track-v0"): "env wrapper 'gymnasium.wrappers.time_limit.TimeLimit' is not supported",
    ("sac", "NeckEnvRelative-v2"): "env wrapper 'rl_zoo3.wrappers.HistoryWrapper' is not supported",
    ("tqc", "CarRacing-v0"): "env wrapper 'rl_zoo3.wrappers.FrameSkip' is not supported",
    ("tqc", "RocketLander-v0"): "env wrapper 'rl_zoo3.wrappers.FrameSkip' is not supported",
    ("td3", "MountainCarContinuous-v0"): "noise_type: only 'normal' is supported, got 'ornstein-uhlenbeck'",
    # Hindsight experience replay (goal-conditioned robotics tasks): its buffer class is not run.
    **{
        (algo, name): "replay_buffer_class: not supported .*'HerReplayBuffer'"
        for algo, names in {
            "sac": ["FetchReach-v1"],
            "tqc": ["FetchReach-v1", "FetchPush-v1", "FetchSlide-v1", "FetchPickAndPlace-v1", "parking-v0"]
            + [f"Panda{task}-v1" for task in ("Reach", "Push", "Slide", "PickAndPlace", "Stack")],
        }.items()
        for name in names
    },
}
# An env for the entries that are not env ids: ids that no file has an entry for, so that the entry itself is taken.
ENTRY_ENV = {"atari": "ALE/Pong-v5", "default": "FrozenLake-v1"}
CONTINUOUS = ("sac", "td3", "tqc")
# Pendulum under an id of its own: an env with continuous actions for which no rl-zoo3 file has an entry.
PENDULUM = "gymnasium.envs.classic_control.pendulum:PendulumEnv"
gym.register("ZooDefault/Pendulum-v1", entry_point=PENDULUM, max_episode_steps=200)


def _installed(env_id: str) -> bool:
    register_ale()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rl-zoo3's MuJoCo ids are old versions, and gymnasium says so
            gym.make(env_id).close()
    except (gym.error.Error, ImportError):  # not registered here (MiniGrid, PyBullet), or MuJoCo not installed
        return False
    return True


@pytest.mark.heavy
def test_every_zoo_entry_loads_or_is_refused_for_a_listed_reason_and_installed_ones_make_a_plan(capsys):
    listing: dict[str, list[str]] = {"planned": [], "loaded, env not installed": [], "refused": []}
    for algo in ZOO_ALGOS:
        entries, label = load_preset_file(get_algo(algo), f"zoo:{algo}")
        assert label == f"zoo:{algo}.yml" and len(entries) > 5
        for name in entries:
            reason = REFUSED.get((algo, name))
            if reason is not None:
                with pytest.raises(ConfigError, match=reason):
                    entries[name]
                listing["refused"].append(f"{algo}:{name}")
                continue
            entries[name]  # converted and validated as a bundled preset's entry is
            env = "ZooDefault/Pendulum-v1" if (name == "default" and algo in CONTINUOUS) else ENTRY_ENV.get(name, name)
            if not _installed(env):
                listing["loaded, env not installed"].append(f"{algo}:{name}")
                continue
            # training=False: the memory check of a 1M-transition Atari buffer depends on the machine, not the file.
            plan = make_plan(algo, env, "cpu", preset=f"zoo:{algo}", overrides={"probe": False}, training=False)
            source = f"zoo:{algo}.yml:{name}"
            assert plan.preset.entry == source and plan.preset.sources["n_timesteps"] == source
            listing["planned"].append(f"{algo}:{name}")
    with capsys.disabled():
        for outcome, names in listing.items():
            print(f"\nrl-zoo3 entries {outcome}: {len(names)}: {', '.join(names)}")
    # rl_zoo3's classic-control, Box2D and Atari entries of all three files run here.
    assert {"ppo:CartPole-v1", "ppo:atari", "ppo:LunarLander-v3", "dqn:atari", "qrdqn:Acrobot-v1"} <= set(listing["planned"])
    assert {"sac:Pendulum-v1", "td3:LunarLanderContinuous-v3", "tqc:default"} <= set(listing["planned"])
    assert len(listing["refused"]) == len(REFUSED)


def test_an_env_newer_than_rl_zoo3s_entries_takes_its_tasks_entry_not_default(tmp_path):
    # rl-zoo3's files name MuJoCo's -v4 envs; gymnasium's are -v5. default's values (SAC: learning from 100 steps,
    # 1M steps of SB3's defaults) would train HalfCheetah-v5 without a word.
    entries, _ = load_preset_file(get_algo("sac"), "zoo:sac")
    assert select_entry(entries, "HalfCheetah-v5", False, "zoo:sac.yml") == "HalfCheetah-v4"
    assert select_entry(entries, "Hopper-v5", False, "zoo:sac.yml") == "Hopper-v4"
    assert select_entry(entries, "Pendulum-v1", False, "zoo:sac.yml") == "Pendulum-v1"
    assert select_entry(entries, "ZooDefault/Pendulum-v1", False, "zoo:sac.yml") == "default"
    plan = make_plan("tqc", "Hopper-v5", "cpu", preset="zoo:tqc", overrides={"probe": False}, training=False)
    assert plan.preset.entry == "zoo:tqc.yml:Hopper-v4"
    # A preset file of the user's is taken as written: its entries are env ids, matched exactly.
    own = tmp_path / "own.yaml"
    own.write_text("default:\n  learning_starts: 100\nHopper-v4:\n  learning_starts: 10000\n")
    entries, _ = load_preset_file(get_algo("sac"), own)
    assert select_entry(entries, "Hopper-v5", False, "own.yaml") == "default"


def test_the_literal_forms_rl_zoo3_writes_become_preset_values():
    entry = {
        "n_timesteps": 1e6,
        "policy": "MlpPolicy",
        "learning_rate": "lin_2.5e-4",
        "clip_range": "linear_0.1",
        "normalize": "{'norm_obs': True, 'norm_reward': False}",
        "policy_kwargs": "dict(log_std_init=-2, ortho_init=False, activation_fn=th.nn.ReLU,\n"
        "  net_arch=[dict(pi=[64, 64], vf=(64, 64))])",
    }
    out = convert_entry(get_algo("ppo"), "Pendulum-v1", entry, "ppo.yml")
    assert out["n_timesteps"] == 1_000_000 and out["policy"] == "MlpPolicy"
    assert out["learning_rate"] == Schedule("linear", 2.5e-4, 0.0) and out["clip_range"] == Schedule("linear", 0.1, 0.0)
    assert out["normalize"] == {"norm_obs": True, "norm_reward": False}
    assert out["activation_fn"] == "relu" and out["net_arch"] == {"pi": [64, 64], "vf": [64, 64]}
    assert out["policy_kwargs"] == {"log_std_init": -2, "ortho_init": False}


@pytest.mark.parametrize(
    ("key", "text", "expected"),
    [
        ("policy_kwargs", "__import__('os').system('touch {marker}')", "call \"__import__('os')"),
        ("policy_kwargs", "dict(optimizer_class=th.optim.RMSprop)", "the name th.optim.RMSprop is not accepted"),
        ("policy_kwargs", "dict(**{'net_arch': [1]})", "dict() with positional or ** arguments"),
        ("policy_kwargs", "dict(net_arch=[64], features_extractor_class=os.system)", "the name os.system"),
        ("normalize", "().__class__.__bases__[0].__subclasses__()", "is not accepted"),
        ("normalize", "{'norm_obs': (lambda: open('{marker}', 'w'))()}", "is not accepted"),
        ("policy_kwargs", "dict(activation_fn=nn.Softmax)", "nn.Softmax, not an activation (nn.Tanh, nn.ReLU"),
        (
            "policy_kwargs",
            "dict(net_arch=[64], ortho_init=nn.ReLU)",
            "an nn activation (relu) is accepted only as policy_kwargs' activation_fn",
        ),
        ("policy_kwargs", "dict(net_arch=[64", "not a Python literal"),
        ("policy_kwargs", "dict(\0)", "cannot read"),
        ("normalize", "{'clip_obs': " + "9" * 400 + "}", "expected a positive number, got 99999"),
        ("env_wrapper", "gymnasium.wrappers.RecordVideo", "env wrapper 'gymnasium.wrappers.RecordVideo' is not supported"),
        ("callback", "rl_zoo3.callbacks.ParallelTrainCallback", "not supported (callbacks named by import path"),
    ],
)
def test_anything_outside_the_grammar_is_refused_in_one_line_and_runs_nothing(tmp_path, key, text, expected):
    marker = tmp_path / "ran"
    text = text.replace("{marker}", str(marker))
    with pytest.raises(ConfigError) as e:
        convert_entry(get_algo("ppo"), "CartPole-v1", {"policy": "MlpPolicy", key: text}, "my.yml")
    message = str(e.value)
    # Refused by the grammar (", key K: ") or, read, by the preset checks (": K.option: "): file, entry and key named.
    assert message.startswith("my.yml, entry CartPole-v1") and f" {key}" in message and expected in message
    assert "\n" not in message and not marker.exists()


def test_an_atari_wrapper_is_kept_only_for_atari_games_and_without_arguments():
    wrapper = ["stable_baselines3.common.atari_wrappers.AtariWrapper"]
    assert "env_wrapper" not in convert_entry(get_algo("dqn"), "atari", {"env_wrapper": wrapper}, "dqn.yml")
    with pytest.raises(ConfigError, match="AtariWrapper on CartPole-v1, which is not an Atari game"):
        convert_entry(get_algo("dqn"), "CartPole-v1", {"env_wrapper": wrapper}, "dqn.yml")
    register_ale()  # ale-py's own ids, such as Pong-v4, are Atari games too
    assert "env_wrapper" not in convert_entry(get_algo("dqn"), "Pong-v4", {"env_wrapper": wrapper}, "dqn.yml")
    with_args = [{wrapper[0]: {"terminal_on_life_loss": False}}]
    with pytest.raises(ConfigError, match="AtariWrapper arguments"):
        convert_entry(get_algo("dqn"), "atari", {"env_wrapper": with_args}, "dqn.yml")


def test_a_zoo_value_the_preset_checks_refuse_names_the_file_and_entry():
    with pytest.raises(ConfigError, match=r"my.yml, entry CartPole-v1: unknown key 'n_step'.*did you mean 'n_steps'"):
        convert_entry(get_algo("ppo"), "CartPole-v1", {"n_step": 32}, "my.yml")
    with pytest.raises(ConfigError, match="sb3_gpu trains ppo, dqn, qrdqn, sac, td3, tqc; there is no preset for a2c"):
        load_preset_file(get_algo("ppo"), "zoo:a2c")
    with pytest.raises(ConfigError, match=r"; there is no preset for A2C$"):  # not "did you mean 'sac'"
        load_preset_file(get_algo("ppo"), "zoo:A2C")
    with pytest.raises(ConfigError, match=r"zoo:sac holds rl-zoo3's values for sac; this run trains ppo \(zoo:ppo\)"):
        load_preset_file(get_algo("ppo"), "zoo:sac")
    accepted = r"accepted: zoo:ppo, zoo:dqn, zoo:qrdqn, zoo:sac, zoo:td3, zoo:tqc or zoo:PATH.yml"
    for spec in ("SAC", "sac.yml", "sac.yml:Pendulum-v1", "sac:Pendulum-v1"):  # rl-zoo3's file and entry names
        with pytest.raises(ConfigError, match=rf"zoo:{spec} is neither .* {accepted}; did you mean zoo:sac\? \(the entry"):
            load_preset_file(get_algo("sac"), f"zoo:{spec}")
    with pytest.raises(ConfigError, match=rf"zoo:sacc is neither .* a readable file; {accepted}; did you mean 'sac'\?"):
        load_preset_file(get_algo("sac"), "zoo:sacc")
    for spec in ("zoo:", "zoo:no/such.yml"):  # the folder "." and a missing file
        with pytest.raises(ConfigError, match=accepted):
            load_preset_file(get_algo("sac"), spec)


def test_train_plans_from_an_installed_zoo_file_and_refuses_a_hostile_one_with_exit_2(tmp_path, call_main):
    result = call_main(train_main, "ppo", "--env", "CartPole-v1", "--preset", "zoo:ppo", "--plan", "--no-probe")
    assert result.returncode == 0 and "zoo:ppo.yml:CartPole-v1" in result.stdout
    hostile = tmp_path / "hostile.yml"
    hostile.write_text(f"CartPole-v1:\n  policy_kwargs: \"__import__('os').system('touch {tmp_path / 'ran'}')\"\n")
    result = call_main(train_main, "ppo", "--env", "CartPole-v1", "--preset", f"zoo:{hostile}", "--plan")
    assert result.returncode == 2 and not (tmp_path / "ran").exists()
    assert result.stderr.count("\n") == 1 and f"{hostile}, entry CartPole-v1, key policy_kwargs: cannot read" in result.stderr


# Where sb3_gpu's bundled entries part from rl-zoo3's own (the keys; each preset's comment says why): everything else
# in them is rl-zoo3's value, and a change to one of those fails here. GPU profiles keep rl-zoo3's networks and batches
# where the CPU's are smaller.
LUNAR_CONTINUOUS = {"learning_rate", "n_timesteps", "eval_freq", "buffer_size"}  # a constant rate, 300k steps
DEPARTURES = {
    ("ppo", "CartPole-v1"): set(),
    ("ppo", "Acrobot-v1"): set(),
    ("ppo", "MountainCar-v0"): set(),
    ("ppo", "LunarLander-v3"): set(),
    ("dqn", "CartPole-v1"): {
        *("gradient_steps", "exploration_fraction", "learning_rate", "n_timesteps", "net_arch", "n_envs", "buffer_size"),
        *("target_update_interval", "exploration_final_eps", "n_steps", "gamma", "train_freq", "per"),
    },
    ("dqn", "Acrobot-v1"): set(),
    ("dqn", "MountainCar-v0"): set(),
    ("dqn", "LunarLander-v3"): {"eval_freq", "n_timesteps", "n_steps", "per"},
    ("qrdqn", "CartPole-v1"): set(),
    ("qrdqn", "Acrobot-v1"): set(),
    ("qrdqn", "MountainCar-v0"): set(),
    ("qrdqn", "LunarLander-v3"): {
        *("exploration_fraction", "learning_rate", "learning_starts", "n_timesteps", "buffer_size", "gamma", "n_steps"),
        *("target_update_interval", "exploration_final_eps", "train_freq", "policy_kwargs"),
    },
    **{(algo, "Pendulum-v1"): set() for algo in CONTINUOUS},
    ("sac", "LunarLanderContinuous-v3"): LUNAR_CONTINUOUS,
    ("tqc", "LunarLanderContinuous-v3"): LUNAR_CONTINUOUS,
    ("td3", "LunarLanderContinuous-v3"): {"eval_freq", "buffer_size", "learning_rate", "action_noise_std", "tau", "gamma"},
    **{(algo, env): set() for algo in CONTINUOUS for env in ("BipedalWalker-v3", "HalfCheetah-v5", "Hopper-v5")},
}
CPU_DEPARTURES = {  # the CPU profile's smaller networks and batches
    ("sac", "Pendulum-v1"): {"net_arch", "batch_size"},
    ("tqc", "Pendulum-v1"): {"net_arch", "batch_size"},
    ("td3", "Pendulum-v1"): {"net_arch", "batch_size", "learning_starts"},
    ("sac", "LunarLanderContinuous-v3"): {"net_arch"},
    ("tqc", "LunarLanderContinuous-v3"): {"net_arch"},
    ("td3", "LunarLanderContinuous-v3"): {"net_arch"},
}


def test_every_bundled_entry_has_the_env_list_of_this_table():
    entries = {algo: load_preset_file(get_algo(algo))[0] for algo in ZOO_ALGOS}
    bundled = {(algo, env) for algo, file in entries.items() for env in file if env not in ("default", "atari")}
    assert bundled == set(DEPARTURES)


@pytest.mark.parametrize("gpus", [0, 1], ids=["cpu", "gpu"])
@pytest.mark.parametrize("algo, env", sorted(DEPARTURES))
def test_bundled_entries_are_rl_zoo3s_values_but_where_they_say(algo, env, gpus):
    hardware = machine(gpus=gpus)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rl-zoo3's MuJoCo entries are for -v4
        ours = make_plan(algo, env, hardware=hardware).preset.values()
        zoo = make_plan(algo, env, hardware=hardware, preset=f"zoo:{algo}").preset.values()
    departed = {key for key in ours.keys() | zoo.keys() if ours.get(key) != zoo.get(key)}
    assert departed == DEPARTURES[algo, env] | (CPU_DEPARTURES.get((algo, env), set()) if not gpus else set())
