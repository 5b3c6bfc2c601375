"""Where replay and rollout data live: on the model's device (sb3_gpu's device buffers) or in SB3's host buffers."""

from __future__ import annotations

from dataclasses import dataclass

from gymnasium import spaces

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.config.presets import Preset
from sb3_gpu.extensions.replay import size_text


@dataclass(frozen=True)
class BufferChoice:
    """``device``: DeviceRolloutBuffer (PPO), DeviceReplayBuffer or DevicePrioritizedReplayBuffer (DQN family);
    ``host``: SB3's own buffers (and sb3_gpu's host PrioritizedReplayBuffer)."""

    kind: str
    reason: str


def choose_buffers(preset: Preset, device: str, observation_space: spaces.Space, data_bytes: int) -> BufferChoice:
    """Resolve ``device_buffers`` (auto, true, false) for a plan on ``device``; ``data_bytes`` is what the buffer holds."""
    request, source = preset.device_buffers, preset.sources.get("device_buffers", "sb3_gpu default")
    # A reason a device buffer cannot be used at all: asked for, it is an error; under auto, SB3's buffer is kept.
    blocker = "Dict observations take SB3's Dict buffers" if isinstance(observation_space, spaces.Dict) else None
    if request == "false":
        return BufferChoice("host", f"SB3's buffers: device_buffers=false ({source})")
    if request == "true":
        if blocker is not None:
            raise ConfigError(f"device_buffers=true ({source}): {blocker}; set device_buffers to auto or false")
        return BufferChoice("device", f"asked for ({source}); {size_text(data_bytes)} on {device}")
    if blocker is not None:
        return BufferChoice("host", f"SB3's buffers: {blocker}")
    if device.startswith("cuda"):
        return BufferChoice(
            "device",
            f"on {device}: {size_text(data_bytes)} of rollout/replay data stays there (frames cross once, in their own "
            "dtype; sampling and advantages on the GPU)",
        )
    # Measured on a 2-core VM (bench gpu): PPO and DQN CartPole 0.98x SB3's buffers; PER 0.63x the host sum trees.
    return BufferChoice("host", f"SB3's buffers: on {device} a device buffer is no faster (device_buffers=true to use one)")
