"""The bench command runs end to end and prints its ratios (the figures themselves are for the README, not tests)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import types
from pathlib import Path

import pytest

from sb3_gpu import bench
from sb3_gpu.benches import speed, telemetry
from sb3_gpu.extensions.per import tree_backends
from tests.conftest import disk_full


@pytest.mark.heavy
def test_bench_speed_prints_a_row_per_switch(monkeypatch, capsys):
    tiny = {"n_envs": 2, "n_steps": 16, "batch_size": 16, "n_epochs": 1, "net_arch": [16]}
    monkeypatch.setattr(speed, "SPEED_CASES", [("tiny PPO", "ppo", "CartPole-v1", tiny)])
    assert bench.main(["speed", "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "4096x256 @ 256x256 matmul" in out and "native bf16:" in out
    rows = [line for line in out.splitlines() if line.startswith("tiny PPO")]
    assert all(r.startswith("tiny PPO (16, batch 16)") for r in rows), rows  # the network and batch the plan built
    assert [r.split("  ")[1].strip() for r in rows] == ["bf16 autocast", "torch.compile", "2 threads"]
    assert all(len(re.findall(r"\d+\.\d\dx", r)) == 2 for r in rows)


@pytest.mark.heavy
def test_bench_per_times_each_tree_backend_and_the_gradient_step(capsys):
    assert bench.main(["per", "--repeats", "1", "--capacities", "1000", "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    backends = tree_backends()
    for backend in backends:
        assert re.search(rf"sample\(32\) \+ update @ 1e\+03, {backend} tree.*\d\.\d\dx", out), out
    assert re.search(r"DQN gradient step .* <= 1.25x (ok|MISSED)", out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--envs", "NoSuchEnv-v0"], "unknown env id 'NoSuchEnv-v0'"),
        (["--algos", "ppo", "--envs", "Pendulum-v1"], "Pendulum-v1 registers no reward_threshold; pass --target"),
        (["--algos", "dqn", "--envs", "Pendulum-v1", "--target", "-200"], "dqn needs a Discrete action space"),
        (["--algos", "dqn", "--envs", "Pendulum-v1", "--threshold", "-200"], "dqn needs a Discrete action space"),
        (["--algos", "ppo", "--per", "on"], "--per on: prioritized replay is for dqn and qrdqn, and --algos has neither"),
    ],
)
def test_bench_solve_refuses_what_it_cannot_train_in_one_line(capsys, args, message):
    assert bench.main(["solve", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.heavy
def test_bench_solve_trains_each_case_in_its_own_process_and_evaluates_the_best_on_fresh_episodes(tmp_path, capsys):
    import json

    args = ["solve", "--seeds", "0", "1", "--per", "on", "off", "--timesteps", "1024", "--episodes", "3"]
    assert bench.main([*args, "--target", "20", "--jobs", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "solve.json").read_text())["rows"]
    assert [(r["per"], r["seed"]) for r in rows] == [(True, 0), (True, 1), (False, 0), (False, 1)]  # the order asked
    for row in rows:
        assert row["model"] == "best_model.zip" and row["reported_best"] is not None and row["wall_s"] > 0
        assert row["evaluated"] >= 8  # CartPole returns one per step: no episode is shorter than 8
    markdown = (tmp_path / "solve.md").read_text()
    assert all(row["compile_used"] == "false" for row in rows)  # runs this short do not earn a compile back
    assert re.search(r"\| dqn \| CartPole-v1 \| on \| auto \| 0/2 \| \d/2 \(>= 20\) \|", markdown), markdown
    out = capsys.readouterr().out  # each seed's line as it ends, figures to one decimal
    line = r"seed 1: best_model\.zip \d+\.\d \+/- \d+\.\d on 3 fresh episodes \(reported best \d+\.\d\) in \d+ s"
    assert re.search(line, out), out


@pytest.mark.heavy
def test_bench_solve_trains_a_preset_file_in_place_of_the_bundled_one(tmp_path, capsys):
    import json

    preset = tmp_path / "mine.yaml"
    preset.write_text("CartPole-v1:\n  n_timesteps: 640\n  learning_starts: 64\n  net_arch: [16]\n")
    args = ["solve", "--seeds", "0", "--per", "off", "--episodes", "2", "--target", "20", "--preset", str(preset)]
    assert bench.main([*args, "--eval-freq", "200", "--out", str(tmp_path / "out")]) == 0
    (row,) = json.loads((tmp_path / "out" / "solve.json").read_text())["rows"]
    assert row["preset"] == str(preset) and row["trained"] == 640, row
    assert row["eval_freq"] == 200 and row["best_at"] in (200, 400, 600), row  # not the default's tenths, 64 apart
    assert "preset mine.yaml, evaluated every 200 steps, seed 0: best_model.zip" in capsys.readouterr().out
    preset.write_text("CartPole-v1:\n  bach_size: 64\n")
    assert bench.main([*args, "--out", str(tmp_path / "out")]) == 2
    assert "unknown key 'bach_size'; did you mean 'batch_size'" in capsys.readouterr().err


@pytest.mark.parametrize("callback", ["telemetry", "guard", "session"])
def test_bench_telemetry_prints_the_overhead(monkeypatch, capsys, callback):
    tiny = {"n_envs": 2, "n_steps": 16, "batch_size": 16, "n_epochs": 1, "net_arch": [16]}
    monkeypatch.setattr(telemetry, "TELEMETRY_CASES", [("tiny PPO", "ppo", "CartPole-v1", tiny)])
    built: list[list[str]] = []
    real = telemetry.callbacks_for

    def recorded(which: str):
        callbacks = real(which)
        built.append(sorted(type(c).__name__ for c in callbacks))
        return callbacks

    monkeypatch.setattr(telemetry, "callbacks_for", recorded)
    assert bench.main(["telemetry", "--repeats", "1", "--callback", callback]) == 0
    assert re.search(r"tiny PPO\s+\d+\s+\d+\s+[+-]\d+\.\d%\s+[+-]\d+\.\d%", capsys.readouterr().out)
    assert built and all(names == sorted(type(c).__name__ for c in real(callback)) for names in built)  # the one asked for


@pytest.mark.heavy
def test_bench_envs_writes_json_and_markdown_with_ratios_to_the_better_sb3_class(tmp_path, capsys):
    import json

    args = ["envs", "--envs", "CartPole-v1", "--n-envs", "2", "--seconds", "0.05", "--repeats", "1"]
    assert bench.main([*args, "--startup-workers", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "envs.json").read_text())
    rows = {r["backend"]: r for r in data["rows"]}
    assert {"dummy", "subproc", "batched", "auto"} <= rows.keys()
    best = max(rows["dummy"]["steps_per_s"], rows["subproc"]["steps_per_s"])
    for row in rows.values():  # a ratio of unrounded medians: it may differ from that of the rounded ones in the last digit
        assert row["vs_best_sb3"] == pytest.approx(row["steps_per_s"] / best, abs=1e-3)
    assert rows["batched"]["class"] == "BatchedSubprocVecEnv" and rows["subproc"]["class"] == "SubprocVecEnv"
    markdown = (tmp_path / "envs.md").read_text()
    assert (
        markdown.startswith("`python -m sb3_gpu.bench envs --envs CartPole-v1") and "| CartPole-v1 | 2 | batched |" in markdown
    )


@pytest.mark.heavy
def test_bench_train_runs_the_preset_and_the_zoo_baseline_side_by_side(tmp_path, capsys):
    import json

    args = ["train", "--seeds", "0", "--threshold", "30", "--max-timesteps", "2048", "--eval-freq", "512"]
    assert bench.main([*args, "--eval-episodes", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "train.json").read_text())
    for name in ("sb3_gpu", "sb3_zoo"):
        (run,) = data[name]["runs"]
        assert run["timesteps"] <= 2048 + 256 and run["train_seconds"] > 0 and run["steps_per_s"] > 0
    assert data["sb3_gpu"]["runs"][0]["plan_seconds"] > 0 and data["sb3_gpu"]["median_plan_seconds"] > 0
    assert "| SB3 + rl-zoo3 values |" in (tmp_path / "train.md").read_text()
    assert "sb3_gpu's plan took" in (tmp_path / "train.md").read_text()
    assert data["plan"].endswith(", compile false"), data["plan"]  # planned for its 2,048 steps, too few to earn it


def test_bench_train_trains_the_baseline_with_torchs_own_settings_not_those_a_plan_left(monkeypatch):
    from sb3_gpu.benches import train
    from sb3_gpu.common.torch_settings import TorchSettings

    seen = []
    monkeypatch.setattr(train, "zoo_model", lambda *args, **kwargs: None)
    monkeypatch.setattr(train, "train_once", lambda *args, **kwargs: seen.append(TorchSettings.current()) or {"seed": 0})
    plain = TorchSettings(2, False, False, False)
    monkeypatch.setattr(train, "SB3_TORCH", plain)
    before = TorchSettings.current()
    try:
        TorchSettings(1, True, True, True).apply()  # as a CUDA plan for a small CNN leaves them
        assert train._train_side("sb3_zoo", "sac", "Pendulum-v1", 0, None, 1000, -200.0, 100, 2)["threads"] == 2
    finally:
        before.apply()
    assert seen == [plain]


def test_bench_train_refuses_a_seeds_plan_whose_envs_the_evaluation_interval_does_not_divide():
    # bench_train checks the interval against its first, unprobed plan; a seed's probed plan may take another profile
    # with another env count (on a GPU machine), so each seed's is checked too, before it trains.
    from sb3_gpu.benches import train
    from sb3_gpu.common.errors import ConfigError

    with pytest.raises(ConfigError, match="--eval-freq 6 is not a multiple of the 8 envs seed 0's plan steps"):
        train._train_side("sb3_gpu", "dqn", "CartPole-v1", 0, 2048, 2048, 30.0, 6, 2)


def test_bench_train_refuses_a_seed_twice_and_evaluations_the_two_sides_would_take_at_other_steps(capsys):
    assert bench.main(["train", "--seeds", "0", "1", "0"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "--seeds names 0 more than once" in err
    assert bench.main(["solve", "--seeds", "3", "3"]) == 2
    assert "--seeds names 3 more than once" in capsys.readouterr().err
    for args, named in (
        (["--algos", "ppo", "ppo"], "--algos names ppo"),
        (["--envs", "Acrobot-v1", "Acrobot-v1"], "--envs names"),
    ):
        assert bench.main(["solve", *args]) == 2  # each case trained twice, and counted twice in the table
        assert f"{named}" in capsys.readouterr().err
    # DQN's CartPole preset steps 8 envs, rl-zoo3's 1: every 500 env steps is 496 for one side and 500 for the other.
    args = ["train", "--algo", "dqn", "--seeds", "0", "--threshold", "30", "--max-timesteps", "2048", "--eval-freq", "500"]
    assert bench.main(args) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "--eval-freq 500 is not a multiple of 8: sb3_gpu steps 8 envs at once and the baseline 1" in err


def test_bench_train_keeps_each_run_as_it_ends_and_goes_on_from_them(tmp_path, monkeypatch, capsys):
    import json

    from sb3_gpu.benches import train

    trained: list[tuple[str, int]] = []
    signals = [KeyboardInterrupt("stopped by SIGINT")]  # one, for the fourth run: under way when it came

    def fake_side(side, algo, env_id, seed, max_timesteps, budget, threshold, every, episodes):
        if (side, seed) == ("sb3_zoo", 1) and signals:
            raise signals.pop()
        trained.append((side, seed))
        run = {"seed": seed, "reached": True, "timesteps": 1000 * (seed + 1), "train_seconds": 10.0 + seed}
        return {**run, "steps_per_s": 100.0, "best": 31.0, **({"plan": "device cpu"} if side == "sb3_gpu" else {})}

    monkeypatch.setattr(train, "_train_side", fake_side)
    args = ["train", "--seeds", "0", "1", "--threshold", "30", "--max-timesteps", "2048", "--out", str(tmp_path)]
    assert bench.main(args) == 130
    assert "the runs that ended are kept in" in capsys.readouterr().err
    saved = json.loads((tmp_path / "train-runs-ppo-CartPole-v1.json").read_text())
    assert sorted(saved["runs"]["sb3_gpu"]) == ["0", "1"] and sorted(saved["runs"]["sb3_zoo"]) == ["0"]
    assert not (tmp_path / "train.json").exists()

    assert bench.main(args) == 0  # the same command trains only the run that was lost
    assert trained == [("sb3_gpu", 0), ("sb3_zoo", 0), ("sb3_gpu", 1), ("sb3_zoo", 1)]
    data = json.loads((tmp_path / "train.json").read_text())
    assert [r["seed"] for r in data["sb3_zoo"]["runs"]] == [0, 1] and data["sb3_zoo"]["median_train_seconds"] == 10.5
    assert data["budget"] == 2048 and data["plan"] == "device cpu"

    other = [a if a != "30" else "40" for a in args]
    assert bench.main(other) == 2  # other settings: refused, not mixed in
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "train-runs-ppo-CartPole-v1.json holds runs with other settings: threshold 30.0 (now 40.0)" in err, err
    # Runs of another baseline, or of other code, are not comparable either.
    monkeypatch.setitem(train.ZOO, ("ppo", "CartPole-v1"), {**train.ZOO["ppo", "CartPole-v1"], "n_epochs": 10})
    assert bench.main(args) == 2
    assert "holds runs with other settings: baseline_sha256" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(train, "_train_side", fake_side)
    monkeypatch.setattr(train, "versions", lambda: "sb3_gpu 9.9")
    assert bench.main(args) == 2
    assert "(now 'sb3_gpu 9.9')" in capsys.readouterr().err
    (tmp_path / "train-runs-ppo-CartPole-v1.json").write_text("[1, 2]")
    assert bench.main(args) == 2
    assert "train-runs-ppo-CartPole-v1.json is not a saved bench train" in capsys.readouterr().err
    assert len(trained) == 4


def test_zoo_schedules_decay_over_rl_zoo3s_length_whatever_the_budget():
    from sb3_gpu.benches.train import zoo_model

    sac = zoo_model("sac", "LunarLanderContinuous-v3", seed=0, budget=300_000)
    # lin_7.3e-4 over rl-zoo3's 500k steps: at the end of a 300k budget 2/5 of it is left.
    assert sac.lr_schedule(1.0) == pytest.approx(7.3e-4) and sac.lr_schedule(0.0) == pytest.approx(7.3e-4 * 0.4)
    assert sac.policy.net_arch == [400, 300] and sac.learning_starts == 10_000 and sac.tau == 0.01
    ppo = zoo_model("ppo", "CartPole-v1", seed=0, budget=100_000)  # no length of its own: over the budget
    assert ppo.lr_schedule(0.0) == 0.0 and ppo.lr_schedule(1.0) == pytest.approx(1e-3)
    # DQN's epsilon falls to 0.04 over 0.16 of rl-zoo3's 50k steps, 8,000, whatever the budget: halfway at 4,000.
    for algo in ("dqn", "qrdqn"):
        dqn = zoo_model(algo, "CartPole-v1", seed=0, budget=100_000)
        assert dqn.exploration_schedule(1 - 8_000 / 100_000) == pytest.approx(0.04)
        assert dqn.exploration_schedule(1 - 4_000 / 100_000) == pytest.approx((1 + 0.04) / 2)
        dqn.get_env().close()
    for model in (sac, ppo):
        model.get_env().close()


def test_bench_envs_and_train_refuse_bad_names(capsys):
    assert bench.main(["envs", "--envs", "CartPol-v1", "--startup-workers", "0"]) == 2
    assert "did you mean 'CartPole-v1'" in capsys.readouterr().err
    assert bench.main(["train", "--env", "Pong-v5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no rl-zoo3 baseline for ppo Pong-v5 (have: dqn CartPole-v1" in err[0]


def test_bench_train_takes_an_atari_game_as_its_baselines_list_says(capsys, monkeypatch):
    from sb3_gpu.benches import train

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "bench_train", stop)  # past the checks, the comparison would start here
    assert bench.main(["train", "--env", "ALE/Pong-v5"]) == 2  # ale-py's ids registered, as the comparison needs them
    assert "ALE/Pong-v5 registers no reward_threshold; pass --threshold" in capsys.readouterr().err
    for game in ("ALE/Pong-v5", "Pong-v4"):  # an older id, an Atari game once ale-py's ids are registered
        assert bench.main(["train", "--env", game, "--threshold", "0"]) == 130
        assert "no rl-zoo3 baseline" not in capsys.readouterr().err
    assert bench.main(["train", "--algo", "dqn", "--env", "ALE/Pong-v5"]) == 2
    err = capsys.readouterr().err
    assert "no rl-zoo3 baseline for dqn ALE/Pong-v5 (have: dqn CartPole-v1" in err and "ppo on Atari games" in err


@pytest.mark.heavy
def test_bench_train_evaluates_each_side_of_an_atari_comparison_on_stacked_frames(monkeypatch):
    # The eval env had no frame stack: a (1, 84, 84) frame for a model of (4, 84, 84), refused at the first evaluation.
    from sb3_gpu.benches import train
    from sb3_gpu.benches.train import _train_side, train_once
    from sb3_gpu.planning.build import build_env, build_model
    from sb3_gpu.planning.plan import make_plan

    small_zoo = {**train.ZOO_ATARI["ppo"], "n_envs": 2, "n_steps": 32, "batch_size": 64, "n_epochs": 1}
    monkeypatch.setitem(train.ZOO_ATARI, "ppo", small_zoo)  # rl-zoo3's wrappers and frame stack, a shorter rollout
    run = _train_side("sb3_zoo", "ppo", "ALE/Pong-v5", 0, None, 64, 21.0, 64, 1)
    assert run["timesteps"] == 64 and not run["reached"]
    small = {"n_envs": 2, "n_steps": 64, "batch_size": 64, "n_epochs": 1, "probe": False, "compile": False}
    plan = make_plan("ppo", "ALE/Pong-v5", "cpu", seed=0, vec_env="dummy", overrides=small)
    ours = train_once(build_model(plan, build_env(plan)), "ALE/Pong-v5", 128, 21.0, 128, 1, 0, plan.preset.frame_stack)
    assert ours["timesteps"] == 128 and not ours["reached"]


@pytest.mark.heavy
@pytest.mark.parametrize("env_id", ["ALE/Pong-v5", "Pong-v4"])
def test_the_zoo_baseline_makes_atari_games_in_worker_processes_with_the_ids_own_frame_skip_off(monkeypatch, env_id):
    # SubprocVecEnv's workers start with no ale-py ids registered (bench gpu's zoo row died in them), and Pong-v4
    # skips 2 to 4 frames itself, under AtariWrapper's 4.
    from stable_baselines3.common.vec_env import SubprocVecEnv

    from sb3_gpu.benches import train

    monkeypatch.setitem(train.ZOO_ATARI, "ppo", {**train.ZOO_ATARI["ppo"], "n_envs": 2})
    model = train.zoo_model("ppo", env_id, 0, vec_env_cls=SubprocVecEnv, device="cpu", budget=1_000)
    env = model.get_env()
    try:
        assert env.observation_space.shape == (4, 84, 84) and env.get_attr("unwrapped")[0]._frameskip == 1
    finally:
        env.close()


@pytest.mark.parametrize("option", [["--n-envs", "8", "5000"], ["--startup-workers", "100000"]])
def test_bench_envs_refuses_more_processes_than_a_machine_runs_before_starting_any(option, capsys):
    assert bench.main(["envs", "--envs", "CartPole-v1", *option]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "start one process per env: at most 1024 (got" in err


@pytest.mark.heavy
def test_bench_gpu_runs_on_the_cpu_and_writes_the_sample_and_training_ratios(tmp_path, capsys):
    import json

    args = ["gpu", "--device", "cpu", "--capacity", "256", "--batch", "32", "--envs", "CartPole-v1", "--steps", "1536"]
    assert bench.main([*args, "--repeats", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["sample"]["capacity"] == 256 and data["sample"]["speedup"] > 0 and data["sample"]["per_speedup"] > 0
    rows = {row["algo"]: row for row in data["training"]}
    assert rows.keys() == {"ppo", "dqn"}
    # PPO CartPole has an rl-zoo3 baseline (plain SB3 on SubprocVecEnv); every DQN row ran SB3's count of updates.
    assert list(rows["ppo"]["variants"]) == ["sb3", "device", "zoo"]
    assert list(rows["dqn"]["variants"]) == ["sb3", "device", "device+overlap"]
    # The preset trains 16 steps per rollout of 16 x 8 env steps once past learning_starts 1000: five rollouts.
    assert {f["grad_steps_per_1k"] for f in rows["dqn"]["variants"].values()} == {1000 * 5 * 16 / 1536}
    for row in rows.values():
        assert row["variants"]["sb3"]["ratio"] == 1.0 and row["variants"]["sb3"]["cpu_ratio"] == 1.0
        for f in row["variants"].values():
            assert f["steps_per_s"] > 0 and f["ratio"] > 0 and len(f["ratios"]) == 2
            assert f["gpu_utilisation"] is None and f["peak_memory_mib"] is None  # no GPU figures on a CPU
    # CPU time compares runs whose envs step in this process; the zoo baseline's step in subprocesses.
    assert rows["ppo"]["variants"]["zoo"]["cpu_ratio"] is None and rows["dqn"]["variants"]["device"]["cpu_ratio"] > 0
    markdown = (tmp_path / "gpu.md").read_text()
    assert "| ppo CartPole-v1 | plain SB3, rl-zoo3 values, SubprocVecEnv |" in markdown
    assert "| dqn CartPole-v1 | device buffers, overlapped training |" in markdown


@pytest.mark.heavy
def test_bench_step_counts_reads_ops_and_graph_breaks_per_variant(tmp_path, monkeypatch):
    import json

    from sb3_gpu.benches import step

    timed = []

    def recorded(fns, device, repeats):
        timed.append(len(fns))
        return step_interleaved(fns, device, repeats)

    step_interleaved = step.interleaved_medians
    monkeypatch.setattr(step, "interleaved_medians", recorded)
    # QR-DQN with prioritized replay inside its graph; TD3 with its delayed actor (a graph with it, one without).
    cases = ["dqn:CartPole-v1", "qrdqn+per:CartPole-v1", "ppo:CartPole-v1", "td3:Pendulum-v1"]
    assert bench.main(["step", "--cases", *cases, "--repeats", "1", "--out", str(tmp_path)]) == 0
    assert timed == [3, 3] * len(cases)  # each case's training, then its collection: its three variants in turn
    rows = {(r["case"], r["variant"]): r for r in json.loads((tmp_path / "step.json").read_text())["rows"]}
    assert set(rows) == {(c, v) for c in cases for v in ("sb3", "eager", "compiled")}
    for case in cases:
        sb3, eager, compiled = rows[case, "sb3"], rows[case, "eager"], rows[case, "compiled"]
        assert sb3["grad_reads"] >= 1 and eager["grad_reads"] == compiled["grad_reads"] == 0  # SB3 reads its losses
        assert eager["vec_reads"] <= 1  # the envs' actions (DQN's random ones read nothing)
        # Compiled steps launch at most a fifth of SB3's ops; QR-DQN's with PER (its 200 quantiles per action need a
        # matrix product where DQN's head is a fused sum of products) about a quarter: held there.
        limit = 0.3 if case.startswith("qrdqn") else 0.2
        assert compiled["graph_breaks"] == "0" and compiled["grad_ops"] <= limit * sb3["grad_ops"], case
    # The actions, the values and log-probs SB3's host buffer stores, torch.distributions' two checks (on, as in a new
    # process, though the QR-DQN case compiled before), and once per rollout the last values for the returns.
    assert rows["ppo:CartPole-v1", "sb3"]["vec_reads"] == pytest.approx(5, abs=0.1)
    assert rows["ppo:CartPole-v1", "eager"]["vec_reads"] == 1
    assert "| qrdqn+per:CartPole-v1 | compiled | 0.00 |" in (tmp_path / "step.md").read_text()


@pytest.mark.heavy
def test_bench_step_matmul_heads_times_the_compiled_step_with_its_narrow_layers_as_matrix_products(tmp_path):
    import json

    argv = [
        "step",
        "--cases",
        "dqn:CartPole-v1",
        "--repeats",
        "1",
        "--vec-steps",
        "8",
        "--matmul-heads",
        "--out",
        str(tmp_path),
    ]
    assert bench.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "step.json").read_text())["rows"]}
    assert list(rows) == ["sb3", "eager", "compiled", "compiled-mm"]
    narrow, matmul = rows["compiled"], rows["compiled-mm"]
    assert narrow["graph_breaks"] == matmul["graph_breaks"] == "0" and narrow["grad_reads"] == matmul["grad_reads"] == 0
    # The Q-network's 2-wide head: a fused sum of products forward and backward, where a matrix product is a library
    # call with kernels around it.
    assert narrow["grad_ops"] < matmul["grad_ops"]
    assert "| dqn:CartPole-v1 | compiled-mm | 0.00 |" in (tmp_path / "step.md").read_text()


def _op(name: str, *children: types.SimpleNamespace) -> types.SimpleNamespace:
    """A profiler event as bench step reads one: its name and the events it called."""
    return types.SimpleNamespace(name=name, cpu_children=list(children))


@pytest.mark.parametrize(
    ("tree", "counted"),
    [
        # A linear layer on the CPU: addmm copies its bias into the output (an op), then its GEMM runs inside it.
        (_op("aten::linear", _op("aten::t", _op("aten::transpose")), _op("aten::addmm", _op("aten::copy_"))), ["copy_"]),
        (
            _op(
                "aten::conv2d",
                _op(
                    "aten::convolution",
                    _op(
                        "aten::_convolution",
                        _op("aten::mkldnn_convolution", _op("aten::empty"), _op("aten::resize_"), _op("aten::as_strided_")),
                    ),
                ),
            ),
            ["mkldnn_convolution"],
        ),
        (_op("aten::mm", _op("aten::resolve_conj")), ["mm"]),
        (_op("aten::index", _op("aten::as_strided"), _op("aten::reshape", _op("aten::view"))), ["index"]),  # a gather
        (_op("aten::flatten", _op("aten::view")), []),
        (_op("aten::contiguous", _op("aten::clone", _op("aten::empty_like"), _op("aten::copy_"))), ["copy_"]),
        (_op("aten::zeros", _op("aten::empty"), _op("aten::zero_", _op("aten::fill_"))), ["fill_"]),
        (_op("aten::add_"), ["add_"]),
    ],
    ids=["linear", "conv2d", "mm", "index", "flatten", "contiguous", "zeros", "in-place"],
)
def test_bench_step_counts_each_kernel_once_and_views_as_none(tree, counted):
    from sb3_gpu.benches import step

    def walk(event):
        yield event
        for child in event.cpu_children:
            yield from walk(child)

    assert [e.name[6:] for e in walk(tree) if step._kernel(e)] == counted


@pytest.mark.heavy
def test_bench_step_counts_sb3s_argument_checks_after_a_compile_turned_them_off(monkeypatch):
    import torch as th

    from sb3_gpu.benches import step

    # What dynamo leaves after any compile in the process (an earlier case's compiled variant).
    monkeypatch.setattr(th.distributions.Distribution, "_validate_args", False)
    monkeypatch.setattr(step, "VARIANTS", ("sb3",))
    (row,) = step.bench_step(["sac:Pendulum-v1"], "cpu", repeats=1, vec_steps=8)
    # Per gradient step: four losses read for the log, and two checks of each of the two Normal distributions built;
    # per vec step: the actions and the exploring distribution's two checks.
    assert (row.grad_reads, row.vec_reads) == (10, 3)
    assert th.distributions.Distribution._validate_args is False  # left as it was found


def test_bench_step_times_a_cases_variants_in_turn(monkeypatch):
    import torch as th

    from sb3_gpu.benches import step

    calls, clock = [], [0.0]
    costs = {"sb3": [3.0, 1.0, 2.0], "eager": [5.0, 5.0, 4.0], "compiled": [1.0, 0.5, 9.0]}  # seconds, per call

    def variant(name):
        def call():
            clock[0] += costs[name][sum(c == name for c in calls)]
            calls.append(name)

        return call

    monkeypatch.setattr(step.time, "perf_counter", lambda: clock[0])
    medians = step.interleaved_medians([variant(n) for n in costs], th.device("cpu"), repeats=3)
    # Each repeat meets every variant once, so none is timed only after the others warmed the process (or tired it).
    rounds = [calls[i : i + 3] for i in range(0, 9, 3)]
    assert rounds[0] == ["sb3", "eager", "compiled"] and all(sorted(r) == sorted(costs) for r in rounds)
    assert medians == [2.0, 5.0, 1.0]
    # In shuffled order after the first round: no variant always runs after the same one.
    calls.clear()
    step.interleaved_medians([variant(n) for n in ("sb3", "eager", "compiled")], th.device("cpu"), repeats=3)
    orders = {tuple(calls[i : i + 3]) for i in range(0, 9, 3)}
    assert len(orders) > 1


def test_bench_gpu_refuses_a_cuda_device_this_machine_lacks(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert bench.main(["gpu", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: --device: device 'cuda' asked for a CUDA GPU, but torch sees none")
    assert bench.main(["step", "--device", "tpu"]) == 2  # the plan's own check and words
    assert capsys.readouterr().err == "error: --device: unknown device 'tpu'; accepted: auto, cpu, cuda, cuda:N, mps\n"


@pytest.mark.heavy
def test_bench_auto_times_auto_against_every_alternative_idle_and_beside_busy_work(tmp_path):
    import json

    args = ["auto", "--cases", "ppo:CartPole-v1", "--steps", "512", "--repeats", "1", "--compete", "1"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "auto.json").read_text())["rows"]
    assert [r["phase"] for r in rows] == ["idle", "beside 1 busy processes"]
    for row in rows:
        assert row["auto"] in row["steps_per_s"] and row["best"] in row["steps_per_s"]
        assert all(v > 0 for v in row["steps_per_s"].values()) and 0 < row["ratio"] <= 1
    assert "| ppo CartPole-v1 | idle |" in (tmp_path / "auto.md").read_text()


def test_bench_auto_that_cannot_start_its_busy_processes_says_so_in_one_line_and_stops_those_it_started(
    tmp_path, monkeypatch, capsys
):
    from sb3_gpu.benches import auto

    started = []
    real_popen = subprocess.Popen

    class Spinner:
        def __new__(cls, args, **kwargs):  # the subprocess module's own Popen for anything but a busy process
            return super().__new__(cls) if args[-1] == "while True: pass" else real_popen(args, **kwargs)

        def __init__(self, args, **kwargs):
            if started:
                raise BlockingIOError(11, "Resource temporarily unavailable")  # fork() at a process limit
            started.append(self)
            self.killed = False

        def kill(self):
            self.killed = True

        def wait(self):
            return -9

    monkeypatch.setattr(auto.subprocess, "Popen", Spinner)
    monkeypatch.setattr(auto, "_run", lambda *args: 1000.0)  # the idle phase's runs: not what this test is about
    args = ["auto", "--cases", "ppo:CartPole-v1", "--steps", "512", "--repeats", "1", "--compete", "2"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "error: cannot start busy process 2 of 2 for --compete: [Errno 11] Resource temporarily unavailable\n"
    )
    assert len(started) == 1 and started[0].killed


def test_bench_auto_refuses_a_case_it_cannot_read(capsys):
    assert bench.main(["auto", "--cases", "CartPole-v1"]) == 2
    assert capsys.readouterr().err.startswith("error: --cases: expected ALGO:ENV with ALGO one of ppo")
    assert bench.main(["auto", "--cases", "a2c:CartPole-v1"]) == 2
    assert capsys.readouterr().err.startswith("error: --cases 'a2c:CartPole-v1': sb3_gpu trains ppo, dqn, qrdqn, sac")
    assert bench.main(["auto", "--cases", "ppo:CartPole-v1:cpu"]) == 2  # bench step's form, with a profile
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --cases 'ppo:CartPole-v1:cpu': bench auto takes ALGO:ENV and chooses the profile; leave out ':cpu'"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["step", "--cases", "ppo:CartPole-v1", "sac:CartPole-v1"], "--cases: sac needs a Box action space"),
        (["step", "--cases", "ppo:Nope-v1"], "--cases: unknown env id 'Nope-v1'"),
        (["step", "--cases", "ppo:CartPole-v1:bogus"], "--cases: unknown profile 'bogus'"),
        (
            ["step", "--cases", "dqn:CartPole-v1", "--buffer-size", "10"],
            "--cases: batch_size (64) is more than buffer_size (10)",
        ),
        (["envs", "--envs", "CartPole-v1", "--seconds", "nan"], "--seconds must be a finite number > 0, got nan"),
        (["envs", "--envs", "CartPole-v1", "--seconds", "inf"], "--seconds must be a finite number > 0, got inf"),
        (["envs", "--envs", "CartPole-v1", "--out", "{file}"], "cannot create --out folder {file}: {file} is in the way"),
        (["solve", "--out", "{file}/sub"], "cannot create --out folder {file}/sub: {file} is in the way"),
        (["auto", "--compete", "100000"], "--compete: expected a count from 0 to 1024, got 100000"),  # busy processes
        (["per", "--batch-size", "512", "--capacities", "100", "1000"], "--batch-size 512 is above the 100 frames the"),
        (["gpu", "--device", "cpu", "--capacity", "500", "--batch", "1024"], "--batch 1,024 is above the 500 frames the"),
        (["gpu", "--device", "cpu", "--envs", "NoSuch-v0"], "unknown env id 'NoSuch-v0'"),
        (["gpu", "--device", "cpu", "--dqn-profiles", "huge"], "unknown profile 'huge'"),
        (["gpu", "--device", "cpu", "--dqn-profiles", "gpu", "--algos", "ppo"], "--dqn-profiles gpu: they are DQN's, and"),
        (["auto", "--cases", "ppo:NoSuch-v0"], "unknown env id 'NoSuch-v0'"),
    ],
)
def test_bad_bench_input_is_refused_in_one_line_before_any_work(args, message, tmp_path, capsys, monkeypatch):
    from sb3_gpu.benches import auto, envs, gpu, per, step

    def no_work(*a, **k):
        raise AssertionError("the bench ran before refusing its input")

    monkeypatch.setattr(step, "bench_step", no_work)
    monkeypatch.setattr(envs, "bench_envs", no_work)
    monkeypatch.setattr(auto, "bench_auto", no_work)
    monkeypatch.setattr(per, "bench_per", no_work)
    monkeypatch.setattr(gpu, "bench_sample", no_work)
    (tmp_path / "file").write_text("")
    monkeypatch.chdir(tmp_path)
    assert bench.main([a.format(file="file") for a in args]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: " + message.format(file="file")) and err.count("\n") == 1, err
    assert out == "", out  # nothing printed before the refusal (the machine line, say)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no results folder made


def test_bench_step_counts_a_buffer_too_big_for_this_machine_with_a_smaller_one(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    import psutil

    from sb3_gpu.benches import step

    # 100 KB free: DQN CartPole's 50,000 transitions do not fit, 64 do.
    total = psutil.virtual_memory().total
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=total, available=100_000))
    args = ["step", "--cases", "dqn:CartPole-v1", "--out", str(tmp_path)]
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --cases: buffer_size=50,000 needs") and err.count("\n") == 1, err
    assert err.endswith("lower buffer_size; or count with a smaller --buffer-size\n")
    asked = []
    monkeypatch.setattr(
        step, "bench_step", lambda cases, device, repeats, vec_steps, size, matmul_heads, rows: asked.append(size) or []
    )
    assert bench.main([*args, "--buffer-size", "64"]) == 0
    assert asked == [64]
    assert step.plan_case("dqn:CartPole-v1", "cpu", "eager", 64).preset.params.buffer_size == 64
    assert step.plan_case("ppo:CartPole-v1", "cpu", "eager", 64).preset.params.n_steps == 32  # PPO has no buffer_size


@pytest.mark.parametrize(
    "args",
    [
        ["sb3_gpu.bench", "train", "--threshold", "nan"],
        ["sb3_gpu.bench", "solve", "--target", "inf"],
        ["sb3_gpu.tune", "ppo", "--threshold", "inf"],
    ],
)
def test_a_return_to_reach_that_no_run_can_compare_to_is_refused(args, call_main, monkeypatch, tmp_path):
    # NaN would stop each run at its first new best and report it as never reached; a rerun then refuses the saved
    # runs, whose threshold NaN never equals itself.
    import importlib

    from sb3_gpu.benches import solve, train

    def no_work(*a, **k):
        raise AssertionError("the bench ran before refusing its input")

    monkeypatch.setattr(train, "bench_train", no_work)
    monkeypatch.setattr(solve, "bench_solve", no_work)
    monkeypatch.chdir(tmp_path)
    result = call_main(importlib.import_module(args[0]).main, *args[1:])
    option, value = args[-2:]
    assert result.returncode == 2 and f"error: argument {option}: expected a finite number, got '{value}'" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_results_a_full_disk_will_not_take_end_the_bench_in_one_line(tmp_path, monkeypatch, capsys):
    from sb3_gpu.benches import base

    monkeypatch.setattr(base, "atomic_write_text", disk_full)
    monkeypatch.setattr(bench, "_main_step", lambda args, command: print(*base.write_results(Path(args.out), "step", {}, "")))
    assert bench.main(["step", "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"error: cannot write the results into {tmp_path / 'out'}: No space left on device\n"
    # The runs file that bench train and solve save after each run: the same (exit 1, not bad input's 2).
    monkeypatch.setattr(bench, "_main_step", lambda args, command: base.save_json(Path(args.out, "x.json"), {}, "the runs"))
    assert bench.main(["step", "--out", str(tmp_path / "out")]) == 1
    runs_file = tmp_path / "out" / "x.json"
    assert capsys.readouterr().err == f"error: cannot save the runs to {runs_file}: No space left on device\n"


def test_a_signal_during_bench_solve_stops_the_bench_not_only_its_training(monkeypatch, capsys, tmp_path):
    from sb3_gpu.benches import solve

    trained = []

    def stopped(plan, run_dir, **kwargs):
        trained.append(plan.seed)
        return {"interrupted": True, "stopped_by": "SIGTERM", "timesteps": 10}

    monkeypatch.setattr(solve, "train_run", stopped)
    assert bench.main(["solve", "--seeds", "0", "1", "2", "--out", str(tmp_path)]) == 130
    assert trained == [0] and "interrupted; no results were written" in capsys.readouterr().err
    assert not (tmp_path / "solve.json").exists()


@pytest.mark.heavy
def test_a_sigterm_to_bench_solve_alone_stops_its_workers_too(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    args = ["solve", "--seeds", "0", "1", "2", "3", "--per", "off", "--timesteps", "1000000", "--jobs", "2"]
    scratch = tmp_path / "tmp"  # where the workers make their temporary run dirs
    scratch.mkdir()
    bench_process = subprocess.Popen(
        [sys.executable, "-m", "sb3_gpu.bench", *args, "--out", str(tmp_path)],
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    parent = psutil.Process(bench_process.pid)

    def pool_workers() -> list[psutil.Process]:  # not spawn's resource tracker, which goes with the bench
        found = []
        for child in parent.children():
            with contextlib.suppress(psutil.Error):  # one that exited between the listing and the reading
                if "spawn_main" in " ".join(child.cmdline()):
                    found.append(child)
        return found

    try:
        deadline = time.monotonic() + 300  # a guard against a bench that died before starting its pool, not a speed limit
        while len(pool_workers()) < 2:
            if bench_process.poll() is not None:
                pytest.fail(f"the bench ended before its pool started: {bench_process.stderr.read().decode()}")
            assert time.monotonic() < deadline, "no pool workers after 300 s"
            time.sleep(0.2)
        workers = pool_workers()
        while len(list(scratch.glob("sb3_gpu_solve_*"))) < 2:  # into both trainings: their run dirs exist
            if bench_process.poll() is not None:
                pytest.fail(f"the bench ended before its cases began: {bench_process.stderr.read().decode()}")
            assert time.monotonic() < deadline, "no case began within 300 s"
            time.sleep(0.2)
        bench_process.send_signal(signal.SIGTERM)  # to the bench alone, as a job scheduler may send it
        _, stderr = bench_process.communicate(timeout=300)  # a guard against a hang, not a speed limit
    finally:  # a failed test must not leave four million-step trainings running under the rest of the suite
        if bench_process.poll() is None:
            for process in [*parent.children(recursive=True), parent]:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            bench_process.wait(timeout=60)
    assert bench_process.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr, stderr.decode()
    _, alive = psutil.wait_procs(workers, timeout=60)  # a worker may still be unwinding as the bench exits

    def running(worker: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return worker.status() != psutil.STATUS_ZOMBIE
        return False

    assert not [w for w in alive if running(w)]
    assert not (tmp_path / "solve.json").exists()
    assert not list(scratch.glob("sb3_gpu_solve_*")), "a stopped case left its temporary run dir behind"


def test_a_signal_unwinds_a_workers_case_and_lets_an_idle_worker_exit_quietly(monkeypatch):
    # An idle worker waits inside multiprocessing's queue, where a KeyboardInterrupt prints a traceback; a SystemExit
    # ends it quietly. A worker solving a case unwinds it as from Ctrl-C, so that its temporary run dir goes.
    import signal

    from sb3_gpu.benches import solve

    with pytest.raises(SystemExit) as idle:
        solve._worker_signal(signal.SIGTERM, None)
    assert idle.value.code == 128 + signal.SIGTERM

    def case_under_way(case, episodes, threads):
        solve._worker_signal(signal.SIGINT, None)

    monkeypatch.setattr(solve, "solve_case", case_under_way)
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        solve._solve_in_worker(None, 20, 1)
    assert not solve._case_under_way.is_set()


def test_bench_solves_parallel_jobs_each_train_on_their_share_of_the_cores(monkeypatch):
    from sb3_gpu.benches import solve

    # Each plan, probing while the others start, may take every core; jobs whose threads outnumber the cores wait.
    shares, planned = [], []
    monkeypatch.setattr(solve, "logical_cores", lambda: 16)
    monkeypatch.setattr(solve, "_solve_in_pool", lambda cases, episodes, jobs, done, threads: shares.append(threads))
    case = solve.Case("dqn", "CartPole-v1", None, "auto", 0)
    for jobs in (3, 16, 32):
        solve.bench_solve([case], 20, jobs, print_fn=lambda line: None)
    assert shares == [5, 1, 1]

    def plan(*args, overrides, **kwargs):
        planned.append(overrides.get("threads"))
        raise KeyboardInterrupt  # planned: enough

    monkeypatch.setattr(solve, "make_plan", plan)
    for threads in (5, None):  # one job alone keeps the plan's own choice
        with pytest.raises(KeyboardInterrupt):
            solve.solve_case(case, 20, threads)
    assert planned == [5, None]


def test_bench_solve_keeps_each_ended_case_and_trains_only_the_rest_when_run_again(monkeypatch, capsys, tmp_path):
    import json
    import shutil

    from sb3_gpu.benches import solve
    from sb3_gpu.benches.base import preset_sha256
    from sb3_gpu.config.files import presets_dir

    trained: list[int] = []
    signals = [KeyboardInterrupt("stopped by SIGTERM")]  # one, under way in the third case

    def fake_case(case, episodes):
        if case.seed == 2 and signals:
            raise signals.pop()
        trained.append(case.seed)
        run = {"evaluated": 500.0, "evaluated_std": 0.0, "model": "best_model.zip", "reported_best": 500.0}
        run["preset_sha256"] = preset_sha256(case.algo, case.preset)  # read as the case starts, as solve_case does
        return {**dataclasses.asdict(case), **run, "reported_best_std": 0.0, "reported_best_episodes": 30, "wall_s": 1.0}

    monkeypatch.setattr(solve, "solve_case", fake_case)
    preset = tmp_path / "dqn.yaml"
    shutil.copy(presets_dir() / "dqn.yaml", preset)
    args = ["solve", "--algos", "dqn", "--seeds", "0", "1", "2", "--preset", str(preset), "--out", str(tmp_path / "out")]
    assert bench.main(args) == 130
    assert "the cases that ended are kept in" in capsys.readouterr().err
    assert not (tmp_path / "out" / "solve.json").exists()

    assert bench.main(args) == 0 and trained == [0, 1, 2]  # the same command trains only the case that was lost
    assert capsys.readouterr().out.count("(kept from ") == 2
    rows = json.loads((tmp_path / "out" / "solve.json").read_text())["rows"]
    assert [r["seed"] for r in rows] == [0, 1, 2] and all(r["episodes"] == 20 and r["preset_sha256"] for r in rows)

    preset.write_text(preset.read_text() + "\n# changed\n")  # another preset file: nothing kept
    assert bench.main(args) == 0 and trained == [0, 1, 2, 0, 1, 2]
    saved = json.loads((tmp_path / "out" / "solve-rows.json").read_text())["rows"]
    assert len(saved) == 6 and len({r["preset_sha256"] for r in saved}) == 2


def test_saved_results_are_keyed_by_the_bytes_of_the_preset_file_a_run_reads(tmp_path):
    import hashlib

    from sb3_gpu.benches.base import preset_sha256
    from sb3_gpu.common.errors import ConfigError
    from sb3_gpu.config.files import presets_dir

    zoo = tmp_path / "ppo.yml"
    zoo.write_text("CartPole-v1:\n  n_timesteps: !!float 1e5\n  policy: MlpPolicy\n")
    assert preset_sha256("ppo", f"zoo:{zoo}") == preset_sha256("ppo", str(zoo)) == hashlib.sha256(zoo.read_bytes()).hexdigest()
    assert preset_sha256("ppo") == hashlib.sha256((presets_dir() / "ppo.yaml").read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match=r"cannot read the preset file .*nope\.yaml"):
        preset_sha256("ppo", str(tmp_path / "nope.yaml"))


def test_bench_step_gives_sb3_the_samples_an_accumulating_step_takes(monkeypatch):
    # The large profile's step takes two micro-batches: SB3's, which cannot accumulate, takes them as one batch, so
    # that a gradient step is the same work on both sides.
    from sb3_gpu.benches import step

    kwargs_of = step.model_kwargs
    monkeypatch.setattr(step, "model_kwargs", lambda plan: {**kwargs_of(plan), "grad_accum_steps": 2})
    for variant, (batch, accumulate) in {"sb3": (128, 1), "eager": (64, 2)}.items():
        model, _ = step._model("dqn:CartPole-v1", "cpu", variant)
        assert (model.batch_size, getattr(model, "grad_accum_steps", 1)) == (batch, accumulate), variant
        model.get_env().close()


def test_bench_steps_sb3_row_is_sb3s_own_class_where_the_profile_accumulates():
    from stable_baselines3 import DQN

    from sb3_gpu.benches import step

    # The large profile accumulates two micro-batches of 1,024, which would make the preset's class sb3_gpu's: SB3's
    # row takes the two as one batch.
    model, breaks = step._model("dqn:FrozenLake-v1:large", "cpu", "sb3", 4096)
    assert type(model) is DQN and model.batch_size == 2048 and breaks == "-"


def test_an_out_folder_its_results_cannot_name_is_refused_before_the_work(tmp_path, capsys):
    out = tmp_path / b"out\xff".decode("utf-8", "surrogateescape")  # the results file names its command, in UTF-8
    args = ["envs", "--envs", "CartPole-v1", "--n-envs", "1", "--seconds", "0.05", "--repeats", "1", "--out", str(out)]
    assert bench.main(args) == 2
    assert "cannot use --out folder" in capsys.readouterr().err and not out.exists()


def test_bench_envs_startup_workers_is_a_count_as_every_other(capsys):
    assert bench.build_parser().parse_args(["envs", "--startup-workers", "1e1"]).startup_workers == 10
    with pytest.raises(SystemExit) as exit_:
        bench.build_parser().parse_args(["envs", "--startup-workers", "-1"])
    assert exit_.value.code == 2 and "--startup-workers: expected an integer >= 0, got '-1'" in capsys.readouterr().err


def test_a_stopped_bench_step_or_gpu_writes_the_cases_that_ended(tmp_path, monkeypatch, capsys):
    # A GPU's lent minutes ran out mid-bench: the cases already measured were lost with the one stopped.
    import json

    from sb3_gpu.benches import gpu, step

    def one_case(text, *args):
        if text != "dqn:CartPole-v1":
            raise KeyboardInterrupt
        return [step.StepRow(text, "sb3", 3.0, 300.0, 1.5, 2.0, 100.0, 0.5, "-")]

    monkeypatch.setattr(step, "_case_rows", one_case)
    assert (
        bench.main(["step", "--device", "cpu", "--cases", "dqn:CartPole-v1", "ppo:CartPole-v1", "--out", str(tmp_path)]) == 130
    )
    saved = json.loads((tmp_path / "step.json").read_text())
    assert saved["interrupted"] == "1 of 2 cases" and [r["case"] for r in saved["rows"]] == ["dqn:CartPole-v1"]
    assert (tmp_path / "step.md").read_text().startswith("Interrupted after 1 of 2 cases: the others were not measured.")
    assert "interrupted after 1 of 2 cases; those are written" in capsys.readouterr().err

    def dqn_only(case, *args):
        if case[0] != "dqn":
            raise KeyboardInterrupt
        return {
            "steps_per_s": 100.0,
            "cpu_s_per_1k": 1.0,
            "grad_steps_per_1k": 250.0,
            "gpu_utilisation": None,
            "peak_memory_mib": None,
        }

    monkeypatch.setattr(gpu, "_train_once", dqn_only)
    args = ["gpu", "--device", "cpu", "--capacity", "256", "--batch", "32", "--algos", "dqn", "ppo", "--repeats", "1"]
    assert bench.main([*args, "--no-zoo", "--out", str(tmp_path)]) == 130  # DQN's three variants, then PPO's stop
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["interrupted"] == "1 of 2 cases" and [r["algo"] for r in saved["training"]] == ["dqn"]
    assert saved["sample"]["capacity"] == 256
    # Stopped before any case ended: the earlier run's complete files stay.
    assert bench.main([*args[:-5], "--algos", "ppo", "--repeats", "1", "--no-zoo", "--out", str(tmp_path)]) == 130
    assert json.loads((tmp_path / "gpu.json").read_text()) == saved


def test_a_second_ctrl_c_while_a_stopped_bench_writes_waits_for_its_files(tmp_path, monkeypatch, capsys):
    # Ctrl-C pressed twice: the second one cut the write short, and the message said no results were written.
    import json
    import os
    import signal

    from sb3_gpu.benches import base, step

    def one_case(text, *args):
        if text != "dqn:CartPole-v1":
            raise KeyboardInterrupt
        return [step.StepRow(text, "sb3", 3.0, 300.0, 1.5, 2.0, 100.0, 0.5, "-")]

    real_write = base.atomic_write_text

    def write_stopped(path, text):
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at once, in this thread
        return real_write(path, text)

    monkeypatch.setattr(step, "_case_rows", one_case)
    monkeypatch.setattr(base, "atomic_write_text", write_stopped)
    args = ["step", "--device", "cpu", "--cases", "dqn:CartPole-v1", "ppo:CartPole-v1", "--out", str(tmp_path)]
    assert bench.main(args) == 130
    assert json.loads((tmp_path / "step.json").read_text())["interrupted"] == "1 of 2 cases"
    assert (tmp_path / "step.md").read_text().startswith("Interrupted after 1 of 2 cases")
    err = capsys.readouterr().err
    assert "interrupted after 1 of 2 cases; those are written" in err and "no results were written" not in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


@pytest.mark.heavy
def test_bench_gpu_times_gradient_steps_where_a_presets_warm_up_is_longer_than_the_run():
    # Pong's DQN presets learn after 100,000 env steps: a 20,000-step run on a lent GPU timed no update at all.
    from sb3_gpu.benches import gpu

    late = {"device_buffers": False, "overlap_training": False, "learning_starts": 5_000}
    run = gpu._train_once(("dqn", "CartPole-v1", "auto"), "cpu", 2_048, late)
    assert run["grad_steps_per_1k"] > 0
