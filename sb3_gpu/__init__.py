"""sb3_gpu: Stable-Baselines3 presets, vec envs and tools that fit the hardware at hand.

Three lines in a notebook::

    from sb3_gpu import make_model
    model = make_model("ppo", "CartPole-v1", device="auto")
    model.learn(model.preset_timesteps)
"""

from sb3_gpu.accumulate import GradAccumPPO
from sb3_gpu.amp import enable_amp
from sb3_gpu.envs import VecEnvFallbackWarning, make_vec_env
from sb3_gpu.errors import ConfigError, EnvWorkerError, StopNow, TrainingDiverged
from sb3_gpu.hardware import HardwareProfile, choose_device, detect_hardware
from sb3_gpu.plan import Plan, build_env, build_model, make_model, make_plan
from sb3_gpu.run import evaluate_run, resume_run, train_run

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "EnvWorkerError",
    "GradAccumPPO",
    "HardwareProfile",
    "Plan",
    "StopNow",
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
    "resume_run",
    "train_run",
]
