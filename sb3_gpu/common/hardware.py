"""What machine this is: cores, memory, CPU features, GPUs. Facts only; the choices made from them live in planning."""

from __future__ import annotations

import math
import os
import platform
import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUInfo:
    """One CUDA device as torch reports it."""

    index: int
    name: str
    memory_gb: float
    capability: tuple[int, int]

    @property
    def bf16(self) -> bool:
        # Ampere (8.0) and newer run bf16 on tensor cores; older cards emulate it slowly.
        return self.capability >= (8, 0)

    @property
    def fp16(self) -> bool:
        # Volta (7.0) introduced tensor cores; fp16 before that brings no speed-up.
        return self.capability >= (7, 0)


@dataclass(frozen=True)
class HardwareProfile:
    """The machine as far as training decisions care."""

    logical_cores: int
    physical_cores: int
    ram_gb: float
    cpu_model: str
    cpu_bf16: bool
    gpus: tuple[GPUInfo, ...]
    mps: bool
    in_notebook: bool
    in_colab: bool
    # AMX tiles: bf16 matrix units (Sapphire Rapids and newer), where CPU bf16 training pays.
    cpu_amx: bool = False
    # Cores busy with other work when the machine was queried (other trainings, say): not free for torch threads.
    busy_cores: int = 0
    # The vector instructions torch's CPU kernels use (AVX2, AVX512, ...): a VM may name two processor generations
    # alike ("AMD EPYC") whose matmuls differ threefold, so timings are kept apart by it too.
    cpu_capability: str = ""

    @property
    def has_cuda(self) -> bool:
        return len(self.gpus) > 0

    def gpu(self, device: str) -> GPUInfo:
        """The GPU of a ``cuda`` or ``cuda:N`` device string."""
        return self.gpus[int(device.split(":")[1]) if ":" in device else 0]

    @property
    def busy_physical_cores(self) -> int:
        """:attr:`busy_cores` (logical CPUs) as physical cores, as the thread counts count them."""
        return -(-self.busy_cores * self.physical_cores // max(self.logical_cores, 1))

    @property
    def cpu(self) -> str:
        """The processor's name and the vector instructions torch uses on it, e.g. ``AMD EPYC (AVX2)``."""
        return f"{self.cpu_model} ({self.cpu_capability})" if self.cpu_capability else self.cpu_model

    def describe(self) -> str:
        """One line, e.g. ``2 cores (2 physical), 23.4 GiB RAM, no GPU``."""
        cpu = f"{self.logical_cores} cores ({self.physical_cores} physical), {self.ram_gb:.1f} GiB RAM"
        if self.gpus:
            gpu = ", ".join(
                f"cuda:{g.index} {g.name} {g.memory_gb:.0f} GiB sm_{g.capability[0]}{g.capability[1]}" for g in self.gpus
            )
        elif self.mps:
            gpu = "Apple MPS"
        else:
            gpu = "no GPU"
        where = " (Colab)" if self.in_colab else " (notebook)" if self.in_notebook else ""
        return f"{cpu}, {gpu}{where}"


def logical_cores() -> int:
    """The logical cores this process may use: the one count that every core-based choice uses.

    That is its CPU affinity (``taskset``, a Slurm job, a container's cpuset), capped by a cgroup's CPU quota (a
    Kubernetes CPU limit), where the OS says; else ``os.cpu_count``. A job given 4 CPUs of a 64-core node plans for 4.
    """
    allowed = _allowed_cpus()
    count = len(allowed) if allowed is not None else os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(count, quota)) if quota is not None else max(1, count)


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity query
        return None


_CGROUP_ROOT, _OWN_CGROUP = "/sys/fs/cgroup", "/proc/self/cgroup"


def _cgroup_dirs(controller: str, root: str = _CGROUP_ROOT, own: str = _OWN_CGROUP) -> list[str]:
    """The folders of this process's cgroup for ``controller`` and of every cgroup above it, where a limit on any of
    them holds (a systemd or Slurm scope, a container without a cgroup namespace): v2's unified tree and v1's tree of
    the controller, as ``own`` (``/proc/self/cgroup``) places the process in them; and the roots themselves."""
    found: list[str] = []
    try:
        with open(own, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, path = fields[1], fields[2]
        if controllers == "":  # v2: the root itself, or /unified beside v1's trees
            base = root if os.path.exists(f"{root}/cgroup.controllers") else f"{root}/unified"
        elif controller in controllers.split(","):
            base = f"{root}/{controller}"  # v1 mounts each tree at its name (cpu: a link to cpu,cpuacct)
        else:
            continue
        names = [name for name in path.split("/") if name and name != ".."]
        found += [os.path.join(base, *names[:depth]) for depth in range(len(names), -1, -1)]
    return list(dict.fromkeys([*found, root, f"{root}/{controller}"]))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_cpu_quota(root: str = _CGROUP_ROOT, own: str = _OWN_CGROUP) -> int | None:
    """The CPUs the tightest cgroup quota on this process allows (rounded up), or None where none sets one: v2's
    ``cpu.max``, v1's CFS files."""
    quotas = []
    for folder in _cgroup_dirs("cpu", root, own):
        try:
            if (v2 := _read(f"{folder}/cpu.max")) is not None:
                quota, period = v2.split()[:2]
                if quota != "max":
                    quotas.append(max(1, math.ceil(int(quota) / int(period))))
            quota_us, period_us = _read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us")
            if quota_us is not None and period_us is not None and int(quota_us) > 0 and int(period_us) > 0:
                quotas.append(max(1, math.ceil(int(quota_us) / int(period_us))))
        except ValueError:
            continue
    return min(quotas, default=None)


def _cgroup_memory(root: str = _CGROUP_ROOT, own: str = _OWN_CGROUP) -> tuple[int, int] | None:
    """The smallest cgroup memory limit on this process and the least room any limit leaves it (a limit less what
    its cgroup holds beyond the inactive page cache, which the kernel drops first), in bytes; None where none is set. psutil
    reports the host's memory inside a container, whose limit ends a process that passes it."""
    smallest: int | None = None
    room: int | None = None
    files = (
        ("memory.max", "memory.current", "inactive_file"),
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    )
    for folder in _cgroup_dirs("memory", root, own):
        for limit_file, usage_file, cache_key in files:
            try:
                text = _read(f"{folder}/{limit_file}")
                if text is None or text == "max" or int(text) >= 2**60:  # v1 writes "no limit" as a page-rounded 2**63
                    continue
                limit, usage = int(text), int(_read(f"{folder}/{usage_file}") or 0)
                stat = dict(line.split()[:2] for line in (_read(f"{folder}/memory.stat") or "").splitlines() if " " in line)
                held = max(0, usage - int(stat.get(cache_key, 0)))
            except ValueError:
                continue
            smallest = limit if smallest is None else min(smallest, limit)
            room = limit - held if room is None else min(room, limit - held)
    return None if smallest is None or room is None else (smallest, room)


def _cpu_info() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return model, flags
    if m := re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE):
        model = m.group(1).strip()
    if m := re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE):
        flags = set(m.group(1).split())
    return model, flags


def _physical_cores(logical: int, sysfs: str = "/sys/devices/system/cpu") -> int:
    """The physical cores under the ``logical`` CPUs this process may use: the distinct cores of its allowed CPUs as
    Linux's topology files name them (``taskset -c 0-3`` on a machine with hyperthreads is 4 cores, not 2), else
    the machine's physical cores in proportion."""
    allowed = _allowed_cpus()
    if allowed is not None and len(allowed) == logical:  # no quota below the affinity: its CPUs are the ones counted
        cores = set()
        try:
            for cpu in allowed:
                topology = f"{sysfs}/cpu{cpu}/topology"
                with open(f"{topology}/physical_package_id", encoding="utf-8") as f:
                    package = f.read().strip()
                with open(f"{topology}/core_id", encoding="utf-8") as f:
                    cores.add((package, f.read().strip()))
            return max(1, len(cores))
        except OSError:
            pass
    import psutil

    physical = psutil.cpu_count(logical=False)
    host = os.cpu_count() or logical
    if not physical:
        return logical
    return max(1, min(logical, round(physical * logical / host)))


def _ram_gb() -> float:
    """The host's memory, or a cgroup's limit below it."""
    import psutil

    limit = _cgroup_memory()
    total = psutil.virtual_memory().total
    return (total if limit is None else min(total, limit[0])) / 2**30


def _in_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and type(shell).__name__ in {"ZMQInteractiveShell", "Shell"}


def host_available_bytes() -> int:
    """The host memory available for new allocations without swapping (psutil's ``available``), or, where less, the
    least room a cgroup limit on this process (its own cgroup's or one above it) leaves."""
    import psutil

    available = int(psutil.virtual_memory().available)
    limit = _cgroup_memory()
    return available if limit is None else max(0, min(available, limit[1]))


def gpu_free_bytes(index: int) -> int | None:
    """The memory free for new tensors on CUDA device ``index``: the device's free memory and the blocks torch's
    allocator holds for this process but no tensor uses (asking makes this process's context there, on the device a
    run is planned for); None where torch cannot say."""
    import torch as th

    try:
        cached = th.cuda.memory_reserved(index) - th.cuda.memory_allocated(index)
        return int(th.cuda.mem_get_info(index)[0] + cached)
    except (RuntimeError, AssertionError):  # no CUDA, or a driver that cannot tell
        return None


def detect_hardware() -> HardwareProfile:
    """Query the machine; every GPU query goes through ``torch.cuda`` / ``torch.backends.mps`` so tests can fake it."""
    import torch as th  # here, not at the top: the CLIs read this module before deciding they need torch

    logical = logical_cores()
    model, flags = _cpu_info()
    gpus: list[GPUInfo] = []
    if th.cuda.is_available():
        for i in range(th.cuda.device_count()):
            props = th.cuda.get_device_properties(i)
            gpus.append(GPUInfo(i, props.name, props.total_memory / 2**30, (props.major, props.minor)))
    mps = bool(getattr(th.backends, "mps", None) and th.backends.mps.is_available())
    return HardwareProfile(
        logical_cores=logical,
        physical_cores=_physical_cores(logical),
        ram_gb=_ram_gb(),
        cpu_model=model,
        # AVX512-BF16 or AMX tiles: the CPU multiplies bf16 natively (other CPUs emulate it, slower than fp32).
        cpu_bf16=bool(flags & {"avx512_bf16", "amx_bf16"}),
        gpus=tuple(gpus),
        mps=mps,
        in_notebook=_in_notebook(),
        in_colab="google.colab" in sys.modules,
        cpu_amx="amx_bf16" in flags,
        busy_cores=busy_cores(),
        cpu_capability=th.backends.cpu.get_cpu_capability(),
    )


def busy_cores(interval: float = 0.1) -> int:
    """Cores more than half busy over ``interval`` seconds, while this process sleeps: other processes' work."""
    import psutil

    allowed = _allowed_cpus()  # another job's cores, outside this process's affinity, are not this one's to count
    try:
        loads = psutil.cpu_percent(interval=interval, percpu=True)
    except Exception:  # pragma: no cover - an unusual /proc: assume the cores are free
        return 0
    busy = sum(load > 50.0 for cpu, load in enumerate(loads) if allowed is None or cpu in allowed)
    shared = len(allowed) if allowed is not None else len(loads)
    quota = _cgroup_cpu_quota()
    if quota is not None and quota < shared:  # a CPU limit over shared CPUs: others' load takes its share of the quota
        busy = math.floor(busy * quota / shared)
    return min(busy, logical_cores())
