"""A run's saved state: atomic saves of model, VecNormalize statistics and replay buffer; finding the newest state
to resume from and restoring it; loading model zips without unpickling what is inside them; and the run dir's
lock and Monitor files."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch as th
from rich.console import Console
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from sb3_gpu._io import save_model, save_pickle
from sb3_gpu.errors import ConfigError
from sb3_gpu.plan import Plan
from sb3_gpu.presets import get_algo
from sb3_gpu.speed import apply_speed

# SB3 rebuilds these in ``_setup_model`` after loading, so the stored (pickled) values are never needed.
_REBUILT_ON_LOAD = ("lr_schedule", "exploration_schedule")


def first_non_finite(module: th.nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or inf, or None (one device sync when all are finite)."""
    params = [(name, p) for name, p in module.named_parameters()]
    if not params:
        return None
    finite = th.stack([th.isfinite(p.detach()).all() for _, p in params])
    if bool(finite.all()):
        return None
    return params[int((~finite).nonzero()[0, 0])][0]


def save_state(model: BaseAlgorithm, model_path: Path, vecnormalize_path: Path, replay_buffer_path: Path | None) -> None:
    """Save replay buffer and VecNormalize statistics first and the model last, each file atomically.

    The model is written last because resuming starts from the model: its companions are never older than it.
    """
    if replay_buffer_path is not None and getattr(model, "replay_buffer", None) is not None:
        save_pickle(replay_buffer_path, model.replay_buffer)  # type: ignore[attr-defined]
    vec_normalize = model.get_vec_normalize_env()
    if vec_normalize is not None:
        save_pickle(vecnormalize_path, vec_normalize)
    save_model(model, model_path)


def zip_timesteps(path: Path) -> int | None:
    """``num_timesteps`` recorded in a model zip, read from its JSON without loading the model (None if unreadable)."""
    try:
        with zipfile.ZipFile(path) as archive:
            value = json.loads(archive.read("data")).get("num_timesteps")
    except (OSError, zipfile.BadZipFile, KeyError, ValueError):
        return None
    return value if isinstance(value, int) else None


@dataclass(frozen=True)
class SavedState:
    """One resumable point of a run: a model and the files saved with it (None where absent)."""

    model: Path
    timesteps: int
    vecnormalize: Path | None
    replay_buffer: Path | None


_CHECKPOINT = re.compile(r"model_(\d+)_steps\.zip")


def saved_states(run_dir: Path) -> list[SavedState]:
    """Every readable model of a run (``model.zip`` and checkpoints), newest first."""
    found: list[SavedState] = []

    def add(model: Path, vecnormalize: Path, replay_buffer: Path) -> None:
        steps = zip_timesteps(model)
        if steps is not None:
            found.append(
                SavedState(
                    model,
                    steps,
                    vecnormalize if vecnormalize.is_file() else None,
                    replay_buffer if replay_buffer.is_file() else None,
                )
            )

    if (run_dir / "model.zip").is_file():
        add(run_dir / "model.zip", run_dir / "vecnormalize.pkl", run_dir / "replay_buffer.pkl")
    checkpoints = run_dir / "checkpoints"
    for path in checkpoints.glob("model_*_steps.zip") if checkpoints.is_dir() else []:
        match = _CHECKPOINT.fullmatch(path.name)
        if match:
            n = match.group(1)
            add(path, checkpoints / f"model_vecnormalize_{n}_steps.pkl", checkpoints / f"model_replay_buffer_{n}_steps.pkl")
    # Newest first; at equal timesteps model.zip (written at the stop) wins over a checkpoint of the same step.
    return sorted(found, key=lambda s: (s.timesteps, s.model.name == "model.zip"), reverse=True)


def _zip_data(path: Path) -> dict[str, Any]:
    try:
        with zipfile.ZipFile(path) as archive:
            data = json.loads(archive.read("data"))
    except (OSError, zipfile.BadZipFile, KeyError, ValueError) as e:
        raise ConfigError(f"{path} is not an SB3 model zip ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not an SB3 model zip (its 'data' entry is not a JSON object)")
    return data


def load_model(
    model_class: type[BaseAlgorithm],
    path: Path,
    *,
    policy: str,
    model_kwargs: dict[str, Any],
    env: VecEnv,
    device: str,
) -> BaseAlgorithm:
    """``model_class.load`` that unpickles nothing from the zip.

    SB3 stores some entries (spaces, schedules, classes) as cloudpickle, and unpickling runs code. Every such
    entry is replaced by the value this run's config gives it (taken from an unbuilt model made with the same
    arguments); a zip holding a pickled entry that the config cannot supply is refused. Weights are read with
    ``torch.load(weights_only=True)`` by SB3 itself.
    """
    serialized = sorted(k for k, v in _zip_data(path).items() if isinstance(v, dict) and ":serialized:" in v)
    template = model_class(policy, env, device="cpu", _init_setup_model=False, **model_kwargs)  # type: ignore[call-arg]
    known = vars(template)
    custom: dict[str, Any] = {}
    for key in serialized:
        if key in known:
            custom[key] = known[key]
        elif key in _REBUILT_ON_LOAD:
            custom[key] = None
        else:
            raise ConfigError(
                f"{path} stores a pickled {key!r} that this run's config cannot supply; sb3_gpu does not unpickle "
                f"model files (load it with SB3's {model_class.__name__}.load only if you trust where it came from)"
            )
    try:
        return model_class.load(str(path), env=env, device=device, custom_objects=custom)
    except Exception as e:  # a truncated or foreign zip fails in many ways inside SB3
        raise ConfigError(f"{path} is not a loadable {model_class.__name__} model ({type(e).__name__}: {e})") from None


def restore_vecnormalize(plan: Plan, env: VecEnv, state: SavedState, run_dir: Path) -> VecEnv:
    """The training env with the statistics saved beside ``state``'s model (where the preset normalises)."""
    if not isinstance(env, VecNormalize):
        return env
    if state.vecnormalize is None:
        raise ConfigError(f"--resume: {run_dir} normalised observations but holds no statistics saved with {state.model.name}")
    restored = VecNormalize.load(str(state.vecnormalize), env.venv)
    restored.training = True
    return restored


def restore_model(plan: Plan, env: VecEnv, state: SavedState, run_dir: Path, console: Console | None) -> BaseAlgorithm:
    """``state``'s model on ``env``, set up as :func:`build_model` sets up a new one, with its replay buffer."""
    preset = plan.preset
    model = load_plan_model(plan, state.model, env)
    model.tensorboard_log = str(run_dir / "tb")
    if plan.seed is not None:
        model.set_random_seed(plan.seed)
    model.preset_timesteps = preset.n_timesteps  # type: ignore[attr-defined]
    if plan.speed is not None:
        model.compile_fallback = apply_speed(model, plan.speed, preset.params.batch_size)  # type: ignore[attr-defined]
    say = (console or Console()).print
    say(f"resuming from {state.model} at {state.timesteps:,} timesteps", highlight=False)
    if not get_algo(plan.algo).on_policy:
        if state.replay_buffer is not None:
            model.load_replay_buffer(str(state.replay_buffer))  # type: ignore[attr-defined]
            size = model.replay_buffer.size() * env.num_envs  # type: ignore[attr-defined]
            say(f"replay buffer restored from {state.replay_buffer} ({size:,} transitions)", highlight=False)
        else:
            say(f"no replay buffer was saved with {state.model.name} (--save-replay-buffer keeps it): it starts empty")
    return model


def load_plan_model(plan: Plan, path: Path, env: VecEnv) -> BaseAlgorithm:
    """:func:`load_model` with the plan's class, policy and hyperparameters."""
    preset = plan.preset
    kwargs = preset.sb3_kwargs()
    return load_model(preset.model_class, path, policy=preset.policy, model_kwargs=kwargs, env=env, device=plan.device.device)


def set_monitor_files_aside(monitor: Path) -> None:
    """Keep the earlier segments' episodes: SB3's Monitor truncates its file. The plots read every *.monitor.csv."""
    if not monitor.is_dir():
        return
    segment = 1 + len({p.name.split(".")[1] for p in monitor.glob("*.seg*.monitor.csv")})
    for path in monitor.glob("*.monitor.csv"):
        if ".seg" not in path.name:
            path.rename(path.with_name(path.name.replace(".monitor.csv", f".seg{segment}.monitor.csv")))


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """One process per run dir: a second `--resume` of a running run would interleave their files."""
    with open(run_dir / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ConfigError(f"{run_dir} is in use by another sb3_gpu process (pid {f.read().strip() or '?'})") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
