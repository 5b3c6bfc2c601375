"""``python -m sb3_gpu.tune``: studies on SQLite, a journal file and PostgreSQL, shared by workers, resumed."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna", reason="tuning needs the [tune] extra")

from sb3_gpu import tune  # noqa: E402
from sb3_gpu.common.errors import ConfigError  # noqa: E402
from sb3_gpu.config.search import load_space  # noqa: E402
from sb3_gpu.planning.plan import make_plan  # noqa: E402
from sb3_gpu.runs.threshold import ThresholdRun  # noqa: E402
from sb3_gpu.tuning import storage as tuning_storage  # noqa: E402
from sb3_gpu.tuning import study as tuning  # noqa: E402
from tests.conftest import REPO, disk_full, run_cli  # noqa: E402

TINY_SPACE = REPO / "tests" / "cli" / "tiny_ppo_space.yaml"
TINY = ["--timesteps", "512", "--eval-episodes", "2", "--vec-env", "dummy", "--device", "cpu", "--space", str(TINY_SPACE)]


def load(storage: str, name: str = "ppo-CartPole-v1"):
    return optuna.load_study(study_name=name, storage=tuning_storage.make_storage(storage, 60))


def finished(study):
    return [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]


@pytest.mark.heavy
def test_a_tiny_study_exports_a_preset_that_train_accepts(tmp_path):
    out = run_cli("sb3_gpu.tune", "ppo", "--trials", "3", "--study-dir", str(tmp_path), *TINY, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "3 of 3" not in out.stdout and "best preset:" in out.stdout
    assert re.search(r"^trial 2, seed 0: mean return \d+\.\d$", out.stdout, re.M), out.stdout  # progress as seeds end
    study = load(f"sqlite:///{tmp_path / 'study.db'}")
    assert len(finished(study)) == 3 and study.best_trial.user_attrs["seed_scores"]
    preset = tmp_path / "best_preset.yaml"
    text = preset.read_text()
    assert text.startswith("# Tuned by python -m sb3_gpu.tune ppo") and "CartPole-v1:" in text
    for key, value in study.best_trial.params.items():
        assert key in text, (key, value)
    trained = run_cli(
        "sb3_gpu.train",
        "ppo",
        "--preset",
        str(preset),
        "--timesteps",
        "512",
        "--no-progress",
        "--run-dir",
        str(tmp_path / "run"),
        "--eval-episodes",
        "2",
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stderr
    assert (tmp_path / "run" / "model.zip").is_file()
    # Running the command again with a higher target resumes the same study.
    again = run_cli("sb3_gpu.tune", "ppo", "--trials", "4", "--study-dir", str(tmp_path), *TINY, cwd=tmp_path)
    assert again.returncode == 0 and "3 of 4 trials finished" in again.stdout
    assert len(finished(load(f"sqlite:///{tmp_path / 'study.db'}"))) == 4


def _workers(storage: str, tmp_path: Path, trials: int, n: int = 2) -> list[subprocess.CompletedProcess[str]]:
    cmd = [sys.executable, "-m", "sb3_gpu.tune", "ppo", "--trials", str(trials), "--storage", storage]
    cmd += ["--study-dir", str(tmp_path), "--sampler", "random", "--pruner", "none", *TINY]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(n)
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in procs]


def _check_shared(storage: str, trials: int):
    study = load(storage)
    done = finished(study)
    # Each worker stops once the study has `trials` finished ones; both may have been mid-trial at that moment.
    assert trials <= len(done) <= trials + 1
    assert len({t.user_attrs["worker"] for t in done}) == 2, "both workers must have run trials"


@pytest.mark.heavy
def test_two_workers_share_one_study_on_a_journal_file(tmp_path):
    storage = f"journal:{tmp_path / 'journal.log'}"
    for out in _workers(storage, tmp_path, trials=6):
        assert out.returncode == 0, out.stderr
    _check_shared(storage, 6)


def _heartbeat_ages(db: Path) -> list[float]:
    """Seconds since each trial's last heartbeat, by the database's own clock (optuna's staleness check uses it)."""
    if not db.exists():
        return []
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as connection:
        try:
            rows = connection.execute(
                "SELECT (julianday(CURRENT_TIMESTAMP) - julianday(heartbeat)) * 86400.0 FROM trial_heartbeats"
            ).fetchall()
        except sqlite3.OperationalError:  # optuna has not made its tables yet
            return []
    return [float(age) for (age,) in rows]


def _poll(condition, what: str, proc: subprocess.Popen | None = None, stderr: Path | None = None) -> None:
    """Wait for ``condition``; fail at once, with its stderr, where the worker ``proc`` ended first. The deadline only
    guards against a hang: a loaded CI machine takes many times an idle one's start-up (imports, planning)."""
    timeout = 600.0
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            said = stderr.read_text()[-3000:] if stderr is not None and stderr.exists() else ""
            pytest.fail(f"the worker ended (exit code {proc.returncode}) before {what}:\n{said}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen in {timeout} s")
        time.sleep(0.2)


@pytest.mark.heavy
def test_a_killed_worker_leaves_a_failed_trial_and_the_study_goes_on(tmp_path):
    db = tmp_path / "study.db"
    storage = f"sqlite:///{db}"
    base = ["--storage", storage, "--study-dir", str(tmp_path), "--heartbeat", "1", *TINY]
    base += ["--env", "tests.fault_envs:SlowCartPoleV1", "--study-name", "ppo-CartPole-v1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The same settings (a study refuses a worker that would score another way), on an env slow in this worker alone.
    long_trial = [sys.executable, "-m", "sb3_gpu.tune", "ppo", "--trials", "1", *base]
    slow = {**env, "SB3_GPU_TEST_STEP_SLEEP": "0.5"}
    stderr = tmp_path / "worker.err"
    with stderr.open("w") as err:
        proc = subprocess.Popen(long_trial, cwd=tmp_path, env=slow, stdout=subprocess.DEVNULL, stderr=err)
    try:
        _poll(lambda: _heartbeat_ages(db), "the worker's first heartbeat", proc, stderr)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # Stale once no heartbeat came for longer than the grace period (two heartbeats of 1 s).
    _poll(lambda: min(_heartbeat_ages(db)) > 2.0, "the dead worker's trial going stale")
    quick = [sys.executable, "-m", "sb3_gpu.tune", "ppo", "--trials", "1", *base]
    out = subprocess.run(quick, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    states = [t.state for t in load(storage).trials]
    assert states.count(optuna.trial.TrialState.FAIL) == 1 and states.count(optuna.trial.TrialState.COMPLETE) == 1


@pytest.mark.heavy
def test_sigint_stops_the_running_trial_marks_it_failed_and_ends_the_worker(tmp_path):
    db = tmp_path / "study.db"
    storage = f"sqlite:///{db}"
    cmd = [sys.executable, "-m", "sb3_gpu.tune", "ppo", "--trials", "1", *TINY, "--timesteps", "200000"]
    cmd += ["--storage", storage, "--study-dir", str(tmp_path), "--heartbeat", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    stderr = tmp_path / "worker.err"
    with stderr.open("w") as err_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err_file, text=True)
    try:
        _poll(lambda: _heartbeat_ages(db), "the worker's first heartbeat", proc, stderr)  # a trial is training
    finally:
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    err = stderr.read_text()
    assert proc.returncode == 130, err
    # "stopped by SIGINT in trial 0" once training began; "interrupted" while the trial was still building its model.
    assert re.search(r"error: (stopped by SIGINT in trial 0|interrupted); a running trial was marked failed\.", err), err
    assert "Traceback" not in err
    assert [t.state for t in load(storage).trials] == [optuna.trial.TrialState.FAIL]


def test_sigterm_while_a_trial_builds_marks_it_failed_and_ends_the_worker_with_143(tmp_path, monkeypatch, capsys):
    # Before a trial's training installs its own handlers (planning, building envs): a preempted node or docker stop.
    def objective(trial):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises inside the sleep
        return 0.0

    monkeypatch.setattr(tuning, "make_objective", lambda settings, space: objective)
    storage = f"sqlite:///{tmp_path / 'study.db'}"

    def unhandled(signum, frame):  # where tune's own handler is missing, this test fails instead of pytest ending
        raise AssertionError("SIGTERM reached the handler tune should have replaced")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert tune.main(["ppo", "--trials", "1", *TINY, "--storage", storage, "--study-dir", str(tmp_path)]) == 143
        assert signal.getsignal(signal.SIGTERM) is unhandled  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert "error: stopped by SIGTERM; a running trial was marked failed." in err and "Traceback" not in err
    assert [t.state for t in load(storage).trials] == [optuna.trial.TrialState.FAIL]

    # Between trials, outside any: counting the finished ones, say.
    monkeypatch.setattr(tuning, "finished_trials", lambda study: os.kill(os.getpid(), signal.SIGTERM) or time.sleep(30))
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert tune.main(["ppo", "--trials", "1", *TINY, "--storage", storage, "--study-dir", str(tmp_path)]) == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert err == "error: stopped by SIGTERM; run the same command to go on\n"


def test_a_stop_that_optuna_fails_to_record_still_marks_the_trial_failed_and_exits_as_stopped(tmp_path, monkeypatch, capsys):
    # A signal that lands inside a storage write (the trial's first parameters, say) can leave the worker's connection
    # unusable: optuna's own FAIL record then raises, and its bookkeeping ends in an AssertionError of its own.
    def objective(trial):
        raise tuning.TrialInterrupted("SIGINT", trial.number)

    monkeypatch.setattr(tuning, "make_objective", lambda settings, space: objective)
    record = optuna.storages.RDBStorage.set_trial_state_values
    broken = []

    def cut_short(self, trial_id, state, values=None):
        if state == optuna.trial.TrialState.FAIL and not broken:
            broken.append(self)
            raise RuntimeError("This Session's transaction has been rolled back due to a previous exception")
        return record(self, trial_id, state, values)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", cut_short)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    assert tune.main(["ppo", "--trials", "1", *TINY, "--storage", storage, "--study-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "error: stopped by SIGINT in trial 0; a running trial was marked failed." in err and "Traceback" not in err
    assert broken and [t.state for t in load(storage).trials] == [optuna.trial.TrialState.FAIL]


def test_failed_and_invalid_trials_are_tried_again_until_the_study_has_its_trials(tmp_path, monkeypatch, call_main):
    space = load_space("ppo", TINY_SPACE)

    def objective(trial):  # trials 0 and 2 fail (a NaN, out of memory), 3 draws an invalid combination
        params = tuning.sample(trial, space)
        if trial.number in (0, 2):
            raise RuntimeError("CUDA out of memory")
        if trial.number == 3:
            trial.set_user_attr("invalid", "batch_size > n_steps * n_envs")
            raise optuna.TrialPruned("invalid combination")
        return params["learning_rate"]

    monkeypatch.setattr(tuning, "make_objective", lambda settings, space: objective)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    out = call_main(tune.main, "ppo", "--trials", "3", *TINY, "--storage", storage, "--study-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    states = [t.state for t in load(storage).trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3 and len(states) == 6
    assert tuning.finished_trials(load(storage)) == 3  # the invalid one counts for nothing
    assert (tmp_path / "best_preset.yaml").is_file()
    assert "3 complete, 2 fail, 1 invalid" in out.stdout  # not "1 pruned": the pruner stopped none
    assert "3 complete, 2 fail, 1 invalid" in (tmp_path / "summary.md").read_text()


def test_a_worker_whose_trials_all_fail_stops_after_as_many_in_a_row_as_asked_ten_at_least_and_says_so(
    tmp_path, monkeypatch, call_main
):
    def objective(trial):
        trial.set_user_attr("invalid", "one rollout is more than the budget")
        raise optuna.TrialPruned("invalid combination")

    monkeypatch.setattr(tuning, "make_objective", lambda settings, space: objective)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    out = call_main(tune.main, "ppo", "--trials", "2", *TINY, "--storage", storage, "--study-dir", str(tmp_path))
    assert out.returncode == 1, out.stderr
    # Ten at the least: with as few as --trials, one or two unlucky draws of a half-valid space ended a short study.
    assert "error: this worker stopped after 10 trials in a row that failed or drew an invalid combination" in out.stderr
    assert "the study has 0 of 2 trials finished" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: this worker stopped after")  # last, below the results
    assert len(load(storage).trials) == 10
    # The same command tries again (the invalid ones are no results that would end the study).
    out = call_main(tune.main, "ppo", "--trials", "2", *TINY, "--storage", storage, "--study-dir", str(tmp_path))
    assert "0 of 2 trials finished; this worker joins in" in out.stdout and len(load(storage).trials) == 20


def test_an_env_that_raises_while_tune_plans_is_its_traceback_and_one_line_and_exit_1(tmp_path, monkeypatch, call_main):
    def broken(*args, **kwargs):  # the env's reset or step, as the plan's probe meets it
        raise RuntimeError("flaky env broke")

    monkeypatch.setattr("sb3_gpu.planning.plan.probe_env", broken)
    out = call_main(tune.main, "ppo", "--trials", "1", *TINY, "--study-dir", str(tmp_path / "study"))
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == "error: RuntimeError: flaky env broke", out.stderr
    assert out.stderr.startswith("Traceback") and "in broken" in out.stderr  # the env's code, as train shows it
    assert not (tmp_path / "study").exists()


def test_trials_of_equal_scores_rank_as_optuna_picks_the_best_one():
    study = optuna.create_study(direction="maximize")
    for value in (500.0, 120.0, 500.0, 500.0):  # CartPole's cap, reached by several trials
        study.add_trial(optuna.trial.create_trial(value=value, params={}, distributions={}))
    assert [t.number for t, _ in tuning.ranked_trials(study, 4)] == [0, 2, 3, 1]
    assert study.best_trial.number == 0  # what export_preset exports: first in the table too


def test_threads_reach_each_trials_plan_under_their_own_flag(monkeypatch):
    seen = []

    def plan_only(*args, overrides, override_source, **kwargs):
        seen.append((overrides, override_source))
        raise ConfigError("stop here")  # the trial is pruned as an invalid combination

    monkeypatch.setattr(tuning, "make_plan", plan_only)
    args = tune.build_parser().parse_args(["ppo", *TINY, "--threads", "1"])
    study = optuna.create_study(direction="maximize")
    study.optimize(tuning.make_objective(tune.settings_from_args(args), load_space("ppo", TINY_SPACE)), n_trials=1)
    ((overrides, sources),) = seen
    assert overrides["threads"] == 1 and sources["threads"] == "--threads" and sources["n_steps"] == "search space"


def test_the_pruner_stops_a_trial_through_the_eval_callback(tmp_path):
    class AlwaysPrune(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return True

    args = tune.build_parser().parse_args(["ppo", *TINY, "--eval-freq", "128"])
    study = optuna.create_study(direction="maximize", pruner=AlwaysPrune())
    study.optimize(tuning.make_objective(tune.settings_from_args(args), load_space("ppo", TINY_SPACE)), n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert list(trial.intermediate_values) == [128]  # reported once, then stopped


def test_a_trial_stopped_in_its_second_seed_keeps_the_first_seeds_score(tmp_path):
    class PruneInSecondSeed(optuna.pruners.BasePruner):
        def prune(self, study, trial):  # seed 1 reports from step 512 + 128 on (each seed's steps follow the last's)
            return max(trial.intermediate_values) > 512

    args = tune.build_parser().parse_args(["ppo", *TINY, "--eval-freq", "128", "--seeds", "2"])
    study = optuna.create_study(direction="maximize", pruner=PruneInSecondSeed())
    study.optimize(tuning.make_objective(tune.settings_from_args(args), load_space("ppo", TINY_SPACE)), n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert len(trial.user_attrs["seed_scores"]) == 1  # seed 0 finished and was stored; seed 1 was cut short


def test_each_seed_reports_at_steps_of_its_own_though_a_rollout_carries_a_seed_past_its_budget(tmp_path):
    # 8 envs of 32 steps: a rollout is 256 env steps, so a budget of 384 trains to 512 (SB3 completes a rollout) and
    # seed 0 reports at 512. Seed 1 must not report at that step too: optuna would keep the first and drop the other.
    space = tmp_path / "space.yaml"
    space.write_text("n_steps: {choices: [32]}\nn_epochs: {choices: [1]}\n")
    tiny = ["--eval-episodes", "1", "--vec-env", "dummy", "--device", "cpu", "--space", str(space)]
    args = tune.build_parser().parse_args(["ppo", *tiny, "--timesteps", "384", "--eval-freq", "128", "--seeds", "2"])
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is already reported")  # optuna drops a second report at one step
        study.optimize(tuning.make_objective(tune.settings_from_args(args), load_space("ppo", space)), n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    steps = sorted(trial.intermediate_values)
    assert len(steps) == 2 * 4 and steps[3] == 512  # each seed's four evaluations, the last past the budget


def test_a_seed_that_never_reaches_the_threshold_ranks_behind_a_slower_one_that_does():
    # Trials train at different speeds: one three times faster that never gets there must still score worse.
    fast_never = ThresholdRun(reached=False, timesteps=2048, train_seconds=30.0, best=12.0)
    slow_reached = ThresholdRun(reached=True, timesteps=1024, train_seconds=90.0, best=480.0)
    assert -fast_never.cost_seconds < -slow_reached.cost_seconds
    line = tuning.seed_progress(3, 1, -fast_never.cost_seconds, False, 475.0)
    assert line == "trial 3, seed 1: never reached 475 in 30.0 s of training (scored behind every seed that reached it)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sampler", "cmaes"], "argument --sampler: invalid choice: 'cmaes'"),
        # bench's --seeds lists seeds; tune's counts them, and says so to someone who listed them.
        (
            ["--seeds", "0"],
            "--seeds: expected how many seeds each trial trains (a positive integer; the first seed is --seed)",
        ),
        (["--pruner", "hyperband"], "argument --pruner: invalid choice: 'hyperband'"),
        (
            ["--storage", "postgresql://tuner:s3cret@127.0.0.1:1/optuna"],
            "cannot open storage postgresql://tuner:***@127.0.0.1:1/optuna",
        ),
        (  # a password holding "/", an empty user name, a password in the query: none of them printed
            ["--storage", "postgresql://tuner:s3cret/x@127.0.0.1:1/optuna"],
            "cannot open storage postgresql://tuner:***@127.0.0.1:1/optuna",
        ),
        (["--storage", "postgresql://:s3cret@127.0.0.1:1/optuna"], "cannot open storage postgresql://:***@127.0.0.1:1"),
        (
            ["--storage", "postgresql://tuner@127.0.0.1:1/optuna?password=s3cret&sslmode=disable"],
            "cannot open storage postgresql://tuner@127.0.0.1:1/optuna?password=***&sslmode=disable",
        ),
        (["--storage", "study.db"], "storage 'study.db' is not a URL"),
        (["--storage", "sqlite://"], "storage 'sqlite://' is an in-memory database, which workers cannot share"),
        (["--storage", "sqlite:///:memory:"], "is an in-memory database, which workers cannot share; give sqlite:///FILE"),
        (["--study-name", "../../escape"], "--study-name '../../escape': it names a folder under tune/; accepted: letters"),
        (["--study-name", ".."], "--study-name '..': it names a folder under tune/"),
        (
            ["--timesteps", "2048", "--eval-freq", "4096", "--threshold", "100"],
            "--eval-freq 4,096 is above the 2,048 timesteps of each seed: no evaluation could see --threshold reached",
        ),
        (["--storage", "foo://bar"], "cannot open storage foo://bar: Can't load plugin: sqlalchemy.dialects:foo (accepted: "),
        (["--env", "CartPol-v1"], "did you mean 'CartPole-v1'"),
        (["--seed", "4294967295", "--seeds", "2"], "would train seed 4,294,967,296; seeds stop at 2**32 - 1"),
        (["--storage", "journal:"], "storage 'journal:': journal:PATH names a file to write, and . is a folder"),
        (["--storage", "journal:sub"], "storage 'journal:sub': journal:PATH names a file to write, and sub is a folder"),
        (["--storage", "journal:notes.txt/j.log"], "cannot create the journal's folder notes.txt: a file is in the way"),
        (["--storage", "sqlite:///notes.txt/s.db"], "cannot create the database's folder notes.txt: a file is in the way"),
        # A file that is no journal: optuna's JSONDecodeError and its traceback, exit 1.
        (["--storage", "journal:readme.txt"], "storage 'journal:readme.txt': readme.txt is not an optuna journal (its first"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message, monkeypatch, call_main):
    monkeypatch.chdir(tmp_path)
    # Some inputs are judged after the plan, whose probe times a compiled step on a loaded machine and says so on
    # stderr: not what these cases are about.
    monkeypatch.setattr("sb3_gpu.planning.plan.compiles_auto", lambda device: False)
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "readme.txt").write_text("hello\n")
    out = call_main(tune.main, "ppo", "--study-dir", str(tmp_path / "study"), *args)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "s3cret" not in out.stdout + out.stderr
    assert not (tmp_path / "study").exists()  # a study that cannot open leaves no empty study dir behind


def test_a_misspelt_policy_kwargs_key_in_a_space_is_refused_before_the_study_opens(tmp_path, monkeypatch, call_main):
    # Loading cannot check it (the policy is the plan's): each trial would fail it, after the study was made.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.yaml").write_text("policy_kwargs.orth_init: {choices: [true, false]}\n")
    out = call_main(tune.main, "ppo", "--study-dir", str(tmp_path / "study"), *TINY[:-1], "space.yaml")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith(
        "error: space.yaml, key policy_kwargs.orth_init: policy_kwargs of MlpPolicy: unknown key 'orth_init'; did you "
        "mean 'ortho_init'"
    )
    assert not (tmp_path / "study").exists()


def test_a_study_dir_that_is_a_file_or_holds_a_link_is_refused_in_one_line(tmp_path, monkeypatch, call_main):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("keep")
    out = call_main(tune.main, "ppo", "--study-dir", "notes.txt", *TINY)
    assert out.returncode == 2 and out.stderr.strip() == "error: cannot create study dir notes.txt: a file is in the way"
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "study.db").symlink_to(tmp_path / "notes.txt")
    out = call_main(tune.main, "ppo", "--study-dir", "study", *TINY)
    assert out.returncode == 2 and "study/study.db is a symbolic link" in out.stderr
    assert (tmp_path / "notes.txt").read_text() == "keep"


def test_optunas_lock_on_a_journal_file_is_no_link_to_refuse_and_look_alikes_are(tmp_path):
    # A worker that starts while another holds the journal's lock finds optuna's link beside the file: two workers on
    # one journal file raced into a refused study dir. Links that only look like the lock are still refused.
    from optuna.storages.journal import JournalFileSymlinkLock

    from sb3_gpu.common.io import refuse_links

    journal = tmp_path / "journal.log"
    allowed = tuning_storage.journal_lock(f"journal:{journal}")
    lock = JournalFileSymlinkLock(str(journal))
    assert lock.acquire() and (tmp_path / "journal.log.lock").is_symlink()
    (tmp_path / "journal.log.lock0f3a.rename").symlink_to(str(journal))  # a lock on its way out
    refuse_links(tmp_path, "study dir", allowed=allowed)
    lock.release()
    for name, target in (("journal.log.lock", tmp_path / "victim"), ("best_preset.yaml", journal)):
        (tmp_path / name).symlink_to(target)
        with pytest.raises(ConfigError, match=f"{name} is a symbolic link"):
            refuse_links(tmp_path, "study dir", allowed=allowed)
        (tmp_path / name).unlink()
    with pytest.raises(ConfigError, match="rename is a symbolic link"):  # no journal: no lock to allow
        refuse_links(tmp_path, "study dir", allowed=tuning_storage.journal_lock(f"sqlite:///{tmp_path / 'study.db'}"))


@pytest.mark.heavy
def test_a_worker_that_starts_while_another_holds_the_journal_lock_waits_for_it(tmp_path, call_main):
    import threading

    from optuna.storages.journal import JournalFileSymlinkLock

    journal = tmp_path / "journal.log"
    lock = JournalFileSymlinkLock(str(journal))
    assert lock.acquire()  # as another worker's, while this one checks its study dir
    release = threading.Timer(4.0, lock.release)
    release.start()
    try:
        storage = ["--storage", f"journal:{journal}", "--study-dir", str(tmp_path)]
        out = call_main(tune.main, "ppo", "--trials", "1", *storage, *TINY)
    finally:
        release.join()
    assert out.returncode == 0, out.stderr
    assert len(finished(load(f"journal:{journal}"))) == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rat: {low: 1.0e-5, high: 1.0e-3}", "unknown key 'learning_rat'.*did you mean 'learning_rate'"),
        ("gamma: {low: 0.9, high: 1.5}", "gamma"),
        ("n_steps: {choices: []}", "non-empty list"),
        ("n_steps: {lo: 1, high: 2}", "did you mean 'low'"),
        ("buffer_size: {choices: [1000]}", "'buffer_size' is for off-policy"),
        ("learning_rate: {low: 0, high: 1, log: true}", "low > 0 with log"),
        ("learning_rate: {low: 1.0e-5, high: 1, log: 'false'}", "'log' is true or false, got 'false'"),
        # The key is named before its spec's shape is judged.
        ("learning_rat: 3.0e-4", "unknown key 'learning_rat'.*did you mean 'learning_rate'"),
        ("per.alpha: {low: 0.4, high: 0.8}", "'per' is for off-policy algorithms"),
        ("n_timesteps: {choices: [100, 200]}", "n_timesteps cannot be searched: each trial trains --timesteps"),
        # Each trial's plan refuses the pair: every trial was pruned.
        (
            "policy_kwargs: {choices: [{ortho_init: true}]}\npolicy_kwargs.ortho_init: {choices: [false]}",
            "policy_kwargs.ortho_init and a choice of policy_kwargs both set policy_kwargs.ortho_init; search it in one place",
        ),
    ],
)
def test_search_space_keys_and_values_are_checked_like_presets(tmp_path, text, message):
    path = tmp_path / "space.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_space("ppo", path)


@pytest.mark.parametrize("algo", ["ppo", "dqn", "qrdqn", "sac", "td3", "tqc"])
def test_bundled_search_spaces_load(algo):
    assert load_space(algo)


@pytest.mark.parametrize("path", sorted(Path(REPO, "benchmarks", "tuning").glob("*.space.yaml")), ids=lambda p: p.name)
def test_the_search_spaces_behind_the_tuning_records_still_load(path):
    # Each records the study that tuned (or tested) a preset entry, and must stay a space tune would run.
    algo = path.name.split("-")[0]
    assert load_space(algo, path)


def _draws(tmp_path, text: str) -> list[dict]:
    """Twenty draws of a DQN search space written as ``text``, by a seeded random sampler."""
    path = tmp_path / "space.yaml"
    path.write_text(text)
    space = load_space("dqn", path)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    return [tuning.sample(study.ask(), space) for _ in range(20)]


def test_a_dotted_key_listed_before_its_whole_is_still_skipped_where_the_whole_draws_false(tmp_path):
    # Drawn in the file's order, per.alpha came before per: a trial drawing per=false kept per.alpha, and its plan
    # refused the pair.
    drawn = _draws(tmp_path, "per.alpha: {low: 0.4, high: 0.8}\nper: {choices: [true, false]}\n")
    assert {d["per"] for d in drawn} == {True, False}
    assert all(("per.alpha" in d) == d["per"] for d in drawn)


def test_a_range_draws_values_of_its_keys_type_however_its_bounds_are_written(tmp_path):
    # YAML reads 1.0e+6 as a float and 0 as an int: the key decides, or every trial would be refused (a buffer size of
    # 52345.6) or a coefficient drawn only at 0 and 1.
    drawn = _draws(tmp_path, "buffer_size: {low: 10000, high: 1.0e+6, log: true}\nexploration_fraction: {low: 0, high: 1}\n")
    path = tmp_path / "space.yaml"
    assert all(type(d["buffer_size"]) is int and 10_000 <= d["buffer_size"] <= 1_000_000 for d in drawn)
    assert all(type(d["exploration_fraction"]) is float for d in drawn)
    assert len({d["exploration_fraction"] for d in drawn}) == 20
    # Keys handed on unchecked to a class go by how their bounds are written.
    path.write_text("policy_kwargs.n_quantiles: {low: 10, high: 200}\nenv_kwargs.scale: {low: 1, high: 2.5}\n")
    typed = {key: (spec["low"], spec["high"], type(spec["low"])) for key, spec in load_space("qrdqn", path).items()}
    assert typed == {"policy_kwargs.n_quantiles": (10, 200, int), "env_kwargs.scale": (1.0, 2.5, float)}
    path.write_text("n_steps: {low: 16, high: 64.5}\n")
    with pytest.raises(ConfigError, match=r"n_steps: expected a positive int, got 64\.5"):  # a bound's own check
        load_space("ppo", path)
    # An exponent without a dot is a string to YAML; bounds and choices take it as the number it spells, as presets
    # do, a whole one as an int (so that an unchecked key's range still draws ints).
    path.write_text(
        "learning_rate: {low: 1e-5, high: 3e-3, log: true}\nbuffer_size: {low: 1e4, high: 1e6}\n"
        "policy_kwargs.n_quantiles: {low: 10, high: 2e2}\nbatch_size: {choices: [64, 1e3]}\n"
    )
    typed = {
        key: [(v, type(v)) for v in spec.get("choices", [spec.get("low"), spec.get("high")])]
        for key, spec in load_space("qrdqn", path).items()
    }
    assert typed == {
        "learning_rate": [(1e-5, float), (3e-3, float)],
        "buffer_size": [(10_000, int), (1_000_000, int)],
        "policy_kwargs.n_quantiles": [(10, int), (200, int)],
        "batch_size": [(64, int), (1000, int)],
    }
    path.write_text("policy_kwargs.n_quantiles: {low: 10, high: .inf}\n")  # unchecked keys too: no infinite bound
    with pytest.raises(ConfigError, match=r"a range needs finite numbers for 'low' and 'high', got 10 and inf"):
        load_space("qrdqn", path)


def test_per_subkeys_are_only_drawn_with_per_on():
    space = load_space("dqn")
    seen = set()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        params = tuning.sample(study.ask(), space)
        seen.add(params["per"])
        assert ("per.alpha" in params) == params["per"]
    assert seen == {True, False}


# --- the budget and the threshold -----------------------------------------------------------------------------


def test_the_space_keeps_only_values_that_fit_the_budget():
    from sb3_gpu.config.search import fit_to_budget

    ppo, notes = fit_to_budget(load_space("ppo"), timesteps=1500, n_envs=8, on_policy=True)
    assert ppo["n_steps"] == {"choices": [16, 32, 64, 128]}  # 8 x 256 = 2,048 steps would outrun 1,500
    assert notes == ["n_steps: 256, 512, 1024, 2048 left out (a rollout of 8 envs would outrun the 1,500-step budget)"]
    dqn, notes = fit_to_budget(load_space("dqn"), timesteps=3000, n_envs=1, on_policy=False)
    assert dqn["learning_starts"] == {"choices": [0, 1000]}  # 5,000 would leave no steps to learn from
    assert dqn["buffer_size"] == {"choices": [10000]}  # 50,000 and 100,000 would hold what 10,000 holds: all of it
    assert dqn["train_freq"] == load_space("dqn")["train_freq"]
    assert dqn["target_update_interval"] == {"choices": [10, 100, 1000]}  # 5,000 would never sync in 3,000 steps
    assert "target_update_interval: 5000 left out (the target network would be synced less than twice in the" in notes[1]
    assert len(notes) == 3
    ranged, _ = fit_to_budget({"n_steps": {"low": 8, "high": 4096}}, timesteps=1000, n_envs=4, on_policy=True)
    assert ranged == {"n_steps": {"low": 8, "high": 250}}
    buffers = {"buffer_size": {"low": 1000, "high": 1_000_000, "log": True}}
    ranged, notes = fit_to_budget(buffers, timesteps=3000, n_envs=1, on_policy=False)
    assert ranged == {"buffer_size": {"low": 1000, "high": 3000, "log": True}}  # above 3,000 all hold the whole run
    assert notes == ["buffer_size: values above 3,000 left out (larger than the 3,000-step budget, like the size kept)"]
    assert fit_to_budget({"buffer_size": {"low": 5000, "high": 9000}}, 3000, 1, False)[0]["buffer_size"]["high"] == 5000
    with pytest.raises(ConfigError, match=r"every choice .* is too large for trials of 100 timesteps"):
        fit_to_budget(load_space("ppo"), timesteps=100, n_envs=8, on_policy=True)


def test_a_fixed_learning_starts_is_checked_against_the_budget(tmp_path, call_main, monkeypatch):
    from sb3_gpu.config.search import fit_to_budget

    rate = {"learning_rate": {"low": 1e-4, "high": 1e-3, "log": True}}
    with pytest.raises(ConfigError, match=r"learning_starts \(10,000\) is not below the 5,000-step trials"):
        fit_to_budget(rate, timesteps=5000, n_envs=1, on_policy=False, learning_starts=10_000)
    _, notes = fit_to_budget(rate, timesteps=5000, n_envs=1, on_policy=False, learning_starts=3000)
    assert notes == [
        "learning_starts: the preset's 3,000 leaves under half of the 5,000-step budget to learn in; raise --timesteps, "
        "or search learning_starts (--space)"
    ]
    assert fit_to_budget(rate, timesteps=5000, n_envs=1, on_policy=False, learning_starts=2500) == (rate, [])
    searched = {**rate, "learning_starts": {"choices": [100, 10_000]}}  # the space's values are capped instead
    assert fit_to_budget(searched, timesteps=5000, n_envs=1, on_policy=False, learning_starts=10_000)[0] == {
        **rate,
        "learning_starts": {"choices": [100]},
    }
    # tune refuses such a study before any trial: TD3's Pendulum entry learns from 1,000 steps on a CPU.
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "rate.yaml"
    space.write_text("learning_rate: {low: 1.0e-4, high: 1.0e-3, log: true}\n")
    out = call_main(
        tune.main,
        "td3",
        "--env",
        "Pendulum-v1",
        "--trials",
        "1",
        "--timesteps",
        "800",
        "--device",
        "cpu",
        "--space",
        str(space),
    )
    assert out.returncode == 2 and "learning_starts (1,000) is not below the 800-step trials" in out.stderr
    assert not (tmp_path / "tune").exists()


def test_the_exported_preset_is_what_the_best_trial_trained(tmp_path):
    """The trials' profile folded in (TD3 Pendulum's cpu profile: 64x64, batch 128, learning from 1,000), the tuned
    keys set, and a tuned buffer that held whole trials leaving the entry's larger own size."""
    import yaml

    space = {"learning_rate": {"low": 1e-4, "high": 1e-2, "log": True}, "buffer_size": {"choices": [10_000]}}
    study = optuna.create_study(direction="maximize", study_name="td3-Pendulum-v1")
    study.set_user_attr("space", space)
    dists = {
        "learning_rate": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
        "buffer_size": optuna.distributions.CategoricalDistribution([10_000]),
    }

    def add(value: float, size: int, profile: str) -> None:
        params = {"learning_rate": 3e-3, "buffer_size": size}
        attrs = {"profile": profile, "seed_scores": [value]}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value, user_attrs=attrs))

    add(-150.0, 10_000, "cpu")
    path = tuning.export_preset(study, "td3", "Pendulum-v1", tmp_path / "best_preset.yaml", timesteps=5000)
    text = path.read_text()
    assert f"Train it: python -m sb3_gpu.train td3 --env Pendulum-v1 --preset {path.resolve()}\n" in text  # from anywhere
    entry = yaml.safe_load(text)["Pendulum-v1"]
    assert {k: entry[k] for k in ("net_arch", "batch_size", "learning_starts", "learning_rate", "buffer_size")} == {
        "net_arch": [64, 64],
        "batch_size": 128,
        "learning_starts": 1000,
        "learning_rate": 3e-3,
        "buffer_size": 200_000,
    }
    assert "cpu" not in entry and "gpu" not in entry
    # The entry's counts (2.0e+4 in its YAML) are written as integers, its rates as floats.
    assert "n_timesteps: 20000\n" in text and isinstance(entry["gamma"], float)
    assert "'cpu' profile's values" in text and "the trials' 10,000 held all of each trial" in text
    # Trials longer than the buffer did evict: their size is the finding and is kept.
    path = tuning.export_preset(study, "td3", "Pendulum-v1", tmp_path / "short.yaml", timesteps=20_000)
    assert yaml.safe_load(path.read_text())["Pendulum-v1"]["buffer_size"] == 10_000


@pytest.mark.heavy
def test_an_evaluation_interval_past_the_budget_is_noted_and_the_trial_scored_at_its_end(tmp_path, call_main, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = call_main(tune.main, "ppo", "--trials", "1", *TINY, "--eval-freq", "1024", "--study-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    note = "note: --eval-freq 1,024 is above the 512 timesteps of each seed: no trial is evaluated before its end, so none"
    assert note in out.stdout
    (trial,) = load(f"sqlite:///{tmp_path / 'study.db'}").trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value is not None


@pytest.mark.heavy
@pytest.mark.parametrize("sampler_seed", range(5))
def test_a_one_trial_study_of_1500_steps_completes_whatever_the_sampler_draws(tmp_path, sampler_seed, call_main, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["ppo", "--trials", "1", "--timesteps", "1500", "--eval-episodes", "2", "--device", "cpu"]
    out = call_main(tune.main, *args, "--sampler-seed", str(sampler_seed), "--study-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    (trial,) = load(f"sqlite:///{tmp_path / 'study.db'}").trials
    assert trial.state == optuna.trial.TrialState.COMPLETE, trial.user_attrs


@pytest.mark.heavy
@pytest.mark.parametrize("algo", ["sac", "td3", "tqc"])
def test_a_continuous_study_trains_its_trial_and_exports_a_preset_train_accepts(tmp_path, algo, call_main, monkeypatch):
    """The off-policy continuous algorithms through the whole path: a trial on Pendulum-v1 that learns from its own
    sampled `learning_starts`, the best trial's values written to a preset, and `train` running that preset."""
    import yaml

    from sb3_gpu import train

    monkeypatch.chdir(tmp_path)
    space = tmp_path / "space.yaml"
    space.write_text(
        "learning_rate: {low: 1.0e-4, high: 3.0e-3, log: true}\ntau: {choices: [0.005, 0.02]}\n"
        "learning_starts: {choices: [100, 200]}\n"
    )
    args = ["--env", "Pendulum-v1", "--trials", "1", "--timesteps", "400", "--eval-episodes", "1", "--device", "cpu"]
    out = call_main(tune.main, algo, *args, "--space", str(space), "--study-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    (trial,) = load(f"sqlite:///{tmp_path / 'study.db'}", f"{algo}-Pendulum-v1").trials
    assert trial.state == optuna.trial.TrialState.COMPLETE, trial.user_attrs
    assert -3300 < trial.value < 0  # Pendulum's return (at worst about -16.3 a step, 200 steps), not a placeholder
    entry = yaml.safe_load((tmp_path / "best_preset.yaml").read_text())["Pendulum-v1"]
    assert entry["learning_rate"] == pytest.approx(trial.params["learning_rate"])
    assert (entry["tau"], entry["learning_starts"]) == (trial.params["tau"], trial.params["learning_starts"])
    run = tmp_path / "run"
    preset = str(tmp_path / "best_preset.yaml")
    trained = call_main(
        train.main,
        algo,
        "--env",
        "Pendulum-v1",
        "--preset",
        preset,
        "--timesteps",
        "300",
        "--eval-episodes",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--run-dir",
        str(run),
    )
    assert trained.returncode == 0, trained.stderr
    assert (run / "model.zip").is_file()


@pytest.mark.heavy
def test_a_threshold_study_scores_the_seconds_each_seed_took_to_reach_it(tmp_path, monkeypatch, call_main):
    monkeypatch.chdir(tmp_path)
    args = ["ppo", "--trials", "1", *TINY, "--timesteps", "2048", "--eval-freq", "256", "--seeds", "2"]
    out = call_main(tune.main, *args, "--threshold", "15", "--study-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    (trial,) = load(f"sqlite:///{tmp_path / 'study.db'}").trials
    scores, reached = trial.user_attrs["seed_scores"], trial.user_attrs["seed_reached"]
    assert len(scores) == 2 and all(s < 0 for s in scores) and trial.value == pytest.approx(sum(scores) / 2)
    assert any(reached)  # a return of 15 on CartPole: within reach of 2,048 steps
    for seed, (score, got_there) in enumerate(zip(scores, reached, strict=True)):  # each seed's line, as it ended
        assert tuning.seed_progress(0, seed, score, got_there, 15.0) in out.stdout
    assert "reached 15 in " in out.stdout
    # A seed that reached it stopped early: it reported fewer evaluations than the budget holds.
    assert len(trial.intermediate_values) < 2 * 2048 // 256
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("`python -m sb3_gpu.tune ppo --trials 1") and "reached 15" in summary
    again = call_main(tune.main, *args, "--threshold", "20", "--study-dir", str(tmp_path))
    assert again.returncode == 2 and "scores the time to a return of 15" in again.stderr
    longer = call_main(tune.main, *args, "--threshold", "15", "--timesteps", "4096", "--study-dir", str(tmp_path))
    assert longer.returncode == 2 and "scores trials with --timesteps 2048 (this worker: 4096)" in longer.stderr

    # Results that cannot be written (a full disk) end in one line that says where the trials are; the same command,
    # its trials done, writes them once it can.
    from sb3_gpu.common import io

    (tmp_path / "summary.md").unlink()
    with monkeypatch.context() as m:
        m.setattr(io, "atomic_write_text", disk_full)
        full = call_main(tune.main, *args, "--threshold", "15", "--study-dir", str(tmp_path))
    expected = f"error: cannot write the study's results into {tmp_path}: No space left on device; its trials are in sqlite"
    assert full.returncode == 1 and full.stderr.startswith(expected) and full.stderr.count("\n") == 1, full.stderr
    assert call_main(tune.main, *args, "--threshold", "15", "--study-dir", str(tmp_path)).returncode == 0
    assert (tmp_path / "summary.md").read_text().startswith("`python -m sb3_gpu.tune ppo --trials 1")


# --- PostgreSQL ----------------------------------------------------------------------------------------------


def _pg_bin() -> Path | None:
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(folder, "initdb").is_file():
            return Path(folder)
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


@pytest.fixture(scope="module")
def postgres_url():
    """A throwaway PostgreSQL server on 127.0.0.1 (Debian's postgresql package; .ci/run installs it)."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed here (Debian: apt-get install postgresql; .ci/run installs it)")
    root = Path(tempfile.mkdtemp(prefix="sb3_gpu_pg_"))
    prefix: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root
        shutil.chown(root, "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"

    def pg(tool: str, *args: str) -> None:
        subprocess.run([*prefix, str(bin_dir / tool), *args], check=True, capture_output=True, timeout=120)

    pg("initdb", "-D", str(data), "-A", "trust", "-U", "postgres")
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    pg("pg_ctl", "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
    try:
        pg("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "optuna")
        yield f"postgresql://postgres@127.0.0.1:{port}/optuna"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.heavy
def test_two_workers_share_one_study_on_postgresql(tmp_path, postgres_url):
    for out in _workers(postgres_url, tmp_path, trials=6):
        assert out.returncode == 0, out.stderr
        assert "postgresql://postgres@127.0.0.1" in out.stdout
    _check_shared(postgres_url, 6)


def test_a_new_study_is_marked_set_up_only_after_its_settings_are_written(monkeypatch):
    # Two workers start together: the second may load the study while the first writes its settings, one transaction
    # each. It reads "algo" as the mark that the others are there (CI once caught it between "algo" and "env").
    written = []
    monkeypatch.setattr(optuna.study.Study, "set_user_attr", lambda self, key, value: written.append(key))
    settings = {"sampler": "random", "pruner": "none", "timesteps": 512, "algo": "ppo", "env": "CartPole-v1"}
    tuning.open_study("s", optuna.storages.InMemoryStorage(), space={}, where="memory", **settings)
    assert written[-1] == "algo" and set(written) == {"algo", "env", "space", "threshold", "scoring"}


def test_a_worker_whose_trials_would_score_another_way_is_refused_by_the_flag():
    storage = optuna.storages.InMemoryStorage()
    settings = {"sampler": "random", "pruner": "none", "timesteps": 512, "algo": "ppo", "env": "CartPole-v1"}
    made = {"--timesteps": 512, "--seeds": 2, "--eval-freq": None}
    tuning.open_study("s", storage, space={}, where="memory", scoring=made, **settings)
    tuning.open_study("s", storage, space={}, where="memory", scoring=made, **settings)  # the same: joins
    tuning.open_study("s", storage, space={}, where="memory", **settings)  # a caller that compares none
    for flag, value, said in (("--seeds", 3, "--seeds 2 (this worker: 3)"), ("--eval-freq", 64, "its default (this")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            tuning.open_study("s", storage, space={}, where="memory", scoring={**made, flag: value}, **settings)


def test_a_study_whose_range_drew_ints_is_refused_by_a_space_that_draws_floats():
    # optuna refuses a float range for a name it drew ints for: every trial would fail. 0 == 0.0, but not as JSON.
    storage = optuna.storages.InMemoryStorage()
    settings = {"sampler": "random", "pruner": "none", "timesteps": 512, "algo": "dqn", "env": "CartPole-v1"}
    tuning.open_study("s", storage, space={"exploration_fraction": {"low": 0, "high": 1}}, where="memory", **settings)
    with pytest.raises(ConfigError, match="was made with another search space"):
        space = {"exploration_fraction": {"low": 0.0, "high": 1.0}}
        tuning.open_study("s", storage, space=space, where="memory", **settings)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_seeded_study_resumed_by_the_same_command_never_draws_its_first_trials_again(sampler):
    settings = {"sampler": sampler, "pruner": "none", "timesteps": 512, "algo": "ppo", "env": "CartPole-v1"}

    def worker(storage, trials: int) -> list[float]:  # a fresh process's sampler each time: the command run again
        study = tuning.open_study("s", storage, space={}, where="memory", sampler_seed=7, **settings)
        study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=trials)
        return [t.params["x"] for t in study.trials]

    resumed = optuna.storages.InMemoryStorage()
    worker(resumed, 3)
    drawn = worker(resumed, 3)  # stopped after 3 trials, then the same command
    assert len(set(drawn)) == 6
    assert worker(optuna.storages.InMemoryStorage(), 6) == drawn  # still reproducible: seeded by trial number


def test_trials_of_dead_workers_on_this_host_are_failed():
    study = optuna.create_study()
    dead, alive = study.ask(), study.ask()
    dead.set_user_attr("worker", f"{socket.gethostname()}:{2**22 + 12345}")  # above Linux's pid_max
    alive.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    assert tuning_storage.fail_dead_local_trials(study) == 1
    states = {t.number: t.state for t in study.trials}
    assert states == {dead.number: optuna.trial.TrialState.FAIL, alive.number: optuna.trial.TrialState.RUNNING}


def test_a_worker_is_told_apart_by_its_pid_namespace_and_start_time():
    # Containers sharing a host name each have pids of their own: a worker there failed another's live trial, which
    # then crashed its worker. A pid reused after a worker died (a container's pid 1, restarted) left its trial running.
    study = optuna.create_study()
    own = tuning_storage.worker_attrs()
    elsewhere, reused, alive = study.ask(), study.ask(), study.ask()
    for trial in (elsewhere, reused, alive):
        for key, value in own.items():
            trial.set_user_attr(key, value)
    elsewhere.set_user_attr("worker", f"{socket.gethostname()}:{2**22 + 12345}")  # no such pid here...
    elsewhere.set_user_attr("worker_pid_ns", "pid:[1]")  # ...where it runs
    start = next(key for key in own if key.startswith("worker_start"))  # ticks since boot (Linux) or psutil's time
    reused.set_user_attr(start, own[start] - 360_000.0)  # this pid's process, long before it
    assert tuning_storage.fail_dead_local_trials(study) == 1
    states = {t.number: t.state for t in study.trials}
    running, failed = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL
    assert states == {elsewhere.number: running, reused.number: failed, alive.number: running}


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="Linux's start time in clock ticks")
def test_a_live_worker_is_not_taken_for_dead_when_the_clock_is_corrected(monkeypatch):
    # psutil's start time is boot time plus ticks, its boot time read from the clock: an NTP correction moved it by a
    # second or more, and a live worker's running trial was failed.
    import psutil

    study = optuna.create_study()
    by_ticks, by_time = study.ask(), study.ask()  # psutil's time: where /proc is not (another OS), under its own name
    for trial in (by_ticks, by_time):
        for key, value in tuning_storage.worker_attrs().items():
            trial.set_user_attr(key, value)
    by_time.set_user_attr("worker_start_ticks", None)
    by_time.set_user_attr("worker_started", psutil.Process().create_time())
    real = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 1.0)
    assert tuning_storage.fail_dead_local_trials(study) == 0
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.RUNNING}


def test_a_storage_secret_is_masked_where_it_stands_never_inside_other_words():
    from sb3_gpu.tuning.storage import mask_url

    url = "postgresql://postgres:p@127.0.0.1:1/optuna"
    driver = f'cannot open storage {url} (psycopg2.OperationalError) connection to server at "127.0.0.1", port 1 failed'
    assert mask_url(url) == "postgresql://postgres:***@127.0.0.1:1/optuna"
    assert mask_url(url, driver) == driver.replace(":p@", ":***@")  # "psycopg2", "port" and "postgres" kept whole
    same = "postgresql://postgres:postgres@db/optuna"  # the URL keeps its scheme and user; elsewhere a long secret goes
    assert mask_url(same, f"{same}: password=postgres for user postgres") == (
        "postgresql://postgres:***@db/optuna: password=*** for user ***"
    )
    long = "postgresql://tuner:s3cr3t@db/optuna"
    for free in ("error near 's3cr3t'", "PASSWORD: s3cr3t", "{'password': 's3cr3t'}", "at tuner:s3cr3t@db."):
        assert "s3cr3t" not in mask_url(long, free), free
    short = {"PASSWORD=p", "pwd: p", "{'password': 'p'}", "at u:p@db"}
    assert {mask_url(url, text) for text in short} == {"PASSWORD=***", "pwd: ***", "{'password': '***'}", "at u:***@db"}
    encoded = "postgresql://tuner:a%40b%2Fc@db/optuna?sslpassword=k3y&sslmode=require"
    assert mask_url(encoded) == "postgresql://tuner:***@db/optuna?sslpassword=***&sslmode=require"
    assert mask_url(encoded, "dsn: password='a@b/c' sslpassword=k3y") == "dsn: password='***' sslpassword=***"


def test_a_study_dir_its_summary_cannot_name_is_refused_before_any_trial(tmp_path, capsys):
    study = tmp_path / b"st\xff".decode("utf-8", "surrogateescape")  # summary.md names it, in UTF-8, after the trials
    assert tune.main(["ppo", "--trials", "1", *TINY, "--study-dir", str(study)]) == 2
    assert "cannot use study dir" in capsys.readouterr().err and not study.exists()


def test_a_sqlite_file_in_a_folder_not_made_yet_gets_its_folder_as_a_journal_does(tmp_path, monkeypatch):
    # It said "(sqlite3.OperationalError) unable to open database file", where journal:PATH made the folder.
    monkeypatch.chdir(tmp_path)
    for url, made in (
        (f"sqlite:///{tmp_path / 'new' / 'deeper' / 's.db'}", tmp_path / "new" / "deeper"),
        ("sqlite:///relative/s.db?timeout=5", tmp_path / "relative"),
        ("sqlite+pysqlite:///with%20space/s.db", tmp_path / "with space"),  # as SQLAlchemy reads the URL
    ):
        optuna.create_study(study_name="s", storage=tuning_storage.make_storage(url, 60))
        assert (made / "s.db").is_file()
    assert not (tmp_path / "with%20space").exists()


def test_a_best_trial_with_per_on_exports_the_entrys_own_per_settings_with_the_tuned_ones(tmp_path):
    # `per: true` replaced DQN CartPole's {..., normalize: buffer} whole: the exported preset weighted by the batch.
    space = {"per": {"choices": [True, False]}, "per.alpha": {"low": 0.4, "high": 0.8}}
    study = optuna.create_study(direction="maximize", study_name="dqn-CartPole-v1")
    study.set_user_attr("space", space)
    dists = {
        "per": optuna.distributions.CategoricalDistribution([True, False]),
        "per.alpha": optuna.distributions.FloatDistribution(0.4, 0.8),
    }
    params = {"per": True, "per.alpha": 0.7}
    study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=500.0, user_attrs={"profile": "cpu"}))
    path = tuning.export_preset(study, "dqn", "CartPole-v1", tmp_path / "best_preset.yaml", timesteps=5000)
    trained = make_plan("dqn", "CartPole-v1", "cpu", vec_env="dummy", overrides={"probe": False, **params})
    replayed = make_plan("dqn", "CartPole-v1", "cpu", vec_env="dummy", preset=path, overrides={"probe": False})
    trained, replayed = trained.preset.values()["per"], replayed.preset.values()["per"]
    assert replayed == trained and trained["normalize"] == "buffer" and trained["alpha"] == 0.7


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts the open files in /proc")
def test_tune_main_closes_its_database_connections_as_it_returns(tmp_path, monkeypatch, call_main):
    # A notebook or driver calling main() again and again kept two handles on study.db open per call.
    monkeypatch.setattr("sb3_gpu.planning.plan.compiles_auto", lambda device: False)

    args = ["ppo", "--trials", "1", "--study-dir", str(tmp_path / "study"), *TINY]
    for _ in range(2):  # a trial, then the report alone
        assert call_main(tune.main, *args).returncode == 0
        assert _open_on((tmp_path / "study" / "study.db").resolve()) == 0
    # Nor does the module hold on to storages made outside main(): one dropped is closed with its study.
    import gc

    study = optuna.create_study(storage=tuning_storage.make_storage(f"sqlite:///{tmp_path / 's.db'}", 60))
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=1)
    del study
    gc.collect()
    assert _open_on((tmp_path / "s.db").resolve()) == 0


def _open_on(path: Path) -> int:
    return sum(1 for fd in Path("/proc/self/fd").iterdir() if os.path.realpath(fd) == str(path))
