"""``bench train``: a preset against plain SB3 with rl-zoo3's hyperparameters, time and steps to a reward threshold,
both trained through the same Session (NaN guard, signals, telemetry) and evaluated the same way (a new best confirmed
on fresh episodes), so that neither pays for what the other skips.

A seed's run is saved as it ends (``train-runs-ALGO-ENV.json`` in the ``--out`` folder), and a later ``bench train``
with the same settings on the same machine keeps it and trains only what is missing: a comparison of hours per seed
can be gathered over several sittings, and one stopped halfway loses only the run under way."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import sb3_contrib
import stable_baselines3 as sb3
import torch as th
from sb3_contrib import QRDQN, TQC
from stable_baselines3 import DQN, PPO, SAC, TD3
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.utils import LinearSchedule
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv, VecFrameStack

from sb3_gpu.benches.base import SB3_TORCH, machine_key, preset_sha256, save_json
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.version import __version__
from sb3_gpu.envs.build import close_vec_envs, make_vec_env
from sb3_gpu.envs.spec import looks_atari, register_ale, resolve_env
from sb3_gpu.planning.build import EVAL_SEED_OFFSET, build_env, build_model, offset_seed
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.evaluation import confirm_count, eval_envs
from sb3_gpu.runs.threshold import THRESHOLD_EVALUATIONS, train_to_threshold

# rl-zoo3's published hyperparameters (hyperparams/*.yml in DLR-RM/rl-baselines3-zoo), the baseline that `bench
# train` runs with plain SB3. LunarLander-v3 takes the values rl-zoo3 lists for LunarLander-v2. ("lin", x) is
# rl-zoo3's lin_x: x decaying linearly to 0 over the entry's `zoo_timesteps` (rl-zoo3's n_timesteps), else over the
# bench's budget; DQN's exploration_fraction, a share of learn()'s total, is a share of `zoo_timesteps` the same way.
ZOO: dict[tuple[str, str], dict[str, Any]] = {
    ("ppo", "CartPole-v1"): dict(
        n_envs=8,
        zoo_timesteps=100_000,
        n_steps=32,
        batch_size=256,
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate=("lin", 1e-3),
        clip_range=("lin", 0.2),
    ),
    ("ppo", "LunarLander-v3"): dict(
        n_envs=16,
        n_steps=1024,
        batch_size=64,
        gae_lambda=0.98,
        gamma=0.999,
        n_epochs=4,
        ent_coef=0.01,
    ),
    ("dqn", "CartPole-v1"): dict(
        n_envs=1,
        zoo_timesteps=50_000,
        learning_rate=2.3e-3,
        batch_size=64,
        buffer_size=100_000,
        learning_starts=1000,
        gamma=0.99,
        target_update_interval=10,
        train_freq=256,
        gradient_steps=128,
        exploration_fraction=0.16,
        exploration_final_eps=0.04,
        policy_kwargs=dict(net_arch=[256, 256]),
    ),
}
# rl-zoo3 gives QR-DQN on CartPole DQN's values, with 10 quantiles.
ZOO["qrdqn", "CartPole-v1"] = {**ZOO["dqn", "CartPole-v1"], "policy_kwargs": dict(net_arch=[256, 256], n_quantiles=10)}
# Pendulum (hyperparams/sac.yml, tqc.yml, td3.yml): SAC's and TQC's defaults with a larger learning rate; TD3 with
# Gaussian exploration noise of std 0.1 (`noise_std`: built as SB3's NormalActionNoise of the action shape).
ZOO["sac", "Pendulum-v1"] = dict(n_envs=1, learning_rate=1e-3)
ZOO["tqc", "Pendulum-v1"] = dict(n_envs=1, learning_rate=1e-3)
ZOO["td3", "Pendulum-v1"] = dict(
    n_envs=1,
    gamma=0.98,
    buffer_size=200_000,
    learning_starts=10_000,
    noise_std=0.1,
    gradient_steps=1,
    train_freq=1,
    learning_rate=1e-3,
    policy_kwargs=dict(net_arch=[400, 300]),
)

# LunarLanderContinuous-v3 takes the values rl-zoo3 lists for -v2: 400x300 networks; SAC's and TQC's learning rate
# decays over their 500k steps whatever the bench's budget, so that the steps a run takes are the ones rl-zoo3 takes.
ZOO["sac", "LunarLanderContinuous-v3"] = dict(
    n_envs=1,
    zoo_timesteps=500_000,
    batch_size=256,
    learning_rate=("lin", 7.3e-4),
    buffer_size=1_000_000,
    ent_coef="auto",
    gamma=0.99,
    tau=0.01,
    train_freq=1,
    gradient_steps=1,
    learning_starts=10_000,
    policy_kwargs=dict(net_arch=[400, 300]),
)
ZOO["tqc", "LunarLanderContinuous-v3"] = ZOO["sac", "LunarLanderContinuous-v3"]
ZOO["td3", "LunarLanderContinuous-v3"] = ZOO["td3", "Pendulum-v1"]  # rl-zoo3 lists the same values for both

# rl-zoo3's values for every Atari game (its `atari` entries), run with its AtariWrapper and a 4-frame stack.
ZOO_ATARI: dict[str, dict[str, Any]] = {
    "ppo": dict(
        n_envs=8,
        zoo_timesteps=10_000_000,
        n_steps=128,
        n_epochs=4,
        batch_size=256,
        learning_rate=("lin", 2.5e-4),
        clip_range=("lin", 0.1),
        vf_coef=0.5,
        ent_coef=0.01,
    ),
}


def has_zoo_baseline(algo: str, env_id: str) -> bool:
    return (algo, env_id) in ZOO or (looks_atari(env_id) and algo in ZOO_ATARI)


def zoo_entry(algo: str, env_id: str) -> dict[str, Any]:
    """rl-zoo3's values for ``algo`` on ``env_id``: its own entry, else its Atari entry."""
    return ZOO[(algo, env_id)] if (algo, env_id) in ZOO else ZOO_ATARI[algo]


def versions() -> str:
    """The versions a saved run was trained with: runs of other releases are not comparable, so not kept (sb3_gpu's
    commits between two releases are not told apart)."""
    return f"sb3_gpu {__version__}, SB3 {sb3.__version__}, sb3-contrib {sb3_contrib.__version__}, torch {th.__version__}"


def zoo_model(
    algo: str,
    env_id: str,
    seed: int,
    vec_env_cls: type[DummyVecEnv | SubprocVecEnv] = DummyVecEnv,
    device: str = "auto",
    budget: int | None = None,
) -> BaseAlgorithm:
    """Plain SB3 as an rl-zoo3 user runs it: the published hyperparameters, DummyVecEnv (or ``vec_env_cls``) and
    SB3's default device.

    :param budget: the env steps it will be trained for; a linear schedule of an entry with ``zoo_timesteps`` then
        decays as it would over rl-zoo3's own length
    """
    if env_id not in gym.registry:
        register_ale()  # SB3 makes the id as it is: ale-py's ids (Pong-v4 too) must be registered first
    atari = (algo, env_id) not in ZOO and looks_atari(env_id)
    kwargs = dict(zoo_entry(algo, env_id))
    n_envs = kwargs.pop("n_envs")
    zoo_timesteps = kwargs.pop("zoo_timesteps", None)
    # SB3 schedules read the fraction of learn()'s total left; over rl-zoo3's length that is budget / zoo_timesteps.
    end_fraction = zoo_timesteps / budget if zoo_timesteps and budget else 1.0
    for key, value in list(kwargs.items()):
        if isinstance(value, tuple):
            kwargs[key] = LinearSchedule(value[1], 0.0, end_fraction)
    if "exploration_fraction" in kwargs:  # epsilon reaches its floor after the env steps rl-zoo3's run takes to it
        kwargs["exploration_fraction"] *= end_fraction
    env: VecEnv
    if atari:
        # sb3_gpu's own maker of the id: it registers ale-py's ids where it runs (SubprocVecEnv's workers start with
        # none), and turns the id's own frame skip off (v5's 4, Pong-v4's 2 to 4 at random), as AtariWrapper skips.
        venv = make_atari_env(resolve_env(env_id).make, n_envs=n_envs, seed=seed, vec_env_cls=vec_env_cls)
        env = VecFrameStack(venv, n_stack=4)
    else:
        env = sb3_make_vec_env(env_id, n_envs=n_envs, seed=seed, vec_env_cls=vec_env_cls)
    policy = "CnnPolicy" if atari else "MlpPolicy"
    std = kwargs.pop("noise_std", None)
    if std is not None:
        shape = env.action_space.shape or ()
        kwargs["action_noise"] = NormalActionNoise(mean=np.zeros(shape), sigma=np.full(shape, std))
    algo_class: Any = {"ppo": PPO, "dqn": DQN, "qrdqn": QRDQN, "sac": SAC, "td3": TD3, "tqc": TQC}[algo]
    return algo_class(policy, env, seed=seed, verbose=0, device=device, **kwargs)


def train_once(
    model: BaseAlgorithm,
    env_id: str,
    max_timesteps: int,
    threshold: float,
    eval_freq: int,
    episodes: int,
    seed: int,
    frame_stack: int | None = None,
) -> dict[str, Any]:
    """Train until the best, confirmed, deterministic eval mean reaches ``threshold``; evaluation time is kept apart.
    The eval env stacks ``frame_stack`` frames, as the model's training env does; an Atari game's frames are SB3's
    AtariWrapper's, for either side."""
    seed_ = offset_seed(seed, EVAL_SEED_OFFSET)
    eval_env = make_vec_env(env_id, eval_envs(episodes), seed=seed_, vec_env="dummy", frame_stack=frame_stack)
    try:
        run, _ = train_to_threshold(
            model,
            eval_env,
            threshold,
            max_timesteps,
            eval_freq=eval_freq,
            episodes=episodes,
            confirm_episodes=confirm_count(episodes),
        )
    finally:
        close_vec_envs(model.get_env(), eval_env)
    if run.stopped_by is not None:
        raise KeyboardInterrupt(f"stopped by {run.stopped_by}")
    return {
        "seed": seed,
        "reached": run.reached,
        "timesteps": run.timesteps,
        "train_seconds": round(run.train_seconds, 2),
        "steps_per_s": round(run.steps_per_s, 1),
        "best": run.best,
    }


def runs_file(algo: str, env_id: str) -> str:
    """The file of one comparison's saved runs: one per algorithm and env, so that one ``--out`` folder holds many."""
    return f"train-runs-{algo}-{env_id.replace('/', '_')}.json"


class SavedRuns:
    """The seed runs of one comparison, saved in ``folder/`` :func:`runs_file` as each ends.

    Runs are kept only for the same settings, preset file and machine (its processor, cores and GPUs): a file saved
    with others is refused, never mixed in.
    """

    def __init__(self, folder: Path | None, settings: dict[str, Any]) -> None:
        self.path = None if folder is None else folder / runs_file(settings["algo"], settings["env"])
        self.settings = settings
        self.runs: dict[str, dict[str, dict[str, Any]]] = {"sb3_gpu": {}, "sb3_zoo": {}}
        if self.path is None or not self.path.exists():
            return
        try:
            saved = json.loads(self.path.read_text())
            before = dict(saved["settings"])
            differ = [k for k in sorted(settings.keys() | before.keys()) if before.get(k) != settings.get(k)]
            runs = {side: dict(saved["runs"][side]) for side in self.runs}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{self.path} is not a saved bench train ({exc}); remove it or pass another --out") from None
        if differ:
            was = ", ".join(f"{k} {before.get(k)!r} (now {settings.get(k)!r})" for k in differ)
            raise ConfigError(f"{self.path} holds runs with other settings: {was}; remove it or pass another --out")
        self.runs = runs

    def get(self, side: str, seed: int) -> dict[str, Any] | None:
        return self.runs[side].get(str(seed))

    def add(self, side: str, seed: int, run: dict[str, Any]) -> None:
        self.runs[side][str(seed)] = run
        if self.path is not None:
            save_json(self.path, {"settings": self.settings, "runs": self.runs}, "the ended runs")


def _train_side(
    side: str,
    algo: str,
    env_id: str,
    seed: int,
    max_timesteps: int | None,
    budget: int,
    threshold: float,
    every: int,
    episodes: int,
) -> dict[str, Any]:
    """One seed of one side: our preset as the plan makes it (the plan named in the run), or rl-zoo3's values."""
    if side == "sb3_zoo":
        SB3_TORCH.apply()  # torch's own threads, TF32 and cuDNN settings: not what the seed's plan left
        model = zoo_model(algo, env_id, seed, budget=budget)
        stack = 4 if (algo, env_id) not in ZOO and looks_atari(env_id) else None  # zoo_model's stack of Atari frames
        run = train_once(model, env_id, budget, threshold, every, episodes, seed, frame_stack=stack)
        return {**run, "threads": SB3_TORCH.threads}
    start = time.perf_counter()
    plan = make_plan(algo, env_id, "auto", seed=seed, n_timesteps=max_timesteps)  # compile=auto weighs the budget
    plan_seconds = time.perf_counter() - start  # the probe's timings, cached for later plans: reported, not in the time
    if every % plan.preset.n_envs:  # the probe chose another profile than the one bench_train checked the interval for
        raise ConfigError(f"--eval-freq {every} is not a multiple of the {plan.preset.n_envs} envs seed {seed}'s plan steps")
    model = build_model(plan, build_env(plan))
    run = train_once(model, env_id, budget, threshold, every, episodes, seed, frame_stack=plan.preset.frame_stack)
    compiled = plan.speed.compile_label if plan.speed is not None else "false"
    return {
        **run,
        "plan_seconds": round(plan_seconds, 2),
        "plan": f"device {plan.device.device}, vec_env {plan.vec_env}, {plan.preset.n_envs} envs, compile {compiled}",
    }


def bench_train(
    algo: str,
    env_id: str,
    seeds: Sequence[int],
    threshold: float,
    max_timesteps: int | None,
    eval_freq: int | None,
    episodes: int,
    print_fn: Callable[[str], None] = print,
    out: Path | None = None,
) -> dict[str, Any]:
    """Our preset (device, vec env and threads chosen by the plan) and plain SB3 with rl-zoo3's values, per seed, in
    turns; both to the same threshold on the same budget (the preset's), evaluated the same way.

    :param out: where each run is saved as it ends, and where runs of the same settings saved earlier are kept
    """
    results: dict[str, list[dict[str, Any]]] = {"sb3_gpu": [], "sb3_zoo": []}
    first = make_plan(algo, env_id, "auto", seed=seeds[0], n_timesteps=max_timesteps, training=False)
    budget = max_timesteps or first.preset.n_timesteps
    # Each side evaluates every `every` // n_envs vec steps: a multiple of both env counts evaluates both at the same
    # env steps.
    envs = (first.preset.n_envs, zoo_entry(algo, env_id)["n_envs"])
    step = math.lcm(*envs)
    every = eval_freq or max(budget // THRESHOLD_EVALUATIONS // step * step, step)
    if every % step:
        raise ConfigError(
            f"--eval-freq {every} is not a multiple of {step}: sb3_gpu steps {envs[0]} envs at once and the baseline "
            f"{envs[1]}, so the two would be evaluated at other env steps"
        )
    settings = {
        "algo": algo,
        "env": env_id,
        "threshold": threshold,
        "budget": budget,
        "eval_freq": every,
        "eval_episodes": episodes,
        "preset_sha256": preset_sha256(algo),
        "baseline_sha256": hashlib.sha256(repr(zoo_entry(algo, env_id)).encode()).hexdigest(),
        "versions": versions(),
        "machine": machine_key(),
    }
    saved = SavedRuns(out, settings)
    for seed in seeds:
        for side, runs in results.items():
            run = saved.get(side, seed)
            if run is not None:
                print_fn(f"  seed {seed}: {side} kept from {saved.path}")
            else:
                run = _train_side(side, algo, env_id, seed, max_timesteps, budget, threshold, every, episodes)
                saved.add(side, seed, run)
            runs.append(run)
        print_fn(f"  seed {seed}: sb3_gpu {results['sb3_gpu'][-1]}, zoo {results['sb3_zoo'][-1]}")
    summary: dict[str, Any] = {
        "algo": algo,
        "env": env_id,
        "threshold": threshold,
        "seeds": list(seeds),
        "plan": "; ".join(dict.fromkeys(run["plan"] for run in results["sb3_gpu"])),
        "budget": budget,
        "eval_freq": every,
        "eval_episodes": episodes,
        "confirm_episodes": confirm_count(episodes),
        "machine": settings["machine"],
    }
    for name, runs in results.items():
        seconds = [r["train_seconds"] for r in runs]
        summary[name] = {
            "runs": runs,
            "reached": sum(r["reached"] for r in runs),
            "median_train_seconds": statistics.median(seconds),
            "train_seconds_range": [min(seconds), max(seconds)],
            "median_timesteps": statistics.median(r["timesteps"] for r in runs),
            "timesteps_range": [min(r["timesteps"] for r in runs), max(r["timesteps"] for r in runs)],
            "median_steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
        }
    ours, zoo = summary["sb3_gpu"], summary["sb3_zoo"]
    summary["time_ratio"] = ours["median_train_seconds"] / max(zoo["median_train_seconds"], 1e-9)
    planned = [r["plan_seconds"] for r in results["sb3_gpu"] if "plan_seconds" in r]  # runs saved before it was kept
    ours["median_plan_seconds"] = statistics.median(planned) if planned else None
    return summary


def train_markdown(summary: dict[str, Any], command: str) -> str:
    """The summary as a markdown table with the ratio, headed by the command that produced it."""
    ours, zoo = summary["sb3_gpu"], summary["sb3_zoo"]
    n = len(summary["seeds"])
    lines = [
        f"`{command}`: {summary['algo']} {summary['env']} to a mean eval return of {summary['threshold']:g}, confirmed "
        f"on {summary['confirm_episodes']} fresh episodes (evaluated every {summary['eval_freq']:,} env steps on "
        f"{summary['eval_episodes']} episodes; {n} seeds; a budget of {summary['budget']:,} env steps each; evaluation time "
        f"excluded; ours: {summary['plan']}; {summary['machine']})",
        "",
        "| run | seeds reached | time to threshold, median [min-max] | timesteps, median [min-max] | steps/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in (("sb3_gpu preset", ours), ("SB3 + rl-zoo3 values", zoo)):
        (t_lo, t_hi), (n_lo, n_hi) = s["train_seconds_range"], s["timesteps_range"]
        lines.append(
            f"| {name} | {s['reached']}/{n} | {s['median_train_seconds']:.1f} s [{t_lo:.1f}-{t_hi:.1f}] "
            f"| {s['median_timesteps']:,.0f} [{n_lo:,}-{n_hi:,}] | {s['median_steps_per_s']:,.0f} |"
        )
    lines += [
        "",
        f"Time to threshold, sb3_gpu / SB3 + rl-zoo3: {summary['time_ratio']:.2f}x (medians; below 1 is faster; a run "
        f"that never reached the threshold counts its whole time). Seeds reached: {ours['reached']} vs {zoo['reached']}.",
    ]
    if ours.get("median_plan_seconds") is not None:
        lines.append(
            f"sb3_gpu's plan took {ours['median_plan_seconds']:.1f} s a seed (median), outside its time: the first plan on a "
            "machine times its options, and later plans read those timings from the cache."
        )
    return "\n".join(lines) + "\n"
