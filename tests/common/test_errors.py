from __future__ import annotations

import ast
import importlib.metadata
import pathlib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sb3_gpu.common import errors
from sb3_gpu.common.errors import install_hint

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("extra", sorted(set(EXTRAS) - {"dev"}))
def test_an_install_hint_lists_the_extras_packages_as_pip_takes_them(extra):
    hint = install_hint(extra)
    assert hint.startswith("pip install '") and hint.endswith(f" (sb3_gpu's [{extra}] extra)")
    listed = hint.removeprefix("pip install ").removesuffix(f" (sb3_gpu's [{extra}] extra)").split(" ")
    names = {canonicalize_name(Requirement(item.strip("'")).name) for item in listed}
    assert names == {canonicalize_name(Requirement(r).name) for r in EXTRAS[extra]}


def test_every_hint_in_the_code_names_an_extra_that_exists():
    named = []
    for path in (ROOT / "sb3_gpu").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "install_hint" and node.args:
                arg = node.args[0]
                named.append(arg.value if isinstance(arg, ast.Constant) else None)
    constants = [extra for extra in named if extra is not None]  # probe_env's, chosen from a dependency's name, are below
    assert len(constants) >= 10 and set(constants) <= set(EXTRAS), named


def test_without_installed_metadata_the_hint_names_the_extra(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(errors.importlib.metadata, "requires", missing)
    install_hint.cache_clear()
    try:
        assert install_hint("tune") == "install sb3_gpu's [tune] extra"
    finally:
        install_hint.cache_clear()
    assert install_hint("no-such-extra") == "install sb3_gpu's [no-such-extra] extra"


@pytest.mark.parametrize(("missing", "extra"), [("Box2D", "box2d"), ("MuJoCo", "mujoco"), ("ale_py", "atari")])
def test_an_env_missing_its_dependency_names_the_extra_that_brings_it(missing, extra):
    import gymnasium as gym

    from sb3_gpu.envs.spec import EnvSpec, probe_env

    def make(render_mode=None):
        raise gym.error.DependencyNotInstalled(f"{missing} is not installed, run `pip install {missing}`")

    with pytest.raises(errors.ConfigError, match=rf"needs a missing dependency .*\(sb3_gpu's \[{extra}\] extra\)"):
        probe_env(EnvSpec("Fake-v0", make))


def test_a_warning_names_the_callers_line_not_sb3_gpus(tmp_path):
    import warnings

    from stable_baselines3.common.vec_env import DummyVecEnv

    from sb3_gpu import make_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = make_model("ppo", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", probe=False, n_steps=64, batch_size=48)
    assert isinstance(model.get_env(), DummyVecEnv)
    mine = [w for w in caught if "is not a factor of the rollout" in str(w.message)]
    assert len(mine) == 1 and mine[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from sb3_gpu.common.errors import warn

        warn("from a caller", RuntimeWarning)  # a direct call: this line too
    assert caught[0].filename == __file__ and caught[0].category is RuntimeWarning
