"""The wheel carries the presets: install it into a fresh venv and use it from outside the repo. The sdist carries
what its tests read."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

from tests.conftest import REPO


@pytest.mark.heavy
def test_wheel_installs_into_a_fresh_venv_and_works_outside_the_repo(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        check=True,
        capture_output=True,
    )
    wheel = next(dist.glob("sb3_gpu-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    algos = ("ppo", "dqn", "qrdqn", "sac", "td3", "tqc")
    presets = {f"sb3_gpu/presets/{a}.yaml" for a in algos} | {f"sb3_gpu/presets/search/{a}.yaml" for a in algos}
    assert presets | {"sb3_gpu/py.typed"} <= set(names)
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), "the licence the metadata declares"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    # The heavy dependencies (torch, SB3) come from this interpreter's site-packages, added *after* the venv's own,
    # so the sb3_gpu that imports is the installed wheel, not the checkout.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(f"{site}/outer_deps.pth", "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    script = (
        "import sb3_gpu, sb3_gpu.config.files as p\n"
        "from sb3_gpu import make_model\n"
        "model, timesteps = make_model('ppo', 'CartPole-v1', device='auto', n_steps=16, n_envs=2)\n"
        "model.learn(64)\n"
        "print(sb3_gpu.__file__); print(p.presets_dir()); print(timesteps)\n"
    )
    out = subprocess.run([str(python), "-c", script], cwd=outside, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    module_file, presets, timesteps = out.stdout.strip().splitlines()[-3:]
    assert module_file.startswith(str(venv)) and presets.startswith(str(venv)), out.stdout
    assert timesteps == "100000"

    plan = subprocess.run(
        [str(python), "-m", "sb3_gpu.train", "dqn", "--env", "CartPole-v1", "--plan"],
        cwd=outside,
        capture_output=True,
        text=True,
        check=False,
    )
    assert plan.returncode == 0, plan.stderr
    assert "dqn.yaml:CartPole-v1" in plan.stdout


def test_the_sdist_carries_the_files_its_tests_read(tmp_path):
    subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(tmp_path)], cwd=REPO, check=True)
    sdist = next(tmp_path.glob("sb3_gpu-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {"LICENSE", "README.md", "pyproject.toml"}
    for folder in ("tests", "notebooks", "tools", "presets"):
        needed |= {
            str(path.relative_to(REPO))
            for path in (REPO / folder).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and ".ipynb_checkpoints" not in path.parts
        }
    spaces = {str(path.relative_to(REPO)) for path in (REPO / "benchmarks" / "tuning").glob("*.space.yaml")}
    assert spaces and (needed | spaces) - names == set()
    assert not any(name.startswith(("runs/", "benchmarks/", ".venv/")) for name in names - spaces)
