"""Nothing lost: signals, resume, crashed envs and workers, NaN losses, writes killed midway, hostile model zips."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.logger import configure
from stable_baselines3.common.save_util import json_to_data

from sb3_gpu import ConfigError
from sb3_gpu.common.cli import command
from sb3_gpu.common.errors import EnvWorkerError, StopNow, TrainingDiverged
from sb3_gpu.common.io import atomic_write_bytes, keep_previous
from sb3_gpu.config.runconfig import load_config
from sb3_gpu.extensions.hostreads import HostReads
from sb3_gpu.extensions.stepping import LossScale, first_non_finite, optimizer_step, settle_guards
from sb3_gpu.planning.build import build_env, build_model, model_class, model_kwargs
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.callbacks import AtomicCheckpointCallback, NanGuard, StopOnSignal
from sb3_gpu.runs.evaluation import TimedEvalCallback
from sb3_gpu.runs.rundir import RunDir, zip_timesteps
from sb3_gpu.runs.saving import load_model, load_vecnormalize, save_state
from sb3_gpu.runs.session import Session
from sb3_gpu.runs.training import train_run
from sb3_gpu.train import main as train_main
from tests.conftest import REPO, run_cli, squashed

FAULTY = "tests.fault_envs:FaultyCartPoleV1"


def _start(*args: str, new_session: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    # These runs are about stops, not speed: no probe, so no compile (or two) before the first checkpoint on a loaded
    # machine. A resume keeps its run's own choice.
    quick = [] if "--resume" in args or "--no-probe" in args else ["--no-probe"]
    return subprocess.Popen(
        [sys.executable, "-m", "sb3_gpu.train", *args, *quick, "--no-progress"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,  # its own process group, for a signal sent to the whole job
    )


def _start_workers(run_dir: Path, vec_env: str, *args: str, new_session: bool = False) -> subprocess.Popen[str]:
    """PPO on CartPole-v1 with two envs in worker processes, long enough to be stopped on purpose."""
    common = ["ppo", "--env", "CartPole-v1", "--n-envs", "2", "--vec-env", vec_env, "--timesteps", "100000"]
    return _start(*common, "--run-dir", str(run_dir), *args, new_session=new_session)


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training ended before {path.name} appeared:\n{out[-3000:]}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path} did not appear in {timeout} s")
        time.sleep(0.1)


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    """No process left, running or zombie (a zombie is a worker nobody reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if psutil.pid_exists(p)]:
            return True
        time.sleep(0.1)
    return False


def _load(run_dir: Path, path: Path):
    config = load_config(run_dir)
    plan = make_plan(config.algo, config.env, "cpu", vec_env="dummy", config=config)
    return _load_zip(plan, path, build_env(plan, evaluation=True))


def _load_zip(plan, path: Path, env):
    # The plan's class and arguments, as a run loads them: its buffer takes the n-step returns where it computes them.
    kwargs = model_kwargs(plan)
    return load_model(model_class(plan), path, policy=plan.preset.policy, model_kwargs=kwargs, env=env, device="cpu")


def _no_temp_files(run_dir: Path) -> bool:
    return not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]


# --- signals and resume ----------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_sigint_saves_everything_and_resume_continues_schedules_buffer_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(
        "dqn",
        "--env",
        "CartPole-v1",
        "--per",
        "--n-envs",
        "1",  # one env: checkpoints land on exact step counts (the preset's 8 envs step 8 at a time)
        "--timesteps",
        "100000",
        "--seed",
        "0",
        "--run-dir",
        str(run_dir),
        "--checkpoint-freq",
        "1500",
        "--eval-freq",
        "1000",
        "--eval-episodes",
        "2",
        "--save-replay-buffer",
    )
    # The checkpoint writes the model, then the buffer (atomically, under its final name only once whole): wait for
    # the last of them, or a loaded machine can be between the two.
    _wait_for(run_dir / "checkpoints" / "model_replay_buffer_1500_steps.pkl", proc)
    assert (run_dir / "checkpoints" / "model_1500_steps.zip").is_file()
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "SIGINT received: stopping after this step" in err
    assert f"timesteps, its replay buffer beside it (replay_buffer.pkl); continue with: {command()} -m sb3_gpu.train" in err
    assert f"continue with: {command()} -m sb3_gpu.train --resume {run_dir}" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["timesteps"]
    assert summary["stopped_by"] == "SIGINT" and stopped_at >= 1500
    assert zip_timesteps(run_dir / "model.zip") == stopped_at
    assert (run_dir / "replay_buffer.pkl").is_file() and _no_temp_files(run_dir)
    evals_before = np.load(run_dir / "eval" / "evaluations.npz")["timesteps"].tolist()
    assert evals_before

    resumed = run_cli("sb3_gpu.train", "--resume", str(run_dir), "--timesteps", str(stopped_at + 1200), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {run_dir / 'model.zip'} at {stopped_at:,} timesteps" in resumed.stdout
    assert "replay buffer restored" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    total = stopped_at + 1200
    assert total <= summary["timesteps"] < total + 100 and summary["stopped_by"] is None
    assert summary["final_eval_mean"] > 0

    model = _load(run_dir, run_dir / "model.zip")
    assert model.num_timesteps == summary["timesteps"]
    # Schedules went on from where the run stopped, against the new total.
    progress = 1 - model.num_timesteps / total
    assert model._current_progress_remaining == pytest.approx(progress, abs=0.01)
    assert model.exploration_rate == pytest.approx(model.exploration_schedule(progress), abs=0.01)
    model.load_replay_buffer(run_dir / "replay_buffer.pkl")
    buffer = model.replay_buffer
    # The buffer came back: it holds every step but the one cut short by each stop.
    assert buffer.size() * buffer.n_envs >= summary["timesteps"] - 2 * buffer.n_envs
    assert buffer.beta == pytest.approx(model._anneal_beta(), abs=0.02) and buffer.beta > 0.4
    # One TensorBoard run, holding steps from both sides of the stop.
    assert [p.name for p in (run_dir / "tb").iterdir()] == ["run_1"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb" / "run_1"))
    events.Reload()
    steps = [e.step for e in events.Scalars("rollout/exploration_rate")]
    assert min(steps) < stopped_at < max(steps)
    # The evaluation history goes on too, and the earlier episodes are kept beside the new ones.
    evals = np.load(run_dir / "eval" / "evaluations.npz")["timesteps"].tolist()
    assert evals[: len(evals_before)] == evals_before and len(evals) > len(evals_before)
    assert sorted(p.name for p in (run_dir / "monitor").iterdir()) == ["0.monitor.csv", "0.seg1.monitor.csv"]

    evaluation = run_cli("sb3_gpu.evaluate", str(run_dir), "--model", "final", "--episodes", "2", "--json")
    assert evaluation.returncode == 0, evaluation.stderr
    assert json.loads(evaluation.stdout)["episodes"] == 2


@pytest.mark.heavy
def test_sigterm_exits_143_stops_workers_and_resume_restores_normalization(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(
        "ppo",
        "--env",
        "Acrobot-v1",  # its preset normalises observations
        "--n-envs",
        "2",
        "--vec-env",
        "batched",
        "--timesteps",
        "100000",
        "--run-dir",
        str(run_dir),
        "--checkpoint-freq",
        "1024",
        "--eval-episodes",
        "1",
        "--set",
        "n_steps=256",
    )
    _wait_for(run_dir / "checkpoints" / "model_1024_steps.zip", proc)
    children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM: model saved to" in err
    assert _gone(children), "env workers outlived the run"
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["timesteps"]
    assert summary["stopped_by"] == "SIGTERM" and stopped_at >= 1024
    count_before = _vecnormalize_count(run_dir / "vecnormalize.pkl")

    resumed = run_cli("sb3_gpu.train", "--resume", str(run_dir), "--timesteps", str(stopped_at + 512), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["timesteps"] == stopped_at + 512
    # The statistics were restored and updated further, not started afresh.
    assert _vecnormalize_count(run_dir / "vecnormalize.pkl") > count_before + 500
    assert [p.name for p in (run_dir / "tb").iterdir()] == ["run_1"]
    evaluation = run_cli("sb3_gpu.evaluate", str(run_dir), "--model", "final", "--episodes", "1", "--json")
    assert evaluation.returncode == 0, evaluation.stderr


@pytest.mark.heavy
@pytest.mark.parametrize("vec_env", ["subproc", "batched"])
def test_sigterm_to_the_whole_process_group_stops_as_sigterm_to_the_run_does(tmp_path, vec_env):
    # A cluster's preemption or `kill -- -PGID` signals the workers too: they must leave the stop to the run (which
    # needs them for its current step), not die and turn a clean stop into an env crash (exit 1).
    run_dir = tmp_path / "run"
    proc = _start_workers(
        run_dir, vec_env, "--checkpoint-freq", "1024", "--eval-episodes", "1", "--no-probe", new_session=True
    )
    _wait_for(run_dir / "checkpoints" / "model_1024_steps.zip", proc)
    children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM: model saved to" in err and "EnvWorkerError" not in err and "exited with code" not in err
    assert _gone(children), "env workers outlived the run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["error"] is None


def _vecnormalize_count(path: Path) -> float:
    import pickle

    with open(path, "rb") as f:
        return float(pickle.load(f).obs_rms.count)


@pytest.mark.heavy
def test_a_second_signal_quits_at_once_and_keeps_the_last_good_files(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "in-step-40"
    # The env blocks in its 40th step (after the 32-step checkpoint), so that both signals land inside one env step.
    proc = _start(
        "ppo",
        "--env",
        FAULTY,
        "--set",
        f"env_kwargs={{block_at: 40, marker: '{marker}'}}",
        "--vec-env",
        "dummy",
        "--n-envs",
        "1",
        "--set",
        "n_steps=32",
        "--set",
        "batch_size=32",
        "--timesteps",
        "10000",
        "--checkpoint-freq",
        "32",
        "--eval-freq",
        "100000",
        "--run-dir",
        str(run_dir),
    )
    stderr = _StderrReader(proc)
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGINT)
    stderr.wait_for("SIGINT received: stopping after this step")  # the first one was handled: now the second
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    err = stderr.text()
    assert proc.returncode == 130, err
    assert "stopped at once by a second signal; nothing more was saved" in err
    assert "Traceback" not in err
    states = RunDir(run_dir).saved_states()
    checkpoint = run_dir / "checkpoints" / "model_32_steps.zip"
    assert states and states[0].model == checkpoint and f"the last good model is {checkpoint}" in err
    assert not (run_dir / "model.zip").exists() and _no_temp_files(run_dir)
    assert _load(run_dir, checkpoint).num_timesteps == 32


def test_a_second_signal_before_any_save_removes_the_new_run_dir(tmp_path, monkeypatch, capsys):
    def stopped_while_building(plan, run_dir, **kwargs):
        (run_dir / "config.yaml").write_text("written before the stop")
        raise StopNow

    monkeypatch.setattr("sb3_gpu.runs.training.train_run", stopped_while_building)
    run_dir = tmp_path / "run"
    assert train_main(["ppo", "--run-dir", str(run_dir), "--no-progress", "--no-probe"]) == 130
    err = capsys.readouterr().err
    assert err == "error: stopped at once by a second signal before any model was saved; nothing was kept\n"
    assert not run_dir.exists()  # the same --run-dir works on the next try


def test_a_second_signal_with_only_a_best_model_names_it(tmp_path, monkeypatch, capsys):
    def stopped_after_an_evaluation(plan, run_dir, **kwargs):
        (run_dir / "best_model.zip").write_bytes(b"the first evaluation's best model")
        raise StopNow

    monkeypatch.setattr("sb3_gpu.runs.training.train_run", stopped_after_an_evaluation)
    run_dir = tmp_path / "run"
    assert train_main(["ppo", "--run-dir", str(run_dir), "--no-progress", "--no-probe"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        f"error: stopped at once by a second signal; the best model so far is {run_dir / 'best_model.zip'}",
        f"error: to evaluate it: {command()} -m sb3_gpu.evaluate {run_dir}",
    ]
    assert (run_dir / "best_model.zip").exists()


def test_the_first_signal_promises_a_save_only_where_the_session_saves(capfd):
    from sb3_gpu.runs.session import Session

    for saving, said in ((True, "stopping after this step and saving (again"), (False, "stopping after this step (again")):
        StopOnSignal(saving=saving)._handle(signal.SIGTERM, None)
        assert f"SIGTERM received: {said} to quit at once)" in capfd.readouterr().err
    # A tune trial or a bench run has no run dir: it saves nothing.
    assert Session(PPO("MlpPolicy", "CartPole-v1", n_steps=64)).stop.saving is False


def test_a_second_signal_exits_with_its_own_status(tmp_path, monkeypatch, capsys):
    stop = StopOnSignal()
    stop._handle(signal.SIGINT, None)  # the first: stop after this step
    with pytest.raises(StopNow) as raised:
        stop._handle(signal.SIGTERM, None)
    assert raised.value.signum == signal.SIGTERM  # a preemption's second SIGTERM is not reported as Ctrl-C

    def stopped_by_a_second_sigterm(plan, run_dir, **kwargs):
        raise StopNow(signal.SIGTERM)

    monkeypatch.setattr("sb3_gpu.runs.training.train_run", stopped_by_a_second_sigterm)
    assert train_main(["ppo", "--run-dir", str(tmp_path / "run"), "--no-progress", "--no-probe"]) == 143
    assert "stopped at once by a second signal" in capsys.readouterr().err


def test_sigterm_before_training_began_removes_the_new_run_dir_and_exits_143(tmp_path, monkeypatch, capsys):
    def terminated_while_building(plan, run_dir, **kwargs):  # planning, a compile, building the envs
        (run_dir / "config.yaml").write_text("written before the stop")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises on the next bytecode: never reached
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr("sb3_gpu.runs.training.train_run", terminated_while_building)
    before = signal.getsignal(signal.SIGTERM)
    run_dir = tmp_path / "run"
    assert train_main(["ppo", "--run-dir", str(run_dir), "--no-progress", "--no-probe"]) == 143
    assert capsys.readouterr().err == "error: stopped by SIGTERM before training began; nothing was saved\n"
    assert not run_dir.exists()  # not left behind with its lock
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_before_a_resume_trained_keeps_the_run_dir_and_names_its_last_model(tmp_path, monkeypatch, capsys):
    plan = make_plan(
        "ppo", "CartPole-v1", "cpu", n_envs=1, n_timesteps=64, vec_env="dummy", overrides={"n_steps": 32, "batch_size": 32}
    )
    train_run(plan, tmp_path, eval_episodes=1, progress=False, report_s=None)
    files = sorted(p.name for p in tmp_path.iterdir())

    def terminated_while_loading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the resume")

    monkeypatch.setattr("sb3_gpu.runs.training.restore_model", terminated_while_loading)
    assert train_main(["--resume", str(tmp_path), "--timesteps", "128", "--no-progress"]) == 143
    err = capsys.readouterr().err
    assert squashed(err) == squashed(
        "error: stopped by SIGTERM before training resumed; nothing new was saved, the last complete model is "
        f"{tmp_path / 'model.zip'} (64 timesteps)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_sigterm_as_a_resume_starts_says_the_run_dir_is_as_it_was(tmp_path, monkeypatch, capsys):
    def terminated_at_once(path):  # before the run dir is known: the first moments of the process
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the resume")

    monkeypatch.setattr("sb3_gpu.runs.rundir.RunDir", terminated_at_once)
    assert train_main(["--resume", str(tmp_path), "--no-progress"]) == 143
    assert capsys.readouterr().err == (
        f"error: stopped by SIGTERM before training resumed; nothing new was saved, {tmp_path} is as it was\n"
    )


def test_a_crash_in_the_final_evaluation_keeps_the_model_and_writes_the_summary(tmp_path, monkeypatch, capsys):
    from sb3_gpu.runs.session import Session

    def crashed(self, episodes):
        raise RuntimeError("the evaluation env broke")

    monkeypatch.setattr(Session, "evaluate", crashed)
    run_dir = tmp_path / "run"
    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "64", "--n-envs", "1", "--set", "n_steps=32"]
    args += ["--set", "batch_size=32", "--eval-freq", "1000", "--run-dir", str(run_dir), "--no-progress"]
    assert train_main(args) == 1
    err = capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["saved"] == (
        f"model saved to {run_dir / 'model.zip'} at 64 timesteps; training was complete and its final evaluation "
        "failed (RuntimeError: the evaluation env broke)"
    )
    assert "RuntimeError: the evaluation env broke" in err and squashed(summary["saved"]) in squashed(err)
    assert _load(run_dir, run_dir / "model.zip").num_timesteps == 64


def test_a_best_model_that_cannot_be_written_is_not_reported_as_the_best(tmp_path, monkeypatch, capsys):
    import errno

    def full(model, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("sb3_gpu.runs.evaluation.save_model", full)
    run_dir = tmp_path / "run"
    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "64", "--n-envs", "1", "--set", "n_steps=32"]
    args += ["--set", "batch_size=32", "--eval-freq", "32", "--eval-episodes", "1", "--confirm-episodes", "0"]
    assert train_main([*args, "--run-dir", str(run_dir), "--no-progress"]) == 1
    assert f"could not write {run_dir / 'best_model.zip'}: No space left on device" in capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "best" not in summary and summary["best_eval_mean"] is None
    assert not (run_dir / "best_model.zip").exists() and not (run_dir / "eval" / "best.json").exists()
    assert _load(run_dir, run_dir / "model.zip").num_timesteps == 32  # the final save kept what was trained


@pytest.mark.heavy
def test_a_resumed_pass_drops_the_older_final_buffer_and_a_kills_half_written_temp_files(tmp_path):
    from sb3_gpu.runs.saving import save_state

    plan = make_plan(
        "dqn", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", overrides={"learning_starts": 0, "buffer_size": 500}
    )
    model = build_model(plan, build_env(plan))
    run = RunDir(tmp_path)
    model.learn(40)
    save_state(model, run.final, replay_buffer=True)  # the run stopped here, and is resumed
    run.checkpoints.mkdir()
    # Writes a SIGKILL cut short: hidden temp files, a buffer's gigabytes each, that no write would ever finish.
    gone = 999_999_999  # no process has this id (Linux's largest is 2**22)
    stale = [tmp_path / f".replay_buffer.pkl.tmp-{gone}-0badf00d", run.checkpoints / f".model_1_steps.zip.tmp-{gone}-deadbeef"]
    kept = [
        tmp_path / ".notes.tmp",  # not a name sb3_gpu's writes give
        tmp_path / f".curves.png.tmp-{gone}-0badf00d",  # plot's, which writes here without the lock: not training's
        tmp_path / f".model.zip.tmp-{os.getppid()}-0badf00d",  # a live process's write (another machine's, say)
    ]
    for path in [*stale, *kept]:
        path.write_bytes(b"half")
    with run.locked():
        assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
        checkpoints = AtomicCheckpointCallback(save_freq=20, run_dir=run, save_replay_buffer=True)
        model.learn(20, callback=checkpoints, reset_num_timesteps=False)
    newest = run.saved_states()[0]
    assert newest.timesteps > 40 and newest.replay_buffer.is_file()
    assert not run.final.replay_buffer.exists() and run.final.model.is_file()  # --resume takes the newer: one copy


@pytest.mark.heavy
def test_only_the_newest_checkpoint_keeps_a_replay_buffer(tmp_path, monkeypatch, capsys):
    from sb3_gpu.runs import saving

    plan = make_plan(
        "dqn", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", overrides={"learning_starts": 0, "buffer_size": 500}
    )
    env = build_env(plan)
    model = build_model(plan, env)
    run = RunDir(tmp_path)
    run.checkpoints.mkdir()
    # Another run's file of another name, and a buffer beside a later checkpoint (not this run's to judge): both stay.
    (run.checkpoints / "model_replay_buffer_notes.pkl").write_bytes(b"not a checkpoint's")
    run.checkpoint(10_000).replay_buffer.write_bytes(b"a later checkpoint's")
    checkpoints = AtomicCheckpointCallback(save_freq=20, run_dir=run, save_replay_buffer=True)
    model.learn(60, callback=checkpoints)

    def buffers() -> set[str]:
        return {p.name for p in run.checkpoints.glob("*replay_buffer*")}

    assert sorted(p.name for p in run.checkpoints.glob("*.zip")) == [f"model_{n}_steps.zip" for n in (20, 40, 60)]
    later = {"model_replay_buffer_10000_steps.pkl", "model_replay_buffer_notes.pkl"}
    assert buffers() == {"model_replay_buffer_60_steps.pkl", *later}
    newest = run.saved_states()[0]  # the 10,000-step buffer pairs with no model; 60's with its own
    assert (newest.timesteps, newest.replay_buffer) == (60, run.checkpoint(60).replay_buffer)

    real = saving.save_pickle

    def out_of_memory(path, obj):
        if "replay_buffer" in Path(path).name:
            raise MemoryError
        return real(path, obj)

    monkeypatch.setattr(saving, "save_pickle", out_of_memory)  # a buffer not written keeps the one before it
    with pytest.warns(RuntimeWarning, match=r"model_80_steps\.zip: the replay buffer was not saved \(MemoryError\)"):
        model.learn(20, callback=checkpoints, reset_num_timesteps=False)
    assert buffers() == {"model_replay_buffer_60_steps.pkl", *later} and _no_temp_files(tmp_path)
    monkeypatch.setattr(saving, "save_pickle", real)
    capsys.readouterr()
    checkpoints.verbose = 2  # says which copies it removed
    model.learn(40, callback=checkpoints, reset_num_timesteps=False)
    newest = run.saved_states()[0]
    assert newest.timesteps > 80 and buffers() == {newest.replay_buffer.name, *later}
    removed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Removed")]
    # 60's goes with the first new checkpoint (80's was never written); each later one takes the one before it.
    kept_before = [60, *range(100, newest.timesteps, 20)]
    assert removed == [f"Removed the older checkpoint replay buffer {run.checkpoint(n).replay_buffer}" for n in kept_before]
    # A run's final save with its buffer drops the checkpoints' copies, as a newer checkpoint does, that of a checkpoint
    # at its own step too.
    every = math.lcm(20, model.train_freq.frequency)  # DQN trains (and stops) at whole rollouts: end on a checkpoint
    with Session(model, run_dir=run, checkpoint_freq=20, save_replay_buffer=True) as session:
        outcome = session.learn(every - model.num_timesteps % every, reset_num_timesteps=False)
    assert run.checkpoint(model.num_timesteps).model.is_file()
    assert outcome.model_path == run.final.model and run.final.replay_buffer.is_file()
    assert buffers() == later and run.saved_states()[0].replay_buffer == run.final.replay_buffer
    env.close()


@pytest.mark.heavy
def test_a_replay_buffer_that_cannot_be_written_costs_the_buffer_not_the_model(tmp_path, monkeypatch):
    from sb3_gpu.runs import saving

    plan = make_plan("dqn", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", overrides={"learning_starts": 0})
    env = build_env(plan)
    model = build_model(plan, env)
    model.learn(64)
    run = RunDir(tmp_path)
    run.final.replay_buffer.write_bytes(b"an older run's buffer")
    real = saving.save_pickle

    def out_of_memory(path, obj):
        if Path(path) == run.final.replay_buffer:
            raise MemoryError
        return real(path, obj)

    monkeypatch.setattr(saving, "save_pickle", out_of_memory)
    assert saving.save_state(model, run.final, replay_buffer=True) == "the replay buffer was not saved (MemoryError)"
    assert _load_zip(plan, run.final.model, env).num_timesteps == 64
    assert not run.final.replay_buffer.exists() and _no_temp_files(tmp_path)  # never older than the model beside it
    monkeypatch.setattr(saving, "save_pickle", real)
    assert saving.save_state(model, run.final, replay_buffer=True) is None and run.final.replay_buffer.is_file()
    saved = run.final.replay_buffer.read_bytes()

    def full(model, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(saving, "save_model", full)  # the model is not written: its own buffer stays beside it
    with pytest.raises(OSError):
        saving.save_state(model, run.final, replay_buffer=True)
    assert run.final.replay_buffer.read_bytes() == saved
    env.close()


class _StderrReader:
    """A process's stderr, read line by line as it comes, so that a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen[str]):
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        with self._new:
            if not self._new.wait_for(lambda: any(text in line for line in self.lines), timeout=timeout):
                pytest.fail(f"{text!r} never appeared on stderr:\n{''.join(self.lines)[-3000:]}")

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


# --- crashed envs and workers -----------------------------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.parametrize("vec_env", ["batched", "subproc"])
def test_a_killed_worker_stops_the_run_with_its_env_named_after_a_save(tmp_path, vec_env):
    run_dir = tmp_path / "run"
    proc = _start_workers(run_dir, vec_env, "--checkpoint-freq", "512", "--eval-freq", "100000")
    _wait_for(run_dir / "checkpoints" / "model_512_steps.zip", proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    # The env workers are the forkserver's children (the main process's direct children are the forkserver
    # and the resource tracker).
    workers = [c for c in children if c.ppid() != proc.pid]
    assert len(workers) == 2, [(c.pid, c.ppid(), c.cmdline()) for c in children]
    os.kill(workers[1].pid, signal.SIGKILL)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert re.search(r"error: env (worker )?[01] .*was killed by SIGKILL", err), err
    assert f"model saved to {run_dir / 'model.zip'}" in err and "--resume" in err
    assert _gone([c.pid for c in children])
    assert _load(run_dir, run_dir / "model.zip").num_timesteps >= 512


def test_a_new_run_that_fails_before_any_model_leaves_no_run_dir_and_a_resume_names_its_own_save(
    tmp_path, monkeypatch, call_main
):
    from sb3_gpu.runs import training

    real_build_model = training.build_model

    def broken(*args, **kwargs):
        raise RuntimeError("no room for the model")

    run_dir = tmp_path / "run"
    args = ["ppo", "--vec-env", "dummy", "--n-envs", "1", "--set", "n_steps=32", "--set", "batch_size=32"]
    args += ["--timesteps", "64", "--eval-freq", "64", "--eval-episodes", "1", "--no-progress", "--run-dir", str(run_dir)]
    monkeypatch.setattr(training, "build_model", broken)
    failed = call_main(train_main, *args)
    assert failed.returncode == 1 and "no room for the model" in failed.stderr
    assert "error: no model was saved" in failed.stderr and not run_dir.exists()  # the same --run-dir works again
    monkeypatch.setattr(training, "build_model", real_build_model)
    # One that trained keeps its logs, model or not (NaN weights are never saved): a look at what went wrong.
    real_learn = training._learn

    def diverged(plan, run, *rest):
        atomic_write_bytes(run.summary, b'{"saved": "no finite model was saved"}')
        raise TrainingDiverged("parameter q_net.0.weight is NaN or inf at 32 timesteps")

    monkeypatch.setattr(training, "_learn", diverged)
    kept = call_main(train_main, *args)
    assert kept.returncode == 1 and "error: no finite model was saved" in kept.stderr and run_dir.is_dir()
    shutil.rmtree(run_dir)
    monkeypatch.setattr(training, "_learn", real_learn)
    assert call_main(train_main, *args).returncode == 0
    # A resume that fails before it saves must not quote the summary.json of the part before it.
    monkeypatch.setattr(training, "restore_model", broken)
    resumed = call_main(train_main, "--resume", str(run_dir), "--timesteps", "128", "--no-progress")
    assert resumed.returncode == 1 and "no room for the model" in resumed.stderr
    assert f"error: the last complete model is {run_dir / 'model.zip'} (64 timesteps)" in resumed.stderr


@pytest.mark.heavy
@pytest.mark.parametrize("vec_env", ["batched", "subproc", "dummy"])
def test_an_env_raising_at_step_n_stops_the_run_after_a_save(tmp_path, vec_env):
    run_dir = tmp_path / "run"
    proc = _start(
        "ppo",
        "--env",
        FAULTY,
        "--set",
        "env_kwargs.raise_at=700",
        "--n-envs",
        "2",
        "--vec-env",
        vec_env,
        "--set",
        "n_steps=128",
        "--timesteps",
        "100000",
        "--eval-freq",
        "100000",
        "--run-dir",
        str(run_dir),
    )
    _out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err
    if vec_env == "batched":
        assert re.search(r"error: env [01] \(worker [01]\) raised RuntimeError: boom at step 700", err), err
        assert "Traceback" not in err
    elif vec_env == "subproc":  # SB3's worker prints its traceback and exits; the parent names it
        assert re.search(r"error: env [01] \(SubprocVecEnv worker, pid \d+\) exited with code 1", err), err
        assert "RuntimeError: boom at step 700" in err
    else:  # the env's traceback (its code, in this process), then the error in one line and the save, once
        assert "Traceback" in err and re.search(r"error: env [01] raised RuntimeError: boom at step 700\n", err), err
        assert err.count("model saved to") == 1, err
    assert f"model saved to {run_dir / 'model.zip'} at 1,39" in err  # 2 envs x 699 steps, in rollouts of 2 x 128
    assert _load(run_dir, run_dir / "model.zip").num_timesteps == 1398
    summary = json.loads((run_dir / "summary.json").read_text())
    assert ("exited with code 1" if vec_env == "subproc" else "boom at step 700") in summary["error"]


def test_an_evaluation_env_that_raises_is_named_as_one():
    from stable_baselines3.common.vec_env import DummyVecEnv

    from tests.fault_envs import FaultyCartPoleV1

    model = PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1)
    evaluator = TimedEvalCallback(DummyVecEnv([lambda: FaultyCartPoleV1(raise_at=5)]), eval_freq=32, n_eval_episodes=1)
    with Session(model, evaluator=evaluator) as session:
        outcome = session.learn(64)
    assert isinstance(outcome.error, EnvWorkerError) and outcome.error.env_index == 0
    assert str(outcome.error) == "evaluation env 0 raised RuntimeError: boom at step 5"


# --- NaN -----------------------------------------------------------------------------------------------------------

FUSED = {"policy_kwargs.optimizer_kwargs": {"fused": True}}


@pytest.mark.heavy
@pytest.mark.parametrize(
    "algo, overrides",
    [
        ("ppo", {"n_steps": 128}),
        ("dqn", {"per": False, "learning_starts": 200}),
        ("dqn", {"per": True, "learning_starts": 200}),  # caught by the priority update, before the tree is touched
        # Fused optimizers: the guard skips the step on the device, and the run stops at the next log write.
        ("ppo", {"n_steps": 128, "grad_accum_steps": 2, **FUSED}),
        ("dqn", {"per": True, "device_buffers": True, "learning_starts": 200, **FUSED}),
        # Compiled steps decide on the device too.
        ("ppo", {"n_steps": 128, "compile": "default"}),
        ("dqn", {"per": True, "device_buffers": True, "learning_starts": 200, "compile": "default"}),
        ("qrdqn", {"per": True, "device_buffers": True, "learning_starts": 200, "compile": "default"}),
    ],
    ids=[
        *("ppo", "dqn", "dqn-per", "ppo-fused", "dqn-device-per-fused", "ppo-compiled", "dqn-device-per-compiled"),
        "qrdqn-device-per-compiled",
    ],
)
def test_nan_rewards_stop_training_before_the_weights_turn_nan(tmp_path, algo, overrides):
    if overrides.get("device_buffers"):
        assert algo in ("dqn", "qrdqn")
    plan = make_plan(
        algo,
        FAULTY,
        "cpu",
        n_envs=2,
        n_timesteps=20_000,
        vec_env="dummy",
        overrides={**overrides, "env_kwargs": {"nan_at": 400}},
    )
    with pytest.raises(TrainingDiverged, match="NaN or inf"):
        train_run(plan, tmp_path, eval_freq=100_000, checkpoint_freq=256, progress=False, report_s=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"].startswith("TrainingDiverged") and summary["model"]
    for state in RunDir(tmp_path).saved_states():  # model.zip and every checkpoint: all finite and loadable
        assert first_non_finite(_load(tmp_path, state.model).policy) is None
    # A skipped step is read at the next log write or checkpoint: one more rollout (PPO) or a few episodes (DQN) may
    # run first.
    saved = zip_timesteps(tmp_path / "model.zip")
    assert saved is not None and saved >= 2 * 400  # the model of the step the NaN stopped, not an earlier one
    assert saved <= 2 * 400 + 256 + (512 if {"policy_kwargs.optimizer_kwargs", "compile"} & set(overrides) else 0)
    if overrides.get("per"):
        # The priorities kept their finite values, so the saved buffer stays usable.
        assert not (tmp_path / "replay_buffer.pkl").exists()


@pytest.mark.heavy
@pytest.mark.parametrize("algo", ["sac", "td3", "tqc"])
def test_nan_rewards_stop_continuous_control_before_any_weight_turns_nan(tmp_path, algo):
    # Eager and fp32: timed on a slower machine, the probe would compile the step (a minute on the CPU) or take bf16.
    overrides = {"learning_starts": 100, "batch_size": 32, "net_arch": [32, 32], "env_kwargs": {"nan_at": 300}}
    overrides.update(compile="false", amp="off")
    plan = make_plan(algo, "tests.fault_envs:NanPendulum", "cpu", n_timesteps=5_000, vec_env="dummy", overrides=overrides)
    with pytest.raises(TrainingDiverged, match=r"the gradient of critic.* is NaN or inf"):
        train_run(plan, tmp_path, eval_freq=100_000, checkpoint_freq=200, progress=False, report_s=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"].startswith("TrainingDiverged") and summary["model"]
    for state in RunDir(tmp_path).saved_states():
        model = _load(tmp_path, state.model)
        assert first_non_finite(model.policy) is None
        assert bool(th.isfinite(getattr(model, "log_ent_coef", th.zeros(1))).all())
    # The first NaN reward reaches a sampled batch within a few gradient steps of step 300.
    assert 300 <= (zip_timesteps(tmp_path / "model.zip") or 0) <= 400


@pytest.mark.heavy
def test_a_replay_buffer_holding_a_nan_reward_is_not_saved_for_a_resume_to_stop_on_again(tmp_path):
    # Eager and fp32: timed on a slower machine, the probe would compile the step (a minute on the CPU) or take bf16.
    overrides = {"learning_starts": 100, "batch_size": 32, "net_arch": [32, 32], "env_kwargs": {"nan_at": 300}}
    overrides.update(compile="false", amp="off")
    plan = make_plan("sac", "tests.fault_envs:NanPendulum", "cpu", n_timesteps=5_000, vec_env="dummy", overrides=overrides)
    with pytest.raises(TrainingDiverged):
        train_run(
            plan, tmp_path, eval_freq=100_000, checkpoint_freq=200, save_replay_buffer=True, progress=False, report_s=None
        )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert re.search(
        r"the replay buffer was not saved: it holds a NaN or inf reward \(buffer row 29\d\), which a resumed run",
        summary["saved"],
    )
    assert "--resume would start with an empty one" in summary["saved"]
    assert not (tmp_path / "replay_buffer.pkl").exists()
    # The checkpoint before the NaN kept its buffer, whose rewards are all finite.
    assert (tmp_path / "checkpoints" / "model_replay_buffer_200_steps.pkl").exists()


def test_a_device_buffer_larger_than_the_hosts_free_memory_is_not_copied_to_be_saved(tmp_path, monkeypatch):
    # Copying it to the host would not raise MemoryError: the kernel would kill the process. A buffer on the meta
    # device stands for one on a GPU (its storage is not host memory); one on the CPU is pickled from its own memory.
    from sb3_gpu.extensions.replay import DeviceReplayBuffer
    from sb3_gpu.runs import saving

    box, actions = spaces.Box(-1, 1, (250,), np.float32), spaces.Box(-1, 1, (2,), np.float32)
    elsewhere = DeviceReplayBuffer(1000, box, actions, "meta")
    assert elsewhere.host_copy_bytes() == 1000 * (2 * 250 + 2 + 3) * 4  # 2.0 MB
    assert DeviceReplayBuffer(1000, box, actions, "cpu").host_copy_bytes() == 0
    monkeypatch.setattr(saving, "host_available_bytes", lambda: 2_000_000)
    assert saving.host_memory_short(elsewhere) == (
        "its 1.9 MiB on meta would be copied to host memory to be written, and only 1.9 MiB is available"
    )
    monkeypatch.setattr(saving, "host_available_bytes", lambda: 3_000_000)
    assert saving.host_memory_short(elsewhere) is None  # 2.0 MB of 3.0: within the share a save may take

    # save_state keeps the model and says why the buffer is missing.
    plan = make_plan(
        "dqn", "CartPole-v1", "cpu", n_envs=1, vec_env="dummy", overrides={"learning_starts": 0, "device_buffers": True}
    )
    env = build_env(plan)
    model = build_model(plan, env)
    model.learn(64)
    assert isinstance(model.replay_buffer, DeviceReplayBuffer)
    needed = model.replay_buffer._storage_bytes()
    monkeypatch.setattr(type(model.replay_buffer), "host_copy_bytes", lambda self: needed)  # as though on a GPU
    monkeypatch.setattr(saving, "host_available_bytes", lambda: needed)
    run = RunDir(tmp_path)
    lost = saving.save_state(model, run.final, replay_buffer=True)
    assert lost is not None and lost.startswith("the replay buffer was not saved: its ") and "only" in lost
    assert _load_zip(plan, run.final.model, env).num_timesteps == 64 and not run.final.replay_buffer.exists()
    env.close()


@pytest.mark.parametrize("storage", ["numpy", "torch"])
def test_the_scan_of_a_replay_buffer_names_the_first_non_finite_field_and_row(storage, monkeypatch):
    from stable_baselines3.common.buffers import ReplayBuffer

    from sb3_gpu.runs import saving

    monkeypatch.setattr(saving, "_SCANNED_BYTES", 12 * 1000)  # 1,000 rows of 3 floats at a time
    buffer = ReplayBuffer(100_000, spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-1, 1, (2,), np.float32), "cpu")
    convert = (lambda a: a) if storage == "numpy" else th.from_numpy
    buffer.observations, buffer.actions = convert(buffer.observations), convert(buffer.actions)
    assert saving.non_finite_transition(buffer) is None
    buffer.observations[70_000, 0, 2] = np.inf  # past the first chunks of rows scanned
    assert saving.non_finite_transition(buffer) == "a NaN or inf observation (buffer row 70,000)"
    buffer.rewards[5, 0] = np.nan  # rewards are read first
    assert saving.non_finite_transition(buffer) == "a NaN or inf reward (buffer row 5)"


def test_the_scan_reads_the_episode_ends_a_memory_optimised_device_buffer_keeps_aside():
    from sb3_gpu.extensions.replay import DeviceReplayBuffer
    from sb3_gpu.runs.saving import non_finite_transition

    box = spaces.Box(-1, 1, (3,), np.float32)
    buffer = DeviceReplayBuffer(10, box, spaces.Box(-1, 1, (2,), np.float32), "cpu", optimize_memory_usage=True)
    obs, action, reward = np.zeros((1, 3), np.float32), np.zeros((1, 2), np.float32), np.zeros(1, np.float32)
    last = np.full((1, 3), np.nan, np.float32)  # the final observation of an episode, NaN
    buffer.add(obs, last, action, reward, np.ones(1), [{"terminal_observation": last[0]}])
    buffer.add(obs, obs, action, reward, np.zeros(1), [{}])  # the next episode's first step: the slot holds obs
    assert bool(th.isfinite(buffer.observations).all()) and bool(th.isfinite(buffer.rewards).all())
    assert non_finite_transition(buffer) == "a NaN or inf episode end observation (buffer row 0)"


def _model(algo: str = "ppo", **overrides):
    plan = make_plan(algo, "CartPole-v1", "cpu", vec_env="dummy", overrides=overrides)
    return build_model(plan, build_env(plan))


def _guarded(model) -> NanGuard:
    guard = NanGuard()
    guard.init_callback(model)
    guard.on_training_start({}, {})
    return guard


def test_nan_guard_refuses_a_nan_gradient_and_leaves_the_weights_alone():
    model = _model()
    guard = _guarded(model)
    optimizer = model.policy.optimizer
    before = [p.detach().clone() for p in model.policy.parameters()]
    for p in model.policy.parameters():
        p.grad = th.zeros_like(p)
    next(model.policy.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"the gradient of mlp_extractor\.policy_net\.0\.weight is NaN or inf"):
        optimizer.step()
    assert all(th.equal(a, b) for a, b in zip(before, model.policy.parameters(), strict=True))
    guard.close()
    optimizer.step()  # the guard is off again


@pytest.mark.parametrize("algo", ["sac", "tqc"])
def test_nan_guard_covers_the_entropy_coefficients_own_optimizer(algo):
    plan = make_plan(algo, "Pendulum-v1", "cpu", vec_env="dummy", overrides={"probe": False, "net_arch": [16]})
    model = build_model(plan, build_env(plan))
    guard = _guarded(model)
    before = model.log_ent_coef.detach().clone()
    model.log_ent_coef.grad = th.full_like(model.log_ent_coef, float("nan"))
    with pytest.raises(TrainingDiverged, match="the gradient of log_ent_coef is NaN or inf"):
        model.ent_coef_optimizer.step()
    assert th.equal(model.log_ent_coef.detach(), before)
    guard.close()


@pytest.mark.parametrize("algo", ["ppo", "dqn"])
def test_with_a_fused_optimizer_the_guard_skips_on_the_device_and_raises_when_its_flags_are_read(algo):
    extra = {"batch_size": 64} if algo == "ppo" else {"per": True}
    model = _model(algo, grad_accum_steps=2, **extra, **FUSED)  # sb3_gpu's subclasses
    guard = _guarded(model)
    before = [p.detach().clone() for p in model.policy.parameters()]
    named = list(model.policy.named_parameters())
    for _, p in named:
        p.grad = th.zeros_like(p)
    named[1][1].grad[0] = float("inf")
    with HostReads() as reads:
        for _ in range(2 * 3):  # three steps of two micro-batches, each one skipped
            model.policy.optimizer.zero_grad(set_to_none=False)
            named[1][1].grad[0] = float("inf")
            model.policy.optimizer.step()
    assert reads.total == 0, reads.sites
    assert all(th.equal(a, b) for a, b in zip(before, model.policy.parameters(), strict=True))
    with pytest.raises(TrainingDiverged, match=rf"the gradient of {re.escape(named[1][0])} is NaN or inf"):
        settle_guards(model)
    guard.close()


def _due_every_other_call(tmp_path, where: str):
    """A DQN whose fused optimizer skips a bad step on the device, guarded, and a checkpoint or evaluation callback
    due every other call; the callback's count of checkpoints written or evaluations recorded."""
    model = _model("dqn", per=True, grad_accum_steps=2, **FUSED)
    env = model.get_env()
    model._last_obs = env.reset()  # type: ignore[assignment]
    model.set_logger(configure(None, []))  # the evaluation records its figures
    run_dir = RunDir(tmp_path)
    callback = (
        AtomicCheckpointCallback(save_freq=2, run_dir=run_dir)
        if where == "checkpoint"
        else TimedEvalCallback(env, run_dir=run_dir, eval_freq=2, n_eval_episodes=1, verbose=0)
    )
    callback.init_callback(model)
    _guarded(model)

    def done() -> int:
        return len(list(run_dir.checkpoints.glob("*.zip"))) if where == "checkpoint" else len(callback.evaluations_results)

    return model, callback, done


def _skip_a_step(model) -> str:
    """One optimizer step of two micro-batches with a NaN gradient: skipped on the device, nothing read. Its name."""
    name, param = list(model.policy.named_parameters())[1]
    for _ in range(2):
        model.policy.optimizer.zero_grad(set_to_none=False)
        for p in model.policy.parameters():
            p.grad = th.zeros_like(p) if p.grad is None else p.grad
        param.grad[0] = float("nan")
        model.policy.optimizer.step()
    return name


@pytest.mark.parametrize("where", ["checkpoint", "evaluation"])
def test_a_step_skipped_on_the_device_stops_the_run_at_the_next_checkpoint_or_evaluation(tmp_path, where):
    model, callback, done = _due_every_other_call(tmp_path, where)
    assert callback.on_step() and callback.on_step()  # nothing skipped yet: written or recorded at the second call
    assert done() == 1
    name = _skip_a_step(model)
    with HostReads() as reads:
        assert callback.on_step()  # not due: nothing read, nothing raised
    assert reads.total == 0, reads.sites
    with pytest.raises(TrainingDiverged, match=rf"the gradient of {re.escape(name)} is NaN or inf"):
        callback.on_step()
    assert done() == 1  # stopped before the checkpoint or the evaluation


@pytest.mark.parametrize("where", ["checkpoint", "evaluation"])
def test_an_overlapped_training_still_running_is_waited_for_before_the_flags_are_read(tmp_path, where):
    model, callback, done = _due_every_other_call(tmp_path, where)
    finished = []

    def sync_training() -> None:  # the background training's last step, skipped, ends while it is waited for
        finished.append(_skip_a_step(model))

    model.sync_training = sync_training
    assert callback.on_step()
    with pytest.raises(TrainingDiverged, match="NaN or inf"):
        callback.on_step()
    assert finished and done() == 0


def test_nan_guard_leaves_steps_that_the_amp_loss_scaler_skips_to_it():
    # The CPU twin of fp16 AMP: the same loss scaler wrapped around the optimizer's step, as enable_amp does on CUDA.
    model = _model()
    scaler = LossScale()
    optimizer_step(model.policy.optimizer, model.policy).scale_losses(scaler)
    _guarded(model)
    for p in model.policy.parameters():
        p.grad = th.full_like(p, float("inf"))
    model.policy.optimizer.step()  # an fp16 overflow: skipped by the scaler, not an error
    assert scaler.skipped_steps == 1
    for p in model.policy.parameters():
        p.grad = th.ones_like(p)
    model.policy.optimizer.step()
    assert scaler.skipped_steps == 1 and first_non_finite(model.policy) is None


def test_nan_guard_catches_nan_weights_at_the_next_rollout():
    model = _model("dqn")
    guard = _guarded(model)
    guard.on_rollout_start()
    with th.no_grad():
        model.policy.q_net_target.q_net[0].bias[3] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"parameter q_net_target.q_net.0.bias is NaN or inf"):
        guard.on_rollout_start()


# --- atomic writes -------------------------------------------------------------------------------------------------

WRITER = """
import os, sys, time
from sb3_gpu.common import io as _io

def stall(fd):  # the new bytes are in the temp file; the rename has not happened
    print("WRITING", flush=True)
    time.sleep(120)

os.fsync = stall
_io.atomic_write_bytes(sys.argv[1], b"new" * 1_000_000)
"""


def test_a_writer_killed_midway_leaves_the_old_file_whole(tmp_path):
    target = tmp_path / "model.zip"
    target.write_bytes(b"the last good model")
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(target)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "WRITING"
    partial = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert partial and partial[0].stat().st_size == 3_000_000  # the new bytes exist, beside the old file
    proc.kill()
    proc.wait()
    assert target.read_bytes() == b"the last good model"


def test_an_interrupted_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text("{}")

    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(target, b'{"timesteps": 1}')
    assert target.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# --- hostile model zips --------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs code: it creates a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _tampered_zip(tmp_path: Path, extra_key: bool) -> tuple[Path, Path]:
    model = _model()
    clean = tmp_path / "clean.zip"
    model.save(clean)
    pwned = tmp_path / "pwned"
    payload = {":type:": "<class 'x'>", ":serialized:": base64.b64encode(cloudpickle.dumps(_Payload(str(pwned)))).decode()}
    tampered = tmp_path / "tampered.zip"
    with zipfile.ZipFile(clean) as src, zipfile.ZipFile(tampered, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "data":
                fields = json.loads(data)
                fields["observation_space"] = payload
                if extra_key:
                    fields["evil"] = payload
                data = json.dumps(fields).encode()
            dst.writestr(item, data)
    return tampered, pwned


def test_a_pickled_entry_in_a_model_zip_is_never_unpickled(tmp_path):
    tampered, pwned = _tampered_zip(tmp_path, extra_key=False)
    plan = make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy")
    env = build_env(plan)
    model = _load_zip(plan, tampered, env)
    assert not pwned.exists() and model.observation_space == env.observation_space
    # The control: SB3's own reading of the same entries runs the payload.
    with zipfile.ZipFile(tampered) as archive:
        json_to_data(archive.read("data").decode())
    assert pwned.exists()


@pytest.mark.heavy
def test_the_pickles_of_a_run_dir_load_data_and_run_nothing(tmp_path, monkeypatch):
    import pickle

    from sb3_gpu.runs.saving import load_replay_buffer, load_vecnormalize

    plan = make_plan("ppo", "Acrobot-v1", "cpu", n_envs=2, vec_env="dummy")  # the Acrobot preset normalises
    env = build_env(plan)
    env.reset()
    env.step(np.zeros(2, dtype=int))
    for protocol in (2, 4, pickle.HIGHEST_PROTOCOL):  # SB3 saves with its own protocol, sb3_gpu with the highest
        (tmp_path / "vecnormalize.pkl").write_bytes(pickle.dumps(env, protocol=protocol))
        restored = load_vecnormalize(tmp_path / "vecnormalize.pkl", env.venv)
        np.testing.assert_array_equal(restored.obs_rms.mean, env.obs_rms.mean)
    model = _model("dqn", per=True, learning_starts=0)
    model.learn(64)
    saved = model.replay_buffer
    (tmp_path / "buffer.pkl").write_bytes(pickle.dumps(saved))
    load_replay_buffer(model, tmp_path / "buffer.pkl")
    assert model.replay_buffer is not saved and model.replay_buffer.size() == saved.size() > 0
    assert model.replay_buffer.tree.total == saved.tree.total
    # A buffer saved by sb3_gpu 0.1 names its classes by the top-level module they came from then.
    from sb3_gpu.extensions.per import PrioritizedReplayBuffer, SumMinTree

    for cls in (PrioritizedReplayBuffer, SumMinTree):
        monkeypatch.setattr(cls, "__module__", "sb3_gpu.per")
    old = pickle.dumps(saved)
    monkeypatch.undo()
    assert b"sb3_gpu.per" in old and b"sb3_gpu.extensions.per" not in old
    (tmp_path / "buffer.pkl").write_bytes(old)
    load_replay_buffer(model, tmp_path / "buffer.pkl")
    assert type(model.replay_buffer) is PrioritizedReplayBuffer and model.replay_buffer.tree.total == saved.tree.total
    # A pickle that would create a file when loaded is refused by name, and the file is never created.
    pwned = tmp_path / "pwned"
    for name in ("vecnormalize.pkl", "buffer.pkl"):
        (tmp_path / name).write_bytes(pickle.dumps(_Payload(str(pwned))))
    with pytest.raises(ConfigError, match=r"names pathlib\.Path\.touch, which no VecNormalize statistics file holds"):
        load_vecnormalize(tmp_path / "vecnormalize.pkl", env.venv)
    with pytest.raises(ConfigError, match=r"names pathlib\.Path\.touch, which no replay buffer holds"):
        load_replay_buffer(model, tmp_path / "buffer.pkl")
    assert not pwned.exists()


def test_another_runs_replay_buffer_or_statistics_are_refused_in_one_line(tmp_path):
    # A replay buffer of another env resumed, then failed at its first added step deep in SB3, and the run, saving it
    # as its own, could never resume; VecNormalize statistics of another env failed with SB3's AssertionError.
    import pickle

    from stable_baselines3.common.buffers import ReplayBuffer
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_gpu.runs.saving import load_replay_buffer, load_vecnormalize

    model = _model("dqn")
    acrobot = make_plan("dqn", "Acrobot-v1", "cpu", vec_env="dummy", overrides={"n_envs": 1})
    other_env = build_env(acrobot)
    buffers = {
        "another env's": ReplayBuffer(100, other_env.observation_space, other_env.action_space, n_envs=1),
        "more envs'": ReplayBuffer(100, model.observation_space, model.action_space, n_envs=model.n_envs + 1),
    }
    for what, buffer in buffers.items():
        (tmp_path / "buffer.pkl").write_bytes(pickle.dumps(buffer))
        with pytest.raises(ConfigError, match=r"buffer.pkl holds transitions of \d env\(s\) with observations Box\(") as e:
            load_replay_buffer(model, tmp_path / "buffer.pkl")
        assert "it is another run's buffer (move it away to resume with an empty one)" in str(e.value), what
    # One cut short (a kill or a full disk as it was written) says the same way out.
    whole = pickle.dumps(ReplayBuffer(100, model.observation_space, model.action_space, n_envs=model.n_envs))
    (tmp_path / "buffer.pkl").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=r"buffer.pkl is not a readable replay buffer \(.*\) \(move it away to resume wi"):
        load_replay_buffer(model, tmp_path / "buffer.pkl")
    normalized = VecNormalize(other_env)
    (tmp_path / "vecnormalize.pkl").write_bytes(pickle.dumps(normalized))
    with pytest.raises(ConfigError, match=r"holds statistics of observations Box\(6,\), and the env's are Box\(4,\): they"):
        load_vecnormalize(tmp_path / "vecnormalize.pkl", model.get_env())


def test_a_model_zip_with_a_pickled_entry_the_config_cannot_supply_is_refused(tmp_path):
    tampered, pwned = _tampered_zip(tmp_path, extra_key=True)
    plan = make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy")
    with pytest.raises(ConfigError, match="stores a pickled 'evil' that this run's config cannot supply"):
        _load_zip(plan, tampered, build_env(plan))
    assert not pwned.exists()


# --- one process per run dir -----------------------------------------------------------------------------------------


def test_a_run_dir_in_use_is_refused(tmp_path, capsys):
    plan = make_plan(
        "ppo", "CartPole-v1", "cpu", n_envs=1, n_timesteps=64, vec_env="dummy", overrides={"n_steps": 32, "batch_size": 32}
    )
    train_run(plan, tmp_path, eval_episodes=1, progress=False, report_s=None)
    with RunDir(tmp_path).locked():
        assert train_main(["--resume", str(tmp_path), "--timesteps", "128"]) == 2
    err = capsys.readouterr().err
    assert squashed(f"{tmp_path} is in use by another sb3_gpu process (pid {os.getpid()})") in squashed(err)
    assert not (tmp_path / ".lock").exists()


def test_a_lock_removed_by_the_process_that_held_it_is_not_taken_over(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    stale = os.open(run.lock_file, os.O_RDWR | os.O_CREAT)  # opened just before its holder, finishing, removed it
    run.lock_file.unlink()
    run.lock_file.write_text("")  # and a process that came later made a new one
    monkeypatch.setattr("sb3_gpu.runs.rundir.open_no_follow", lambda path: stale)
    with pytest.raises(ConfigError, match="was in use by another sb3_gpu process that just finished; try again"), run.locked():
        pass
    assert run.lock_file.exists()  # the later process's lock is left alone


@pytest.fixture
def other_process():
    """A live process other than this one: the holder a lock file names."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_what_a_run_at_work_has_not_written_yet_is_refused_saying_so(tmp_path, other_process, capsys):
    run = RunDir(tmp_path)
    (tmp_path / "best_model.zip").write_bytes(b"")  # its first evaluation's best, the final model still to come
    with run.locked():  # a run at work there (this process, as far as the lock can tell): its config not written yet
        assert train_main(["--resume", str(tmp_path)]) == 2
        said = f"cannot resume {tmp_path}: a run is starting there (pid {os.getpid()}) and has not written its config.yaml"
        assert capsys.readouterr().err == f"error: {said}\n"
        with pytest.raises(ConfigError, match=rf"has no model\.zip \(it is still training \(pid {os.getpid()}\)\); which="):
            RunDir.find_model(tmp_path, "final")
    # A killed run's lock file, held by no one, whose pid a live process has by now: the old words.
    run.lock_file.write_text(str(other_process))
    with pytest.raises(ConfigError, match=r"has no model\.zip \(its final save did not happen\)"):
        RunDir.find_model(tmp_path, "final")
    assert train_main(["--resume", str(tmp_path)]) == 2
    assert "it holds no config.yaml; is it a run dir written by sb3_gpu.train?" in capsys.readouterr().err
    # A lock "file" that is a FIFO: asked who holds it, the answer must not wait for a writer.
    run.lock_file.unlink()
    os.mkfifo(run.lock_file)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(run.holder()), daemon=True)
    asking.start()
    asking.join(timeout=30)
    assert answers == [None]


def test_a_pair_replaced_while_evaluate_read_it_is_read_again_and_never_mixed(tmp_path, monkeypatch):
    # A run at work saves a new best (statistics, then model): read between the two, the evaluation would take one
    # model with another's statistics.
    from sb3_gpu.runs import evaluation

    tiny = {"n_envs": 1, "n_steps": 32, "batch_size": 32, "n_timesteps": 64, "normalize": True, "probe": False}
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=0, vec_env="dummy", overrides=tiny)
    train_run(plan, tmp_path, eval_episodes=1, confirm_episodes=0, progress=False, report_s=None)
    run = RunDir(tmp_path)
    real, reads = evaluation.load_plan_model, []

    def saved_meanwhile(plan, path, venv):
        reads.append(venv.obs_rms.count)
        if len(reads) < times:  # the writer's new statistics, then its model, as the model is read
            keep = run.final.vecnormalize.read_bytes()
            atomic_write_bytes(run.final.vecnormalize, keep)
            atomic_write_bytes(run.final.model, run.final.model.read_bytes())
        return real(plan, path, venv)

    monkeypatch.setattr(evaluation, "load_plan_model", saved_meanwhile)
    times = 2
    result = evaluation.evaluate_run(tmp_path, 1, which="final", seed=0)
    assert len(reads) == 2 and result["episodes"] == 1  # read again once, then evaluated
    times, reads = 10, []
    with pytest.raises(ConfigError, match=r"model\.zip was replaced as it was read, 3 times in a row; run again"):
        evaluation.evaluate_run(tmp_path, 1, which="final", seed=0)
    assert len(reads) == 3
    # The statistics file it chose removed as it read it (a kept pair's old ones, once the writer's model is saved).
    real_statistics, tries = evaluation.load_vecnormalize, []

    def removed_meanwhile(path, venv):
        tries.append(path)
        if len(tries) == 1:
            atomic_write_bytes(path, path.read_bytes())
            raise ConfigError(f"{path} is not a readable VecNormalize statistics file (FileNotFoundError)")
        return real_statistics(path, venv)

    monkeypatch.setattr(evaluation, "load_plan_model", real)
    monkeypatch.setattr(evaluation, "load_vecnormalize", removed_meanwhile)
    assert evaluation.evaluate_run(tmp_path, 1, which="final", seed=0)["episodes"] == 1 and len(tries) == 2


def test_a_run_dir_made_by_another_run_between_the_check_and_the_mkdir_is_refused_in_one_line(tmp_path, monkeypatch):
    real = RunDir.check_new

    def raced(requested):
        path = real(requested)
        path.mkdir()  # the other `train --run-dir` of the same name, started at the same moment
        return path

    monkeypatch.setattr(RunDir, "check_new", staticmethod(raced))
    with pytest.raises(ConfigError, match=r"run dir .*/run already exists; choose a new --run-dir"):
        RunDir.create(tmp_path / "run", "ppo", "CartPole-v1")


def test_runs_started_in_the_same_second_get_their_own_default_run_dirs(tmp_path, monkeypatch):
    from datetime import datetime

    from sb3_gpu.runs import rundir

    class Frozen(datetime):  # a script starting several seeds at once: the timestamps are equal
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 8, 3, 0, 0)

    monkeypatch.setattr(rundir, "datetime", Frozen)
    monkeypatch.setattr(RunDir, "DEFAULT_PARENT", tmp_path / "runs")
    made = [RunDir.create(None, "ppo", "ALE/Pong-v5").path for _ in range(3)]
    first = tmp_path / "runs" / "ppo-ALE_Pong-v5-20261208-030000"
    assert made == [first, first.with_name(f"{first.name}-2"), first.with_name(f"{first.name}-3")]


def test_a_lock_file_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    import errno

    class Full:  # the lock file on a full disk: opened and locked, its pid not written
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real(fd, mode)))
    run = RunDir(tmp_path)
    with pytest.raises(OSError, match="No space left on device") as raised, run.locked():
        pass
    assert raised.value.filename == str(run.lock_file)


def test_stop_on_signal_stops_at_the_next_step_then_quits_at_once_and_restores_the_handlers():
    # What they were: a job started in the background by a shell without job control begins with SIGINT ignored.
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopOnSignal()
    with stop:
        assert stop._on_step() is True
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop._on_step() is False
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# --- symbolic links, full disks, damaged zips -------------------------------------------------------------------


def _temp_names(monkeypatch, *names: str) -> None:
    """The random parts of the next temp file names, in order."""
    given = iter(names)
    monkeypatch.setattr("sb3_gpu.common.io.secrets.token_hex", lambda n: next(given))


def test_an_atomic_write_replaces_a_link_and_never_writes_through_one(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "model.zip").symlink_to(victim)
    planted = tmp_path / f".summary.json.tmp-{os.getpid()}-0000aaaa"  # a planted temp name, guessed right
    planted.symlink_to(victim)
    _temp_names(monkeypatch, "1111bbbb", "0000aaaa", "2222cccc")
    atomic_write_bytes(tmp_path / "model.zip", b"new")
    atomic_write_bytes(tmp_path / "summary.json", b"{}")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "model.zip").is_symlink() and (tmp_path / "model.zip").read_bytes() == b"new"
    assert (tmp_path / "summary.json").read_bytes() == b"{}"
    assert [p for p in tmp_path.iterdir() if ".tmp-" in p.name] == [planted]  # passed over, and not ours to remove


def test_an_atomic_write_leaves_another_writers_temp_file_alone(tmp_path, monkeypatch):
    # A writer with the same pid (another container sharing the folder, or this process's other thread) is midway.
    theirs = tmp_path / f".summary.json.tmp-{os.getpid()}-0000aaaa"
    theirs.write_bytes(b"half of their file")
    _temp_names(monkeypatch, "0000aaaa", "1111bbbb")
    atomic_write_bytes(tmp_path / "summary.json", b"{}")
    assert theirs.read_bytes() == b"half of their file"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([theirs.name, "summary.json"])


@pytest.mark.parametrize("hard_links", [True, False], ids=["hard-links", "no-hard-links"])
def test_keep_previous_puts_the_old_file_back_after_a_later_write_fails(tmp_path, monkeypatch, hard_links):
    import errno

    if not hard_links:  # gcsfuse, SMB and the like: a copy keeps it instead

        def refuse(src, dst):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src))

        monkeypatch.setattr("sb3_gpu.common.io.os.link", refuse)
    path = tmp_path / "vecnormalize.pkl"
    path.write_bytes(b"old")
    restore = keep_previous(path)
    atomic_write_bytes(path, b"new")
    restore(True)  # the model's write after it failed
    assert path.read_bytes() == b"old"
    restore = keep_previous(path)
    atomic_write_bytes(path, b"newer")
    restore(False)  # it succeeded
    assert path.read_bytes() == b"newer" and [p.name for p in tmp_path.iterdir()] == [path.name]
    restore = keep_previous(path)  # its own write failed (or was refused): nothing replaced it
    restore(True)
    assert path.read_bytes() == b"newer" and [p.name for p in tmp_path.iterdir()] == [path.name]
    fresh = tmp_path / "best_vecnormalize.pkl"  # none before: a failed pair leaves none
    restore = keep_previous(fresh)
    atomic_write_bytes(fresh, b"new")
    restore(True)
    assert not fresh.exists() and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("pair", ["final", "best"])
def test_statistics_whose_models_write_was_killed_never_pair_with_the_older_model(tmp_path, monkeypatch, pair):
    # The statistics are written, then the model; a SIGKILL (the grace period after SIGTERM, the OOM killer) between
    # the two leaves new statistics beside the old model, and the kept old ones beside them. Resume and evaluate must
    # read the kept ones, and the next save must keep those, not the new ones, for a model write that fails.
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from sb3_gpu.common.io import save_model, save_pickle
    from sb3_gpu.runs import saving

    env = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]))
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=32, n_epochs=1, policy_kwargs={"net_arch": [8]})
    model.learn(32)
    run = RunDir(tmp_path)
    stats, model_zip = (
        (run.final.vecnormalize, run.final.model) if pair == "final" else (run.best_vecnormalize, run.best_model)
    )
    save_pickle(stats, env)
    save_model(model, model_zip)
    paired = stats.read_bytes()
    a_minute_ago = time.time_ns() - 60 * 10**9  # saves are seconds apart at least; file times can be coarser than that
    os.utime(model_zip, ns=(a_minute_ago, a_minute_ago))
    keep_previous(stats)
    env.obs_rms.mean += 1.0
    save_pickle(stats, env)  # ... and the process was killed before the model's write
    assert stats.read_bytes() != paired
    assert run.vecnormalize_for(model_zip).read_bytes() == paired
    if pair == "final":
        (state,) = run.saved_states()
        assert state.vecnormalize is not None and state.vecnormalize.read_bytes() == paired

    def full(model, path):
        raise OSError(28, "No space left on device", str(path))

    if pair == "final":
        monkeypatch.setattr(saving, "save_model", full)
        with pytest.raises(OSError, match="No space left"):
            saving.save_state(model, run.final, replay_buffer=False)
    else:  # a new best: its statistics are written, then its model's write fails
        restore = TimedEvalCallback(env, run_dir=run)._companions_restorer()
        save_pickle(stats, env)
        restore(True)
    assert stats.read_bytes() == paired and run.vecnormalize_for(model_zip) == stats


def test_a_model_whose_own_statistics_are_missing_gets_none_rather_than_another_models(tmp_path):
    run = RunDir(tmp_path)
    run.checkpoints.mkdir()
    checkpoint = run.checkpoint(64)
    for path in (run.best_model, checkpoint.model, run.final.model, run.final.vecnormalize):
        path.write_bytes(b"saved")
    # The final statistics moved on since the best model and the checkpoint were saved: they would scale their
    # observations differently.
    assert run.vecnormalize_for(run.best_model) is None
    assert (
        run.missing_vecnormalize(run.best_model)
        == "it holds no best_vecnormalize.pkl, the statistics saved with best_model.zip"
    )
    assert run.vecnormalize_for(checkpoint.model) is None
    assert checkpoint.vecnormalize.name in run.missing_vecnormalize(checkpoint.model)
    assert run.vecnormalize_for(run.final.model) == run.final.vecnormalize
    copy = tmp_path / "mine.zip"  # a copy of some model: whose statistics it needs is not known
    copy.write_bytes(b"saved")
    assert run.vecnormalize_for(copy) is None and "mine.zip is none of its own models" in run.missing_vecnormalize(copy)
    run.best_vecnormalize.write_bytes(b"best's")
    assert run.vecnormalize_for(run.best_model) == run.best_vecnormalize


def test_keep_previous_never_puts_back_a_copy_cut_short(tmp_path, monkeypatch):
    import errno

    def refuse(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(src))

    def full(src, dst, length=0):
        dst.write(src.read(2))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("sb3_gpu.common.io.os.link", refuse)  # no hard links, and the copy fills the disk
    monkeypatch.setattr("sb3_gpu.common.io.shutil.copyfileobj", full)
    path = tmp_path / "vecnormalize.pkl"
    path.write_bytes(b"old statistics")
    restore = keep_previous(path)
    restore(True)  # the statistics' own write failed on the full disk too: the old file is still there, and stays
    assert path.read_bytes() == b"old statistics" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_failed_model_write_puts_the_previous_statistics_back(tmp_path, monkeypatch):
    import errno

    plan = make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy", overrides={"normalize": True})
    model = build_model(plan, build_env(plan))
    files = RunDir(tmp_path).final
    save_state(model, files, replay_buffer=False)
    saved = files.vecnormalize.read_bytes(), files.model.read_bytes()
    model.get_vec_normalize_env().obs_rms.mean += 1.0  # newer statistics than the saved model's

    def full(model, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("sb3_gpu.runs.saving.save_model", full)
    with pytest.raises(OSError, match="No space left"):
        save_state(model, files, replay_buffer=False)
    assert (files.vecnormalize.read_bytes(), files.model.read_bytes()) == saved  # still a pair
    assert _no_temp_files(tmp_path) and not [p for p in tmp_path.iterdir() if p.name.endswith(".previous")]


def test_nan_rewards_under_vecnormalize_never_save_its_poisoned_statistics(tmp_path):
    # One NaN reward makes the return statistics NaN for good, while the weights may still be finite.
    plan = make_plan(
        "ppo",
        FAULTY,
        "cpu",
        n_envs=2,
        n_timesteps=20_000,
        vec_env="dummy",
        overrides={"normalize": True, "n_steps": 256, "env_kwargs": {"nan_at": 400}},
    )
    with pytest.raises(TrainingDiverged, match="NaN or inf"):
        train_run(plan, tmp_path, eval_freq=100_000, checkpoint_freq=64, progress=False, report_s=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "VecNormalize's ret_rms" in summary["saved"] and "no model was saved" in summary["saved"], summary["saved"]
    states = RunDir(tmp_path).saved_states()
    assert states and all(state.model.name != "model.zip" for state in states)  # checkpoints only
    for state in states:
        stats = load_vecnormalize(RunDir(tmp_path).vecnormalize_for(state.model), build_env(plan).venv)
        assert np.isfinite(stats.ret_rms.var).all() and np.isfinite(stats.obs_rms.mean).all()


def test_a_full_disk_at_the_final_save_says_so_and_names_the_last_complete_model(tmp_path, monkeypatch, capsys):
    import errno

    def full(model, files, replay_buffer):
        raise OSError(errno.ENOSPC, "No space left on device", str(files.model))

    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "128", "--n-envs", "1", "--set", "n_steps=32"]
    args += ["--set", "batch_size=32", "--checkpoint-freq", "64", "--eval-freq", "64", "--eval-episodes", "1"]
    monkeypatch.setattr("sb3_gpu.runs.session.save_state", full)  # checkpoints still save: they call it elsewhere
    assert train_main([*args, "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    model = tmp_path / "run" / "model.zip"
    assert err[0] == f"error: could not write {model}: No space left on device"
    checkpoint = tmp_path / "run" / "checkpoints" / "model_128_steps.zip"
    assert f"the last complete model is {checkpoint} (128 timesteps)" in err[1] and "Traceback" not in "".join(err)
    assert not model.exists()


def test_a_run_whose_every_save_failed_gives_no_resume_command_that_would_be_refused(tmp_path, monkeypatch, capsys):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "model.zip")

    monkeypatch.setattr("sb3_gpu.runs.evaluation.save_model", full)
    monkeypatch.setattr("sb3_gpu.runs.session.save_state", full)
    run = tmp_path / "run"
    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "64", "--n-envs", "1", "--set", "n_steps=32"]
    args += ["--set", "batch_size=32", "--eval-freq", "32", "--eval-episodes", "1", "--confirm-episodes", "0"]
    args += ["--checkpoint-freq", "1000"]  # none: every save the run makes fails
    assert train_main([*args, "--run-dir", str(run), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "no complete model was saved; nothing to resume from (--resume needs model.zip or a checkpoint)" in err
    assert "continue with" not in err
    assert train_main(["--resume", str(run)]) == 2  # what it would have said to run
    assert "holds no readable model.zip or checkpoint" in capsys.readouterr().err


def test_a_disk_too_full_for_the_summary_too_still_says_what_failed_and_where_the_model_is(tmp_path, monkeypatch, capsys):
    import errno

    def full(model, files, replay_buffer):
        raise OSError(errno.ENOSPC, "No space left on device", str(files.model))

    def summary_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "128", "--n-envs", "1", "--set", "n_steps=32"]
    args += ["--set", "batch_size=32", "--checkpoint-freq", "64", "--eval-freq", "64", "--eval-episodes", "1"]
    monkeypatch.setattr("sb3_gpu.runs.session.save_state", full)
    monkeypatch.setattr("sb3_gpu.runs.training.write_json", summary_full)
    run = tmp_path / "run"
    assert train_main([*args, "--run-dir", str(run), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"error: could not write {run / 'summary.json'}: No space left on device"
    checkpoint = run / "checkpoints" / "model_128_steps.zip"
    assert err[1].startswith(f"error: could not write {run / 'model.zip'} (No space left on device); the last complete ")
    assert f"model is {checkpoint} (128 timesteps)" in err[1] and f"-m sb3_gpu.evaluate {run})" in err[1]  # all trained


def test_a_run_that_trained_keeps_its_logs_where_the_disk_filled_before_any_save_and_the_summary(
    tmp_path, monkeypatch, capsys
):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "model.zip")

    def summary_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("sb3_gpu.runs.evaluation.save_model", full)
    monkeypatch.setattr("sb3_gpu.runs.session.save_state", full)
    monkeypatch.setattr("sb3_gpu.runs.training.write_json", summary_full)
    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "64", "--n-envs", "1", "--set", "n_steps=32"]
    args += ["--set", "batch_size=32", "--eval-freq", "1000", "--checkpoint-freq", "1000", "--no-probe"]
    run = tmp_path / "run"
    assert train_main([*args, "--run-dir", str(run), "--no-progress"]) == 1
    assert capsys.readouterr().err.endswith("no complete model was saved; training was complete\n")
    assert list((run / "tb").rglob("events.out.tfevents.*")) and (run / "config.yaml").is_file()  # a look at what ran


@pytest.mark.parametrize("name", ["0", "new/", "run.monitor.csv"])
def test_a_full_disk_on_the_monitor_header_names_the_file_monitor_opened(tmp_path, monkeypatch, name):
    import errno

    import gymnasium as gym
    from stable_baselines3.common.monitor import ResultsWriter

    from sb3_gpu.envs.spec import EnvFactory

    opened, real = [], ResultsWriter.__init__

    def header_full(self, *args, **kwargs):
        real(self, *args, **kwargs)
        opened.append(self.file_handler.name)
        raise OSError(errno.ENOSPC, "No space left on device")  # a write names no file

    monkeypatch.setattr(ResultsWriter, "__init__", header_full)
    monkeypatch.chdir(tmp_path)  # a relative path, as a run dir's
    with pytest.raises(OSError) as raised:
        EnvFactory(lambda: gym.make("CartPole-v1"), os.path.join("monitor", name))()
    assert raised.value.filename == opened[0] and raised.value.errno == errno.ENOSPC


def test_a_full_disk_for_the_monitor_files_is_said_as_a_write_not_as_a_broken_env(tmp_path, monkeypatch, capsys):
    import errno

    from stable_baselines3.common.monitor import ResultsWriter

    real = ResultsWriter.__init__

    def header_full(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")  # a write names no file

    monkeypatch.setattr(ResultsWriter, "__init__", header_full)
    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "64", "--n-envs", "1", "--vec-env", "dummy", "--no-probe"]
    assert train_main([*args, "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 1  # not 2: no bad input
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"error: could not write {os.path.realpath(tmp_path / 'run' / 'monitor' / '0.monitor.csv')}: No space left on device",
        "error: no model was saved",
    ]
    monkeypatch.undo()

    def row_full(self, info):  # the disk fills while training: an episode's row
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ResultsWriter, "write_row", row_full)
    monkeypatch.chdir(tmp_path)  # a relative run dir, as the default runs/...: SB3 names the file by its real path
    assert train_main([*args, "--run-dir", "later", "--no-progress"]) == 1
    err = capsys.readouterr().err
    row_file = os.path.realpath(tmp_path / "later" / "monitor" / "0.monitor.csv")
    assert err.startswith(f"error: could not write {row_file}: No space left on device\n"), err
    assert err.count("\n") == 2 and "model saved to" in err  # and where the model went
    monkeypatch.undo()
    # An env's own write on a full disk (its log on another disk, say) is the env's error, Monitor's frames above it.
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    real_step, steps = CartPoleEnv.step, []

    def own_write_full(self, action):
        steps.append(1)
        if len(steps) > 40:  # after the plan's check of the env
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_step(self, action)

    monkeypatch.setattr(CartPoleEnv, "step", own_write_full)
    assert train_main([*args, "--run-dir", str(tmp_path / "own"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: (evaluation )?env \d raised OSError: \[Errno 28\] No space left on device\n", err), err
    assert "monitor" not in err


def test_a_tensorboard_write_on_a_full_disk_is_one_line_naming_its_folder(tmp_path, monkeypatch, capsys):
    # TensorBoard writes on a thread of its own: Python printed the failure there as a traceback, then the run said
    # "could not write a file".
    import errno

    from tensorboard.compat.tensorflow_stub.io import gfile

    real, writes = gfile.LocalFileSystem.append, []

    def full_after_three(self, *args, **kwargs):
        writes.append(1)
        if len(writes) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", full_after_three)
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    hook = threading.excepthook
    args = ["ppo", "--env", "CartPole-v1", "--timesteps", "2048", "--n-envs", "1", "--set", "n_steps=32"]
    args += ["--set", "batch_size=32", "--vec-env", "dummy", "--no-probe", "--run-dir", str(tmp_path / "run")]
    assert train_main([*args, "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: could not write {tmp_path / 'run' / 'tb' / 'run_1'}: No space left on device", err
    assert err[1].startswith(f"error: model saved to {tmp_path / 'run' / 'model.zip'} at ")
    assert thread_errors == [] and threading.excepthook is hook  # said once, and the hook put back


def test_sessions_training_at_once_put_the_thread_hook_back_when_the_last_ends(monkeypatch):
    from sb3_gpu.runs.session import _tensorboard_errors_raised_once

    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    original = threading.excepthook
    first, second = _tensorboard_errors_raised_once(), _tensorboard_errors_raised_once()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first to start ends first
    assert threading.excepthook is not original
    second.__exit__(None, None, None)
    assert threading.excepthook is original
    # A hook set during one session that chains to the hook it found: the next session must not loop through it.
    seen = []
    with _tensorboard_errors_raised_once():
        found = threading.excepthook
        monkeypatch.setattr(threading, "excepthook", lambda args: seen.append("theirs") or found(args))
    with _tensorboard_errors_raised_once():
        monkeypatch.setattr(threading, "__excepthook__", lambda args: seen.append("python's"))
        failing = threading.Thread(target=lambda: 1 / 0)
        failing.start()
        failing.join()
    assert seen == ["theirs", "python's"]


def test_resume_passes_over_a_damaged_checkpoint_with_a_warning(tmp_path, capsys):
    plan = make_plan(
        "ppo", "CartPole-v1", "cpu", n_envs=1, n_timesteps=64, vec_env="dummy", overrides={"n_steps": 32, "batch_size": 32}
    )
    train_run(plan, tmp_path, eval_episodes=1, progress=False, report_s=None)
    damaged = bytearray((tmp_path / "model.zip").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (tmp_path / "checkpoints" / "model_9999_steps.zip").write_bytes(bytes(damaged))  # "newer" than model.zip
    assert train_main(["--resume", str(tmp_path), "--timesteps", "96", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "warning: skipped" in err and squashed("model_9999_steps.zip is damaged") in squashed(err)
    assert squashed(f"resuming from {tmp_path / 'model.zip'} at 64 timesteps") in squashed(out)


def test_a_zip_whose_data_inflates_past_the_cap_is_refused_before_it_is_read(tmp_path):
    from sb3_gpu.runs.rundir import read_zip_data

    with zipfile.ZipFile(tmp_path / "bomb.zip", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data", b" " * (20 << 20))  # 20 MiB of spaces: a few kilobytes compressed
    with pytest.raises(ConfigError, match="its 'data' member inflates past 16 MiB"):
        read_zip_data(tmp_path / "bomb.zip")


def test_an_unexpected_error_mid_run_prints_its_traceback_its_name_and_the_save_once(tmp_path, monkeypatch, call_main):
    from stable_baselines3 import PPO

    calls = []
    real_train = PPO.train

    def fails_the_second_time(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kaput")
        real_train(self)

    monkeypatch.setattr(PPO, "train", fails_the_second_time)
    run_dir = tmp_path / "run"
    args = ["ppo", "--vec-env", "dummy", "--n-envs", "1", "--set", "n_steps=32", "--set", "batch_size=32"]
    args += ["--set", "probe=false"]
    args += ["--timesteps", "256", "--eval-freq", "1000", "--no-progress", "--run-dir", str(run_dir)]
    result = call_main(train_main, *args)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "in fails_the_second_time" in result.stderr
    tail = result.stderr.strip().splitlines()[-2:]
    assert tail[0] == "error: RuntimeError: kaput", result.stderr
    assert tail[1].startswith(f"error: model saved to {run_dir / 'model.zip'} at 64 timesteps"), result.stderr
    assert result.stderr.count("model saved to") == 1, result.stderr


def test_a_resume_that_another_process_saves_past_before_it_takes_the_lock_is_refused(tmp_path, monkeypatch):
    # It read the newest model, then took the lock the other run had just released: it trained on from an older state
    # and wrote over the newer model.zip.
    from sb3_gpu import make_plan
    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.runs.training import resume_run, train_run

    overrides = {"probe": False, "threads": 1, "n_steps": 64, "batch_size": 64, "n_epochs": 1}
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=0, n_envs=1, vec_env="dummy", n_timesteps=128, overrides=overrides)
    run = tmp_path / "run"
    train_run(plan, run, eval_episodes=1, progress=False, report_s=None)
    locked = RunDir.locked

    def saved_meanwhile(self):
        model = PPO.load(self.final.model, device="cpu")
        model.num_timesteps += 64
        model.save(self.final.model)  # the other process's last save, as it finished
        return locked(self)

    monkeypatch.setattr(RunDir, "locked", saved_meanwhile)
    with pytest.raises(ConfigError, match="run was saved by another sb3_gpu process as this resume began; run it again"):
        resume_run(run, timesteps=512, progress=False, report_s=None)


def test_checkpoints_land_every_checkpoint_freq_env_steps_whatever_the_env_count(tmp_path):
    # The callback is called once per vec step of n_envs env steps: a frequency in calls checkpointed n_envs times
    # less often, and a default of a fifth of the run never before its end with five envs or more.
    tiny = {"n_envs": 4, "n_steps": 32, "batch_size": 32, "n_epochs": 1, "n_timesteps": 512, "probe": False}
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=1, vec_env="dummy", overrides=tiny)
    train_run(plan, tmp_path, checkpoint_freq=128, eval_episodes=1, confirm_episodes=0, progress=False)
    saved = sorted(int(p.stem.split("_")[1]) for p in (tmp_path / "checkpoints").glob("model_*_steps.zip"))
    assert saved[:3] == [128, 256, 384]


def test_a_checkpoint_whose_replay_buffer_was_not_saved_says_so_as_it_is_written(tmp_path, monkeypatch):
    from sb3_gpu.runs import callbacks

    def model_only(model, files, *, replay_buffer):
        save_state(model, files, replay_buffer=False)
        return "its replay buffer was not saved (the disk is full)"

    monkeypatch.setattr(callbacks, "save_state", model_only)
    tiny = {"n_envs": 1, "n_timesteps": 256, "learning_starts": 32, "batch_size": 16, "probe": False, "per": False}
    plan = make_plan("dqn", "CartPole-v1", "cpu", seed=1, vec_env="dummy", overrides=tiny)
    with pytest.warns(RuntimeWarning, match=r"checkpoint .*model_\d+_steps\.zip: its replay buffer was not saved"):
        train_run(
            plan, tmp_path, checkpoint_freq=128, save_replay_buffer=True, eval_episodes=1, confirm_episodes=0, progress=False
        )


def test_a_final_replay_buffer_that_was_not_saved_is_warned_of_by_a_run_that_exits_0(tmp_path, monkeypatch):
    from sb3_gpu.runs import session

    def model_only(model, files, *, replay_buffer):
        save_state(model, files, replay_buffer=False)
        return "the replay buffer was not saved (OSError: [Errno 27] File too large)"

    monkeypatch.setattr(session, "save_state", model_only)
    args = ["dqn", "--env", "CartPole-v1", "--timesteps", "128", "--n-envs", "1", "--set", "learning_starts=32"]
    args += ["--checkpoint-freq", "1000", "--eval-freq", "1000", "--eval-episodes", "1", "--no-probe", "--vec-env", "dummy"]
    said = re.escape(f"{tmp_path / 'run' / 'model.zip'}: the replay buffer was not saved (OSError: [Errno 27]")
    with pytest.warns(RuntimeWarning, match=said + r".*; --resume would start with an empty one"):
        assert train_main([*args, "--save-replay-buffer", "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 0


def test_a_run_dir_moved_and_resumed_reseeds_its_model_and_logs_where_it_now_is(tmp_path, monkeypatch):
    from stable_baselines3.common.base_class import BaseAlgorithm

    from sb3_gpu.planning.build import resumed_seed
    from sb3_gpu.runs import training

    tiny = {"n_envs": 1, "n_steps": 64, "batch_size": 32, "n_epochs": 1, "n_timesteps": 128, "probe": False}
    plan = make_plan("ppo", "CartPole-v1", "cpu", seed=3, vec_env="dummy", overrides=tiny)
    first, moved = tmp_path / "first", tmp_path / "moved"
    train_run(plan, first, eval_episodes=1, confirm_episodes=0, progress=False)
    first.rename(moved)
    seeds: list[int | None] = []
    real = BaseAlgorithm.set_random_seed
    monkeypatch.setattr(BaseAlgorithm, "set_random_seed", lambda self, seed=None: seeds.append(seed) or real(self, seed))
    training.resume_run(moved, timesteps=256, progress=False)
    # The zip holds the seed and the log folder of the run as it was: the resume draws fresh ones and logs here.
    assert resumed_seed(3, 128) in seeds
    assert not first.exists() and len(list((moved / "tb").rglob("events.out.tfevents.*"))) >= 2


def test_a_replay_buffer_saved_on_another_device_samples_onto_the_resuming_models(tmp_path):
    import pickle

    from sb3_gpu.runs.saving import load_replay_buffer

    tiny = {"n_envs": 1, "n_timesteps": 64, "learning_starts": 16, "batch_size": 16, "probe": False, "per": False}
    plan = make_plan("dqn", "CartPole-v1", "cpu", seed=1, vec_env="dummy", overrides=tiny)
    model = build_model(plan, build_env(plan))
    model.learn(64)
    model.replay_buffer.device = th.device("cuda")  # as a run on a GPU machine saved it; this one resumes on the CPU
    path = tmp_path / "replay_buffer.pkl"
    path.write_bytes(pickle.dumps(model.replay_buffer))
    load_replay_buffer(model, path)
    assert model.replay_buffer.device == model.device == th.device("cpu")
    assert model.replay_buffer.sample(4).observations.device == th.device("cpu")


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("algo", "eval_freq", "nan_at", "where"),
    [
        ("sac", 100_000, 300, "in training at 300 timesteps"),
        # sb3_gpu's TQC collects without torch's argument checks: its NaN action went to the env, and the run stopped
        # later on a NaN gradient. The step's own observations are checked now, the terminal one (step 200) too.
        ("tqc", 100_000, 300, "in training at 300 timesteps"),
        ("tqc", 100_000, 200, "in training at 200 timesteps"),
        ("tqc", 100_000, "reset", "in training at 0 timesteps"),  # the first reset's: stored, then sampled
        ("ppo", 100, 300, r"in an evaluation at \d+ timesteps"),
    ],
)
def test_a_nan_observation_is_said_as_such_and_the_model_before_it_saved(tmp_path, algo, eval_freq, nan_at, where):
    # SB3's distributions refuse NaN parameters, in a message about a tensor's constraint (Normal's loc, Categorical's
    # logits) that named no observation. The eval env's steps run ahead of training's: 200 per evaluation.
    env_kwargs = {"what": "reset"} if nan_at == "reset" else {"nan_at": nan_at, "what": "observation"}
    overrides = {"net_arch": [16], "env_kwargs": env_kwargs, "compile": "false", "amp": "off"}
    overrides.update({"n_envs": 1, "n_steps": 64} if algo == "ppo" else {"learning_starts": 100, "batch_size": 32})
    plan = make_plan(algo, "tests.fault_envs:NanPendulum", "cpu", n_timesteps=2_000, vec_env="dummy", overrides=overrides)
    message = rf"^the policy was given a NaN or inf observation {where}: an env returned it"
    with pytest.raises(TrainingDiverged, match=message):
        train_run(plan, tmp_path, eval_freq=eval_freq, eval_episodes=1, confirm_episodes=0, progress=False, report_s=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"].startswith("TrainingDiverged: the policy was given a NaN") and summary["model"]
    assert first_non_finite(_load(tmp_path, tmp_path / "model.zip").policy) is None


def test_only_a_distributions_refusal_is_taken_for_a_nan_observation():
    # Any error whose traceback had a local `obs` holding NaN (a user's callback masking readings) was said to be one,
    # its own traceback lost.
    from sb3_gpu.runs.callbacks import non_finite_input

    def raising(error: Exception) -> Exception:
        obs = np.array([np.nan, 1.0], np.float32)  # noqa: F841 (a frame's local, as a policy's or a callback's)
        try:
            raise error
        except Exception as e:
            return e

    refused = raising(
        ValueError("Expected parameter loc (Tensor of shape (1, 1)) of distribution Normal to satisfy the constraint Real()")
    )
    assert "NaN or inf observation in training" in str(non_finite_input(refused, 64))
    # sb3_gpu's PPO collects with torch's argument checks off: the categorical's draw refuses the NaN instead.
    drawn = raising(RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"))
    assert "NaN or inf observation in training" in str(non_finite_input(drawn, 64))
    assert non_finite_input(raising(AttributeError("no attribute 'unknown_attr'")), 64) is None
    assert non_finite_input(raising(ValueError("shapes do not match")), 64) is None


def test_a_model_zip_beside_its_config_is_found_and_a_pick_by_name_is_refused_for_it(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    for path in (run / "model.zip", run / "best_model.zip"):
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("data", "{}")
        found, run_dir = RunDir.find_model(path)
        assert found == path and run_dir.path == run  # evaluate runs/x/model.zip: the folder it is in
    for which in ("best", "final"):
        with pytest.raises(ConfigError, match=rf"which='{which}' picks a model in a run dir; .*model\.zip names one already"):
            RunDir.find_model(run / "model.zip", which)
    # A zip with no step count is passed over, and said to be.
    shutil.copy(run / "model.zip", run / "checkpoints" / "model_64_steps.zip")
    skipped: list[str] = []
    assert RunDir(run).saved_states(on_skip=skipped.append) == []
    assert [line.endswith("it records no num_timesteps") for line in skipped] == [True, True]


def test_an_empty_monitor_file_of_an_earlier_segment_is_left_alone_on_a_resume_from_a_checkpoint(tmp_path):
    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "0.seg1.monitor.csv").write_text("")  # a run killed before Monitor wrote its header
    assert RunDir(tmp_path).set_episodes_aside_after(1e9) == 0


def test_a_run_dir_tensorboard_cannot_name_is_refused_before_a_resume(tmp_path):
    run = tmp_path / b"run\xff".decode("utf-8", "surrogateescape")  # bytes that are no UTF-8, as Linux's argv gives them
    try:
        run.mkdir()
    except (OSError, UnicodeEncodeError):  # a file system that takes UTF-8 names only (macOS)
        pytest.skip("this file system refuses names that are no UTF-8")
    (run / "config.yaml").write_text("algo: ppo\n")
    with pytest.raises(ConfigError, match=r"^cannot use run dir '.*run\\udcff': its name is not valid UTF-8"):
        RunDir(run).check_resumable()
