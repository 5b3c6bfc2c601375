"""``python -m sb3_gpu.plot RUN_DIR [RUN_DIR ...]``: learning curves and throughput of one or several runs."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from sb3_gpu.common.cli import Parser, interrupted, print_error
from sb3_gpu.common.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m sb3_gpu.plot", description="Plot the learning curves of one or several runs.")
    parser.add_argument("run_dirs", nargs="+", help="run dirs written by sb3_gpu.train")
    parser.add_argument("-o", "--out", help="the PNG to write (default: RUN_DIR/curves.png for one run, curves.png)")
    args = parser.parse_args(argv)
    same = [run for run, n in Counter(Path(run).resolve() for run in args.run_dirs).items() if n > 1]
    if same:  # two curves of one run: a slip, most likely for another run's name
        parser.error(f"{same[0]} is given twice; each run once")
    try:
        from sb3_gpu.runs.curves import load_curves, plot_runs  # matplotlib and SB3: here, so that --help needs neither
        from sb3_gpu.runs.rundir import RunDir

        default = RunDir(args.run_dirs[0]).curves if len(args.run_dirs) == 1 else Path("curves.png")
        out = default if args.out is None else Path(args.out)
        with warnings.catch_warnings(record=True) as caught:  # the filters as they were: Python's defaults, say
            path = plot_runs(args.run_dirs, out)
            empty = [run_dir for run_dir in args.run_dirs if not len(load_curves(run_dir)["returns"])]
        for message in dict.fromkeys(str(w.message) for w in caught):
            print(f"warning: {message}", file=sys.stderr)
        for run_dir in empty:
            print(f"note: {run_dir} has no finished episode yet; its curves are empty")
    except ConfigError as e:
        print_error(str(e))
        return 2
    except KeyboardInterrupt:
        print_error("interrupted; no plot was written")
        return interrupted()
    except OSError as e:  # a full disk, say, while the PNG was written (atomically: no half file is left)
        print_error(f"cannot write {e.filename or 'the plot'}: {e.strerror or e}")
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
