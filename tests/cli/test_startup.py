"""The CLIs start light: --help loads no torch, SB3, gymnasium, optuna or matplotlib, and a Ctrl-C while those load
is one line and exit 130."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from sb3_gpu import bench, evaluate, plot, train, tune
from sb3_gpu.common.checks import ALGO_NAMES

HEAVY = ("torch", "stable_baselines3", "sb3_contrib", "gymnasium", "optuna", "matplotlib", "numpy", "rich")
CLIS = ("train", "evaluate", "tune", "bench", "plot")


def test_help_of_every_cli_loads_no_heavy_module():
    script = f"""
import contextlib, io, json, sys
heavy = {HEAVY!r}
loaded = {{}}
for name in {CLIS!r}:
    module = __import__("sb3_gpu." + name, fromlist=["main"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        module.main(["--help"])
    loaded[name] = [m for m in heavy if m in sys.modules]
print(json.dumps(loaded))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == {name: [] for name in CLIS}


class _InterruptedImport(types.ModuleType):
    """A module whose names cannot be read: as if Ctrl-C arrived while it was being imported."""

    def __getattr__(self, name: str):
        raise KeyboardInterrupt


@pytest.mark.parametrize(
    "main, argv, module, message",
    [
        (train.main, ["ppo", "--plan"], "sb3_gpu.runs.training", "interrupted before training began; nothing was saved"),
        (evaluate.main, ["some_run"], "sb3_gpu.runs.evaluation", "interrupted; nothing was evaluated"),
        (tune.main, ["ppo"], "sb3_gpu.tuning.storage", "interrupted before any trial began"),
        (bench.main, ["telemetry"], "sb3_gpu.benches.telemetry", "interrupted; no results were written"),
        (plot.main, ["some_run"], "sb3_gpu.runs.curves", "interrupted; no plot was written"),
    ],
)
def test_ctrl_c_while_modules_load_is_one_line_and_exit_130(main, argv, module, message, monkeypatch, call_main):
    monkeypatch.setitem(sys.modules, module, _InterruptedImport(module))
    result = call_main(main, *argv)
    assert (result.returncode, result.stderr) == (130, f"error: {message}\n")


def test_the_names_the_parsers_offer_are_the_ones_the_package_knows():
    from sb3_gpu.config.schema import ALGOS

    assert tuple(ALGOS) == ALGO_NAMES
