"""Evaluations end: episodes of an env with no time limit are cut (with a line saying so), and a signal during any
evaluation (periodic, final, the evaluate CLI) stops it at once, keeps what training produced, and says what to do."""

from __future__ import annotations

import json
import signal

import gymnasium as gym
import numpy as np
import pytest
import yaml
from rich.console import Console

from sb3_gpu.common.cli import command
from sb3_gpu.envs.spec import EpisodeStepCap
from sb3_gpu.evaluate import main as evaluate_main
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.planning.table import plan_table
from sb3_gpu.runs.rundir import zip_timesteps
from sb3_gpu.train import main as train_main
from tests.conftest import run_cli, squashed
from tests.fault_envs import Endless

ENDLESS = "tests.fault_envs:Endless"
TINY = ["--vec-env", "dummy", "--n-envs", "1", "--set", "n_steps=32", "--set", "batch_size=32", "--set", "n_epochs=1"]
CUT = "warning: an episode was cut at {:,} steps; the env did not end it"


@pytest.fixture(autouse=True)
def _count_from_zero(monkeypatch):
    monkeypatch.setattr(Endless, "steps", 0)


def test_the_plan_caps_evaluation_episodes_where_the_env_sets_no_time_limit():
    endless = make_plan("ppo", ENDLESS, "cpu", vec_env="dummy")
    assert endless.eval_step_cap == 10_000
    assert endless.eval_step_cap_reason.startswith("warning: the env sets no time limit")
    console = Console(width=200, record=True)
    console.print(plan_table(endless))
    row = next(line for line in console.export_text().splitlines() if "eval episode cap" in line)
    assert [cell.strip() for cell in row.split("│")][2:4] == ["10,000 steps", endless.eval_step_cap_reason]
    chosen = make_plan("ppo", ENDLESS, "cpu", vec_env="dummy", overrides={"eval_max_episode_steps": 50})
    assert chosen.eval_step_cap == 50 and chosen.eval_step_cap_reason == "eval_max_episode_steps (override)"
    cartpole = make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy")
    assert cartpole.eval_step_cap is None and cartpole.eval_step_cap_reason == "the env ends episodes itself (after 500 steps)"
    # A class that wraps itself in TimeLimit has no registered spec: its limit is found in the wrappers.
    own = make_plan("ppo", "tests.fault_envs:FaultyCartPoleV1", "cpu", vec_env="dummy")
    assert own.eval_step_cap is None and own.eval_step_cap_reason == "the env ends episodes itself (after 500 steps)"
    pong = make_plan("dqn", "ALE/Pong-v5", "cpu", vec_env="dummy", overrides={"buffer_size": 1000, "probe": False})
    assert pong.eval_step_cap is None and pong.eval_step_cap_reason == "the env ends episodes itself (after 108,000 frames)"


@pytest.mark.parametrize("own_limit, lines", [(None, 1), (20, 0)])
def test_the_cap_cuts_only_episodes_nothing_else_ended_and_says_so(own_limit, lines, capsys):
    env = Endless() if own_limit is None else gym.wrappers.TimeLimit(Endless(), own_limit)
    capped = EpisodeStepCap(env, 20)
    for _ in range(2):
        capped.reset()
        ends = [capped.step(0)[2:4] for _ in range(20)]
        assert ends[:-1] == [(False, False)] * 19 and ends[-1] == (False, True)
    assert capsys.readouterr().err.count(CUT.format(20)) == 2 * lines


@pytest.fixture
def endless_run(tmp_path, call_main):
    """A finished 64-step PPO run on an env whose episodes never end, evaluated with 20-step episodes."""
    run_dir = tmp_path / "endless"
    args = ["ppo", "--env", ENDLESS, *TINY, "--timesteps", "64", "--eval-freq", "32", "--eval-episodes", "2"]
    result = call_main(train_main, *args, "--set", "eval_max_episode_steps=20", "--run-dir", str(run_dir), "--no-progress")
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_training_and_evaluate_cut_the_episodes_of_an_env_without_time_limit(endless_run, call_main):
    run_dir, trained = endless_run
    # Two periodic evaluations and the final one, two episodes each, the six that confirm the first (the best so far)
    # and the six of the check after training: every episode cut, none hanging.
    assert trained.stderr.count(CUT.format(20)) == 18, trained.stderr
    assert json.loads((run_dir / "summary.json").read_text())["final_eval_mean"] == 0.0
    result = call_main(evaluate_main, str(run_dir), "--episodes", "3")
    assert result.returncode == 0 and result.stderr.count(CUT.format(20)) == 3
    assert "return 0.00 +/- 0.00 over 3 episodes" in result.stdout


# The plan's check of the env takes step 1 (one reset and one step), training steps 2-33; an evaluation steps its 5
# envs together (steps 34-38, 39-43, ...): a signal at step 40 lets that batched step end.
AFTER_SIGNAL_AT_40 = 43


def _train_signalled(tmp_path, call_main, *, signal_at: int, timesteps: int, eval_freq: int):
    """Train PPO on Endless, which sends SIGINT to this process at its ``signal_at``-th step, with endless evaluations."""
    run_dir = tmp_path / "run"
    args = ["ppo", "--env", ENDLESS, *TINY, "--set", f"env_kwargs={{signal_at: {signal_at}}}"]
    args += ["--timesteps", str(timesteps), "--eval-freq", str(eval_freq), "--eval-episodes", "1000000"]
    return run_dir, call_main(train_main, *args, "--run-dir", str(run_dir), "--no-progress")


def test_a_signal_during_a_periodic_evaluation_stops_it_at_once_and_saves(tmp_path, call_main):
    # Training takes env steps 2-33, then evaluates from step 34 on: step 40 is inside the first evaluation.
    run_dir, result = _train_signalled(tmp_path, call_main, signal_at=40, timesteps=2048, eval_freq=32)
    assert result.returncode == 130, result.stderr
    assert Endless.steps == AFTER_SIGNAL_AT_40  # not one evaluation step after the signal's
    model = run_dir / "model.zip"
    expected = (
        f"stopped by SIGINT: model saved to {model} at 32 timesteps; continue with: {command()} -m sb3_gpu.train --resume"
    )
    assert squashed(expected) in squashed(result.stderr)
    assert zip_timesteps(model) == 32


def test_the_resume_runs_the_periodic_evaluation_a_signal_abandoned_before_it_trains_on(tmp_path, call_main):
    # Evaluations every 32 steps, of 2 episodes cut at 20 steps: the signal at step 40 falls in the one at 32.
    run_dir = tmp_path / "run"
    args = ["ppo", "--env", ENDLESS, *TINY, "--set", "env_kwargs={signal_at: 40}", "--set", "eval_max_episode_steps=20"]
    args += ["--timesteps", "64", "--eval-freq", "32", "--eval-episodes", "2", "--confirm-episodes", "0"]
    stopped = call_main(train_main, *args, "--run-dir", str(run_dir), "--no-progress")
    assert stopped.returncode == 130 and zip_timesteps(run_dir / "model.zip") == 32, stopped.stderr
    assert not (run_dir / "eval" / "evaluations.npz").exists()
    resumed = call_main(train_main, "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    owed = "no evaluation is recorded at 32 timesteps, where one is due: running it first"
    assert squashed(owed) in squashed(resumed.stdout)
    with np.load(run_dir / "eval" / "evaluations.npz") as data:
        assert data["timesteps"].tolist() == [32, 64]  # as in a run never stopped
    again = call_main(train_main, "--resume", str(run_dir), "--timesteps", "96", "--no-progress")
    assert again.returncode == 0 and "running it first" not in again.stdout  # nothing owed after a plain end


def test_a_signal_during_the_owed_evaluation_stops_the_resume_before_its_first_step_and_it_stays_owed(
    tmp_path, call_main, monkeypatch
):
    run_dir = tmp_path / "run"
    args = ["ppo", "--env", ENDLESS, *TINY, "--set", "env_kwargs={signal_at: 40}", "--set", "eval_max_episode_steps=20"]
    args += ["--timesteps", "64", "--eval-freq", "32", "--eval-episodes", "2", "--confirm-episodes", "0"]
    stopped = call_main(train_main, *args, "--run-dir", str(run_dir), "--no-progress")
    assert stopped.returncode == 130 and zip_timesteps(run_dir / "model.zip") == 32, stopped.stderr
    # The resume counts from 0 again: its plan's check takes step 1, the owed evaluation (2 episodes of 20 steps)
    # steps 2-41, so the signal at 40 lands inside it, before training's first step.
    monkeypatch.setattr(Endless, "steps", 0)
    again = call_main(train_main, "--resume", str(run_dir), "--no-progress")
    assert again.returncode == 130, again.stderr
    assert "running it first" in again.stdout and Endless.steps < 42  # no training step after the signal
    assert zip_timesteps(run_dir / "model.zip") == 32 and "--resume" in again.stderr  # still due where it stands
    assert not (run_dir / "eval" / "evaluations.npz").exists()
    monkeypatch.setattr(Endless, "steps", 100)  # past the signal
    resumed = call_main(train_main, "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0 and "running it first" in resumed.stdout, resumed.stderr
    with np.load(run_dir / "eval" / "evaluations.npz") as data:
        assert data["timesteps"].tolist() == [32, 64]


def test_a_signal_during_the_final_evaluation_stops_it_keeps_the_summary_and_advises_evaluate(tmp_path, call_main):
    run_dir, result = _train_signalled(tmp_path, call_main, signal_at=40, timesteps=32, eval_freq=100_000)
    assert result.returncode == 130, result.stderr
    assert Endless.steps == AFTER_SIGNAL_AT_40
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and "final_eval_mean" not in summary
    advice = (
        f"training was complete and its final evaluation was stopped (to evaluate: {command()} -m sb3_gpu.evaluate {run_dir})"
    )
    assert squashed(advice) in squashed(result.stderr) and zip_timesteps(run_dir / "model.zip") == 32


def test_a_signal_at_the_last_step_of_training_advises_evaluate_not_resume(tmp_path, call_main):
    run_dir, result = _train_signalled(tmp_path, call_main, signal_at=33, timesteps=32, eval_freq=100_000)
    assert result.returncode == 130, result.stderr
    assert zip_timesteps(run_dir / "model.zip") == 32  # all of the run: --resume would refuse
    stderr = squashed(result.stderr)
    assert squashed(f"training was complete (to evaluate: {command()} -m sb3_gpu.evaluate {run_dir})") in stderr
    assert "--resume" not in stderr


@pytest.mark.heavy
@pytest.mark.parametrize(
    "signum, code, message",
    [
        (signal.SIGTERM, 143, "stopped by SIGTERM; nothing was evaluated"),
        (signal.SIGINT, 130, "interrupted; nothing was evaluated"),
    ],
)
def test_a_signal_stops_the_evaluate_cli_at_once(endless_run, signum, code, message):
    run_dir, _ = endless_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["hyperparameters"]["env_kwargs"] = {"signal_at": 25, "signum": int(signum)}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    # A process of its own: the signal goes to the whole process, and without a handler SIGTERM would end it.
    result = run_cli("sb3_gpu.evaluate", str(run_dir), "--episodes", "1000000")
    assert result.returncode == code, result.stderr
    assert result.stderr.splitlines()[-1] == f"error: {message}" and "Traceback" not in result.stderr
