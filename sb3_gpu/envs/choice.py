"""The one ``auto`` vec env choice (dummy, batched subprocesses or EnvPool), and the worker count it implies."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from sb3_gpu.common.checks import VEC_ENV_KINDS
from sb3_gpu.common.errors import ConfigError, closest, warn
from sb3_gpu.common.hardware import logical_cores
from sb3_gpu.envs.batched import batched_workers, measure_overhead
from sb3_gpu.envs.envpool_vec import envpool_available, envpool_failure, envpool_task, no_twin
from sb3_gpu.envs.spec import EnvSpec, check_env_api, measure_step_seconds, probe_env

try:
    import resource
except ImportError:  # Windows: no rlimits to check
    resource = None  # type: ignore[assignment]

# BatchedSubprocVecEnv pays one round trip per worker per step (the workers wake in parallel), plus the infos'
# pickling per env. Measured on a 2-core Firecracker VM, where waking an idle vCPU is slow: ~350 us per step and
# ~10 us per env (python -m sb3_gpu.bench envs). Another 2-core VM paid ~120 us and ~2 us, so where these figures
# leave the choice in doubt, auto measures them on the machine at hand (BatchedCosts).
BATCHED_STEP_OVERHEAD_S = 350e-6
BATCHED_PER_ENV_S = 10e-6
# Batched must be estimated this much faster: it costs start-up, and the measured overhead (idle envs) leaves out
# what a real env's step costs more in a worker than in place (bench envs: CartPole x64 est. 1.22x, ran 0.95x).
BATCHED_MARGIN = 1.3
# Estimates of batched / dummy inside this band, with the slow VM's costs, could go either way on another machine:
# they are measured there. Above it batched wins even on the slow VM; below it no measured VM's costs would do.
MEASURE_BAND = (0.5, 1.5)
# EnvPool hands each step to its C++ thread pool, whose wake-ups cost a fixed time per step, so it only pays where
# a DummyVecEnv step (n_envs * one env step) is longer than this. bench envs on the same VM: CartPole x8 (~60 us a
# vec step) 0.73x dummy, x32 1.33x (0.86x in an earlier run), x64 2.00x; LunarLander x8 (~300 us) 1.63x; Atari always.
ENVPOOL_MIN_VEC_STEP_S = 0.2e-3


@dataclass(frozen=True)
class BatchedCosts:
    """What a step of the batched VecEnv costs besides its envs' own steps: a round trip (the workers wake in
    parallel) and a little per env. The defaults are a slow VM's; :func:`batched_costs` measures this machine's."""

    step_s: float = BATCHED_STEP_OVERHEAD_S
    per_env_s: float = BATCHED_PER_ENV_S
    measured: bool = False

    def describe(self) -> str:
        return f"{self.step_s * 1e6:.0f} us a step + {self.per_env_s * 1e6:.1f} us an env"


@functools.cache
def batched_costs(workers: int) -> BatchedCosts | None:
    """This machine's :class:`BatchedCosts` for ``workers`` workers, timed once per process, or None where its
    workers cannot start here (the defaults then stand). It takes about a second, most of it the workers' start, and
    a few more where it starts the workers' server (which then stays, for the run's workers to fork from)."""
    try:
        step_s, per_env_s = measure_overhead(workers)
    except Exception:  # no subprocesses here (a sandbox, a frozen app): the build itself will say why, if it is tried
        return None
    return BatchedCosts(step_s, per_env_s, measured=True)


class VecEnvFallbackWarning(UserWarning):
    """The vec env kind chosen could not run here (workers that cannot start, an EnvPool that cannot make the env),
    so another one steps the envs; the warning names the cause."""


def envpool_fits(spec: EnvSpec) -> bool:
    """Whether EnvPool is installed and has a faithful twin of this env."""
    return spec.env_id is not None and envpool_task(spec.env_id, spec.is_atari) is not None and envpool_available()


def check_vec_env_kind(kind: str) -> str:
    if inspect.isclass(kind):  # SubprocVecEnv given where SB3's make_vec_env takes vec_env_cls
        raise ConfigError(f"vec_env is a name ({', '.join(VEC_ENV_KINDS)}); a VecEnv class goes in vec_env_cls, got {kind!r}")
    if not isinstance(kind, str):
        raise ConfigError(f"vec_env must be one of {', '.join(VEC_ENV_KINDS)}, got {kind!r}")
    if kind not in VEC_ENV_KINDS:
        raise ConfigError(f"unknown vec_env {kind!r}{closest(kind, VEC_ENV_KINDS)} (valid: {', '.join(VEC_ENV_KINDS)})")
    return kind


def choose_vec_env(
    requested: str, n_envs: int, step_seconds: float, cores: int, envpool: bool = False, costs: BatchedCosts | None = None
) -> tuple[str, str]:
    """Pick a VecEnv kind for ``n_envs`` envs whose step takes ``step_seconds``; return (kind, reason).

    ``envpool`` says whether EnvPool is installed and has a twin of this env: its C++ envs step on a thread pool
    with no Python in the loop, which wins once a step is long enough to pay for waking the threads. Otherwise the
    model is: DummyVecEnv costs ``n_envs * step``; the batched subprocess VecEnv spreads the envs over ``cores``
    workers and pays a round trip per worker and a little per env (``costs``, by default a slow VM's). Batched must
    win by 30% (``BATCHED_MARGIN``). SB3's SubprocVecEnv is never the automatic choice: batched does the same work
    with one round trip per worker instead of per env.
    """
    if check_vec_env_kind(requested) != "auto":
        return requested, "asked for"
    if envpool and n_envs * step_seconds >= ENVPOOL_MIN_VEC_STEP_S:
        return "envpool", (
            f"EnvPool has a faithful twin of this env; {n_envs} envs x {step_seconds * 1e6:.0f} us per Python step "
            "pays for its thread pool"
        )
    passed_over = (
        f"; EnvPool not taken: a {n_envs * step_seconds * 1e6:.1f} us vec step is under the "
        f"{ENVPOOL_MIN_VEC_STEP_S * 1e6:.0f} us its thread pool needs"
        if envpool
        else ""
    )
    if n_envs == 1:
        return "dummy", "one env: nothing to parallelise" + passed_over
    if cores < 2:
        return "dummy", "one CPU core: subprocesses would only add overhead" + passed_over
    costs = costs or BatchedCosts()
    ratio = batched_speedup(n_envs, step_seconds, cores, costs)
    detail = (
        f"env step {step_seconds * 1e6:.0f} us, {n_envs} envs on {cores} cores: "
        f"batched ({batched_workers(n_envs, cores)} workers) est. {ratio:.2f}x dummy"
    )
    if costs.measured:
        detail += f" (its overhead measured here: {costs.describe()})"
    return ("batched" if ratio >= BATCHED_MARGIN else "dummy"), detail + passed_over


def batched_speedup(n_envs: int, step_seconds: float, cores: int, costs: BatchedCosts) -> float:
    """The model's estimate of a batched step's speed over a dummy one: dummy steps the envs one after the other;
    batched spreads them over its workers and pays ``costs``."""
    workers = batched_workers(n_envs, cores)
    batched = -(-n_envs // workers) * step_seconds + costs.step_s + n_envs * costs.per_env_s
    return n_envs * step_seconds / batched


# More SB3 SubprocVecEnv workers than this per core only queue on the CPU (each is a process with its own torch).
MAX_SUBPROC_PER_CORE = 8
# File descriptors that a process needs besides its envs' (imports, logs, TensorBoard, the console).
FD_MARGIN = 64


def env_processes(kind: str, n_envs: int, cores: int) -> int:
    """Worker processes a vec env kind starts for ``n_envs`` envs (EnvPool's C++ threads are no processes)."""
    return {"subproc": n_envs, "batched": batched_workers(n_envs, cores)}.get(kind, 0)


def check_env_resources(kind: str, n_envs: int, *, monitor: bool, cores: int | None = None) -> None:
    """Refuse, before anything is spawned or opened, a vec env that the process or machine limits cannot hold."""
    cores = cores or logical_cores()
    processes = env_processes(kind, n_envs, cores)
    if kind == "subproc" and n_envs > max(64, MAX_SUBPROC_PER_CORE * cores):
        raise ConfigError(
            f"n_envs={n_envs:,} with vec_env 'subproc' would start {n_envs:,} processes on {cores} cores; "
            "use vec_env 'batched' (--vec-env batched: one worker per core) or 'dummy'"
        )
    if resource is None:
        return
    files = (n_envs if monitor else 0) + 2 * processes + FD_MARGIN  # a Monitor CSV per env, a pipe pair per worker
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and files > soft:
        raise ConfigError(
            f"n_envs={n_envs:,} needs about {files:,} open files (a Monitor CSV per env, pipes per worker); this "
            f"process may open {soft:,} (ulimit -n): lower n_envs or raise the limit"
        )
    max_procs, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if processes and max_procs != resource.RLIM_INFINITY and processes > max_procs:
        raise ConfigError(f"vec_env {kind!r} would start {processes:,} processes; this user may run {max_procs:,}")


@dataclass(frozen=True)
class VecEnvChoice:
    """A vec env kind, why, and how many worker processes it starts (each runs one torch thread; EnvPool's thread
    pool is not counted)."""

    kind: str
    reason: str
    workers: int


def vec_env_choice(
    requested: str,
    spec: EnvSpec,
    n_envs: int,
    *,
    cores: int | None = None,
    step_seconds: float | None = None,
    envpool_allowed: bool = True,
    measure: bool = True,
) -> VecEnvChoice:
    """:func:`choose_vec_env` with its facts gathered: ``auto`` times one env step (unless ``step_seconds`` is
    given) and asks whether EnvPool fits (``envpool_allowed=False``: the envs carry wrappers EnvPool cannot run).
    Where batched or dummy is in doubt, it times the batched VecEnv's overhead here, unless ``measure`` is False
    (``cores`` are another machine's, or probing is off)."""
    cores = cores or logical_cores()
    if check_vec_env_kind(requested) == "auto" and step_seconds is None:
        probe = probe_env(spec)
        try:
            check_env_api(probe, spec.name)  # before it is timed: a broken env is named, not a traceback of the timing
            step_seconds = measure_step_seconds(probe)
        finally:
            probe.close()
    if requested == "envpool" and spec.env_id is not None and envpool_task(spec.env_id, spec.is_atari) is None:
        raise ConfigError(no_twin(spec.env_id))  # said by the plan, as the run would say it
    step_seconds = step_seconds or 0.0
    pool = requested == "auto" and envpool_allowed and envpool_fits(spec)
    suffix = ""
    takes_pool = pool and choose_vec_env(requested, n_envs, step_seconds, cores, envpool=True)[0] == "envpool"
    if takes_pool:
        # Installed is not enough (a missing dependency such as dm_env only shows on import): auto takes EnvPool
        # only once it has made the env.
        assert spec.env_id is not None  # envpool_fits checked it
        failure = envpool_failure(spec.env_id, spec.is_atari)
        if failure is not None:
            message = f"EnvPool cannot make {spec.name} here ({failure}); choosing another vec env"
            warn(message, VecEnvFallbackWarning)
            pool, takes_pool, suffix = False, False, f"; EnvPool could not make the env ({failure})"
    costs = None
    if measure and requested == "auto" and not takes_pool and n_envs > 1 and cores > 1:
        default = batched_speedup(n_envs, step_seconds, cores, BatchedCosts())
        if MEASURE_BAND[0] <= default <= MEASURE_BAND[1]:  # a slow VM's costs leave it in doubt: this machine's decide
            costs = batched_costs(batched_workers(n_envs, cores))
    kind, reason = choose_vec_env(requested, n_envs, step_seconds, cores, envpool=pool, costs=costs)
    reason += suffix
    return VecEnvChoice(kind, reason, env_processes(kind, n_envs, cores))
