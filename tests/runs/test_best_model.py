"""The best model holds up: a periodic evaluation that beats the best so far is only a candidate until fresh
episodes confirm it, and only a confirmed mean above the best's own replaces best_model.zip."""

from __future__ import annotations

import json
import os
import warnings
import zipfile

import gymnasium as gym
import numpy as np
import pytest
import yaml
from rich.console import Console
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
from stable_baselines3.common.vec_env import DummyVecEnv

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.io import atomic_write_bytes
from sb3_gpu.envs.build import make_vec_env
from sb3_gpu.evaluate import main as evaluate_main
from sb3_gpu.planning.build import EVAL_SEED_OFFSET, resumed_seed
from sb3_gpu.runs import evaluation, training
from sb3_gpu.runs.evaluation import BestModel, EvaluationStopped, TimedEvalCallback
from sb3_gpu.runs.rundir import RunDir, zip_timesteps
from sb3_gpu.train import main as train_main
from tests.conftest import squashed
from tests.fault_envs import Endless

EVERY = 32  # env steps between evaluations: one PPO rollout of 32 steps on one env


class Counting(BaseCallback):
    def __init__(self) -> None:
        super().__init__()
        self.at: list[int] = []

    def _on_step(self) -> bool:
        self.at.append(self.num_timesteps)
        return True


def _scripted(monkeypatch, periodic: list[float], confirmations: list[float | Exception]) -> list[int]:
    """Periodic evaluations read ``periodic`` in turn, confirmations ``confirmations``; returns the confirmations'
    episode counts as they are asked for."""
    periodic_iter, confirm_iter, asked = iter(periodic), iter(confirmations), []

    def periodic_eval(model, env, n_eval_episodes, **kwargs):
        value = next(periodic_iter)
        return [value] * n_eval_episodes, [1] * n_eval_episodes

    def confirm(model, env, episodes, deterministic=True, should_stop=None):
        asked.append(episodes)
        value = next(confirm_iter)
        if isinstance(value, Exception):
            raise value
        return value, 1.0

    monkeypatch.setattr("stable_baselines3.common.callbacks.evaluate_policy", periodic_eval)
    monkeypatch.setattr(evaluation, "evaluate", confirm)
    return asked


def _learn(
    tmp_path, evaluations: int, on_new_best: Counting | None = None, **kwargs
) -> tuple[TimedEvalCallback, Counting, PPO]:
    run = RunDir(tmp_path)
    env = make_vec_env("CartPole-v1", 1, vec_env="dummy", seed=0)
    model = PPO("MlpPolicy", env, n_steps=EVERY, batch_size=EVERY, n_epochs=1, policy_kwargs={"net_arch": [8]}, seed=0)
    on_new_best = on_new_best if on_new_best is not None else Counting()
    evaluator = TimedEvalCallback(
        make_vec_env("CartPole-v1", 1, vec_env="dummy", seed=1),
        run_dir=run,
        eval_freq=EVERY,
        n_eval_episodes=4,
        callback_on_new_best=on_new_best,
        **kwargs,
    )
    model.learn(evaluations * EVERY, callback=evaluator)
    return evaluator, on_new_best, model


def test_a_candidate_replaces_the_best_only_when_fresh_episodes_confirm_it(tmp_path, monkeypatch):
    # 10 is the first best (confirmed at 30); 50 confirms at 20, below 30: refused; 40 at 35 and 80 at 90 are kept;
    # 60 does not beat 90 and is no candidate.
    asked = _scripted(monkeypatch, [10, 50, 40, 80, 60], [30, 20, 35, 90])
    evaluator, on_new_best, _ = _learn(tmp_path, 5, confirm_episodes=12)
    assert asked == [12, 12, 12, 12]
    assert on_new_best.at == [32, 96, 128] and evaluator.rejected == 1
    assert evaluator.best == BestModel(128, 90.0, 1.0, 12, 80.0, confirmed=True)
    assert evaluator.best_mean_reward == 90.0
    run = RunDir(tmp_path)
    assert BestModel.read(run.best_record) == evaluator.best
    assert zip_timesteps(run.best_model) == 128


def test_without_confirmation_the_best_periodic_evaluation_is_kept_as_sb3_keeps_it(tmp_path, monkeypatch):
    asked = _scripted(monkeypatch, [10, 50, 40], [])
    evaluator, on_new_best, _ = _learn(tmp_path, 3, confirm_episodes=0)
    assert asked == [] and on_new_best.at == [32, 64]
    assert evaluator.best == BestModel(64, 50.0, 0.0, 4, 50.0, confirmed=False)
    assert zip_timesteps(RunDir(tmp_path).best_model) == 64


def test_a_signal_during_a_confirmation_stops_training_and_keeps_the_previous_best(tmp_path, monkeypatch):
    _scripted(monkeypatch, [10, 50], [30, EvaluationStopped()])
    evaluator, on_new_best, model = _learn(tmp_path, 4, confirm_episodes=6)
    assert evaluator.stopped and model.num_timesteps == 64  # stopped at the second evaluation
    assert evaluator.best_mean_reward == 30.0 and on_new_best.at == [32]
    run = RunDir(tmp_path)
    assert BestModel.read(run.best_record) == BestModel(32, 30.0, 1.0, 6, 10.0, confirmed=True)
    assert zip_timesteps(run.best_model) == 32


class WritesStatistics(Counting):
    """Writes the best model's VecNormalize statistics file, as SaveVecNormalizeCallback does, one version per best."""

    def _on_step(self) -> bool:
        super()._on_step()
        path = RunDir(self.parent.run_dir.path).best_vecnormalize
        atomic_write_bytes(path, b"statistics at %d" % self.num_timesteps)  # by a rename, as save_pickle writes
        return True


@pytest.mark.parametrize("failing", [1, 2])
def test_a_best_model_that_fails_to_save_leaves_the_previous_best_and_its_statistics_as_they_were(
    tmp_path, monkeypatch, failing
):
    _scripted(monkeypatch, [10, 50], [30, 60])
    saves = []

    def save_model(model, path):
        saves.append(model.num_timesteps)
        if len(saves) == failing:
            raise OSError(28, "No space left on device")
        return real_save(model, path)

    real_save = evaluation.save_model
    monkeypatch.setattr(evaluation, "save_model", save_model)
    run = RunDir(tmp_path)
    with pytest.raises(OSError, match="No space left"):
        _learn(tmp_path, 2, confirm_episodes=6, on_new_best=WritesStatistics())
    if failing == 1:  # no best yet: no statistics left without their model
        assert not run.best_vecnormalize.exists() and not run.best_model.exists()
    else:
        assert run.best_vecnormalize.read_bytes() == b"statistics at 32"
        assert zip_timesteps(run.best_model) == 32 and not list(tmp_path.glob(".best_vecnormalize*"))
        assert BestModel.read(run.best_record) == BestModel(32, 30.0, 1.0, 6, 10.0, confirmed=True)


def test_a_resumed_evaluator_measures_candidates_against_the_confirmed_best(tmp_path):
    run = RunDir(tmp_path)
    run.eval.mkdir()
    np.savez(run.evaluations, timesteps=np.array([32, 64]), results=np.array([[10.0], [50.0]]), ep_lengths=np.ones((2, 1)))
    record = BestModel(32, 30.0, 1.0, 6, 10.0, confirmed=True)
    run.best_record.write_text(json.dumps(record.__dict__))
    evaluator = TimedEvalCallback(make_vec_env("CartPole-v1", 1, vec_env="dummy"), run_dir=run, confirm_episodes=6)
    evaluator.restore_history(up_to_timesteps=32, n_envs=1)
    assert evaluator.best == record and evaluator.best_mean_reward == 30.0  # not 50, the best periodic figure
    assert evaluator.evaluations_timesteps == [32]


def test_a_resumed_evaluator_owes_the_evaluation_due_at_its_timesteps_only_where_none_is_recorded(tmp_path):
    run = RunDir(tmp_path)
    run.eval.mkdir()
    np.savez(run.evaluations, timesteps=np.array([32, 64]), results=np.ones((2, 1)), ep_lengths=np.ones((2, 1)))
    evaluator = TimedEvalCallback(make_vec_env("CartPole-v1", 1, vec_env="dummy"), run_dir=run, eval_freq=16)
    # Two envs: an evaluation every 16 calls is one every 32 timesteps.
    owed = {t: evaluator.restore_history(up_to_timesteps=t, n_envs=2) for t in (0, 48, 64, 96)}
    assert owed == {0: False, 48: False, 64: False, 96: True}  # nothing due at 0 or 48; 64's is recorded
    assert evaluator.evaluate_first and evaluator.evaluations_timesteps == [32, 64]
    fresh = TimedEvalCallback(make_vec_env("CartPole-v1", 1, vec_env="dummy"), run_dir=RunDir(tmp_path / "new"), eval_freq=16)
    assert fresh.restore_history(up_to_timesteps=32, n_envs=2)  # no evaluations.npz yet: the one at 32 is owed


def test_a_resumed_evaluator_keeps_the_success_rates_in_line_with_the_timesteps(tmp_path):
    # An env that reports is_success: SB3 writes a row of successes per evaluation, beside the timesteps.
    run = RunDir(tmp_path)
    run.eval.mkdir()
    rows = {"timesteps": np.array([32, 64]), "results": np.ones((2, 2)), "ep_lengths": np.ones((2, 2))}
    np.savez(run.evaluations, **rows, successes=np.array([[0.0, 1.0], [1.0, 1.0]]))
    evaluator = TimedEvalCallback(make_vec_env("CartPole-v1", 1, vec_env="dummy"), run_dir=run)
    evaluator.restore_history(up_to_timesteps=32, n_envs=1)
    assert evaluator.evaluations_timesteps == [32] and evaluator.evaluations_successes == [[0.0, 1.0]]


def test_an_evaluation_whose_write_is_cut_short_leaves_the_runs_evaluations_whole(tmp_path, monkeypatch):
    import errno

    evaluator, _, model = _learn(tmp_path, 2)
    run = evaluator.run_dir
    assert run is not None

    def cut_short(file, **arrays):  # SB3 writes its evaluations with np.savez: a full disk midway
        with open(f"{file}.npz", "wb") as f:
            f.write(b"PK\x03\x04 half of a zip")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("stable_baselines3.common.callbacks.np.savez", cut_short)
    with pytest.raises(OSError, match="No space left"):
        model.learn(EVERY, callback=evaluator, reset_num_timesteps=False)
    with np.load(run.evaluations) as data:  # the two evaluations before it, still readable by --resume
        assert data["timesteps"].tolist() == [EVERY, 2 * EVERY]
    assert not (run.eval / RunDir.SCRATCH / RunDir.EVALUATIONS).exists()


def test_a_resumed_run_evaluates_and_checkpoints_at_the_timesteps_of_a_run_never_stopped(tmp_path):
    # Resumed at 48 timesteps, with evaluations and checkpoints every 32: the next of each falls at 64, as in a run
    # never stopped, not 32 steps after the resume (a run resumed in parts shorter than the interval would never
    # evaluate or checkpoint).
    from sb3_gpu.runs.callbacks import AtomicCheckpointCallback

    run = RunDir(tmp_path)
    model = PPO("MlpPolicy", make_vec_env("CartPole-v1", 1, vec_env="dummy", seed=0), n_steps=EVERY, batch_size=EVERY)
    model.num_timesteps = 48  # as loaded from a checkpoint at 48
    eval_env = make_vec_env("CartPole-v1", 1, vec_env="dummy", seed=1)
    evaluator = TimedEvalCallback(eval_env, run_dir=run, eval_freq=EVERY, n_eval_episodes=1, verbose=0)
    checkpoints = AtomicCheckpointCallback(EVERY, run)
    model.learn(EVERY, callback=[evaluator, checkpoints], reset_num_timesteps=False)
    assert model.num_timesteps == 80
    assert evaluator.evaluations_timesteps == [64]
    assert sorted(p.name for p in run.checkpoints.glob("*.zip")) == [run.checkpoint(64).model.name]


def test_a_damaged_evaluations_file_warns_and_the_resumed_history_starts_empty(tmp_path):
    run = RunDir(tmp_path)
    run.eval.mkdir()
    run.evaluations.write_bytes(b"PK\x03\x04 half of a zip")  # damaged outside sb3_gpu's writes
    record = BestModel(32, 30.0, 1.0, 6, 10.0, confirmed=True)
    run.best_record.write_text(json.dumps(record.__dict__))
    evaluator = TimedEvalCallback(make_vec_env("CartPole-v1", 1, vec_env="dummy"), run_dir=run, confirm_episodes=6)
    with pytest.warns(RuntimeWarning, match="evaluation history starts empty"):
        evaluator.restore_history(up_to_timesteps=32, n_envs=1)
    assert evaluator.best == record and evaluator.best_mean_reward == 30.0 and evaluator.evaluations_timesteps == []


ENDLESS = "tests.fault_envs:Endless"
TINY = ["--vec-env", "dummy", "--n-envs", "1", "--set", "n_steps=32", "--set", "batch_size=32", "--set", "n_epochs=1"]


@pytest.fixture(autouse=True)
def _count_from_zero(monkeypatch):
    monkeypatch.setattr(Endless, "steps", 0)


def test_a_real_signal_inside_the_first_confirmation_stops_it_at_once_and_names_no_best(tmp_path, call_main):
    # The plan's check of the env takes step 1; training steps 2-33; the periodic evaluation (one 20-step episode)
    # 34-53; its confirmation (three episodes on one env) would take 54-113: the signal lands at step 61.
    run_dir = tmp_path / "run"
    args = ["ppo", "--env", ENDLESS, *TINY, "--set", "env_kwargs={signal_at: 61}", "--set", "eval_max_episode_steps=20"]
    args += ["--timesteps", "2048", "--eval-freq", "32", "--eval-episodes", "1", "--run-dir", str(run_dir), "--no-progress"]
    result = call_main(train_main, *args)
    assert result.returncode == 130, result.stderr
    assert Endless.steps == 61
    assert not (run_dir / "best_model.zip").exists() and not (run_dir / "eval" / "best.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_eval_mean"] is None and zip_timesteps(run_dir / "model.zip") == 32


def test_the_plan_and_the_summary_say_how_the_best_is_chosen(tmp_path, call_main):
    planned = call_main(train_main, "ppo", "--eval-episodes", "4", "--plan")
    assert planned.returncode == 0
    text = " ".join(planned.stdout.split())
    assert "confirmed on 12 fresh episodes, and its model becomes best_model.zip only if their mean beats" in text
    off = call_main(train_main, "ppo", "--confirm-episodes", "0", "--plan")
    assert "The best periodic evaluation's model is best_model.zip (--confirm-episodes 0: not confirmed)" in " ".join(
        off.stdout.split()
    )
    bad = call_main(train_main, "ppo", "--confirm-episodes", "-1", "--plan")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "expected an integer >= 0, got '-1'" in bad.stderr

    run_dir = tmp_path / "run"
    trained = call_main(
        train_main, "ppo", *TINY, "--timesteps", "64", "--eval-freq", "32", "--eval-episodes", "2", "--run-dir", str(run_dir)
    )
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    best = summary["best"]
    assert best["confirmed"] and best["episodes"] == 6 and best["checked_episodes"] == 6
    assert summary["best_eval_mean"] == best["checked_mean"]
    assert json.loads((run_dir / "eval" / "best.json").read_text())["checked_mean"] == best["checked_mean"]
    reported = f"{best['checked_mean']:.2f} +/- {best['checked_std']:.2f} on 6 fresh episodes after training"
    table = " ".join(trained.stdout.replace("│", " ").split())  # a long row wraps inside the table's borders
    assert best["chosen"].startswith(reported) and reported in table
    assert "6 confirming episodes; its periodic evaluation read" in best["chosen"]
    evaluated = call_main(evaluate_main, str(run_dir), "--episodes", "2")
    assert evaluated.returncode == 0 and "best_model.zip" in evaluated.stdout


def test_rewards_only_normalisation_of_channel_last_images_evaluates_periodically_after_training_and_on_video(
    tmp_path, call_main
):
    # SB3 syncs VecNormalize's statistics down the training and eval chains level by level, and the training one
    # has the VecTransposeImage SB3 adds; without obs_rms (rewards only) there are no observation statistics to copy.
    run_dir = tmp_path / "run"
    images = [*TINY, "--env", "tests.fault_envs:ChannelLastImages", "--set", "normalize.norm_obs=false"]
    args = ["--timesteps", "64", "--eval-freq", "32", "--eval-episodes", "2", "--confirm-episodes", "2"]
    trained = call_main(train_main, "ppo", *images, *args, "--seed", "1", "--run-dir", str(run_dir))
    assert trained.returncode == 0, trained.stderr
    assert [int(t) for t in np.load(run_dir / "eval" / "evaluations.npz")["timesteps"]] == [32, 64]
    assert json.loads((run_dir / "summary.json").read_text())["final_eval_mean"] == pytest.approx(8.0, abs=8.0)
    assert (
        call_main(evaluate_main, str(run_dir), "--episodes", "2", "--env", "tests.fault_envs:ChannelLastImages").returncode
        == 0
    )

    vector = tmp_path / "vector"  # an env that renders: the video's env is normalised as the run's was
    flags = [*TINY, "--set", "normalize.norm_obs=false", "--timesteps", "32", "--eval-episodes", "2"]
    assert call_main(train_main, "ppo", *flags, "--seed", "1", "--run-dir", str(vector)).returncode == 0
    filmed = call_main(evaluate_main, str(vector), "--episodes", "1", "--video", "--video-length", "10")
    assert filmed.returncode == 0 and (vector / "videos").is_dir(), filmed.stderr


def test_an_eval_env_whose_own_wrapper_moved_the_channels_first_is_evaluated_as_it_is(tmp_path):
    # The user's eval env already gives what the model sees: wrapping it in VecTransposeImage too (as the training
    # env's channel-last images are) failed SB3's channel-last assertion before the first step.
    from tests.fault_envs import ChannelLastImages

    class ChannelsFirst(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Box(0, 255, (1, 36, 36), np.uint8)

        def observation(self, observation):
            return np.moveaxis(observation, -1, 0)

    model = PPO("CnnPolicy", ChannelLastImages(), n_steps=32, batch_size=32, n_epochs=1, seed=0)
    eval_env = DummyVecEnv([lambda: ChannelsFirst(ChannelLastImages())])
    evaluator = TimedEvalCallback(eval_env, eval_freq=32, n_eval_episodes=1, verbose=0)
    model.learn(64, callback=evaluator)
    assert evaluator.last_mean_reward >= 0 and evaluator.eval_env is eval_env  # evaluated, on the env as given


def test_a_signal_during_the_check_after_training_stops_it_and_keeps_the_chosen_figure(tmp_path, call_main):
    # The plan's check of the env takes step 1; training steps 2-33; the periodic evaluation (one 20-step episode)
    # 34-53; its confirmation 54-113; the final evaluation 114-133; the check after training plans afresh (its check
    # of the env: step 134), then its three episodes on three envs would take 135-194, stepped together (..., 150-152):
    # the signal at 151 lets that batched step end.
    run_dir = tmp_path / "run"
    args = ["ppo", "--env", ENDLESS, *TINY, "--set", "env_kwargs={signal_at: 151}", "--set", "eval_max_episode_steps=20"]
    args += ["--timesteps", "32", "--eval-freq", "32", "--eval-episodes", "1", "--run-dir", str(run_dir), "--no-progress"]
    result = call_main(train_main, *args)
    assert result.returncode == 130, result.stderr
    assert Endless.steps == 152
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["stopped_by"] == "SIGINT" and summary["final_eval_mean"] == 0.0
    assert "the check of the best model after them was stopped" in summary["saved"]
    best = json.loads((run_dir / "eval" / "best.json").read_text())
    assert best["confirmed"] and best["checked_mean"] is None
    assert summary["best"]["checked_mean"] is None and summary["best_eval_mean"] == best["mean"]


def test_a_check_that_fails_costs_neither_the_summary_nor_the_chosen_best(tmp_path, call_main, monkeypatch):
    def fails(*args, **kwargs):
        raise MemoryError("no room for a second replay buffer")

    monkeypatch.setattr(training, "evaluate_run", fails)
    run_dir = tmp_path / "run"
    trained = call_main(
        train_main, "ppo", *TINY, "--timesteps", "64", "--eval-freq", "32", "--eval-episodes", "2", "--run-dir", str(run_dir)
    )
    assert trained.returncode == 0, trained.stderr
    assert "warning: the best model was not checked after training (MemoryError: no room" in trained.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best"]["confirmed"] and summary["best"]["checked_mean"] is None
    assert summary["best_eval_mean"] == summary["best"]["mean"] and not summary["interrupted"]


@pytest.mark.heavy
def test_a_presets_eval_freq_sets_how_often_a_run_evaluates_and_eval_freq_overrides_it(tmp_path, call_main, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # a plan table's cells on one line each, however long this test's paths
    preset = tmp_path / "often.yaml"
    preset.write_text("CartPole-v1:\n  eval_freq: 64\n")
    args = ["ppo", *TINY, "--preset", str(preset), "--timesteps", "128", "--eval-episodes", "1", "--confirm-episodes", "0"]
    for extra, expected, why in (
        ([], [64, 128], "eval_freq, often.yaml:CartPole-v1; 2 times"),
        (["--eval-freq", "32"], [32, 64, 96, 128], "--eval-freq; 4 times"),
    ):
        run_dir = tmp_path / f"run{len(expected)}"
        trained = call_main(train_main, *args, *extra, "--run-dir", str(run_dir), "--no-progress")
        assert trained.returncode == 0, trained.stderr
        assert f"evaluation: every {expected[0]} env steps ({why})" in " ".join(trained.stdout.split())
        assert np.load(run_dir / "eval" / "evaluations.npz")["timesteps"].tolist() == expected
    # PPO trains whole rollouts: 100 timesteps take four of 32 steps, and the plan counts the evaluation in the last.
    over = tmp_path / "over"
    trained = call_main(train_main, *args, "--eval-freq", "32", "--timesteps", "100", "--run-dir", str(over), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    assert "every 32 env steps (--eval-freq; 4 times)" in " ".join(trained.stdout.split())
    assert squashed("--timesteps; trains 128: SB3 completes each rollout of n_steps * n_envs") in squashed(trained.stdout)
    assert np.load(over / "eval" / "evaluations.npz")["timesteps"].tolist() == [32, 64, 96, 128]
    # A resumed run evaluates as its config says: the preset's interval is among its hyperparameters.
    resumed = call_main(train_main, "--resume", str(tmp_path / "run2"), "--timesteps", "256", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert np.load(tmp_path / "run2" / "eval" / "evaluations.npz")["timesteps"].tolist() == [64, 128, 192, 256]
    longer = call_main(train_main, "ppo", "--timesteps", "4096", "--eval-freq", "10000", "--plan")
    assert "(--eval-freq; 0 times)" in longer.stdout and "names no best_model.zip" in " ".join(longer.stdout.split())
    bad = call_main(train_main, "ppo", "--set", "eval_freq=0", "--plan")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "eval_freq" in bad.stderr, bad.stderr
    rounded = call_main(train_main, "ppo", "--n-envs", "8", "--timesteps", "960", "--eval-freq", "100", "--plan", "--no-probe")
    assert "every 96 env steps (--eval-freq, 100 rounded to whole steps of 8 envs; 10 times)" in " ".join(
        rounded.stdout.split()
    )


@pytest.mark.heavy
def test_a_replayed_config_evaluates_and_saves_as_its_run_did_and_flags_still_win(tmp_path, call_main):
    import yaml

    first = tmp_path / "first"
    args = ["ppo", *TINY, "--timesteps", "128", "--eval-freq", "32", "--eval-episodes", "1", "--confirm-episodes", "0"]
    trained = call_main(train_main, *args, "--checkpoint-freq", "64", "--run-dir", str(first), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    table_row = next(line for line in trained.stdout.splitlines() if " eval_freq " in line)
    assert "32" in table_row and "--eval-freq" in table_row, table_row  # the table shows the interval the run uses

    def replay(name: str, *extra: str) -> tuple[list[int], dict, str]:
        run_dir = tmp_path / name
        result = call_main(train_main, "--config", str(first), *extra, "--run-dir", str(run_dir), "--no-progress")
        assert result.returncode == 0, result.stderr
        run = yaml.safe_load((run_dir / "config.yaml").read_text())["run"]
        # squashed: a path in the table may wrap anywhere
        return np.load(run_dir / "eval" / "evaluations.npz")["timesteps"].tolist(), run, squashed(result.stdout)

    at, run, out = replay("same")
    assert at == [32, 64, 96, 128] and squashed("(--eval-freq; 4 times)") in out, out  # the first run's source
    assert run == {"eval_freq": None, "eval_episodes": 1, "confirm_episodes": 0, "checkpoint_freq": 64,
                   "save_replay_buffer": False}  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "same" / "checkpoints").glob("*.zip")) == sorted(
        p.name for p in (first / "checkpoints").glob("*.zip")
    )
    at, run, out = replay("flags", "--eval-freq", "64", "--eval-episodes", "2")
    assert (
        at == [64, 128]
        and run["eval_episodes"] == 2
        and run["confirm_episodes"] == 0
        and squashed("(--eval-freq; 2 times)") in out
    )
    # A config written while --eval-freq was a run option kept the interval there: a replay keeps it, as the preset's.
    config = yaml.safe_load((first / "config.yaml").read_text())
    del config["hyperparameters"]["eval_freq"]
    config["run"]["eval_freq"] = 64
    (first / "config.yaml").write_text(yaml.safe_dump(config))
    at, run, out = replay("older")
    assert at == [64, 128] and "(run.eval_freq," in out and squashed("first/config.yaml; 2 times)") in out, out
    assert (
        run["eval_freq"] is None
        and yaml.safe_load((tmp_path / "older" / "config.yaml").read_text())["hyperparameters"]["eval_freq"] == 64
    )
    at, run, out = replay("older_set", "--set", "eval_freq=32")
    assert at == [32, 64, 96, 128] and squashed("(eval_freq, --set; 4 times)") in out, out
    # From Python too: the old config read back holds the interval as the preset key (the CLI holds no logic of its own).
    from sb3_gpu.config.runconfig import load_config
    from sb3_gpu.planning.plan import make_plan

    read = load_config(first)
    assert read.hyperparameters["eval_freq"] == 64 and "eval_freq" not in read.run
    assert read.sources["eval_freq"] == f"run.eval_freq, {first / 'config.yaml'}"
    assert make_plan(read.algo, read.env, "cpu", config=read, overrides={"probe": False}).preset.eval_freq == 64


def test_which_model_a_run_dir_gives_is_decided_once_for_the_api_and_the_cli(tmp_path):
    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "model.zip").write_bytes(b"")
    assert RunDir.find_model(tmp_path)[0] == tmp_path / "model.zip"  # auto: the best, else the final one
    assert RunDir.find_model(tmp_path, "final")[0] == tmp_path / "model.zip"
    with pytest.raises(ConfigError, match=r"has no best_model\.zip \(no evaluation saved one\); which='final': model\.zip"):
        RunDir.find_model(tmp_path, "best")  # asked for by name: the final model does not stand in
    with pytest.raises(ConfigError, match=r"which='best' picks a model in a run dir; .*model\.zip names one already"):
        RunDir.find_model(tmp_path / "model.zip", "best")
    with pytest.raises(ConfigError, match="which must be 'auto', 'best' or 'final', got 'newest'"):
        RunDir.find_model(tmp_path, "newest")
    with pytest.raises(ConfigError, match=r"no such run dir or model file: .*typo"):  # not "picks a model in a run dir"
        RunDir.find_model(tmp_path / "typo", "best")
    (tmp_path / "best_model.zip").write_bytes(b"")
    (tmp_path / "model.zip").unlink()
    with pytest.raises(ConfigError, match=r"has no model\.zip \(its final save did not happen\); which='best': best_model"):
        RunDir.find_model(tmp_path, "final")
    (tmp_path / "model.zip").write_bytes(b"")
    assert RunDir.find_model(tmp_path)[0] == RunDir.find_model(tmp_path, "best")[0] == tmp_path / "best_model.zip"


def test_an_interval_given_to_train_run_is_kept_by_its_resume(tmp_path):
    from sb3_gpu.config.runconfig import load_config
    from sb3_gpu.planning.plan import make_plan

    tiny = {"n_envs": 1, "n_steps": 32, "batch_size": 32, "n_epochs": 1, "n_timesteps": 128, "probe": False}
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=3, vec_env="dummy", overrides=tiny)
    training.train_run(plan, tmp_path, eval_freq=64, eval_episodes=1, confirm_episodes=0, progress=False)
    read = load_config(tmp_path)  # the run option wins over the preset key (null here), as it did in the run
    assert read.hyperparameters["eval_freq"] == 64 and "eval_freq" not in read.run
    training.resume_run(tmp_path, timesteps=256, progress=False)
    assert np.load(tmp_path / "eval" / "evaluations.npz")["timesteps"].tolist() == [64, 128, 192, 256]


def test_a_model_zip_inside_a_run_dir_names_the_run_dir_as_given(tmp_path, monkeypatch):
    # evaluate's paths (its JSON's model and video) stay relative when the zip was given relative.
    (tmp_path / "runs" / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.yaml").write_text("")
    zipfile.ZipFile(tmp_path / "runs" / "r" / "checkpoints" / "model_96_steps.zip", "w").close()
    monkeypatch.chdir(tmp_path)
    model, run = RunDir.find_model("runs/r/checkpoints/model_96_steps.zip")
    assert str(model) == "runs/r/checkpoints/model_96_steps.zip" and str(run) == "runs/r"
    _, run = RunDir.find_model(tmp_path / "runs" / "r" / "checkpoints" / "model_96_steps.zip")
    assert run.path == tmp_path / "runs" / "r"
    (tmp_path / "runs" / "r" / "notes.txt").write_text("not a model")  # said before its config is looked for
    with pytest.raises(ConfigError, match=r"^runs/r/notes.txt is not a zip archive, as SB3 saves a model"):
        RunDir.find_model("runs/r/notes.txt")


def test_waiting_for_training_at_an_evaluation_is_training_time_not_evaluation_time(tmp_path, monkeypatch):
    # On a GPU, settle_training waits for background steps and the device's queue: training's own time. Were it
    # timed as evaluation, bench train would subtract it from sb3_gpu's side alone (plain SB3 has no such wait).
    from types import SimpleNamespace

    clock = [0.0]
    _scripted(monkeypatch, [10, 5, 5], [30])
    monkeypatch.setattr(evaluation, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(evaluation, "settle_training", lambda model: clock.__setitem__(0, clock[0] + 100.0))

    def timed_confirm(*args, **kwargs):
        clock[0] += 1.0  # a confirmation takes a second of the fake clock
        return 30.0, 1.0

    monkeypatch.setattr(evaluation, "evaluate", timed_confirm)
    evaluator, _, _ = _learn(tmp_path, 3, confirm_episodes=6)
    assert clock[0] == 3 * 100.0 + 1.0 and evaluator.seconds == 1.0


def test_an_in_process_eval_env_beside_another_vec_env_class_raises_no_warning_of_sb3s():
    class InProcess(DummyVecEnv):  # SB3 warns where the training env is no instance of the eval env's class
        pass

    model = PPO("MlpPolicy", DummyVecEnv([lambda: gym.make("CartPole-v1")] * 2), n_steps=16, batch_size=32, device="cpu")
    callback = TimedEvalCallback(InProcess([lambda: gym.make("CartPole-v1")]), eval_freq=10_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.init_callback(model)
    with warnings.catch_warnings(record=True) as caught:  # SB3's own callback warns for the same pair
        warnings.simplefilter("always")
        EvalCallback(InProcess([lambda: gym.make("CartPole-v1")])).init_callback(model)
    assert any("not of the same type" in str(w.message) for w in caught)


def test_evaluate_run_plays_the_episodes_of_the_seed_it_is_given_not_those_of_the_training_run(tmp_path, monkeypatch):
    from sb3_gpu.planning.build import build_env
    from sb3_gpu.planning.plan import make_plan

    tiny = {"n_envs": 1, "n_steps": 32, "batch_size": 32, "n_epochs": 1, "n_timesteps": 32, "probe": False}
    training.train_run(make_plan("ppo", "CartPole-v1", "cpu", seed=3, overrides=tiny), tmp_path / "run", progress=False)
    firsts: list[np.ndarray] = []

    def first_observations(model, venv, *args):
        firsts.append(venv.reset())
        return 0.0, 0.0

    monkeypatch.setattr(evaluation, "evaluate", first_observations)
    for seed in (5, 6, 5, None, None, 2**32 - 1):  # the last: its envs' seeds wrap below 2**32, as numpy needs
        evaluation.evaluate_run(tmp_path / "run", episodes=4, seed=seed, which="final")

    def built(seed):  # the evaluation env as built for that seed, before any model is loaded
        env = build_env(make_plan("ppo", "CartPole-v1", "cpu", seed=seed, overrides=tiny), evaluation=True, n_envs=4)
        return env.reset()

    assert np.array_equal(firsts[0], built(5)) and np.array_equal(firsts[1], built(6))
    assert np.array_equal(firsts[0], firsts[2]) and not np.array_equal(firsts[0], firsts[1])
    assert not np.array_equal(firsts[3], firsts[4])  # no seed: fresh episodes each time, not the training seed's
    trained = build_env(make_plan("ppo", "CartPole-v1", "cpu", seed=3, overrides=tiny)).reset()  # its first episode
    assert not any(np.array_equal(first[0], trained[0]) for first in firsts)


def test_a_resumed_run_trains_on_seeds_apart_from_its_first_episodes_and_its_evaluations():
    # Resumed at 10,000 or 20,000 steps, seed + timesteps trained on the evaluation envs' (seed + 10,000 + i) or the
    # check's (seed + 20,000 + i) episodes.
    seed, n_envs = 3, 16
    taken = {seed + offset + i for offset in (0, EVAL_SEED_OFFSET, training.CHECK_SEED_OFFSET) for i in range(n_envs)}
    resumed = [resumed_seed(seed, steps) for steps in (256, 10_000, 20_000, 500_000)]
    assert all(0 <= r < 2**32 and not {r + i for i in range(n_envs)} & taken for r in resumed)
    assert len(set(resumed)) == 4 and resumed[1] == resumed_seed(3, 10_000)  # one per stop, and repeatable
    assert resumed_seed(None, 10_000) is None


def test_a_resume_from_a_checkpoint_sets_aside_the_episodes_it_trains_again(tmp_path, monkeypatch):
    """A run killed after a checkpoint resumes from it and trains the steps after it again: the episodes they ended
    leave the curves (kept beside them), as their evaluations leave evaluations.npz; a resume from the final model
    sets none aside."""
    from sb3_gpu.planning.plan import make_plan
    from sb3_gpu.runs.curves import load_curves

    tiny = {"n_envs": 1, "n_steps": 64, "batch_size": 32, "n_epochs": 1, "n_timesteps": 512, "probe": False}
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=3, vec_env="dummy", overrides=tiny)
    training.train_run(plan, tmp_path, checkpoint_freq=256, eval_episodes=1, confirm_episodes=0, progress=False)
    first = (tmp_path / "monitor" / "0.monitor.csv").read_text().splitlines()
    lengths = [int(line.split(",")[1]) for line in first[2:]]
    (tmp_path / "model.zip").unlink()  # killed: only the checkpoint at 256 steps is left
    (tmp_path / "checkpoints" / "model_512_steps.zip").unlink(missing_ok=True)
    (tmp_path / "checkpoints" / "model_vecnormalize_512_steps.pkl").unlink(missing_ok=True)
    console = Console(record=True, width=300)
    planned = []
    monkeypatch.setattr(training, "make_plan", lambda *a, **k: planned.append(k["seed"]) or make_plan(*a, **k))
    training.resume_run(tmp_path, progress=False, console=console)
    # Fresh episodes, not the first ones; config.yaml keeps the run's own seed, which a second resume starts from.
    assert planned == [resumed_seed(3, 256)] and yaml.safe_load((tmp_path / "config.yaml").read_text())["seed"] == 3
    kept = (tmp_path / "monitor" / "0.seg1.monitor.csv").read_text().splitlines()
    aside = (tmp_path / "monitor" / "0.seg1.dropped.csv").read_text().splitlines()
    # One env steps once per step: the episodes kept ended within the checkpoint's 256 steps, the next one after.
    kept_steps = sum(int(line.split(",")[1]) for line in kept[2:])
    assert kept_steps <= 256 < kept_steps + lengths[len(kept) - 2]
    assert kept[:2] == aside[:2] == first[:2] and kept[2:] + aside[2:] == first[2:]  # moved, not lost
    moved = len(aside) - 2
    assert f"{moved:,} episodes that ended after model_256_steps.zip was saved set aside (trained again)" in (
        console.export_text()
    )
    resumed = [int(line.split(",")[1]) for line in (tmp_path / "monitor" / "0.monitor.csv").read_text().splitlines()[2:]]
    assert load_curves(tmp_path)["steps"][-1] == kept_steps + sum(resumed)

    console = Console(record=True, width=300)
    training.resume_run(tmp_path, timesteps=640, progress=False, console=console)  # from the final model.zip
    assert "set aside" not in console.export_text()
    assert (tmp_path / "monitor" / "0.seg1.monitor.csv").read_text().splitlines() == kept


def test_a_resume_from_an_older_checkpoint_says_why_it_has_no_replay_buffer(tmp_path):
    from sb3_gpu.planning.plan import make_plan

    tiny = {"n_envs": 1, "n_timesteps": 512, "learning_starts": 64, "batch_size": 16, "probe": False, "per": False}
    plan = make_plan("dqn", "CartPole-v1", "cpu", seed=3, vec_env="dummy", overrides=tiny)
    training.train_run(
        plan, tmp_path, checkpoint_freq=256, save_replay_buffer=True, eval_episodes=1, confirm_episodes=0, progress=False
    )
    (tmp_path / "model.zip").unlink()  # the final model is lost; its buffer, written after it, is not
    (tmp_path / "checkpoints" / "model_512_steps.zip").unlink(missing_ok=True)
    assert not list((tmp_path / "checkpoints").glob("*.pkl"))  # the final buffer replaced the checkpoints' own
    console = Console(record=True, width=300)
    training.resume_run(tmp_path, progress=False, console=console)
    assert (
        f"no replay buffer was saved with model_256_steps.zip (a run keeps only its newest model's, "
        f"{tmp_path / 'replay_buffer.pkl'}, and that model could not be resumed from): it starts empty"
    ) in console.export_text()


def test_a_killed_pass_after_the_final_model_and_an_older_checkpoint_are_set_aside_too(tmp_path, monkeypatch):
    import time

    from sb3_gpu.planning.plan import make_plan

    tiny = {"n_envs": 1, "n_steps": 64, "batch_size": 32, "n_epochs": 1, "n_timesteps": 256, "probe": False}
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=3, vec_env="dummy", overrides=tiny)
    training.train_run(plan, tmp_path, checkpoint_freq=128, eval_episodes=1, confirm_episodes=0, progress=False)
    monitor = tmp_path / "monitor"
    first = (monitor / "0.monitor.csv").read_text()
    # A second pass (--resume --timesteps 512) set the first pass's files aside and was killed before it saved.
    (monitor / "0.monitor.csv").rename(monitor / "0.seg1.monitor.csv")
    killed = f'#{{"t_start": {time.time() + 1}, "env_id": "CartPole-v1"}}\nr,l,t\n20.0,20,0.5\n31.0,31,1.1\n'
    (monitor / "0.monitor.csv").write_text(killed)
    console = Console(record=True, width=300)
    training.resume_run(tmp_path, timesteps=384, progress=False, console=console)
    assert "2 episodes that ended after model.zip was saved set aside (trained again)" in console.export_text()
    assert (monitor / "0.seg1.monitor.csv").read_text() == first  # the first pass ended before model.zip was saved
    assert (monitor / "0.seg2.monitor.csv").read_text().splitlines() == killed.splitlines()[:2]
    assert (monitor / "0.seg2.dropped.csv").read_text() == killed

    # A checkpoint an older sb3_gpu wrote records no save time: its file's time stands in, and the run says so.
    (tmp_path / "model.zip").unlink()
    for late in (512, 384):
        (tmp_path / "checkpoints" / f"model_{late}_steps.zip").unlink(missing_ok=True)
    checkpoint = tmp_path / "checkpoints" / "model_256_steps.zip"
    os.utime(checkpoint, (0.0, 0.0))  # before every episode: each segment's episodes move
    monkeypatch.setattr(training, "zip_saved_at", lambda path: None)
    console = Console(record=True, width=300)
    training.resume_run(tmp_path, timesteps=384, progress=False, console=console)
    assert "set aside (by the file's time: the zip records none) (trained again)" in console.export_text()
    assert [p.name for p in sorted(monitor.glob("*.seg*.monitor.csv"))] == [f"0.seg{k}.monitor.csv" for k in (1, 2, 3)]
    assert all(len(p.read_text().splitlines()) == 2 for p in monitor.glob("*.seg*.monitor.csv"))  # headers only


def test_what_a_run_says_prints_its_paths_as_they_are():
    # A run dir named "runs[b]" lost its "[b]" to rich's markup.
    console = Console(record=True, width=300)
    training._Output(progress=False, console=console, report_s=None).say("set aside: runs[b]/monitor/*.dropped.csv")
    assert console.export_text() == "set aside: runs[b]/monitor/*.dropped.csv\n"


@pytest.mark.heavy
def test_a_run_trained_with_optimize_memory_usage_evaluates_and_resumes(tmp_path):
    # Its evaluation's plan takes SB3's host buffer, which refused the zip's optimize_memory_usage=True.
    from sb3_gpu.planning.plan import make_plan

    tiny = {"n_timesteps": 512, "probe": False, "learning_starts": 64, "buffer_size": 1_000}
    plan = make_plan(
        "dqn", "CartPole-v1", "cpu", seed=0, vec_env="dummy",
        overrides={**tiny, "optimize_memory_usage": True, "device_buffers": True},
    )  # fmt: skip
    run = tmp_path / "run"
    training.train_run(plan, run, eval_episodes=1, confirm_episodes=0, progress=False, save_replay_buffer=True)
    assert evaluation.evaluate_run(run, episodes=2, which="final")["episodes"] == 2
    training.resume_run(run, timesteps=768, progress=False)
    assert zip_timesteps(run / "model.zip") == 768
    assert evaluate_main([str(run), "--episodes", "1", "--model", "best"]) == 0
