"""Shared fixtures: fake machines for device decisions, and runners for the CLIs (in this process, or as a user runs
them, in a subprocess)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch as th
from hypothesis import settings

from sb3_gpu.common.hardware import GPUInfo, HardwareProfile
from sb3_gpu.common.torch_settings import TorchSettings

# In CI the property tests run the same examples every time: a red CI must come from a change, not from a draw.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = Path(__file__).resolve().parent.parent

# The CLIs the tests start, and the ones they signal, meet Ctrl-C and SIGTERM as from a terminal, however this run was
# started. A shell without job control starts a background job with SIGINT ignored, and a supervisor may start it with
# the signal blocked; children inherit both (a blocked one stays pending for good), and Python then raises no
# KeyboardInterrupt in them. A handler, unlike an ignored signal, is reset in a child, to the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


# The devices of the tests that hold the GPU path to SB3's updates and to its promise of no host reads: the CPU always
# (CI's, the same tensor code as CUDA's), CUDA where the machine has one (then `pytest -m ""` checks it there too).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not th.cuda.is_available(), reason="no CUDA device here")),
]


def compiled_mode(device: str) -> str:
    """torch.compile's mode as a run takes it on ``device``: inductor's default on the CPU, a CUDA graph on CUDA."""
    return "reduce-overhead" if device.startswith("cuda") else "default"


@contextlib.contextmanager
def no_syncs(device: str) -> Iterator[None]:
    """On CUDA, any wait of the host for the device inside the block raises (torch's sync debug mode), which catches
    what a count of host reads could miss; elsewhere, nothing."""
    if not device.startswith("cuda"):
        yield
        return
    before = th.cuda.get_sync_debug_mode()
    th.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        th.cuda.set_sync_debug_mode(before)


def squashed(text: str) -> str:
    """``text`` without its whitespace: where rich wraps a line (at a space, or inside a long path) depends on the
    width of the terminal and of the paths printed, so a test compares printed text with this on both sides."""
    return "".join(text.split())


def machine(
    gpus: int = 0,
    capability: tuple[int, int] = (8, 0),
    mps: bool = False,
    cores: int = 8,
    cpu_bf16: bool = False,
    cpu_amx: bool = False,
    gpu_name: str = "Fake A100",
) -> HardwareProfile:
    """A HardwareProfile for a machine we do not have."""
    return HardwareProfile(
        logical_cores=cores,
        physical_cores=cores,
        ram_gb=64.0,
        cpu_model="Fake CPU",
        cpu_bf16=cpu_bf16 or cpu_amx,
        gpus=tuple(GPUInfo(i, gpu_name, 40.0, capability) for i in range(gpus)),
        mps=mps,
        in_notebook=False,
        in_colab=False,
        cpu_amx=cpu_amx,
    )


@pytest.fixture(autouse=True, scope="session")
def _probe_cache(tmp_path_factory):
    """Plans time their policies and cache the figures: in a folder of this test session, never the user's cache."""
    os.environ["SB3_GPU_CACHE_DIR"] = str(tmp_path_factory.mktemp("sb3_gpu-cache"))
    yield
    os.environ.pop("SB3_GPU_CACHE_DIR", None)


@pytest.fixture(autouse=True)
def _no_users_thread_cap(monkeypatch):
    """A shell's OMP_NUM_THREADS caps the automatic thread count (planning.speed.thread_cap): tests plan without one,
    whoever runs them; the tests of the cap set their own."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.fixture(autouse=True)
def _batched_costs_of_a_slow_vm(monkeypatch):
    """A plan in doubt between dummy and batched times the batched VecEnv's overhead on this machine; tests keep the
    model's defaults, so that a choice does not depend on the machine that runs them (tests/envs times it for real)."""
    monkeypatch.setattr("sb3_gpu.envs.choice.batched_costs", lambda workers: None)


@pytest.fixture(autouse=True)
def _keep_torch_settings():
    """Building a model applies its plan's thread count and CUDA math flags process-wide: put them back after each test.

    torch.distributions' argument checks start on, as in a new process: dynamo turns them off process-wide the first
    time anything compiles, and a read count would otherwise depend on which test ran before it."""
    before = TorchSettings.current()
    th.distributions.Distribution.set_default_validate_args(__debug__)
    yield
    before.apply()


def _signal_state() -> tuple[object, object, frozenset[int]]:
    blocked = frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), blocked


@pytest.fixture(autouse=True)
def _signals_kept():
    """A test leaves Ctrl-C and SIGTERM as it found them in this process: every CLI a later test starts inherits an
    ignored or blocked signal and cannot be stopped by it (a CI run once waited 10 minutes on such a CLI)."""
    before = _signal_state()
    yield
    after = _signal_state()
    if after != before:
        for signum, handler in ((signal.SIGINT, before[0]), (signal.SIGTERM, before[1])):
            if handler is not None:  # None: a handler not set from Python, which cannot be put back from here
                signal.signal(signum, handler)  # type: ignore[arg-type]
        signal.pthread_sigmask(signal.SIG_SETMASK, before[2])
        pytest.fail(f"the test changed this process's (SIGINT, SIGTERM, blocked) from {before} to {after}")


@pytest.fixture
def cpu_machine() -> HardwareProfile:
    return machine()


@pytest.fixture
def gpu_machine() -> HardwareProfile:
    return machine(gpus=2)


def disk_full(*args: object, **kwargs: object) -> None:
    """A stand-in for a file write on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def run_cli(*args: str, cwd: Path | str | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m <args>`` as a user would, and capture its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def call_main(capsys) -> Callable[..., CliResult]:
    """Run a CLI's ``main(argv)`` in this process and capture its exit code and output (argparse errors included)."""

    def call(main: Callable[[Sequence[str]], int], *args: str) -> CliResult:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse reports bad arguments by exiting
            code = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return call
