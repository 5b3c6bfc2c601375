"""``bench step``: what one gradient step and one vec env step cost, for SB3's own ``train()`` and collection,
sb3_gpu's eager step (device buffers, nothing logged read back) and sb3_gpu's compiled step, in one process.

Per gradient step and per vec step: host reads (the device's values read back: ``.item()``, ``.cpu()``,
``bool(t)``, ...; counted by :class:`~sb3_gpu.extensions.hostreads.HostReads`), ops launched (on the CPU the
innermost aten ops that compute and inductor's kernels, each one a launch on a GPU; on CUDA the kernels that ran,
those a CUDA graph replays with one launch included), graph breaks of the compiled step (0 where it compiled with
``fullgraph=True``), and medians of wall time, a case's variants timed in turn. On CUDA also the GPU's busy share
during training and whether a training passes under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.type_aliases import TrainFreq, TrainFrequencyUnit

from sb3_gpu.common.checks import algo_name
from sb3_gpu.common.errors import ConfigError, gist
from sb3_gpu.common.torch_settings import synchronize
from sb3_gpu.config.schema import get_algo
from sb3_gpu.extensions.hostreads import HostReads
from sb3_gpu.extensions.networks import NarrowLinear
from sb3_gpu.extensions.per import DeviceSumMinTree
from sb3_gpu.planning.build import build_env, model_kwargs
from sb3_gpu.planning.optimizers import planned_policy_kwargs
from sb3_gpu.planning.plan import Plan, auto_compile_mode, make_plan

# (algo, env, profile): the CartPole presets everywhere; the Pong CNNs where a GPU is at hand. ``dqn+per``: sb3_gpu's
# variants with prioritized replay on the device, its trees searched by tensor ops as on a GPU (SB3's row is uniform
# DQN, since SB3 has no PER).
# SAC's family on Pendulum-v1: SAC's and TD3's gpu profiles, rl-zoo3's networks (256x256, as on HalfCheetah, and
# 400x300), since their cpu ones take 64x64; TQC's cpu profile (64x64, batches of 128).
CPU_CASES = [
    *("dqn:CartPole-v1", "dqn+per:CartPole-v1", "qrdqn:CartPole-v1", "ppo:CartPole-v1"),
    *("sac:Pendulum-v1:gpu", "td3:Pendulum-v1:gpu", "tqc:Pendulum-v1"),
]
GPU_CASES = [*CPU_CASES, "dqn:ALE/Pong-v5:large", "ppo:ALE/Pong-v5"]
VARIANTS = ("sb3", "eager", "compiled")
# The compiled step with every linear layer a matrix product, narrow ones too (--matmul-heads): what NarrowLinear saves.
MATMUL_HEADS = "compiled-mm"
# aten ops that launch no kernel of their own: views, changes of metadata, allocations, no-op casts, and composites of
# those (a copy inside ``contiguous`` or ``to`` is an ``aten::copy_`` of its own, counted there).
_NO_KERNEL = frozenset(
    (
        *("view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "expand", "as_strided"),
        *("t", "transpose", "permute", "select", "slice", "unbind", "split", "chunk", "alias", "detach", "numpy_T"),
        *("flatten", "unflatten", "narrow", "tensor_split", "movedim", "view_as", "expand_as", "reshape_as"),
        *("unsqueeze_", "squeeze_", "t_", "transpose_", "as_strided_", "resize_", "broadcast_tensors", "contiguous"),
        *("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"),
        *("lift_fresh", "to", "resolve_conj", "resolve_neg"),
    )
)


@dataclass(frozen=True)
class StepRow:
    """One variant of one case: per gradient step (``grad_*``) and per vec step (``vec_*``)."""

    case: str
    variant: str
    grad_reads: float
    grad_ops: float
    grad_ms: float
    vec_reads: float
    vec_ops: float
    vec_ms: float
    graph_breaks: str  # "0" (fullgraph), "-" (not compiled), or why compiling fell back
    gpu_busy: float | None = None
    sync_free: str | None = None  # "yes", or the first line of what set_sync_debug_mode("error") raised


def parse_case(text: str) -> tuple[str, str, str]:
    """``algo[+per]:env[:profile]``, e.g. ``dqn:ALE/Pong-v5:large``."""
    algo, _, rest = text.partition(":")
    env, _, profile = rest.partition(":")
    name, _, per = algo.lower().partition("+")
    if not algo or not env or per not in ("", "per"):
        raise ValueError(f"a case is ALGO:ENV or ALGO:ENV:PROFILE (ALGO may be dqn+per or qrdqn+per), got {text!r}")
    try:
        name = algo_name(name)
    except ConfigError as e:
        raise ValueError(f"{text!r}: {e}") from None
    if per and name not in ("dqn", "qrdqn"):
        raise ValueError(f"{text!r}: +per is for dqn and qrdqn")
    return name + ("+" if per else "") + per, env, profile.strip().lower() or "auto"


def plan_case(text: str, device: str, variant: str = "sb3", buffer_size: int | None = None) -> Plan:
    """The plan a case's variant trains with (a ConfigError for an env or profile that does not suit it).
    ``buffer_size`` replaces an off-policy preset's, so that a CPU can count a profile whose buffer only a big machine
    holds: a uniform sample's ops do not change with it; PER's tree searches and updates take one op more per level
    of its trees, which a smaller buffer can have fewer of."""
    algo, env, profile = parse_case(text)
    algo, _, extension = algo.partition("+")
    overrides: dict[str, Any] = {"amp": "off", "compile": False, "device_buffers": variant != "sb3"}
    if algo != "ppo":
        overrides["learning_starts"] = 1_000  # a short warm-up
        if buffer_size is not None:
            overrides["buffer_size"] = buffer_size
    if algo in ("dqn", "qrdqn"):
        overrides["per"] = extension == "per" and variant != "sb3"  # SB3's own train() has no PER
    return make_plan(algo, env, device, seed=0, profile=profile, overrides=overrides, vec_env="dummy")


def _model(text: str, device: str, variant: str, buffer_size: int | None = None) -> tuple[BaseAlgorithm, str]:
    """A model of the variant, warmed up on its own data (buffers filled, compiled), and its graph-break note."""
    plan = plan_case(text, device, variant, buffer_size)
    algo, off_policy = plan.algo, plan.algo != "ppo"
    per = bool(getattr(plan.preset.params, "per", False))  # plan_case's choice: +per, and not SB3's own variant
    kwargs = model_kwargs(plan)
    spec = get_algo(algo)
    # SB3's own class for its row, also where a profile's accumulation or PER would make the preset's sb3_gpu's.
    cls = spec.model_class if variant == "sb3" else spec.extended_class
    assert cls is not None
    if variant == "sb3":  # SB3's train() cannot accumulate: it takes the k micro-batches as one batch, the same samples
        accumulate = kwargs.pop("grad_accum_steps", 1)
        if accumulate > 1:
            kwargs["batch_size"] = accumulate * kwargs["batch_size"]
        # And plain SB3's optimizer: the fused one a plan gives a GPU model is sb3_gpu's.
        given = plan.preset.sb3_kwargs().get("policy_kwargs") or {}
        kwargs["policy_kwargs"] = planned_policy_kwargs(algo, given, kwargs["batch_size"], plan.device.device, False)
    model: Any = cls(plan.preset.policy, build_env(plan), device=plan.device.device, seed=0, **kwargs)
    if per:  # the trees' tensor ops (a GPU's only backend; the CPU would take numba's loops, outside any graph)
        buffer = model.replay_buffer
        buffer.tree = DeviceSumMinTree(buffer.tree.capacity, buffer.device, backend="torch")
    breaks = "-"
    if variant in ("compiled", MATMUL_HEADS):
        compile_step = getattr(model, "compile_step", None)
        if compile_step is None:
            return model, "not built for this algorithm"
        refused = compile_step(auto_compile_mode(plan.device.device))
        if refused:
            return model, f"not compiled: {refused}"
        if variant == MATMUL_HEADS:  # before the first call compiles the step
            for layer in model.policy.modules():
                if type(layer) is NarrowLinear:
                    layer.__class__ = th.nn.Linear  # type: ignore[assignment]  # back to nn.Linear's forward
    # Off-policy: the warm-up's transitions and two rounds of training past them (a CNN's step at a large profile's
    # batches takes seconds on a CPU). _collector explores at the final rate whatever the steps done.
    if off_policy:
        model.learn(model.learning_starts + 2 * model.n_envs * max(model.train_freq.frequency, 1))
    else:
        model.learn(model.n_steps * model.n_envs)
    if variant in ("compiled", MATMUL_HEADS):
        _train(model)  # compiles now, if learn did not train yet
        compiled = getattr(model, "_compiled_step", None) or model._compiled  # the DQN family and PPO's, SAC's family's
        breaks = compiled.fallback or "0"  # fullgraph=True: compiled means no graph break
    return model, breaks


def _gradient_steps(model: Any) -> int:
    """Gradient steps per timed ``train()`` call: as ``learn`` makes them, or for TD3 a whole cycle of its delayed
    actor update (a step with it, one without: two compiled graphs)."""
    if hasattr(model, "n_epochs"):
        return model.n_epochs * -(-model.n_steps * model.n_envs // model.batch_size)
    return max(model.gradient_steps, 1) * getattr(model, "policy_delay", 1)


def _train(model: Any) -> None:
    if hasattr(model, "n_epochs"):
        model.train()
    else:
        model.train(gradient_steps=_gradient_steps(model), batch_size=model.batch_size)


def _collector(model: Any, vec_steps: int) -> tuple[Callable[[], None], int]:
    """A call of the model's own collection (``collect_rollouts``, exploring as ``learn`` does) and its vec steps:
    ``vec_steps``, at most a rollout for PPO (whose buffer holds one)."""
    # A learn of one step more than done: its progress is at the end, so that DQN explores at its final rate and
    # most actions come from the network.
    _, callback = model._setup_learn(1, None, reset_num_timesteps=False)
    callback.on_training_start(locals(), globals())
    if hasattr(model, "rollout_buffer"):
        steps = min(vec_steps, model.n_steps)

        def rollout() -> None:
            model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=steps)

        return rollout, steps
    freq = TrainFreq(vec_steps, TrainFrequencyUnit.STEP)

    def replay() -> None:
        model.collect_rollouts(model.env, callback, freq, model.replay_buffer, learning_starts=0)

    return replay, vec_steps


def _count(fn: Callable[[], None], device: th.device) -> tuple[int, int, float | None]:
    """Host reads and ops launched by one call of ``fn``, and on CUDA the GPU's busy share of its wall time."""
    cuda = device.type == "cuda"
    activities = [th.profiler.ProfilerActivity.CPU] + ([th.profiler.ProfilerActivity.CUDA] if cuda else [])
    with HostReads():  # a compiled step meets the counting mode here first: any recompiling for it is done now
        fn()
    synchronize(device)
    start = time.perf_counter()
    with HostReads() as reads, th.profiler.profile(activities=activities) as prof:
        fn()
        synchronize(device)
    wall = time.perf_counter() - start
    events = list(prof.events())
    if cuda:
        kernels = [e for e in events if e.device_type == th.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / wall
        return reads.total, len(kernels), min(busy, 1.0)
    # On the CPU: the ops that would each be a kernel on a GPU, the innermost aten ops that compute (not views or
    # no-op casts), and inductor's kernels (events of their own with enable_kernel_profile). Not dynamo's guards: they
    # read 0-dim float64 and int tensors with item() only where those live on the CPU (a GPU's stay on the device).
    ops = sum(e.name.startswith(("cpp_fused", "graph_")) or (_kernel(e) and not _in_guard(e)) for e in events)
    return reads.total, ops, None


def _computes(event: Any) -> bool:
    """Whether ``event`` is an aten op that may launch a kernel (not one of ``_NO_KERNEL``)."""
    return bool(event.name.startswith("aten::") and event.name[6:] not in _NO_KERNEL)


def _kernel(event: Any) -> bool:
    """Whether ``event`` is counted as one kernel: it computes and no op it calls does. ``aten::linear`` is not one,
    what it calls is; ``aten::addmm`` on the CPU copies its bias into the output (an ``aten::copy_``, counted) and then
    runs its GEMM in the same call, not as an op: a linear layer counts once. A convolution, whose calls only size
    and stride its output, counts once."""
    return _computes(event) and not _computes_inside(event)


def _computes_inside(event: Any) -> bool:
    return any(_computes(c) or _computes_inside(c) for c in event.cpu_children)


def _in_guard(event: Any) -> bool:
    """Whether ``event`` ran inside dynamo's check of a compiled function's guards."""
    while event is not None:
        if event.name == "TorchDynamo Cache Lookup":
            return True
        event = event.cpu_parent
    return False


def interleaved_medians(fns: Sequence[Callable[[], None]], device: th.device, repeats: int) -> list[float]:
    """Median wall seconds of each of ``fns``, timed in turn, each once per round: each meets the machine as the
    others do. Timed one after the other, a variant's figure moved with what had run before it in the process. The
    first round takes them in order, later ones in a shuffled (seeded) order: in a fixed order each would always run
    after the same one, in the caches and memory that one left."""
    times: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    shuffle = random.Random(0).shuffle
    for round_ in range(repeats):
        if round_:
            shuffle(order)
        for i in order:
            synchronize(device)
            start = time.perf_counter()
            fns[i]()
            synchronize(device)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _sync_free(fn: Callable[[], None], device: th.device) -> str | None:
    if device.type != "cuda":
        return None
    th.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "yes"
    except RuntimeError as e:
        return gist(e, 120)
    finally:
        th.cuda.set_sync_debug_mode("default")


def bench_step(
    cases: list[str],
    device: str,
    repeats: int,
    vec_steps: int,
    buffer_size: int | None = None,
    matmul_heads: bool = False,
    rows: list[StepRow] | None = None,
) -> list[StepRow]:
    """A row per case and variant (SB3's own, sb3_gpu eager, sb3_gpu compiled, and with ``matmul_heads`` the compiled
    step with every linear layer a matrix product); ``buffer_size`` as for plan_case. ``rows``, where given, gets each
    case's rows as the case ends (what a stop leaves)."""
    # Inductor's CPU kernels then show in the profiler, one event per kernel call, as CUDA kernels do.
    th._inductor.config.cpp.enable_kernel_profile = True
    # This torch's profiler (kineto) prints two lines to stderr at each start and stop, hundreds in a bench, unless
    # its log level is above theirs; read when it first starts. A level the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    checks = th.distributions.Distribution._validate_args
    try:
        variants = (*VARIANTS, MATMUL_HEADS) if matmul_heads else VARIANTS
        return _rows(cases, device, repeats, vec_steps, buffer_size, variants, [] if rows is None else rows)
    finally:
        th.distributions.Distribution.set_default_validate_args(checks)


def _checks_as_a_new_process() -> None:
    """Dynamo turns torch.distributions' argument checks off for the whole process when it compiles, and SB3's
    distributions then skip their reads: every variant runs with them as a new process has them (on, as Python's
    asserts are), so SB3's row counts what SB3 reads whichever compiled variant went before."""
    th.distributions.Distribution.set_default_validate_args(__debug__)


@dataclass
class _Variant:
    name: str
    model: Any
    breaks: str
    per_train: int  # gradient steps per train() call
    train: Callable[[], None]
    collect: Callable[[], None]
    vec_steps: int  # vec steps per collect() call


def _rows(
    cases: list[str],
    device: str,
    repeats: int,
    vec_steps: int,
    buffer_size: int | None,
    variants: Sequence[str],
    rows: list[StepRow],
) -> list[StepRow]:
    for text in cases:
        rows += _case_rows(text, device, repeats, vec_steps, buffer_size, variants)
        print(f"  {text}: done", flush=True)
    return rows


def _case_rows(
    text: str, device: str, repeats: int, vec_steps: int, buffer_size: int | None, variants: Sequence[str]
) -> list[StepRow]:
    """The case's variants, built side by side (at most four models, envs and buffers alive at once; all freed on
    return), counted one by one and timed in turn."""
    built: list[_Variant] = []
    for name in variants:
        model, breaks = _model(text, device, name, buffer_size)
        if breaks.startswith("not "):
            print(f"  {text}, {name}: {breaks}", flush=True)
            continue
        collect, vec_steps_done = _collector(model, vec_steps)

        def train(model: Any = model) -> None:
            _checks_as_a_new_process()
            _train(model)

        def collect_checked(collect: Callable[[], None] = collect) -> None:
            _checks_as_a_new_process()
            collect()

        built.append(_Variant(name, model, breaks, _gradient_steps(model), train, collect_checked, vec_steps_done))
    if not built:
        return []
    dev = built[0].model.device
    # Training first, all of it: a collection shorter than PPO's rollout leaves its buffer part-filled, which SB3's
    # train() refuses.
    grad_counts = [_count(v.train, dev) for v in built]
    grad_s = interleaved_medians([v.train for v in built], dev, repeats)
    sync_free = [_sync_free(v.train, dev) for v in built]
    vec_counts = [_count(v.collect, dev) for v in built]
    vec_s = interleaved_medians([v.collect for v in built], dev, repeats)
    counts = zip(grad_counts, vec_counts, sync_free, strict=True)
    rows = []
    for v, ((grad_reads, grad_ops, busy), (vec_reads, vec_ops, _), free), g, c in zip(
        built, counts, grad_s, vec_s, strict=True
    ):
        rows.append(
            StepRow(
                text,
                v.name,
                grad_reads / v.per_train,
                grad_ops / v.per_train,
                g / v.per_train * 1e3,
                vec_reads / v.vec_steps,
                vec_ops / v.vec_steps,
                c / v.vec_steps * 1e3,
                v.breaks,
                busy,
                free,
            )
        )
    return rows


def step_markdown(rows: list[StepRow], command: str, machine: str) -> str:
    """The rows as a markdown table, with each variant's ops per gradient step as a share of SB3's."""
    sb3_ops = {r.case: r.grad_ops for r in rows if r.variant == "sb3"}
    lines = [
        f"`{command}`",
        "",
        machine,
        "",
        "| case | variant | reads / grad step | ops / grad step | ops vs SB3 | ms / grad step | reads / vec step "
        "| ops / vec step | ms / vec step | graph breaks | GPU busy | sync-free |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        share = f"{r.grad_ops / sb3_ops[r.case]:.2f}x" if sb3_ops.get(r.case) else "-"
        busy = f"{r.gpu_busy:.0%}" if r.gpu_busy is not None else "-"
        lines.append(
            f"| {r.case} | {r.variant} | {r.grad_reads:.2f} | {r.grad_ops:.1f} | {share} | {r.grad_ms:.3f} "
            f"| {r.vec_reads:.2f} | {r.vec_ops:.1f} | {r.vec_ms:.3f} | {r.graph_breaks} | {busy} | {r.sync_free or '-'} |"
        )
    return "\n".join(lines) + "\n"


def rows_json(rows: list[StepRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
