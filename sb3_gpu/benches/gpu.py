"""``bench gpu``: the device data path against SB3's host buffers on one device, side by side in one process.

Two parts: ``sample(batch)`` of Atari-shaped uint8 frames (SB3's ReplayBuffer, which gathers on the host and copies
the batch over, against DeviceReplayBuffer, which gathers where the frames live), and env steps/s of the PPO and DQN
presets trained with SB3's buffers and with the device buffers (``device_buffers`` false and true), in alternating
rounds. On CUDA it adds the peak device memory of each training and, with ``pynvml``, the GPU utilisation.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.vec_env import SubprocVecEnv

from sb3_gpu.benches.base import SB3_TORCH, paired_times
from sb3_gpu.benches.train import has_zoo_baseline, zoo_model
from sb3_gpu.common.torch_settings import synchronize
from sb3_gpu.envs.batched import BatchedSubprocVecEnv
from sb3_gpu.envs.build import close_vec_envs
from sb3_gpu.extensions.per import DevicePrioritizedReplayBuffer, PrioritizedReplayBuffer
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan

FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)  # what SB3's Atari preprocessing and a 4-frame stack give


def _filled(buffer: ReplayBuffer, capacity: int) -> ReplayBuffer:
    """Every slot written, with frames that differ (a repeated random block: random bytes for a million frames would
    take longer than the bench)."""
    block = np.random.default_rng(0).integers(0, 256, (min(capacity, 256), 1, *FRAMES.shape), dtype=np.uint8)
    reps = -(-capacity // len(block))
    frames = np.tile(block, (reps, 1, 1, 1, 1))[:capacity]
    if isinstance(buffer, DeviceReplayBuffer):
        for start in range(0, capacity, 4096):  # in chunks: the host copy of a whole buffer may not fit twice
            chunk = th.from_numpy(frames[start : start + 4096]).to(buffer.device)
            buffer.observations[start : start + 4096] = chunk
            if buffer.next_observations is not None:
                buffer.next_observations[start : start + 4096] = chunk
    else:
        buffer.observations[:] = frames
        buffer.next_observations[:] = frames
    buffer.pos, buffer.full = 0, True
    priorities = np.random.default_rng(1).uniform(0.01, 2.0, capacity)  # unequal, so the prefix search has work
    if isinstance(buffer, PrioritizedReplayBuffer):
        buffer.tree.update(np.arange(capacity), priorities**buffer.alpha)
    elif isinstance(buffer, DevicePrioritizedReplayBuffer):
        leaves = th.arange(capacity, device=buffer.device)
        buffer.tree.update(leaves, th.as_tensor(priorities**buffer.alpha, device=buffer.device))
    return buffer


def bench_sample(device: str, capacity: int, batch: int, repeats: int) -> dict[str, Any]:
    """Median seconds of ``sample(batch)``: SB3's host buffer (samples copied to ``device``) against the device
    buffer, then prioritized replay's sample and priority update, host trees against device trees."""
    dev = th.device(device)
    actions = gym.spaces.Discrete(6)

    def sample(buffer: ReplayBuffer, update: bool = False) -> Callable[[], None]:
        td = th.rand(batch, device=dev) if isinstance(buffer, DevicePrioritizedReplayBuffer) else np.random.rand(batch)

        def run() -> None:
            data: Any = buffer.sample(batch)
            if update:
                buffer.update_priorities(data.indices, td)  # type: ignore[attr-defined]
            synchronize(dev)  # a CUDA copy or gather is asynchronous: time it to its end

        return run

    out: dict[str, Any] = {"capacity": capacity, "batch": batch}
    sb3 = _filled(ReplayBuffer(capacity, FRAMES, actions, dev), capacity)
    ours = _filled(DeviceReplayBuffer(capacity, FRAMES, actions, dev), capacity)
    out["sb3_s"], out["device_s"] = paired_times(sample(sb3), sample(ours), repeats)[0].medians()
    del sb3, ours  # two frame buffers at a time at most
    host_per = _filled(PrioritizedReplayBuffer(capacity, FRAMES, actions, dev), capacity)
    device_per = _filled(DevicePrioritizedReplayBuffer(capacity, FRAMES, actions, dev), capacity)
    wall = paired_times(sample(host_per, update=True), sample(device_per, update=True), repeats)[0]
    out["per_host_s"], out["per_device_s"] = wall.medians()
    out["speedup"], out["per_speedup"] = out["sb3_s"] / out["device_s"], out["per_host_s"] / out["per_device_s"]
    return out


class _Utilisation:
    """Mean GPU utilisation over a block, sampled by NVML every 50 ms (None where pynvml or a GPU is missing)."""

    def __init__(self, device: th.device):
        self.device, self.samples = device, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Utilisation:
        if self.device.type == "cuda":
            try:
                th.cuda.utilization(self.device)  # needs pynvml
            except Exception:
                return self
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(th.cuda.utilization(self.device))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) / 100 if self.samples else None


# The env steps an off-policy preset collects before it trains, at most: a timed run shorter than a preset's own
# warm-up (100,000 on Atari) would time no gradient step at all.
WARM_UP = 1_000

# What each preset is trained with, in this order in the table; ratios are to the first. "zoo" is plain SB3 with
# rl-zoo3's values on SubprocVecEnv, for the envs that have them.
VARIANTS: dict[str, tuple[tuple[str, dict[str, Any] | None], ...]] = {
    "ppo": (("sb3", {"device_buffers": False}), ("device", {"device_buffers": True}), ("zoo", None)),
    "dqn": (
        ("sb3", {"device_buffers": False, "overlap_training": False}),
        ("device", {"device_buffers": True, "overlap_training": False}),
        ("device+overlap", {"device_buffers": True, "overlap_training": True}),
    ),
}
LABELS = {
    "sb3": "SB3's buffers",
    "device": "device buffers",
    "device+overlap": "device buffers, overlapped training",
    "zoo": "plain SB3, rl-zoo3 values, SubprocVecEnv",
}


def _timed_learn(model: Any, steps: int, device: th.device, in_process: bool) -> dict[str, Any]:
    if device.type == "cuda":
        th.cuda.reset_peak_memory_stats(device)
    with _Utilisation(device) as gpu:
        start, start_cpu = time.perf_counter(), time.process_time()
        model.learn(steps)
        synchronize(device)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    updates = int(getattr(model, "_n_updates", 0))
    return {
        "steps_per_s": model.num_timesteps / seconds,
        # This process's CPU seconds (all its threads): steadier than wall time on a shared machine, and the whole
        # cost where the envs step in this process; None where subprocesses step them.
        "cpu_s_per_1k": 1000 * cpu_seconds / model.num_timesteps if in_process else None,
        # SB3's n_updates: gradient steps for the DQN family, epochs for PPO.
        "grad_steps_per_1k": 1000 * updates / max(model.num_timesteps, 1),
        "gpu_utilisation": gpu.mean,
        "peak_memory_mib": th.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }


def _train_once(case: tuple[str, str, str], device: str, steps: int, overrides: dict[str, Any] | None) -> dict[str, Any]:
    algo, env, profile = case
    if overrides is None:
        SB3_TORCH.apply()
        model = zoo_model(algo, env, seed=0, vec_env_cls=SubprocVecEnv, device=device)
        try:
            return _timed_learn(model, steps, model.device, in_process=False)
        finally:
            close_vec_envs(model.get_env())
    plan = make_plan(algo, env, device, n_timesteps=steps, profile=profile, overrides=overrides)
    if getattr(plan.preset.params, "learning_starts", 0) > WARM_UP:  # Pong's 100,000: no update in a timed run
        warm = {**overrides, "learning_starts": WARM_UP}
        plan = make_plan(algo, env, device, n_timesteps=steps, profile=profile, overrides=warm)
    venv = build_env(plan)
    try:
        in_process = not isinstance(venv.unwrapped, (SubprocVecEnv, BatchedSubprocVecEnv))
        return _timed_learn(build_model(plan, venv), steps, th.device(plan.device.device), in_process)
    finally:
        close_vec_envs(venv)


def check_cases(cases: list[tuple[str, str, str]], device: str) -> None:
    """Plan each (algo, env, profile) without training or timing anything: a bad env or profile fails here, in one
    line, before the bench prints or measures anything."""
    for algo, env, profile in cases:
        make_plan(algo, env, device, profile=profile, training=False)


def bench_training(
    cases: Sequence[tuple[str, str, str]],
    device: str,
    steps: int,
    repeats: int,
    zoo: bool = True,
    rows: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Per (algo, env, profile): env steps/s of each of the algorithm's VARIANTS, in rounds whose order rotates.
    ``rows``, where given, gets each case's row as the case ends (what a stop leaves)."""
    rows = [] if rows is None else rows
    for case in cases:
        algo, env, profile = case
        variants = [(label, o) for label, o in VARIANTS[algo] if o is not None or (zoo and has_zoo_baseline(algo, env))]
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in variants}
        for round_ in range(repeats):
            shift = round_ % len(variants)
            for label, overrides in variants[shift:] + variants[:shift]:
                runs[label].append(_train_once(case, device, steps, overrides))
        base = variants[0][0]
        row: dict[str, Any] = {"algo": algo, "env": env, "profile": profile, "steps": steps, "variants": {}}
        for label, results in runs.items():
            figures: dict[str, Any] = {}
            for key in ("steps_per_s", "cpu_s_per_1k", "grad_steps_per_1k", "gpu_utilisation", "peak_memory_mib"):
                values = [r[key] for r in results if r[key] is not None]
                figures[key] = statistics.median(values) if values else None
            # To the first variant, round by round: env steps/s, and CPU time per env step where both have it.
            pairs = list(zip(results, runs[base], strict=True))
            figures["ratios"] = [r["steps_per_s"] / b["steps_per_s"] for r, b in pairs]
            figures["ratio"] = statistics.median(figures["ratios"])
            cpu = [b["cpu_s_per_1k"] / r["cpu_s_per_1k"] for r, b in pairs if r["cpu_s_per_1k"] and b["cpu_s_per_1k"]]
            figures["cpu_ratio"] = statistics.median(cpu) if cpu else None
            row["variants"][label] = figures
        rows.append(row)
    return rows


def gpu_markdown(device: str, sample: dict[str, Any], training: list[dict[str, Any]], command: str) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.0%}"

    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f} MiB"

    lines = [
        f"`{command}` on {device}",
        "",
        f"sample({sample['batch']}) of 4x84x84 uint8 frames from {sample['capacity']:,} transitions (median):",
        f"SB3's ReplayBuffer {sample['sb3_s'] * 1e3:.2f} ms, DeviceReplayBuffer {sample['device_s'] * 1e3:.2f} ms "
        f"({sample['speedup']:.1f}x)",
        f"prioritized sample + priority update: host trees {sample['per_host_s'] * 1e3:.2f} ms, device trees "
        f"{sample['per_device_s'] * 1e3:.2f} ms ({sample['per_speedup']:.1f}x)",
        "",
        "| preset | data path | env steps/s | ratio (range) | CPU time ratio | updates / 1k env steps | GPU utilisation "
        "| peak memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in training:
        name = f"{r['algo']} {r['env']}" + ("" if r["profile"] == "auto" else f" ({r['profile']})")
        for label, f in r["variants"].items():
            spread = f"{f['ratio']:.2f}x ({min(f['ratios']):.2f}-{max(f['ratios']):.2f})"
            cpu = "-" if f["cpu_ratio"] is None else f"{f['cpu_ratio']:.2f}x"
            lines.append(
                f"| {name} | {LABELS[label]} | {f['steps_per_s']:,.0f} | {spread} | {cpu} | {f['grad_steps_per_1k']:.0f} | "
                f"{pct(f['gpu_utilisation'])} | {mib(f['peak_memory_mib'])} |"
            )
    lines.append("")
    lines.append(
        "Ratios to the first row of each preset, median of the rounds (each round runs all rows): env steps/s, with "
        "the lowest and highest round, and this process's CPU time per env step (first row's over this row's; steadier "
        "on a shared machine, and '-' where subprocesses step the envs)."
    )
    return "\n".join(lines) + "\n"
