"""Prioritized experience replay: the sum/min trees, the replay buffer, and the DQN-family models that train on it."""

from sb3_gpu.extensions.per.buffer import PrioritizedReplayBuffer, PrioritizedReplayBufferSamples
from sb3_gpu.extensions.per.device import DevicePrioritizedReplayBuffer, DeviceSumMinTree
from sb3_gpu.extensions.per.dqn import PrioritizedDQN, PrioritizedQRDQN
from sb3_gpu.extensions.per.tree import SumMinTree, tree_backends

__all__ = [
    "DevicePrioritizedReplayBuffer",
    "DeviceSumMinTree",
    "PrioritizedDQN",
    "PrioritizedQRDQN",
    "PrioritizedReplayBuffer",
    "PrioritizedReplayBufferSamples",
    "SumMinTree",
    "tree_backends",
]
