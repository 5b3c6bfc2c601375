"""Linear layers with few outputs, computed inside a compiled graph as sums of products (NarrowLinear)."""

from __future__ import annotations

import copy

import pytest
import torch as th
from stable_baselines3 import TD3

from sb3_gpu.extensions.continuous import SyncFreeTD3
from sb3_gpu.extensions.networks import NARROW_OUTPUTS, NarrowLinear, narrow_linears


def _matrix_products(fn) -> list[str]:
    with th.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear")]


@pytest.mark.heavy
@pytest.mark.parametrize(("out_features", "bias"), [(1, True), (NARROW_OUTPUTS, False)])
def test_a_narrow_layer_is_nn_linear_outside_a_graph_and_a_fused_sum_of_products_inside(out_features, bias):
    th.manual_seed(0)
    reference = th.nn.Sequential(th.nn.Linear(5, 300), th.nn.ReLU(), th.nn.Linear(300, out_features, bias=bias))
    net = copy.deepcopy(reference)
    assert narrow_linears(net) == 1
    assert type(net[0]) is th.nn.Linear and type(net[2]) is NarrowLinear
    x = th.randn(64, 5)
    assert th.equal(net(x), reference(x))  # uncompiled: nn.Linear's own op

    compiled = th.compile(net, fullgraph=True)
    out = compiled(x)
    # The head's matrix product is gone from the graph: only the hidden layer's remains, forward and backward.
    assert len(_matrix_products(lambda: compiled(x))) == 1
    expected = reference(x)
    th.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    (out**2).sum().backward()
    (expected**2).sum().backward()
    for mine, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        th.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def test_only_plain_linear_layers_with_few_outputs_change_keeping_their_parameters():
    wide = th.nn.Linear(4, NARROW_OUTPUTS + 1)
    narrow = th.nn.Linear(4, 2)
    net = th.nn.Sequential(wide, th.nn.Tanh(), narrow)
    params = list(net.parameters())
    keys = list(net.state_dict())
    assert narrow_linears(net) == 1
    assert type(wide) is th.nn.Linear and type(narrow) is NarrowLinear and net[2] is narrow
    assert all(a is b for a, b in zip(net.parameters(), params, strict=True)) and list(net.state_dict()) == keys
    assert narrow_linears(net) == 0  # done once


@pytest.mark.heavy
def test_a_compiled_td3_saves_a_model_that_sb3_loads_with_plain_linear_layers(tmp_path):
    model = SyncFreeTD3(
        "MlpPolicy", "Pendulum-v1", learning_starts=20, batch_size=16, policy_kwargs={"net_arch": [32, 32]}, seed=0
    )
    assert model.compile_step() is None
    assert type(model.critic.qf0[-1]) is NarrowLinear and type(model.actor.mu[-2]) is NarrowLinear
    model.learn(40)
    model.save(tmp_path / "model.zip")
    loaded = TD3.load(tmp_path / "model.zip", device="cpu")
    assert type(loaded.critic.qf0[-1]) is th.nn.Linear
    observation = model.observation_space.sample()
    assert (loaded.predict(observation, deterministic=True)[0] == model.predict(observation, deterministic=True)[0]).all()
