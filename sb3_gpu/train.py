"""``python -m sb3_gpu.train ALGO --env ID --device auto``: plan, print the plan, train, save, summarise."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sb3_gpu import __version__
from sb3_gpu._cli import Parser, positive_int, print_error, seed_int
from sb3_gpu.amp import AMP_MODES
from sb3_gpu.envs import VEC_ENV_KINDS
from sb3_gpu.errors import ConfigError
from sb3_gpu.plan import Plan, load_config, make_plan, plan_table
from sb3_gpu.presets import ALGOS, parse_override
from sb3_gpu.run import new_run_dir, train_run
from sb3_gpu.speed import COMPILE_MODES

DEFAULT_ENV = "CartPole-v1"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m sb3_gpu.train", description="Train an SB3 model with presets that fit this machine.")
    p.add_argument("algo", nargs="?", type=str.lower, help=f"algorithm: {', '.join(ALGOS)} (taken from --config if omitted)")
    p.add_argument("--env", help=f"Gymnasium id, 'package.module:EnvClass' or 'module:factory' (default {DEFAULT_ENV})")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N or mps")
    p.add_argument("--timesteps", type=positive_int, help="training length (default: the preset's n_timesteps)")
    p.add_argument("--n-envs", type=positive_int, help="number of parallel envs (default: the preset's)")
    p.add_argument(
        "--vec-env", choices=VEC_ENV_KINDS, default=None, help="auto (default), dummy, subproc (SB3's), batched or envpool"
    )
    p.add_argument("--seed", type=seed_int, default=None, help="random seed (default: none)")
    p.add_argument("--preset", metavar="FILE", help="a preset YAML file to use instead of the bundled one")
    p.add_argument("--profile", default="auto", help="preset profile: auto (cpu or gpu by device), cpu, gpu or large")
    p.add_argument(
        "--per",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prioritized replay on/off for dqn and qrdqn (default: the preset's)",
    )
    p.add_argument("--amp", choices=AMP_MODES, help="mixed precision: auto (the plan says why), off, bf16, fp16 (CUDA)")
    p.add_argument("--compile", choices=COMPILE_MODES, help="torch.compile the policy: false (default) or a mode")
    p.add_argument("--threads", type=_threads, help="torch CPU threads: auto (default; chosen by policy size) or N")
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


def _threads(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Turn parsed arguments (and a --config file) into a Plan; the CLI's only decision logic is which wins."""
    # --per first, so that --set per.alpha=... refines it rather than being replaced by it.
    overrides: dict[str, Any] = {} if args.per is None else {"per": args.per}
    overrides.update({k: v for k in ("amp", "compile", "threads") if (v := getattr(args, k)) is not None})
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
    tp = summary.get("throughput") or {}
    if "env_steps_per_s" in tp:
        rows.append(("last 30 s", f"{tp['env_steps_per_s']:,.0f} env steps/s, {tp['episodes_per_s']:.1f} episodes/s"))
    if "share_env" in tp:
        split = ", ".join(f"{name} {tp['share_' + name]:.0%}" for name in ("env", "policy", "train", "eval"))
        rows.append(("time split", split))
    rows += [("run dir", str(run_dir)), ("model", summary["model"])]
    if "best_model" in summary:
        rows.append(("best model", summary["best_model"]))
    if summary.get("curves"):
        rows.append(("curves", summary["curves"]))
    rows.append(("replay", f"python -m sb3_gpu.train --config {run_dir / 'config.yaml'}"))
    rows.append(("dashboard", f"tensorboard --logdir {run_dir / 'tb'}  (Custom Scalars tab)"))
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
    try:
        summary = train_run(
            plan,
            run_dir,
            eval_freq=args.eval_freq,
            eval_episodes=args.eval_episodes,
            checkpoint_freq=args.checkpoint_freq,
            progress=not args.no_progress,
            console=console,
        )
    except ConfigError as e:
        # Refused before training began: nothing in the new run dir is worth keeping, and keeping it would
        # make the same --run-dir "already exist" on the next try.
        shutil.rmtree(run_dir, ignore_errors=True)
        print_error(str(e))
        return 2
    console.print(summary_table(summary, run_dir))
    if summary["interrupted"]:
        print_error(f"interrupted at {summary['timesteps']:,} timesteps; model saved to {summary['model']}")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
