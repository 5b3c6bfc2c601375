"""The data path: where replay and rollout data live (the model's device, or SB3's host buffers), and whether
off-policy training overlaps collection."""

from __future__ import annotations

from dataclasses import dataclass

from gymnasium import spaces

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.hardware import GPUInfo
from sb3_gpu.config.presets import Preset
from sb3_gpu.extensions.replay import size_text


@dataclass(frozen=True)
class BufferChoice:
    """``device``: DeviceRolloutBuffer (PPO), DeviceReplayBuffer or DevicePrioritizedReplayBuffer (DQN family);
    ``host``: SB3's own buffers (and sb3_gpu's host PrioritizedReplayBuffer)."""

    kind: str
    reason: str
    gpu_too_small: str = ""  # host, where the data would not fit the GPU: how much it would take there


# The share of a GPU's memory a device buffer may take: the networks, optimizer state, activations and torch's
# caching allocator need the rest. On the host, the same share of the available memory, for the same reasons.
GPU_MEMORY_SHARE = 0.8
HOST_MEMORY_SHARE = 0.8


def choose_buffers(
    preset: Preset,
    device: str,
    observation_space: spaces.Space,
    data_bytes: int,
    gpu: GPUInfo | None = None,
    gpu_free: int | None = None,
) -> BufferChoice:
    """Resolve ``device_buffers`` (auto, true, false) for a plan on ``device``; ``data_bytes`` is what the buffer holds,
    ``gpu`` the CUDA device's facts (its memory), ``gpu_free`` the bytes free on it for new tensors (None: all of it).
    """
    request, source = preset.device_buffers, preset.sources.get("device_buffers", "sb3_gpu default")
    # A reason a device buffer cannot be used at all: asked for, it is an error; under auto, SB3's buffer is kept.
    blocker = "Dict observations take SB3's Dict buffers" if isinstance(observation_space, spaces.Dict) else None
    if gpu is not None:
        total = gpu.memory_gb * 2**30
        usable, of = (gpu_free, "free") if gpu_free is not None and gpu_free < total else (total, "")
        if data_bytes > GPU_MEMORY_SHARE * usable:
            blocker = (
                f"{size_text(data_bytes)} would take more than {GPU_MEMORY_SHARE:.0%} of the {size_text(usable)}"
                f"{' ' + of if of else ''} on {gpu.name}"
                f"{f' (of {size_text(total)} in all)' if of else ''}, which the networks and their activations need too"
            )
    if device.startswith("mps"):  # its sampling draws, n-step discounts and PER trees are float64, which MPS lacks
        blocker = "Apple's MPS has no float64, which the device buffers' sampling and PER trees use"
    host = f"SB3's buffers ({size_text(data_bytes)} in host memory)"
    if request == "false":
        return BufferChoice("host", f"{host}: device_buffers=false ({source})")
    if request == "true":
        if blocker is not None:
            fix = "set device_buffers to auto or false"
            if getattr(preset.params, "optimize_memory_usage", False):  # which takes the device buffer only
                fix += ", and optimize_memory_usage to false (sb3_gpu's device buffer is what takes it)"
            raise ConfigError(f"device_buffers=true ({source}): {blocker}; {fix}")
        return BufferChoice("device", f"asked for ({source}); {size_text(data_bytes)} on {device}")
    if blocker is not None:
        too_small = blocker if gpu is not None and blocker.startswith(size_text(data_bytes)) else ""
        return BufferChoice("host", f"{host}: {blocker}", too_small)
    if device.startswith("cuda"):
        return BufferChoice(
            "device",
            f"on {device}: {size_text(data_bytes)} of rollout/replay data stays there (frames cross once, in their own "
            "dtype; sampling and advantages on the GPU)",
        )
    # Measured on a 2-core VM (bench gpu --device cpu): the PPO and DQN CartPole presets (PER included) at 1.02x and
    # 0.97x SB3's buffers, medians of 7 rounds that ranged from 0.73x to 1.15x: even, within the noise.
    return BufferChoice("host", f"{host}: on {device} a device buffer is no faster (device_buffers=true to use one)")


def choose_overlap(preset: Preset, device: str) -> BufferChoice:
    """Resolve ``overlap_training`` (auto, true, false; off-policy only) for a plan on ``device``: ``kind`` is
    ``overlapped`` or ``sync`` (SB3's schedule)."""
    request = getattr(preset.params, "overlap_training", None)
    if request is None and preset.algo == "ppo":
        return BufferChoice("sync", "on-policy: collection and training alternate by design")
    if request is None:
        return BufferChoice("sync", f"SB3's schedule: overlapped training is for dqn and qrdqn so far, not {preset.algo}")
    source = preset.sources.get("overlap_training", "sb3_gpu default")
    if request == "false":
        return BufferChoice("sync", f"SB3's schedule: overlap_training=false ({source})")
    if request == "true":
        return BufferChoice("overlapped", f"asked for ({source}); the envs act with a policy one rollout behind")
    if device.startswith("cuda"):
        return BufferChoice(
            "overlapped",
            f"on {device}: the GPU trains on a thread of its own while the envs step, the same gradient steps per env "
            "step (overlap_training=false for SB3's exact schedule)",
        )
    # Measured on a 2-core VM (bench gpu --device cpu): the DQN CartPole preset at 0.56x-0.90x with its training on a
    # thread; the cores that would train are the ones that step the envs, and the GIL serialises the rest.
    return BufferChoice("sync", f"SB3's schedule: on {device} the training thread would compete with the envs for the cores")
