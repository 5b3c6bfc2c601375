from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest
import torch as th

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.hardware import GPUInfo, detect_hardware
from sb3_gpu.planning.device import choose_device
from tests.conftest import machine


def test_detect_hardware_reads_the_real_cpu():
    hw = detect_hardware()
    assert hw.logical_cores >= 1 and hw.physical_cores >= 1
    assert hw.ram_gb > 0
    assert not hw.in_notebook
    assert hw.cpu_capability == th.backends.cpu.get_cpu_capability() and hw.cpu.endswith(f"({hw.cpu_capability})")


def test_saved_timings_are_kept_apart_by_the_vector_instructions_of_a_processor_named_alike(monkeypatch):
    # Two VMs both called "AMD EPYC", one with AVX512-BF16 and one with AVX2 only: SAC's LunarLanderContinuous entry
    # trained at 310-513 env steps/s on one and about 90 on the other. A bench run or a probe timing from one is not
    # the other's.
    import dataclasses

    from sb3_gpu.benches import base

    keys = set()
    for capability in ("AVX512", "AVX2"):
        hw = dataclasses.replace(machine(), cpu_model="AMD EPYC", cpu_capability=capability)
        monkeypatch.setattr(base, "detect_hardware", lambda hw=hw: hw)
        keys.add(base.machine_key())
    assert keys == {"AMD EPYC (AVX512), 8 cores, no GPU", "AMD EPYC (AVX2), 8 cores, no GPU"}


def _topology(root, cores: dict[int, int]) -> str:
    """Linux's topology files for CPUs -> their core (one package)."""
    for cpu, core in cores.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text("0\n")
        (folder / "core_id").write_text(f"{core}\n")
    return str(root)


def test_a_job_pinned_to_4_cpus_of_a_64_core_node_plans_for_4(monkeypatch, tmp_path):
    import psutil

    from sb3_gpu.common import hardware

    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {8, 9, 10, 11}, raising=False)
    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 64 if logical else 32)
    monkeypatch.setattr(hardware, "_cgroup_cpu_quota", lambda: None)
    assert hardware.logical_cores() == 4
    # Its CPUs' own cores: 4 where each is a core of its own (Linux numbers the hyperthreads last), 2 where they are
    # two cores' pairs; without topology files, the machine's proportion.
    assert hardware._physical_cores(4, _topology(tmp_path / "a", {8: 8, 9: 9, 10: 10, 11: 11})) == 4
    assert hardware._physical_cores(4, _topology(tmp_path / "b", {8: 4, 9: 4, 10: 5, 11: 5})) == 2
    assert hardware._physical_cores(4, str(tmp_path / "none")) == 2
    # Only its own cores' load counts: the node's other 60 are other jobs' business.
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: [100.0] * 64)
    assert hardware.busy_cores() == 4
    monkeypatch.setattr(hardware, "_cgroup_cpu_quota", lambda: 2)  # a Kubernetes CPU limit below the cpuset
    assert hardware.logical_cores() == 2 and hardware.busy_cores() == 2  # others' load takes its share of the quota


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # cgroup v2: 1.5 CPUs' quota, rounded up
        ({"cpu.max": "max 100000\n"}, None),  # no limit
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files (macOS, or a host without them)
    ],
    ids=["v2-quota", "v2-max", "v1-quota", "v1-unlimited", "none"],
)
def test_a_cgroup_cpu_quota_is_read_from_either_version(tmp_path, files, cpus):
    from sb3_gpu.common.hardware import _cgroup_cpu_quota

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cgroup_cpu_quota(str(tmp_path), own=str(tmp_path / "no-proc")) == cpus


def _cgroup_tree(root, own: str, files: dict[str, str]) -> str:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "self").write_text(own)
    return str(root / "self")


def test_a_cgroup_limit_on_the_processs_own_cgroup_or_one_above_it_is_found(tmp_path):
    # Only the root's files were read: a limit on a systemd or Slurm scope, or in a container sharing the host's
    # cgroup tree, was missed, and the plan used every core and the host's whole memory.
    from sb3_gpu.common.hardware import _cgroup_cpu_quota, _cgroup_memory

    v2 = tmp_path / "v2"
    own = _cgroup_tree(
        v2,
        "0::/system.slice/job.scope\n",
        {
            "cgroup.controllers": "cpu memory\n",
            "system.slice/cpu.max": "400000 100000\n",  # 4 CPUs on the slice, 2 on the job's scope
            "system.slice/job.scope/cpu.max": "200000 100000\n",
            "system.slice/job.scope/memory.max": str(4 * 2**30),
            "system.slice/job.scope/memory.current": str(3 * 2**30),
            "system.slice/job.scope/memory.stat": f"anon 1\ninactive_file {2**30}\n",  # page cache, dropped first
        },
    )
    assert _cgroup_cpu_quota(str(v2), own) == 2
    assert _cgroup_memory(str(v2), own) == (4 * 2**30, 2 * 2**30)  # (the smallest limit, the least room left)
    v1 = tmp_path / "v1"
    own = _cgroup_tree(
        v1,
        "4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "cpu/docker/abc/cpu.cfs_quota_us": "300000\n",
            "cpu/docker/abc/cpu.cfs_period_us": "100000\n",
            "memory/docker/memory.limit_in_bytes": str(8 * 2**30),  # a busy parent's: the least room
            "memory/docker/memory.usage_in_bytes": str(int(7.5 * 2**30)),
            "memory/docker/abc/memory.limit_in_bytes": str(4 * 2**30),  # the smallest: the job's own
            "memory/docker/abc/memory.usage_in_bytes": str(2**30),
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        },
    )
    assert _cgroup_cpu_quota(str(v1), own) == 3
    assert _cgroup_memory(str(v1), own) == (4 * 2**30, 2**29)
    assert _cgroup_memory(str(tmp_path / "none"), own) is None


def test_memory_figures_take_a_cgroup_limit_below_the_hosts(monkeypatch):
    # psutil reports the host's memory inside a container: a buffer that fit the host passed the plan's check, and
    # the container's limit ended the run.
    from sb3_gpu.common import hardware

    host = SimpleNamespace(total=256 * 2**30, available=200 * 2**30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: host)
    monkeypatch.setattr(hardware, "_cgroup_memory", lambda: (4 * 2**30, 3 * 2**30))
    assert hardware._ram_gb() == 4.0 and hardware.host_available_bytes() == 3 * 2**30
    monkeypatch.setattr(hardware, "_cgroup_memory", lambda: None)
    assert hardware._ram_gb() == 256.0 and hardware.host_available_bytes() == 200 * 2**30


def test_detect_hardware_reports_each_gpu_from_torch_queries(monkeypatch):
    props = [
        SimpleNamespace(name="Tesla T4", total_memory=15 * 2**30, major=7, minor=5),
        SimpleNamespace(name="NVIDIA A100", total_memory=80 * 2**30, major=8, minor=0),
    ]
    monkeypatch.setattr(th.cuda, "is_available", lambda: True)
    monkeypatch.setattr(th.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(th.cuda, "get_device_properties", lambda i: props[i])
    hw = detect_hardware()
    assert [g.name for g in hw.gpus] == ["Tesla T4", "NVIDIA A100"]
    assert hw.gpus[0].memory_gb == pytest.approx(15.0)
    assert (hw.gpus[0].fp16, hw.gpus[0].bf16) == (True, False)
    assert (hw.gpus[1].fp16, hw.gpus[1].bf16) == (True, True)
    assert "Tesla T4" in hw.describe()


def test_pre_volta_gpu_has_neither_fast_fp16_nor_bf16():
    gpu = GPUInfo(0, "GTX 1080", 8.0, (6, 1))
    assert not gpu.fp16 and not gpu.bf16


def test_auto_without_gpu_picks_cpu_and_says_why():
    choice = choose_device("auto", "cnn", on_policy=True, hardware=machine())
    assert choice.device == "cpu" and choice.profile == "cpu"
    assert "no CUDA" in choice.reason


def test_auto_picks_gpu_for_cnn_policies():
    choice = choose_device("auto", "cnn", on_policy=True, hardware=machine(gpus=1))
    assert choice.device == "cuda:0" and choice.profile == "gpu"
    assert "CNN" in choice.reason


def test_auto_keeps_on_policy_mlp_on_cpu_even_with_a_gpu():
    choice = choose_device("auto", "mlp", on_policy=True, hardware=machine(gpus=1))
    assert choice.device == "cpu"
    assert "1245" in choice.reason and "--device cuda" in choice.reason


def test_auto_gives_off_policy_mlp_the_gpu():
    assert choose_device("auto", "mlp", on_policy=False, hardware=machine(gpus=1)).device == "cuda:0"


def test_auto_uses_mps_for_cnn_on_apple():
    assert choose_device("auto", "cnn", on_policy=True, hardware=machine(mps=True)).device == "mps"


@pytest.mark.parametrize(
    "requested, expected", [("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1"), (" CUDA:0 ", "cuda:0")]
)
def test_explicit_devices_are_honoured(requested, expected):
    assert choose_device(requested, "mlp", on_policy=True, hardware=machine(gpus=2)).device == expected


def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="asked for a CUDA GPU, but torch sees none"):
        choose_device("cuda", "mlp", on_policy=True, hardware=machine())


def test_cuda_index_past_the_last_gpu_is_an_error():
    with pytest.raises(ConfigError, match=r"only cuda:0..cuda:1 exist"):
        choose_device("cuda:2", "mlp", on_policy=True, hardware=machine(gpus=2))


def test_mps_unavailable_is_an_error():
    with pytest.raises(ConfigError, match="MPS"):
        choose_device("mps", "mlp", on_policy=True, hardware=machine())


@pytest.mark.parametrize("device", ["cuda", "cuda:2", "mps", "gpu"])
def test_a_plan_refuses_a_device_before_it_builds_the_env(device):
    # Building MuJoCo's envs prints warnings of its own: the refusal must be the only thing the user reads.
    import gymnasium as gym

    from sb3_gpu.planning.plan import make_plan

    built = []

    def env() -> gym.Env:
        built.append(1)
        return gym.make("Pendulum-v1")

    with pytest.raises(ConfigError):
        make_plan("sac", env, device, hardware=machine(gpus=2 if device == "cuda:2" else 0))
    assert built == []


@pytest.mark.parametrize("bogus", ["bogus", "gpu", "cuda:x", "cuda:-1", ""])
def test_unknown_device_names_the_accepted_ones(bogus):
    with pytest.raises(ConfigError, match="accepted: auto, cpu, cuda, cuda:N, mps"):
        choose_device(bogus, "mlp", on_policy=True, hardware=machine())
