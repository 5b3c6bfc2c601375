"""The bench command runs end to end and prints its ratios (the figures themselves are for the README, not tests)."""

from __future__ import annotations

import re

from sb3_gpu import bench


def test_bench_speed_prints_a_row_per_switch(monkeypatch, capsys):
    tiny = {"n_envs": 2, "n_steps": 16, "batch_size": 16, "n_epochs": 1, "net_arch": [16]}
    monkeypatch.setattr(bench, "SPEED_CASES", [("tiny PPO", "ppo", "CartPole-v1", tiny)])
    assert bench.main(["speed", "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "4096x256 @ 256x256 matmul" in out and "native bf16:" in out
    rows = [line for line in out.splitlines() if line.startswith("tiny PPO")]
    assert [r.split("  ")[1].strip() for r in rows] == ["bf16 autocast", "torch.compile", "2 threads"]
    assert all(len(re.findall(r"\d+\.\d\dx", r)) == 2 for r in rows)


def test_bench_per_times_each_tree_backend_and_the_gradient_step(capsys):
    assert bench.main(["per", "--repeats", "1", "--capacities", "1000", "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    backends = bench.tree_backends()
    for backend in backends:
        assert re.search(rf"sample\(32\) \+ update @ 1e\+03, {backend} tree.*\d\.\d\dx", out), out
    assert re.search(r"DQN gradient step .* <= 1.25x (ok|MISSED)", out)


def test_bench_learning_with_an_unknown_env_is_exit_2(capsys):
    assert bench.main(["per", "--learn", "--env", "NoSuchEnv-v0", "--no-timing"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown env id 'NoSuchEnv-v0'" in err[0]


def test_bench_telemetry_prints_the_overhead(monkeypatch, capsys):
    tiny = {"n_envs": 2, "n_steps": 16, "batch_size": 16, "n_epochs": 1, "net_arch": [16]}
    monkeypatch.setattr(bench, "TELEMETRY_CASES", [("tiny PPO", "ppo", "CartPole-v1", tiny)])
    assert bench.main(["telemetry", "--repeats", "1"]) == 0
    assert re.search(r"tiny PPO\s+\d+\s+\d+\s+[+-]\d+\.\d%", capsys.readouterr().out)
