"""Shared fixtures: fake machines for device decisions, and a subprocess runner for the CLIs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sb3_gpu.hardware import GPUInfo, HardwareProfile

REPO = Path(__file__).resolve().parent.parent


def machine(
    gpus: int = 0,
    capability: tuple[int, int] = (8, 0),
    mps: bool = False,
    cores: int = 8,
    cpu_bf16: bool = False,
    cpu_amx: bool = False,
    gpu_name: str = "Fake A100",
) -> HardwareProfile:
    """A HardwareProfile for a machine we do not have."""
    return HardwareProfile(
        logical_cores=cores,
        physical_cores=cores,
        ram_gb=64.0,
        cpu_model="Fake CPU",
        cpu_bf16=cpu_bf16 or cpu_amx,
        gpus=tuple(GPUInfo(i, gpu_name, 40.0, capability) for i in range(gpus)),
        mps=mps,
        in_notebook=False,
        in_colab=False,
        cpu_amx=cpu_amx,
    )


@pytest.fixture
def cpu_machine() -> HardwareProfile:
    return machine()


@pytest.fixture
def gpu_machine() -> HardwareProfile:
    return machine(gpus=2)


def run_cli(*args: str, cwd: Path | str | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m <args>`` as a user would, and capture its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
