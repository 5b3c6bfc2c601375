"""The module path that replay buffers and models saved by sb3_gpu 0.1 name; the code is in sb3_gpu.extensions.per."""

from sb3_gpu.extensions.per import (
    PrioritizedDQN,
    PrioritizedQRDQN,
    PrioritizedReplayBuffer,
    PrioritizedReplayBufferSamples,
    SumMinTree,
)

__all__ = ["PrioritizedDQN", "PrioritizedQRDQN", "PrioritizedReplayBuffer", "PrioritizedReplayBufferSamples", "SumMinTree"]
