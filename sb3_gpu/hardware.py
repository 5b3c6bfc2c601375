"""What machine this is, and which torch device a model should train on (with the reason)."""

from __future__ import annotations

import os
import platform
import re
import sys
from dataclasses import dataclass
from typing import Literal

import torch as th

from sb3_gpu.errors import ConfigError

PolicyKind = Literal["mlp", "cnn", "multi"]


@dataclass(frozen=True)
class GPUInfo:
    """One CUDA device as torch reports it."""

    index: int
    name: str
    memory_gb: float
    capability: tuple[int, int]

    @property
    def bf16(self) -> bool:
        # Ampere (8.0) and newer run bf16 on tensor cores; older cards emulate it slowly.
        return self.capability >= (8, 0)

    @property
    def fp16(self) -> bool:
        # Volta (7.0) introduced tensor cores; fp16 before that brings no speed-up.
        return self.capability >= (7, 0)


@dataclass(frozen=True)
class HardwareProfile:
    """The machine as far as training decisions care."""

    logical_cores: int
    physical_cores: int
    ram_gb: float
    cpu_model: str
    cpu_bf16: bool
    gpus: tuple[GPUInfo, ...]
    mps: bool
    in_notebook: bool
    in_colab: bool
    # AMX tiles: bf16 matrix units (Sapphire Rapids and newer), where CPU bf16 training pays.
    cpu_amx: bool = False

    @property
    def has_cuda(self) -> bool:
        return len(self.gpus) > 0

    def describe(self) -> str:
        """One line, e.g. ``2 cores (2 physical), 23.4 GiB RAM, no GPU``."""
        cpu = f"{self.logical_cores} cores ({self.physical_cores} physical), {self.ram_gb:.1f} GiB RAM"
        if self.gpus:
            gpu = ", ".join(
                f"cuda:{g.index} {g.name} {g.memory_gb:.0f} GiB sm_{g.capability[0]}{g.capability[1]}" for g in self.gpus
            )
        elif self.mps:
            gpu = "Apple MPS"
        else:
            gpu = "no GPU"
        where = " (Colab)" if self.in_colab else " (notebook)" if self.in_notebook else ""
        return f"{cpu}, {gpu}{where}"


@dataclass(frozen=True)
class DeviceChoice:
    """The device to train on, whether the preset's ``gpu`` profile applies, and why."""

    device: str
    reason: str

    @property
    def profile(self) -> Literal["cpu", "gpu"]:
        return "cpu" if self.device == "cpu" else "gpu"


def _cpu_info() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return model, flags
    if m := re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE):
        model = m.group(1).strip()
    if m := re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE):
        flags = set(m.group(1).split())
    return model, flags


def _physical_cores(logical: int) -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or logical
    except ImportError:  # pragma: no cover - psutil is a dependency, but keep the probe harmless without it
        return logical


def _ram_gb() -> float:
    try:
        import psutil

        return psutil.virtual_memory().total / 2**30
    except ImportError:  # pragma: no cover
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _in_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and type(shell).__name__ in {"ZMQInteractiveShell", "Shell"}


def detect_hardware() -> HardwareProfile:
    """Query the machine; every GPU query goes through ``torch.cuda`` / ``torch.backends.mps`` so tests can fake it."""
    logical = os.cpu_count() or 1
    model, flags = _cpu_info()
    gpus: list[GPUInfo] = []
    if th.cuda.is_available():
        for i in range(th.cuda.device_count()):
            props = th.cuda.get_device_properties(i)
            gpus.append(GPUInfo(i, props.name, props.total_memory / 2**30, (props.major, props.minor)))
    mps = bool(getattr(th.backends, "mps", None) and th.backends.mps.is_available())
    return HardwareProfile(
        logical_cores=logical,
        physical_cores=_physical_cores(logical),
        ram_gb=_ram_gb(),
        cpu_model=model,
        # AVX512-BF16 or AMX tiles: the CPU multiplies bf16 natively (other CPUs emulate it, slower than fp32).
        cpu_bf16=bool(flags & {"avx512_bf16", "amx_bf16"}),
        gpus=tuple(gpus),
        mps=mps,
        in_notebook=_in_notebook(),
        in_colab="google.colab" in sys.modules,
        cpu_amx="amx_bf16" in flags,
    )


_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(?::(\d+))?)$")


def choose_device(requested: str, policy: PolicyKind, on_policy: bool, hardware: HardwareProfile) -> DeviceChoice:
    """Resolve ``auto | cpu | cuda | cuda:N | mps`` for a policy kind and algorithm family.

    ``auto`` follows what is known about SB3: CNN policies train much faster on a GPU; MLP policies of on-policy
    algorithms (PPO, A2C) train faster on the CPU, because each rollout step is a tiny batch whose transfer costs
    more than its compute (SB3 issue 1245). Off-policy MLP policies train on a GPU in batches, so they keep it.
    """
    match = _DEVICE_RE.match(requested.strip().lower())
    if match is None:
        raise ConfigError(f"unknown device {requested!r}; accepted: auto, cpu, cuda, cuda:N, mps")
    req = match.group(1)
    if req == "cpu":
        return DeviceChoice("cpu", "asked for")
    if req.startswith("cuda"):
        if not hardware.has_cuda:
            raise ConfigError(
                f"--device {req} asked for a CUDA GPU, but torch sees none (torch {th.__version__}); use --device cpu or auto"
            )
        index = int(match.group(2) or 0)
        if index >= len(hardware.gpus):
            raise ConfigError(f"--device {req}: only cuda:0..cuda:{len(hardware.gpus) - 1} exist on this machine")
        return DeviceChoice(f"cuda:{index}", f"asked for ({hardware.gpus[index].name})")
    if req == "mps":
        if not hardware.mps:
            raise ConfigError("--device mps asked for Apple's MPS backend, which torch reports unavailable; use cpu or auto")
        return DeviceChoice("mps", "asked for")

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
