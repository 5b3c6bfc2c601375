"""sb3_gpu: Stable-Baselines3 presets, vec envs and tools that fit the hardware at hand.

Three lines in a notebook::

    from sb3_gpu import make_model
    model, timesteps = make_model("ppo", "CartPole-v1", device="auto")
    model.learn(timesteps)

The package is layered, each layer importing only those before it: ``common`` (hardware facts, atomic files,
checks), ``envs`` and ``extensions`` (vec envs; AMP, accumulation, prioritized replay), ``config`` (presets),
``planning`` (the Plan and what it builds), ``runs`` (run dirs and the training Session), ``tuning`` and
``benches``, and the command-line entry points. The names below are the public API; they load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sb3_gpu.common.version import __version__ as __version__

# Public name -> the module that defines it.
_EXPORTS = {
    "ConfigError": "sb3_gpu.common.errors",
    "EnvWorkerError": "sb3_gpu.common.errors",
    "StopNow": "sb3_gpu.common.errors",
    "TrainingDiverged": "sb3_gpu.common.errors",
    "HardwareProfile": "sb3_gpu.common.hardware",
    "detect_hardware": "sb3_gpu.common.hardware",
    "VecEnvFallbackWarning": "sb3_gpu.envs.choice",
    "make_vec_env": "sb3_gpu.envs.build",
    "GradAccumPPO": "sb3_gpu.extensions.accumulate",
    "enable_amp": "sb3_gpu.extensions.amp",
    "choose_device": "sb3_gpu.planning.device",
    "Plan": "sb3_gpu.planning.plan",
    "make_plan": "sb3_gpu.planning.plan",
    "PresetModel": "sb3_gpu.planning.build",
    "build_env": "sb3_gpu.planning.build",
    "build_model": "sb3_gpu.planning.build",
    "make_model": "sb3_gpu.planning.build",
    "EvaluationStopped": "sb3_gpu.runs.evaluation",
    "evaluate_run": "sb3_gpu.runs.evaluation",
    "ReturnFreeMemory": "sb3_gpu.runs.callbacks",
    "record_video": "sb3_gpu.runs.video",
    "resume_run": "sb3_gpu.runs.training",
    "ThroughputCallback": "sb3_gpu.runs.telemetry",
    "train_run": "sb3_gpu.runs.training",
}

__all__ = [
    "ConfigError",
    "EnvWorkerError",
    "EvaluationStopped",
    "GradAccumPPO",
    "HardwareProfile",
    "Plan",
    "PresetModel",
    "ReturnFreeMemory",
    "StopNow",
    "ThroughputCallback",
    "TrainingDiverged",
    "VecEnvFallbackWarning",
    "build_env",
    "build_model",
    "choose_device",
    "detect_hardware",
    "enable_amp",
    "evaluate_run",
    "make_model",
    "make_plan",
    "make_vec_env",
    "record_video",
    "resume_run",
    "train_run",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sb3_gpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from sb3_gpu.common.errors import ConfigError, EnvWorkerError, StopNow, TrainingDiverged
    from sb3_gpu.common.hardware import HardwareProfile, detect_hardware
    from sb3_gpu.envs.build import make_vec_env
    from sb3_gpu.envs.choice import VecEnvFallbackWarning
    from sb3_gpu.extensions.accumulate import GradAccumPPO
    from sb3_gpu.extensions.amp import enable_amp
    from sb3_gpu.planning.build import PresetModel, build_env, build_model, make_model
    from sb3_gpu.planning.device import choose_device
    from sb3_gpu.planning.plan import Plan, make_plan
    from sb3_gpu.runs.callbacks import ReturnFreeMemory
    from sb3_gpu.runs.evaluation import EvaluationStopped, evaluate_run
    from sb3_gpu.runs.telemetry import ThroughputCallback
    from sb3_gpu.runs.training import resume_run, train_run
    from sb3_gpu.runs.video import record_video
