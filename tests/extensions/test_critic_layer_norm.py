"""critic_layer_norm: SAC's, TD3's and TQC's critics with a LayerNorm after each hidden layer, trained by sb3_gpu's
step as SB3's train() trains the same networks, compiled whole, saved and loaded, and chosen through the plan."""

from __future__ import annotations

import copy
import sys
from typing import Any

import gymnasium as gym
import pytest
import torch as th
from sb3_contrib import TQC
from stable_baselines3 import SAC, TD3

from sb3_gpu import ConfigError, build_env, build_model, make_plan
from sb3_gpu.extensions.continuous import NormedCritics, SyncFreeSAC, SyncFreeTD3, SyncFreeTQC, normed_critics_policy

PAIRS = {"sac": (SAC, SyncFreeSAC), "td3": (TD3, SyncFreeTD3), "tqc": (TQC, SyncFreeTQC)}
SMALL = {"learning_starts": 40, "batch_size": 16, "gradient_steps": 3, "policy_kwargs": {"net_arch": [16, 8]}}


def _model(cls: type, policy: Any = "MlpPolicy", **kwargs: Any) -> Any:
    return cls(policy, "Pendulum-v1", seed=3, device="cpu", **copy.deepcopy({**SMALL, **kwargs}))


def _layers(net: th.nn.Module) -> list[str]:
    return [type(m).__name__ for m in net]


def _weights(model: Any) -> list[th.Tensor]:
    return [t.detach().clone() for t in model.policy.state_dict().values()]


@pytest.mark.parametrize("case", list(PAIRS))
def test_each_hidden_layer_of_the_critics_and_their_targets_is_normalised_and_optimised(case):
    model = _model(PAIRS[case][1], critic_layer_norm=True)
    policy = model.policy
    for critic in (policy.critic, policy.critic_target):
        assert len(critic.q_networks) == 2
        for i, net in enumerate(critic.q_networks):
            assert getattr(critic, f"qf{i}") is net
            assert _layers(net) == ["Linear", "LayerNorm", "ReLU", "Linear", "LayerNorm", "ReLU", "Linear"]
            assert [m.normalized_shape for m in net if isinstance(m, th.nn.LayerNorm)] == [(16,), (8,)]
    assert not any(isinstance(m, th.nn.LayerNorm) for m in policy.actor.modules())  # the actor is SB3's
    for a, b in zip(policy.critic.state_dict().values(), policy.critic_target.state_dict().values(), strict=True):
        assert th.equal(a, b)
    stepped = {id(p) for group in policy.critic.optimizer.param_groups for p in group["params"]}
    owned = [p for name, p in policy.critic.named_parameters() if "features_extractor" not in name]
    assert stepped == {id(p) for p in owned}
    assert len(owned) == 2 * (3 * 2 + 2 * 2)  # per network: three Linear layers' weights and biases, two LayerNorms'


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(PAIRS))
def test_the_normalised_critics_train_as_sb3s_train_trains_them_eager_and_compiled(case):
    plain_cls, ours_cls = PAIRS[case]
    # The same networks, trained by SB3's own train(): its class with the policy that makes them.
    plain = _model(plain_cls, normed_critics_policy(plain_cls.policy_aliases["MlpPolicy"]))
    plain.learn(100)
    eager = _model(ours_cls, critic_layer_norm=True).learn(100)
    compiled = _model(ours_cls, critic_layer_norm=True)
    assert compiled.compile_step("default") is None
    compiled.learn(100)
    assert compiled._compiled is not None and compiled._compiled.fallback is None  # fullgraph=True: no break
    assert eager._n_updates == plain._n_updates == 3 * 60
    initial = _weights(_model(ours_cls, critic_layer_norm=True))
    assert all(not th.equal(a, b) for a, b in zip(initial, _weights(eager), strict=True))  # the LayerNorms' trained too
    for a, b, c in zip(_weights(eager), _weights(compiled), _weights(plain), strict=True):
        th.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
        th.testing.assert_close(b, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", list(PAIRS))
def test_a_saved_model_loads_with_sb3s_own_load(case, tmp_path):
    plain_cls, ours_cls = PAIRS[case]
    model = _model(ours_cls, critic_layer_norm=True)
    model.learn(60)
    assert isinstance(model.policy, NormedCritics)
    model.save(tmp_path / "model")
    loaded = plain_cls.load(tmp_path / "model", env=gym.make("Pendulum-v1"), device="cpu")  # SB3's class and train()
    assert type(loaded) is plain_cls and type(loaded.policy) is type(model.policy)
    assert "LayerNorm" in _layers(loaded.critic.qf0) and "LayerNorm" in _layers(loaded.critic_target.qf1)
    for a, b in zip(_weights(model), _weights(loaded), strict=True):
        assert th.equal(a, b)
    loaded.learn(20)  # and SB3's own train() goes on with them


@pytest.mark.parametrize("case", list(PAIRS))
def test_a_run_loads_its_own_saved_model_as_evaluate_and_resume_do(case, tmp_path):
    # The loader's template is not set up, so its policy class was SB3's, and the twin's module was taken for another
    # algorithm: a run's best-model check, evaluate and --resume all refused the run's own models.
    from sb3_gpu.runs.saving import load_plan_model

    small = {"learning_starts": 40, "batch_size": 16, "net_arch": [16, 8], "probe": False}
    plan = make_plan(case, "Pendulum-v1", "cpu", overrides={**small, "critic_layer_norm": True})
    model = build_model(plan, build_env(plan))
    model.save(tmp_path / "model")
    loaded = load_plan_model(plan, tmp_path / "model.zip", build_env(plan))
    assert isinstance(loaded.policy, NormedCritics)
    for a, b in zip(_weights(model), _weights(loaded), strict=True):
        assert th.equal(a, b)
    plain = make_plan(case, "Pendulum-v1", "cpu", overrides=small)  # a config without the norms
    with pytest.raises(ConfigError, match=f"holds a {case} model with layer-normed critics, and this run's config has"):
        load_plan_model(plain, tmp_path / "model.zip", build_env(plain))
    # Their twin policies share one module: another of the three algorithms is still told apart.
    for other in set(PAIRS) - {case}:
        other_plan = make_plan(other, "Pendulum-v1", "cpu", overrides={**small, "critic_layer_norm": True})
        with pytest.raises(ConfigError, match=f"holds a {case} model, and this run's config is for {other};"):
            load_plan_model(other_plan, tmp_path / "model.zip", build_env(other_plan))


@pytest.mark.parametrize("alias", ["MlpPolicy", "CnnPolicy", "MultiInputPolicy"])
@pytest.mark.parametrize("case", list(PAIRS))
def test_each_of_sb3s_policies_has_a_twin_and_other_policies_are_refused(case, alias):
    base = PAIRS[case][0].policy_aliases[alias]
    twin = normed_critics_policy(base)
    assert twin.__bases__ == (NormedCritics, base) and normed_critics_policy(twin) is twin
    assert getattr(sys.modules[twin.__module__], twin.__qualname__) is twin  # pickled by reference, as SB3 saves it

    class Custom(base):  # type: ignore[misc, valid-type]
        pass

    with pytest.raises(ConfigError, match="critic_layer_norm works with SB3's own SAC, TD3 and TQC policies"):
        normed_critics_policy(Custom)


def test_a_model_saved_before_the_policy_classes_loads_with_its_normalised_critics(tmp_path):
    model = _model(SyncFreeSAC, critic_layer_norm=True)
    model.learn(60)
    model.policy_class = PAIRS["sac"][0].policy_aliases["MlpPolicy"]  # as such zips named it: SB3's own class
    model.save(tmp_path / "sac")
    loaded = SyncFreeSAC.load(tmp_path / "sac", device="cpu")
    assert isinstance(loaded.policy, NormedCritics)
    for a, b in zip(_weights(model), _weights(loaded), strict=True):
        assert th.equal(a, b)


def test_a_saved_model_loads_with_its_normalised_critics(tmp_path):
    model = _model(SyncFreeSAC, critic_layer_norm=True)
    model.learn(60)
    model.save(tmp_path / "sac")
    loaded = SyncFreeSAC.load(tmp_path / "sac", device="cpu")
    assert loaded.critic_layer_norm is True
    assert "LayerNorm" in _layers(loaded.critic.qf0) and "LayerNorm" in _layers(loaded.critic_target.qf1)
    for a, b in zip(_weights(model), _weights(loaded), strict=True):
        assert th.equal(a, b)
    saved = model.critic.optimizer.state_dict()["state"]
    assert len(loaded.critic.optimizer.state_dict()["state"]) == len(saved) > 0  # Adam's moments came back too


def test_the_plan_takes_it_as_a_key_of_sac_td3_and_tqc_and_refuses_it_elsewhere():
    plan = make_plan("td3", "Pendulum-v1", "cpu", overrides={"critic_layer_norm": True, "probe": False, "n_envs": 1})
    assert plan.preset.params.critic_layer_norm is True
    assert plan.preset.sources["critic_layer_norm"] == "override"
    env = build_env(plan)
    try:
        model = build_model(plan, env)
        assert isinstance(model, SyncFreeTD3) and "LayerNorm" in _layers(model.critic.qf0)
    finally:
        env.close()
    unset = make_plan("sac", "Pendulum-v1", "cpu", overrides={"probe": False})
    assert unset.preset.params.critic_layer_norm is False
    assert unset.preset.sources["critic_layer_norm"] == "sb3_gpu default"
    with pytest.raises(ConfigError, match="'critic_layer_norm' is for sac, td3, tqc, not dqn"):
        make_plan("dqn", "CartPole-v1", "cpu", overrides={"critic_layer_norm": True, "probe": False})
    with pytest.raises(ConfigError, match=r"critic_layer_norm.*true or false"):
        make_plan("sac", "Pendulum-v1", "cpu", overrides={"critic_layer_norm": "yes", "probe": False})
