"""What differs on Windows and macOS, run here as their twins: the imports and file flags Windows lacks, its lock, its
shell quoting and its renames refused while a file is open; and Apple's MPS, which has no float64."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import types

import pytest
import torch as th

from sb3_gpu.common import cli, io
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.devicelog import DeviceLog, _wide
from sb3_gpu.planning.plan import make_plan

# Windows has no fcntl, resource, O_NOFOLLOW or O_CLOEXEC; a stand-in msvcrt locks one byte per open file.
_WINDOWS_TWIN = textwrap.dedent(
    """
    import os, sys
    # The libraries' own Linux code needs these two: imported first, so that only sb3_gpu's imports meet their absence.
    import gymnasium, multiprocessing, psutil, stable_baselines3, subprocess, torch
    sys.modules["fcntl"] = None
    sys.modules["resource"] = None
    del os.O_NOFOLLOW, os.O_CLOEXEC
    from sb3_gpu import make_plan
    from sb3_gpu.common.errors import ConfigError
    from sb3_gpu.common.io import atomic_write_text
    from sb3_gpu.envs.choice import check_env_resources
    from sb3_gpu.runs.rundir import RunDir

    held = set()

    def locking(fd, mode, nbytes):
        key = os.fstat(fd).st_ino
        if key in held:
            raise PermissionError(13, "Permission denied")
        held.add(key)

    # Only now: the standard library takes an importable msvcrt for a sign that it runs on Windows.
    sys.modules["msvcrt"] = type(sys)("msvcrt")
    sys.modules["msvcrt"].locking, sys.modules["msvcrt"].LK_NBLCK = locking, 2

    plan = make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy", overrides={"probe": False})
    check_env_resources("batched", 64, monitor=True, cores=2)
    run = RunDir(sys.argv[1])
    atomic_write_text(run.path / "config.yaml", "algo: ppo\\n")
    with run.locked():
        try:
            with RunDir(sys.argv[1]).locked():
                print("locked twice")
        except ConfigError as e:
            print(e)
    print(plan.algo, (run.path / "config.yaml").read_text().strip())
    """
)


def test_the_package_plans_writes_and_locks_without_what_windows_lacks(tmp_path):
    done = subprocess.run([sys.executable, "-c", _WINDOWS_TWIN, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path} is in use by another sb3_gpu process (pid ")  # the twin's own msvcrt lock
    assert lines[-1] == "ppo algo: ppo"


def test_printed_commands_use_windows_quoting_there(monkeypatch):
    words = ["--resume", r"runs\ppo 1", "it's"]
    assert cli._quoted(words) == "--resume 'runs\\ppo 1' 'it'\"'\"'s'"
    monkeypatch.setattr(cli, "os", types.SimpleNamespace(name="nt"))
    assert cli._quoted(words) == '--resume "runs\\ppo 1" it\'s'
    assert cli._quoted(["runs\\a&b", "a(1)\\", "plain"]) == '"runs\\a&b" "a(1)\\\\" plain'  # cmd.exe's & and ( quoted


def test_a_rename_refused_while_the_file_is_open_is_tried_again_on_windows(monkeypatch):
    calls: list[tuple[str, str]] = []

    def refused_twice(src: str, dst: str) -> None:
        calls.append((src, dst))
        if len(calls) <= 2:
            raise PermissionError(13, "The process cannot access the file because it is being used by another process")

    monkeypatch.setattr(io, "os", types.SimpleNamespace(name="nt", replace=refused_twice))
    monkeypatch.setattr(io.time, "sleep", lambda s: None)
    io.replace("a.tmp", "a")
    assert calls == [("a.tmp", "a")] * 3
    calls.clear()
    monkeypatch.setattr(io, "os", types.SimpleNamespace(name="posix", replace=refused_twice))
    with pytest.raises(PermissionError):  # elsewhere a refusal is an error at once
        io.replace("a.tmp", "a")
    assert len(calls) == 1


def test_mps_is_given_no_float64(gpu_machine):
    assert _wide(th.device("mps")) == th.float32 and _wide(th.device("cpu")) == th.float64
    log = DeviceLog()
    log.mean("loss", th.tensor(2.0), counts=th.tensor(True))
    assert log.read() == {"loss": 2.0}
    mac = dataclasses.replace(gpu_machine, gpus=(), mps=True)
    overrides = {"probe": False, "device_buffers": True}
    with pytest.raises(ConfigError, match=r"device_buffers=true \(override\): Apple's MPS has no float64"):
        make_plan("dqn", "CartPole-v1", "mps", hardware=mac, overrides=overrides)
    plan = make_plan("dqn", "CartPole-v1", "mps", hardware=mac, overrides={"probe": False})
    assert plan.buffers == "host" and "MPS has no float64" in plan.buffers_reason


def test_a_mac_plan_feeds_its_gpu_with_few_threads_and_takes_no_envpool():
    from tests.conftest import machine

    mac = machine(mps=True, cores=8)
    plan = make_plan("sac", "Pendulum-v1", "auto", hardware=mac, overrides={"probe": False})
    assert plan.device.device == "mps" and plan.speed is not None
    assert plan.speed.threads == 4 and plan.speed.threads_reason.startswith("the GPU does the math")
    plan = make_plan("ppo", "LunarLander-v3", "auto", hardware=mac, n_envs=64, overrides={"probe": False})
    assert plan.vec_env != "envpool"  # EnvPool has no macOS build, whatever this machine has installed


@pytest.mark.heavy  # MuJoCo's envs
def test_a_mac_keeps_float64_observations_off_mps(tmp_path):
    # MuJoCo's observations are float64: SB3 makes tensors of them, and stores them, in that dtype; MPS has none.
    from tests.conftest import machine

    mac = machine(mps=True, cores=8)
    tiny = {"probe": False}
    plan = make_plan("sac", "HalfCheetah-v5", "auto", hardware=mac, overrides=tiny)
    assert plan.device.device == "cpu"
    assert plan.device.reason == "the observations are float64, which Apple's MPS cannot hold: the CPU"
    message = r"^device 'mps': Apple's MPS has no float64, and the observations are float64: use cpu or auto$"
    with pytest.raises(ConfigError, match=message):
        make_plan("td3", "Hopper-v5", "mps", hardware=mac, overrides=tiny)
    with pytest.raises(ConfigError, match=message):  # PPO too, where nothing scales them into float32
        make_plan("ppo", "Hopper-v5", "mps", hardware=mac, overrides=tiny)
    for algo in ("ppo", "sac"):  # VecNormalize hands over the observations it scales as float32, and SB3's host
        # replay buffers scale those they sample so
        assert make_plan(algo, "Hopper-v5", "mps", hardware=mac, overrides={**tiny, "normalize": True}).device.device == "mps"
    # The profile MPS resolves decides (the CPU profile scales them, the GPU one does not): refused.
    from sb3_gpu.common.io import write_yaml

    write_yaml(tmp_path / "p.yaml", {"Hopper-v5": {"cpu": {"normalize": True}, "gpu": {"normalize": False}}})
    with pytest.raises(ConfigError, match=message):
        make_plan("ppo", "Hopper-v5", "mps", hardware=mac, preset=str(tmp_path / "p.yaml"), overrides=tiny)
    assert make_plan("sac", "Pendulum-v1", "auto", hardware=mac, overrides=tiny).device.device == "mps"  # float32
