"""torch's process-wide settings that a plan sets (threads, TF32, cuDNN autotuning): taken and put back as one;
waiting for a device, for timings; and torch's generators kept from work that is not the run's own."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch as th


@dataclass(frozen=True)
class TorchSettings:
    """torch's threads, TF32 matmuls and convolutions, and cuDNN's autotuning, as one value."""

    threads: int
    tf32_matmul: bool
    tf32_cudnn: bool
    cudnn_benchmark: bool

    @classmethod
    def current(cls) -> TorchSettings:
        return cls(
            th.get_num_threads(),
            th.backends.cuda.matmul.allow_tf32,
            th.backends.cudnn.allow_tf32,
            th.backends.cudnn.benchmark,
        )

    def apply(self) -> None:
        th.set_num_threads(self.threads)
        th.backends.cuda.matmul.allow_tf32 = self.tf32_matmul
        th.backends.cudnn.allow_tf32 = self.tf32_cudnn
        th.backends.cudnn.benchmark = self.cudnn_benchmark

    def with_cuda_math(self, tf32: bool, cudnn_benchmark: bool) -> TorchSettings:
        return dataclasses.replace(self, tf32_matmul=tf32, tf32_cudnn=tf32, cudnn_benchmark=cudnn_benchmark)


def synchronize(device: th.device | str) -> None:
    """Wait until ``device`` has run everything queued on it (a timing that skips this times the launches only)."""
    device = th.device(device)
    if device.type == "cuda":
        th.cuda.synchronize(device)
    elif device.type == "mps":
        th.mps.synchronize()


def own_rng(device: th.device) -> contextlib.AbstractContextManager[Any]:
    """torch's generators (the CPU's and ``device``'s) put back after the block: a timing or a compile's trial step
    must leave a seeded run's draws as they would be without it."""
    return th.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])
