"""``python -m sb3_gpu.evaluate RUN_DIR_or_MODEL --episodes N [--video]``: mean and std of the return, and a video."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

from sb3_gpu.common.cli import (
    Parser,
    Terminated,
    interrupted,
    name_arg,
    positive_int,
    print_error,
    seed_int,
    sigterm_as_interrupt,
)
from sb3_gpu.common.errors import ConfigError, ResultsNotWritten


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m sb3_gpu.evaluate", description="Evaluate a trained model.")
    p.add_argument("target", help="a run dir (its best model, else its final model) or a model .zip inside a run dir")
    p.add_argument("--episodes", type=positive_int, default=10, help="episodes to run (default 10)")
    p.add_argument("--stochastic", action="store_true", help="sample actions, not the most likely one (not for td3)")
    p.add_argument(
        "--model",
        type=name_arg,
        choices=("best", "final"),
        help="for a run dir: which model (default: the best, else the final one)",
    )
    p.add_argument("--device", default="cpu", help="device to run the policy on (default cpu)")
    p.add_argument(
        "--env",
        help="the env to evaluate on (default: the run's own); give the run's 'package.module:EnvClass' again to "
        "confirm that its module may be imported",
    )
    p.add_argument("--seed", type=seed_int, default=None, help="seed of the evaluation env")
    p.add_argument(
        "--video",
        action="store_true",
        help="also record an mp4 of the model's first episode (at most 2,000 frames) into the run dir's videos/",
    )
    p.add_argument(
        "--video-length", type=positive_int, metavar="N", help="record N frames instead, across episodes (implies --video)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():  # stops at once, as Ctrl-C does
            return _evaluate(args)
    except Terminated:
        print_error("stopped by SIGTERM; nothing was evaluated")
        return 143
    except KeyboardInterrupt:
        print_error("interrupted; nothing was evaluated")
        return interrupted()


def _evaluate(args: argparse.Namespace) -> int:
    try:
        from sb3_gpu.runs.evaluation import evaluate_run  # torch and SB3: here, so that --help needs neither

        result = evaluate_run(
            args.target,
            args.episodes,
            deterministic=not args.stochastic,
            which=args.model or "auto",
            device=args.device,
            seed=args.seed,
            video=args.video or args.video_length is not None,
            video_length=args.video_length or 0,
            env=args.env,
        )
    except ConfigError as e:
        # evaluate_run's arguments, as this CLI spells them
        message = re.sub(r"which='(\w+)'", r"--model \1", str(e)).replace("with deterministic=True", "without --stochastic")
        print_error(message)
        return 2
    except ResultsNotWritten as e:  # the video, on a full disk, say: any earlier one is kept
        print_error(str(e))
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        mode = "deterministic" if result["deterministic"] else "stochastic"
        mean, std, episodes = result["mean"], result["std"], result["episodes"]
        plural = "s" if episodes != 1 else ""
        print(f"{result['model']}: return {mean:.2f} +/- {std:.2f} over {episodes} episode{plural} ({mode})")
        if "video" in result:
            video = result["video"]
            print(f"video: {video['path']} ({video['frames']:,} frames at {video['fps']} fps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
