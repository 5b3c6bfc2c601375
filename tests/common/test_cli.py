"""The commands the CLIs print are runnable as printed: bare names where the shell finds this environment's; and the
exit status a CLI returns after a Ctrl-C is the one the process ends with."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sb3_gpu.common.cli import command


def test_a_command_is_its_bare_name_only_where_the_shell_finds_this_environments_own(monkeypatch, tmp_path):
    bin_dir = Path(sys.executable).parent
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin")
    if Path(sys.executable).name == "python":
        assert command() == "python"
    if (bin_dir / "tensorboard").exists():
        assert command("tensorboard") == "tensorboard"
    # A virtual environment that is not active: the shell finds another python first, here one that is a link to
    # the very interpreter a venv's python links to. Running it would miss the venv's packages.
    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setenv("PATH", str(other))
    assert command() == sys.executable and command("tensorboard") == str(bin_dir / "tensorboard")


def test_a_script_missing_beside_the_interpreter_runs_as_its_module(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert command("no_such_script") == f"{sys.executable} -m no_such_script.main"


# sympy's import runs source with exec; a Ctrl-C landing there once made `tune` end by SIGINT (-2), not with 130.
_CAUGHT = """
import sys
from sb3_gpu.common.cli import interrupted
try:
    exec("raise KeyboardInterrupt")
except KeyboardInterrupt:
    code = {}
sys.exit(code)
"""


def test_a_caught_ctrl_c_inside_exec_ends_with_the_status_main_returned(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{tmp_path}"}

    def status(code: str) -> int:  # run with -m, as the CLIs are
        (tmp_path / "stop_demo.py").write_text(_CAUGHT.format(code))
        return subprocess.run([sys.executable, "-m", "stop_demo"], env=env, cwd=tmp_path).returncode

    if sys.version_info[:2] == (3, 11):  # CPython's quirk, which interrupted() undoes (seen on 3.11)
        assert status("130") == -2
    assert status("interrupted()") == 130
    assert status("interrupted(143)") == 143


@pytest.mark.parametrize(
    "module, args, option",
    [
        ("train", ["ppo", "--env", "", "--plan"], "--env"),
        ("train", ["ppo", "--device", "", "--plan"], "--device"),
        ("train", ["--config", "", "--plan"], "--config"),
        ("tune", ["ppo", "--storage", ""], "--storage"),
        ("plot", ["run", "-o", ""], "-o/--out"),
        ("bench", ["step", "--cases", ""], "--cases"),
        ("evaluate", [""], "target"),
    ],
)
def test_an_empty_value_is_refused_not_read_as_not_given(module, args, option, call_main):
    main = importlib.import_module(f"sb3_gpu.{module}").main
    out = call_main(main, *args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"error: argument {option}: expected a value, got an empty string" in out.stderr


@pytest.mark.parametrize(
    "module, args, dest, value",
    [
        ("train", ["ppo", "--amp", "BF16"], "amp", "bf16"),
        ("train", ["ppo", "--vec-env", " Dummy"], "vec_env", "dummy"),
        ("train", ["ppo", "--compile", "Reduce-Overhead"], "compile", "reduce-overhead"),
        ("train", ["ppo", "--profile", "CPU"], "profile", "cpu"),
        ("tune", ["ppo", "--sampler", "Random", "--pruner", "HALVING"], "pruner", "halving"),
        ("tune", ["ppo", "--vec-env", "SubProc"], "vec_env", "subproc"),
        ("bench", ["solve", "--per", "On", "OFF"], "per", ["on", "off"]),
        ("bench", ["telemetry", "--callback", "Guard"], "callback", "guard"),
        ("evaluate", ["run", "--model", "Final"], "model", "final"),
    ],
)
def test_a_named_choice_is_read_in_any_case_as_algorithm_names_are(module, args, dest, value):
    parsed = importlib.import_module(f"sb3_gpu.{module}").build_parser().parse_args(args)
    assert getattr(parsed, dest) == value


def test_a_named_choice_outside_the_list_is_still_refused_with_the_list(call_main):
    from sb3_gpu.train import main

    out = call_main(main, "ppo", "--amp", "FP8", "--plan")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    # Python 3.12.8 and 3.13.1 list the choices without quotes.
    assert "argument --amp: invalid choice: 'fp8' (choose from " in out.stderr and "bf16" in out.stderr


def test_a_program_run_prints_warnings_as_one_line_each_and_a_call_from_python_leaves_them_alone(capsys, monkeypatch):
    import warnings

    from sb3_gpu.common.cli import Parser

    with warnings.catch_warnings():
        before = warnings.showwarning
        Parser(prog="x").parse_args([])  # main(argv) called from Python: its caller's warnings stay as they were
        assert warnings.showwarning is before
        monkeypatch.setattr(sys, "argv", ["x"])
        Parser(prog="x").parse_args()  # the program's own command line
        warnings.simplefilter("always")
        warnings.warn("batch_size 512 is more than one rollout", UserWarning, stacklevel=1)
    assert capsys.readouterr().err == "warning: batch_size 512 is more than one rollout\n"


def test_a_library_warning_is_printed_as_one_plain_line(monkeypatch):
    import io
    import warnings

    from sb3_gpu.common.cli import plain_warnings

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # put back after the test
    plain_warnings()
    out = io.StringIO()
    warnings.showwarning("\x1b[33mWARN: The environment CartPole-v0 is out of date.\x1b[0m", UserWarning, "x.py", 1, out)
    assert out.getvalue() == "warning: The environment CartPole-v0 is out of date.\n"


class _Held:
    pass


def test_a_stop_raised_inside_a_finalizer_is_raised_again_where_the_main_thread_runs_on(monkeypatch):
    # A signal handler's KeyboardInterrupt that lands in a weakref callback (the garbage collector runs them anywhere)
    # was only printed as "Exception ignored in ...", and the process ran on: a bench worker stopped by SIGTERM
    # printed a traceback, and a command's SIGTERM before training was lost.
    import weakref

    from sb3_gpu.common.cli import stops_not_swallowed

    def stopped(_):
        raise KeyboardInterrupt  # as Ctrl-C's handler raises it, wherever the main thread is

    with stops_not_swallowed(), pytest.raises(KeyboardInterrupt):
        held = _Held()
        ref = weakref.ref(held, stopped)
        del held  # the callback runs here, and its exception cannot leave it
        time.sleep(30)  # the main thread runs on: the stop ends this at once (30 s is a guard, not a limit)
    assert ref() is None
    # Any other exception in a finalizer goes to the hook there was.
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with stops_not_swallowed():
        held = _Held()
        ref = weakref.ref(held, lambda _: 1 / 0)
        del held
    assert len(seen) == 1 and isinstance(seen[0].exc_value, ZeroDivisionError) and sys.unraisablehook == seen.append


def test_a_printed_path_that_starts_with_a_dash_is_not_read_as_a_flag():
    from pathlib import Path

    from sb3_gpu.common.cli import shell_line
    from sb3_gpu.runs.rundir import RunDir

    line = shell_line("-m", "sb3_gpu.evaluate", RunDir(Path("-dash")), "--video")
    assert line.endswith(" -m sb3_gpu.evaluate ./-dash --video"), line  # words the program gives stay as they are
    assert shell_line("--resume", Path("-a b/-c")).endswith(" --resume './-a b/-c'")
    assert shell_line("--resume", Path("/abs/-c")).endswith(" --resume /abs/-c")


def test_a_command_writes_what_its_output_cannot_encode_as_escapes_not_a_traceback():
    import os
    import subprocess
    import sys

    # A finished run printed its summary (the run dir's name) and failed there, under an ASCII locale.
    code = "from sb3_gpu.evaluate import build_parser\nbuild_parser().parse_args()\nprint('r\\u00fc1')"
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = subprocess.run(
        [sys.executable, "-c", code, "runs/x"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout == "r\\xfc1\n", done.stderr


@pytest.mark.parametrize("columns, width", [(None, 160), ("0", 160), ("abc", 160), ("5", 160), ("100", 100), ("300", 300)])
def test_a_log_file_gets_160_columns_unless_columns_gives_a_real_width(monkeypatch, columns, width):
    from sb3_gpu.common.cli import console

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)  # fish exports 0; rich took it as a width of 0 and printed nothing
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert console().width == width


def test_force_color_in_a_log_file_is_no_person_watching(monkeypatch, tmp_path):
    import io

    from rich.console import Console

    from sb3_gpu.common.cli import watched

    monkeypatch.setenv("FORCE_COLOR", "1")
    with open(tmp_path / "log", "w") as log:
        forced = Console(file=log)
        assert forced.is_terminal and not watched(forced)  # no live bar's redraws in the log
    assert not watched(Console(file=io.StringIO()))


@pytest.mark.parametrize(
    ("argv0", "given", "prog"),
    [
        ("/venv/bin/sb3-gpu-train", "python -m sb3_gpu.train", "sb3-gpu-train"),
        ("C:/venv/Scripts/sb3-gpu-evaluate.exe", "python -m sb3_gpu.evaluate", "sb3-gpu-evaluate"),
        ("/repo/sb3_gpu/train.py", "python -m sb3_gpu.train", "python -m sb3_gpu.train"),  # python -m
        ("/venv/bin/sb3-gpu-evaluate", "python -m sb3_gpu.train", "python -m sb3_gpu.train"),  # another's parser
        ("", "python -m sb3_gpu.train", "python -m sb3_gpu.train"),  # an embedded interpreter
    ],
)
def test_a_console_script_names_itself_in_its_usage(monkeypatch, argv0, given, prog):
    from sb3_gpu.common.cli import Parser

    monkeypatch.setattr(sys, "argv", [argv0])
    assert Parser(prog=given).prog == prog
