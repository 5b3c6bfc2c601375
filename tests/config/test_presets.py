from __future__ import annotations

import dataclasses
import inspect
import os
import re

import pytest
import torch as th
import yaml
from gymnasium import spaces
from stable_baselines3.common.utils import ConstantSchedule, LinearSchedule
from torch import nn

from sb3_gpu.common.checks import Schedule
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.config.files import presets_dir
from sb3_gpu.config.presets import check_policy_kwargs, load_preset_file, parse_override, resolve_preset, select_entry
from sb3_gpu.config.schema import ALGOS, CONVERTED_KEYS, EXTENSION_KEYS, get_algo, validate_entry, validate_flat

PPO_ = get_algo("ppo")
DQN_ = get_algo("dqn")


def write(tmp_path, text: str, name: str = "preset.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("algo", list(ALGOS))
def test_bundled_preset_files_load_and_validate(algo):
    entries, label = load_preset_file(get_algo(algo))
    continuous = spaces.Discrete not in get_algo(algo).action_space
    generic, classic = (["default"], "Pendulum-v1") if continuous else (["default", "atari"], "CartPole-v1")
    assert {*generic, classic} <= set(entries)
    assert label.endswith(f"{algo}.yaml")
    for profile in ("cpu", "gpu"):
        assert all(profile in entries[name] for name in generic)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_dataclass_defaults_equal_sb3_defaults(algo):
    spec = get_algo(algo)
    signature = inspect.signature(spec.model_class.__init__).parameters
    for f in dataclasses.fields(spec.params_class):
        if f.name in EXTENSION_KEYS:  # sb3_gpu's own extensions: off by default, or auto (decided by the plan)
            off = {"per": False, "grad_accum_steps": 1, "overlap_training": "auto", "critic_layer_norm": False}[f.name]
            assert type(f.default) is type(off) and f.default == off, f.name  # True == 1: the type tells them apart
            continue
        if f.name in CONVERTED_KEYS:  # turned into SB3's argument by the plan: none by default, as SB3's
            assert f.default is None and signature["action_noise"].default is None
            continue
        assert f.name in signature, f"{f.name} is not an argument of {spec.model_class.__name__}"
        assert f.default == signature[f.name].default, f.name


def test_default_entry_follows_the_seed_table():
    entries, _ = load_preset_file(PPO_)
    gpu = resolve_preset(PPO_, entries["default"], "ppo.yaml:default", "gpu")
    cpu = resolve_preset(PPO_, entries["default"], "ppo.yaml:default", "cpu")
    assert (gpu.n_envs, gpu.params.batch_size, gpu.params.n_steps, gpu.params.n_epochs, gpu.net_arch) == (
        8,
        256,
        512,
        10,
        [256, 256],
    )
    assert (cpu.params.batch_size, cpu.params.n_steps, cpu.params.n_epochs, cpu.net_arch) == (64, 256, 4, [128, 128])
    entries, _ = load_preset_file(DQN_)
    gpu = resolve_preset(DQN_, entries["default"], "dqn.yaml:default", "gpu")
    cpu = resolve_preset(DQN_, entries["default"], "dqn.yaml:default", "cpu")
    assert (gpu.params.batch_size, gpu.params.buffer_size, gpu.net_arch) == (128, 50_000, [256, 256, 256])
    assert (cpu.params.batch_size, cpu.params.buffer_size, cpu.net_arch) == (32, 10_000, [128, 128])


def test_profile_overrides_shared_values_and_sources_say_so():
    entry = validate_entry(PPO_, {"n_steps": 128, "batch_size": 32, "gpu": {"batch_size": 512}}, "t")
    preset = resolve_preset(PPO_, entry, "f:e", "gpu")
    assert preset.params.batch_size == 512 and preset.sources["batch_size"] == "f:e/gpu"
    assert preset.params.n_steps == 128 and preset.sources["n_steps"] == "f:e"
    assert preset.params.gamma == 0.99 and preset.sources["gamma"] == "SB3 default"


def test_a_profile_may_not_set_the_policy_and_its_key_list_does_not_offer_it():
    with pytest.raises(ConfigError, match="t, profile gpu: 'policy' must be shared, not set per profile"):
        validate_entry(PPO_, {"gpu": {"policy": "MlpPolicy"}}, "t")
    with pytest.raises(ConfigError, match="unknown key 'batch_sise'; did you mean 'batch_size'") as refused:
        validate_entry(PPO_, {"gpu": {"batch_sise": 64}}, "t")
    valid = str(refused.value).split("(valid: ")[1]
    assert "batch_size" in valid.split(", ") and "policy" not in valid.rstrip(")").split(", ")


def test_a_profile_left_blank_is_an_empty_one():
    # Every line under `gpu:` commented out: YAML reads null, which is a profile that changes nothing.
    entry = validate_entry(PPO_, yaml.safe_load("n_envs: 2\ngpu:\n  # batch_size: 512\n"), "t")
    assert entry["gpu"] == {} and resolve_preset(PPO_, entry, "f:e", "gpu").n_envs == 2


@pytest.mark.parametrize(
    ("algo", "values", "refused"),
    [
        # SB3's DQN clips every gradient: None reaches clip_grad_norm_ and fails at the first gradient step.
        ("dqn", {"max_grad_norm": None}, "max_grad_norm: expected a positive number, got None"),
        ("qrdqn", {"max_grad_norm": 0}, "max_grad_norm: expected a positive number or null, got 0"),
        ("tqc", {"top_quantiles_to_drop_per_net": -1}, "top_quantiles_to_drop_per_net: expected an int >= 0, got -1"),
    ],
)
def test_bounds_that_sb3_sets_are_the_presets(algo, values, refused):
    with pytest.raises(ConfigError, match=f"^t: {re.escape(refused)}$"):
        validate_flat(get_algo(algo), values, "t")


@pytest.mark.parametrize(
    ("values", "refused"),
    [
        ({"activation_fn": "relux"}, "(valid: null, tanh, relu, elu, leaky_relu, gelu, silu)"),
        (
            {"activation_fn": "relu, got it"},
            "unknown value 'relu, got it' (valid: null, tanh, relu, elu, leaky_relu, gelu, silu)",
        ),
        ({"frame_stack": 0}, "frame_stack: expected a positive int or null, got 0"),
        ({"net_arch": "x"}, "(SAC, TD3, TQC) or null, got 'x'"),
        ({"net_arch": [0]}, "net_arch: expected a positive layer width, got 0"),  # a layer: null is no width
        ({"net_arch": {"pi": [0]}}, "net_arch.pi: expected a positive layer width, got 0"),
        ({"net_arch": {"foo": [64]}}, "(valid: pi, qf, vf)"),  # a key of the mapping: null is no key
        # The value echoed as given, however it reads.
        (
            {"activation_fn": "x (valid: y)"},
            "unknown value 'x (valid: y)' (valid: null, tanh, relu, elu, leaky_relu, gelu, silu)",
        ),
        ({"frame_stack": "(valid: 1"}, "frame_stack: expected a positive int or null, got '(valid: 1'"),
        ({"frame_stack": "2, got 3"}, "frame_stack: expected a positive int or null, got '2, got 3'"),
    ],
)
def test_a_refused_value_that_may_be_null_says_so(values, refused):
    with pytest.raises(ConfigError) as raised:
        validate_flat(PPO_, values, "t")
    assert str(raised.value).endswith(refused)


def test_values_at_the_bounds_are_taken():
    assert validate_flat(get_algo("qrdqn"), {"max_grad_norm": None}, "t") == {"max_grad_norm": None}  # QR-DQN: no clip
    tqc = validate_flat(get_algo("tqc"), {"top_quantiles_to_drop_per_net": 0}, "t")  # no truncation: SAC's target
    assert tqc == {"top_quantiles_to_drop_per_net": 0}


def test_overrides_win_and_are_validated():
    entry = validate_entry(PPO_, {"batch_size": 32}, "t")
    preset = resolve_preset(
        PPO_, entry, "f:e", "cpu", {"batch_size": (128, "--set"), "policy_kwargs.ortho_init": (False, "--set")}
    )
    assert preset.params.batch_size == 128 and preset.sources["batch_size"] == "--set"
    assert preset.policy_kwargs == {"ortho_init": False}
    with pytest.raises(ConfigError, match="batch_size: expected an int >= 2"):
        resolve_preset(PPO_, entry, "f:e", "cpu", {"batch_size": ("big", "--set")})


def test_an_override_that_adds_to_a_presets_mapping_credits_both():
    # The preset's own option was credited to the override in the plan table.
    entry = validate_entry(PPO_, {"policy_kwargs": {"ortho_init": False}}, "t")
    added = resolve_preset(PPO_, entry, "f:e", "cpu", {"policy_kwargs.log_std_init": (-1.0, "--set")})
    assert added.policy_kwargs == {"ortho_init": False, "log_std_init": -1.0}
    assert added.sources["policy_kwargs"] == "f:e and --set"
    replaced = resolve_preset(PPO_, entry, "f:e", "cpu", {"policy_kwargs": ({"ortho_init": True}, "overrides")})
    assert replaced.policy_kwargs == {"ortho_init": True} and replaced.sources["policy_kwargs"] == "overrides"


@pytest.mark.parametrize("dotted_first", [False, True])
def test_a_whole_mapping_and_a_dotted_key_merge_in_any_order_and_may_not_both_set_one_value(dotted_first):
    # A whole mapping given after a dotted key replaced it; both giving one value: the last one won without a word.
    entry = validate_entry(PPO_, {}, "t")
    items = [("policy_kwargs", ({"log_std_init": -1.0}, "overrides")), ("policy_kwargs.ortho_init", (False, "overrides"))]
    merged = resolve_preset(PPO_, entry, "f:e", "cpu", dict(items[::-1] if dotted_first else items))
    assert merged.policy_kwargs == {"log_std_init": -1.0, "ortho_init": False}
    items = [("policy_kwargs", ({"ortho_init": True}, "--set")), ("policy_kwargs.ortho_init", (False, "--set"))]
    with pytest.raises(ConfigError, match=r"^--set: policy_kwargs gives ortho_init=True and policy_kwargs.ortho_init gives"):
        resolve_preset(PPO_, entry, "f:e", "cpu", dict(items[::-1] if dotted_first else items))
    # A whole that is no mapping (off) beside one of its values: the order decided before, without a word.
    items = [("normalize", (False, "overrides")), ("normalize.norm_reward", (False, "overrides"))]
    with pytest.raises(ConfigError, match=r"^overrides: normalize=False and normalize.norm_reward=False both set normalize"):
        resolve_preset(PPO_, entry, "f:e", "cpu", dict(items[::-1] if dotted_first else items))


@pytest.mark.parametrize(
    ("algo", "key", "says"),
    [
        ("dqn", "replay_buffer_class", "sb3_gpu chooses the replay buffer from per, n_steps and device_buffers"),
        ("ppo", "rollout_buffer_kwargs", "sb3_gpu chooses the rollout buffer from device_buffers"),
        ("td3", "action_noise", "set action_noise_std"),
        ("sac", "handle_timeout_termination", "always bootstrap from truncated episodes"),
        ("qrdqn", "seed", "pass seed to make_model or make_plan"),
    ],
)
def test_an_sb3_argument_that_is_no_preset_key_says_where_it_is_set(algo, key, says):
    # "unknown key" read as a typo of a real SB3 argument.
    with pytest.raises(ConfigError, match=rf"^--set: '{key}' is SB3's but no preset key: .*{says}") as refused:
        validate_flat(ALGOS[algo], {key: None}, "--set")
    assert "unknown key" not in str(refused.value)


@pytest.mark.parametrize(
    ("algo", "key"), [("ppo", "action_noise"), ("ppo", "replay_buffer_class"), ("dqn", "rollout_buffer_kwargs")]
)
def test_an_sb3_argument_of_another_algorithm_is_an_unknown_key(algo, key):
    # PPO was told to set action_noise_std, which it then refused as a key of sac, td3 and tqc.
    with pytest.raises(ConfigError, match=rf"^--set: unknown key '{key}'"):
        validate_flat(ALGOS[algo], {key: None}, "--set")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("net_arch", [32], "policy_kwargs.net_arch is a preset key of its own; set net_arch instead"),
        ("activation_fn", "relu", "policy_kwargs.activation_fn is a preset key of its own; set activation_fn instead"),
        ("use_sde", True, "policy_kwargs.use_sde is a preset key of its own; set use_sde instead"),
        ("lr_schedule", 1, "policy_kwargs.lr_schedule is made by ppo from learning_rate; set that"),
    ],
)
def test_policy_arguments_the_preset_or_sb3_sets_are_refused_in_policy_kwargs(key, value, message):
    # Each would be overwritten (net_arch, activation_fn, use_sde) or clash (lr_schedule) without a word.
    entry = validate_entry(PPO_, {"net_arch": [64]}, "t")
    with pytest.raises(ConfigError, match=rf"^--set: {message}$"):
        resolve_preset(PPO_, entry, "f:e", "cpu", {f"policy_kwargs.{key}": (value, "--set")})
    with pytest.raises(ConfigError, match=rf"^t: {message}$"):
        resolve_preset(PPO_, validate_entry(PPO_, {"policy_kwargs": {key: value}}, "t"), "t", "cpu")


@pytest.mark.parametrize(
    ("algo", "key", "value", "message"),
    [
        ("ppo", "ortho_init", "false", "must be true or false, got 'false'"),  # a string: truthy, so init stayed on
        ("ppo", "log_std_init", "low", "must be a number, got 'low'"),
        ("ppo", "optimizer_kwargs", [1], "must be a mapping or null, got \\[1\\]"),
        ("sac", "n_critics", 2.5, "must be an integer, got 2.5"),
        ("ppo", "optimizer_class", "torch.optim.SGD", "must be a class, passed in Python"),
        ("dqn", "features_extractor_class", "my.Extractor", "must be a class, passed in Python"),
    ],
)
def test_policy_kwargs_values_are_checked_against_the_policys_signature(algo, key, value, message):
    algo_ = get_algo(algo)
    entry = validate_entry(algo_, {"policy": "MlpPolicy"}, "t")
    with pytest.raises(ConfigError, match=rf"^--set: policy_kwargs.{key} {message}"):
        resolve_preset(algo_, entry, "f:e", "cpu", {f"policy_kwargs.{key}": (value, "--set")})
    fine = {"ppo": {"ortho_init": False, "log_std_init": -1}, "sac": {"n_critics": 3}, "dqn": {"optimizer_kwargs": None}}
    for k, v in {**fine[algo], "optimizer_kwargs": {"eps": 1e-5}, "optimizer_class": th.optim.SGD}.items():
        preset = resolve_preset(algo_, entry, "f:e", "cpu", {f"policy_kwargs.{k}": (v, "--set")})
        assert preset.policy_kwargs[k] == v


def test_entry_selection_prefers_env_then_atari_then_default():
    entries = {"default": {}, "atari": {}, "CartPole-v1": {}}
    assert select_entry(entries, "CartPole-v1", False, "f") == "CartPole-v1"
    assert select_entry(entries, "ALE/Pong-v5", True, "f") == "atari"
    assert select_entry(entries, "Pendulum-v1", False, "f") == "default"
    with pytest.raises(ConfigError, match="no entry for 'X-v0' and no 'default'"):
        select_entry({"CartPole-v1": {}}, "X-v0", False, "f")


def test_a_misspelt_entry_is_refused_not_passed_over_for_default(tmp_path):
    entries = {"default": {}, "CartPol-v1": {}, "Acrobot-v1": {}}
    with pytest.raises(ConfigError, match=r"^f, entry 'CartPol-v1': no registered env id; did you mean 'CartPole-v1'\?"):
        select_entry(entries, "CartPole-v1", False, "f")
    assert select_entry(entries, "Pendulum-v1", False, "f") == "default"  # nothing like Pendulum-v1: its fallback
    assert select_entry({"default": {}, "CartPole-v0": {}}, "CartPole-v1", False, "f") == "default"  # a real id
    with pytest.raises(ConfigError, match=r"\(entries: defualt\); did you mean 'default'\?$"):
        select_entry({"defualt": {}}, "CartPole-v1", False, "f")
    # rl-zoo3's files name other packages' envs and older versions, close to Gymnasium's ids but no typos (tqc.yml has
    # CarRacing-v0): not refused, and an older version is its task's entry.
    (tmp_path / "z.yml").write_text("default: {n_timesteps: 1000}\nCarRacing-v0: {n_timesteps: 2000}\n")
    zoo, label = load_preset_file(get_algo("tqc"), f"zoo:{tmp_path / 'z.yml'}")
    assert select_entry(zoo, "CarRacing-v3", False, label) == "CarRacing-v0"
    assert select_entry(zoo, "CarRacing-v", False, label) == select_entry(zoo, "CarRacingv3", False, label) == "default"


def test_unknown_key_names_file_entry_and_closest_valid_name(tmp_path):
    path = write(tmp_path, "CartPole-v1:\n  bach_size: 64\n")
    with pytest.raises(
        ConfigError, match=r"preset.yaml, entry CartPole-v1: unknown key 'bach_size'; did you mean 'batch_size'"
    ):
        load_preset_file(PPO_, path)


def test_unknown_key_in_a_profile_is_an_error(tmp_path):
    path = write(tmp_path, "default:\n  gpu:\n    n_env: 4\n")
    with pytest.raises(ConfigError, match=r"profile gpu: unknown key 'n_env'; did you mean 'n_envs'"):
        load_preset_file(PPO_, path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("default:\n  batch_size: sixty\n", "batch_size: expected an int >= 2, got 'sixty'"),
        ("default:\n  n_steps: 12.5\n", "n_steps: expected a positive int"),
        ("default:\n  gamma: 1.5\n", r"gamma: expected a number in \[0, 1\]"),
        ("default:\n  normalize_advantage: 'yes please'\n", "expected true or false"),
        (
            "default:\n  normalize: maybe\n",
            r"normalize: expected true, false or a mapping of VecNormalize's options \(norm_obs",
        ),
        ("default:\n  learning_rate: -1\n", "learning_rate: expected a positive number"),
        ("default:\n  learning_rate: {schedule: cosine, start: 1}\n", "schedule must be 'linear' or 'constant'"),
        ("default:\n  net_arch: [64, -1]\n", "expected a positive layer width"),
        ("default:\n  activation_fn: relu6\n", "unknown value 'relu6'"),
        ("default:\n  policy: MlpPolicyy\n", "did you mean 'MlpPolicy'"),
        ("default:\n  gpu:\n    policy: CnnPolicy\n", "'policy' must be shared"),
        ("default:\n  policy_kwargs: {ortho_innit: false}\n  policy: MlpPolicy\n", "did you mean 'ortho_init'"),
        ("default:\n  policy_delay: 2\n", "'policy_delay' is for td3, not ppo"),  # not "did you mean 'policy'"
        ("default:\n  cpu:\n    buffer_size: 10\n", "'buffer_size' is for off-policy algorithms"),
    ],
)
def test_bad_values_are_errors_that_name_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        entries, label = load_preset_file(PPO_, path)
        resolve_preset(PPO_, entries["default"], label, "cpu")


@pytest.mark.parametrize(
    "text, message",
    [
        ("default: [1, 2\n", "not valid YAML at line"),
        ("- a\n- b\n", "must be a mapping of entries"),
        ("", "must be a mapping of entries"),
        ("default: !!python/object/apply:os.system ['echo hacked']\n", "refused YAML tag"),
        ("default: !!python/name:builtins.eval\n", "refused YAML tag"),
        ("default:\n  n_steps: 64\n  n_steps: 128\n", "not valid YAML at line 3: key 'n_steps' given twice"),
        ("default: {}\ndefault: {n_steps: 64}\n", "not valid YAML at line 2: key 'default' given twice"),
    ],
)
def test_files_that_are_not_plain_yaml_mappings_are_refused(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_preset_file(PPO_, write(tmp_path, text))


def test_a_merged_entry_may_override_what_it_merged(tmp_path):
    # `<<: *base` then a key of the entry's own is YAML's way to override, not a key given twice.
    text = "base: &base {n_steps: 64, batch_size: 32}\ndefault:\n  <<: *base\n  n_steps: 128\n"
    entries, _ = load_preset_file(PPO_, write(tmp_path, text))
    assert entries["default"] == {"n_steps": 128, "batch_size": 32}


def test_missing_preset_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="preset file not found"):
        load_preset_file(PPO_, tmp_path / "nope.yaml")


def test_oversized_preset_file_is_refused(tmp_path):
    path = write(tmp_path, "default:\n  n_steps: 1\n" + "#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1024 KiB"):
        load_preset_file(PPO_, path)
    if os.path.exists("/dev/zero"):  # endless, and of size 0 to stat: read up to the cap, not to the end
        with pytest.raises(ConfigError, match=r"^/dev/zero: preset file is larger than 1024 KiB"):
            load_preset_file(PPO_, "/dev/zero")


def test_numbers_written_as_1e5_are_accepted():
    # PyYAML reads 1e5 (no dot) as a string; users write it anyway.
    values = validate_flat(PPO_, yaml.safe_load("n_timesteps: 1e5\nlearning_rate: 3e-4"), "t")
    assert values == {"n_timesteps": 100_000, "learning_rate": 3e-4}


def test_schedules_become_sb3_schedule_objects():
    entry = validate_entry(
        PPO_,
        {
            "learning_rate": {"schedule": "linear", "start": 1e-3, "end": 0.0},
            "clip_range": {"schedule": "constant", "value": 0.1},
        },
        "t",
    )
    kwargs = resolve_preset(PPO_, entry, "t", "cpu").sb3_kwargs()
    assert isinstance(kwargs["learning_rate"], LinearSchedule) and isinstance(kwargs["clip_range"], ConstantSchedule)
    assert kwargs["learning_rate"](1.0) == pytest.approx(1e-3) and kwargs["learning_rate"](0.5) == pytest.approx(5e-4)
    assert kwargs["clip_range"](0.3) == 0.1


@pytest.mark.parametrize(
    "algo, arch, message",
    [
        ("sac", {"pi": [8], "vf": [8]}, r"net_arch of sac: unknown key 'vf' \(valid: pi, qf\)"),
        ("td3", {"pi": [8]}, r"td3 needs \{pi: \[...\], qf: \[...\]\}, qf missing"),
        ("ppo", {"pi": [8], "qf": [8]}, r"net_arch of ppo: unknown key 'qf' \(valid: pi, vf\)"),
        ("ppo", {"pi": [8]}, "ppo needs .*, vf missing"),
        ("dqn", {"pi": [8], "qf": [8]}, r"dqn's Q-network takes a list of layer widths like \[64, 64\]"),
        ("qrdqn", {"pi": [8], "vf": [8]}, "qrdqn's Q-network takes a list"),
    ],
)
def test_a_dict_net_arch_is_refused_unless_it_names_each_network_the_algorithm_builds(algo, arch, message):
    # SB3 would ignore a key it does not build and build a missing one empty (PPO) or fail when the model is made.
    with pytest.raises(ConfigError, match=message):
        validate_flat(get_algo(algo), {"net_arch": arch}, "t")


@pytest.mark.parametrize("algo", ["dqn", "sac"])
def test_gradient_steps_is_positive_or_minus_one_never_zero(algo):
    # SB3 skips train() when gradient_steps is 0: the run would collect and never learn.
    checked = get_algo(algo)
    assert [validate_flat(checked, {"gradient_steps": n}, "t")["gradient_steps"] for n in (-1, 1, 64)] == [-1, 1, 64]
    with pytest.raises(ConfigError, match=r"gradient_steps: expected a positive int, or -1 .*, got 0 \(no gradient step"):
        validate_flat(checked, {"gradient_steps": 0}, "t")
    with pytest.raises(ConfigError, match="got -2"):
        validate_flat(checked, {"gradient_steps": -2}, "t")


@pytest.mark.parametrize(
    "value, message",
    [
        ([1, "epsiode"], r"got \[1, 'epsiode'\]; did you mean 'episode'\?"),
        ([4, "steps"], "did you mean 'step'"),
        ([1, 2, 3], r"expected a positive int or \[n, step\|episode\], got \[1, 2, 3\]$"),
        (0, "expected a positive int or"),
    ],
)
def test_a_bad_train_freq_says_what_is_accepted_and_the_closest_unit(value, message):
    with pytest.raises(ConfigError, match=message):
        validate_flat(DQN_, {"train_freq": value}, "t")
    assert validate_flat(DQN_, {"train_freq": [2, "episode"]}, "t")["train_freq"] == (2, "episode")


def test_sb3s_tuple_forms_from_python_are_taken_as_the_yaml_lists():
    flat = validate_flat(DQN_, {"train_freq": (1, "episode"), "net_arch": (32, 32)}, "t")
    assert flat["train_freq"] == (1, "episode") and flat["net_arch"] == [32, 32]
    assert validate_flat(PPO_, {"net_arch": {"pi": (8,), "vf": [4]}}, "t")["net_arch"] == {"pi": [8], "vf": [4]}
    with pytest.raises(ConfigError, match="did you mean 'episode'"):
        validate_flat(DQN_, {"train_freq": (1, "epsiode")}, "t")


def test_sb3s_class_and_function_forms_from_python_say_what_a_config_can_hold():
    assert validate_flat(PPO_, {"activation_fn": nn.Tanh}, "t")["activation_fn"] == "tanh"
    with pytest.raises(ConfigError, match=r"t: activation_fn: Softsign is none of the activations accepted \(torch.nn's Tanh"):
        validate_flat(PPO_, {"activation_fn": nn.Softsign}, "t")
    for key in ("learning_rate", "clip_range"):
        with pytest.raises(ConfigError, match=rf"t: {key}: a function cannot be written .* {{'schedule': 'linear', 'st"):
            validate_flat(PPO_, {key: lambda progress: 0.1 * progress}, "t")


def test_numpy_numbers_and_exponent_strings_are_taken_as_numbers_inside_policy_kwargs_too():
    import numpy as np

    flat = validate_flat(
        PPO_,
        {
            "batch_size": np.int64(64),
            "n_envs": np.int32(4),
            "learning_rate": np.float32(0.5),
            "net_arch": [np.int64(32)],
            "threads": np.int64(2),
            "policy_kwargs": {"log_std_init": "-1e0", "optimizer_kwargs": {"eps": "1e-5", "betas": [np.float64(0.9), 0.99]}},
        },
        "t",
    )
    assert (flat["batch_size"], flat["n_envs"], flat["learning_rate"], flat["net_arch"], flat["threads"]) == (
        64,
        4,
        0.5,
        [32],
        2,
    )
    assert type(flat["batch_size"]) is int and type(flat["learning_rate"]) is float and type(flat["net_arch"][0]) is int
    assert flat["policy_kwargs"] == {"log_std_init": -1.0, "optimizer_kwargs": {"eps": 1e-5, "betas": [0.9, 0.99]}}
    assert type(flat["policy_kwargs"]["optimizer_kwargs"]["betas"][0]) is float
    yaml.safe_dump(flat["policy_kwargs"])  # what config.yaml will hold
    # A string that is no exponent number stays a string (an argument may take one); a bool stays a bool.
    kept = validate_flat(PPO_, {"policy_kwargs": {"name": "64", "squash_output": np.bool_(True)}}, "t")["policy_kwargs"]
    assert kept["name"] == "64"
    with pytest.raises(ConfigError, match=r"t: batch_size: expected an int >= 2, got np.float64\(64.5\)"):
        validate_flat(PPO_, {"batch_size": np.float64(64.5)}, "t")


def test_a_dict_net_arch_with_the_algorithms_networks_is_what_sb3_builds():
    import gymnasium as gym

    arch = validate_flat(PPO_, {"net_arch": {"pi": [8], "vf": []}}, "t")["net_arch"]
    ppo = PPO_.model_class("MlpPolicy", gym.make("CartPole-v1"), policy_kwargs={"net_arch": arch}, device="cpu")
    assert (ppo.policy.action_net.in_features, ppo.policy.value_net.in_features) == (8, 4)  # vf: [] is linear
    sac_ = get_algo("sac")
    arch = validate_flat(sac_, {"net_arch": {"pi": [8], "qf": []}}, "t")["net_arch"]
    sac = sac_.model_class("MlpPolicy", gym.make("Pendulum-v1"), policy_kwargs={"net_arch": arch}, device="cpu")
    assert sac.actor.mu.in_features == 8 and [type(m) for m in sac.critic.qf0] == [nn.Linear]


def test_activation_names_map_to_torch_classes():
    entry = validate_entry(PPO_, {"activation_fn": "relu", "net_arch": {"pi": [32], "vf": [64]}}, "t")
    kwargs = resolve_preset(PPO_, entry, "t", "cpu").sb3_kwargs()
    assert kwargs["policy_kwargs"] == {"activation_fn": nn.ReLU, "net_arch": {"pi": [32], "vf": [64]}}


def test_values_round_trip_through_validation():
    entries, label = load_preset_file(PPO_)
    preset = resolve_preset(PPO_, entries["CartPole-v1"], label, "cpu")
    again = resolve_preset(PPO_, validate_flat(PPO_, yaml.safe_load(yaml.safe_dump(preset.values())), "t"), "t", "cpu")
    assert again.params == preset.params and again.values() == preset.values()
    assert isinstance(again.params.learning_rate, Schedule)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("batch_size=128", ("batch_size", 128)),
        ("net_arch=[64, 64]", ("net_arch", [64, 64])),
        ("use_sde=true", ("use_sde", True)),
        ("gamma = 0.9", ("gamma", 0.9)),
    ],
)
def test_override_values_are_yaml_scalars(text, expected):
    assert parse_override(text) == expected


def test_env_kwargs_numbers_in_exponent_form_reach_the_env_as_floats(tmp_path):
    # PyYAML reads 1e-3 as a string; policy_kwargs and the hyperparameters took it as a number, env_kwargs as written.
    path = tmp_path / "p.yaml"
    path.write_text("CartPole-v1:\n  env_kwargs: {scale: 1e-3, big: -2E5, quoted: '1e-3x', plain: 7}\n")
    entries, _ = load_preset_file(PPO_, path)
    preset = resolve_preset(PPO_, entries["CartPole-v1"], "p.yaml:CartPole-v1", "cpu")
    assert preset.env_kwargs == {"scale": 0.001, "big": -200000.0, "quoted": "1e-3x", "plain": 7}


@pytest.mark.parametrize("text", ["batch_size", "=3", ""])
def test_override_without_key_or_equals_is_an_error(text):
    with pytest.raises(ConfigError, match="--set expects key=value"):
        parse_override(text)


def test_presets_dir_is_the_top_level_folder_in_a_checkout():
    assert (presets_dir() / "ppo.yaml").is_file()


def test_a_profiles_option_mapping_adds_to_the_entrys_and_a_schedule_is_replaced_whole(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "CartPole-v1:\n"
        "  policy_kwargs: {ortho_init: false}\n"
        "  learning_rate: {schedule: linear, start: 1.0e-3, end: 0.0}\n"
        "  cpu: {policy_kwargs: {log_std_init: -1.0}, learning_rate: {schedule: constant, value: 3.0e-4}}\n"
        "  gpu: {n_epochs: 3}\n"
    )
    entries, _ = load_preset_file(PPO_, path)
    cpu = resolve_preset(PPO_, entries["CartPole-v1"], "p.yaml:CartPole-v1", "cpu")
    assert cpu.policy_kwargs == {"ortho_init": False, "log_std_init": -1.0}
    assert cpu.sources["policy_kwargs"] == "p.yaml:CartPole-v1 and p.yaml:CartPole-v1/cpu"
    assert cpu.params.learning_rate.to_yaml() == {"schedule": "constant", "value": 3e-4}  # replaced whole
    gpu = resolve_preset(PPO_, entries["CartPole-v1"], "p.yaml:CartPole-v1", "gpu")
    assert gpu.policy_kwargs == {"ortho_init": False} and gpu.sources["policy_kwargs"] == "p.yaml:CartPole-v1"


def test_amp_off_as_yaml_reads_it_is_off_and_compile_off_is_false(cpu_machine):
    # The README's `amp: off` reached the check as YAML's False and was refused with a list holding "off".
    from sb3_gpu.planning.plan import make_plan

    assert yaml.safe_load("amp: off") == {"amp": False}
    plan = make_plan("ppo", "CartPole-v1", hardware=cpu_machine, overrides={"amp": False, "compile": "off", "probe": False})
    assert (plan.preset.amp, plan.preset.compile) == ("off", "false")


@pytest.mark.parametrize(
    "algo, key, value, message",
    [
        # SB3's LinearSchedule divides by end_fraction: a ZeroDivisionError at the first gradient step.
        (
            "ppo",
            "learning_rate",
            {"schedule": "linear", "start": 3e-4, "end_fraction": 0},
            "end_fraction: expected a number in (0, 1]",
        ),
        # tau 0 never moves the target network: a run that trains against a random target, without a word.
        ("dqn", "tau", 0.0, "tau: expected a number in (0, 1]"),
        ("sac", "tau", 0.0, "tau: expected a number in (0, 1]"),
        # SB3's PPO asserts batch_size > 1 as the model is built.
        ("ppo", "batch_size", 1, "batch_size: expected an int >= 2"),
    ],
)
def test_values_sb3_fails_on_or_that_never_learn_are_refused_at_their_bound(algo, key, value, message):
    algo_ = get_algo(algo)
    entry = validate_entry(algo_, {}, "t")
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_preset(algo_, entry, "f:e", "cpu", {key: (value, "--set")})
    at_bound = {"learning_rate": {"schedule": "linear", "start": 3e-4, "end_fraction": 1}, "tau": 1.0, "batch_size": 2}
    resolve_preset(algo_, entry, "f:e", "cpu", {key: (at_bound[key], "--set")})


@pytest.mark.parametrize(
    "value, mode", [(True, "default"), ("true", "default"), (False, "false"), ("reduce-overhead", "reduce-overhead")]
)
def test_compile_true_as_yaml_or_python_reads_it_compiles_in_the_default_mode(value, mode):
    from sb3_gpu.common.checks import compile_mode

    assert compile_mode(value, "compile") == mode


def test_per_switched_on_takes_the_presets_own_settings_not_the_defaults():
    # dqn.yaml tunes PER (eps 0.1, buffer-wide normalisation); --per must train with those.
    tuned = {"alpha": 0.4, "beta0": 0.4, "eps": 0.1, "normalize": "buffer"}
    entry = validate_entry(DQN_, {"per": tuned}, "t")
    preset = resolve_preset(DQN_, entry, "f:e", "cpu", {"per": (True, "--per")})
    assert preset.params.per == {**tuned, "beta_fraction": 1.0}


def test_a_profiles_option_mapping_wins_over_the_entrys_on_a_key_both_set():
    entry = validate_entry(
        PPO_,
        {"policy_kwargs": {"ortho_init": False, "log_std_init": -1.0}, "gpu": {"policy_kwargs": {"ortho_init": True}}},
        "t",
    )
    assert resolve_preset(PPO_, entry, "f:e", "gpu").policy_kwargs == {"ortho_init": True, "log_std_init": -1.0}
    assert resolve_preset(PPO_, entry, "f:e", "cpu").policy_kwargs == {"ortho_init": False, "log_std_init": -1.0}


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("per", {"beta0": 1.5}, "per.beta0: expected a number in [0, 1]"),  # importance weights over-corrected
        ("per", {"beta_fraction": 0}, "per.beta_fraction: expected a number in (0, 1]"),
        ("threads", 0, "threads: expected 'auto' or a positive int, got 0"),
        ("threads", True, "threads: expected 'auto' or a positive int, got True"),  # not one thread
        ("normalize", {"norm_obs_keys": ["pos", "pos"]}, "normalize.norm_obs_keys: ['pos', 'pos'] names a key twice"),
    ],
)
def test_extension_values_out_of_their_range_are_refused(key, value, message):
    entry = validate_entry(DQN_, {}, "t")
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_preset(DQN_, entry, "f:e", "cpu", {key: (value, "--set")})


def test_a_games_own_entry_wins_over_atari_and_a_zoo_task_takes_its_newest_version():
    entries = {"default": {}, "atari": {}, "PongNoFrameskip-v4": {}}
    assert select_entry(entries, "PongNoFrameskip-v4", True, "t") == "PongNoFrameskip-v4"
    assert select_entry(entries, "BreakoutNoFrameskip-v4", True, "t") == "atari"
    assert select_entry(entries, "CartPole-v1", False, "t") == "default"
    from sb3_gpu.config.zoo import ZooEntries

    zoo = ZooEntries(get_algo("sac"), {"Hopper-v3": {}, "Hopper-v4": {}, "HopperBulletEnv-v0": {}}, "sac.yml")
    assert select_entry(zoo, "Hopper-v5", False, "t") == "Hopper-v4"  # rl-zoo3's files lag behind gymnasium's versions


def test_an_empty_preset_file_and_a_config_without_hyperparameters_are_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: a preset file must be a mapping of entries"):
        load_preset_file(PPO_, empty)
    from sb3_gpu.config.runconfig import load_config

    config = tmp_path / "config.yaml"
    config.write_text("version: 1\nalgo: ppo\nenv: CartPole-v1\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: missing hyperparameters$"):
        load_config(config)


def test_a_profiles_own_keys_are_credited_to_the_profile_beside_a_merged_option_mapping():
    entry = validate_entry(
        PPO_,
        {"policy_kwargs": {"ortho_init": False}, "cpu": {"policy_kwargs": {"log_std_init": -1.0}, "n_steps": 128}},
        "t",
    )
    preset = resolve_preset(PPO_, entry, "f:x", "cpu")
    assert preset.policy_kwargs == {"ortho_init": False, "log_std_init": -1.0}
    assert preset.sources["policy_kwargs"] == "f:x and f:x/cpu" and preset.sources["n_steps"] == "f:x/cpu"


@pytest.mark.parametrize("run", ["[1, 2]", "ab", "5"])
def test_a_config_whose_run_is_no_mapping_is_refused_and_one_without_a_device_plans_auto(tmp_path, run):
    from sb3_gpu.config.runconfig import load_config

    config = tmp_path / "config.yaml"
    config.write_text("version: 1\nalgo: ppo\nenv: CartPole-v1\nhyperparameters: {}\n")
    assert load_config(config).device == "auto" and load_config(config).vec_env == "auto"  # a config written by hand
    config.write_text(f"version: 1\nalgo: ppo\nenv: CartPole-v1\nhyperparameters: {{}}\nrun: {run}\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: run must be a mapping, got "):
        load_config(config)


def test_a_preset_key_given_inside_policy_kwargs_is_pointed_to_its_own_key():
    with pytest.raises(
        ConfigError, match=r"did you mean 'net_arch'\? It is a preset key of its own: set it without policy_kwargs"
    ):
        check_policy_kwargs(PPO_, "MlpPolicy", {"net_arc": [64]}, "t")
