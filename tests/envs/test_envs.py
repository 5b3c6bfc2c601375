from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import re
import sys
import threading
import warnings

import gymnasium as gym
import numpy as np
import pytest
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecFrameStack

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.envs.build import VecEnvFallbackWarning, make_vec_env
from sb3_gpu.envs.choice import choose_vec_env, vec_env_choice
from sb3_gpu.envs.spec import resolve_env


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def fails_in_worker() -> gym.Env:
    # Works in the parent, fails in a subprocess: like an env registered only at run time in __main__.
    if mp.parent_process() is not None:
        raise RuntimeError("env 'MyEnv-v0' is not registered in this process")
    return gym.make("CartPole-v1")


class ResetFailsInWorker(gym.Wrapper):
    def reset(self, **kwargs):
        if mp.parent_process() is not None:
            raise OSError("device /dev/sim0 busy")
        return super().reset(**kwargs)


def reset_fails_in_worker() -> gym.Env:
    return ResetFailsInWorker(gym.make("CartPole-v1"))


def test_registered_id_resolves():
    spec = resolve_env("CartPole-v1")
    assert spec.name == "CartPole-v1" and not spec.is_atari
    assert spec.make().observation_space.shape == (4,)


def test_unknown_id_suggests_the_closest_registered_names():
    with pytest.raises(ConfigError, match=r"unknown env id 'CartPol-v1'; did you mean 'CartPole-v1'"):
        resolve_env("CartPol-v1")


def test_gymnasium_module_colon_id_form_resolves_through_the_registry(tmp_path):
    spec = resolve_env("gymnasium.envs.classic_control:CartPole-v1")
    assert spec.name == "gymnasium.envs.classic_control:CartPole-v1" and spec.make().spec.id == "CartPole-v1"
    # Its preset entry is the id's.
    from sb3_gpu.planning.plan import make_plan

    plan = make_plan("ppo", spec.name, "cpu", overrides={"probe": False})
    assert plan.preset.sources["n_steps"] == "ppo.yaml:CartPole-v1"
    # An entry keyed by the whole name is the one for it.
    own = tmp_path / "own.yaml"
    own.write_text(f"default: {{n_steps: 64}}\nCartPole-v1: {{n_steps: 128}}\n'{spec.name}': {{n_steps: 256}}\n")
    plan = make_plan("ppo", spec.name, "cpu", preset=own, overrides={"probe": False})
    assert plan.preset.params.n_steps == 256


def test_an_id_a_module_registers_is_made_in_a_fresh_process_too(tmp_path, monkeypatch):
    # The name kept only the id: a worker, a resumed run or an evaluation (a fresh process) never imported the module
    # that registers it, and failed with "Environment doesn't exist" (SubprocVecEnv fell back to DummyVecEnv).
    import pickle
    import subprocess
    import sys

    (tmp_path / "registers_an_env.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('Registered-v3', entry_point='gymnasium.envs.classic_control:CartPoleEnv', max_episode_steps=7)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = resolve_env("registers_an_env:Registered-v3")
    assert spec.name == "registers_an_env:Registered-v3"  # what config.yaml keeps
    made = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; env = pickle.loads(sys.stdin.buffer.read())(); print(env.spec.id)"],
        input=pickle.dumps(spec.make),
        capture_output=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
        timeout=120,
        check=False,
    )
    assert made.returncode == 0 and made.stdout.decode().strip() == "Registered-v3", made.stderr.decode()[-500:]
    with pytest.raises(ConfigError, match=r"has no attribute 'Registered-v4'; did you mean 'Registered-v3'"):
        resolve_env("registers_an_env:Registered-v4")


def test_a_name_resolves_to_an_env_class_and_never_to_a_function(tmp_path):
    spec = resolve_env("gymnasium.envs.classic_control.cartpole:CartPoleEnv")
    assert spec.make().observation_space.shape == (4,)
    marker = tmp_path / "ran"
    for name, kwargs in (
        ("tests.envs.test_envs:cartpole", {}),
        ("os:system", {"command": f"touch {marker}"}),
        # A wrapper is an Env subclass, but takes an env, and Monitor writes the file it is named.
        ("stable_baselines3.common.monitor:Monitor", {"env": "CartPole-v1", "filename": str(marker)}),
    ):
        with pytest.raises(ConfigError, match=r"is not a gymnasium\.Env class \(nor may it be a wrapper, which takes an "):
            resolve_env(name, kwargs)
    assert not marker.exists(), "refused before anything was called"
    assert resolve_env(cartpole).make().spec.id == "CartPole-v1", "a factory is passed as a callable"


@pytest.mark.parametrize(
    "target, message",
    [
        ("no_such_package.envs:Env", "cannot import module 'no_such_package.envs'"),
        ("gymnasium.envs.classic_control.cartpole:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
        ("gymnasium.envs.classic_control.cartpole:__name__", "is not a gymnasium.Env class"),
        (":NoModule", "cannot import module ''"),
    ],
)
def test_module_attr_that_does_not_import_is_an_error(target, message):
    with pytest.raises(ConfigError, match=message):
        resolve_env(target)


def test_atari_ids_are_marked_and_wrapped_with_frame_stack():
    spec = resolve_env("ALE/Pong-v5")
    assert spec.is_atari
    venv = make_vec_env(spec, 2, vec_env="dummy", frame_stack=4, seed=0)
    assert isinstance(venv, VecFrameStack)
    assert venv.observation_space.shape == (84, 84, 4)
    assert venv.reset().shape == (2, 84, 84, 4)
    venv.close()


@pytest.mark.parametrize("env_id", ["ALE/Pong-v5", "Pong-v4", "Pong-v0", "PongNoFrameskip-v4"])
def test_atari_ids_leave_the_frame_skip_to_sb3s_wrapper_alone(env_id):
    # Pong-v4 skips 2 to 4 frames itself, ALE/Pong-v5 4: under the AtariWrapper's own 4 an action would last 8-20.
    env = resolve_env(env_id).make()
    assert env.unwrapped._frameskip == 1
    env.close()


def test_a_plan_refuses_envpool_where_the_run_would():
    from sb3_gpu.envs.choice import vec_env_choice

    with pytest.raises(ConfigError, match=r"no faithful twin of 'Pong-v4' \(supported: .* and Atari games as ALE/<Game>-v5"):
        vec_env_choice("envpool", resolve_env("Pong-v4"), 2, cores=2)


def test_factory_and_kwargs_are_accepted():
    venv = make_vec_env("CartPole-v1", 3, vec_env="dummy", env_kwargs={"max_episode_steps": 7}, seed=1)
    assert isinstance(venv, DummyVecEnv) and venv.num_envs == 3
    venv.reset()
    for _ in range(7):
        _, _, dones, infos = venv.step(np.zeros(3, dtype=int))
    assert dones.all() and infos[0]["TimeLimit.truncated"] in (True, False)
    venv.close()


def test_same_seed_gives_the_same_first_observations():
    a = make_vec_env(cartpole, 2, vec_env="dummy", seed=3)
    b = make_vec_env(cartpole, 2, vec_env="dummy", seed=3)
    np.testing.assert_array_equal(a.reset(), b.reset())


def test_subproc_starts_and_steps():
    venv = make_vec_env("CartPole-v1", 2, vec_env="subproc", seed=0)
    assert isinstance(venv, SubprocVecEnv)
    venv.reset()
    obs, rewards, _, _ = venv.step(np.zeros(2, dtype=int))
    assert obs.shape == (2, 4) and rewards.tolist() == [1.0, 1.0]
    venv.close()


@pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(), reason="no forkserver on this platform")
def test_a_subproc_vec_env_has_the_forkserver_preload_torch_and_sb3_for_later_workers(monkeypatch):
    # A forkserver started by a plain SubprocVecEnv would otherwise make every later worker (batched ones too, an eval
    # env's) import torch and SB3 itself: seconds per worker.
    from multiprocessing import forkserver

    from sb3_gpu.envs import build

    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", ["__main__"])  # as a process that has started none
    preloads = []

    class Recording(DummyVecEnv):  # what the server would preload, at the moment the workers would start
        def __init__(self, env_fns, start_method=None):
            preloads.append((start_method, list(forkserver._forkserver._preload_modules)))
            for fn in env_fns:  # a worker's settings (one thread, Ctrl-C ignored) would stay in this test process
                fn.worker = False
            super().__init__(env_fns)

    class Subclass(Recording):  # a user's own SubprocVecEnv, passed as vec_env_cls
        pass

    monkeypatch.setattr(build, "SubprocVecEnv", Recording)
    make_vec_env("CartPole-v1", 2, vec_env="subproc", seed=0, vec_env_kwargs={"start_method": "spawn"}).close()
    make_vec_env("CartPole-v1", 2, vec_env="subproc", seed=0).close()
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", ["__main__"])
    make_vec_env("CartPole-v1", 2, seed=0, vec_env_cls=Subclass).close()
    preloaded = ["__main__", "sb3_gpu.envs.spec", "sb3_gpu.envs.batched"]
    assert preloads == [("spawn", ["__main__"]), (None, preloaded), (None, preloaded)]  # spawn has no server to preload


def test_subproc_and_dummy_agree_for_the_same_seed():
    dummy = make_vec_env("CartPole-v1", 2, vec_env="dummy", seed=5)
    sub = make_vec_env("CartPole-v1", 2, vec_env="subproc", seed=5)
    np.testing.assert_array_equal(dummy.reset(), sub.reset())
    sub.close()


def test_unpicklable_factory_falls_back_with_one_warning_naming_the_cause():
    lock = threading.Lock()

    def factory() -> gym.Env:
        with lock:
            return gym.make("CartPole-v1")

    with pytest.warns(VecEnvFallbackWarning, match="cannot be pickled") as record:
        venv = make_vec_env(factory, 2, vec_env="subproc")
    assert len(record) == 1
    assert isinstance(venv, DummyVecEnv) and venv.num_envs == 2


@pytest.mark.heavy
def test_factory_failing_only_in_workers_falls_back_and_names_the_cause():
    before = set(mp.active_children())
    with pytest.warns(VecEnvFallbackWarning, match="RuntimeError: env 'MyEnv-v0' is not registered") as record:
        venv = make_vec_env(fails_in_worker, 2, vec_env="subproc")
    assert len(record) == 1
    assert isinstance(venv, DummyVecEnv)
    assert venv.reset().shape == (2, 4)
    assert set(mp.active_children()) <= before, "workers of the failed start must not linger"


def fails_everywhere() -> gym.Env:
    raise ZeroDivisionError("division by zero")


def reset_fails_everywhere() -> gym.Env:
    return _ResetFails()


class _ResetFails(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        raise KeyError("level file")


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["subproc", "batched"])
@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (fails_everywhere, r"^env 'fails_everywhere' failed to build: ZeroDivisionError: division by"),
        # It warned that the workers could not start, fell back to DummyVecEnv, and failed again at the first learn().
        (reset_fails_everywhere, r"^env 'reset_fails_everywhere' failed on its first reset or step: KeyError: 'level"),
    ],
)
def test_an_env_that_fails_in_this_process_too_is_refused_without_a_fallback_warning(kind, factory, message):
    # The workers' failure is then the env's own: a warning that falls back to DummyVecEnv, and the same error
    # raised from it, would point at the wrong cause.
    before = set(mp.active_children())
    with warnings.catch_warnings():
        warnings.simplefilter("error", VecEnvFallbackWarning)
        with pytest.raises(ConfigError, match=message):
            make_vec_env(factory, 2, vec_env=kind)
    assert set(mp.active_children()) <= before, "workers of the failed start must not linger"


@pytest.mark.heavy
def test_worker_dying_on_first_reset_falls_back():
    with pytest.warns(VecEnvFallbackWarning, match="SubprocVecEnv could not start"):
        venv = make_vec_env(reset_fails_in_worker, 2, vec_env="subproc")
    assert isinstance(venv, DummyVecEnv)


def test_dummy_choice_raises_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_vec_env("CartPole-v1", 2, vec_env="dummy").close()


def test_auto_picks_dummy_for_cheap_envs_on_this_machine(monkeypatch):
    monkeypatch.setattr("sb3_gpu.envs.choice.envpool_available", lambda: False)
    assert isinstance(make_vec_env("CartPole-v1", 4, vec_env="auto"), DummyVecEnv)
    assert isinstance(make_vec_env(cartpole, 4, vec_env="auto"), DummyVecEnv)  # a factory: EnvPool never applies


@pytest.mark.parametrize(
    "n_envs, step_s, cores, kind",
    [
        (1, 1e-2, 64, "dummy"),  # one env
        (8, 1e-2, 1, "dummy"),  # one core
        (8, 15e-6, 2, "dummy"),  # CartPole: IPC dwarfs the step
        (8, 40e-6, 16, "dummy"),  # LunarLander, many cores: still IPC-bound
        (8, 800e-6, 16, "batched"),  # Atari with the wrapper: heavy steps spread over cores
        (8, 800e-6, 2, "batched"),  # ... even on two cores (measured 1.1-1.6x dummy on Pong)
        (32, 60e-6, 2, "dummy"),  # LunarLander on two cores: measured slower than dummy
        (64, 2e-3, 128, "batched"),
    ],
)
def test_auto_choice_follows_step_cost_and_cores(n_envs, step_s, cores, kind):
    chosen, reason = choose_vec_env("auto", n_envs, step_s, cores)
    assert chosen == kind and reason


def test_auto_prefers_envpool_where_it_fits_and_never_picks_sb3_subproc():
    assert choose_vec_env("auto", 64, 8e-6, 2, envpool=True)[0] == "envpool"  # CartPole x64
    kind, reason = choose_vec_env("auto", 8, 8e-6, 2, envpool=True)  # x8: EnvPool's thread wake-ups cost more
    assert kind == "dummy" and reason.endswith(
        "; EnvPool not taken: a 64.0 us vec step is under the 200 us its thread pool needs"
    )
    assert choose_vec_env("auto", 8, 38e-6, 2, envpool=True)[0] == "envpool"  # LunarLander x8
    assert choose_vec_env("auto", 8, 800e-6, 2, envpool=True)[0] == "envpool"  # Atari
    kinds = {choose_vec_env("auto", n, s, c)[0] for n in (2, 8, 64) for s in (1e-5, 1e-3, 1e-1) for c in (2, 16, 128)}
    assert kinds == {"dummy", "batched"}


def test_where_the_model_is_in_doubt_the_batched_overhead_is_measured_here(monkeypatch):
    from sb3_gpu.envs import choice

    asked = []

    def fast_machine(workers):
        asked.append(workers)
        return choice.BatchedCosts(120e-6, 2e-6, measured=True)

    monkeypatch.setattr(choice, "batched_costs", fast_machine)
    lunar = resolve_env("LunarLander-v3")
    # 64 envs of 34 us on 2 cores: a slow VM's costs say 1.04x (dummy); this machine's, 1.63x.
    picked = vec_env_choice("auto", lunar, 64, cores=2, step_seconds=34e-6, envpool_allowed=False)
    assert picked.kind == "batched" and asked == [2]
    assert picked.reason.endswith("est. 1.63x dummy (its overhead measured here: 120 us a step + 2.0 us an env)")
    # Clear either way: not measured.
    assert vec_env_choice("auto", lunar, 8, cores=2, step_seconds=1e-6, envpool_allowed=False).kind == "dummy"
    assert vec_env_choice("auto", lunar, 8, cores=2, step_seconds=1e-2, envpool_allowed=False).kind == "batched"
    assert vec_env_choice("auto", lunar, 64, cores=1, step_seconds=34e-6, envpool_allowed=False).kind == "dummy"
    assert vec_env_choice("dummy", lunar, 64, cores=2, step_seconds=34e-6).kind == "dummy"
    assert asked == [2]
    # Where the workers cannot start, the defaults stand.
    monkeypatch.setattr(choice, "batched_costs", lambda workers: None)
    picked = vec_env_choice("auto", lunar, 64, cores=2, step_seconds=34e-6, envpool_allowed=False)
    assert picked.kind == "dummy" and "measured" not in picked.reason


def test_a_plan_times_no_batched_overhead_for_made_up_hardware_or_with_the_probe_off(monkeypatch, cpu_machine):
    from sb3_gpu.envs import choice
    from sb3_gpu.planning.plan import make_plan

    asked = []
    monkeypatch.setattr(choice, "batched_costs", lambda workers: asked.append(workers))
    monkeypatch.setattr(choice, "envpool_fits", lambda spec: False)  # LunarLander x64 on 2 cores: then in doubt
    make_plan("ppo", "LunarLander-v3", hardware=dataclasses.replace(cpu_machine, logical_cores=2), n_envs=64)
    assert asked == [], "another machine's cores: nothing here is timed for it"
    make_plan("ppo", "LunarLander-v3", "cpu", n_envs=64, overrides={"probe": False}, training=False)
    assert asked == []
    assert vec_env_choice("auto", resolve_env("LunarLander-v3"), 64, cores=2, step_seconds=34e-6).kind == "dummy"
    assert asked == [2]


@pytest.mark.heavy
def test_the_batched_overhead_is_timed_with_real_workers():
    from sb3_gpu.envs.batched import measure_overhead

    before = set(mp.active_children())
    step_s, per_env_s = measure_overhead(2, steps=50)
    # Timed (seconds, not the zero of a loop never run), whatever the machine's load: no bound on the speed itself.
    assert math.isfinite(step_s) and math.isfinite(per_env_s) and step_s >= 0.0 and per_env_s >= 0.0
    assert step_s + per_env_s > 0
    assert set(mp.active_children()) <= before, "its workers are gone"


def test_explicit_choice_is_kept_and_bad_names_rejected():
    assert choose_vec_env("subproc", 1, 0.0, 1) == ("subproc", "asked for")
    with pytest.raises(ConfigError, match="unknown vec_env 'subprocess'; did you mean 'subproc'"):
        choose_vec_env("subprocess", 2, 0.0, 2)


@pytest.mark.parametrize("n_envs", [0, -3, 2.5, True])
def test_n_envs_must_be_a_positive_int(n_envs):
    with pytest.raises(ConfigError, match="n_envs must be a positive int"):
        make_vec_env("CartPole-v1", n_envs)


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["subproc", "batched"])
def test_script_without_main_guard_falls_back_and_runs_only_once(tmp_path, kind):
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(
        "import warnings\n"
        "from sb3_gpu import make_vec_env\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    venv = make_vec_env('CartPole-v1', 4, vec_env={kind!r})\n"
        "print('KIND', type(venv).__name__)\n"
        "print('WARN', *[str(w.message) for w in caught])\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("KIND") == 1, "workers must not run the script's body"
    assert "KIND DummyVecEnv" in out.stdout and "missing __main__ guard" in out.stdout
    assert "Traceback" not in out.stderr, "each worker printed a page of traceback before the warning said why"


@pytest.mark.heavy
@pytest.mark.parametrize("fails_in", ["__init__", "reset"])
def test_an_env_that_fails_only_in_workers_falls_back_without_a_traceback_from_each(tmp_path, fails_in):
    # SB3's workers print a page of traceback each (their process's own), before the warning that says why once.
    script = (
        "import multiprocessing as mp\n"
        "import gymnasium as gym\n"
        "class WorkerOnlyFails(gym.Wrapper):\n"
        "    def __init__(self):\n"
        "        super().__init__(gym.make('CartPole-v1'))\n"
        f"        self.{'init' if fails_in == '__init__' else 'reset'}_fails = mp.parent_process() is not None\n"
        "        if getattr(self, 'init_fails', False):\n"
        "            raise RuntimeError('no licence server in a worker')\n"
        "    def reset(self, **kwargs):\n"
        "        if getattr(self, 'reset_fails', False):\n"
        "            raise RuntimeError('no licence server in a worker')\n"
        "        return self.env.reset(**kwargs)\n"
    )
    out = _run_script(script, "subproc", "forkserver", "WorkerOnlyFails", tmp_path / "worker_only.py")
    assert "KIND DummyVecEnv" in out
    assert "SubprocVecEnv could not start (env0: RuntimeError: no licence server in a worker)" in out, out


def _run_script(script: str, kind: str, start_method: str, env: str, path) -> str:
    """Run ``script``'s lines, which make a vec env of ``env`` in a __main__ guard: from the file ``path``, or piped to
    ``python -`` where ``path`` is None; the lines it printed (KIND and WARN)."""
    import subprocess
    import sys

    script += (
        "if __name__ == '__main__':\n"
        "    import warnings\n"
        "    from sb3_gpu import make_vec_env\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        f"        venv = make_vec_env({env}, 3, vec_env={kind!r}, vec_env_kwargs={{'start_method': {start_method!r}}})\n"
        "        venv.reset()\n"
        "    print('KIND', type(venv).__name__)\n"
        "    print('WARN', *[str(w.message) for w in caught])\n"
        "    venv.close()\n"
    )
    if path is None:
        run = [sys.executable, "-"]
    else:
        path.write_text(script)
        run, script = [sys.executable, str(path)], ""
    out = subprocess.run(
        run, input=script, capture_output=True, text=True, timeout=300, check=False, cwd=path.parent if path else None
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out.stdout


@pytest.mark.heavy
@pytest.mark.parametrize(("kind", "start_method"), [("subproc", "spawn"), ("batched", "forkserver")])
def test_workers_start_for_a_script_whose_top_level_registers_its_env(tmp_path, kind, start_method):
    # Spawn and forkserver workers run the script again: what its imports and top level register, they know.
    script = (
        "import gymnasium as gym\n"
        "gym.register('Registered-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv', max_episode_steps=50)\n"
    )
    out = _run_script(script, kind, start_method, "'Registered-v0'", tmp_path / "registers.py")
    assert f"KIND {'BatchedSubprocVecEnv' if kind == 'batched' else 'SubprocVecEnv'}\nWARN\n" in out, out


@pytest.mark.heavy
@pytest.mark.parametrize(("kind", "start_method"), [("subproc", "spawn"), ("batched", "forkserver")])
def test_a_script_piped_to_python_gets_its_workers(kind, start_method):
    # They tried to run the script again from the file "<stdin>", and none started: DummyVecEnv, its warning naming a
    # missing __main__ guard.
    out = _run_script("", kind, start_method, "lambda: __import__('gymnasium').make('CartPole-v1')", None)
    assert f"KIND {'BatchedSubprocVecEnv' if kind == 'batched' else 'SubprocVecEnv'}\nWARN\n" in out, out


# --- SB3's make_vec_env signature ----------------------------------------------------------------------------------
def test_sb3_arguments_mean_what_they_mean_in_sb3(tmp_path):
    from gymnasium.wrappers import TimeLimit
    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env

    kwargs = {"seed": 3, "start_index": 2, "wrapper_class": TimeLimit, "wrapper_kwargs": {"max_episode_steps": 5}}
    ours = make_vec_env("CartPole-v1", 2, monitor_dir=str(tmp_path / "ours"), vec_env_cls=DummyVecEnv, **kwargs)
    theirs = sb3_make_vec_env("CartPole-v1", 2, monitor_dir=str(tmp_path / "sb3"), vec_env_cls=DummyVecEnv, **kwargs)
    np.testing.assert_array_equal(ours.reset(), theirs.reset())  # the same seeds for the same envs
    dones = [ours.step(np.zeros(2, dtype=int))[2] for _ in range(5)]
    assert not any(d.any() for d in dones[:4]) and dones[4].all(), "the wrapper and its kwargs: episodes of 5 steps"
    assert isinstance(ours, DummyVecEnv) and ours.env_is_wrapped(TimeLimit) == [True, True]
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["2.monitor.csv", "3.monitor.csv"]
    assert sorted(p.name for p in (tmp_path / "sb3").iterdir()) == ["2.monitor.csv", "3.monitor.csv"]
    ours.close()
    theirs.close()


class _TaggedVecEnv(DummyVecEnv):
    def __init__(self, env_fns, tag: str = "") -> None:
        super().__init__(env_fns)
        self.tag = tag


def test_vec_env_cls_picks_the_class_and_passes_its_kwargs():
    venv = make_vec_env("CartPole-v1", 2, vec_env_cls=_TaggedVecEnv, vec_env_kwargs={"tag": "mine"})
    try:
        assert type(venv) is _TaggedVecEnv and venv.tag == "mine" and venv.num_envs == 2
    finally:
        venv.close()
    venv = make_vec_env("CartPole-v1", 2, vec_env_cls=SubprocVecEnv, vec_env_kwargs={"start_method": "spawn"})
    try:
        assert isinstance(venv, SubprocVecEnv)
    finally:
        venv.close()


def test_vec_env_and_vec_env_cls_together_are_refused():
    with pytest.raises(ConfigError, match=r"give vec_env \('batched'\) or vec_env_cls \(DummyVecEnv\), not both"):
        make_vec_env("CartPole-v1", 2, vec_env="batched", vec_env_cls=DummyVecEnv)


def test_a_wrapper_class_keeps_atari_preprocessing_off_and_envpool_out():
    from stable_baselines3.common.atari_wrappers import AtariWrapper

    pytest.importorskip("ale_py")
    venv = make_vec_env("ALE/Pong-v5", 1, wrapper_class=AtariWrapper, vec_env="dummy")
    try:
        assert venv.env_is_wrapped(AtariWrapper) == [True]
        assert venv.observation_space.shape == (84, 84, 1), "wrapped once, by the caller's AtariWrapper"
    finally:
        venv.close()
    with pytest.raises(ConfigError, match="a Python wrapper_class or monitor_kwargs cannot apply"):
        make_vec_env("CartPole-v1", 2, wrapper_class=AtariWrapper, vec_env="envpool")


def test_vec_env_kwargs_without_a_class_that_takes_them_are_refused():
    for vec_env in ("auto", "dummy"):
        with pytest.raises(ConfigError, match=r"vec_env_kwargs \['start_method'\] need a class that takes them"):
            make_vec_env("CartPole-v1", 2, vec_env=vec_env, vec_env_kwargs={"start_method": "spawn"})


def test_envpool_names_its_monitor_files_from_start_index(tmp_path):
    from sb3_gpu.envs.envpool_vec import envpool_available

    if not envpool_available():
        pytest.skip("EnvPool is not installed (the envpool extra)")
    venv = make_vec_env("CartPole-v1", 2, start_index=5, monitor_dir=str(tmp_path), vec_env="envpool", seed=0)
    venv.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5.monitor.csv", "6.monitor.csv"]
    with pytest.raises(ConfigError, match="monitor_kwargs cannot apply"):
        make_vec_env("CartPole-v1", 2, vec_env="envpool", monitor_kwargs={"info_keywords": ("x",)})


def test_more_envs_than_the_open_file_limit_allows_are_refused_before_any_is_built(monkeypatch, tmp_path):
    import resource

    real = resource.getrlimit
    limited = lambda which: (1024, 1024) if which == resource.RLIMIT_NOFILE else real(which)  # noqa: E731
    monkeypatch.setattr(resource, "getrlimit", limited)
    with pytest.raises(ConfigError, match=r"n_envs=2,000 needs about 2,064 open files .* may open 1,024 \(ulimit -n\)"):
        make_vec_env("CartPole-v1", 2000, vec_env="dummy", monitor_dir=str(tmp_path / "monitor"))
    assert not (tmp_path / "monitor").exists(), "refused before a single Monitor file was opened"


@pytest.mark.parametrize(
    ("kind", "n_envs", "monitor", "limits", "refused"),
    [
        # Two pipe ends per worker, one Monitor CSV per env, a margin for the rest of the process.
        ("subproc", 100, False, {"NOFILE": 263}, "n_envs=100 needs about 264 open files"),
        ("subproc", 100, True, {"NOFILE": 363}, "n_envs=100 needs about 364 open files"),
        ("subproc", 100, False, {"NOFILE": 264}, None),
        ("dummy", 300, False, {"NOFILE": 64}, None),  # no workers, no files of its own
        ("batched", 100, False, {"NOFILE": "unlimited", "NPROC": 16}, None),  # one worker per core: 16
        ("batched", 100, False, {"NPROC": 15}, "vec_env 'batched' would start 16 processes; this user may run 15"),
        ("subproc", 40, False, {"NPROC": 39}, "vec_env 'subproc' would start 40 processes; this user may run 39"),
        ("subproc", 40, False, {"NPROC": "unlimited"}, None),
    ],
)
def test_the_process_limits_refuse_only_a_vec_env_they_cannot_hold(monkeypatch, kind, n_envs, monitor, limits, refused):
    import resource

    from sb3_gpu.envs.choice import check_env_resources

    def limited(which):
        for name, limit in limits.items():
            if which == getattr(resource, f"RLIMIT_{name}"):
                limit = resource.RLIM_INFINITY if limit == "unlimited" else limit
                return limit, limit
        return resource.RLIM_INFINITY, resource.RLIM_INFINITY  # the rest unlimited: only what the case sets can refuse

    monkeypatch.setattr(resource, "getrlimit", limited)
    if refused is None:
        check_env_resources(kind, n_envs, monitor=monitor, cores=16)
    else:
        with pytest.raises(ConfigError, match=re.escape(refused)):
            check_env_resources(kind, n_envs, monitor=monitor, cores=16)


def test_auto_takes_envpool_only_once_it_has_made_the_env(monkeypatch):
    pytest.importorskip("envpool")
    from sb3_gpu.envs.choice import vec_env_choice
    from sb3_gpu.envs.envpool_vec import EnvPoolVecEnv, envpool_failure

    def missing_dependency(self, n_envs, seed):
        raise ModuleNotFoundError("No module named 'dm_env'")  # installed, but its import fails

    monkeypatch.setattr(EnvPoolVecEnv, "_make_pool", missing_dependency)
    envpool_failure.cache_clear()
    try:
        cause = r"EnvPool cannot make ALE/Pong-v5 here \(ModuleNotFoundError: No module named 'dm_env'\)"
        with pytest.warns(VecEnvFallbackWarning, match=cause):
            choice = vec_env_choice("auto", resolve_env("ALE/Pong-v5"), 8, cores=2, step_seconds=1e-3)
    finally:
        envpool_failure.cache_clear()
    assert choice.kind in ("dummy", "batched") and "EnvPool could not make the env" in choice.reason


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["subproc", "batched"])
def test_a_script_that_never_closes_its_env_still_exits(tmp_path, kind):
    """Workers let SIGTERM pass, and multiprocessing's exit terminates and joins its children: without a kill first,
    a script ending after make_model(...).learn(...) (the README's three lines) waited for ever."""
    import subprocess
    import sys

    script = tmp_path / "never_closed.py"
    script.write_text(
        "import atexit\n"
        "from sb3_gpu import make_vec_env\n"
        "envs = []\n"
        "atexit.register(lambda: [e.close() for e in envs])  # a cleanup of the script's own, registered before\n"
        "if __name__ == '__main__':\n"
        f"    venv = make_vec_env('CartPole-v1', 2, vec_env={kind!r})\n"
        "    venv.reset()\n"
        "    envs.append(venv)\n"
        "    print('END', type(venv).__name__, flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "END" in out.stdout, out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr  # the cleanup closed an env whose workers were killed


def test_an_atari_id_named_with_its_module_is_still_atari():
    # Curves count 4 frames per step for Atari: the module:EnvId form kept whole must not hide the game.
    from sb3_gpu.envs.spec import looks_atari

    assert looks_atari("ale_py:ALE/Pong-v5") and looks_atari("ALE/Pong-v5") and not looks_atari("my_pkg:CartPole-v1")


class _OneAtATime(gym.Env):
    """Holds something only one instance may (a simulator's port, say) while it is open."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
    action_space = gym.spaces.Discrete(2)
    open_now = 0

    def __init__(self):
        if _OneAtATime.open_now:
            raise OSError(98, "Address already in use")
        _OneAtATime.open_now += 1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}

    def close(self):
        _OneAtATime.open_now -= 1


def test_the_fallbacks_check_of_one_env_is_closed_before_the_fallbacks_own_envs_are_built():
    lock = threading.Lock()

    def factory() -> gym.Env:
        with lock:  # unpicklable: workers cannot start
            return _OneAtATime()

    with pytest.warns(VecEnvFallbackWarning, match="cannot be pickled"):
        venv = make_vec_env(factory, 1, vec_env="subproc")
    assert isinstance(venv, DummyVecEnv) and _OneAtATime.open_now == 1
    venv.close()


@pytest.mark.parametrize("leaves_first", ["first", "second"])
def test_threads_starting_workers_at_once_each_keep_a_script_that_is_no_file_from_them(monkeypatch, leaves_first):
    # A thread that looked while another had hidden "<stdin>" from its workers found nothing to hide, and started its
    # own after the other had put the name back: they tried to run "<stdin>" again. Nor may one wait for another.
    from sb3_gpu.envs.batched import main_kept_from_workers

    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", "<stdin>", raising=False)
    inside = {name: threading.Event() for name in ("first", "second")}
    left = {name: threading.Event() for name in ("first", "second")}
    together, hidden = {}, {}

    def run(name, other):
        if name == "second":
            inside["first"].wait(10)
        with main_kept_from_workers():
            inside[name].set()
            together[name] = inside[other].wait(10)  # both inside at once: neither waits for the other to leave
            if name != leaves_first:
                left[other].wait(10)  # its workers start after the other thread has left
            hidden[name] = not hasattr(main, "__file__")
        left[name].set()

    threads = [threading.Thread(target=run, args=names) for names in (("first", "second"), ("second", "first"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert together == {"first": True, "second": True} and hidden == {"first": True, "second": True}
    assert main.__file__ == "<stdin>"


def _hide_main_and_leave() -> None:
    from sb3_gpu.envs.batched import main_kept_from_workers

    with main_kept_from_workers():
        pass


def test_a_child_forked_while_the_main_hiding_lock_was_held_does_not_wait_for_it():
    # The thread that held it is not in the child: the lock would stay held there for good.
    from sb3_gpu.envs import batched

    with batched._HIDDEN_LOCK:
        child = mp.get_context("fork").Process(target=_hide_main_and_leave)
        child.start()
    child.join(30)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
