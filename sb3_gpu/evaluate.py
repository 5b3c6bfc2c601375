"""``python -m sb3_gpu.evaluate RUN_DIR_or_MODEL --episodes N``: mean and std of the return."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu._cli import Parser, positive_int, print_error, seed_int
from sb3_gpu.errors import ConfigError
from sb3_gpu.plan import Plan, build_env, load_config, make_plan
from sb3_gpu.run import evaluate


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m sb3_gpu.evaluate", description="Evaluate a trained model.")
    p.add_argument("target", help="a run dir (its best model, else its final model) or a model .zip inside a run dir")
    p.add_argument("--episodes", type=positive_int, default=10, help="episodes to run (default 10)")
    p.add_argument("--stochastic", action="store_true", help="sample actions instead of taking the most likely one")
    p.add_argument("--model", choices=("best", "final"), default="best", help="for a run dir: which model (default best)")
    p.add_argument("--device", default="cpu", help="device to run the policy on (default cpu)")
    p.add_argument("--seed", type=seed_int, default=None, help="seed of the evaluation env")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _find_model(target: Path, which: str) -> tuple[Path, Path]:
    """Return (model zip, run dir) for a run dir or a zip somewhere inside one."""
    if target.is_dir():
        names = ["best_model.zip", "model.zip"] if which == "best" else ["model.zip"]
        for name in names:
            if (target / name).is_file():
                return target / name, target
        raise ConfigError(f"{target} holds no {' or '.join(names)}; is it a run dir written by sb3_gpu.train?")
    if not target.is_file():
        raise ConfigError(f"no such run dir or model file: {target}")
    for parent in target.resolve().parents:
        if (parent / "config.yaml").is_file():
            return target, parent
    raise ConfigError(f"{target}: no config.yaml beside it or above it, so its algorithm and env are unknown")


def _stats_for(model_path: Path, run_dir: Path) -> Path | None:
    """The VecNormalize statistics saved with this model, if the run normalised."""
    candidates = [run_dir / "best_vecnormalize.pkl"] if model_path.name == "best_model.zip" else []
    if model_path.parent.name == "checkpoints":
        steps = model_path.stem.removeprefix("model_")
        candidates.append(model_path.with_name(f"model_vecnormalize_{steps}.pkl"))
    candidates.append(run_dir / "vecnormalize.pkl")
    return next((c for c in candidates if c.is_file()), None)


def evaluate_run(
    target: str | Path,
    episodes: int = 10,
    *,
    deterministic: bool = True,
    which: str = "best",
    device: str = "cpu",
    seed: int | None = None,
) -> dict[str, Any]:
    """Load a model from a run and return ``{"mean", "std", "episodes", "model"}``."""
    if which not in ("best", "final"):
        raise ConfigError(f"which must be 'best' or 'final', got {which!r}")
    model_path, run_dir = _find_model(Path(target), which)
    config = load_config(run_dir)
    plan: Plan = make_plan(config.algo, config.env, device, vec_env="dummy", seed=seed, config=config)
    env = build_env(plan, evaluation=True)
    if isinstance(env, VecNormalize):
        stats = _stats_for(model_path, run_dir)
        if stats is None:
            raise ConfigError(f"{run_dir} normalised its observations but holds no vecnormalize.pkl for {model_path.name}")
        env = VecNormalize.load(str(stats), env.venv)
        env.training, env.norm_reward = False, False
    try:
        model = plan.preset.model_class.load(str(model_path), device=plan.device.device)
    except Exception as e:  # a truncated or foreign zip fails in many ways inside SB3
        raise ConfigError(
            f"{model_path} is not a loadable {plan.preset.model_class.__name__} model ({type(e).__name__}: {e})"
        ) from None
    mean, std = evaluate(model, env, episodes, deterministic)
    env.close()
    return {
        "mean": mean,
        "std": std,
        "episodes": episodes,
        "deterministic": deterministic,
        "model": str(model_path),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = evaluate_run(
            args.target, args.episodes, deterministic=not args.stochastic, which=args.model, device=args.device, seed=args.seed
        )
    except ConfigError as e:
        print_error(str(e))
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        mode = "deterministic" if result["deterministic"] else "stochastic"
        mean, std, episodes = result["mean"], result["std"], result["episodes"]
        print(f"{result['model']}: return {mean:.2f} +/- {std:.2f} over {episodes} episodes ({mode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
