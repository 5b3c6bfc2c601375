"""``python -m sb3_gpu.train ALGO --env ID --device auto``: plan, print the plan, train, save, summarise."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback, EvalCallback
from stable_baselines3.common.vec_env import sync_envs_normalization

from sb3_gpu import __version__
from sb3_gpu._cli import Parser, evaluate, positive_int, print_error
from sb3_gpu._io import save_model, write_json, write_yaml
from sb3_gpu.callbacks import ProgressCallback, SaveVecNormalizeCallback
from sb3_gpu.envs import VEC_ENV_KINDS
from sb3_gpu.errors import ConfigError
from sb3_gpu.plan import Plan, build_env, build_model, load_config, make_plan, plan_table
from sb3_gpu.presets import ALGOS, parse_override

DEFAULT_ENV = "CartPole-v1"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m sb3_gpu.train", description="Train an SB3 model with presets that fit this machine.")
    p.add_argument("algo", nargs="?", type=str.lower, help=f"algorithm: {', '.join(ALGOS)} (taken from --config if omitted)")
    p.add_argument("--env", help=f"Gymnasium id, 'package.module:EnvClass' or 'module:factory' (default {DEFAULT_ENV})")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N or mps")
    p.add_argument("--timesteps", type=positive_int, help="training length (default: the preset's n_timesteps)")
    p.add_argument("--n-envs", type=positive_int, help="number of parallel envs (default: the preset's)")
    p.add_argument("--vec-env", choices=VEC_ENV_KINDS, default=None, help="auto (default), dummy or subproc")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: none)")
    p.add_argument("--preset", metavar="FILE", help="a preset YAML file to use instead of the bundled one")
    p.add_argument("--profile", default="auto", help="preset profile: auto (cpu or gpu by device), cpu, gpu or large")
    p.add_argument(
        "--per",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prioritized replay on/off for dqn and qrdqn (default: the preset's)",
    )
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], help="override a preset key (repeatable)")
    p.add_argument("--config", metavar="CONFIG", help="repeat a run: its run_dir/config.yaml (or the run dir)")
    p.add_argument("--run-dir", help="where to write the run (default: runs/ALGO-ENV-TIMESTAMP); must not exist")
    p.add_argument("--eval-freq", type=positive_int, help="evaluate every N timesteps (default: a tenth of the run)")
    p.add_argument("--eval-episodes", type=positive_int, default=10, help="episodes per evaluation (default 10)")
    p.add_argument("--checkpoint-freq", type=positive_int, help="checkpoint every N timesteps (default: a fifth of the run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plan", action="store_true", help="print the plan and exit without training")
    p.add_argument("--version", action="version", version=f"sb3_gpu {__version__}")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Turn parsed arguments (and a --config file) into a Plan; the CLI's only decision logic is which wins."""
    # --per first, so that --set per.alpha=... refines it rather than being replaced by it.
    overrides: dict[str, Any] = {} if args.per is None else {"per": args.per}
    overrides.update(parse_override(item) for item in args.set)
    config = load_config(args.config) if args.config else None
    if config is not None and args.preset:
        raise ConfigError("--config and --preset both give hyperparameters; use one (add --set to change a value)")
    if config is not None and args.algo and args.algo != config.algo:
        raise ConfigError(f"algorithm {args.algo!r} differs from the config's {config.algo!r}; leave it out to replay")
    algo = args.algo or (config.algo if config else None)
    if algo is None:
        raise ConfigError(f"give an algorithm ({', '.join(ALGOS)}) or --config RUN_DIR/config.yaml")
    return make_plan(
        algo,
        args.env or (config.env if config else DEFAULT_ENV),
        args.device or (config.device if config else "auto"),
        n_envs=args.n_envs,
        n_timesteps=args.timesteps,
        vec_env=args.vec_env or (config.vec_env if config else "auto"),
        seed=args.seed if args.seed is not None else (config.seed if config else None),
        preset=args.preset,
        profile=args.profile,
        overrides=overrides,
        override_source="--set",
        config=config,
    )


def new_run_dir(requested: str | None, plan: Plan) -> Path:
    """Create the run dir; an existing one is never reused, so no run overwrites another."""
    if requested is not None:
        path = Path(requested)
        if path.exists():
            raise ConfigError(f"run dir {path} already exists; choose a new --run-dir (runs are never overwritten)")
        path.mkdir(parents=True)
        return path
    env = re.sub(r"[^A-Za-z0-9_.-]+", "_", plan.env.name)
    base = Path("runs") / f"{plan.algo}-{env}-{datetime.now():%Y%m%d-%H%M%S}"
    for i in range(1, 1000):
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"could not find a free run dir name beside {base}")  # pragma: no cover


def train(plan: Plan, run_dir: Path, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Train per the plan into ``run_dir``; return the summary (also written as summary.json)."""
    preset = plan.preset
    total = preset.n_timesteps
    write_yaml(run_dir / "config.yaml", plan.to_config())
    env = build_env(plan, monitor_dir=str(run_dir / "monitor"))
    eval_env = build_env(plan, evaluation=True)
    model = build_model(plan, env, tensorboard_log=str(run_dir / "tb"))

    eval_freq = args.eval_freq or max(total // 10, 1)
    checkpoint_freq = args.checkpoint_freq or max(total // 5, 1)
    callbacks: list[BaseCallback] = [
        EvalCallback(
            eval_env,
            n_eval_episodes=args.eval_episodes,
            eval_freq=max(eval_freq // preset.n_envs, 1),
            best_model_save_path=str(run_dir),
            log_path=str(run_dir / "eval"),
            callback_on_new_best=SaveVecNormalizeCallback(run_dir / "best_vecnormalize.pkl") if preset.normalize else None,
            verbose=0,
        ),
        CheckpointCallback(
            max(checkpoint_freq // preset.n_envs, 1), str(run_dir / "checkpoints"), name_prefix="model", save_vecnormalize=True
        ),
    ]
    if not args.no_progress:
        callbacks.append(ProgressCallback(total, console=console))

    start = time.perf_counter()
    interrupted = False
    try:
        model.learn(total, callback=callbacks, tb_log_name="run")
    except KeyboardInterrupt:
        interrupted = True
    wall = time.perf_counter() - start

    model_path = save_model(model, run_dir / "model.zip")
    vec_normalize = model.get_vec_normalize_env()
    if vec_normalize is not None:
        vec_normalize.save(str(run_dir / "vecnormalize.pkl"))
    summary: dict[str, Any] = {
        "algo": plan.algo,
        "env": plan.env.name,
        "device": plan.device.device,
        "vec_env": type(env.unwrapped).__name__,
        "timesteps": int(model.num_timesteps),
        "wall_time_s": round(wall, 2),
        "steps_per_s": round(model.num_timesteps / wall, 1) if wall > 0 else None,
        "interrupted": interrupted,
        "model": str(model_path),
    }
    if not interrupted:
        sync_envs_normalization(env, eval_env)
        mean, std = evaluate(model, eval_env, args.eval_episodes)
        summary.update(final_eval_mean=mean, final_eval_std=std, eval_episodes=args.eval_episodes)
        best = callbacks[0]
        assert isinstance(best, EvalCallback)
        summary["best_eval_mean"] = float(best.best_mean_reward) if best.best_mean_reward > -float("inf") else None
    if (run_dir / "best_model.zip").exists():
        summary["best_model"] = str(run_dir / "best_model.zip")
    write_json(run_dir / "summary.json", summary)
    env.close()
    eval_env.close()
    return summary


def summary_table(summary: dict[str, Any], run_dir: Path) -> Table:
    table = Table(title="sb3_gpu summary", title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("timesteps", f"{summary['timesteps']:,}"),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("steps/s", f"{summary['steps_per_s']:,.0f}" if summary.get("steps_per_s") else "-"),
    ]
    if "final_eval_mean" in summary:
        rows.append(
            (
                "final eval",
                f"{summary['final_eval_mean']:.2f} +/- {summary['final_eval_std']:.2f} "
                f"({summary['eval_episodes']} episodes, deterministic)",
            )
        )
    if summary.get("best_eval_mean") is not None:
        rows.append(("best eval", f"{summary['best_eval_mean']:.2f}"))
    rows += [("run dir", str(run_dir)), ("model", summary["model"])]
    if "best_model" in summary:
        rows.append(("best model", summary["best_model"]))
    rows.append(("replay", f"python -m sb3_gpu.train --config {run_dir / 'config.yaml'}"))
    for row in rows:
        table.add_row(*row)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        plan = plan_from_args(args)
        console.print(plan_table(plan))
        if args.plan:
            return 0
        run_dir = new_run_dir(args.run_dir, plan)
    except ConfigError as e:
        print_error(str(e))
        return 2
    summary = train(plan, run_dir, args, console)
    console.print(summary_table(summary, run_dir))
    if summary["interrupted"]:
        print_error(f"interrupted at {summary['timesteps']:,} timesteps; model saved to {summary['model']}")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
