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
NAME = "handed_over_env:CartPoleEnv"
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
def handed_over(tmp_path, monkeypatch):
    """A finished run on an env class from a module of its own, as if from another machine: the module not imported."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "handed_over_env.py").write_text(PAYLOAD)
    monkeypatch.syspath_prepend(str(code))
    plan = make_plan("ppo", NAME, "cpu", seed=0, vec_env="dummy", overrides=TINY)
    train_run(plan, tmp_path / "run", eval_episodes=1, confirm_episodes=0, progress=False)
    monkeypatch.delitem(sys.modules, "handed_over_env")
    (code / "imported").unlink()
    return tmp_path / "run", code / "imported"


def test_a_run_dirs_env_module_is_imported_only_once_the_user_names_it_again(handed_over, call_main):
    run, imported = handed_over
    refused = (
        f"error: {run / 'config.yaml'} names the env '{NAME}', whose module 'handed_over_env' is not imported: "
        "importing it would run its code, which a file may not ask for; to confirm, give it again: "
    )
    for main, args, confirm in (
        (evaluate_main, [str(run), "--episodes", "1"], f"--env {NAME} (from Python: evaluate_run(run, env='{NAME}'))"),
        (train_main, ["--resume", str(run), "--timesteps", "128", "--no-progress"], f"--env {NAME} (from Python: resume_run"),
        (train_main, ["--config", str(run / "config.yaml"), "--plan"], f"--env {NAME}"),
    ):
        result = call_main(main, *args)
        assert result.returncode == 2 and squashed(result.stderr).startswith(squashed(refused + confirm)), result.stderr
        assert not imported.exists()
    with pytest.raises(ConfigError, match=r"from Python: resume_run\(run, env='handed_over_env:CartPoleEnv'\)\)$"):
        resume_run(run, timesteps=128, progress=False)
    # A resume goes on on the run's own env: another name is refused, before anything is imported.
    result = call_main(train_main, "--resume", str(run), "--env", "CartPole-v1", "--timesteps", "128", "--no-progress")
    assert result.returncode == 2 and squashed("may only name it again, not 'CartPole-v1'") in squashed(result.stderr)
    assert not imported.exists()

    # Named again by the user: imported, and the run evaluates and resumes as before.
    result = call_main(evaluate_main, str(run), "--episodes", "1", "--env", NAME)
    assert result.returncode == 0 and imported.exists(), result.stderr
    result = call_main(train_main, "--resume", str(run), "--env", NAME, "--timesteps", "128", "--no-progress")
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
