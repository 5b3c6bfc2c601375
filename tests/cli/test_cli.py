from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from stable_baselines3 import A2C, PPO

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.evaluate import main as evaluate_main
from sb3_gpu.train import build_parser, run_options
from sb3_gpu.train import main as train_main
from tests.conftest import run_cli, squashed


@pytest.mark.heavy
def test_train_writes_a_complete_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        "sb3_gpu.train",
        "ppo",
        "--env",
        "CartPole-v1",
        "--timesteps",
        "2048",
        "--n-envs",
        "2",
        "--seed",
        "1",
        "--run-dir",
        str(run_dir),
        "--eval-freq",
        "1024",
        "--eval-episodes",
        "2",
        "--checkpoint-freq",
        "1024",
        "--no-progress",
        "--set",
        "n_epochs=1",
    )
    assert result.returncode == 0, result.stderr
    assert "sb3_gpu plan: PPO on CartPole-v1" in result.stdout and "sb3_gpu summary" in result.stdout
    for name in (
        "config.yaml",
        "model.zip",
        "best_model.zip",
        "summary.json",
        "eval/evaluations.npz",
        "checkpoints/model_1024_steps.zip",
        "monitor/0.monitor.csv",
    ):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").glob("run_1/events.out.tfevents.*"))
    assert not (run_dir / ".lock").exists()  # held while the run worked, removed when it finished
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["timesteps"] >= 2048 and summary["steps_per_s"] > 0 and summary["eval_episodes"] == 2
    assert summary["final_eval_mean"] > 0 and summary["interrupted"] is False
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["hyperparameters"]["n_epochs"] == 1 and config["resolved"]["sources"]["n_epochs"] == "--set"
    assert PPO.load(run_dir / "model.zip").num_timesteps == summary["timesteps"]

    replay = run_cli("sb3_gpu.train", "--config", str(run_dir / "config.yaml"), "--plan")
    assert replay.returncode == 0, replay.stderr
    assert "n_epochs" in replay.stdout and squashed(str(run_dir / "config.yaml")) in squashed(replay.stdout)

    evaluation = run_cli("sb3_gpu.evaluate", str(run_dir), "--episodes", "2", "--json")
    assert evaluation.returncode == 0, evaluation.stderr
    assert json.loads(evaluation.stdout)["episodes"] == 2

    again = run_cli("sb3_gpu.train", "ppo", "--run-dir", str(run_dir), "--timesteps", "256")
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.heavy
def test_plan_prints_and_trains_nothing(tmp_path):
    result = run_cli("sb3_gpu.train", "dqn", "--env", "CartPole-v1", "--plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "device" in result.stdout and "why / source" in result.stdout and "dqn.yaml:CartPole-v1" in result.stdout
    assert not (tmp_path / "runs").exists()


# Each bad input: arguments, and a piece of the one-line message that says what was wrong.
BAD_INPUTS = [
    (["ppo3"], "unknown algorithm 'ppo3'; did you mean 'ppo'"),
    # SB3's other algorithms are named as such, not answered with the closest spelling ('a2c' is as close to 'sac').
    (["A2C"], "argument algo: sb3_gpu trains ppo, dqn, qrdqn, sac, td3, tqc; 'A2C' is not one of them (train it with"),
    (["recurrent-ppo"], "'recurrent-ppo' is not one of them"),
    (["ppo", "--env", "CartPol-v1"], "did you mean 'CartPole-v1'"),
    (["ppo", "--env", "no_such_pkg.envs:MyEnv"], "cannot import module 'no_such_pkg.envs'"),
    (["ppo", "--timesteps", "0"], "--timesteps: expected a positive integer"),
    (["dqn", "--no-per", "--set", "per.alpha=0.5"], "--no-per turns prioritized replay off, and --set per.alpha sets"),
    (["dqn", "--set", "per=false", "--set", "per.alpha=0.5"], "--set per=false turns prioritized replay off, and --set"),
    (["dqn", "--set", "learning_rat=1e-3"], "error: --set: unknown key 'learning_rat'; did you mean 'learning_rate'"),
    (["ppo", "--profile", "large"], "ppo.yaml:CartPole-v1 has no 'large' profile; accepted for it: auto, cpu, gpu"),
    (["dqn", "--set", "policy_kwargs.net_arc=[64]"], "unknown key 'net_arc'; did you mean 'net_arch'? It is a preset key of"),
    (["ppo", "--n-envs", "4", "--set", "n_envs=2"], "--n-envs and --set n_envs both set n_envs; give one"),
    (["ppo", "--timesteps", "900", "--set", "n_timesteps=500"], "--timesteps and --set n_timesteps both set n_timesteps"),
    (["dqn", "--amp", "off", "--set", "amp=bf16"], "--amp and --set amp both set amp; give one"),
    (["dqn", "--per", "--set", "per=false"], "--per and --set per both set per; give one"),
    (["ppo", "--set", "policy=CnnPolicy"], "policy=CnnPolicy (--set) takes images, a Box of shape (height, width, channels)"),
    (["ppo", "--timesteps", "-5"], "--timesteps: expected a positive integer"),
    (["ppo", "--n-envs", "0"], "--n-envs: expected a positive integer"),
    (["ppo", "--n-envs", "2.5"], "--n-envs: expected a positive integer"),
    (["ppo", "--device", "cuda"], "asked for a CUDA GPU, but torch sees none"),
    (["ppo", "--device", "bogus"], "unknown device 'bogus'; accepted: auto, cpu, cuda, cuda:N, mps"),
    (["ppo", "--set", "bach_size=64"], "unknown key 'bach_size'; did you mean 'batch_size'"),
    (["ppo", "--set", "batch_size=lots"], "batch_size: expected an int >= 2, got 'lots'"),
    (["ppo", "--set", "batch_size"], "--set expects key=value"),
    (["ppo", "--set", "batch_size="], "--set batch_size=: no value after '=' (give one, or batch_size=null for none)"),
    (["ppo", "--vec-env", "threads"], "argument --vec-env: invalid choice: 'threads'"),
    (["ppo", "--preset", "{bad_yaml}"], "not valid YAML"),
    (["ppo", "--preset", "{list_yaml}"], "must be a mapping of entries"),
    (["ppo", "--preset", "{python_tag}"], "refused YAML tag"),
    (["ppo", "--preset", "{unknown_key}"], "unknown key 'n_step'; did you mean 'n_steps'"),
    (["ppo", "--preset", "{anchor_bomb}"], "YAML expands to more than 100,000 values"),
    (["ppo", "--preset", "{self_alias}"], "a YAML alias refers to itself"),
    (["ppo", "--set", "net_arch=&a [64, *a]"], "a YAML alias refers to itself"),
    (["--config", "{missing}/config.yaml"], "config file not found"),
    (["ppo", "--run-dir", "{existing}"], "already exists"),
    (["ppo", "--run-dir", "{existing}", "--plan"], "already exists"),
    (["ppo", "--run-dir", "{a_file}/run"], "is in the way (not a folder)"),
    # Before the plan is printed; os.access lets root write anywhere, /proc included.
    (["ppo", "--run-dir", "/proc/nope/x"], "cannot create run dir /proc/nope/x: /proc "),
    (
        ["ppo", "--run-dir", "{existing}/" + "b" * 256],
        "256 bytes long, and this file system takes at most 255",
    ),
    ([], "give an algorithm"),
    (["ppo", "--per"], "'per' is for off-policy algorithms (dqn, qrdqn); ppo is on-policy"),
    (["dqn", "--profile", "huge"], "unknown profile 'huge'"),
    (["dqn", "--set", "per.alpha=-1"], "per.alpha: expected a number >= 0"),
    (["dqn", "--set", "grad_accum_steps=0"], "grad_accum_steps: expected a positive int"),
    (["dqn", "--set", "optimize_memory_usage=true"], "optimize_memory_usage=true (--set) needs device_buffers=true"),
    (["ppo", "--set", "use_sde=true"], "use_sde=true explores continuous actions; the env's actions are Discrete(2)"),
    (["ppo", "--set", "n_steps=64", "--set", "n_steps=128"], "--set n_steps is given twice (64, then 128); give one"),
    (["ppo", "--n-envs", "1", "--set", "n_steps=1"], "n_steps * n_envs must be > 1 for PPO"),
    (["ppo", "--seed", "-1"], "--seed: expected a seed, an integer >= 0"),
    (["ppo", "--timesteps", "inf"], "--timesteps: expected a positive integer, got 'inf'"),
    (
        ["ppo", "--set", "learning_rate={{schedule: linear, start: 1.0e-3, end: -1}}"],
        "learning_rate.end: expected a number >= 0",
    ),
    (["ppo", "--save-replay-buffer"], "(--save-replay-buffer) is for off-policy algorithms (dqn, qrdqn, sac, td3, tqc)"),
    # --resume: the run dir and what may be given with it
    (["--resume", "{missing}"], ": no such run dir"),
    (["--resume", "{done}/config.yaml"], "config.yaml: it is a file; give the run dir that holds config.yaml"),
    (["--resume", "{existing}"], "holds no config.yaml; is it a run dir written by sb3_gpu.train?"),
    (["--resume", "{missing}", "--plan"], "cannot resume "),  # what is wrong first, not the flag
    (["--resume", "{broken}"], "holds no readable model.zip or checkpoint to continue from"),
    (["--resume", "{done}"], "already trained 64 of 64 timesteps; pass --timesteps (resume_run's timesteps=) with a larger"),
    (["--resume", "{done}", "--timesteps", "10"], "already trained 64 of 10 timesteps"),
    (["--resume", "{done}", "--seed", "3"], "so --seed cannot be given; accepted with --resume: --timesteps"),
    (["--resume", "{done}", "--env", "Acrobot-v1"], "on its own env 'CartPole-v1'; --env (resume_run's env=) may only repeat"),
    (["--resume", "{done}", "--set", "n_steps=8"], "so --set cannot be given"),
    (["ppo", "--resume", "{done}"], "so the algorithm 'ppo' cannot be given"),
    # A run started on a GPU, resumed on a machine without one: --device says where it goes on.
    (["--resume", "{on_gpu}", "--timesteps", "128"], "on_gpu: its config.yaml: device 'cuda' asked for a CUDA GPU, but"),
    (["--resume", "{on_gpu}", "--timesteps", "128"], "; give --device (resume_run's device=) for where it"),
    (["--resume", "{done}", "--timesteps", "128", "--device", "cuda:1"], "device 'cuda:1' asked for a CUDA GPU, but"),
    (["--resume", "{done}", "--timesteps", "128", "--device", "tpu"], "unknown device 'tpu'; accepted: auto, cpu, cuda"),
    (["--resume", "{run_typo}", "--timesteps", "128"], "unknown key 'run.eval_frek'; did you mean 'eval_freq'"),
    (["--resume", "{magic_vec}", "--timesteps", "128"], "unknown vec_env 'magic' (valid: auto, dummy, subproc, batched"),
    (["--resume", "{magic_vec}", "--timesteps", "128"], "magic_vec/config.yaml)"),  # where the value came from
    (["--resume", "{run_zero}", "--timesteps", "128"], "eval_episodes must be a positive int, got 0"),
    (["--resume", "{run_null}", "--timesteps", "128"], "eval_episodes must be a positive int, got None"),
    # A replay takes the run's evaluation and saving options, checked, and an error names the file.
    (["--config", "{run_zero}", "--plan"], "eval_episodes must be a positive int, got 0 (replaying"),
    (["--config", "{run_null}", "--plan"], "run_null/config.yaml)"),
    (["--config", "{run_typo}", "--plan"], "unknown key 'run.eval_frek'; did you mean 'eval_freq'"),
    # A replay's values are pinned: the plan said "profile gpu, asked for" beside the run's cpu values.
    (["--config", "{done}/config.yaml", "--profile", "gpu", "--plan"], "--config replays its run's own hyperparameters, and"),
    # sb3_gpu's own settings are named where they are set, not answered with a preset key's spelling ('n_envs').
    (["ppo", "--set", "vec_env=dummy"], "--set: 'vec_env' is no preset key: the CLI's --vec-env, make_model's and"),
    (["ppo", "--set", "eval_episodes=5"], "'eval_episodes' is no preset key: the CLI's --eval-episodes, train_run's"),
    # YAML reads a bare off as False: amp's off, as compile's false.
    (["ppo", "--set", "amp=on"], "--set: amp: true names no precision; give one of auto, off, bf16, fp16"),
    (["--config", "{run_buffer}", "--plan"], "ppo keeps no replay buffer (replaying"),
    (["--resume", "{tampered}", "--timesteps", "128"], "stores a pickled 'evil' that this run's config cannot supply"),
    # A name in a file runs nothing: `env: os:system` with `env_kwargs: {command: ...}` is refused before any call.
    (["--config", "{evil_config}", "--plan"], "'system' is not a gymnasium.Env class"),
    (["--resume", "{evil_run}", "--timesteps", "128"], "'system' is not a gymnasium.Env class"),
    # Nothing is written through a symbolic link, and a run dir that cannot be made says why.
    (["--resume", "{linked}", "--timesteps", "128"], "linked/.lock is a symbolic link; sb3_gpu does not write through"),
    (["ppo", "--run-dir", "{a_file}/run"], "cannot create run dir"),
    (["ppo", "--run-dir", "/sys/sb3_gpu_run"], "cannot create run dir /sys/sb3_gpu_run: /sys "),
    (["--resume", "{edited}", "--timesteps", "128"], "model.zip was trained with other hyperparameters than its run's config"),
    (["--resume", "{damaged}", "--timesteps", "128"], "holds no readable model.zip or checkpoint to continue from (skipped"),
    # Sizes the machine cannot hold are refused before anything is allocated or spawned.
    (["dqn", "--env", "ALE/Pong-v5", "--set", "buffer_size=50000000"], "buffer_size=50,000,000 needs 2629.5 GiB"),
    (["ppo", "--n-envs", "5000", "--vec-env", "subproc", "--timesteps", "1e6"], "would start 5,000 processes on"),
    (["ppo", "--n-envs", "5000", "--timesteps", "2000"], "n_steps * n_envs = 32 * 5,000 = 160,000 env steps, more than"),
    (["ppo", "--eval-episodes", "1e30"], "--eval-episodes: expected a positive integer up to 2,147,483,647"),
    (["ppo", "--set", "n_timesteps=1e30"], "n_timesteps: expected a positive int up to 2,147,483,647"),
    # A --config error names the file it came from.
    (["--config", "{typo_env_config}", "--plan"], "typo_env/config.yaml)"),
    (["--config", "{typo_algo_config}", "--plan"], "typo_algo/config.yaml: unknown algorithm 'ppo3'"),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed 64-step PPO run (trained once per module)."""
    from sb3_gpu import make_plan, train_run

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_dir.mkdir()
    plan = make_plan("ppo", "CartPole-v1", "cpu", n_envs=1, n_timesteps=64, overrides={"n_steps": 32, "batch_size": 32})
    train_run(plan, run_dir, eval_episodes=1, progress=False, report_s=None)
    return run_dir


def _variant(run_dir, dest, run_options=None, tamper=False, env=None, algo=None, device=None):
    shutil.copytree(run_dir, dest)
    if run_options is not None or env is not None or algo is not None or device is not None:
        config = yaml.safe_load((dest / "config.yaml").read_text())
        if device is not None:
            config["device"] = device
        if run_options is not None:
            config["run"] = run_options
        if env is not None:
            config["env"], config["hyperparameters"]["env_kwargs"] = env
        if algo is not None:
            config["algo"] = algo
        (dest / "config.yaml").write_text(yaml.safe_dump(config))
    if tamper:  # a pickled entry the config cannot supply, whose unpickling would create a file
        payload = base64.b64encode(b"cos\nsystem\n(S'touch pwned'\ntR.").decode()
        with zipfile.ZipFile(run_dir / "model.zip") as src, zipfile.ZipFile(dest / "model.zip", "w") as out:
            for item in src.infolist():
                data = src.read(item.filename)
                if item.filename == "data":
                    fields = json.loads(data)
                    fields["evil"] = {":type:": "<class 'x'>", ":serialized:": payload}
                    data = json.dumps(fields).encode()
                out.writestr(item, data)
    return dest


@pytest.fixture
def bad_files(tmp_path, finished_run):
    files = {
        "bad_yaml": "default: [1, 2\n",
        "list_yaml": "- 1\n- 2\n",
        "python_tag": "default: !!python/object/apply:os.system ['touch pwned']\n",
        "unknown_key": "CartPole-v1:\n  n_step: 4\n",
        # "billion laughs": 9^10 values from a few hundred bytes, hanging any code that walks them
        "anchor_bomb": 'a0: &a0 ["x","x","x","x","x","x","x","x","x"]\n'
        + "".join(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 10))
        + "CartPole-v1:\n  net_arch: *a9\n",
        "self_alias": "CartPole-v1:\n  net_arch: &a [64, *a]\n",
    }
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(text)
    paths["missing"] = tmp_path / "missing"
    paths["existing"] = tmp_path / "existing"
    paths["existing"].mkdir()
    broken = tmp_path / "broken_run"
    broken.mkdir()
    (broken / "config.yaml").write_text("algo: ppo\nenv: CartPole-v1\nhyperparameters: {}\n")
    (broken / "model.zip").write_bytes(b"PK\x03\x04 not really a zip")
    paths["broken"] = broken
    paths["done"] = _variant(finished_run, tmp_path / "done")
    paths["on_gpu"] = _variant(finished_run, tmp_path / "on_gpu", device="cuda")
    paths["run_typo"] = _variant(finished_run, tmp_path / "run_typo", {"eval_frek": 5})
    paths["run_zero"] = _variant(finished_run, tmp_path / "run_zero", {"eval_episodes": 0})
    paths["run_null"] = _variant(finished_run, tmp_path / "run_null", {"eval_episodes": None})
    paths["run_buffer"] = _variant(finished_run, tmp_path / "run_buffer", {"save_replay_buffer": True})
    paths["tampered"] = _variant(finished_run, tmp_path / "tampered", tamper=True)
    evil = ("os:system", {"command": f"touch {tmp_path / 'pwned'}"})
    paths["evil_run"] = _variant(finished_run, tmp_path / "evil_run", env=evil)
    paths["evil_config"] = paths["evil_run"] / "config.yaml"
    paths["linked"] = _variant(finished_run, tmp_path / "linked")
    (tmp_path / "victim").write_text("precious")
    (paths["linked"] / ".lock").unlink(missing_ok=True)
    (paths["linked"] / ".lock").symlink_to(tmp_path / "victim")  # a resume would lock (and write its pid) through it
    paths["a_file"] = tmp_path / "victim"
    paths["damaged"] = _variant(finished_run, tmp_path / "damaged")
    zip_bytes = bytearray((paths["damaged"] / "model.zip").read_bytes())
    zip_bytes[len(zip_bytes) // 2] ^= 0xFF  # one flipped byte inside a member: its CRC no longer matches
    (paths["damaged"] / "model.zip").write_bytes(bytes(zip_bytes))
    shutil.rmtree(paths["damaged"] / "checkpoints")  # nothing else to continue from
    paths["typo_env_config"] = _variant(finished_run, tmp_path / "typo_env", env=("CartPol-v1", {})) / "config.yaml"
    paths["typo_algo_config"] = _variant(finished_run, tmp_path / "typo_algo", algo="ppo3") / "config.yaml"
    paths["dqn_config"] = _variant(finished_run, tmp_path / "dqn_config")  # a PPO model beside a DQN config
    (paths["dqn_config"] / "config.yaml").write_text("algo: dqn\nenv: CartPole-v1\nhyperparameters: {}\n")
    paths["other_env"] = _variant(finished_run, tmp_path / "other_env", env=("Acrobot-v1", {}))  # 6 inputs, not 4
    # A config.yaml edited after the run saved its models: SB3's load took a changed schedule, not a changed gamma.
    paths["edited"] = _variant(finished_run, tmp_path / "edited")
    config = yaml.safe_load((paths["edited"] / "config.yaml").read_text())
    config["hyperparameters"]["gamma"] = 0.5
    (paths["edited"] / "config.yaml").write_text(yaml.safe_dump(config))
    paths["edited_net"] = _variant(finished_run, tmp_path / "edited_net")  # sb3_gpu's own key for the network
    config = yaml.safe_load((paths["edited_net"] / "config.yaml").read_text())
    config["hyperparameters"]["net_arch"] = [8, 8]
    (paths["edited_net"] / "config.yaml").write_text(yaml.safe_dump(config))
    paths["magic_vec"] = _variant(finished_run, tmp_path / "magic_vec")  # a value the user never typed on --resume
    config = yaml.safe_load((paths["magic_vec"] / "config.yaml").read_text())
    config["vec_env"] = "magic"
    (paths["magic_vec"] / "config.yaml").write_text(yaml.safe_dump(config))
    paths["a2c_model"] = _variant(finished_run, tmp_path / "a2c_model")  # A2C's zip names PPO's policy module too
    a2c = A2C("MlpPolicy", "CartPole-v1", device="cpu")
    for name in ("model.zip", "best_model.zip"):
        a2c.save(paths["a2c_model"] / name)
    paths["garbage_weights"] = _variant(finished_run, tmp_path / "garbage_weights")
    for name in ("model.zip", "best_model.zip"):  # a whole zip whose weights member is noise
        zip_path = paths["garbage_weights"] / name
        with zipfile.ZipFile(zip_path) as archive:
            members = {info.filename: archive.read(info) for info in archive.infolist()}
        members["policy.pth"] = bytes(range(256)) * 8
        with zipfile.ZipFile(zip_path, "w") as archive:
            for member, data in members.items():
                archive.writestr(member, data)
    return paths


def test_a_run_dir_that_cannot_be_the_new_runs_is_refused_before_the_plan(tmp_path, monkeypatch, call_main):
    def no_plan(*args, **kwargs):
        raise AssertionError("planned")

    monkeypatch.setattr("sb3_gpu.train.plan_from_args", no_plan)
    result = call_main(train_main, "ppo", "--run-dir", str(tmp_path))
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr == f"error: run dir {tmp_path} already exists; choose a new --run-dir (runs are never overwritten)\n"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # where a run dir goes when none is named
    result = call_main(train_main, "ppo")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert (
        result.stderr == "error: cannot create the runs folder runs: runs is in the way (not a folder); give --run-dir for "
        "another place\n"
    )
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert call_main(train_main, "ppo", "--plan", "--no-probe").returncode == 0  # --plan writes nothing


def test_an_output_pipe_whose_reader_quit_is_said_as_such_not_as_a_file(tmp_path, monkeypatch, call_main):
    import errno

    def reader_gone(*args, **kwargs):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # print() to a `| head` that has exited

    monkeypatch.setattr("sb3_gpu.train._train_new", reader_gone)
    result = call_main(train_main, "ppo", "--run-dir", str(tmp_path / "run"), "--no-probe", "--timesteps", "512")
    assert result.returncode == 1
    assert "error: stopped: the program reading the output (head, or a pager that quit) closed it" in result.stderr
    assert "could not write" not in result.stderr


def test_an_output_closed_before_the_plan_is_printed_stops_with_that_said(tmp_path):
    read, write = os.pipe()
    os.close(read)  # `| head -0`: the first write fails (rich's own handler exited 1 without a word)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "sb3_gpu.train", "ppo", "--plan", "--no-probe", "--threads", "1"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
            cwd=tmp_path,
        )
    finally:
        os.close(write)
    assert done.returncode == 1
    assert done.stderr == "error: stopped: the program reading the output (head, or a pager that quit) closed it\n"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[" ".join(a) or "no-args" for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(args, message, bad_files, tmp_path, monkeypatch, call_main):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # "--device cuda" is bad input on a machine without
    args = [a.format(**bad_files) for a in args]
    result = call_main(train_main, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert "sb3_gpu plan" not in result.stdout, "refused before the plan, not after it"
    assert not (tmp_path / "pwned").exists()
    assert (tmp_path / "victim").read_text() == "precious"


def test_a_run_started_on_a_gpu_resumes_on_the_cpu_with_device(finished_run, tmp_path, monkeypatch, call_main):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    run_dir = _variant(finished_run, tmp_path / "moved", device="cuda")
    result = call_main(train_main, "--resume", str(run_dir), "--timesteps", "128", "--device", "cpu", "--no-progress")
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["timesteps"] == 128 and summary["device"] == "cpu"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["device"] == "cpu"  # a later --resume goes on there


def test_a_run_whose_config_names_a_bare_id_resumes_on_the_module_that_registers_it(finished_run, tmp_path, call_main):
    # Before the module:EnvId form was kept whole, config.yaml held its bare id, which a fresh process cannot make;
    # naming the module again was refused as another env.
    run_dir = _variant(finished_run, tmp_path / "bare")
    env = "gymnasium.envs.classic_control:CartPole-v1"
    result = call_main(train_main, "--resume", str(run_dir), "--timesteps", "128", "--env", env, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["env"] == env  # the next --resume needs no --env
    result = call_main(train_main, "--resume", str(run_dir), "--timesteps", "128", "--env", "gymnasium:Acrobot-v1")
    assert result.returncode == 2 and squashed("may only repeat that name") in squashed(result.stderr)


def test_evaluate_refuses_a_best_model_whose_statistics_are_missing_in_one_line(tmp_path, call_main):
    from sb3_gpu import make_plan, train_run
    from sb3_gpu.runs.rundir import RunDir

    overrides = {"n_steps": 32, "batch_size": 32, "normalize": True, "eval_freq": 32}
    plan = make_plan("ppo", "CartPole-v1", "cpu", n_envs=1, n_timesteps=64, vec_env="dummy", overrides=overrides)
    train_run(plan, tmp_path / "run", eval_episodes=1, progress=False, report_s=None)
    run = RunDir(tmp_path / "run")
    assert run.best_model.is_file() and run.final.vecnormalize.is_file()
    run.best_vecnormalize.unlink()  # the final model's statistics are still there, and are not the best model's
    result = call_main(evaluate_main, str(run.path), "--episodes", "1")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "but it holds no best_vecnormalize.pkl, the statistics saved with best_model.zip; --model final" in result.stderr
    assert call_main(evaluate_main, str(run.path), "--episodes", "1", "--model", "final").returncode == 0


def test_evaluate_does_not_check_what_only_training_allocates(finished_run, tmp_path, call_main):
    # A run made before a size check, or on a bigger machine, must stay evaluable: evaluation allocates none of it.
    run_dir = _variant(finished_run, tmp_path / "short")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["hyperparameters"]["n_timesteps"] = 16  # less than one rollout (n_steps * n_envs = 32)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    assert call_main(train_main, "--config", str(run_dir / "config.yaml"), "--plan").returncode == 2
    result = call_main(evaluate_main, str(run_dir), "--episodes", "1")
    assert result.returncode == 0, result.stderr


def test_no_save_replay_buffer_turns_off_what_a_replayed_config_saves(bad_files, call_main):
    # run_buffer's config.yaml says save_replay_buffer: true (refused for its PPO, which shows it is read); the flag
    # overrides it either way, as every other run option's flag does.
    config = str(bad_files["run_buffer"] / "config.yaml")
    assert call_main(train_main, "--config", config, "--plan").returncode == 2
    result = call_main(train_main, "--config", config, "--no-save-replay-buffer", "--plan")
    assert result.returncode == 0, result.stderr
    args = build_parser().parse_args(["--config", config, "--no-save-replay-buffer"])
    assert run_options(args).save_replay_buffer is False


@pytest.mark.parametrize(
    "args, message",
    [
        (["{broken}"], "is not a readable SB3 model zip"),
        (["{missing}"], "no such run dir or model file"),
        (["{existing}"], "holds no best_model.zip or model.zip"),
        (["{existing}", "--episodes", "0"], "--episodes: expected a positive integer"),
        (["{evil_run}"], "'system' is not a gymnasium.Env class"),
        (["{existing}", "--episodes", "1e30"], "--episodes: expected a positive integer up to 2,147,483,647"),
        (["{dqn_config}"], "holds a ppo model, and this run's config is for dqn"),
        (["{a2c_model}"], "holds an on-policy model that is not PPO's (A2C's or TRPO's, say"),
        (["{edited_net}"], "config.yaml gives (net_arch: null in the model, [8, 8] in config.yaml)"),
        (
            ["{edited}"],
            "best_model.zip was trained with other hyperparameters than its run's config.yaml gives (gamma: 0.98 in",
        ),
        (["{other_env}"], "was trained on an env with observation space Box(4,); the env it is loaded with has Box(6,)"),
        (["{done}/model.zip", "--model", "best"], "--model best picks a model in a run dir; "),
        (["{garbage_weights}"], "(UnpicklingError: its weights (a .pth member) are damaged, or hold more than plain tensors)"),
    ],
)
def test_evaluate_bad_input_exits_2_with_one_line(args, message, bad_files, call_main, tmp_path):
    result = call_main(evaluate_main, *[a.format(**bad_files) for a in args])
    assert not (tmp_path / "pwned").exists()
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.strip()] == [result.stderr.strip()]
    assert message in result.stderr


def test_evaluate_model_best_asked_for_by_name_is_not_stood_in_for_by_the_final_one(finished_run, tmp_path, call_main):
    run = _variant(finished_run, tmp_path / "run")
    (run / "best_model.zip").unlink()
    result = call_main(evaluate_main, str(run), "--episodes", "1", "--model", "best")
    assert result.returncode == 2
    assert result.stderr == f"error: {run} has no best_model.zip (no evaluation saved one); --model final: model.zip\n"
    default = call_main(evaluate_main, str(run), "--episodes", "1")  # the default takes the final model in its place
    assert default.returncode == 0 and f"{run / 'model.zip'}: return" in default.stdout


def test_evaluates_flags_each_reach_the_evaluation(finished_run, tmp_path, call_main):
    run = _variant(finished_run, tmp_path / "run")
    args = (str(run), "--episodes", "3", "--stochastic", "--seed", "3", "--video-length", "5")
    result = call_main(evaluate_main, *args, "--json")
    assert result.returncode == 0, result.stderr
    seeded = json.loads(result.stdout)
    assert seeded["episodes"] == 3 and seeded["deterministic"] is False
    assert seeded["video"]["frames"] == 5 and Path(seeded["video"]["path"]).is_file()
    # The seed makes the stochastic evaluation repeat; the text says what it was.
    again = call_main(evaluate_main, *args)
    shown = f"return {seeded['mean']:.2f} +/- {seeded['std']:.2f} over 3 episodes (stochastic)"
    assert again.returncode == 0 and shown in again.stdout, again.stdout


def test_evaluate_says_in_one_line_that_a_video_could_not_be_written_and_exits_1(
    finished_run, tmp_path, monkeypatch, call_main
):
    from sb3_gpu.runs import video

    run = _variant(finished_run, tmp_path / "run")
    monkeypatch.setattr(video, "complete_mp4", lambda path: False)  # what ffmpeg leaves on a full disk
    result = call_main(evaluate_main, str(run), "--episodes", "1", "--video-length", "5")
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    path = run / "videos" / "best_model.mp4"
    assert (
        result.stderr
        == f"error: could not write {path}: ffmpeg left the video incomplete (is the disk full?); any earlier one is kept\n"
    )
    assert not path.exists()

    # Any other OSError (an env's lost connection, say) is not a write that failed: it keeps its traceback.
    def connection_lost(*args):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr("sb3_gpu.runs.evaluation.evaluate", connection_lost)
    with pytest.raises(ConnectionResetError):
        evaluate_main([str(run), "--episodes", "1"])


# The table above runs in this process; these run the real commands, as a user would.
@pytest.mark.heavy
@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("sb3_gpu.train", ["ppo3"], "unknown algorithm 'ppo3'; did you mean 'ppo'"),
        ("sb3_gpu.train", ["ppo", "--timesteps", "0"], "--timesteps: expected a positive integer"),
        ("sb3_gpu.train", ["ppo", "--set", "bach_size=64"], "unknown key 'bach_size'; did you mean 'batch_size'"),
        ("sb3_gpu.evaluate", ["nowhere"], "no such run dir or model file"),
    ],
)
def test_bad_input_in_a_real_process_exits_2_with_one_line(module, args, message, tmp_path):
    result = run_cli(module, *args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == [result.stderr.strip()]
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.heavy
def test_a_run_logged_to_a_file_prints_no_progress_bar_and_commands_that_run_as_printed(tmp_path):
    run_dir = tmp_path / "logged"
    args = ("ppo", "--env", "CartPole-v1", "--timesteps", "1024", "--n-envs", "2", "--set", "n_epochs=1")
    args += ("--run-dir", str(run_dir), "--eval-episodes", "2", "--checkpoint-freq", "1024")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # a log file has no width
    result = subprocess.run([sys.executable, "-m", "sb3_gpu.train", *args], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # stdout is a pipe here, as in a log file: no bar redrawn, and the plan's rows are not folded into 80 columns.
    assert not any("━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━" in line and "/" in line for line in lines)
    assert any(
        line.startswith("evaluation: every 102 env steps (a tenth of the run; 10 times) and at the end, 2 deterministic")
        for line in lines
    )
    assert max(len(line) for line in lines) > 80
    watch, replay = (next(line for line in lines if line.startswith(prefix)) for prefix in ("watch it: ", "replay it: "))
    assert watch.endswith(f"-m sb3_gpu.evaluate {run_dir} --video")
    trained = json.loads((run_dir / "summary.json").read_text())["timesteps"]
    assert any(line.endswith(f"--resume {run_dir} --timesteps {2 * trained}   (a new total)") for line in lines)
    replayed = subprocess.run(
        [*replay.removeprefix("replay it:").split("   (")[0].split(), "--plan"], capture_output=True, text=True
    )
    assert replayed.returncode == 0 and "sb3_gpu plan: PPO on CartPole-v1" in replayed.stdout


def test_the_video_hint_is_left_out_for_an_env_whose_class_cannot_render(tmp_path):
    import tests.fault_envs  # noqa: F401  (imported, as the run imported it)
    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.train import next_commands

    run = RunDir(tmp_path)
    watch = f"-m sb3_gpu.evaluate {tmp_path} --video"
    assert any(line.endswith(watch) for line in next_commands(run, "CartPole-v1"))
    assert any(line.endswith(watch) for line in next_commands(run, None))  # unknown (a factory): offered
    lines = next_commands(run, "tests.fault_envs:Endless")  # metadata without rgb_array
    assert not any("--video" in line for line in lines) and lines[0].startswith("replay it: ")


def test_the_summary_shows_values_with_brackets_as_written(tmp_path):
    from rich.console import Console

    from sb3_gpu.runs.curves import missing
    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.train import summary_table

    summary = {"timesteps": 64, "wall_time_s": 1.0, "steps_per_s": 64.0, "model": "m.zip", "curves": f"not drawn: {missing()}"}
    console = Console(record=True, width=200)
    console.print(summary_table(summary, RunDir(tmp_path)))
    assert "(sb3_gpu's [plot] extra)" in console.export_text()  # rich markup would have eaten "[plot]"


def test_the_summary_folds_a_long_path_on_a_narrow_terminal_rather_than_cutting_it(tmp_path):
    from rich.console import Console

    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.train import summary_table

    model = "/tmp/experiments/cartpole/ppo-baseline-seed0-lr1e-3-a-long-name-to-copy/model.zip"
    summary = {"timesteps": 64, "wall_time_s": 1.0, "steps_per_s": 64.0, "model": model}
    console = Console(record=True, width=80)
    console.print(summary_table(summary, RunDir(tmp_path)))
    cells = "".join(line.split("│")[2].strip() for line in console.export_text().splitlines() if line.count("│") == 3)
    assert model in cells and "…" not in console.export_text()


@pytest.mark.parametrize(
    "window, span",
    [
        ({"window_s": 30.0, "window_whole": 0.0}, "over the last 30 s"),
        ({"window_s": 12.4, "window_whole": 0.0}, "over the last 12 s"),  # a run of 17 s: its first 5 left out
        ({"window_s": 8.0, "window_whole": 1.0}, "over the whole run"),
    ],
)
def test_the_summary_says_what_span_the_current_speed_is_measured_over(window, span, tmp_path):
    from rich.console import Console

    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.train import summary_table

    # 300 s of wall time (setup, an owed evaluation) say nothing of the span: the telemetry says it.
    throughput = {"env_steps_per_s": 900.0, "episodes_per_s": 2.0, **window}
    summary = {"timesteps": 64, "wall_time_s": 300.0, "steps_per_s": 500.0, "model": "m.zip", "throughput": throughput}
    console = Console(record=True, width=200)
    console.print(summary_table(summary, RunDir(tmp_path)))
    # Measured whole, the telemetry's figure (training alone, not the setup) is the one the row gives.
    both = (
        "900 env steps/s over the whole run"
        if span == "over the whole run"
        else f"500 env steps/s over the whole run, 900 env steps/s {span}"
    )
    assert f"{both}; 2.0 episodes/s" in console.export_text()


def test_a_resumed_runs_summary_says_its_time_and_speeds_are_since_the_resume(tmp_path):
    from rich.console import Console

    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.train import summary_table

    # 1M timesteps of which this pass trained 200,000 in 1,000 s: not "the whole run" (its first pass is not counted).
    throughput = {"env_steps_per_s": 210.0, "episodes_per_s": 0.2, "window_s": 30.0, "window_whole": 0.0}
    summary = {"timesteps": 1_000_000, "steps": 200_000, "wall_time_s": 1000.0, "steps_per_s": 200.0, "model": "m.zip"}
    console = Console(record=True, width=200)
    console.print(summary_table({**summary, "throughput": throughput}, RunDir(tmp_path)))
    text = console.export_text()
    assert "1000.0 s (200,000 steps since the resume)" in text
    assert "200 env steps/s since the resume, 210 env steps/s over the last 30 s; 0.2 episodes/s" in text
    assert "whole run" not in text


def test_a_model_zip_that_records_no_spaces_is_left_to_sb3s_own_refusal():
    import gymnasium as gym

    from sb3_gpu.envs.spec import space_text
    from sb3_gpu.runs.saving import _check_same_spaces

    template = PPO("MlpPolicy", "CartPole-v1", _init_setup_model=False)
    _check_same_spaces(Path("m.zip"), {}, template)  # nothing recorded: not compared (SB3's load refuses it)
    _check_same_spaces(Path("m.zip"), {"observation_space": "Box(4,)"}, template)
    assert space_text(None) is None and space_text([1, 2]) is None and space_text(gym.spaces.Discrete(2)) == "Discrete(2)"


def test_a_model_trained_on_one_dict_space_is_refused_on_a_dict_of_other_keys_or_shapes(tmp_path):
    import gymnasium as gym

    from sb3_gpu.envs.spec import space_text
    from sb3_gpu.runs.saving import _check_same_spaces, read_zip_data

    def dict_space(**members):
        return gym.spaces.Dict(
            {"level": gym.spaces.Discrete(3, start=1), "steer": gym.spaces.MultiDiscrete([2, 3]), **members}
        )

    class Env(gym.Env):
        observation_space = dict_space(a=gym.spaces.Box(-1, 1, (3,)), img=gym.spaces.Box(0, 255, (3, 40, 40), np.uint8))
        action_space = gym.spaces.Discrete(2)

    PPO("MultiInputPolicy", Env(), n_steps=16, batch_size=16, device="cpu").save(tmp_path / "m.zip")
    data = read_zip_data(tmp_path / "m.zip")
    recorded = "Dict(a: Box(3,), img: Box(3,40,40), level: Discrete(3), steer: MultiDiscrete(2 3))"
    assert space_text(data["observation_space"]) == space_text(Env.observation_space) == recorded
    for other in (
        dict_space(x=gym.spaces.Box(-1, 1, (3,)), img=gym.spaces.Box(0, 255, (3, 40, 40), np.uint8)),  # another key
        dict_space(a=gym.spaces.Box(-1, 1, (3,)), img=gym.spaces.Box(0, 255, (3, 36, 36), np.uint8)),  # another shape
    ):
        Env.observation_space = other
        template = PPO("MultiInputPolicy", Env(), _init_setup_model=False)
        with pytest.raises(ConfigError, match=rf"observation space {re.escape(recorded)}; the env it is loaded with has Dict"):
            _check_same_spaces(tmp_path / "m.zip", data, template)


def test_the_plan_names_the_flag_that_set_each_value():
    from sb3_gpu.train import build_parser, plan_from_args

    args = ["dqn", "--amp", "off", "--no-probe", "--threads", "1", "--per", "--set", "n_steps=2", "--plan"]
    sources = plan_from_args(build_parser().parse_args(args)).preset.sources
    assert [sources[k] for k in ("amp", "probe", "threads", "per", "n_steps")] == [
        "--amp",
        "--no-probe",
        "--threads",
        "--per",
        "--set",
    ]
    # A --set refines --per's mapping (the preset's), and each is named; one that sets a flag's own key is refused
    # (tested with bad input).
    sources = plan_from_args(build_parser().parse_args([*args, "--set", "per.alpha=0.5"])).preset.sources
    assert sources["per"] == "dqn.yaml:CartPole-v1 and --per and --set"
    assert plan_from_args(build_parser().parse_args(["dqn", "--no-per", "--plan"])).preset.sources["per"] == "--no-per"


def test_run_options_are_refused_before_the_plan_is_made(call_main, monkeypatch):
    # The plan's probe may compile a step for a minute on a CPU: a refused option must not wait for it.
    import sb3_gpu.train as train_module

    def no_plan(args):
        raise AssertionError("planned before the run options were checked")

    monkeypatch.setattr(train_module, "plan_from_args", no_plan)
    result = call_main(train_main, "ppo", "--save-replay-buffer", "--plan")  # PPO keeps no replay buffer
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


def test_the_next_commands_run_as_pasted_whatever_the_run_dir_is_called(tmp_path):
    import shlex

    from sb3_gpu.runs.rundir import RunDir
    from sb3_gpu.train import next_commands

    run = RunDir(tmp_path / "rün dir's\nnew ☃")
    words = [shlex.split(line.split(":", 1)[1].split("   (")[0]) for line in next_commands(run, "CartPole-v1", 1000)]
    assert [w[1:] for w in words] == [
        ["-m", "sb3_gpu.evaluate", str(run), "--video"],
        ["-m", "sb3_gpu.train", "--config", str(run.config)],
        ["-m", "sb3_gpu.train", "--resume", str(run), "--timesteps", "2000"],
        ["--logdir", str(run.tensorboard)],
    ]


@pytest.mark.parametrize("given", ["SAC", " sac", "Sac\t"])
def test_an_algorithm_is_read_whatever_its_case_and_spaces(given):
    # The stripped name picks the default env: " sac" once got CartPole-v1, and an error that SAC needs a Box.
    assert build_parser().parse_args([given]).algo == "sac"
