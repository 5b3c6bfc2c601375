"""The commands the CLIs print are runnable as printed: bare names where the shell finds this environment's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
