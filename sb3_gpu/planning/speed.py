"""The training-speed switches: mixed precision, torch.compile, CPU threads and CUDA math flags.

``choose_speed`` decides each from the hardware, device and policy size, with the reason the plan prints;
``apply_speed`` puts the decisions into effect on a built model. ``python -m sb3_gpu.bench speed`` measures them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.common.errors import ConfigError, warn
from sb3_gpu.common.hardware import HardwareProfile
from sb3_gpu.common.torch_settings import TorchSettings
from sb3_gpu.extensions.amp import enable_amp
from sb3_gpu.extensions.compile import CompileFallbackWarning, compile_policy
from sb3_gpu.planning.device import PolicyKind

# Below these sizes a policy's matmuls are too small for lower precision or more threads to pay: per-op overhead
# and synchronisation dominate. `python -m sb3_gpu.bench speed` on a 2-core Xeon: a second thread gave 0.95x on a
# 64-wide PPO MLP, 1.12-1.15x on 256-wide PPO and DQN MLPs.
LARGE_MLP_WIDTH = 256
LARGE_MLP_BATCH = 256
LARGE_GPU_BATCH = 1024


# compile=auto compiles the gradient step where the probe has timed it faster, compile time included: on CUDA, where
# the step is replayed as a CUDA graph and the launches it saves are most of a small network's step, and on the CPU,
# where inductor fuses the step's many small ops into a few C++ loops (for long runs: compiling takes tens of seconds).
AUTO_COMPILE_UNPROBED = "auto: not probed (probe off), so not compiled"
AUTO_COMPILE_UNTIMED_DEVICE = (
    "auto compiles on CUDA and the CPU only, where the probe times it; on this device ask for it (compile=default)"
)


def compiles_auto(device: str) -> bool:
    """Whether compile=auto times the compiled step on ``device`` (MPS's compiler is too young to trust unasked)."""
    return device == "cpu" or device.startswith("cuda")


@dataclass(frozen=True)
class SpeedPlan:
    """What the speed switches resolved to, each with its reason."""

    amp: str
    amp_reason: str
    compile: str
    compile_reason: str
    threads: int
    threads_reason: str
    cudnn_benchmark: bool = False
    tf32: bool = False
    cuda_reason: str = ""
    # Whether collection's forward pass compiles with the step (auto leaves it eager where it times it slower so).
    compile_collect: bool = True

    @property
    def compile_label(self) -> str:
        return compile_label(self.compile, self.compile_collect)

    def rows(self) -> list[tuple[str, str, str]]:
        rows = [("amp", self.amp, self.amp_reason), ("compile", self.compile_label, self.compile_reason)]
        rows.append(("threads", str(self.threads), self.threads_reason))
        if self.cuda_reason:
            flags = f"cudnn.benchmark={self.cudnn_benchmark}, tf32={self.tf32}"
            rows.append(("cuda math", flags, self.cuda_reason))
        return rows


def compile_label(mode: str, collect: bool) -> str:
    """What compiles: ``false``, the mode, or the mode and ``step only`` where collection stays eager."""
    return mode + ("" if collect or mode == "false" else ", step only")


def _width(net_arch: Any) -> int:
    """The widest hidden layer (SB3's default is 64)."""
    layers = [w for value in net_arch.values() for w in value] if isinstance(net_arch, dict) else list(net_arch or [])
    return max(layers, default=64)


def choose_amp(
    request: str, device: str, policy: PolicyKind, width: int, batch_size: int, hardware: HardwareProfile
) -> tuple[str, str]:
    """``auto | off | bf16 | fp16`` -> (mode, reason)."""
    kind = device.split(":")[0]
    gpu = hardware.gpu(device) if kind == "cuda" else None
    if request == "off":
        return "off", "asked for"
    if request in ("bf16", "fp16"):
        if kind == "mps":
            raise ConfigError(f"amp={request} is not supported on Apple MPS; use amp=off")
        if request == "fp16" and gpu is None:
            raise ConfigError("amp=fp16 needs a CUDA GPU (fp16 tensor cores, loss scaling); on the CPU use bf16 or off")
        if request == "bf16" and gpu is not None and not gpu.bf16:
            sm = f"sm_{gpu.capability[0]}{gpu.capability[1]}"
            raise ConfigError(f"amp=bf16: {gpu.name} ({sm}) has no bf16 tensor cores; use fp16 (ppo, dqn, qrdqn) or off")
        if request == "bf16" and gpu is None and not hardware.cpu_bf16:
            return "bf16", "asked for; this CPU has no native bf16, so expect it slower than fp32"
        return request, "asked for"
    big_cnn = policy == "cnn"
    if kind == "mps":
        return "off", "AMP is not supported on Apple MPS here"
    if gpu is not None:
        if not gpu.fp16:
            return "off", f"{gpu.name} has no tensor cores (sm_{gpu.capability[0]}{gpu.capability[1]} < sm_70)"
        if not (big_cnn or width >= 1024 or (width >= LARGE_MLP_WIDTH and batch_size >= LARGE_GPU_BATCH)):
            return "off", f"MLP {width} wide, batch {batch_size}: too small for tensor cores to beat launch overhead"
        mode = "bf16" if gpu.bf16 else "fp16"
        what = "CNN policy" if big_cnn else f"MLP {width} wide, batch {batch_size}"
        scaling = "no loss scaling needed" if mode == "bf16" else "dynamic loss scaling"
        return mode, f"{what} on {gpu.name} tensor cores ({scaling})"
    if not hardware.cpu_amx:
        have = "AVX512-BF16 but no AMX tiles" if hardware.cpu_bf16 else "no native bf16"
        return "off", f"CPU has {have}: bf16 matmuls run no faster than fp32"
    if not (big_cnn or (width >= LARGE_MLP_WIDTH and batch_size >= LARGE_MLP_BATCH)):
        return "off", f"MLP {width} wide, batch {batch_size}: too small for AMX to pay for the casts"
    return "bf16", "CPU has AMX bf16 matrix units and the policy is large enough"


def free_cores(hardware: HardwareProfile, env_workers: int) -> int:
    """Physical cores left to torch's threads: the env workers and other busy work take theirs."""
    return max(1, hardware.physical_cores - env_workers - hardware.busy_physical_cores)


def thread_cap() -> int | None:
    """The user's ``OMP_NUM_THREADS`` (a positive count), which the automatic thread count stays within: a cluster job
    or a shared machine sets it to leave the other cores to others."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def choose_threads(
    request: int | str,
    device: str,
    policy: PolicyKind,
    width: int,
    batch_size: int,
    env_workers: int,
    hardware: HardwareProfile,
) -> tuple[int, str]:
    """``auto`` or a count -> (torch intra-op threads, reason)."""
    if request != "auto":
        if int(request) > hardware.logical_cores:  # torch accepts any count; past the cores, threads take turns
            return int(request), (
                f"asked for; warning: more than the {hardware.logical_cores} logical cores this process may use, so the "
                "threads take turns and every op waits for the last"
            )
        return int(request), "asked for"
    busy = hardware.busy_physical_cores
    free = free_cores(hardware, env_workers)
    left = f"{hardware.physical_cores} physical cores" + (f" minus {env_workers} env workers" if env_workers else "")
    left += f" minus {busy} busy with other work" if busy else ""
    if device.startswith(("cuda", "mps")):
        threads, reason = min(free, 4), f"the GPU does the math; {left}, at most 4 to feed it"
    elif policy == "mlp" and width < LARGE_MLP_WIDTH:
        return 1, f"MLP {width} wide: one thread is as fast as several on ops this small"
    else:
        threads, reason = free, f"{'CNN' if policy == 'cnn' else f'MLP {width} wide, batch {batch_size}'}: {left}"
    cap = thread_cap()
    if cap is not None and threads > cap:
        return cap, f"{reason}; at most OMP_NUM_THREADS={cap}"
    return threads, reason


def choose_speed(
    amp: str,
    compile_mode: str,
    threads: int | str,
    *,
    device: str,
    policy: PolicyKind,
    net_arch: Any,
    batch_size: int,
    env_workers: int,
    hardware: HardwareProfile,
) -> SpeedPlan:
    """Resolve the speed switches for a plan."""
    width = _width(net_arch)
    amp_mode, amp_reason = choose_amp(amp, device, policy, width, batch_size, hardware)
    n_threads, threads_reason = choose_threads(threads, device, policy, width, batch_size, env_workers, hardware)
    if compile_mode == "auto":
        compile_mode, compile_reason = "false", AUTO_COMPILE_UNPROBED
        if not compiles_auto(device):
            compile_mode, compile_reason = "false", AUTO_COMPILE_UNTIMED_DEVICE
    elif compile_mode == "false":
        compile_reason = "asked for"
    else:
        compile_reason = "asked for; training goes on uncompiled, with the reason, if compilation fails"
    cudnn_benchmark = tf32 = False
    cuda_reason = ""
    if device.startswith("cuda"):
        gpu = hardware.gpu(device)
        cudnn_benchmark = policy == "cnn"
        tf32 = gpu.bf16  # Ampere and newer
        cuda_reason = ("cuDNN picks the fastest convolutions for the fixed image size; " if cudnn_benchmark else "") + (
            "TF32 matmuls on Ampere+ (10-bit mantissa inputs, fp32 accumulation)" if tf32 else "no TF32 before Ampere"
        )
    return SpeedPlan(
        amp_mode, amp_reason, compile_mode, compile_reason, n_threads, threads_reason, cudnn_benchmark, tf32, cuda_reason
    )


def apply_torch_settings(speed: SpeedPlan) -> None:
    """``speed``'s torch threads and, on CUDA, math switches, for the whole process. Set before a model is built as
    well as after: the initial weights depend on the thread count (PPO's orthogonal init, a QR decomposition), and a
    seeded build must not depend on what the process ran before it (a notebook's earlier cell)."""
    settings = dataclasses.replace(TorchSettings.current(), threads=speed.threads)
    if speed.cuda_reason:  # a CUDA plan; a CPU one leaves the CUDA math switches as they are
        settings = settings.with_cuda_math(speed.tf32, speed.cudnn_benchmark)
    settings.apply()


def apply_speed(model: BaseAlgorithm, speed: SpeedPlan, batch_size: int) -> str | None:
    """Put ``speed`` into effect on ``model``; returns why compilation fell back, if it did."""
    apply_torch_settings(speed)
    if speed.amp != "off":
        enable_amp(model, speed.amp)
    if speed.compile == "false":
        return None
    # SAC's family compiles through compile_step (its whole step and its action forward pass), not its networks apart;
    # the others' networks compile for collection here, unless the plan leaves collection eager.
    networks = speed.compile_collect and not getattr(model, "compiles_step_only", False)
    failed = compile_policy(model, speed.compile, batch_size) if networks else None
    compile_step = getattr(model, "compile_step", None)  # PPO's and the DQN family's gradient step, compiled whole
    if failed is None and compile_step is not None:
        refused = compile_step(speed.compile, collect=speed.compile_collect)
        if refused:  # the step stays torch's, and the user is told why
            rest = "" if speed.compile_collect else "; collection stays eager too, so nothing is compiled"
            warn(f"the gradient step is not compiled whole: {refused}{rest}", CompileFallbackWarning)
    return failed
