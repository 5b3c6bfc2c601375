"""A run dir handed over must not choose code to run: the env module its config.yaml names is imported only once the
user names it again, and a video never goes through a link the run dir brings."""

from __future__ import annotations

import sys

import pytest

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.evaluate import main as evaluate_main
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.training import resume_run, train_run
from sb3_gpu.train import main as train_main
from tests.conftest import squashed

# Its import leaves a mark beside it: whatever else a module does at import, it does then.
PAYLOAD = """
from pathlib import Path

Path(__file__).with_name("imported").touch()

from gymnasium.envs.classic_control import CartPoleEnv  # noqa: E402
"""
TINY = {
    "n_envs": 1,
    "n_steps": 32,
    "batch_size": 32,
    "n_epochs": 1,
    "n_timesteps": 64,
    "probe": False,
    "eval_max_episode_steps": 200,
}


@pytest.fixture
def own_env_run(tmp_path, monkeypatch):
    """A finished run on an env class from the user's own module, beside the run dir, in a fresh process (the module
    not imported yet); the folder above the run dir is on sys.path, as the working directory is for ``python -m``.
    Yields the run dir, the module's name and the file its import creates."""
    code, module = tmp_path / "code", "own_env_" + tmp_path.name  # a name of its own: each test imports it afresh
    code.mkdir()
    (code / f"{module}.py").write_text(PAYLOAD)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = make_plan("ppo", f"{module}:CartPoleEnv", "cpu", seed=0, vec_env="dummy", overrides=TINY)
    train_run(plan, tmp_path / "run", eval_episodes=1, confirm_episodes=0, progress=False)
    del sys.modules[module]
    (code / "imported").unlink()
    yield tmp_path / "run", module, code / "imported"
    for name in [name for name in sys.modules if name.split(".")[0] in ("run", module)]:
        del sys.modules[name]


def test_the_users_own_env_module_beside_the_run_is_imported_as_the_run_names_it(own_env_run, call_main):
    run, _, imported = own_env_run
    result = call_main(evaluate_main, str(run), "--episodes", "1")
    assert result.returncode == 0 and imported.exists(), result.stderr


def test_a_module_that_came_inside_the_run_dir_is_imported_only_once_the_user_names_it(own_env_run, call_main):
    # A run dir handed over with code of its own, which its config.yaml names (the folder above is on sys.path).
    run, module, _ = own_env_run
    (run / "payload.py").write_text(PAYLOAD)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace(f"env: {module}:CartPoleEnv", "env: run.payload:CartPoleEnv"))
    name, imported = "run.payload:CartPoleEnv", run / "imported"
    refused = (
        f"error: {config} names the env '{name}', whose module 'run' lies inside {run}: importing it would run code "
        "that came with the config's folder (a run dir handed over, say); to confirm, give it again: "
    )
    for main, args, confirm in (
        (evaluate_main, [str(run), "--episodes", "1"], f"--env {name} (from Python: evaluate_run(run, env='{name}'))"),
        (train_main, ["--resume", str(run), "--timesteps", "128", "--no-progress"], f"--env {name} (from Python: resume_run"),
        (train_main, ["--config", str(config), "--plan"], f"--env {name}"),
    ):
        result = call_main(main, *args)
        assert result.returncode == 2 and squashed(result.stderr).startswith(squashed(refused + confirm)), result.stderr
        assert not imported.exists()
    with pytest.raises(ConfigError, match=r"from Python: resume_run\(run, env='run.payload:CartPoleEnv'\)\)$"):
        resume_run(run, timesteps=128, progress=False)
    # A resume goes on on the run's own env: another name is refused, before anything is imported.
    result = call_main(train_main, "--resume", str(run), "--env", "CartPole-v1", "--timesteps", "128", "--no-progress")
    assert result.returncode == 2 and squashed("may only repeat that name") in squashed(result.stderr), result.stderr
    assert not imported.exists()

    # Named again by the user: imported, and the run resumes and evaluates.
    result = call_main(train_main, "--resume", str(run), "--env", name, "--timesteps", "128", "--no-progress")
    assert result.returncode == 0 and imported.exists(), result.stderr
    result = call_main(evaluate_main, str(run), "--episodes", "1", "--env", name)
    assert result.returncode == 0, result.stderr


def test_a_video_never_goes_through_a_link_the_run_dir_brings(tmp_path, call_main):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=0, vec_env="dummy", overrides=TINY)
    train_run(plan, run, eval_episodes=1, confirm_episodes=0, progress=False)
    elsewhere.mkdir()
    (run / "videos").symlink_to(elsewhere)
    result = call_main(evaluate_main, str(run), "--episodes", "1", "--video")
    assert result.returncode == 2 and result.stderr.startswith(f"error: {run / 'videos'} is a symbolic link"), result.stderr
    (run / "videos").unlink()
    (run / "videos").mkdir()
    (run / "videos" / "best_model.mp4").symlink_to(elsewhere / "victim.mp4")  # a link inside it
    result = call_main(evaluate_main, str(run), "--episodes", "1", "--video")
    assert result.returncode == 2 and "best_model.mp4 is a symbolic link" in result.stderr, result.stderr
    assert list(elsewhere.iterdir()) == []


def test_a_config_links_to_elsewhere_is_checked_where_it_lies_and_where_it_leads(own_env_run, call_main):
    run, module, _ = own_env_run
    (run / "payload.py").write_text(PAYLOAD)
    config = run / "config.yaml"
    (run / "x").mkdir()
    (run / "x" / "config.yaml").write_text(
        config.read_text().replace(f"env: {module}:CartPoleEnv", "env: run.payload:CartPoleEnv")
    )
    config.unlink()
    config.symlink_to("x/config.yaml")  # the folder it leads to holds no code: the one it lies in does
    result = call_main(evaluate_main, str(run), "--episodes", "1")
    assert result.returncode == 2 and "whose module 'run' lies inside" in result.stderr, result.stderr
    assert not (run / "imported").exists()


def test_a_link_from_elsewhere_to_a_handed_over_config_is_checked_where_it_leads(own_env_run, call_main):
    run, module, _ = own_env_run
    (run / "payload.py").write_text(PAYLOAD)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace(f"env: {module}:CartPoleEnv", "env: run.payload:CartPoleEnv"))
    elsewhere = run.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").symlink_to(config)  # the folder it lies in holds no code: the one it leads to does
    result = call_main(train_main, "--config", str(elsewhere / "config.yaml"), "--plan")
    assert result.returncode == 2 and "whose module 'run' lies inside" in result.stderr, result.stderr
    assert not (run / "imported").exists()


def test_a_package_installed_in_a_virtual_environment_inside_the_configs_folder_is_imported(tmp_path, monkeypatch):
    from sb3_gpu.config import runconfig

    # A project keeping its config at its root and its virtual environment in .venv below it.
    site_packages = tmp_path / ".venv" / "lib" / "site-packages"
    site_packages.mkdir(parents=True)
    (site_packages / "installed_envs.py").write_text("")
    monkeypatch.syspath_prepend(str(site_packages))
    config = runconfig.RunConfig("ppo", "installed_envs:MyEnv", "cpu", "auto", None, {}, str(tmp_path / "config.yaml"))
    with pytest.raises(ConfigError, match="whose module 'installed_envs' lies inside"):
        runconfig.config_env(config, None, "", "")
    # A Python whose prefix holds the project (a distribution's /usr above /usr/src/app): the prefix is no package folder.
    monkeypatch.setattr(runconfig.sys, "prefix", str(tmp_path))
    with pytest.raises(ConfigError, match="whose module 'installed_envs' lies inside"):
        runconfig.config_env(config, None, "", "")
    monkeypatch.setattr(runconfig.site, "getsitepackages", lambda: [str(site_packages)])  # this Python's own packages
    assert runconfig.config_env(config, None, "", "") == "installed_envs:MyEnv"


def test_evaluating_a_run_on_an_env_of_other_spaces_says_so_and_blames_no_file(own_env_run, call_main):
    run, _, _ = own_env_run
    result = call_main(evaluate_main, str(run), "--episodes", "1", "--env", "Acrobot-v1")
    assert result.returncode == 2, result.stderr
    assert squashed(
        f"error: {run / 'best_model.zip'} was trained on an env with observation space Box(4,); the env it is loaded "
        "with has Box(6,): evaluate or resume it on the env it trained on"
    ) in squashed(result.stderr)
