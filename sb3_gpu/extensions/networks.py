"""Which modules of an SB3 policy do its math: what AMP autocasts and torch.compile compiles."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

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
# SB3's off-policy actor-critics (SAC, TD3, sb3-contrib's TQC): each part's children are its networks.
_OFF_POLICY_PARTS = ("actor", "actor_target", "critic", "critic_target")
# SAC's and TQC's Gaussian heads: the mean and log-std that the squashing and the entropy term read stay float32.
_GAUSSIAN_HEADS = ("mu", "log_std")


@dataclass(frozen=True)
class PolicyNetworks:
    """A policy's networks.

    :ivar compute: modules with parameters whose forward passes do the policy's math
    :ivar loss_facing: those whose outputs feed the loss directly (the DQN family's Q-networks)
    :ivar loss_methods: policy methods whose outputs feed the loss (PPO's ``evaluate_actions``)
    :ivar value_heads: the last linear layer of each Q-network (and of TD3's actor), and PPO's value and action
        heads: their outputs are the values that bootstrap targets and pick actions, or the distribution's
        parameters, so AMP keeps them in float32
    """

    compute: list[th.nn.Module]
    loss_facing: list[th.nn.Module]
    loss_methods: list[str]
    value_heads: Sequence[th.nn.Module] = ()


def steps_one_optimizer(policy_class: type) -> bool:
    """Whether one optimizer steps the whole policy (PPO's, the DQN family's), which fp16's loss scale and
    per-module compiling need. SB3's off-policy actor-critics (SAC, TD3, TQC) make an actor and a critic with an
    optimizer each; the plan asks this of an algorithm's policy class, AMP and compile of the policy they are given."""
    return not (hasattr(policy_class, "make_actor") and hasattr(policy_class, "make_critic"))


def policy_networks(model: BaseAlgorithm) -> PolicyNetworks:
    """The networks of an actor-critic (PPO, A2C), DQN-family or off-policy actor-critic (SAC, TD3, TQC) policy.

    PPO's distribution math (log-probabilities, entropy) is not in them, nor are SAC's Gaussian heads: they stay in
    float32 under AMP.
    """
    policy: Any = model.policy
    q_nets = [m for name in _Q_NETS if isinstance(m := getattr(policy, name, None), th.nn.Module)]
    if q_nets:
        return PolicyNetworks(q_nets, q_nets, [], _last_linears(q_nets))
    if not steps_one_optimizer(type(policy)):
        found: dict[int, th.nn.Module] = {}  # by identity: a features extractor may be shared by actor and critic
        for part in (getattr(policy, name, None) for name in _OFF_POLICY_PARTS):
            for name, child in part.named_children() if part is not None else ():
                gaussian_head = name in _GAUSSIAN_HEADS and isinstance(child, th.nn.Linear)  # TD3's mu is a network
                if not gaussian_head and any(True for _ in child.parameters()):
                    found[id(child)] = child
        nets = list(found.values())
        valued = [
            n for n in nets if not isinstance(n, BaseFeaturesExtractor) and n is not getattr(policy.actor, "latent_pi", None)
        ]
        return PolicyNetworks(nets, [], [], _last_linears(valued))
    if hasattr(policy, "evaluate_actions") and hasattr(policy, "mlp_extractor"):
        found = {id(m): m for name in _ACTOR_CRITIC if isinstance(m := getattr(policy, name, None), th.nn.Module)}
        compute = [m for m in found.values() if any(True for _ in m.parameters())]
        # The value and the action distribution's parameters: a bf16 value of 80 moves in steps of 0.5 (noise in
        # every advantage), and a bf16 Gaussian mean or logit makes the probability ratio jump in steps.
        heads = [m for name in ("value_net", "action_net") if isinstance(m := getattr(policy, name, None), th.nn.Linear)]
        return PolicyNetworks(compute, [], ["evaluate_actions"], heads)
    raise ConfigError(
        f"AMP and compile support actor-critic (PPO, A2C, SAC, TD3, TQC) and DQN-family policies, not {type(policy).__name__}"
    )


def _last_linears(nets: Sequence[th.nn.Module]) -> list[th.nn.Module]:
    return [linears[-1] for net in nets if (linears := [m for m in net.modules() if isinstance(m, th.nn.Linear)])]


# At most this many outputs, a compiled linear layer is worth computing as a reduction (see NarrowLinear).
NARROW_OUTPUTS = 8


class NarrowLinear(th.nn.Linear):
    """A linear layer with few outputs (a Q-value, an action) that, inside a compiled graph, computes each output as a
    sum of products rather than a matrix product: inductor then fuses it with the activation before it and its backward
    pass with the one after, where a matrix product would be a library call, and kernels on each side of it. Outside
    a graph it is ``nn.Linear`` itself, op for op. Same parameters and state-dict keys: a saved model loads into SB3."""

    def forward(self, x: th.Tensor) -> th.Tensor:
        if not th.compiler.is_compiling():
            return super().forward(x)
        out = (x.unsqueeze(-2) * self.weight).sum(-1)
        return out if self.bias is None else out + self.bias


def narrow_linears(module: th.nn.Module) -> int:
    """Make each ``nn.Linear`` in ``module`` with at most ``NARROW_OUTPUTS`` outputs a :class:`NarrowLinear`, in place
    (its parameters, hooks and optimizer state unchanged); returns how many it changed."""
    changed = 0
    for layer in module.modules():
        if type(layer) is th.nn.Linear and layer.out_features <= NARROW_OUTPUTS:
            layer.__class__ = NarrowLinear
            changed += 1
    return changed
