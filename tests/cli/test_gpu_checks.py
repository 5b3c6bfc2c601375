"""tools/gpu_checks.sh, the one pass over the GPU figures: what it names still exists, and it refuses what it cannot run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch as th

from sb3_gpu.benches.step import parse_case, plan_case

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_checks.sh"


def _run(*groups: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *groups], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_an_unknown_group_is_refused_before_anything_runs(tmp_path):
    result = _run("bench", "benhc", out=tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip() == "gpu_checks.sh: unknown group 'benhc' (groups: bench, tests, heads)"
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(th.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_cuda_device_it_says_so_in_one_line(tmp_path):
    result = _run("heads", out=tmp_path / "out")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"gpu_checks.sh: torch {th.__version__} sees no CUDA device here; these checks need one"
    ]
    assert not list((tmp_path / "out").glob("*.log"))  # no step started


def test_the_test_files_and_bench_cases_it_names_exist():
    words = [w for w in shlex.split(SCRIPT.read_text(), comments=True) if w.strip()]  # a line's closing backslash: "\n"
    test_files = [w for w in words if w.startswith("tests/")]
    assert len(test_files) == 2 and all((ROOT / f).is_file() for f in test_files), test_files
    for f in test_files:  # each has cases that its selection (-m "" -k cuda) collects
        collected = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider", "-k", "cuda", f],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert re.search(r"^([1-9]\d*/)?\d+ tests? collected", collected, re.M), collected[-500:]
        assert not re.search(r"^(0/\d+|0) tests? collected|no tests ran", collected, re.M), collected[-500:]
    i = words.index("--cases")  # the heads group's
    named = []
    for w in words[i + 1 :]:
        if w.startswith("--"):
            break
        named.append(w)
    assert len(named) == 5
    for case in named:
        parse_case(case)
        plan_case(case, "cpu", variant="compiled")  # the env and profile suit the algorithm


def test_a_case_names_its_algorithm_in_any_case_and_an_unknown_one_is_named():
    assert parse_case("DQN+PER:ALE/Pong-v5:large") == ("dqn+per", "ALE/Pong-v5", "large")
    assert parse_case("Sac:Pendulum-v1") == ("sac", "Pendulum-v1", "auto")
    with pytest.raises(ValueError, match=r"'qr-dqn:CartPole-v1': unknown algorithm 'qr-dqn'; did you mean 'qrdqn'"):
        parse_case("qr-dqn:CartPole-v1")
    with pytest.raises(ValueError, match="'a2c' is not one of them"):
        parse_case("a2c:CartPole-v1")


def _commands(module: str) -> list[list[str]]:
    """The script's command lines that run ``python -m module``, continuation lines joined: the arguments after it."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if f"-m {module} " in line and not line.lstrip().startswith("#")]
    return [shlex.split(line)[shlex.split(line).index(module) + 1 :] for line in lines]


def test_every_bench_command_it_runs_parses_with_the_current_flags(tmp_path):
    # A flag renamed under the script would cost a lent GPU's scarce minutes before anything is measured.
    from sb3_gpu.bench import build_parser

    commands = _commands("sb3_gpu.bench")
    assert len(commands) == 3
    for args in commands:
        build_parser().parse_args([a.replace("$OUT", str(tmp_path)) for a in args])


def test_a_step_that_fails_or_runs_out_of_time_makes_the_script_exit_1(tmp_path):
    fake = tmp_path / "python"  # passes the CUDA check (its script on stdin), then fails as the step's command
    fake.write_text('#!/bin/sh\n[ "$1" = "-" ] && { cat >/dev/null; echo "2.13 Fake GPU"; exit 0; }\nexit 3\n')
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PYTHON": str(fake)}
    result = subprocess.run(["bash", str(SCRIPT), "heads"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "bench-heads: exit 3 after" in result.stdout, result.stdout + result.stderr


def test_each_group_fits_a_ten_minute_call_with_its_kill_grace_and_start_up():
    text = SCRIPT.read_text()
    grace = int(re.search(r"timeout -s INT -k (\d+)", text).group(1))
    groups = re.findall(r"^    (bench|tests|heads)\)\n(.*?)^        ;;", text, re.M | re.S)
    assert [g for g, _ in groups] == ["bench", "tests", "heads"]
    for group, body in groups:
        limits = [int(s) for s in re.findall(r"^\s*step [\w-]+ (\d+) ", body, re.M)]
        assert limits, group
        # 30 s left for the interpreter's start and the device check, the kill grace of each step on top of its limit
        assert sum(limits) + grace * len(limits) + 30 <= 600, (group, limits)
