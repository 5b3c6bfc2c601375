"""The Plan: the hardware, the resolved preset, and the device, profile, vec env and speed choices, each with its
reason. It is decided before anything trains, printed as one table, and saved as a run's ``config.yaml``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.preprocessing import is_image_space, is_image_space_channels_first

from sb3_gpu.common.checks import CONTINUOUS_ALGOS, bool_arg, count_arg, seed_arg
from sb3_gpu.common.errors import ConfigError, closest, named
from sb3_gpu.common.hardware import GPUInfo, HardwareProfile, detect_hardware, gpu_free_bytes, host_available_bytes
from sb3_gpu.config.presets import Preset, check_policy_kwargs, load_preset_file, resolve_preset, select_entry
from sb3_gpu.config.runconfig import CONFIG_VERSION, RunConfig
from sb3_gpu.config.schema import ACTIVATIONS, ALGOS, PROFILES, get_algo
from sb3_gpu.envs.choice import VecEnvChoice, check_env_resources, vec_env_choice
from sb3_gpu.envs.spec import (
    EnvSpec,
    channel_last_images,
    check_env_api,
    episode_limit,
    measure_step_seconds,
    probe_env,
    resolve_env,
)
from sb3_gpu.extensions.accumulate import check_accumulation
from sb3_gpu.extensions.continuous import check_actor_critic_accumulation
from sb3_gpu.extensions.replay import size_text
from sb3_gpu.planning.buffers import HOST_MEMORY_SHARE, choose_buffers, choose_overlap
from sb3_gpu.planning.device import DeviceChoice, PolicyKind, choose_device, device_text, requested_device
from sb3_gpu.planning.optimizers import planned_policy_kwargs
from sb3_gpu.planning.probe import MARGIN, Candidate, Option, Prober, ProbeResult, Workload
from sb3_gpu.planning.speed import SpeedPlan, choose_speed, compiles_auto, free_cores, thread_cap


@dataclass(frozen=True)
class Plan:
    """Everything decided before training, with the reason for each decision. Saved as ``config.yaml``."""

    algo: str
    env: EnvSpec
    device_request: str
    device: DeviceChoice
    vec_env_request: str
    vec_env: str
    vec_env_reason: str
    preset: Preset
    hardware: HardwareProfile
    profile_reason: str = ""
    seed: int | None = None
    # amp, compile, threads and CUDA math flags as decided for this machine (None: leave torch as it is).
    speed: SpeedPlan | None = None
    # Evaluation episodes are cut after this many steps (None: the env bounds its episodes itself).
    eval_step_cap: int | None = None
    eval_step_cap_reason: str = ""
    # Where replay or rollout data live: "device" (sb3_gpu's device buffers) or "host" (SB3's).
    buffers: str = "host"
    buffers_reason: str = ""
    # Off-policy training: "overlapped" with collection (on a trainer thread) or "sync" (SB3's schedule).
    training: str = "sync"
    training_reason: str = ""
    # The timings behind the auto choices (None: nothing was probed; the rules decided).
    probe: ProbeResult | None = None
    # The env's action space as training sees it (None: not recorded).
    action_space: spaces.Space | None = None
    # The hidden layers and activation SB3's policy builds where the preset sets none (None: not known).
    sb3_network: tuple[Any, str] | None = None

    @property
    def action_shape(self) -> tuple[int, ...] | None:
        """A Box action space's shape (None for discrete actions): the shape of TD3's and SAC's action noise."""
        return self.action_space.shape if isinstance(self.action_space, spaces.Box) else None

    def to_config(self) -> dict[str, Any]:
        """Plain data that :func:`~sb3_gpu.config.runconfig.load_config` turns back into the same hyperparameters."""
        speed_rows = self.speed.rows() if self.speed else []
        return {
            "version": CONFIG_VERSION,
            "algo": self.algo,
            "env": self.env.name,
            "device": self.device_request,
            "vec_env": self.vec_env_request,
            "seed": self.seed,
            "hyperparameters": self.preset.values(),
            # Informational: what was chosen on the machine that wrote this file, and why.
            "resolved": {
                "device": f"{self.device.device} ({self.device.reason})",
                "profile": f"{self.preset.profile} ({self.profile_reason})",
                "vec_env": f"{self.vec_env} ({self.vec_env_reason})",
                "buffers": f"{self.buffers} ({self.buffers_reason})",
                "training": f"{self.training} ({self.training_reason})",
                "hardware": self.hardware.describe(),
                **({"env_factory": True} if self.env.factory else {}),
                **{f"speed.{name}": f"{value} ({why})" for name, value, why in speed_rows},
                **(
                    {"probe": [self.probe.summary(), *map(self.probe.line, range(len(self.probe.options)))]}
                    if self.probe
                    else {}
                ),
                "sources": dict(self.preset.sources),
            },
        }


@dataclass(frozen=True)
class _EnvFacts:
    """What one env, built as training will see it, tells the plan."""

    observation_space: spaces.Space
    action_space: spaces.Space
    step_seconds: float | None  # measured only where the vec env kind is chosen automatically
    episode_limit: str | None  # the env's own bound on an episode, in words; None: an episode may never end


def make_plan(
    algo: str,
    env: str | Callable[[], gym.Env] | EnvSpec,
    device: str | th.device = "auto",
    *,
    n_envs: int | None = None,
    n_timesteps: int | None = None,
    vec_env: str = "auto",
    seed: int | None = None,
    preset: str | Path | None = None,
    profile: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    override_source: str | Mapping[str, str] = "override",
    config: RunConfig | None = None,
    hardware: HardwareProfile | None = None,
    training: bool = True,
    prober: Prober | None = None,
    steps_left: int | None = None,
) -> Plan:
    """Resolve hardware, preset, device and vec env for ``algo`` on ``env``.

    :param preset: a preset YAML file to use instead of the bundled one for ``algo``
    :param profile: ``auto`` (``cpu`` or ``gpu`` by the chosen device) or a profile name: ``cpu``, ``gpu``, ``large``
    :param overrides: hyperparameters that win over the preset (``{"batch_size": 128, "policy_kwargs.ortho_init": False}``)
    :param override_source: what the plan names as their source: one label, or one per override key
    :param config: a run's config read by :func:`~sb3_gpu.config.runconfig.load_config`; its hyperparameters replace
        the preset
    :param training: False for a plan that only evaluates a saved model: the training sizes (replay buffer memory,
        rollout length, env workers) are not checked, since nothing of that size is made, and nothing is probed
    :param prober: times the candidates of ``auto`` choices (default: a real one with the user's probe cache, where
        ``hardware`` is detected rather than given; the preset key ``probe: false`` turns it off)
    :param steps_left: env steps still to train, where fewer than ``n_timesteps`` (a resumed run): what compiling
        must earn its time back in
    """
    algo_ = get_algo(algo)
    seed = seed_arg(seed)
    _check_plan_args(n_envs, n_timesteps, profile, overrides, override_source, config, training, prober, steps_left)
    hardware_detected = hardware is None  # an injected profile is a what-if: nothing on it can be timed
    hardware = hardware or detect_hardware()
    device = device_text(device)
    requested_device(device, hardware)
    entry, entry_label = _entry(algo_.name, env, preset, config)
    layered = _layered(overrides, override_source, n_envs, n_timesteps)
    # Policy and env kwargs never differ between profiles, so a provisional resolve tells what to probe.
    provisional = resolve_preset(algo_, entry, entry_label, "cpu", layered)
    spec = resolve_env(env, provisional.env_kwargs)
    facts = _probe(spec, measure=vec_env == "auto")
    if not isinstance(facts.action_space, algo_.action_space):
        fits = ", ".join(name for name, a in ALGOS.items() if isinstance(facts.action_space, a.action_space))
        needed = " or ".join(", ".join(cls.__name__ for cls in algo_.action_space).rsplit(", ", 1))
        raise ConfigError(
            f"{algo_.name} needs a {needed} action space; {spec.name} has {facts.action_space} "
            + (
                f"(for it: {fits})"
                if fits
                else "(no SB3 algorithm takes it: a gymnasium.ActionWrapper can map a MultiDiscrete or Box action onto it)"
            )
        )
    _check_observation_space(spec.name, facts.observation_space, provisional.frame_stack)
    _check_action_space(spec.name, facts.action_space)
    box = facts.action_space
    if isinstance(box, spaces.Box) and not (np.isfinite(box.low).all() and np.isfinite(box.high).all()):
        # SB3 squashes or clips actions into the bounds, and asserts them finite only when the model is built.
        raise ConfigError(f"SB3 needs finite action bounds; {spec.name} has {box}: give its Box a finite low and high")

    policy, policy_reason = provisional.policy, ""
    if policy == "auto":
        policy, policy_reason = _policy_for(facts.observation_space, provisional.policy_kwargs)
    kind = _policy_kind(policy, _stored_space(provisional, facts.observation_space))  # scaled images are flattened

    def variant(choice: DeviceChoice) -> _Variant:
        chosen_profile, profile_reason = _profile(profile, choice, entry, entry_label)
        resolved = resolve_preset(algo_, entry, entry_label, chosen_profile, layered)
        if config is not None and config.sources:  # what the run's first plan named, where this one names its config
            sources = {k: config.sources.get(k, s) if s == entry_label else s for k, s in resolved.sources.items()}
            resolved = dataclasses.replace(resolved, sources=sources)
        if resolved.policy == "auto":
            sources = {**resolved.sources, "policy": policy_reason}
            resolved = dataclasses.replace(resolved, policy=policy, sources=sources)
        # Timing the batched VecEnv's overhead (where its choice is in doubt) is a probe of this machine.
        measure = hardware_detected and resolved.probe
        vec = vec_env_choice(
            vec_env,
            spec,
            resolved.n_envs,
            cores=hardware.logical_cores,
            step_seconds=facts.step_seconds,
            envpool_allowed=not hardware.mps,  # macOS: EnvPool has no build for it (a what-if may ask from Linux)
            measure=measure,
        )
        if resolved.amp == "fp16" and not algo_.fp16:  # before the device's own fp16 check: on no device
            source, use = resolved.sources.get("amp", "preset"), "bf16 or off"
            if choice.device.startswith("cuda") and not (gpu := hardware.gpu(choice.device)).bf16:
                use = f"off ({gpu.name} has no bf16)"
            raise ConfigError(f"amp=fp16 ({source}): {_NO_FP16.format(algo=algo_.name)}; use {use}")
        speed = _speed(resolved, choice.device, kind, vec.workers, hardware)
        if speed.amp == "fp16" and not algo_.fp16:  # chosen by the rules for the GPU
            speed = dataclasses.replace(speed, amp="off", amp_reason=f"off: {_NO_FP16.format(algo=algo_.name)}")
        return _Variant(choice, profile_reason, resolved, vec, speed)

    def check(v: _Variant) -> _Variant:
        check_policy_kwargs(
            algo_, v.resolved.policy, v.resolved.policy_kwargs, v.resolved.sources.get("policy_kwargs", entry_label)
        )
        _check_combinations(v.resolved, facts.observation_space, facts.action_space, training)
        return v

    device_choice = choose_device(device, kind, algo_.on_policy, hardware)
    chosen = check(variant(device_choice))
    if device_choice.device == "mps" and (float64 := _float64_observations(chosen.resolved, facts.observation_space)):
        if device != "auto":
            raise ConfigError(f"device {device!r}: Apple's MPS has no float64, and {float64} float64: use cpu or auto")
        chosen = check(variant(DeviceChoice("cpu", f"{float64} float64, which Apple's MPS cannot hold: the CPU")))
    probed: ProbeResult | None = None
    if prober is None and hardware_detected:
        # The CPU's model and vector instructions too: machines alike in cores and memory that share a home folder keep
        # figures apart.
        prober = Prober(context=f"{hardware.describe()}, {hardware.cpu}, {hardware.busy_cores} busy cores")
    if training and prober is not None and chosen.resolved.probe:
        chosen, probed = _probed(chosen, variant, device, hardware, prober, facts)
        check(chosen)

    resolved, vec = chosen.resolved, chosen.vec
    gpu = hardware.gpu(chosen.device.device) if chosen.device.device.startswith("cuda") else None
    # What other processes leave free on this machine's GPU (a what-if GPU: all of it).
    gpu_free = gpu_free_bytes(gpu.index) if gpu is not None and hardware_detected and training else None
    buffers = _buffers(resolved, chosen.device.device, facts, gpu, gpu_free)
    gpu_too_small = buffers.pop("gpu_too_small")
    if not training:  # a loaded model's buffer is built at its full size, and evaluation fills none: never on the GPU
        buffers.update(buffers="host", buffers_reason="SB3's buffers: evaluation fills none")
    if training:
        # A replay buffer on a GPU holds its transitions there (and checks the GPU's free memory as it allocates).
        on_gpu = buffers["buffers"] == "device" and chosen.device.device.startswith("cuda")
        # This machine's free memory; a what-if profile's RAM, where the hardware was given.
        available = host_available_bytes() if hardware_detected else int(hardware.ram_gb * 2**30)
        memory_is = "available" if hardware_detected else "of RAM given"
        sb3_buffers, host_memory = buffers["buffers"] == "host", available if not on_gpu else None
        _check_sizes(resolved, facts, host_memory, memory_is, sb3_buffers=sb3_buffers, elsewhere=gpu_too_small)
        check_env_resources(vec.kind, resolved.n_envs, monitor=True, cores=hardware.logical_cores)
        # Last, once the run is known to be possible: timing the compiled step compiles it, a minute on a CPU.
        if prober is not None and resolved.probe and resolved.compile == "auto" and compiles_auto(chosen.device.device):
            timing = probed.timings[probed.chosen] if probed is not None else None
            eager_s = timing.train_s if timing is not None else None
            chosen = _compile_probed(chosen, prober, facts, eager_s, steps_left or resolved.n_timesteps)
    vec_reason = vec.reason
    if vec.kind in ("subproc", "batched") and hardware.in_notebook:
        vec_reason += "; in a notebook, falls back to dummy with a warning if workers cannot start"
    return Plan(
        algo=algo_.name,
        env=spec,
        device_request=device,
        device=chosen.device,
        vec_env_request=vec_env,
        vec_env=vec.kind,
        vec_env_reason=vec_reason,
        preset=resolved,
        hardware=hardware,
        profile_reason=chosen.profile_reason,
        seed=seed,
        speed=chosen.speed,
        probe=probed,
        action_space=facts.action_space,
        sb3_network=_sb3_network(resolved, facts),
        **_eval_step_cap(resolved, facts),
        **buffers,
    )


# fp16's loss scale is kept per optimizer; an off-policy actor-critic steps several per gradient step.
_NO_FP16 = "{algo} steps several optimizers per gradient step and fp16's loss scale spans one, so it takes bf16 only"


@dataclass(frozen=True)
class _Variant:
    """The plan's decisions for one device: its profile, the preset resolved with it, the vec env and speed."""

    device: DeviceChoice
    profile_reason: str
    resolved: Preset
    vec: VecEnvChoice
    speed: SpeedPlan


def _probed(
    rules: _Variant,
    variant: Callable[[DeviceChoice], _Variant],
    device_request: str,
    hardware: HardwareProfile,
    prober: Prober,
    facts: _EnvFacts,
) -> tuple[_Variant, ProbeResult | None]:
    """Time the candidates of every ``auto`` choice (device, amp, threads) and take the fastest; the rules' variant
    and None where nothing is auto or only one candidate is left."""
    variants = [rules]
    if device_request == "auto":
        for other in ("cpu", "cuda:0", "mps"):
            usable = other != rules.device.device and prober.usable(other)
            if usable and (other != "cuda:0" or hardware.has_cuda) and (other != "mps" or hardware.mps):
                try:
                    elsewhere = variant(DeviceChoice(other, ""))
                except ConfigError:  # a profile this device would take does not resolve: not a candidate
                    continue
                if other != "mps" or not _float64_observations(elsewhere.resolved, facts.observation_space):
                    variants.append(elsewhere)
    options: list[Option] = []
    owners: list[_Variant] = []
    for v in variants:
        workload = _workload(v, facts)
        if workload is None:
            return rules, None
        for amp in _amp_candidates(v, hardware):
            for threads in _thread_candidates(v, hardware):
                candidate = Candidate(v.device.device, amp, threads)
                options.append(Option(candidate, workload, v.speed.cudnn_benchmark, v.speed.tf32))
                owners.append(v)
    if len(options) < 2:
        return rules, None
    result = prober.probe(options, rule=0, env_s=facts.step_seconds or 0.0)
    winner, pick = owners[result.chosen], result.options[result.chosen].candidate
    # Each reason gives the figures where the probe compared something for it; otherwise the rules' reason stands.
    speed = dataclasses.replace(winner.speed, amp=pick.amp, threads=pick.threads)
    amp_vs = result.versus(lambda c: c.device == pick.device and c.amp != pick.amp)
    if amp_vs is not None:
        speed = dataclasses.replace(speed, amp_reason=amp_vs)
    threads_vs = result.versus(lambda c: c.device == pick.device and c.amp == pick.amp and c.threads != pick.threads)
    if threads_vs is not None:
        n_busy = hardware.busy_physical_cores
        busy = f"; {n_busy} cores busy with other work" if n_busy else ""
        cap = f"; at most OMP_NUM_THREADS={thread_cap()}" if thread_cap() is not None else ""
        speed = dataclasses.replace(speed, threads_reason=threads_vs + busy + cap)
    device_vs = result.versus(lambda c: c.device != pick.device)
    choice = winner.device if device_vs is None else DeviceChoice(pick.device, device_vs)
    return dataclasses.replace(winner, device=choice, speed=speed), result


def auto_compile_mode(device: str) -> str:
    """What compile=auto compiles with where the probe takes it: on CUDA the step replayed as a CUDA graph; on the
    CPU inductor's fused C++ kernels (a CUDA graph mode adds nothing there)."""
    return "reduce-overhead" if device.startswith("cuda") else "default"


# How a compile reason that rests on the probe's timing of the compiled step begins.
COMPILE_TIMED = "probe: gradient step"
# A run whose eager training takes less than this cannot earn a compile back, and is not timed compiled. On the CPU
# inductor writes and builds C++: 9-13 s for the PPO, DQN and SAC presets' steps on a 2-core VM, where compiling made
# SAC's step about twice as fast, the most it gained; and the first plan on a machine compiles once more to time it
# (cached after). At 300 s, SAC Pendulum's 20,000 steps (about 55 s eager) stayed eager, at half the compiled speed.
MIN_COMPILE_S = {"cuda": 5.0, "cpu": 30.0}


def _compile_probed(v: _Variant, prober: Prober, facts: _EnvFacts, eager_step_s: float | None, steps: int) -> _Variant:
    """Resolve ``compile: auto`` on ``v``'s device by timing its gradient step and collection's forward pass eager and
    compiled: compiled where an env step is clearly faster that way, and the run's ``steps`` (env steps) earn the
    compile time back; the forward pass with the step only where it is faster compiled. ``eager_step_s``: the device
    probe's figure for the eager step, timed here where the probe had nothing to compare (a run too short to earn any
    compile back is not timed compiled)."""
    device, on_cpu = v.device.device, v.device.device == "cpu"
    refused = _compile_refusal(v.resolved, facts.observation_space, device)
    workload = _workload(v, facts)
    if refused is None and workload is None:
        refused = "the schedule counts episodes, so the run's gradient steps are not known"
    if refused is not None or workload is None:
        return _not_compiled(v, refused)
    option = Option(Candidate(device, v.speed.amp, v.speed.threads), workload, v.speed.cudnn_benchmark, v.speed.tf32)
    if eager_step_s is None:
        eager = prober.probe([option], rule=0, env_s=facts.step_seconds or 0.0).timings[0]
        if eager is None:
            return _not_compiled(v, "the eager step could not be timed")
        eager_step_s = eager.train_s
    eager_total = eager_step_s * workload.grads_per_env_step * steps
    least = MIN_COMPILE_S["cpu" if on_cpu else "cuda"]
    if eager_total < least:
        why = f"the run's gradient steps take about {eager_total:.1f} s eager, too little to earn a compile back"
        return _not_compiled(v, why + f" (timed from {least:.0f} s{' on the CPU' if on_cpu else ''})")
    mode = auto_compile_mode(device)
    try:
        timing = prober.time_compile(option, mode)
    except Exception as e:  # compilers fail in many ways; each means "train eager"
        reason = f"probe: the compiled step failed here ({named(e)}), so not compiled"
        return dataclasses.replace(v, speed=dataclasses.replace(v.speed, compile="false", compile_reason=reason))
    # Per env step as the device probe predicts it (training beside collection where the run overlaps them).
    env_s = facts.step_seconds or 0.0
    eager_env_step, step_only = timing.per_env_step(workload, env_s, collect=False)
    both = timing.per_env_step(workload, env_s)[1]
    # Collection's forward pass compiles with the step where it is clearly faster so and earns its own compile time
    # back: a compiled pass over a few observations can be slower than eager on a CPU (its guards cost more than the
    # ops it fuses), and where training outlasts collection (overlapped) a faster pass saves nothing.
    # Under gSDE collection's actions come from the exploration matrix SB3 resamples between env steps: its forward
    # pass stays SB3's (SAC's and TQC's compile_step leaves it so; PPO's is told here).
    sde = bool(getattr(v.resolved.params, "use_sde", False))
    collect = (
        not sde
        and not timing.act_failed
        and timing.act_compiled_s <= MARGIN * timing.act_eager_s
        and both < step_only
        and timing.act_compile_s / (step_only - both) < steps
    )
    compiled_env_step = both if collect else step_only
    compile_s = timing.compile_s + (timing.act_compile_s if collect else 0.0)
    pays_after = compile_s / (eager_env_step - compiled_env_step) if eager_env_step > compiled_env_step else None
    figures = f"{COMPILE_TIMED} {timing.compiled_s * 1e3:.3g} ms compiled vs {timing.eager_s * 1e3:.3g} ms eager"
    if sde:
        figures += ", forward pass SB3's (gSDE)"
    elif timing.act_failed:
        figures += f", forward pass {timing.act_eager_s * 1e3:.3g} ms eager (it did not compile)"
    elif timing.act_eager_s:
        figures += f", forward pass {timing.act_compiled_s * 1e3:.3g} vs {timing.act_eager_s * 1e3:.3g} ms"
        figures += "" if collect else " (stays eager)"
    figures += f", {compile_s:.1f} s to compile"
    faster = compiled_env_step <= MARGIN * eager_env_step
    if pays_after is not None and faster and pays_after < steps:
        reason = f"{figures}; pays after {pays_after:,.0f} of {steps:,.0f} env steps"
    elif pays_after is None or not faster:
        mode, reason = "false", f"{figures}; not faster enough to take"
    else:
        mode, reason = "false", f"{figures}; would pay after {pays_after:,.0f} env steps, the run has {steps:,.0f}"
    speed = dataclasses.replace(v.speed, compile=mode, compile_reason=reason, compile_collect=collect)
    return dataclasses.replace(v, speed=speed)


def _not_compiled(v: _Variant, why: str | None) -> _Variant:
    return dataclasses.replace(v, speed=dataclasses.replace(v.speed, compile_reason=f"auto: not compiled: {why}"))


def _compile_refusal(preset: Preset, obs_space: spaces.Space, device: str) -> str | None:
    """Why the gradient step of ``preset`` on ``device`` could not be compiled whole (see
    ``extensions.graphstep.refusal``)."""
    params: Any = preset.params
    optimizer = preset.policy_kwargs.get("optimizer_class")
    if optimizer not in (None, th.optim.Adam):
        return "the compiled step runs Adam's update, and the preset names another optimizer"
    adam_kwargs = preset.policy_kwargs.get("optimizer_kwargs") or {}
    if any(adam_kwargs.get(k) for k in ("amsgrad", "maximize", "differentiable", "decoupled_weight_decay")):
        return "the compiled step runs plain Adam (no amsgrad, maximize, decoupled weight decay)"
    if isinstance(obs_space, spaces.Dict):
        return "dict observations"
    if getattr(params, "grad_accum_steps", 1) > 1:
        if preset.algo not in ("dqn", "qrdqn"):  # the DQN family's compiled step takes a whole accumulation window
            return "gradient accumulation steps once per several backward passes"
        # As the model's own rule (PrioritizedDQN.compile_step): micro-batches see each other's priorities, so the
        # graph must sample and update the trees itself, which it does on CUDA's device buffers.
        in_graph = device.startswith("cuda") and preset.device_buffers != "false" and not preset.normalize
        if getattr(params, "per", False) and not in_graph:
            return (
                "gradient accumulation with prioritized replay whose trees are searched on the host: each micro-batch's "
                "priorities are updated before the next one is sampled, between graphs"
            )
    return None


def _amp_candidates(v: _Variant, hardware: HardwareProfile) -> list[str]:
    if v.resolved.amp != "auto":
        return [v.speed.amp]
    device = v.device.device
    if device == "cpu":
        modes = ["off", "bf16"] if hardware.cpu_bf16 else ["off"]  # emulated bf16 is slower than fp32 everywhere
    elif device.startswith("cuda"):
        gpu, fp16 = hardware.gpu(device), get_algo(v.resolved.algo).fp16
        modes = ["off", *(["bf16"] if gpu.bf16 else []), *(["fp16"] if gpu.fp16 and fp16 else [])]
    else:
        modes = ["off"]
    return sorted(modes, key=lambda m: m != v.speed.amp)  # the rules' choice first


def _thread_candidates(v: _Variant, hardware: HardwareProfile) -> list[int]:
    """The rules' thread count first, then one thread and every free core (at most OMP_NUM_THREADS): a choice is
    timed against what it passes over (a small MLP's one thread against two, where two cores are free)."""
    if v.resolved.threads != "auto" or v.device.device != "cpu":
        return [v.speed.threads]
    most = min(free_cores(hardware, v.vec.workers), thread_cap() or hardware.physical_cores)
    return sorted({v.speed.threads, 1, most}, key=lambda n: (n != v.speed.threads, n))


def _sb3_network(preset: Preset, facts: _EnvFacts) -> tuple[Any, str] | None:
    """The ``net_arch`` and activation SB3's policy builds for this run where the preset sets none, read off the
    policy built on the CPU: its default depends on the algorithm, the policy and its features extractor (PPO's
    MlpPolicy has two tanh heads of [64, 64]; a NatureCNN's features feed the heads direct)."""
    if preset.net_arch is not None and preset.activation_fn is not None:
        return None
    policy_class = get_algo(preset.algo).model_class.policy_aliases[preset.policy]
    obs_space = _policy_space(_stored_space(preset, facts.observation_space), preset.frame_stack or 1)
    # No optimizer (the first one made imports torch's compiler, seconds) and no orthogonal init: milliseconds.
    kwargs: dict[str, Any] = {**preset.policy_kwargs_for_sb3(), "optimizer_class": _no_optimizer}
    if preset.net_arch is not None:  # only the activation is read: no hidden layers to build (a preset's may be wide)
        kwargs["net_arch"] = []
    if "ortho_init" in inspect.signature(policy_class.__init__).parameters:
        kwargs["ortho_init"] = False
    try:
        with th.random.fork_rng(devices=[]):  # its weights' draws leave the caller's torch seed where it was
            policy = policy_class(obs_space, facts.action_space, lambda _: 1e-4, **kwargs)
        activation = policy.activation_fn
    except Exception:  # a policy that cannot be built so (the run says why when it builds it): the table says less
        return None
    name = next((key for key, cls in ACTIVATIONS.items() if cls is activation), getattr(activation, "__name__", "?"))
    return policy.net_arch, name


def _no_optimizer(*args: Any, **kwargs: Any) -> None:
    return None


def _workload(v: _Variant, facts: _EnvFacts) -> Workload | None:
    """What one env step asks of the policy under ``v`` (None where the schedule counts episodes, whose length is not
    known before training)."""
    preset, params = v.resolved, cast(Any, v.resolved.params)
    algo = get_algo(preset.algo)
    policy_class = algo.model_class.policy_aliases[preset.policy]
    rollout = max(params.n_steps * preset.n_envs, 1) if preset.algo == "ppo" else 0
    if preset.algo == "ppo":  # n_epochs passes over the rollout in minibatches of batch_size
        grads = params.n_epochs * -(-rollout // params.batch_size) / rollout
    else:
        per_rollout = _train_freq_steps(params.train_freq) * preset.n_envs
        if per_rollout == 0:
            return None
        steps = params.gradient_steps if params.gradient_steps >= 0 else per_rollout
        grads = steps * getattr(params, "grad_accum_steps", 1) / per_rollout
    # The optimizer the run will have on this device (fused on a GPU), which the probe times.
    kwargs = planned_policy_kwargs(preset.algo, preset.policy_kwargs_for_sb3(), params.batch_size, v.device.device)
    obs_space = _policy_space(_stored_space(preset, facts.observation_space), preset.frame_stack or 1)
    overlapped = choose_overlap(preset, v.device.device).kind == "overlapped"
    return Workload(
        preset.algo,
        policy_class,
        obs_space,
        facts.action_space,
        kwargs,
        params.batch_size,
        preset.n_envs,
        grads,
        overlapped,
        getattr(params, "max_grad_norm", None) if preset.algo in ("dqn", "qrdqn") else None,
        getattr(params, "top_quantiles_to_drop_per_net", 2),
        getattr(params, "critic_layer_norm", False),
        bool(getattr(params, "use_sde", False)),
    )


# The observation spaces SB3's policies take; others (Tuple, Text, Graph, Sequence) fail only when the model is built.
_POLICY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary, spaces.Dict)


def _check_observation_space(env: str, space: spaces.Space, frame_stack: int | None) -> None:
    if not isinstance(space, _POLICY_SPACES):
        accepted = ", ".join(s.__name__ for s in _POLICY_SPACES)
        raise ConfigError(
            f"SB3's policies cannot take {env}'s observation space {space}; accepted: {accepted} "
            "(gymnasium.wrappers.FlattenObservation makes a Tuple of Box, Discrete and the like one Box)"
        )
    if frame_stack and not isinstance(space, (spaces.Box, spaces.Dict)):
        raise ConfigError(f"frame_stack stacks Box or Dict observations; {env} has {space}: leave frame_stack unset")
    for key, member in (space.spaces if isinstance(space, spaces.Dict) else {"": space}).items():
        where = f"the Dict's {key!r}" if key else "its observations"
        if isinstance(member, spaces.Box) and (not member.shape or 0 in member.shape):
            raise ConfigError(
                f"SB3's policies take a Box of one dimension or more, none of size 0; {env} has {where} of shape "
                f"{member.shape}: give it a shape such as (1,)"
            )
        _check_from_zero(env, member, f"{where} of {member}", "ObservationWrapper")


def _check_from_zero(env: str, space: spaces.Space, what: str, wrapper: str) -> None:
    """SB3 numbers Discrete and MultiDiscrete choices from 0: its one-hot encoding of an observation fails outside 0..n-1,
    and a policy's actions run 0..n-1 whatever the space's ``start`` (a DQN's loss fails once its buffer holds a
    warm-up sample of ``n``)."""
    if isinstance(space, (spaces.Discrete, spaces.MultiDiscrete)) and np.any(space.start != 0):
        raise ConfigError(
            f"SB3 numbers Discrete and MultiDiscrete choices from 0; {env} has {what}: shift them to start at 0 "
            f"(a gymnasium.{wrapper})"
        )


def _check_action_space(env: str, space: spaces.Space) -> None:
    """SB3's policies take MultiDiscrete and MultiBinary actions of one dimension only (its refusal comes as the model
    is built)."""
    if isinstance(space, (spaces.MultiDiscrete, spaces.MultiBinary)) and len(space.shape) > 1:
        raise ConfigError(
            f"SB3's policies take {type(space).__name__} actions of one dimension; {env} has {space}: flatten them "
            "(a gymnasium.ActionWrapper that reshapes the action)"
        )
    _check_from_zero(env, space, f"actions {space}", "ActionWrapper")


def _policy_space(space: spaces.Space, frame_stack: int) -> spaces.Space:
    """The observation space the policy sees: frames stacked, images channel-first (as SB3 transposes them, a Dict's
    too)."""
    if isinstance(space, spaces.Dict):
        return spaces.Dict({key: _policy_space(member, frame_stack) for key, member in space.spaces.items()})
    if not isinstance(space, spaces.Box):
        return space
    low, high = space.low, space.high
    if is_image_space(space, check_channels=False) and not is_image_space_channels_first(space):
        low, high = np.moveaxis(low, -1, 0), np.moveaxis(high, -1, 0)
    if frame_stack > 1:
        axis = 0 if low.ndim == 3 else -1
        low, high = np.concatenate([low] * frame_stack, axis=axis), np.concatenate([high] * frame_stack, axis=axis)
    return spaces.Box(low, high, dtype=space.dtype)


def _stored_space(preset: Preset, space: spaces.Space) -> spaces.Space:
    """The observations the model and its buffers get: the images VecNormalize scales become float32 (the other Boxes
    it scales keep their dtype, as SB3's VecNormalize keeps their space)."""
    scaled = _scaled_keys(preset, space)
    if isinstance(space, spaces.Dict):
        return spaces.Dict({k: _scaled_image(m) if k in scaled else m for k, m in space.spaces.items()})
    return _scaled_image(space) if scaled else space


def _scaled_image(space: spaces.Space) -> spaces.Space:
    if isinstance(space, spaces.Box) and is_image_space(space, check_channels=False):
        return spaces.Box(-np.inf, np.inf, space.shape, np.float32)
    return space


def _data_bytes(preset: Preset, facts: _EnvFacts) -> int:
    """The bytes PPO's rollout buffer or an off-policy replay buffer holds."""
    params: Any = preset.params
    stored = _stored_space(preset, facts.observation_space)
    once = getattr(params, "optimize_memory_usage", False)
    per_step = _transition_bytes(stored, facts.action_space, preset.frame_stack or 1, once)
    # A rollout holds one observation (not two) and a few floats per step; a replay buffer whole transitions.
    if preset.algo == "ppo":
        return int(params.n_steps * preset.n_envs * (per_step // 2 + 32))
    return int(params.buffer_size * per_step)


def _observation_bytes(preset: Preset, facts: _EnvFacts) -> int:
    """The bytes of a PPO rollout's observations (half of a transition's, which holds two)."""
    stored = _stored_space(preset, facts.observation_space)
    per_step = _transition_bytes(stored, facts.action_space, preset.frame_stack or 1)
    return int(preset.params.n_steps * preset.n_envs * (per_step // 2))


def _buffers(preset: Preset, device: str, facts: _EnvFacts, gpu: GPUInfo | None, gpu_free: int | None) -> dict[str, Any]:
    chosen = choose_buffers(preset, device, facts.observation_space, _data_bytes(preset, facts), gpu, gpu_free)
    overlap = choose_overlap(preset, device)
    return {
        "gpu_too_small": chosen.gpu_too_small,  # for the plan's size check, not a Plan field
        "buffers": chosen.kind,
        "buffers_reason": chosen.reason,
        "training": overlap.kind,
        "training_reason": overlap.reason,
    }


# Where an env has no time limit of its own, a deterministic policy may never end an episode: evaluations would hang.
DEFAULT_EVAL_STEP_CAP = 10_000


def _eval_step_cap(preset: Preset, facts: _EnvFacts) -> dict[str, Any]:
    if preset.eval_max_episode_steps is not None:
        source = preset.sources.get("eval_max_episode_steps", "preset")
        return {"eval_step_cap": preset.eval_max_episode_steps, "eval_step_cap_reason": f"eval_max_episode_steps ({source})"}
    if facts.episode_limit is not None:
        return {"eval_step_cap": None, "eval_step_cap_reason": f"the env ends episodes itself (after {facts.episode_limit})"}
    return {
        "eval_step_cap": DEFAULT_EVAL_STEP_CAP,
        "eval_step_cap_reason": "warning: the env sets no time limit, so evaluation episodes are cut here "
        "(set eval_max_episode_steps to change it)",
    }


def _speed(preset: Preset, device: str, policy: PolicyKind, env_workers: int, hardware: HardwareProfile) -> SpeedPlan:
    return choose_speed(
        preset.amp,
        preset.compile,
        preset.threads,
        device=device,
        policy=policy,
        net_arch=preset.net_arch if preset.net_arch is not None else [get_algo(preset.algo).default_width],
        batch_size=preset.params.batch_size,
        env_workers=env_workers,
        hardware=hardware,
    )


def _check_plan_args(
    n_envs: Any,
    n_timesteps: Any,
    profile: Any,
    overrides: Any,
    override_source: Any,
    config: Any,
    training: Any,
    prober: Any,
    steps_left: Any,
) -> None:
    """make_plan's arguments of the wrong type, refused in one line before anything is resolved."""
    for value, name in ((n_envs, "n_envs"), (n_timesteps, "n_timesteps"), (steps_left, "steps_left")):
        whole = isinstance(value, float) and value.is_integer()  # 1e5, as SB3's and rl-zoo3's configs write it
        count_arg(int(value) if whole else value, name, optional=True)
    if not isinstance(profile, str):
        raise ConfigError(f"profile must be a name: auto, {', '.join(PROFILES)}; got {profile!r}")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a mapping of preset keys to values, got {type(overrides).__name__}")
    for key in overrides or {}:
        if not isinstance(key, str):
            raise ConfigError(f"overrides' keys must be preset key names (str), got {key!r}")
    for value, name in ((n_envs, "n_envs"), (n_timesteps, "n_timesteps")):
        if value is not None and overrides is not None and name in overrides:
            raise ConfigError(f"{name}={value!r} and overrides[{name!r}]={overrides[name]!r} both set {name}; give one")
    if isinstance(override_source, Mapping):
        unlabelled = sorted(set(overrides or {}) - set(override_source))
        if unlabelled:
            raise ConfigError(f"override_source names no source for the overrides {unlabelled}")
    elif not isinstance(override_source, str):
        raise ConfigError(f"override_source must be a label, or a mapping of override keys to labels; got {override_source!r}")
    if config is not None and not isinstance(config, RunConfig):
        raise ConfigError(f"config must be a run's RunConfig (from load_config) or None, got {type(config).__name__}")
    if config is not None and profile.strip().lower() != "auto":  # its values are pinned: a profile changed none
        raise ConfigError(
            f"profile {profile!r} picks a preset's values, and a config replays its run's own; leave the profile out "
            "(change a value with --set, or make_plan's overrides)"
        )
    bool_arg(training, "training")
    if prober is not None and not isinstance(prober, Prober):
        raise ConfigError(f"prober must be a Prober or None, got {prober!r}")


def _layered(
    overrides: Mapping[str, Any] | None, source: str | Mapping[str, str], n_envs: int | None, n_timesteps: int | None
) -> dict[str, tuple[Any, str]]:
    """Overrides as ``key -> (value, source)``; the counts are named by their argument, or as ``source`` names them
    (a CLI: its flags)."""
    layered = {k: (v, source if isinstance(source, str) else source[k]) for k, v in (overrides or {}).items()}
    named = source if isinstance(source, Mapping) else {}
    if n_envs is not None:
        layered["n_envs"] = (n_envs, named.get("n_envs", "n_envs="))
    if n_timesteps is not None:
        layered["n_timesteps"] = (n_timesteps, named.get("n_timesteps", "n_timesteps="))
    return layered


def _entry(
    algo: str, env: str | Callable[[], gym.Env] | EnvSpec, preset: str | Path | None, config: RunConfig | None
) -> tuple[dict[str, Any], str]:
    """The preset entry to resolve, and its label: a run config's hyperparameters, else the preset file's entry."""
    if config is not None:
        return dict(config.hyperparameters), config.path
    entries, file_label = load_preset_file(get_algo(algo), preset)
    name_probe = resolve_env(env)
    name = select_entry(entries, name_probe.entry_key(entries), name_probe.is_atari, file_label)
    return entries[name], f"{Path(file_label).name}:{name}"


def _probe(spec: EnvSpec, measure: bool) -> _EnvFacts:
    one = probe_env(spec)
    try:
        check_env_api(one, spec.name)
        seconds = measure_step_seconds(one) if measure else None
        return _EnvFacts(one.observation_space, one.action_space, seconds, episode_limit(one))
    finally:
        one.close()


def _profile(requested: str, choice: DeviceChoice, entry: Mapping[str, Any], entry_label: str) -> tuple[str, str]:
    """The profile to apply and why: the device's, or the one asked for if the entry has it."""
    if requested == "auto":
        return choice.profile, f"follows the device ({choice.device})"
    if requested not in PROFILES:
        raise ConfigError(f"unknown profile {requested!r}{closest(requested, PROFILES)} (valid: auto, {', '.join(PROFILES)})")
    if requested not in entry and requested not in ("cpu", "gpu"):
        accepted = ["auto", "cpu", "gpu", *(p for p in PROFILES if p in entry and p not in ("cpu", "gpu"))]
        raise ConfigError(f"{entry_label} has no {requested!r} profile; accepted for it: {', '.join(accepted)}")
    return requested, "asked for"


def _policy_for(obs_space: spaces.Space, policy_kwargs: Mapping[str, Any]) -> tuple[str, str]:
    """The policy for ``obs_space``, and why."""
    if isinstance(obs_space, spaces.Dict):
        return "MultiInputPolicy", "auto (observation space)"
    if not is_image_space(obs_space, check_channels=False):
        return "MlpPolicy", "auto (observation space)"
    small = _too_small_for_nature_cnn(obs_space, policy_kwargs)
    if small:
        return "MlpPolicy", f"auto (observation space: {small} images, too small for CnnPolicy's NatureCNN)"
    return "CnnPolicy", "auto (observation space)"


# NatureCNN's convolutions (8 pixels wide at a stride of 4, 4 at 2, 3 at 1) leave nothing of a smaller image side.
_NATURE_CNN_SIDE = 36


def _too_small_for_nature_cnn(space: spaces.Space, policy_kwargs: Mapping[str, Any]) -> str:
    """``"HxW"`` where SB3 would run NatureCNN on an image ``space`` that it cannot take ("" where it can, or the
    policy has an extractor of the user's own)."""
    if "features_extractor_class" in policy_kwargs or not isinstance(space, spaces.Box):
        return ""
    if not is_image_space(space, check_channels=False):
        return ""
    height, width = space.shape[1:] if is_image_space_channels_first(space) else space.shape[:2]
    return f"{height}x{width}" if min(height, width) < _NATURE_CNN_SIDE else ""


def _policy_kind(policy: str, obs_space: spaces.Space) -> PolicyKind:
    if policy == "CnnPolicy":
        return "cnn"
    if policy == "MultiInputPolicy":
        subspaces = obs_space.spaces.values() if isinstance(obs_space, spaces.Dict) else []
        return "cnn" if any(is_image_space(s, check_channels=False) for s in subspaces) else "multi"
    return "mlp"


def _check_sizes(
    preset: Preset,
    facts: _EnvFacts,
    host_memory: int | None,
    memory_is: str = "available",
    sb3_buffers: bool = True,
    elsewhere: str = "",
) -> None:
    """Refuse, before anything is allocated, a run that would overshoot its length or outgrow the machine's memory
    (``host_memory`` bytes, where the rollout or replay buffer lives on the host; None: it does not; ``memory_is``
    says what that figure is; ``sb3_buffers``: SB3's own buffers, not sb3_gpu's device ones; ``elsewhere``: why the
    GPU did not take them, where it was too small)."""
    params: Any = preset.params
    per_env = params.n_steps if preset.algo == "ppo" else _train_freq_steps(params.train_freq)
    rollout = per_env * preset.n_envs
    if per_env and rollout > preset.n_timesteps:
        what = "n_steps" if preset.algo == "ppo" else "train_freq"
        raise ConfigError(
            f"one rollout is {what} * n_envs = {per_env:,} * {preset.n_envs:,} = {rollout:,} env steps, more than the "
            f"{preset.n_timesteps:,} timesteps to train (SB3 always completes a rollout): lower n_envs or {what}, or "
            "train longer"
        )
    # SB3 takes it without a word, and every batch repeats transitions. (PPO's larger batch is a whole rollout: the
    # plan table says so, and a study's trial may draw it.)
    if preset.algo != "ppo" and params.batch_size > params.buffer_size:
        raise ConfigError(
            f"batch_size ({params.batch_size:,}) is more than buffer_size ({params.buffer_size:,}): every batch would "
            "repeat transitions; lower batch_size or raise buffer_size"
        )
    # numpy commits a buffer's pages as they fill: one that does not fit is killed by the OOM killer hours in, where
    # nothing can save it. So it is refused here, with room left for the rest of the run.
    # SB3's rollout buffer copies each array as it flattens the envs into one batch axis for sampling (a copy where
    # there are several envs), the whole observations while the rollout is still held.
    flattened = preset.algo == "ppo" and sb3_buffers and preset.n_envs > 1
    needed = _data_bytes(preset, facts) + (_observation_bytes(preset, facts) if flattened else 0)
    if host_memory is not None and needed > HOST_MEMORY_SHARE * host_memory:
        if preset.algo == "ppo":
            holder = f"a rollout of n_steps * n_envs = {params.n_steps:,} * {preset.n_envs:,} steps needs"
            what, fix = "its observations", "lower n_steps or n_envs"
            if flattened:
                what += " (twice while SB3 flattens them for sampling)"
        else:
            holder, fix = f"buffer_size={params.buffer_size:,} needs", "lower buffer_size"
            each = "one observation" if getattr(params, "optimize_memory_usage", False) else "observation and next observation"
            what = f"its transitions ({each} each)"
        gpu = f"; nor does the GPU hold it: {elsewhere}" if elsewhere else ""
        raise ConfigError(
            f"{holder} {size_text(needed)} of memory for {what}, more than {HOST_MEMORY_SHARE:.0%} of the "
            f"{size_text(host_memory)} {memory_is} (the networks, envs and evaluations need the rest){gpu}: {fix}"
        )


def _train_freq_steps(train_freq: int | tuple[int, str]) -> int:
    """Env steps per env in one off-policy rollout (0 where it is counted in episodes, whose length is unknown)."""
    if isinstance(train_freq, tuple):
        return train_freq[0] if train_freq[1] == "step" else 0
    return train_freq


def _transition_bytes(obs_space: spaces.Space, action_space: spaces.Space, frame_stack: int, once: bool = False) -> int:
    """Bytes of one transition in SB3's replay buffer: two (stacked) observations, the action, reward, done, timeout.
    ``once`` (optimize_memory_usage, sb3_gpu's device buffer): one observation and the int64 row of where an episode
    end's next observation is kept aside (those, one an episode end, are left out)."""
    subspaces = obs_space.spaces.values() if isinstance(obs_space, spaces.Dict) else [obs_space]
    obs = frame_stack * sum(int(np.prod(s.shape or (1,))) * np.dtype(s.dtype or np.float32).itemsize for s in subspaces)
    # Actions keep their space's dtype (discrete ones int64), but float64 is stored as float32.
    dtype = np.dtype(action_space.dtype or np.int64)
    action = int(np.prod(action_space.shape or (1,))) * (4 if dtype == np.float64 else dtype.itemsize)
    return (obs + 8 if once else 2 * obs) + action + 3 * 4


def _check_count_kwarg(key: str, value: Any, default: str) -> None:
    """A count in policy_kwargs that SB3 takes as given and fails on, far into the run, when it is below 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"policy_kwargs.{key} must be an int >= 1 ({default}), got {value!r}")


def _check_quantiles(drop: int, n_quantiles: Any) -> None:
    """TQC's critics each give ``n_quantiles``; the target drops the top ``drop`` of each: some must be left."""
    _check_count_kwarg("n_quantiles", n_quantiles, "TQC's default: 25")
    if drop >= n_quantiles:
        raise ConfigError(
            f"top_quantiles_to_drop_per_net={drop} drops every one of each critic's n_quantiles={n_quantiles}, leaving "
            f"no target: drop 0 to {n_quantiles - 1}, or raise policy_kwargs.n_quantiles"
        )


def _check_policy_fits(preset: Preset, obs_space: spaces.Space) -> None:
    """SB3 refuses these when the model is built, in words about its feature extractors: said here in the plan's."""
    policy, source = preset.policy, preset.sources.get("policy", "preset")
    if isinstance(obs_space, spaces.Dict) != (policy == "MultiInputPolicy"):
        wanted = "MultiInputPolicy" if isinstance(obs_space, spaces.Dict) else "MlpPolicy or CnnPolicy"
        raise ConfigError(f"policy={policy} ({source}) does not take {_shown(obs_space)}; use {wanted}, or leave policy auto")
    if policy == "CnnPolicy" and not (isinstance(obs_space, spaces.Box) and len(obs_space.shape) == 3):
        raise ConfigError(
            f"policy=CnnPolicy ({source}) takes images, a Box of shape (height, width, channels) or (channels, height, "
            f"width); the observations are {_shown(obs_space)}: use MlpPolicy, or leave policy auto"
        )
    need = f"NatureCNN, which needs images of at least {_NATURE_CNN_SIDE}x{_NATURE_CNN_SIDE} pixels"
    if policy == "CnnPolicy" and (small := _too_small_for_nature_cnn(obs_space, preset.policy_kwargs)):
        raise ConfigError(
            f"policy=CnnPolicy ({source}) runs {need}; the observations are {small}: use MlpPolicy, leave policy auto, "
            "or pass policy_kwargs features_extractor_class (an extractor of your own, in Python)"
        )
    if isinstance(obs_space, spaces.Dict):  # the keys VecNormalize scales are floats then: flattened, no CNN
        scaled = _scaled_keys(preset, obs_space)
        for key, member in obs_space.spaces.items():
            if key not in scaled and (small := _too_small_for_nature_cnn(member, preset.policy_kwargs)):
                raise ConfigError(
                    f"MultiInputPolicy runs {need}, on the Dict's image {key!r}, which is {small}: make that key's "
                    "dtype float (SB3 then flattens it), or pass policy_kwargs features_extractor_class (in Python)"
                )


def _shown(space: spaces.Space) -> str:
    """A Box by its shape and dtype: its bounds, printed in full, run to lines of numbers."""
    return f"a Box of shape {space.shape}, {space.dtype}" if isinstance(space, spaces.Box) else str(space)


def _check_combinations(preset: Preset, obs_space: spaces.Space, action_space: spaces.Space, training: bool = True) -> None:
    """Refuse settings that each pass alone but that SB3 or sb3_gpu cannot run together."""
    params: Any = preset.params
    _check_policy_fits(preset, obs_space)
    if getattr(params, "use_sde", False) and not isinstance(action_space, spaces.Box):
        # SB3 refuses it only as the model is built, after a plan that said nothing.
        raise ConfigError(f"use_sde=true explores continuous actions; the env's actions are {action_space}: set use_sde=false")
    if preset.algo == "ppo":
        if params.n_steps * preset.n_envs < 2:
            raise ConfigError(f"n_steps * n_envs must be > 1 for PPO, got {params.n_steps} * {preset.n_envs}")
        check_accumulation(params.grad_accum_steps, params.n_steps, preset.n_envs, params.batch_size)
    elif preset.algo in CONTINUOUS_ALGOS:
        check_actor_critic_accumulation(params.grad_accum_steps, getattr(params, "use_sde", False))
        if "n_critics" in preset.policy_kwargs:
            _check_count_kwarg("n_critics", preset.policy_kwargs["n_critics"], f"{preset.algo.upper()}'s default: 2")
        if preset.algo == "tqc":
            _check_quantiles(params.top_quantiles_to_drop_per_net, preset.policy_kwargs.get("n_quantiles", 25))
    elif preset.algo == "qrdqn" and "n_quantiles" in preset.policy_kwargs:
        _check_count_kwarg("n_quantiles", preset.policy_kwargs["n_quantiles"], "QR-DQN's default: 200")
    # Keys that SB3 takes and then ignores: refused, so that no run is believed to have used them (a run saved before
    # they were refused still evaluates).
    if training and not getattr(params, "use_sde", False):
        for key, unused in (("sde_sample_freq", -1), ("use_sde_at_warmup", False)):
            if getattr(params, key, unused) != unused:
                raise ConfigError(f"{key}={getattr(params, key)} applies with use_sde=true only; set use_sde or drop {key}")
    fixed = not isinstance(getattr(params, "ent_coef", "auto"), str)
    if training and fixed and getattr(params, "target_entropy", "auto") != "auto":
        raise ConfigError(
            f"target_entropy={params.target_entropy} applies where the entropy coefficient is learned (ent_coef auto or "
            f"auto_<initial value>), not with ent_coef={params.ent_coef}"
        )
    freq = getattr(params, "train_freq", None)
    if isinstance(freq, tuple) and freq[1] == "episode" and preset.n_envs > 1:
        raise ConfigError(
            f"train_freq [{freq[0]}, episode] needs n_envs=1 (SB3 counts the episodes of one env), got n_envs={preset.n_envs}"
        )
    if getattr(params, "optimize_memory_usage", False) and preset.device_buffers != "true":
        source = preset.sources.get("optimize_memory_usage", "preset")
        raise ConfigError(
            f"optimize_memory_usage=true ({source}) needs device_buffers=true: SB3's host replay buffer refuses it "
            "beside the handling of time limits, which sb3_gpu keeps on, and sb3_gpu's device buffer takes both; set "
            "device_buffers=true, or leave optimize_memory_usage false"
        )
    if getattr(params, "per", False) and isinstance(obs_space, spaces.Dict):
        raise ConfigError("prioritized replay does not support Dict observations yet; set per=false")
    _check_normalize(preset, obs_space)


def _float64_observations(preset: Preset, obs_space: spaces.Space) -> str:
    """Which observations reach the device as float64 ("" if none), which MPS cannot hold: SB3 makes tensors of them
    in their own dtype. (Those VecNormalize scales reach it as float32: it hands them over so as it steps, and SB3's
    host replay buffers scale them so as they sample.)"""
    members = obs_space.spaces if isinstance(obs_space, spaces.Dict) else {"": obs_space}
    scaled = _scaled_keys(preset, obs_space)
    wide = [k for k, m in members.items() if isinstance(m, spaces.Box) and m.dtype == np.float64 and k not in scaled]
    if not wide:
        return ""
    return "the observations are" if wide == [""] else f"the Dict's {', '.join(repr(k) for k in wide)} are"


def _normalizes_observations(preset: Preset) -> bool:
    """Whether the plan's VecNormalize scales the observations (a uint8 image into float32)."""
    options = preset.normalize if isinstance(preset.normalize, dict) else {}
    return bool(preset.normalize) and options.get("norm_obs", True)


def _scaled_keys(preset: Preset, obs_space: spaces.Space) -> set[str]:
    """The keys of the observations the plan's VecNormalize scales; "" stands for observations that are no Dict."""
    if not _normalizes_observations(preset):
        return set()
    if not isinstance(obs_space, spaces.Dict):
        return {""}
    options = preset.normalize if isinstance(preset.normalize, dict) else {}
    return set(options.get("norm_obs_keys") or obs_space.spaces)


def _check_normalize(preset: Preset, obs_space: spaces.Space) -> None:
    """VecNormalize's refusals, and NatureCNN's of what it leaves, said in the plan rather than as the model is
    built."""
    source = preset.sources.get("normalize", "preset")
    # Images VecNormalize leaves as they are stay uint8, and SB3 adds VecTransposeImage over it for them; its
    # off-policy algorithms store VecNormalize's original observations, from below that wrapper.
    scaled = _scaled_keys(preset, obs_space)
    left = [key for key in channel_last_images(obs_space) if key not in scaled]
    if preset.normalize and not get_algo(preset.algo).on_policy and left:
        which = f"the Dict's {', '.join(repr(k) for k in left)}" if left != [""] else "the observations"
        raise ConfigError(
            f"normalize ({source}) leaves {which} channel-last images, which {preset.algo} cannot store: SB3's "
            "off-policy algorithms store them from below the wrapper that moves channels first, in a buffer that holds "
            "them channels first; set normalize=false"
        )
    if not _normalizes_observations(preset):
        return
    asked = (preset.normalize if isinstance(preset.normalize, dict) else {}).get("norm_obs_keys")
    instead = "set normalize.norm_obs=false (rewards only), or normalize=false"
    if isinstance(obs_space, spaces.Dict):
        boxes = [key for key, member in obs_space.spaces.items() if isinstance(member, spaces.Box)]
        if boxes:
            instead = f"set normalize.norm_obs_keys={boxes} (the Dict's Box keys), or normalize.norm_obs=false (rewards only)"
        for key in asked or ():
            if key not in obs_space.spaces:
                raise ConfigError(
                    f"normalize.norm_obs_keys ({source}): the observations have no key {key!r}"
                    f"{closest(key, obs_space.spaces)} (keys: {', '.join(obs_space.spaces)})"
                )
        members = {key: obs_space.spaces[key] for key in scaled}
    elif asked is not None:
        raise ConfigError(
            f"normalize.norm_obs_keys ({source}) names keys of a Dict observation, but these observations are "
            f"{_shown(obs_space)}: leave norm_obs_keys out"
        )
    else:
        members = {"": obs_space}
    for key, member in members.items():
        if not isinstance(member, spaces.Box):
            where = f"the Dict's {key!r} is" if key else "the observations are"
            raise ConfigError(f"normalize ({source}) scales Box observations; {where} {_shown(member)}: {instead}")
        # VecNormalize keeps the space of a Box that is no image, and PPO's rollout buffer allocates in it: scaled
        # values stored as integers are truncated or wrap around (uint8: -1.5 becomes 255).
        integers = not np.issubdtype(member.dtype, np.floating) and not is_image_space(member, check_channels=False)
        if integers and get_algo(preset.algo).on_policy:
            where = f"the Dict's {key!r}" if key else "the observations"
            raise ConfigError(
                f"normalize ({source}) scales {where} into floats, which {preset.algo}'s rollout buffer would store as "
                f"their {member.dtype}: give the env float32 observations (gymnasium.wrappers.DtypeObservation), or "
                f"{instead}"
            )
    kwargs = preset.policy_kwargs
    if preset.policy != "CnnPolicy" or "features_extractor_class" in kwargs:
        return
    # NatureCNN takes float images only as already normalised ones, channel-first: SB3 moves channels first only
    # while they are still uint8 images.
    if not (isinstance(obs_space, spaces.Box) and is_image_space_channels_first(obs_space)):
        raise ConfigError(
            f"normalize ({source}) would turn the channel-last images into floats, which SB3 then no longer moves "
            f"channels first for CnnPolicy's NatureCNN: {instead}"
        )
    if kwargs.get("normalize_images", True) is not False:
        raise ConfigError(
            f"normalize ({source}) would turn the images into floats, which CnnPolicy's NatureCNN takes only with "
            f"policy_kwargs normalize_images=false: set it, or {instead}"
        )
