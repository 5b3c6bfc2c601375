"""Which torch device a model trains on, and why."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch as th

from sb3_gpu.common.checks import bool_arg
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.hardware import HardwareProfile

PolicyKind = Literal["mlp", "cnn", "multi"]


@dataclass(frozen=True)
class DeviceChoice:
    """The device to train on, whether the preset's ``gpu`` profile applies, and why."""

    device: str
    reason: str

    @property
    def profile(self) -> Literal["cpu", "gpu"]:
        return "cpu" if self.device == "cpu" else "gpu"


def device_text(device: str | th.device) -> str:
    """A device as the plan names it: SB3's ``th.device`` taken by its text (``cuda:0``)."""
    if isinstance(device, th.device):
        return device.type if device.type in ("cpu", "mps") else str(device)  # torch numbers these too: cpu:0
    return device


_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(?::(\d+))?)$")


def requested_device(requested: str, hardware: HardwareProfile) -> DeviceChoice | None:
    """The device asked for, checked against this machine (None for ``auto``): a plan checks it before it builds
    the env, so that a device this machine lacks is the first and only thing the user reads."""
    if not isinstance(requested, str):
        raise ConfigError(f"device must be a string: auto, cpu, cuda, cuda:N or mps; got {requested!r}")
    match = _DEVICE_RE.match(requested.strip().lower())
    if match is None:
        raise ConfigError(f"unknown device {requested!r}; accepted: auto, cpu, cuda, cuda:N, mps")
    req = match.group(1)
    if req == "cpu":
        return DeviceChoice("cpu", "asked for")
    if req.startswith("cuda"):
        if not hardware.has_cuda:
            raise ConfigError(
                f"device {req!r} asked for a CUDA GPU, but torch sees none (torch {th.__version__}); use cpu or auto"
            )
        index = int(match.group(2) or 0)
        if index >= len(hardware.gpus):
            raise ConfigError(f"device {req!r}: only cuda:0..cuda:{len(hardware.gpus) - 1} exist on this machine")
        return DeviceChoice(f"cuda:{index}", f"asked for ({hardware.gpus[index].name})")
    if req == "mps":
        if not hardware.mps:
            raise ConfigError("device 'mps' asked for Apple's MPS backend, which torch reports unavailable; use cpu or auto")
        return DeviceChoice("mps", "asked for")
    return None


def choose_device(requested: str | th.device, policy: PolicyKind, on_policy: bool, hardware: HardwareProfile) -> DeviceChoice:
    """Resolve ``auto | cpu | cuda | cuda:N | mps`` for a policy kind and algorithm family.

    ``auto`` follows what is known about SB3: CNN policies train much faster on a GPU; MLP and dict-observation
    (``multi``) policies of on-policy algorithms (PPO) train faster on the CPU, because each rollout step is a tiny
    batch whose transfer costs more than its compute (SB3 issue 1245). Off-policy ones train on a GPU in batches,
    so they keep it.
    """
    if policy not in ("mlp", "cnn", "multi"):
        raise ConfigError(f"policy must be 'mlp', 'cnn' or 'multi' (the policy's kind), got {policy!r}")
    bool_arg(on_policy, "on_policy")
    if not isinstance(hardware, HardwareProfile):
        raise ConfigError(f"hardware must be a HardwareProfile (from detect_hardware()), got {hardware!r}")
    asked = requested_device(device_text(requested), hardware)
    if asked is not None:
        return asked

    gpu_name = hardware.gpus[0].name if hardware.has_cuda else "MPS" if hardware.mps else None
    if gpu_name is None:
        return DeviceChoice("cpu", "no CUDA or MPS device found")
    gpu = "cuda:0" if hardware.has_cuda else "mps"
    if policy == "cnn":
        return DeviceChoice(gpu, f"CNN policy: convolutions are much faster on {gpu_name}")
    if on_policy:
        return DeviceChoice(
            "cpu",
            f"{policy.upper()} policy of an on-policy algorithm: the CPU is faster than {gpu_name} here "
            "(tiny per-step batches; SB3 issue 1245). Pass --device cuda to use the GPU anyway",
        )
    return DeviceChoice(gpu, f"off-policy {policy.upper()} policy trains in replay batches: {gpu_name}")
