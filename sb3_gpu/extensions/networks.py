"""Which modules of an SB3 policy do its math: what AMP autocasts and torch.compile compiles."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.common.errors import ConfigError

_Q_NETS = ("q_net", "q_net_target", "quantile_net", "quantile_net_target")
_ACTOR_CRITIC = (
    "features_extractor",
    "pi_features_extractor",
    "vf_features_extractor",
    "mlp_extractor",
    "action_net",
    "value_net",
)


@dataclass(frozen=True)
class PolicyNetworks:
    """A policy's networks.

    :ivar compute: modules with parameters whose forward passes do the policy's math
    :ivar loss_facing: those whose outputs feed the loss directly (the DQN family's Q-networks)
    :ivar loss_methods: policy methods whose outputs feed the loss (PPO's ``evaluate_actions``)
    :ivar value_heads: the last linear layer of each Q-network: its outputs are the values that bootstrap targets
        and pick actions by argmax, so AMP keeps it in float32
    """

    compute: list[th.nn.Module]
    loss_facing: list[th.nn.Module]
    loss_methods: list[str]
    value_heads: Sequence[th.nn.Module] = ()


def policy_networks(model: BaseAlgorithm) -> PolicyNetworks:
    """The networks of an actor-critic (PPO, A2C) or DQN-family policy.

    PPO's distribution math (log-probabilities, entropy) is not in them: it stays in float32 under AMP.
    """
    policy: Any = model.policy
    q_nets = [m for name in _Q_NETS if isinstance(m := getattr(policy, name, None), th.nn.Module)]
    if q_nets:
        heads = [linears[-1] for net in q_nets if (linears := [m for m in net.modules() if isinstance(m, th.nn.Linear)])]
        return PolicyNetworks(q_nets, q_nets, [], heads)
    if hasattr(policy, "evaluate_actions") and hasattr(policy, "mlp_extractor"):
        found = {id(m): m for name in _ACTOR_CRITIC if isinstance(m := getattr(policy, name, None), th.nn.Module)}
        compute = [m for m in found.values() if any(True for _ in m.parameters())]
        return PolicyNetworks(compute, [], ["evaluate_actions"])
    raise ConfigError(f"AMP and compile support actor-critic (PPO, A2C) and DQN-family policies, not {type(policy).__name__}")
