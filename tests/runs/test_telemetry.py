"""Throughput telemetry read back from TensorBoard's event files, the dashboard layout, pictures, and the plot CLI."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import types
import urllib.request

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import DQN, PPO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.telemetry import DASHBOARD, SHARES, ThroughputCallback
from sb3_gpu.runs.training import train_run
from tests.conftest import REPO, disk_full, run_cli


def _scalars(log_dir) -> dict[str, list[float]]:
    (events,) = [p for p in log_dir.rglob("events.out.tfevents.*")]
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.heavy
def test_dqn_throughput_tags_land_in_tensorboard_with_sane_values(tmp_path):
    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        learning_starts=0,
        train_freq=4,
        gradient_steps=1,
        batch_size=32,
        policy_kwargs={"net_arch": [32]},
        tensorboard_log=str(tmp_path),
        seed=0,
    )
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    model.learn(3000, callback=callback, log_interval=5)
    scalars = _scalars(tmp_path)
    for key in ("env_steps_per_s", "episodes_per_s", "grad_steps_per_1k_env_steps", "buffer_fill", "rss_mib"):
        assert f"throughput/{key}" in scalars, sorted(scalars)
    last = {k.split("/")[1]: v[-1] for k, v in scalars.items() if k.startswith("throughput/")}
    assert last["env_steps_per_s"] > 0 and last["episodes_per_s"] > 0 and last["rss_mib"] > 0
    # train_freq 4, one gradient step each: 250 optimizer steps per 1,000 env steps.
    assert last["grad_steps_per_1k_env_steps"] == pytest.approx(250, rel=0.02)
    shares = [last[f"share_{k}"] for k in ("env", "other", "train", "eval")]
    assert all(0 <= s <= 1 for s in shares) and sum(shares) == pytest.approx(1.0, abs=0.02)
    assert 0 < last["buffer_fill"] <= 1
    assert not {"step_async", "step_wait", "reset"} & set(vars(model.env.unwrapped)), "the timer is removed after learn"


@pytest.mark.heavy
def test_train_run_with_a_normalizing_preset_evaluates_and_times_the_env(tmp_path):
    # Acrobot's PPO preset normalises observations: EvalCallback syncs the VecNormalize statistics through the env.
    overrides = {"n_timesteps": 1024, "n_envs": 2, "n_steps": 128, "batch_size": 64}
    plan = make_plan("ppo", "Acrobot-v1", "cpu", seed=0, overrides=overrides)
    assert plan.preset.normalize
    summary = train_run(plan, tmp_path / "run", eval_freq=256, eval_episodes=1, progress=False)
    assert summary["timesteps"] >= 1024 and summary["best_eval_mean"] is not None


def test_one_callback_measures_each_learn_afresh():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1)
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    model.learn(256, callback=callback)
    model.n_epochs = 2  # twice the optimizer steps per env step: a count carried over would land between the two
    between = time.perf_counter()
    model.learn(256, callback=callback)  # counts restart; the idle time between the learns is not in the window
    assert callback.latest["grad_steps_per_1k_env_steps"] == pytest.approx(2 * 1000 / 64)
    assert callback.window.points[0][0] > between  # the window holds the second learn's points only
    assert 0.0 < callback.latest["share_env"] < 1.0  # both parts measured (their ratio depends on the load beside it)


def test_no_learn_records_a_rate_before_it_has_measured_a_rollout(tmp_path):
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1, tensorboard_log=str(tmp_path))
    callback = ThroughputCallback(record_s=0.0)  # the default warm-up: each short learn is measured whole
    model.learn(256, callback=callback, tb_log_name="run")
    model.learn(256, callback=callback, tb_log_name="run", reset_num_timesteps=False)  # a notebook's second learn
    scalars: dict[str, list[float]] = {}
    for events in sorted(tmp_path.rglob("events.out.tfevents.*")):  # SB3 opens a second file for the second learn
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    # 8 rollouts, the first of each learn recorded before any was measured: no rate (it would read 0 steps/s).
    # Each learn's last rollout is recorded at its end, with its training: one point per step.
    assert len(scalars["throughput/env_steps_per_s"]) == 8 - 2 - 2 + 2
    assert min(scalars["throughput/env_steps_per_s"]) > 0 and max(scalars["throughput/share_train"]) < 1


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("algo", "env", "overrides", "eval_freq", "losses"),
    [
        ("sac", "Pendulum-v1", {"learning_starts": 50, "batch_size": 32, "net_arch": [16, 16]}, 128, "train/critic_loss"),
        # Blocks of 4 vec steps of 2 envs: the last one runs from 248 to 256, past 250; evaluations every 4 env
        # steps fall at 252, past the run's length, and at its last step, 256.
        ("dqn", "CartPole-v1", {"learning_starts": 50, "n_envs": 2, "train_freq": 4, "n_timesteps": 250}, 4, "train/loss"),
        # PPO writes after each rollout, before its training: the last one's training was written at 256 again.
        ("ppo", "CartPole-v1", {"n_envs": 2, "n_steps": 32, "batch_size": 32, "n_timesteps": 250}, 128, "train/loss"),
    ],
)
def test_an_evaluation_at_the_last_step_is_written_with_the_last_record(tmp_path, algo, env, overrides, eval_freq, losses):
    # SB3's EvalCallback wrote the logger at the last step, before the last gradient step; the last record wrote it
    # again: two points at that step for every train/ and throughput/ tag.
    overrides = {"n_timesteps": 256, "probe": False, "compile": False, **overrides}
    plan = make_plan(algo, env, "cpu", seed=0, vec_env="dummy", overrides=overrides)
    train_run(plan, tmp_path / "run", eval_freq=eval_freq, eval_episodes=1, confirm_episodes=0, progress=False)
    (events,) = (tmp_path / "run").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    # (SB3 itself writes twice where an evaluation and an episode's end fall on one step, as they can at 4 env steps.)
    assert {tag for tag, at in steps.items() if at.count(256) > 1} == set()
    assert steps["eval/mean_reward"][-2:] == ([252, 256] if algo == "dqn" else [128, 256])
    if algo == "ppo":  # SB3's write after each rollout (time/, rollout/) is held for the last record's too
        assert steps["time/fps"][-1] == 256 and steps["time/fps"].count(256) == 1  # each at its own step
    # The last write carries the last training's figures, those the device accumulates (sb3_gpu's write) included.
    assert steps["throughput/env_steps_per_s"][-1] == steps["train/learning_rate"][-1] == steps[losses][-1] == 256


def test_a_learn_shorter_than_twice_the_warm_up_is_measured_whole():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=2)
    callback = ThroughputCallback(window_s=1.0, warmup_s=1e9, record_s=0.0)
    start = time.perf_counter()
    model.learn(256, callback=callback)
    wall = time.perf_counter() - start
    figures = callback.latest
    # Every rollout and its training counted (with the warm-up alone, nothing would be), and not a second's slice.
    assert figures["grad_steps_per_1k_env_steps"] == pytest.approx(2 * 1000 / 64)
    assert 256 / wall <= figures["env_steps_per_s"] <= 256 / (wall * 0.25)
    assert figures["window_whole"] == 1.0 and 0 < figures["window_s"] <= wall  # what the summary says it measured
    assert sum(figures[f"share_{part}"] for part in ("env", "other", "train", "eval")) == pytest.approx(1.0)


def test_time_before_learning_starts_is_not_training_and_the_last_cpu_figure_is_measured_over_a_second(monkeypatch):
    # DQN's rollouts of one step, none of them followed by a gradient step: SB3's loop between them is not training.
    import psutil
    from stable_baselines3.common.callbacks import BaseCallback

    real = psutil.Process

    class SpanProcess:  # psutil's, but its CPU figure is ten times the seconds since it was last asked for one
        def __init__(self):
            self.real, self.last = real(), time.perf_counter()

        def cpu_percent(self, interval=None):
            now = time.perf_counter()
            span, self.last = now - self.last, now
            return 10 * span

        def memory_info(self):
            return self.real.memory_info()

    monkeypatch.setattr(psutil, "Process", SpanProcess)

    class BusyOnce(BaseCallback):  # a second and a half of CPU work in one step: the run lasts over a second
        def _on_step(self) -> bool:
            if self.n_calls == 100:
                end = time.perf_counter() + 1.5
                while time.perf_counter() < end:
                    pass
            return True

    model = DQN("MlpPolicy", "CartPole-v1", learning_starts=10_000, train_freq=1, policy_kwargs={"net_arch": [16]})
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    model.learn(2000, callback=[BusyOnce(), callback])
    figures = callback.latest
    assert model._n_updates == 0 and figures["share_train"] == 0.0 and figures["share_other"] > 0
    assert sum(figures[f"share_{part}"] for part in SHARES) == pytest.approx(1.0)
    # The record at the end comes right after another: its CPU figure is the last one measured over a second or more
    # (the busy second among them), not the few milliseconds between the two. (The figure of a real process depends
    # on what else the machine runs: measured under load, a busy second read 7.9%.)
    assert figures["cpu_percent"] >= 10


def test_a_run_shorter_than_the_cpu_span_is_measured_whole_at_its_end():
    # CPU use is renewed once cpu_span_s has passed; a run that ends sooner (a short one on a fast machine) must still
    # get its figure, measured over the whole run, or the dashboard's CPU chart stays empty.
    model = DQN("MlpPolicy", "CartPole-v1", learning_starts=0, policy_kwargs={"net_arch": [16]})
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    callback.cpu_span_s = 1e9  # no record is a span apart: only the end measures
    model.learn(500, callback=callback)
    assert callback.latest["cpu_percent"] > 0  # measured: the process trained the whole time


def test_ppo_counts_optimizer_steps_of_every_minibatch(tmp_path):
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=128, batch_size=32, n_epochs=2, tensorboard_log=str(tmp_path))
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0)
    model.learn(128 * 4, callback=callback)
    # 2 epochs x 4 minibatches of 32 per rollout of 128 steps: 8 optimizer steps per 128 env steps.
    assert callback.latest["grad_steps_per_1k_env_steps"] == pytest.approx(1000 * 8 / 128)


# The dashboard's tags that only a GPU writes (its memory and its use).
GPU_ONLY = {r"throughput/cuda_(allocated|peak)_mib", r"throughput/gpu_util_percent"}


def test_every_chart_of_the_dashboard_draws_tags_a_run_writes(tmp_path):
    # A chart whose pattern names no tag (a typo, a renamed key) stays empty: each one must match a tag of a run with
    # PER, fp16 AMP and confirmed evaluations, on the CPU, or of a short PPO or SAC run (their own losses).
    from stable_baselines3 import SAC

    from sb3_gpu.extensions.amp import enable_amp
    from sb3_gpu.extensions.per import PrioritizedDQN, PrioritizedReplayBuffer
    from sb3_gpu.runs.evaluation import TimedEvalCallback

    model = PrioritizedDQN(
        "MlpPolicy",
        "CartPole-v1",
        learning_starts=0,
        batch_size=32,
        policy_kwargs={"net_arch": [16]},
        replay_buffer_class=PrioritizedReplayBuffer,
        tensorboard_log=str(tmp_path),
        seed=0,
    )
    enable_amp(model, "fp16")
    env = DQN("MlpPolicy", "CartPole-v1").get_env()
    evaluation = TimedEvalCallback(env, eval_freq=500, n_eval_episodes=1, confirm_episodes=1, verbose=0)
    model.learn(1000, callback=[ThroughputCallback(warmup_s=0.0, record_s=0.0), evaluation], log_interval=2)
    tags = set(_scalars(tmp_path))
    ppo, sac = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64), SAC("MlpPolicy", "Pendulum-v1", learning_starts=0)
    for other in (ppo, sac):
        other.tensorboard_log = str(tmp_path / type(other).__name__)
        other.learn(256, log_interval=1)  # a Pendulum episode (200 steps) ends: SAC writes its logs then
        tags |= set(_scalars(tmp_path / type(other).__name__))
    patterns = [(chart, p) for category in DASHBOARD.values() for chart, (_, ps) in category.items() for p in ps]
    assert len(patterns) == 22  # the layout's own count, so that a pattern dropped from it is noticed too
    empty = [(chart, p) for chart, p in patterns if p not in GPU_ONLY and not any(re.fullmatch(p, t) for t in tags)]
    assert not empty, f"charts drawing no tag: {empty}; the run wrote {sorted(tags)}"
    # TensorBoard matches a chart's patterns at the start of a tag only (re.match): a tag drawn by two charts is a
    # pattern that reaches past its own (train/ent_coef drew train/ent_coef_loss too).
    drawn = {t: {chart for chart, p in patterns if re.match(p, t)} for t in tags}
    assert all(len(charts) <= 1 for charts in drawn.values()), {t: c for t, c in drawn.items() if len(c) > 1}


@pytest.mark.heavy
def test_train_run_writes_the_dashboard_layout_and_curves(tmp_path):
    plan = make_plan(
        "ppo", "CartPole-v1", "cpu", seed=0, overrides={"n_timesteps": 2048, "n_envs": 2, "n_steps": 64, "batch_size": 64}
    )
    summary = train_run(plan, tmp_path / "run", eval_freq=512, eval_episodes=2, progress=False)
    (events,) = list((tmp_path / "run" / "tb").rglob("events.out.tfevents.*"))
    raw = events.read_bytes()  # the layout is a summary of the custom_scalars plugin (served: see the server test)
    assert b"custom_scalars" in raw and b"Time split" in raw and b"Hardware" in raw
    png = tmp_path / "run" / "curves.png"
    assert summary["curves"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.heavy
def test_plot_cli_draws_several_runs_and_refuses_non_runs(tmp_path):
    for seed in (0, 1):
        plan = make_plan(
            "ppo",
            "CartPole-v1",
            "cpu",
            seed=seed,
            overrides={"n_timesteps": 1024, "n_envs": 2, "n_steps": 64, "batch_size": 64},
        )
        train_run(plan, tmp_path / f"seed{seed}", eval_freq=512, eval_episodes=1, progress=False)
    result = run_cli("sb3_gpu.plot", "seed0", "seed1", "-o", "both.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    bad = run_cli("sb3_gpu.plot", "nowhere", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "nowhere: no such folder" in bad.stderr


@pytest.mark.parametrize(
    "monitor, out, message",
    [
        (b'#{"t_start": oops\nr,l,t\n', None, "cannot read {run}/monitor/0.monitor.csv: not a Monitor file (JSONDecodeError"),
        (b"#{}\nr,l,t\n\xff\xfe1,2,3\n", None, "cannot read {run}/monitor/0.monitor.csv: not a Monitor file (UnicodeDecode"),
        ("dir", None, "cannot read {run}/monitor/0.monitor.csv: not a Monitor file (IsADirectoryError"),
        (
            b"#{}\nr,l,t\n1,2,3\n",
            "curves.jpg",
            "the plot is written as a PNG file: give a path ending in .png, got 'curves.jpg'",
        ),
        (b'#{"t_start": null}\nr,l,t\n', None, "cannot read {run}/monitor/0.monitor.csv: not a Monitor file (TypeError"),
        # Only a last line may be half written (by a run still going): a bad one before it is damage, not "no episode".
        (
            b"#{}\nr,l,t\n1,2,3\ngarbage\n4,5,6\n",
            None,
            "cannot read {run}/monitor/0.monitor.csv: not a Monitor file (ValueError: line 4 is 'garbage', not an episode",
        ),
        (b"#{}\nx,y\n1,2,3\n", None, "cannot read {run}/monitor/0.monitor.csv: not a Monitor file (ValueError: line 2 is"),
        (
            b"garbage",
            None,
            "cannot read {run}/monitor/0.monitor.csv: not a Monitor file (ValueError: line 1 is 'garbage', not a",
        ),
        (b"#{}\nr,l,t\n1,2,3\n", "a.png", "cannot write the plot to a.png: it is a folder"),
        # ".png" alone is a hidden file's name, with no suffix: it was told to end in .png.
        (b"#{}\nr,l,t\n1,2,3\n", ".png", "the plot is written as a PNG file: give a name before .png, got '.png'"),
        (b"#{}\nr,l,t\n1,2,3\n", "file/x.png", "cannot create the plot's folder file: file is in the way (not a folder)"),
    ],
)
def test_plot_refuses_a_damaged_monitor_file_or_an_unusable_output_in_one_line(tmp_path, monitor, out, message):
    (tmp_path / "run" / "monitor").mkdir(parents=True)
    (tmp_path / "a.png").mkdir()  # a folder where the PNG would go
    (tmp_path / "file").write_text("")
    target = tmp_path / "run" / "monitor" / "0.monitor.csv"
    target.mkdir() if monitor == "dir" else target.write_bytes(monitor)
    result = run_cli("sb3_gpu.plot", "run", *([] if out is None else ["-o", out]), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: " + message.format(run="run")), result.stderr


def test_plot_refuses_a_file_for_a_run_dir_and_a_run_given_twice(tmp_path):
    (tmp_path / "run" / "monitor").mkdir(parents=True)
    (tmp_path / "run" / "monitor" / "0.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n1,2,3\n')
    (tmp_path / "notes.txt").write_text("")
    result = run_cli("sb3_gpu.plot", "notes.txt", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == "error: notes.txt is a file; give the run dir written by " + (
        "sb3_gpu.train (the folder that holds monitor/)\n"
    )
    result = run_cli("sb3_gpu.plot", "run", "./run/", cwd=tmp_path)
    assert result.returncode == 2 and f"{tmp_path / 'run'} is given twice; each run once" in result.stderr
    assert not (tmp_path / "curves.png").exists()


def test_plot_says_when_a_run_has_no_finished_episode(tmp_path):
    (tmp_path / "run" / "monitor").mkdir(parents=True)
    (tmp_path / "run" / "monitor" / "0.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n')
    (tmp_path / "run" / "monitor" / "1.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n-3.5,1')  # being written
    result = run_cli("sb3_gpu.plot", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "note: run has no finished episode yet; its curves are empty" in result.stdout
    assert (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_warns_of_a_damaged_evaluations_file_and_draws_the_rest(tmp_path):
    (tmp_path / "run" / "monitor").mkdir(parents=True)
    (tmp_path / "run" / "monitor" / "0.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n1,2,3\n4,5,6\n')
    (tmp_path / "run" / "eval").mkdir()
    (tmp_path / "run" / "eval" / "evaluations.npz").write_bytes(b"PK\x03\x04 cut short")
    result = run_cli("sb3_gpu.plot", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("warning: cannot read run/eval/evaluations.npz (BadZipFile: "), result.stderr
    assert result.stderr.strip().endswith("the evaluations are left out") and result.stderr.count("\n") == 1
    assert (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    from sb3_gpu.common.errors import ConfigError
    from sb3_gpu.runs.curves import plot_runs

    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "0.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n1,2,3\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'matplotlib>=[\d.]+' \(sb3_gpu's \[plot\] extra\)"):
        plot_runs([tmp_path], tmp_path / "curves.png")


def test_plot_names_a_path_that_is_no_run_dir_and_a_plot_it_could_not_write(tmp_path, monkeypatch, call_main):
    from sb3_gpu import plot
    from sb3_gpu.runs import curves

    (tmp_path / "run" / "monitor").mkdir(parents=True)
    (tmp_path / "run" / "monitor" / "0.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n1,2,3\n')
    (tmp_path / "run" / "model.zip").write_bytes(b"PK")
    monkeypatch.chdir(tmp_path)
    # A model file given for its run: said as such, not as a plot folder that a file is in the way of.
    result = call_main(plot.main, "run/model.zip")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: run/model.zip is a file; give the run dir written by"), result.stderr

    monkeypatch.setattr(curves, "atomic_write_bytes", disk_full)
    result = call_main(plot.main, "run")
    assert (result.returncode, result.stderr) == (1, "error: cannot write the plot: No space left on device\n")
    assert not (tmp_path / "run" / "curves.png").exists()


def _screenshot_tool():
    spec = importlib.util.spec_from_file_location("dashboard_screenshot", REPO / "tools" / "dashboard_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:  # a local server this test started
        return response.read()


@pytest.mark.heavy
def test_a_real_tensorboard_server_serves_the_dashboard_and_a_series(tmp_path):
    model = DQN("MlpPolicy", "CartPole-v1", learning_starts=0, policy_kwargs={"net_arch": [16]}, tensorboard_log=str(tmp_path))
    model.learn(1500, callback=ThroughputCallback(warmup_s=0.0, record_s=0.0), tb_log_name="seed0")
    tool = _screenshot_tool()

    def serve() -> tuple[subprocess.Popen, int]:
        port = tool._free_port()
        cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port)]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port

    server, port = serve()
    try:
        deadline, layout, series, starts = time.monotonic() + 90, None, None, 1
        # Until both are served: the layout reads {} until the server has loaded the event file.
        while time.monotonic() < deadline and not (series and layout and layout.get("category")):
            time.sleep(1)
            if server.poll() is not None and starts < 3:  # another process took the free port first: another one
                server, port = serve()
                starts += 1
            base = f"http://127.0.0.1:{port}/data/plugin"
            try:
                layout = json.loads(_get(f"{base}/custom_scalars/layout"))
                runs = json.loads(_get(f"http://127.0.0.1:{port}/data/runs"))
                if runs:
                    data = _get(f"{base}/scalars/scalars?run={runs[0]}&tag=throughput/env_steps_per_s")
                    series = json.loads(data)
            except OSError:
                continue
        assert layout and {c["title"] for c in layout.get("category", [])} == set(DASHBOARD), layout
        assert series and all(point[2] > 0 for point in series), series
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.heavy
@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium (.ci/run installs Debian's where apt-get can)")
def test_headless_chromium_renders_the_dashboard(tmp_path):
    model = DQN("MlpPolicy", "CartPole-v1", learning_starts=0, policy_kwargs={"net_arch": [16]}, tensorboard_log=str(tmp_path))
    model.learn(1500, callback=ThroughputCallback(warmup_s=0.0, record_s=0.0))
    out = tmp_path / "dashboard.png"
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "dashboard_screenshot.py"), str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, "a rendered page, not a blank one"


def test_cuda_memory_and_gpu_use_are_recorded_on_a_cuda_device(monkeypatch):
    model = DQN("MlpPolicy", "CartPole-v1", policy_kwargs={"net_arch": [8]})
    callback = ThroughputCallback(warmup_s=0.0)
    model.learn(10, callback=callback)  # sets the callback up; then pretend the model sits on a GPU
    monkeypatch.setattr(model, "device", th.device("cuda", 0))
    monkeypatch.setattr(th.cuda, "memory_allocated", lambda device: 300 * 2**20)
    monkeypatch.setattr(th.cuda, "max_memory_allocated", lambda device: 512 * 2**20)
    monkeypatch.setattr("sb3_gpu.runs.telemetry._gpu_util", lambda index: 87.0)
    callback._record(time.perf_counter())
    assert callback.latest["cuda_allocated_mib"] == 300 and callback.latest["cuda_peak_mib"] == 512
    assert callback.latest["gpu_util_percent"] == 87.0 and "GPU mem 300 MiB" in callback.line()


def test_a_live_line_is_printed_every_report_s():
    lines: list[str] = []
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1)
    model.learn(64 * 6, callback=ThroughputCallback(warmup_s=0.0, record_s=0.0, report_s=0.0, print_fn=lines.append))
    assert len(lines) >= 4 and all("steps/s" in line and "env " in line and "train " in line for line in lines)
    # Where the run is, against its total, with the time left at this speed and the latest episodes' return.
    assert re.match(r"^\d{2,3}/384 steps \(\d+%\) \| \d+:\d\d left \| return \d+\.\d \| ", lines[1]), lines[1]
    assert lines[-1].startswith("384/384 steps (100%) | return ")  # nothing left: no time left shown
    hourly: list[str] = []  # the same records, but a line is due only an hour in
    quiet = ThroughputCallback(warmup_s=0.0, record_s=0.0, report_s=3600.0, print_fn=hourly.append)
    model.learn(64 * 6, callback=quiet)
    assert hourly == [] and quiet.latest["env_steps_per_s"] > 0


def test_the_time_left_counts_from_the_first_update_not_from_the_warm_up(monkeypatch):
    # A fake clock: the 300 warm-up steps (no updates) take 10 ms each, the steps that train take 1 s each.
    import gymnasium as gym

    clock = [0.0]

    class Costed(gym.Wrapper):
        def step(self, action):
            clock[0] += 0.01 if self.unwrapped_model.num_timesteps < 300 else 1.0
            return self.env.step(action)

    monkeypatch.setattr("sb3_gpu.runs.telemetry.time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    env = Costed(gym.make("CartPole-v1"))
    model = DQN("MlpPolicy", env, learning_starts=300, train_freq=1, buffer_size=1000, seed=0)
    env.unwrapped_model = model
    lines: list[str] = []
    model.learn(400, callback=ThroughputCallback(warmup_s=0.0, record_s=0.0, report_s=0.0, print_fn=lines.append))
    shown = {int(line.split("/")[0].replace(",", "")): line for line in lines}
    assert all(" left |" not in line for done, line in shown.items() if done < 300)  # no measure of training yet
    # 1 s a step from then on: the last lines before the end say ~(400 - done) s; the whole run's average would say a
    # third of that.
    late = [(done, line) for done, line in shown.items() if 340 <= done < 400]
    assert late
    for done, line in late:
        minutes, seconds = re.search(r"\| (\d+):(\d\d) left \|", line).groups()
        assert abs(60 * int(minutes) + int(seconds) - (400 - done)) <= 2, line


def test_curves_leave_out_the_time_between_a_stop_and_its_resume(tmp_path):
    from sb3_gpu.runs.curves import load_curves

    monitor = tmp_path / "run" / "monitor"
    monitor.mkdir(parents=True)
    # The first stretch (set aside by the resume as .seg1), two envs; the resume, a day later, writes the current files.
    (monitor / "0.seg1.monitor.csv").write_text('#{"t_start": 100.0}\nr,l,t\n1,10,10.0\n2,10,20.0\n')
    (monitor / "1.seg1.monitor.csv").write_text('#{"t_start": 101.0}\nr,l,t\n3,10,14.0\n')
    (monitor / "0.monitor.csv").write_text('#{"t_start": 86500.0}\nr,l,t\n4,10,5.0\n')
    (monitor / "1.monitor.csv").write_text('#{"t_start": 86500.5}\nr,l,t\n5,10,15.0\n')
    curves = load_curves(tmp_path / "run")
    assert curves["returns"].tolist() == [1, 3, 2, 4, 5]
    # The resume begins where the first stretch's last episode ended (20 s in): 20 + 5, 20 + 0.5 + 15.
    assert curves["seconds"].tolist() == pytest.approx([10, 15, 20, 25, 35.5])
    assert curves["steps"].tolist() == [10, 20, 30, 40, 50]


def test_curves_keep_the_segments_in_their_order_whatever_the_clocks_say(tmp_path):
    from sb3_gpu.runs.curves import load_curves

    monitor = tmp_path / "run" / "monitor"
    monitor.mkdir(parents=True)
    # Resumed on a machine whose clock is behind (the current files start "before" the first stretch ended), and
    # eleven stretches in all: seg10 comes after seg2, the current files after every seg.
    for k in range(1, 11):
        (monitor / f"0.seg{k}.monitor.csv").write_text(f'#{{"t_start": {1000.0 * k}}}\nr,l,t\n{k},10,10.0\n')
    (monitor / "0.monitor.csv").write_text('#{"t_start": 5.0}\nr,l,t\n11,10,10.0\n')
    curves = load_curves(tmp_path / "run")
    assert curves["returns"].tolist() == list(range(1, 12))
    assert curves["seconds"].tolist() == pytest.approx([10.0 * k for k in range(1, 12)])


@pytest.mark.parametrize(("env", "per_step"), [("ALE/Pong-v5", 4), ("PongNoFrameskip-v4", 4), ("CartPole-v1", 1)])
def test_curves_count_agent_steps_where_the_monitor_counts_emulator_frames(tmp_path, env, per_step):
    from sb3_gpu.runs.curves import load_curves

    monitor = tmp_path / "run" / "monitor"
    monitor.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(f"version: 1\nalgo: dqn\nenv: {env}\n")
    # On Atari the Monitor sits below SB3's frame skip: its episode lengths are emulator frames, 4 to an agent step.
    (monitor / "0.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n-21,800,1.0\n-20,1200,2.0\n')
    assert load_curves(tmp_path / "run")["steps"].tolist() == [800 / per_step, 2000 / per_step]


def test_a_learn_interrupted_in_a_notebook_leaves_no_timer_on_the_env_for_the_next_one(tmp_path):
    # SB3 skips _on_training_end when learn raises: each interrupted cell left one more timing layer on the env's
    # methods, which no later callback removed.
    from stable_baselines3.common.callbacks import BaseCallback

    class Interrupt(BaseCallback):
        def _on_step(self) -> bool:
            if self.n_calls == 20:
                raise KeyboardInterrupt  # Jupyter's interrupt, raised in the main thread
            return True

    model = PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1, device="cpu")
    venv = model.env.unwrapped
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            model.learn(10_000, callback=[ThroughputCallback(dashboard=False), Interrupt()])
    model.learn(64, callback=ThroughputCallback(dashboard=False))
    assert not {"step_async", "step_wait", "reset"} & set(vars(venv))


def test_the_row_written_at_the_end_of_learn_carries_its_timestep(tmp_path):
    # SB3's rows each hold time/total_timesteps; the one the callback writes as training ends had none, so a
    # progress.csv plotted against it had a blank at the end of each learn().
    import csv

    from stable_baselines3.common.logger import configure

    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1)
    model.set_logger(configure(str(tmp_path), ["csv"]))
    model.learn(192, callback=ThroughputCallback(window_s=1.0, warmup_s=0.0, record_s=0.0))
    with open(tmp_path / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # One row per step: SB3's write after the last rollout waits for its training, and the callback's figures, as
    # learn() ends (TensorBoard drew two points at that step, 0.1 s apart, each train/ tag with two values).
    assert [row["time/total_timesteps"] for row in rows] == ["64", "128", "192"]
    rated = [row["time/total_timesteps"] for row in rows if row["throughput/env_steps_per_s"]]
    assert rated == ["128", "192"] and rows[-1]["time/fps"] and rows[-1]["train/loss"]


class _Game(gym.Env):
    """Three lives of ten steps each: a whole game is thirty steps."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {"lives": 3}

    def step(self, action):
        self.t += 1
        return np.zeros(2, np.float32), 1.0, self.t == 30, False, {"lives": 3 - self.t // 10}


class _LifeEnds(gym.Wrapper):
    """Ends the episode at each life lost, for training, as SB3's Atari wrapper does; a reset after one goes on."""

    def reset(self, **kwargs):
        if getattr(self, "_game_on", False):
            self._game_on = False
            return np.zeros(2, np.float32), {}  # the game goes on from where the life was lost
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        lost = info["lives"] < getattr(self, "_lives", 3)
        self._lives = 3 if terminated else info["lives"]
        self._game_on = lost and not terminated
        return obs, reward, terminated or lost, truncated, info


@pytest.mark.parametrize("monitor", [True, False])
def test_episodes_per_s_counts_whole_games_where_a_monitor_says_when_one_ended(monitor):
    # Atari's training env ends an episode at each life lost: counting dones said three episodes a game.
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    games: list[Monitor] = []

    def make():
        game = Monitor(_Game()) if monitor else _Game()
        games.append(game)
        return _LifeEnds(game)

    venv = DummyVecEnv([make, make])
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, n_epochs=1)
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0, dashboard=False)
    model.learn(256, callback=callback)
    seconds = callback.latest["window_s"]
    # Each env took 128 steps (4 whole games, 12 lives): with no Monitor, every done is an episode.
    ended = sum(len(game.get_episode_rewards()) for game in games) if monitor else 2 * 12
    assert callback.latest["episodes_per_s"] * seconds == pytest.approx(ended)
    assert ended == (8 if monitor else 24)


def test_a_learn_that_raises_after_its_last_rollout_leaves_the_loggers_writes_as_they_were(tmp_path):
    # The writes after the last rollout wait for the callback's last one; SB3 skips on_training_end when learn()
    # raises, and a user's own logger then wrote nothing more, in this learn() or the next.
    import csv

    from stable_baselines3.common.logger import configure

    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1)
    model.set_logger(configure(str(tmp_path), ["csv"]))
    real_train, calls = model.train, []

    def train():
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C in the last training
            raise KeyboardInterrupt
        real_train()

    model.train = train
    with pytest.raises(KeyboardInterrupt):
        model.learn(128, callback=ThroughputCallback(dashboard=False, record_s=0.0))
    model.learn(320, reset_num_timesteps=False)  # no telemetry: SB3's own writes, one per rollout
    with open(tmp_path / "progress.csv", newline="") as f:
        steps = [row["time/total_timesteps"] for row in csv.DictReader(f)]
    # What waited at 128 goes with the next learn()'s first write (as SB3 writes what a learn() left recorded), then
    # that learn's own four.
    assert steps == ["64", "192", "256", "320", "384", "448"]


def test_a_vec_env_that_cannot_say_how_its_envs_are_wrapped_is_measured_by_its_dones():
    from stable_baselines3.common.vec_env import DummyVecEnv

    class Unsaid(DummyVecEnv):
        def env_is_wrapped(self, wrapper_class, indices=None):
            raise NotImplementedError("not supported")

    venv = Unsaid([lambda: _LifeEnds(_Game())] * 2)
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, n_epochs=1)
    callback = ThroughputCallback(window_s=1e9, warmup_s=0.0, record_s=0.0, dashboard=False)
    model.learn(256, callback=callback)
    assert callback.latest["episodes_per_s"] * callback.latest["window_s"] == pytest.approx(24)


def test_an_empty_monitor_file_leaves_the_time_axis_as_it_was(tmp_path):
    # A run stopped between opening a Monitor file and writing its header leaves it empty: its start read as 0, and
    # the other files' episodes were drawn 1.8e9 s (their epoch times) along the axis.
    from sb3_gpu.runs.curves import load_curves

    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "0.monitor.csv").write_text('#{"t_start": 1796000000.0}\nr,l,t\n1,2,3.5\n4,5,7.0\n')
    (tmp_path / "monitor" / "1.monitor.csv").write_text("")
    assert list(load_curves(tmp_path)["seconds"]) == [3.5, 7.0]


def test_each_run_has_a_name_of_its_own_in_the_legend(tmp_path, monkeypatch):
    # Only the folder's name: two exp*/ppo runs read "ppo" twice, "." an empty name, "_baseline" one matplotlib hides.
    from pathlib import Path

    from sb3_gpu.runs.curves import run_labels

    monkeypatch.chdir(tmp_path)
    assert run_labels([Path("exp1/ppo"), Path("exp2/ppo")]) == ["exp1/ppo", "exp2/ppo"]
    assert run_labels([Path("_baseline"), Path("dqn")]) == [" _baseline", "dqn"]
    assert run_labels([Path(".")]) == [tmp_path.name]


def test_a_damaged_evaluations_file_is_not_said_to_hold_pickled_data(tmp_path):
    (tmp_path / "run" / "monitor").mkdir(parents=True)
    (tmp_path / "run" / "monitor" / "0.monitor.csv").write_text('#{"t_start": 1.0}\nr,l,t\n1,2,3\n4,5,6\n')
    (tmp_path / "run" / "eval").mkdir()
    (tmp_path / "run" / "eval" / "evaluations.npz").write_bytes(b"garbage\n")  # numpy: "contains pickled (object) data"
    result = run_cli("sb3_gpu.plot", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "warning: cannot read run/eval/evaluations.npz (damaged); the evaluations are left out\n"
