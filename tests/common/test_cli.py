"""The commands the CLIs print are runnable as printed: bare names where the shell finds this environment's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sb3_gpu.common.cli import command


def test_a_command_is_its_bare_name_where_the_shell_finds_this_environments_and_its_path_elsewhere(monkeypatch, tmp_path):
    bin_dir = Path(sys.executable).parent
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin")
    assert command() == "python" or Path(sys.executable).name != "python"
    if (bin_dir / "tensorboard").exists():
        assert command("tensorboard") == "tensorboard"
    # A virtual environment that is not active: the shell would find another python, or none.
    monkeypatch.setenv("PATH", str(tmp_path))
    assert command() == sys.executable and command("tensorboard") == str(bin_dir / "tensorboard")
