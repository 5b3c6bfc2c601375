"""Measured auto choices (planning.probe): fake timings drive every branch of the choice on machines we do not have;
real probes run on this one, through a cache that survives what it should and nothing else."""

from __future__ import annotations

import dataclasses
import errno
import json
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from sb3_contrib.qrdqn.policies import QRDQNPolicy
from stable_baselines3 import TD3
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy
from stable_baselines3.dqn.policies import DQNPolicy

from sb3_gpu.common.errors import ConfigError, cause_of, gist
from sb3_gpu.extensions.continuous import NormedCritics, SyncFreeTD3, normed_critics_policy, sde_sample
from sb3_gpu.extensions.quantile import quantile_huber, quantile_huber_mean
from sb3_gpu.planning import plan as plan_module
from sb3_gpu.planning import probe as probe_module
from sb3_gpu.planning.build import model_class
from sb3_gpu.planning.plan import _policy_space, make_plan
from sb3_gpu.planning.probe import (
    CompileTiming,
    Option,
    ProbeCache,
    ProbeCacheWarning,
    Prober,
    Timing,
    Workload,
    measure_compile,
    measure_option,
)
from sb3_gpu.train import main as train_main


@pytest.fixture(autouse=True)
def steady_env(monkeypatch):
    """The env steps at a fixed 10 us here: the reasons these tests check quote figures that a live env-step timing
    would move from run to run (it did in CI: 1,632,249 env steps to pay back instead of 1,600,000)."""
    monkeypatch.setattr(plan_module, "measure_step_seconds", lambda env: 1e-5)


class FakeTimes:
    """Timings per candidate label prefix (``cuda:0 fp32``, ``cpu bf16 1``, ...); records what it was asked."""

    def __init__(self, by_label: dict[str, tuple[float, float]] | None = None):
        self.by_label = by_label or {}
        self.asked: list[str] = []

    def __call__(self, option: Option, seconds: float) -> Timing:
        label = option.candidate.label
        self.asked.append(label)
        for prefix, (train_ms, infer_ms) in self.by_label.items():
            if label.startswith(prefix):
                return Timing(train_ms / 1e3, infer_ms / 1e3)
        return Timing(1.0, 1.0)  # anything not named is slow


class FakeCompile:
    """Compile timings (eager ms, compiled ms, compile s) for every option; records the labels it was asked for."""

    def __init__(
        self,
        eager_ms: float = 2.0,
        compiled_ms: float = 0.5,
        compile_s: float = 5.0,
        error: str = "",
        act_ms: tuple[float, float] = (0.02, 0.02),  # collection's forward pass, eager and compiled: no faster
        act_compile_s: float = 0.0,
        act_failed: bool = False,
    ):
        act = (act_ms[0] / 1e3, act_ms[1] / 1e3, act_compile_s, act_failed)
        self.figures = (eager_ms / 1e3, compiled_ms / 1e3, compile_s, *act)
        self.error = error
        self.asked: list[tuple[str, str]] = []

    def __call__(self, option: Option, mode: str) -> CompileTiming:
        self.asked.append((option.candidate.label, mode))
        if self.error:
            raise RuntimeError(self.error)
        return CompileTiming(*self.figures)


def fake_prober(times: FakeTimes, compile_times: FakeCompile | None = None, **kwargs) -> Prober:
    compile_times = compile_times or FakeCompile()
    return Prober(measure=times, cache=None, usable=lambda device: True, measure_compile=compile_times, **kwargs)


def test_a_gpu_slower_than_the_cpu_loses_the_rules_choice(gpu_machine):
    # The rules give an off-policy MLP the GPU; here the GPU's train step is twice the CPU's.
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.8), "cpu fp32": (1.0, 0.2)})
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(times), overrides={"per": False})
    assert plan.device.device == "cpu" and plan.preset.profile == "cpu"
    assert plan.device.reason.startswith("probe: ") and "vs cuda:0 fp32" in plan.device.reason
    assert times.asked[0] == "cuda:0 fp32"  # the rules' choice is timed first
    assert plan.probe is not None and plan.probe.options[plan.probe.chosen].candidate.device == "cpu"
    config = plan.to_config()["resolved"]
    assert config["probe"][0].startswith(f"{len(plan.probe.options)} of {len(plan.probe.options)} candidates timed")
    assert any(line.startswith("cuda:0 fp32: ") and "ms/env step (train 2 ms x " in line for line in config["probe"])


@pytest.mark.parametrize("algo, env", [("ppo", "CartPole-v1"), ("qrdqn", "CartPole-v1"), ("sac", "Pendulum-v1")])
def test_each_device_is_timed_with_the_optimizer_the_run_would_get_there(gpu_machine, algo, env):
    # The GPU candidate was timed with an unfused (foreach) Adam where its run steps a fused one.
    workloads = {}

    def record(option: Option, seconds: float) -> Timing:
        workloads[option.candidate.device] = option.workload
        return Timing(1e-3, 1e-4)

    overrides = {"per": False} if algo == "qrdqn" else {}
    make_plan(algo, env, hardware=gpu_machine, prober=fake_prober(record), overrides=overrides)
    optimizers = {device: w.policy_kwargs.get("optimizer_kwargs", {}) for device, w in workloads.items()}
    assert optimizers["cuda:0"].get("fused") is True and not optimizers["cpu"].get("fused")
    if algo == "qrdqn":  # sb3-contrib's eps, as the run's
        assert optimizers["cpu"]["eps"] == optimizers["cuda:0"]["eps"] < 1e-3


def test_amp_slower_than_fp32_is_not_taken_and_faster_amp_is(gpu_machine):
    # The rules give a CNN bf16 on an A100; a bf16 step slower than fp32 is refused, a much faster one taken.
    slower = FakeTimes({"cuda:0 fp32": (2.8, 0.7), "cuda:0 bf16": (3.7, 0.8), "cuda:0 fp16": (3.9, 0.8)})
    plan = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine, vec_env="dummy", prober=fake_prober(slower))
    assert plan.device.device == "cuda:0" and plan.speed.amp == "off"
    assert plan.speed.amp_reason.startswith("probe: ") and "vs cuda:0 bf16" in plan.speed.amp_reason
    faster = FakeTimes({"cuda:0 fp32": (5.1, 0.7), "cuda:0 bf16": (4.1, 0.7), "cuda:0 fp16": (4.3, 0.7)})
    plan = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine, vec_env="dummy", prober=fake_prober(faster))
    assert plan.speed.amp == "bf16"


def test_in_doubt_the_rules_device_and_precision_stay_with_the_fewest_threads():
    machine_ = __import__("tests.conftest", fromlist=["machine"]).machine(cores=4, cpu_bf16=True)
    # Within 10% of each other: no reason to leave the rules' fp32, and one thread is as good as four.
    times = FakeTimes({"cpu fp32 4": (1.00, 0.1), "cpu fp32 1": (1.05, 0.1), "cpu bf16": (0.97, 0.1)})
    wide = {"per": False, "net_arch": [256, 256]}  # wide enough that the rules would take several threads
    plan = make_plan("dqn", "CartPole-v1", hardware=machine_, prober=fake_prober(times), overrides=wide)
    assert (plan.speed.amp, plan.speed.threads) == ("off", 1)
    assert plan.speed.threads_reason.startswith("probe: ") and "vs cpu fp32 4 threads" in plan.speed.threads_reason
    # Clearly faster with four threads: four.
    times = FakeTimes({"cpu fp32 4": (0.5, 0.1), "cpu fp32 1": (1.05, 0.1), "cpu bf16": (0.97, 0.1)})
    plan = make_plan("dqn", "CartPole-v1", hardware=machine_, prober=fake_prober(times), overrides=wide)
    assert (plan.speed.amp, plan.speed.threads) == ("off", 4)


def test_a_narrow_mlps_one_thread_is_timed_against_the_free_cores_it_passes_over():
    machine_ = __import__("tests.conftest", fromlist=["machine"]).machine(cores=4)
    narrow = {"per": False, "net_arch": [64, 64]}  # the rules take one thread for it
    times = FakeTimes({"cpu fp32 1": (1.00, 0.1), "cpu fp32 4": (0.6, 0.1)})
    plan = make_plan("dqn", "CartPole-v1", hardware=machine_, prober=fake_prober(times), overrides=narrow)
    assert {"cpu fp32 1 thread", "cpu fp32 4 threads"} <= set(times.asked)
    assert plan.speed.threads == 4 and "vs cpu fp32 1 thread" in plan.speed.threads_reason
    times = FakeTimes({"cpu fp32 1": (1.00, 0.1), "cpu fp32 4": (0.98, 0.1)})  # no clear gain: one thread stays
    plan = make_plan("dqn", "CartPole-v1", hardware=machine_, prober=fake_prober(times), overrides=narrow)
    assert plan.speed.threads == 1 and "vs cpu fp32 4 threads" in plan.speed.threads_reason


def test_a_spent_budget_times_only_the_rules_choice_which_then_stands(gpu_machine):
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.8), "cpu fp32": (0.1, 0.1)})
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(times, budget_s=0.0))
    assert times.asked == ["cuda:0 fp32"] and plan.device.device == "cuda:0"
    assert plan.probe is not None and "not probed (budget spent)" in "\n".join(plan.probe.lines())


def test_choices_that_are_not_auto_are_not_probed(gpu_machine):
    times = FakeTimes()
    overrides = {"amp": "off", "threads": 2, "per": False, "compile": False}  # compile=auto times the eager step
    plan = make_plan("dqn", "CartPole-v1", "cuda:0", hardware=gpu_machine, prober=fake_prober(times), overrides=overrides)
    assert times.asked == [] and plan.probe is None and plan.speed.amp_reason == "asked for"
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(times), overrides={"probe": False})
    assert times.asked == [] and plan.probe is None and plan.device.reason.startswith("off-policy MLP policy")


def test_the_cache_serves_the_same_machine_and_torch_and_is_stale_after_an_upgrade(tmp_path, monkeypatch, gpu_machine):
    cache_file = tmp_path / "probes.json"
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.8), "cpu fp32": (1.0, 0.2)})

    def plan():
        prober = Prober(measure=times, cache=ProbeCache(cache_file), usable=lambda device: True, context="fake A100")
        return make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober, overrides={"per": False})

    first = plan()
    n = len(times.asked)
    assert n == len(first.probe.options) and json.loads(cache_file.read_text())["version"] == probe_module.CACHE_VERSION
    second = plan()
    assert len(times.asked) == n and second.device.device == first.device.device  # every figure from the cache
    assert second.probe.summary().endswith(f"({n} from the cache)")
    monkeypatch.setattr(th, "__version__", "99.0.0")  # a torch upgrade: the old figures no longer apply
    plan()
    assert len(times.asked) == 2 * n
    monkeypatch.setattr(probe_module, "_library_versions", lambda: "SB3 9.0.0, sb3_gpu 9.0.0")  # nor after SB3's
    plan()
    assert len(times.asked) == 3 * n


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": probe_module.CACHE_VERSION, "entries": {"k": {"train_s": "fast"}}}),
        json.dumps([1, 2]),
    ],
    ids=["not-json", "bad-entry", "not-a-mapping"],
)
def test_a_corrupt_cache_is_ignored_with_a_warning_and_replaced(tmp_path, content, gpu_machine):
    cache_file = tmp_path / "probes.json"
    cache_file.write_text(content)
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.8), "cpu fp32": (1.0, 0.2)})
    prober = Prober(measure=times, cache=ProbeCache(cache_file), usable=lambda device: True)
    with pytest.warns(ProbeCacheWarning, match=r"ignoring the probe cache .*probes.json \(.*\); probing again"):
        plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober, overrides={"per": False})
    assert plan.device.device == "cpu" and len(times.asked) == len(plan.probe.options)
    assert len(json.loads(cache_file.read_text())["entries"]) == len(plan.probe.options)


def test_this_machine_is_really_timed_once_and_then_served_from_the_cache(tmp_path):
    workload = Workload("ppo", ActorCriticPolicy, spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(2), {}, 32, 4, 0.3)
    options = [Option(probe_module.Candidate("cpu", "off", n), workload) for n in (1, 2)]
    # A budget no load can spend: on busy cores the default's 3 s could leave the second candidate untimed.
    first = Prober(cache=ProbeCache(tmp_path / "probes.json"), budget_s=60.0).probe(options, rule=0, env_s=1e-5)
    assert all(t is not None and t.train_s > 0 and t.infer_s > 0 and not t.cached for t in first.timings)
    again = Prober(cache=ProbeCache(tmp_path / "probes.json"), budget_s=60.0).probe(options, rule=0, env_s=1e-5)
    assert again.timings == tuple(Timing(t.train_s, t.infer_s, cached=True) for t in first.timings)
    assert again.summary().endswith("(2 from the cache)") and again.chosen == first.chosen


def test_a_plan_on_this_machine_records_what_it_timed(tmp_path, monkeypatch):
    monkeypatch.setenv("SB3_GPU_CACHE_DIR", str(tmp_path))
    plan = make_plan("dqn", "CartPole-v1", "cpu", overrides={"per": False, "threads": "auto", "amp": "auto"})
    if plan.probe is None:  # one candidate only (one core, no bf16): nothing to compare, and the rules decided
        assert "probe" not in plan.to_config()["resolved"]
        return
    assert plan.to_config()["resolved"]["probe"] == plan.probe.lines()
    assert (tmp_path / "probes.json").is_file()


@pytest.mark.parametrize(
    ("algo", "policy_class", "space", "policy_kwargs"),
    [
        ("ppo", ActorCriticCnnPolicy, spaces.Box(0, 255, (4, 84, 84), np.uint8), {}),
        ("ppo", ActorCriticPolicy, spaces.Box(-1, 1, (4,), np.float32), {"net_arch": [8]}),
        ("dqn", DQNPolicy, spaces.Box(-1, 1, (4,), np.float32), {"net_arch": [8]}),
    ],
    ids=["ppo-cnn", "ppo-mlp", "dqn-mlp"],
)
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_measuring_runs_the_real_train_step_and_inference(algo, policy_class, space, policy_kwargs, amp):
    workload = Workload(algo, policy_class, space, spaces.Discrete(3), policy_kwargs, 8, 2, 0.5)
    threads = th.get_num_threads()
    timing = measure_option(Option(probe_module.Candidate("cpu", amp, 1), workload), 0.01)
    assert timing.train_s > 0 and timing.infer_s > 0 and th.get_num_threads() == threads


@pytest.mark.parametrize(
    "actions",
    [spaces.MultiBinary(3), spaces.Box(-1, 1, (2, 2), np.float32), spaces.MultiDiscrete([2, 3])],
    ids=["multibinary", "box-2x2", "multidiscrete"],
)
def test_ppo_is_timed_on_actions_of_any_space_its_rollout_buffer_keeps(actions):
    # As SB3's buffer keeps them (float32, one row of action_dim each): MultiBinary's int8 and a 2x2 Box's shape failed.
    workload = Workload("ppo", ActorCriticPolicy, spaces.Box(-1, 1, (4,), np.float32), actions, {"net_arch": [8]}, 8, 2, 0.5)
    timing = measure_option(Option(probe_module.Candidate("cpu", "off", 1), workload), 0.01)
    assert timing.train_s > 0 and timing.infer_s > 0


def test_timing_leaves_torchs_generator_where_it_was():
    # A seeded user's draws after a plan depended on whether its probe timed (building and sampling a policy) or
    # found the figures in its cache.
    workload = Workload("ppo", ActorCriticPolicy, spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3), {}, 8, 2, 0.5)
    th.manual_seed(0)
    expected = th.rand(3)
    th.manual_seed(0)
    measure_option(Option(probe_module.Candidate("cpu", "off", 1), workload), 0.01)
    assert th.equal(th.rand(3), expected)


def test_ppo_inference_is_timed_as_its_rollout_runs_it_values_and_log_probabilities_too(monkeypatch):
    # SB3's collect_rollouts calls the policy itself (actor, critic, log-probabilities), not predict's actor alone.
    rollout_shapes = []
    forward = ActorCriticPolicy.forward

    def counted(self, obs, deterministic=False):
        actions, values, log_prob = forward(self, obs, deterministic)
        if not th.is_grad_enabled():  # inference, not the train step's
            rollout_shapes.append((tuple(values.shape), tuple(log_prob.shape)))
        return actions, values, log_prob

    monkeypatch.setattr(ActorCriticPolicy, "forward", counted)
    monkeypatch.setattr(ActorCriticPolicy, "_predict", lambda *a, **k: pytest.fail("predict's actor alone was timed"))
    workload = Workload("ppo", ActorCriticPolicy, spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3), {}, 8, 2, 0.5)
    assert measure_option(Option(probe_module.Candidate("cpu", "off", 1), workload), 0.01).infer_s > 0
    assert rollout_shapes and set(rollout_shapes) == {((2, 1), (2,))}  # n_envs = 2


def test_figures_are_keyed_by_the_policy_classs_module_not_its_name_alone():
    box, actions = spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3)
    mine = type("DQNPolicy", (DQNPolicy,), {"__module__": "my_project.policies"})  # an edited or foreign class
    keys = {Workload("dqn", cls, box, actions, {}, 8, 2, 0.5).key for cls in (DQNPolicy, mine)}
    assert len(keys) == 2 and any("my_project.policies.DQNPolicy" in k for k in keys)


@pytest.mark.parametrize(("algo", "drop", "target"), [("qrdqn", 0, (8, 7)), ("tqc", 2, (8, 1, 10)), ("tqc", 0, (8, 1, 14))])
def test_quantile_algorithms_are_timed_with_their_quantile_loss(algo, drop, target, monkeypatch):
    from sb3_contrib import QRDQN, TQC

    # Every current quantile against every target one: most of their step, which a squared error would leave out.
    shapes = []

    def counted(loss):
        def call(current, goal):
            shapes.append((tuple(current.shape), tuple(goal.shape)))
            return loss(current, goal)

        return call

    monkeypatch.setattr(probe_module, "quantile_huber", counted(quantile_huber))
    monkeypatch.setattr(probe_module, "quantile_huber_mean", counted(quantile_huber_mean))
    box = spaces.Box(-1, 1, (3,), np.float32)
    if algo == "qrdqn":
        policy_class, actions, kwargs = QRDQN.policy_aliases["MlpPolicy"], spaces.Discrete(3), {"n_quantiles": 7}
    else:
        policy_class, actions = TQC.policy_aliases["MlpPolicy"], spaces.Box(-1, 1, (2,), np.float32)
        kwargs = {"n_quantiles": 7, "n_critics": 2}
    workload = Workload(algo, policy_class, box, actions, {"net_arch": [8], **kwargs}, 8, 2, 1.0)
    workload = dataclasses.replace(workload, top_quantiles_to_drop_per_net=drop, max_grad_norm=None)
    assert measure_option(Option(probe_module.Candidate("cpu", "off", 1), workload), 0.01).train_s > 0
    # QR-DQN: the batch's quantiles against the greedy action's; TQC: both critics' against the 14 less those dropped.
    current = (8, 7) if algo == "qrdqn" else (8, 2, 7)
    assert shapes and set(shapes) == {(current, target)}


@pytest.mark.parametrize(
    ("algo", "overrides", "max_grad_norm"), [("dqn", {}, 10.0), ("qrdqn", {}, None), ("qrdqn", {"max_grad_norm": 5.0}, 5.0)]
)
def test_the_probe_clips_gradients_as_the_run_will(algo, overrides, max_grad_norm, gpu_machine):
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.3), "cpu fp32": (1.0, 0.2)})
    plan = make_plan(
        algo, "CartPole-v1", hardware=gpu_machine, prober=fake_prober(times), overrides={"per": False, **overrides}
    )
    assert plan.probe is not None and {o.workload.max_grad_norm for o in plan.probe.options} == {max_grad_norm}
    drops = make_plan(
        "tqc", "Pendulum-v1", hardware=gpu_machine, prober=fake_prober(times), overrides={"top_quantiles_to_drop_per_net": 3}
    )
    assert drops.probe is not None and {o.workload.top_quantiles_to_drop_per_net for o in drops.probe.options} == {3}
    # And the timed step does clip: a tiny limit leaves gradients of that norm; none leaves them as they came.
    workload = plan.probe.options[0].workload
    for limit in (1e-3, None):
        w = dataclasses.replace(workload, max_grad_norm=limit)
        policy = w.policy(th.device("cpu"))
        obs, _ = policy.obs_to_tensor(probe_module._batch(w.observation_space, w.batch_size))
        probe_module._train_step(policy, w, obs, th.device("cpu"), "fp32")()
        norm = th.linalg.vector_norm(
            th.stack([p.grad.norm() for p in policy.optimizer.param_groups[0]["params"] if p.grad is not None])
        )
        assert (norm <= 1.001e-3) == (limit is not None), (limit, norm)


def test_the_policy_sees_stacked_channel_first_frames():
    frames = _policy_space(spaces.Box(0, 255, (84, 84, 1), np.uint8), 4)
    assert frames.shape == (4, 84, 84) and frames.dtype == np.uint8
    assert _policy_space(spaces.Box(-1, 1, (4,), np.float32), 3).shape == (12,)
    # A Dict's images too, as SB3's VecTransposeImage turns them (NatureCNN took the height for the channels)
    members = _policy_space(spaces.Dict({"img": spaces.Box(0, 255, (40, 40, 3), np.uint8), "v": spaces.Discrete(2)}), 1)
    assert members["img"].shape == (3, 40, 40) and members["v"] == spaces.Discrete(2)


def test_no_probe_on_the_command_line_keeps_the_rules(call_main):
    result = call_main(train_main, "dqn", "--env", "CartPole-v1", "--device", "cpu", "--no-probe", "--plan")
    assert result.returncode == 0, result.stderr
    assert "candidates timed" not in result.stdout and "probe: " not in result.stdout


def test_a_candidate_that_fails_to_run_is_not_chosen_and_says_why(gpu_machine):
    def measure(option, seconds):
        if option.candidate.amp == "fp16":
            raise RuntimeError("an op without an fp16 kernel\nmore detail")
        return Timing(0.001 if option.candidate.device == "cuda:0" else 0.01, 0.001)

    plan = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine, vec_env="dummy", prober=Prober(measure, None))
    assert plan.speed.amp != "fp16"
    assert "cuda:0 fp16: failed (RuntimeError: an op without an fp16 kernel)" in plan.probe.lines()
    failing_rule = Prober(lambda option, seconds: (_ for _ in ()).throw(MemoryError("out of memory")), None)
    plan = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine, vec_env="dummy", prober=failing_rule)
    assert plan.device.device == "cuda:0" and plan.speed.amp == "bf16"  # nothing timed: the rules decide

    def only_the_rule_fails(option, seconds):
        if (option.candidate.device, option.candidate.amp) == ("cuda:0", "bf16"):
            raise RuntimeError("an op without a bf16 kernel")
        return Timing(0.001 if option.candidate.device == "cuda:0" else 0.01, 0.001)

    plan = make_plan("ppo", "ALE/Pong-v5", hardware=gpu_machine, vec_env="dummy", prober=Prober(only_the_rule_fails, None))
    assert plan.device.device == "cuda:0" and plan.speed.amp != "bf16"  # the fastest that ran, not the one that failed
    assert "cuda:0 bf16: failed (RuntimeError: an op without a bf16 kernel)" in plan.probe.lines()


def test_a_switch_goes_to_the_clear_winner_not_to_a_near_tie_of_the_rules_choice():
    from sb3_gpu.planning.probe import Candidate, ProbeResult, _choose

    w = Workload("dqn", DQNPolicy, spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(2), {}, 64, 1, 1.0)
    options = tuple(Option(Candidate(d, "off", t), w) for d, t in (("cpu", 4), ("cuda:0", 4), ("cpu", 1)))
    timings = tuple(Timing(ms / 1e3, 0.0) for ms in (100, 89, 99))
    assert _choose(ProbeResult(options, timings, rule=0, chosen=0, env_s=0.0, seconds=0.0)) == 1


def test_overlapped_training_is_predicted_beside_collection_not_after_it():
    w = Workload("dqn", DQNPolicy, spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(2), {}, 64, 4, 0.5)
    timing = Timing(train_s=0.004, infer_s=0.004)
    assert timing.per_env_step(w, env_s=0.001) == pytest.approx(0.001 + 0.001 + 0.002)
    assert timing.per_env_step(dataclasses.replace(w, overlapped=True), env_s=0.001) == pytest.approx(0.002)


# --------------------------------------------------------------------------- compile=auto
GPU_TIMES = {"cuda:0 fp32": (1.0, 0.2), "cpu fp32": (9.0, 0.5)}  # the GPU wins the device probe


def test_compile_auto_on_a_gpu_takes_the_compiled_step_where_it_is_faster_and_the_run_earns_it_back(gpu_machine):
    compile_times = FakeCompile(eager_ms=2.0, compiled_ms=0.5, compile_s=5.0)  # pays after 3,333 gradient steps
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(FakeTimes(GPU_TIMES), compile_times))
    assert plan.device.device == "cuda:0" and plan.speed.compile == "reduce-overhead"
    assert compile_times.asked == [("cuda:0 fp32", "reduce-overhead")]
    grads = plan.probe.options[plan.probe.chosen].workload.grads_per_env_step  # 1.5 ms saved per gradient step
    assert plan.speed.compile_reason == (
        "probe: gradient step 0.5 ms compiled vs 2 ms eager, forward pass 0.02 vs 0.02 ms (stays eager), 5.0 s to compile; "
        f"pays after {5.0 / (grads * 1.5e-3):,.0f} of {plan.preset.n_timesteps:,.0f} env steps"
    )
    assert plan.to_config()["hyperparameters"]["compile"] == "auto"  # a resumed or copied run decides again


def test_compile_auto_stays_eager_where_compiling_is_not_faster_or_would_not_pay_in_this_run(gpu_machine):
    slower = FakeCompile(eager_ms=1.0, compiled_ms=0.95)
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(FakeTimes(GPU_TIMES), slower))
    assert plan.speed.compile == "false" and plan.speed.compile_reason.endswith("; not faster enough to take")
    slow_to_compile = FakeCompile(eager_ms=2.0, compiled_ms=0.5, compile_s=300.0)  # pays after 200,000 gradient steps
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(FakeTimes(GPU_TIMES), slow_to_compile))
    assert plan.speed.compile == "false"
    grads = plan.probe.options[plan.probe.chosen].workload.grads_per_env_step
    assert grads * plan.preset.n_timesteps == 12_500  # the run's gradient steps
    pays = f"{200_000 / grads:,.0f} env steps, the run has {plan.preset.n_timesteps:,}"
    assert f"; would pay after {pays}" in plan.speed.compile_reason
    # A run whose eager training (2,500 steps of the probe's 1 ms) takes less than any compiling: not even timed.
    untimed = FakeCompile()
    short = make_plan(
        "dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(FakeTimes(GPU_TIMES), untimed), n_timesteps=20_000
    )
    assert short.speed.compile == "false" and untimed.asked == []
    assert short.speed.compile_reason == (
        "auto: not compiled: the run's gradient steps take about 2.5 s eager, too little to earn a compile back "
        "(timed from 5 s)"
    )
    failing = FakeCompile(error="inductor: no kernel for this op\ndetails")
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=fake_prober(FakeTimes(GPU_TIMES), failing))
    assert plan.speed.compile == "false"
    assert plan.speed.compile_reason == (
        "probe: the compiled step failed here (RuntimeError: inductor: no kernel for this op), so not compiled"
    )


HOST_TREES = (
    "gradient accumulation with prioritized replay whose trees are searched on the host: each micro-batch's "
    "priorities are updated before the next one is sampled, between graphs"
)


@pytest.mark.parametrize(
    ("algo", "device", "overrides", "why"),
    [
        (
            "ppo",
            "cuda:0",
            {"grad_accum_steps": 2, "batch_size": 32},
            "gradient accumulation steps once per several backward passes",
        ),
        ("dqn", "cpu", {"grad_accum_steps": 2, "per": True}, HOST_TREES),
        ("dqn", "cuda:0", {"grad_accum_steps": 2, "per": True, "device_buffers": False}, HOST_TREES),
    ],
    ids=["ppo-accumulation", "dqn-per-cpu", "dqn-per-host-buffers"],
)
def test_compile_auto_does_not_time_a_step_that_cannot_compile_whole(gpu_machine, algo, device, overrides, why):
    compile_times = FakeCompile()
    prober = fake_prober(FakeTimes({"cuda:0": (1.0, 0.2), "cpu": (9.0, 0.5)}), compile_times)
    plan = make_plan(algo, "CartPole-v1", device, hardware=gpu_machine, prober=prober, overrides=overrides)
    assert compile_times.asked == []
    assert plan.speed.compile == "false" and plan.speed.compile_reason == f"auto: not compiled: {why}"


@pytest.mark.parametrize("overrides", [{"grad_accum_steps": 2, "per": True}, {"grad_accum_steps": 2, "per": False}])
def test_compile_auto_times_the_dqn_familys_accumulating_step_where_it_compiles_whole(gpu_machine, overrides):
    # On CUDA's device buffers the graph samples and updates the trees itself; a uniform buffer needs neither.
    compile_times = FakeCompile()
    prober = fake_prober(FakeTimes({"cuda:0": (1.0, 0.2), "cpu": (9.0, 0.5)}), compile_times)
    plan = make_plan("dqn", "CartPole-v1", "cuda:0", hardware=gpu_machine, prober=prober, overrides=overrides)
    assert compile_times.asked != [] and plan.speed.compile_reason.startswith("probe: gradient step")


@pytest.mark.heavy  # MuJoCo's envs
def test_the_probe_times_no_mps_candidate_for_float64_observations(gpu_machine):
    mac = dataclasses.replace(gpu_machine, gpus=(), mps=True)
    times = FakeTimes({"mps": (0.1, 0.1), "cpu": (9.0, 0.5)})
    plan = make_plan("sac", "HalfCheetah-v5", hardware=mac, prober=fake_prober(times))
    assert plan.device.device == "cpu" and times.asked and not any(label.startswith("mps") for label in times.asked)
    times = FakeTimes({"mps": (0.1, 0.1), "cpu": (9.0, 0.5)})
    plan = make_plan("ppo", "HalfCheetah-v5", hardware=mac, prober=fake_prober(times))  # the rules: the CPU, for PPO
    assert plan.device.device == "cpu" and not any(label.startswith("mps") for label in times.asked)


def test_compile_auto_is_off_where_nothing_is_probed_and_on_devices_it_does_not_time(gpu_machine):
    compile_times = FakeCompile()
    plan = make_plan("dqn", "CartPole-v1", "cuda:0", hardware=gpu_machine)  # an injected machine: nothing timed
    assert plan.speed.compile == "false" and plan.speed.compile_reason == "auto: not probed (probe off), so not compiled"
    mac = dataclasses.replace(gpu_machine, gpus=(), mps=True)
    plan = make_plan("dqn", "CartPole-v1", "mps", hardware=mac, prober=fake_prober(FakeTimes(), compile_times))
    assert plan.speed.compile == "false" and plan.speed.compile_reason.startswith("auto compiles on CUDA and the CPU only")
    assert compile_times.asked == []
    plan = make_plan("dqn", "CartPole-v1", "cuda:0", hardware=gpu_machine, overrides={"compile": "default"})
    assert plan.speed.compile == "default" and plan.speed.compile_reason.startswith("asked for")


# TD3 on Pendulum, CPU profile: one gradient step per env step, 20,000 of them; 20 ms eager is 400 s of training.
CPU_TIMES = {"cpu fp32": (20.0, 0.3)}


def test_compile_auto_on_the_cpu_compiles_a_long_run_where_its_env_steps_are_faster(cpu_machine):
    compile_times = FakeCompile(eager_ms=20.0, compiled_ms=12.0, compile_s=40.0, act_ms=(0.3, 0.4))
    plan = make_plan(
        "td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=fake_prober(FakeTimes(CPU_TIMES), compile_times)
    )
    assert [mode for _, mode in compile_times.asked] == ["default"]  # inductor's kernels: no CUDA graph on a CPU
    assert plan.speed.compile == "default" and plan.preset.n_timesteps == 20_000
    # 8 ms saved per gradient step; the forward pass, slower compiled, stays eager: 40 s earned back after 5,000 env steps
    assert plan.speed.compile_reason == (
        "probe: gradient step 12 ms compiled vs 20 ms eager, forward pass 0.4 vs 0.3 ms (stays eager), 40.0 s to compile; "
        "pays after 5,000 of 20,000 env steps"
    )
    assert not plan.speed.compile_collect and ("compile", "default, step only", plan.speed.compile_reason) in plan.speed.rows()
    assert model_class(plan) is SyncFreeTD3  # the class that compiles its step


@pytest.mark.parametrize(
    ("step_ms", "act_ms", "act_s", "compiled", "collect", "reason"),
    [
        # 5 ms saved per gradient step; the forward pass, 3.7 ms slower compiled, stays eager: 15.3 ms against 20.3.
        (15.0, (0.3, 4.0), 1.0, "default", False, "forward pass 4 vs 0.3 ms (stays eager), 1.0 s to compile; pays after 200"),
        # 0.1 ms more saved per env step by the pass: its 1 s of compiling pays after 10,000 of the 100,000 env steps.
        (15.0, (0.3, 0.2), 1.0, "default", True, "forward pass 0.2 vs 0.3 ms, 2.0 s to compile; pays after 392 of 100,000"),
        # ... but not 20 s of it (200,000 env steps): the step compiles alone.
        (
            15.0,
            (0.3, 0.2),
            20.0,
            "default",
            False,
            "forward pass 0.2 vs 0.3 ms (stays eager), 1.0 s to compile; pays after 200",
        ),
        # 2% faster is within the probe's noise: the step compiles alone.
        (15.0, (0.3, 0.294), 0.0, "default", False, "forward pass 0.294 vs 0.3 ms (stays eager)"),
        # 1 ms saved of 20.3 (the forward pass eager): not clearly faster, whether the pass compiles or not.
        (19.0, (0.3, 4.0), 1.0, "false", False, "forward pass 4 vs 0.3 ms (stays eager), 1.0 s to compile; not faster"),
    ],
    ids=["forward-slower-compiled", "forward-faster-compiled", "forward-does-not-pay", "forward-in-noise", "step-not-faster"],
)
def test_compile_auto_compiles_collections_forward_pass_only_where_it_is_faster_so(
    cpu_machine, step_ms, act_ms, act_s, compiled, collect, reason
):
    compile_times = FakeCompile(eager_ms=20.0, compiled_ms=step_ms, compile_s=1.0, act_ms=act_ms, act_compile_s=act_s)
    prober = fake_prober(FakeTimes(CPU_TIMES), compile_times)
    plan = make_plan("td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=prober, n_timesteps=100_000)
    assert compile_times.asked and plan.speed.compile == compiled and plan.speed.compile_collect == collect
    assert reason in plan.speed.compile_reason, plan.speed.compile_reason


def test_compile_auto_says_where_the_forward_pass_did_not_compile(cpu_machine):
    failed = FakeCompile(eager_ms=20.0, compiled_ms=15.0, compile_s=1.0, act_ms=(0.3, 0.3), act_failed=True)
    plan = make_plan("td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=fake_prober(FakeTimes(CPU_TIMES), failed))
    assert plan.speed.compile == "default" and not plan.speed.compile_collect
    assert "forward pass 0.3 ms eager (it did not compile), 1.0 s to compile; pays after 200" in plan.speed.compile_reason


def test_compile_auto_on_the_cpu_leaves_a_short_run_eager_without_compiling_to_time_it(cpu_machine):
    compile_times = FakeCompile()
    prober = fake_prober(FakeTimes(CPU_TIMES), compile_times)
    plan = make_plan("td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=prober, n_timesteps=1_400)
    assert compile_times.asked == [] and plan.speed.compile == "false"
    assert plan.speed.compile_reason == (
        "auto: not compiled: the run's gradient steps take about 28.0 s eager, too little to earn a compile back "
        "(timed from 30 s on the CPU)"
    )
    # A little longer, and it is timed: the compile may well pay (SAC Pendulum's step ran twice as fast compiled).
    make_plan("td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=prober, n_timesteps=1_600)
    assert compile_times.asked
    assert model_class(plan) is TD3  # SB3's own class, as before


def test_compile_auto_on_the_cpu_times_the_eager_step_where_the_device_probe_had_nothing_to_compare(cpu_machine):
    times, compile_times = FakeTimes(CPU_TIMES), FakeCompile(eager_ms=20.0, compiled_ms=12.0, compile_s=40.0)
    prober = fake_prober(times, compile_times)
    plan = make_plan("td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=prober, overrides={"threads": 2})
    assert times.asked == ["cpu fp32 2 threads"]  # one candidate: no device probe, the step timed for the gate
    assert plan.speed.compile == "default"
    short = FakeCompile()
    make_plan(
        "td3",
        "Pendulum-v1",
        "cpu",
        hardware=cpu_machine,
        prober=fake_prober(times, short),
        n_timesteps=1_000,
        overrides={"threads": 2},
    )
    assert short.asked == []


def test_compile_auto_on_a_gpu_times_the_eager_step_where_the_device_probe_had_nothing_to_compare(gpu_machine):
    times, compile_times = FakeTimes(GPU_TIMES), FakeCompile()
    one = {"amp": "off"}  # on a device given, one candidate: no device probe
    plan = make_plan(
        "dqn", "CartPole-v1", "cuda:0", hardware=gpu_machine, prober=fake_prober(times, compile_times), overrides=one
    )
    assert times.asked == ["cuda:0 fp32"] and compile_times.asked == [("cuda:0 fp32", "reduce-overhead")]
    assert plan.speed.compile == "reduce-overhead"
    short = FakeCompile()  # 2,500 gradient steps of 1 ms: too little to earn a compile back, so not timed
    plan = make_plan(
        "dqn",
        "CartPole-v1",
        "cuda:0",
        hardware=gpu_machine,
        prober=fake_prober(times, short),
        overrides=one,
        n_timesteps=20_000,
    )
    assert short.asked == [] and plan.speed.compile_reason.startswith("auto: not compiled: the run's gradient steps take")


def test_compile_auto_is_timed_only_once_the_run_is_known_to_be_possible(cpu_machine):
    # A refused run is refused at once, not after a minute of compiling.
    compile_times = FakeCompile(eager_ms=20.0, compiled_ms=12.0, compile_s=40.0)
    prober = fake_prober(FakeTimes(CPU_TIMES), compile_times)
    with pytest.raises(ConfigError, match="buffer_size"):
        make_plan("td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=prober, overrides={"buffer_size": 10**10})
    assert compile_times.asked == []


def test_bench_auto_runs_auto_against_the_compile_choice_it_passed_over_on_the_cpu(cpu_machine):
    from sb3_gpu.benches.auto import _alternatives

    compile_times = FakeCompile(eager_ms=20.0, compiled_ms=12.0, compile_s=40.0, act_ms=(0.3, 0.4))
    plan = make_plan(
        "td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=fake_prober(FakeTimes(CPU_TIMES), compile_times)
    )
    alternatives = _alternatives(plan)
    assert alternatives[0][2]["compile"] == "default" and alternatives[0][0].endswith(" compiled default, step only")
    twins = [(o["compile"], collect) for _, _, o, collect in alternatives if o["threads"] == plan.speed.threads]
    # auto's choice (the step compiled, collection eager) against all eager and all compiled
    assert sorted(twins) == [("default", False), ("default", True), ("false", True)]
    short = make_plan(
        "td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=fake_prober(FakeTimes(CPU_TIMES)), n_timesteps=1_000
    )
    assert {o["compile"] for _, _, o, _ in _alternatives(short)} == {"false"}  # not timed: nothing passed over


def test_compile_figures_are_cached_beside_the_others(tmp_path, gpu_machine):
    cache = ProbeCache(tmp_path / "probes.json")
    compile_times = FakeCompile()

    said: list[str] = []

    def plan():
        prober = Prober(
            FakeTimes(GPU_TIMES),
            ProbeCache(cache.path),
            usable=lambda d: True,
            measure_compile=compile_times,
            announce=said.append,
        )
        # A vec env named, so that no env step is timed: a live figure in the reason would differ between the plans.
        return make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober, vec_env="dummy")

    first, second = plan(), plan()
    assert len(compile_times.asked) == 1 and (tmp_path / "compile-probes.json").is_file()
    assert said == [
        "sb3_gpu: timing the compiled gradient step on cuda:0 fp32 (cached for the next plan; compile=false skips it)"
    ]  # not from the cache
    assert all("failed" not in v for v in json.loads((tmp_path / "compile-probes.json").read_text())["entries"].values())
    assert (first.speed.compile, first.speed.compile_reason) == (second.speed.compile, second.speed.compile_reason)


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("algo", "policy_class", "observation_space"),
    [
        ("dqn", DQNPolicy, spaces.Box(-1, 1, (4,), np.float32)),
        ("ppo", ActorCriticPolicy, spaces.Box(-1, 1, (4,), np.float32)),
        # Gymnasium's Discrete n is a NumPy int, which QR-DQN's reshape and a one-hot observation read: the probe's
        # step must compile as the run's does, not time a failure and leave the run eager.
        ("qrdqn", QRDQNPolicy, spaces.Box(-1, 1, (4,), np.float32)),
        ("dqn", DQNPolicy, spaces.Discrete(5)),
    ],
    ids=["dqn", "ppo", "qrdqn", "dqn-one-hot"],
)
def test_measuring_compile_runs_the_step_compiled_whole_on_this_cpu(algo, policy_class, observation_space):
    workload = Workload(algo, policy_class, observation_space, spaces.Discrete(3), {"net_arch": [16]}, 8, 2, 1)
    timing = measure_compile(Option(probe_module.Candidate("cpu", "off", 1), workload), "default", seconds=0.05)
    assert timing.eager_s > 0 and timing.compiled_s > 0 and timing.compile_s > timing.compiled_s
    assert timing.act_eager_s > 0 and timing.act_compiled_s > 0  # collection's forward pass, timed both ways
    assert timing.act_compile_s > 0 and not timing.act_failed


@pytest.mark.heavy
def test_probing_many_policies_in_one_process_compiles_each_forward_pass():
    # Dynamo's recompile limit (8) counts per code object: tune's trials probe network after network in one process,
    # and forward passes that shared their code would, past the limit, be timed as "did not compile". Limit 1 here.
    box = spaces.Box(-1, 1, (4,), np.float32)
    with th._dynamo.config.patch(recompile_limit=1):
        for algo, policy_class, depth in [("dqn", DQNPolicy, 1), ("dqn", DQNPolicy, 2), ("ppo", ActorCriticPolicy, 1)] * 2:
            workload = Workload(algo, policy_class, box, spaces.Discrete(3), {"net_arch": [8] * depth}, 8, 2, 1)
            timing = measure_compile(Option(probe_module.Candidate("cpu", "off", 1), workload), "default", seconds=0.02)
            assert not timing.act_failed, (algo, depth)


@pytest.mark.heavy
def test_a_forward_pass_that_does_not_compile_leaves_the_steps_figures(monkeypatch):
    # The run would collect with that pass eager and keep its compiled step, so the probe must not drop the step.
    workload = Workload("dqn", DQNPolicy, spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3), {"net_arch": [16]}, 8, 2, 1)

    def broken(obs: th.Tensor) -> th.Tensor:
        th._dynamo.graph_break()  # what fullgraph=True refuses
        return obs

    monkeypatch.setattr(probe_module, "_forward", lambda policy, w: broken)
    timing = measure_compile(Option(probe_module.Candidate("cpu", "off", 1), workload), "default", seconds=0.05)
    assert timing.eager_s > 0 and timing.compiled_s > 0 and timing.compile_s > 0
    assert timing.act_compiled_s == timing.act_eager_s > 0  # collected eager, as the run would
    assert timing.act_failed and timing.act_compile_s == 0


@pytest.mark.parametrize("compile_ms", [0.5, 1.95], ids=["compiled", "eager"])
def test_bench_auto_runs_auto_against_the_compile_choice_it_passed_over(gpu_machine, compile_ms):
    from sb3_gpu.benches.auto import _alternatives

    prober = fake_prober(FakeTimes(GPU_TIMES), FakeCompile(eager_ms=2.0, compiled_ms=compile_ms))
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober)
    chosen = plan.speed.compile
    assert chosen == ("reduce-overhead" if compile_ms == 0.5 else "false")
    alternatives = _alternatives(plan)
    assert alternatives[0][2]["compile"] == chosen  # auto's own choice first
    twins = [o for label, device, o, _ in alternatives if device == "cuda:0" and o["amp"] == plan.speed.amp]
    assert {o["compile"] for o in twins} == {"false", "reduce-overhead"}
    assert all(o["compile"] == "false" for _, device, o, _ in alternatives if device == "cpu")


def test_a_step_that_failed_to_compile_is_not_compiled_again_on_the_next_plan(tmp_path, gpu_machine):
    failing = FakeCompile(error="no kernel")

    def plan():
        prober = Prober(FakeTimes(GPU_TIMES), ProbeCache(tmp_path / "probes.json"), usable=lambda d: True)
        prober.measure_compile = failing
        return make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober)

    first, second = plan(), plan()
    assert len(failing.asked) == 1 and first.speed.compile == second.speed.compile == "false"
    assert "it failed on this machine before (remove " in second.speed.compile_reason


def _failing_compile(cause: BaseException, asked: list[str]):
    def failing(option: Option, mode: str) -> CompileTiming:
        asked.append(mode)
        try:
            raise cause
        except type(cause) as e:  # as inductor wraps what failed: its own error, raised while handling it
            raise RuntimeError(f"InductorError: {type(e).__name__}: {e}") from None

    return failing


def test_a_compile_that_failed_on_a_kernel_file_is_tried_again_on_the_next_plan(tmp_path, gpu_machine):
    # A kernel left half-written by a killed process fails to load: that is the machine's state, not the step's,
    # and must not rule compiling out for good.
    name = "c3iaobx7pvq7srrowycuontzkg5whpxyzq3i5n2ylx3aijq4gqwe7z.cpython-311-x86_64-linux-gnu.so"
    kernel = f"{probe_module._inductor_cache()}/3i/{name}"
    asked: list[str] = []

    def plan():
        prober = Prober(FakeTimes(GPU_TIMES), ProbeCache(tmp_path / "probes.json"), usable=lambda d: True)
        prober.measure_compile = _failing_compile(ImportError(f"{kernel}: file too short"), asked)
        return make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober)

    first, second = plan(), plan()
    assert len(asked) == 2 and first.speed.compile == second.speed.compile == "false"
    assert "failed on this machine before" not in second.speed.compile_reason
    # The reason keeps the error's end, what went wrong, past the long path.
    assert second.speed.compile_reason.endswith("file too short), so not compiled")
    assert "(RuntimeError: InductorError: ImportError: " in second.speed.compile_reason


@pytest.mark.parametrize(
    "cause",
    [
        FileNotFoundError(2, "No such file or directory: 'cl'"),  # no compiler: it fails every time
        PermissionError(13, "Permission denied: '/cache/torchinductor'"),  # a read-only cache, the same
        ImportError("libgomp.so.1: cannot open shared object file"),  # a library the machine lacks
    ],
    ids=["no-compiler", "read-only", "no-library"],
)
def test_a_compile_that_fails_for_good_is_remembered(tmp_path, gpu_machine, cause):
    asked: list[str] = []
    for _ in range(2):
        prober = Prober(FakeTimes(GPU_TIMES), ProbeCache(tmp_path / "probes.json"), usable=lambda d: True)
        prober.measure_compile = _failing_compile(cause, asked)
        plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober)
    assert len(asked) == 1 and "it failed on this machine before" in plan.speed.compile_reason


@pytest.mark.parametrize(
    "cause",
    [th.cuda.OutOfMemoryError("CUDA out of memory"), BrokenProcessPool("a compile worker was killed")],
    ids=["another-process-held-the-gpu", "compile-workers-died"],
)
def test_a_compile_that_failed_on_the_machines_passing_state_is_tried_again(cause):
    try:
        try:
            raise cause
        except Exception:
            raise RuntimeError("BackendCompilerFailed") from None  # as inductor wraps it: raised while handling it
    except RuntimeError as e:
        assert probe_module._passing(e)


def test_a_full_disk_is_tried_again():
    assert probe_module._passing(RuntimeError("x")) is False
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("CppCompileError") from None
    except RuntimeError as e:
        assert probe_module._passing(e)


def test_gist_keeps_a_long_lines_start_and_end():
    line = "ImportError: /tmp/torchinductor_me/" + "x" * 300 + ".so: file too short"
    assert gist(ValueError(line + "\nmore lines")) == line[:77] + " ... " + line[-77:]
    assert len(gist(ValueError(line))) <= 160 and gist(ValueError(line)).endswith(".so: file too short")
    assert gist(ValueError("short\nsecond")) == "short" and gist(ValueError("")) == ""


def test_cause_of_follows_raise_from_and_raise_while_handling():
    root = ImportError("root")
    try:
        try:
            raise root
        except ImportError as e:
            raise KeyError("wrapped") from e
    except KeyError as wrapped:
        assert cause_of(wrapped, ImportError) is root and cause_of(wrapped, OSError) is None
        try:
            raise RuntimeError("outer")  # while handling: its __context__
        except RuntimeError as outer:
            assert cause_of(outer, ImportError) is root and cause_of(outer, RuntimeError) is outer


def test_a_compile_figure_cached_without_the_forward_pass_is_timed_again(tmp_path):
    cache = ProbeCache(tmp_path / "compile-probes.json")
    cache._put("key", {"eager_s": 1.0, "compiled_s": 0.5, "compile_s": 3.0})  # what an older sb3_gpu wrote
    assert cache.get_compile("key") is None
    # then one whose compile_s was the step's and the forward pass's together
    cache._put("key", {"eager_s": 1.0, "compiled_s": 0.5, "compile_s": 3.0, "act_eager_s": 0.2, "act_compiled_s": 0.1})
    assert cache.get_compile("key") is None
    for failed in (False, True):
        cache.put_compile("key", CompileTiming(1.0, 0.5, 3.0, 0.2, 0.1, 1.5, failed))
        assert ProbeCache(cache.path).get_compile("key") == CompileTiming(1.0, 0.5, 3.0, 0.2, 0.1, 1.5, failed, cached=True)


def test_compile_auto_weighs_the_steps_a_resumed_run_has_left(cpu_machine):
    compile_times = FakeCompile(eager_ms=20.0, compiled_ms=12.0, compile_s=40.0)
    prober = fake_prober(FakeTimes(CPU_TIMES), compile_times)
    plan = make_plan("td3", "Pendulum-v1", "cpu", hardware=cpu_machine, prober=prober, steps_left=1_000)
    assert plan.preset.n_timesteps == 20_000 and plan.speed.compile == "false" and compile_times.asked == []
    assert "the run's gradient steps take about 20.0 s eager" in plan.speed.compile_reason


@pytest.mark.parametrize("overlapped", [True, False])
def test_compile_auto_saves_nothing_where_overlapped_training_hides_behind_collection(gpu_machine, overlapped):
    # 8 envs, a gradient step per 8 env steps: 0.5 ms of forward pass per env step against 0.25 ms of training (eager).
    # Overlapped, collection is the slower side, so a faster step beside it gains nothing; after it, it saves 25%.
    compile_times = FakeCompile(eager_ms=2.0, compiled_ms=0.5, compile_s=5.0, act_ms=(4.0, 4.0))
    prober = fake_prober(FakeTimes(GPU_TIMES), compile_times)
    plan = make_plan("dqn", "CartPole-v1", hardware=gpu_machine, prober=prober, overrides={"overlap_training": overlapped})
    assert plan.device.device == "cuda:0" and (plan.training == "overlapped") == overlapped
    assert plan.speed.compile == ("false" if overlapped else "reduce-overhead")


def test_the_eager_and_compiled_steps_are_timed_in_turns_so_that_both_see_the_same_load():
    calls: list[str] = []

    def a() -> None:
        calls.append("eager")

    def b() -> None:
        calls.append("compiled")

    probe_module._paired_medians(a, b, seconds=0.0)
    assert calls == ["eager", "compiled"]  # each at least once
    calls.clear()
    probe_module._paired_medians(a, b, seconds=60.0, max_repeats=3)
    assert calls == ["eager", "compiled"] * 3


def test_the_probe_times_layer_normed_critics_under_a_key_of_their_own(gpu_machine, monkeypatch):
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.3), "cpu fp32": (1.0, 0.2)})
    normed = make_plan(
        "sac", "Pendulum-v1", hardware=gpu_machine, prober=fake_prober(times), overrides={"critic_layer_norm": True}
    )
    plain = make_plan("sac", "Pendulum-v1", hardware=gpu_machine, prober=fake_prober(times))
    assert normed.probe is not None and plain.probe is not None
    assert {o.workload.critic_layer_norm for o in normed.probe.options} == {True}
    keys = {o.workload.key for o in plain.probe.options}
    assert all(k.endswith(" | critic layer norm") for k in (o.workload.key for o in normed.probe.options))
    assert not any("layer norm" in k for k in keys)  # figures cached before the key existed stay the plain run's
    built = []

    def recorded(cls):
        built.append(normed_critics_policy(cls))
        return built[-1]

    monkeypatch.setattr(probe_module, "normed_critics_policy", recorded)
    workload = dataclasses.replace(normed.probe.options[0].workload, batch_size=8, n_envs=2)
    assert measure_option(Option(probe_module.Candidate("cpu", "off", 1), workload), 0.01).train_s > 0
    assert len(built) == 1 and issubclass(built[0], NormedCritics)


@pytest.mark.parametrize("algo", ["sac", "tqc", "ppo"])
def test_the_probe_times_gsde_as_the_run_samples_it_under_a_key_of_its_own(algo, gpu_machine, monkeypatch):
    times = FakeTimes({"cuda:0 fp32": (2.0, 0.3), "cpu fp32": (1.0, 0.2)})
    sde = make_plan(algo, "Pendulum-v1", hardware=gpu_machine, prober=fake_prober(times), overrides={"use_sde": True})
    plain = make_plan(algo, "Pendulum-v1", hardware=gpu_machine, prober=fake_prober(times))
    assert sde.probe is not None and plain.probe is not None
    assert all(o.workload.use_sde and o.workload.key.endswith(" | gSDE") for o in sde.probe.options)
    assert not any(o.workload.use_sde or "gSDE" in o.workload.key for o in plain.probe.options)
    sampled = []
    monkeypatch.setattr(probe_module, "sde_sample", lambda *a: sampled.append(a[2]) or sde_sample(*a))
    workload = dataclasses.replace(sde.probe.options[0].workload, batch_size=8, n_envs=2)
    policy = workload.policy(th.device("cpu"))
    dist = policy.action_dist if algo == "ppo" else policy.actor.action_dist
    assert (policy.use_sde if algo == "ppo" else policy.actor.use_sde) and dist.exploration_matrices is not None
    assert dist.exploration_matrices.shape[0] == 2  # drawn for the n_envs observations collection passes, as SB3's
    assert measure_option(Option(probe_module.Candidate("cpu", "off", 1), workload), 0.01).train_s > 0
    if algo == "ppo":  # SB3's own gSDE distribution in evaluate_actions: no sample to draw
        assert not sampled
    else:  # the target's next actions and the actor's, each on the matrix scaled by the actor's std
        assert sampled and all(m.shape == (policy.actor.action_dist.latent_sde_dim, 1) for m in sampled)


@pytest.mark.heavy
def test_measuring_compile_under_gsde_compiles_the_step_and_leaves_collection_sb3s():
    from sb3_contrib import TQC

    box, actions = spaces.Box(-1, 1, (4,), np.float32), spaces.Box(-1, 1, (1,), np.float32)
    kwargs = {"net_arch": [16], "n_quantiles": 5, "log_std_init": -3, "use_expln": True}
    workload = Workload("tqc", TQC.policy_aliases["MlpPolicy"], box, actions, kwargs, 8, 2, 1, use_sde=True)
    timing = measure_compile(Option(probe_module.Candidate("cpu", "off", 1), workload), "default", seconds=0.05)
    assert timing.eager_s > 0 and timing.compiled_s > 0 and timing.compile_s > timing.compiled_s
    assert timing.act_eager_s == timing.act_compiled_s > 0 and timing.act_compile_s == 0 and not timing.act_failed
