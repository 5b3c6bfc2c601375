"""Saving a model with its companions (VecNormalize statistics, replay buffer), each file atomically; and loading
models back without unpickling what is inside their zips."""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from sb3_gpu.common.checks import plain_numbers
from sb3_gpu.common.errors import ConfigError, named
from sb3_gpu.common.hardware import host_available_bytes
from sb3_gpu.common.io import keep_previous, load_pickle, put_back_cut_short, save_model, save_pickle
from sb3_gpu.config.schema import ALGOS, get_algo
from sb3_gpu.envs.spec import space_text
from sb3_gpu.extensions.amp import record_loss_scale
from sb3_gpu.extensions.continuous import NormedCritics
from sb3_gpu.extensions.replay import DeviceReplayBuffer, end_episodes_under_way, size_text
from sb3_gpu.extensions.stepping import entropy_optimizer, policy_optimizers, settle_guards
from sb3_gpu.planning.build import model_class, model_kwargs
from sb3_gpu.planning.optimizers import fuse_loaded
from sb3_gpu.planning.plan import Plan
from sb3_gpu.planning.speed import apply_speed
from sb3_gpu.runs.rundir import RunDir, SavedState, StateFiles, read_zip_data

# SB3 rebuilds these in ``_setup_model`` after loading, so the stored (pickled) values are never needed.
_REBUILT_ON_LOAD = ("lr_schedule", "exploration_schedule")
# The replay buffer is this plan's, not the saved run's: a run on a GPU's buffer computes its n-step returns itself
# (n_steps in replay_buffer_kwargs, 1 on the algorithm), and SB3's buffer that a CPU plan loads it into takes them as
# the algorithm's n_steps.
_PLANNED_BUFFER = ("replay_buffer_class", "replay_buffer_kwargs", "n_steps", "optimize_memory_usage")

# What the pickles of a run dir may name: numpy arrays and generators, Gymnasium spaces, and the statistics and
# buffer classes themselves. Nothing else is unpickled, so a run dir from elsewhere cannot run code through them.
_DATA = {
    "builtins": {"bytes", "slice"},
    "__builtin__": {"bytes"},  # pickle protocol 2 spells builtins so, and writes bytes through _codecs.encode
    "_codecs": {"encode"},
    "collections": {"OrderedDict"},
    "numpy": {"dtype", "ndarray"},
    **{f"numpy.{core}.multiarray": {"_reconstruct", "scalar"} for core in ("core", "_core")},  # numpy 1 and 2
    **{f"numpy.{core}.numeric": {"_frombuffer"} for core in ("core", "_core")},  # arrays in protocol 5
    "numpy.random._pickle": {"__bit_generator_ctor", "__generator_ctor", "__randomstate_ctor"},
    "numpy.random._pcg64": {"PCG64", "PCG64DXSM"},
    "numpy.random._mt19937": {"MT19937"},
    "numpy.random._philox": {"Philox"},
    "numpy.random._sfc64": {"SFC64"},
    "numpy.random.bit_generator": {"SeedSequence", "__pyx_unpickle_SeedSequence"},
    **{f"gymnasium.spaces.{m}": {c} for m, c in (("box", "Box"), ("discrete", "Discrete"), ("dict", "Dict"))},
    **{f"gymnasium.spaces.{m}": {c} for m, c in (("multi_discrete", "MultiDiscrete"), ("multi_binary", "MultiBinary"))},
    "gymnasium.spaces.tuple": {"Tuple"},
}
VECNORMALIZE_PICKLE = {
    **_DATA,
    "stable_baselines3.common.vec_env.vec_normalize": {"VecNormalize"},
    "stable_baselines3.common.running_mean_std": {"RunningMeanStd"},
}
REPLAY_BUFFER_PICKLE = {
    **_DATA,
    "torch": {"device"},
    "stable_baselines3.common.buffers": {"ReplayBuffer", "DictReplayBuffer", "NStepReplayBuffer"},
    "sb3_gpu.extensions.per.buffer": {"PrioritizedReplayBuffer"},
    "sb3_gpu.extensions.replay": {"DeviceReplayBuffer"},
    "sb3_gpu.extensions.per.tree": {"SumMinTree"},
    "sb3_gpu.extensions.per.device": {"DevicePrioritizedReplayBuffer", "DeviceSumMinTree"},
    "sb3_gpu.extensions.per": {"PrioritizedReplayBuffer", "SumMinTree"},  # as sb3_gpu 0.1 named them (_MOVED)
}
# Where the classes that sb3_gpu 0.1 saved from its top-level module are now.
_MOVED = {"sb3_gpu.per": "sb3_gpu.extensions.per"}


def load_vecnormalize(path: Path, venv: VecEnv) -> VecNormalize:
    """VecNormalize statistics saved by a run, on ``venv`` (SB3's ``VecNormalize.load``, unpickling only data)."""
    stats = load_pickle(path, VECNORMALIZE_PICKLE, "VecNormalize statistics file")
    if not isinstance(stats, VecNormalize):
        raise ConfigError(f"{path} holds a {type(stats).__name__}, not VecNormalize statistics")
    held, wanted = space_text(getattr(stats, "observation_space", None)), space_text(venv.observation_space)
    if held != wanted:
        raise ConfigError(
            f"{path} holds statistics of observations {held}, and the env's are {wanted}: they are another env's "
            "(use the ones saved with the model)"
        )
    try:
        stats.set_venv(venv)
    except (AssertionError, ValueError) as e:  # SB3's own check of the shapes
        raise ConfigError(f"{path} holds statistics that do not fit the env: {named(e)}") from None
    return stats


def load_replay_buffer(model: BaseAlgorithm, path: Path) -> None:
    """Give ``model`` the replay buffer saved at ``path`` (SB3's ``load_replay_buffer``, unpickling only data)."""
    # The empty buffer the model was built with goes first: a device buffer of over half the GPU's free memory
    # would not fit beside it.
    model.replay_buffer = None  # type: ignore[attr-defined]
    if getattr(model, "_fixed_buffer", None) is not None:  # a compiled step's hold on it: it fixes the new one
        model._fixed_buffer = None  # type: ignore[attr-defined]
    try:
        buffer = load_pickle(path, REPLAY_BUFFER_PICKLE, "replay buffer", moved=_MOVED)
    except ConfigError as e:  # cut short by a kill or a full disk, say: the run itself can go on without it
        raise ConfigError(f"{e} (move it away to resume with an empty one)") from None
    if not isinstance(buffer, ReplayBuffer):
        raise ConfigError(f"{path} holds a {type(buffer).__name__}, not a replay buffer")
    held = buffer.n_envs, space_text(buffer.observation_space), space_text(buffer.action_space)
    wanted = model.n_envs, space_text(model.observation_space), space_text(model.action_space)
    if held != wanted:
        # Its first added step would fail deep in SB3, and the run, saving it again as its own, could never resume.
        raise ConfigError(
            f"{path} holds transitions of {held[0]} env(s) with observations {held[1]} and actions {held[2]}; this "
            f"run has {wanted[0]} with {wanted[1]} and {wanted[2]}: it is another run's buffer (move it away to "
            "resume with an empty one)"
        )
    buffer.device = model.device  # saved on another machine, maybe: it samples onto this model's device
    end_episodes_under_way(buffer)  # the resumed run resets its envs
    model.replay_buffer = buffer  # type: ignore[attr-defined]


def save_state(model: BaseAlgorithm, files: StateFiles, *, replay_buffer: bool) -> str | None:
    """Save the VecNormalize statistics, the model and then the replay buffer (if asked), each atomically.

    The model comes before the buffer, which can take gigabytes and minutes to write and can fail where the model
    would not (a full disk, the host's memory, a second Ctrl-C): the model is what must be kept. The previous buffer
    is removed once the new model is written, so a buffer on disk is never older than the model beside it; resuming
    without one starts with an empty buffer and says so.

    :return: why the replay buffer was not saved, where it was asked for and failed; else None
    """
    _finish_training(model)
    vec_normalize = model.get_vec_normalize_env()
    # A failed or stopped model write puts the old statistics back: they never pair with a model they were not saved with.
    if vec_normalize is not None:
        put_back_cut_short(files.vecnormalize, files.model)
    restore = keep_previous(files.vecnormalize) if vec_normalize is not None else None
    try:
        if vec_normalize is not None:
            save_pickle(files.vecnormalize, vec_normalize)
        record_loss_scale(model)
        save_model(model, files.model)
    except BaseException:
        if restore is not None:
            restore(True)
        raise
    if restore is not None:
        restore(False)
    files.replay_buffer.unlink(missing_ok=True)  # the previous model's: after a failed model write it stays with it
    if not replay_buffer or getattr(model, "replay_buffer", None) is None:
        return None
    try:
        bad = non_finite_transition(model.replay_buffer)  # type: ignore[attr-defined]
        if bad is not None:  # a run resumed with it would sample it and stop again, as often as it is resumed
            return f"the replay buffer was not saved: it holds {bad}, which a resumed run would sample again"
        short = host_memory_short(model.replay_buffer)  # type: ignore[attr-defined]
        if short is not None:  # the copy would not raise MemoryError: the kernel would kill the process, model and all
            return f"the replay buffer was not saved: {short}"
        save_pickle(files.replay_buffer, model.replay_buffer)  # type: ignore[attr-defined]
    except Exception as e:  # MemoryError and pickling errors too: the model is saved, only the buffer is lost
        return f"the replay buffer was not saved ({named(e)})"
    return None


# The share of the host's available memory a device buffer's copy may take while it is saved: the rest is the
# pickle's own working memory and the other processes'.
_SAVE_SHARE = 0.8


def host_memory_short(buffer: Any) -> str | None:
    """Why a device replay buffer cannot be copied to the host to be saved (its storage is larger than the host memory
    available to take it), or None where it can, or where nothing is copied (SB3's buffers, a buffer on the CPU)."""
    needed = buffer.host_copy_bytes() if isinstance(buffer, DeviceReplayBuffer) else 0
    available = host_available_bytes()
    if needed > _SAVE_SHARE * available:
        return (
            f"its {size_text(needed)} on {buffer.device} would be copied to host memory to be written, and only "
            f"{size_text(available)} is available"
        )
    return None


_SCANNED_BYTES = 1 << 26  # read 64 MiB of a buffer at a time: the scan's memory stays small beside gigabytes


def non_finite_transition(buffer: Any) -> str | None:
    """The first NaN or inf in a replay buffer's rewards, observations or actions, said as "a NaN or inf reward
    (buffer row 399)", or None. Integer storage (uint8 frames) holds none. Read once per save, never in training."""
    fields: list[tuple[str, Any]] = []
    for name in ("rewards", "observations", "next_observations", "actions"):
        value = getattr(buffer, name, None)
        fields += [(name, array) for array in (value.values() if isinstance(value, dict) else [value])]
    if isinstance(buffer, DeviceReplayBuffer):  # its memory-optimised layout keeps episode ends' next observations aside
        fields.append(("episode_end_observations", buffer.episode_end_observations()))
    for name, array in fields:
        row = _first_non_finite_row(array)
        if row is not None:
            return f"a NaN or inf {name.removesuffix('s').replace('_', ' ')} (buffer row {row:,})"
    return None


def _first_non_finite_row(array: Any) -> int | None:
    host = isinstance(array, np.ndarray) and np.issubdtype(array.dtype, np.floating)
    if not (host or (isinstance(array, th.Tensor) and array.is_floating_point())) or len(array) == 0:
        return None
    row_bytes = array[0].nbytes if host else array[0].numel() * array.element_size()
    step = max(1, _SCANNED_BYTES // max(1, row_bytes))
    for start in range(0, len(array), step):
        chunk = array[start : start + step]
        if host:
            rows = np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
        else:  # reduced where the buffer is, so that only a flag per row crosses to the host
            rows = th.isfinite(chunk).reshape(len(chunk), -1).all(dim=1).cpu().numpy()
        if not rows.all():
            return start + int(np.argmin(rows))
    return None


def non_finite_statistics(model: BaseAlgorithm) -> str | None:
    """The first VecNormalize statistic in use (``obs_rms`` where observations are normalised, ``ret_rms`` where
    rewards are) holding a NaN or inf, or None. One NaN observation or reward poisons them for good, while the weights
    may still be finite: such statistics are never saved, as NaN weights are not."""
    vec_normalize = model.get_vec_normalize_env()
    if vec_normalize is None:
        return None
    used: list[tuple[str, Any]] = [("obs_rms", vec_normalize.obs_rms)] if vec_normalize.norm_obs else []
    used += [("ret_rms", vec_normalize.ret_rms)] if vec_normalize.norm_reward else []
    for name, rms in used:
        for key, stats in rms.items() if isinstance(rms, dict) else [(None, rms)]:
            for field in ("mean", "var"):
                if not np.all(np.isfinite(getattr(stats, field))):
                    return f"VecNormalize's {name}{'' if key is None else f'[{key!r}]'}.{field}"
    return None


def calls_from_the_models_steps(callback: BaseCallback) -> None:
    """Start ``callback.n_calls`` (SB3 counts its calls from 0 in each ``learn``) at the calls the model's timesteps
    stand for: a resumed run then evaluates and checkpoints at the timesteps a run never stopped would, and a resumed
    part shorter than the interval still reaches its next one. Call it from the callback's ``_init_callback``."""
    callback.n_calls = callback.model.num_timesteps // callback.model.n_envs


def settle_training(model: BaseAlgorithm) -> None:
    """Before a checkpoint or an evaluation: wait for an overlapped training still running (its steps count too), then
    read the NaN guard's device-side flags, raising its error where a step was skipped since the last log write."""
    _finish_training(model)
    settle_guards(model)


def _finish_training(model: BaseAlgorithm) -> None:
    """Overlapped training: let the training running in the background finish and its transitions land."""
    sync = getattr(model, "sync_training", None)
    if sync is not None:
        sync()


def load_model(
    model_class: type[BaseAlgorithm],
    path: Path,
    *,
    policy: str,
    model_kwargs: dict[str, Any],
    env: VecEnv,
    device: str,
    hyperparameters: str | None = None,
) -> BaseAlgorithm:
    """``model_class.load`` that unpickles nothing from the zip.

    SB3 stores some entries (spaces, schedules, classes) as cloudpickle, and unpickling runs code. Every such
    entry is replaced by the value this run's config gives it (taken from an unbuilt model made with the same
    arguments); a zip holding a pickled entry that the config cannot supply is refused. Weights are read with
    ``torch.load(weights_only=True)`` by SB3 itself. ``hyperparameters`` (:func:`hyperparameters_record`) is what the
    zip must have recorded, where it recorded any.
    """
    data = read_zip_data(path)
    with warnings.catch_warnings():
        # The template is never trained: PPO's warning that a minibatch does not divide the rollout of this env (one
        # evaluation env, where training had several) would be false.
        warnings.filterwarnings("ignore", message="You have specified a mini-batch size")
        template = model_class(policy, env, device="cpu", _init_setup_model=False, **model_kwargs)  # type: ignore[call-arg]
    _check_same_algorithm(path, data, template)
    _check_same_spaces(path, data, template)
    if hyperparameters is not None:
        _check_same_hyperparameters(path, data.get(HYPERPARAMETERS), hyperparameters)
    serialized = sorted(k for k, v in data.items() if isinstance(v, dict) and ":serialized:" in v)
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
    # Given as load's keyword arguments, which SB3 sets after the zip's entries, whether or not the zip holds them.
    planned = {key: known[key] for key in _PLANNED_BUFFER} if isinstance(template, OffPolicyAlgorithm) else {}
    try:
        model = model_class.load(str(path), env=env, device=device, custom_objects=custom, **planned)
    except Exception as e:  # a truncated or foreign zip fails in many ways inside SB3
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "size mismatch" in str(e):  # torch lists every tensor that differs, one per line
            first = "its networks' shapes differ from the ones this config's env and net_arch give"
        elif "Weights only load failed" in str(e):  # torch's text goes on to advise the unsafe load: not repeated
            first = "its weights (a .pth member) are damaged, or hold more than plain tensors"
        raise ConfigError(f"{path} is not a loadable {model_class.__name__} model ({type(e).__name__}: {first})") from None
    entropy = entropy_optimizer(model)
    # A plan's fused optimizers: the zip's own policy_kwargs, and the saved groups' flags, are what SB3 and torch load.
    fuse = ((model_kwargs.get("policy_kwargs") or {}).get("optimizer_kwargs") or {}).get("fused")
    for optimizer in [*policy_optimizers(model.policy), *([entropy] if entropy is not None else [])]:
        if fuse:
            fuse_loaded(optimizer)
        _capturable_as_loaded(optimizer, model.device)
    return model


def _check_same_spaces(path: Path, data: dict[str, Any], template: BaseAlgorithm) -> None:
    """Refuse a model trained on other observation or action spaces than the env it is loaded with has (an env named
    in place of the run's own, say), read from what the zip records of them as text: their pickles are never loaded,
    and the template's own spaces stand in for them, so SB3's load would only fail at the weights' shapes."""
    for name in ("observation_space", "action_space"):
        if not isinstance(data.get(name), dict):  # not recorded: SB3's load says so itself
            continue
        recorded, space = space_text(data[name]), getattr(template, name)
        if recorded is not None and recorded != space_text(space):
            raise ConfigError(
                f"{path} was trained on an env with {name.replace('_', ' ')} {recorded}; the env it is loaded with "
                f"has {space_text(space)}: evaluate or resume it on the env it trained on"
            )


def _capturable_as_loaded(optimizer: th.optim.Optimizer, device: th.device) -> None:
    """``capturable`` for the device the optimizer was loaded on. A GPU run's graph-captured Adam kept its step counts
    on the device and was capturable; zips leave the flag out (older ones hold it). On a CPU torch's Adam refuses to
    step with it. On a GPU an unfused Adam whose counts SB3 loaded onto the device takes it again: without it, torch
    reads each count back to the host at every step."""
    for group in optimizer.param_groups:
        if "capturable" not in group:
            continue
        steps = [optimizer.state[p].get("step") for p in group["params"]]
        on_device = all(isinstance(t, th.Tensor) and t.device.type == "cuda" for t in steps)
        group["capturable"] = device.type == "cuda" and not group.get("fused") and on_device


def _check_same_algorithm(path: Path, data: dict[str, Any], template: BaseAlgorithm) -> None:
    """Refuse a zip of another algorithm by its policy's module (SB3 keeps it in clear beside the pickle), before
    any entry of the zip is compared with the config."""
    stored = data.get("policy_class")
    module = stored.get("__module__") if isinstance(stored, dict) else None
    expected = template.policy_class.__module__
    if module == expected and isinstance(template, PPO) and not {"clip_range", "n_epochs"} <= data.keys():
        # A2C's and TRPO's policies are PPO's too; only PPO saves a clip range and its epochs.
        raise ConfigError(
            f"{path} holds an on-policy model that is not PPO's (A2C's or TRPO's, say: it has no clip_range or "
            "n_epochs), and this run's config is for ppo; evaluate it with its own run dir"
        )
    if not isinstance(module, str) or module == expected:
        return
    by_module = {algo.model_class.policy_aliases["MlpPolicy"].__module__: name for name, algo in ALGOS.items()}
    want = by_module.get(expected, type(template).__name__)
    held = by_module.get(module)
    if module == NormedCritics.__module__:  # layer-normed critics: SAC's, TD3's and TQC's twin policies share it
        held = _normed_algorithm(data)
        if held == want:
            # The template takes the twin class only as its model is set up.
            if getattr(template, "critic_layer_norm", False):
                return
            raise ConfigError(
                f"{path} holds a {held} model with layer-normed critics, and this run's config has critic_layer_norm "
                "false; evaluate it with its own run dir"
            )
    holds = f"a {held} model" if held is not None else f"a model whose policy is from {module}"
    raise ConfigError(f"{path} holds {holds}, and this run's config is for {want}; evaluate it with its own run dir")


def _normed_algorithm(data: dict[str, Any]) -> str | None:
    """Which of SAC, TD3 and TQC saved a model of layer-normed critics, told by an attribute that only it saves."""
    for key, algo in (("top_quantiles_to_drop_per_net", "tqc"), ("policy_delay", "td3"), ("target_entropy", "sac")):
        if key in data:
            return algo
    return None


# The model attribute, saved in its zip, that records the hyperparameters of the run that trained it: a config.yaml
# edited after the run saved a model is told from it. (SB3 takes a zip's plain entries and leaves the rest to load's
# arguments: a changed schedule took effect on resume, a changed gamma or net_arch did not.)
HYPERPARAMETERS = "sb3_gpu_hyperparameters"


def hyperparameters_record(plan: Plan) -> str:
    """What the plan's model learns with, as a model records it (JSON text, whatever the types): the SB3 class's own
    arguments, the network (sb3_gpu's keys for policy_kwargs' net_arch and activation_fn), the frames stacked and
    the normalisation. Left out: sb3_gpu's choices for a machine (buffers, precision, compiling), which a run moved
    to another may change, and the training length, which a resume extends."""
    own = ("net_arch", "activation_fn", "frame_stack", "normalize")
    learns = {*inspect.signature(get_algo(plan.algo).model_class.__init__).parameters, *own}
    values = {key: value for key, value in plan.preset.values().items() if key in learns}
    return json.dumps(plain_numbers(values), sort_keys=True, default=repr)


def _check_same_hyperparameters(path: Path, recorded: Any, expected: str) -> None:
    if not isinstance(recorded, str) or recorded == expected:  # a zip saved by SB3 or before sb3_gpu recorded them
        return
    try:
        held = json.loads(recorded)
    except ValueError:
        held = {}
    given = json.loads(expected)
    # Keys on one side only are another version's (an SB3 argument added since the model was saved), not an edit.
    changed = [key for key in sorted(held.keys() & given.keys()) if held[key] != given[key]]
    if not changed:
        return
    differences = "; ".join(
        f"{key}: {json.dumps(held[key])} in the model, {json.dumps(given[key])} in config.yaml" for key in changed[:3]
    ) + ("; ..." if len(changed) > 3 else "")
    raise ConfigError(
        f"{path} was trained with other hyperparameters than its run's config.yaml gives ({differences}): config.yaml was "
        "edited after the model was saved; put it back (to train with other values, start a new run from it with --config)"
    )


def load_plan_model(plan: Plan, path: Path, env: VecEnv) -> BaseAlgorithm:
    """:func:`load_model` with the plan's class, policy and hyperparameters."""
    preset = plan.preset
    kwargs = model_kwargs(plan)
    model = load_model(
        model_class(plan),
        path,
        policy=preset.policy,
        model_kwargs=kwargs,
        env=env,
        device=plan.device.device,
        hyperparameters=hyperparameters_record(plan),
    )
    if hasattr(model, "overlap_training"):  # the saved run's choice was for its machine; this plan's is for this one
        model.overlap_training = plan.training == "overlapped"
    return model


def restore_vecnormalize(env: VecEnv, state: SavedState, run: RunDir) -> VecEnv:
    """The training env with the statistics saved beside ``state``'s model (where the preset normalises)."""
    if not isinstance(env, VecNormalize):
        return env
    if state.vecnormalize is None:
        raise ConfigError(
            f"cannot resume {run}: it trained under VecNormalize but holds no statistics saved with {state.model.name}"
        )
    restored = load_vecnormalize(state.vecnormalize, env.venv)
    restored.training = True
    return restored


def restore_model(plan: Plan, env: VecEnv, state: SavedState, run: RunDir, say: Callable[[str], None]) -> BaseAlgorithm:
    """``state``'s model on ``env``, set up as a new model from the plan would be, with its replay buffer."""
    model = load_plan_model(plan, state.model, env)
    model.tensorboard_log = str(run.tensorboard)
    if plan.seed is not None:
        model.set_random_seed(plan.seed)
    if plan.speed is not None:
        apply_speed(model, plan.speed, plan.preset.params.batch_size)
    say(f"resuming from {state.model} at {state.timesteps:,} timesteps")
    if get_algo(plan.algo).on_policy:
        return model
    if state.replay_buffer is not None:
        load_replay_buffer(model, state.replay_buffer)
        buffer = model.replay_buffer  # type: ignore[attr-defined]
        size = buffer.size() * env.num_envs
        kept = ""
        if isinstance(buffer, DeviceReplayBuffer) != (plan.buffers == "device"):  # a run moved with --device
            kind = "sb3_gpu's device buffer" if plan.buffers == "host" else "SB3's host buffer"
            kept = f"; kept as {kind}, as it was saved, where a new run here would use the other"
        say(f"replay buffer restored from {state.replay_buffer} ({size:,} transitions{kept})")
    else:
        others = [run.final.replay_buffer] if run.final.replay_buffer.is_file() else []
        others += sorted(run.checkpoints.glob("model_replay_buffer_*_steps.pkl")) if run.checkpoints.is_dir() else []
        why = (
            f"a run keeps only its newest model's, {others[0]}, and that model could not be resumed from"
            if others
            else "--save-replay-buffer keeps it"
        )
        say(
            f"no replay buffer was saved with {state.model.name} ({why}): it starts empty, and "
            "training goes on at once, on batches drawn from its first transitions"
        )
    return model
