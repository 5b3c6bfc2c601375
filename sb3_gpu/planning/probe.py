"""Measured automatic choices: where the device, precision or thread count is ``auto``, the plan times the preset's
own policy on each candidate and takes the one predicted fastest per env step.

Per candidate (device, precision, torch threads) it times one gradient step at the preset's batch size (forward,
backward, optimizer) and one inference at ``n_envs`` with its observation and action copies, and predicts

    seconds per env step = env step + inference / n_envs + gradient steps per env step * gradient step

from the preset's schedule (where training overlaps collection, the larger of the two parts instead of their sum). The
rules' choice is probed first and kept unless another candidate is predicted at least ``1 - MARGIN`` faster (probe
noise must not flip a choice); among candidates that close to the best, the rules' device and precision and the fewest
threads win. Probing is bounded (``budget_s`` per plan) and its figures are cached per machine, torch version, policy
shape and free cores in the user's cache directory.

``compile: auto`` is probed apart, on the option chosen (:meth:`Prober.time_compile`): the same gradient step eager
and compiled whole (:class:`~sb3_gpu.extensions.graphstep.CompiledUpdate`), collection's forward pass eager and
compiled, and the seconds compiling took. Compiling is taken where an env step, predicted as above with those figures,
is clearly faster and the run is long enough to earn the compile time back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.preprocessing import get_action_dim

from sb3_gpu.common.checks import CONTINUOUS_ALGOS
from sb3_gpu.common.errors import cause_of, named, warn
from sb3_gpu.common.io import atomic_write_text, out_of_space
from sb3_gpu.common.torch_settings import TorchSettings, own_rng, synchronize
from sb3_gpu.common.version import __version__
from sb3_gpu.extensions.compile import CompileFallbackWarning, own_code, python_int_spaces
from sb3_gpu.extensions.continuous import normed_critics_policy, polyak, sde_sample, squashed_sample
from sb3_gpu.extensions.graphstep import CompiledUpdate, Descent
from sb3_gpu.extensions.hostreads import no_argument_checks
from sb3_gpu.extensions.quantile import quantile_huber, quantile_huber_mean
from sb3_gpu.extensions.stepping import OptimizerStep

PROBE_BUDGET_S = 3.0
MIN_CACHED_S = 0.05  # a candidate timed for less than this (a spent budget) is used once, not cached
MARGIN = 0.9  # another candidate must be predicted faster than MARGIN x the rules' choice to replace it
CACHE_VERSION = 7  # 2: inference timed as the run infers (no predict wrapper), actor-critics' steps; 3: their
# entropy coefficient's step and target updates; 4: their compile time includes the action forward pass; 5: TQC's and
# QR-DQN's quantile Huber losses; 6: PPO's inference as its rollout runs it (actions, values, log-probabilities), the
# compiled step timed with argument checks off, classes keyed by module, SB3's and sb3_gpu's versions in every key;
# 7: steps with Discrete spaces (QR-DQN's, a one-hot observation's) compiled as the run compiles them (they had failed)


class ProbeCacheWarning(UserWarning):
    """The probe cache could not be read; it is ignored (and rewritten) rather than trusted."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the policy: a device, a precision (``off`` is fp32) and a torch thread count."""

    device: str
    amp: str
    threads: int

    @property
    def label(self) -> str:
        precision = "fp32" if self.amp == "off" else self.amp
        return f"{self.device} {precision}" + (
            f" {self.threads} thread{'s' * (self.threads > 1)}" if self.device == "cpu" else ""
        )


@dataclass(frozen=True)
class Workload:
    """What one env step asks of the policy under a resolved preset."""

    algo: str
    policy_class: type
    observation_space: spaces.Space
    action_space: spaces.Space
    policy_kwargs: dict[str, Any]
    batch_size: int
    n_envs: int
    grads_per_env_step: float  # micro-batches of batch_size per env step
    overlapped: bool = False  # off-policy training on a thread of its own, beside collection
    max_grad_norm: float | None = 10.0  # the DQN family's clipping (QR-DQN's default: none)
    top_quantiles_to_drop_per_net: int = 2  # TQC's: its target keeps the rest of the sorted quantiles
    critic_layer_norm: bool = False  # SAC's, TD3's and TQC's critics with a LayerNorm after each hidden layer
    use_sde: bool = False  # gSDE: the actor's noise from its latent features times an exploration matrix

    @property
    def key(self) -> str:
        parts = [
            self.algo,
            _named(self.policy_class),
            repr(self.observation_space),
            repr(self.action_space),
            repr(sorted((k, _named(v)) for k, v in self.policy_kwargs.items())),
            f"batch {self.batch_size}",
            f"envs {self.n_envs}",
        ]
        if self.algo in ("dqn", "qrdqn"):
            parts.append(f"max_grad_norm {self.max_grad_norm}")
        if self.algo == "tqc":
            parts.append(f"drop {self.top_quantiles_to_drop_per_net}")
        if self.critic_layer_norm:  # named only where on, so that the keys of figures cached before it stay theirs
            parts.append("critic layer norm")
        if self.use_sde:
            parts.append("gSDE")
        return " | ".join(parts)

    def policy(self, device: th.device) -> Any:
        """The policy at these sizes on ``device``, as the run builds it."""
        sde = {"use_sde": True} if self.use_sde else {}  # as SB3's algorithms pass it to their policies
        policy_class = normed_critics_policy(self.policy_class) if self.critic_layer_norm else self.policy_class
        policy = policy_class(self.observation_space, self.action_space, lambda _: 1e-4, **self.policy_kwargs, **sde)
        policy = policy.to(device)
        if self.use_sde:  # its exploration matrices, made on the CPU and kept outside the modules, for n_envs as SB3's
            policy.reset_noise(self.n_envs)  # runs draw them before collecting
        return policy


def _named(value: Any) -> Any:
    # By module too: an edited (or another project's) CustomCNN of the same name must not meet this one's figures.
    return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else value


@dataclass(frozen=True)
class Timing:
    """Median seconds of one gradient step and of one inference at ``n_envs``."""

    train_s: float
    infer_s: float
    cached: bool = False

    def per_env_step(self, workload: Workload, env_s: float) -> float:
        collect, train = env_s + self.infer_s / workload.n_envs, workload.grads_per_env_step * self.train_s
        return max(collect, train) if workload.overlapped else collect + train


@dataclass(frozen=True)
class CompileTiming:
    """Median seconds of one gradient step eager and compiled whole and the seconds its compilation took; the same
    for collection's forward pass at ``n_envs`` (``act_failed``: it did not compile, its figures are eager's)."""

    eager_s: float
    compiled_s: float
    compile_s: float
    act_eager_s: float = 0.0
    act_compiled_s: float = 0.0
    act_compile_s: float = 0.0
    act_failed: bool = False
    cached: bool = False

    def per_env_step(self, workload: Workload, env_s: float, collect: bool = True) -> tuple[float, float]:
        """Seconds per env step eager and compiled (collection's forward pass too where ``collect``), predicted as
        :meth:`Timing.per_env_step` predicts them."""
        eager = Timing(self.eager_s, self.act_eager_s).per_env_step(workload, env_s)
        act_s = self.act_compiled_s if collect else self.act_eager_s
        return eager, Timing(self.compiled_s, act_s).per_env_step(workload, env_s)


@dataclass(frozen=True)
class Option:
    """A candidate and the workload it would run (a device's own profile may size the preset differently), with the
    CUDA math flags the plan would set for it."""

    candidate: Candidate
    workload: Workload
    cudnn_benchmark: bool = False
    tf32: bool = False


@dataclass(frozen=True)
class ProbeResult:
    """Every option with its figures (None: not probed within the budget), the rules' choice and the one taken."""

    options: tuple[Option, ...]
    timings: tuple[Timing | None, ...]
    rule: int
    chosen: int
    env_s: float
    seconds: float  # spent probing (cached figures cost nothing)
    failures: tuple[str | None, ...] = ()  # why an option could not be timed (an unsupported op, out of memory)

    def predicted(self, i: int) -> float | None:
        timing = self.timings[i]
        return None if timing is None else timing.per_env_step(self.options[i].workload, self.env_s)

    def line(self, i: int) -> str:
        option, timing = self.options[i], self.timings[i]
        failure = self.failures[i] if i < len(self.failures) else None
        if failure is not None:
            return f"{option.candidate.label}: failed ({failure})"
        if timing is None:
            return f"{option.candidate.label}: not probed (budget spent)"
        w = option.workload
        plus = " beside " if w.overlapped else " + "
        return (
            f"{option.candidate.label}: {_ms(self.predicted(i))}/env step (train {_ms(timing.train_s)} x "
            f"{w.grads_per_env_step:.3g}{plus}infer {_ms(timing.infer_s)} / {w.n_envs})"
        )

    def versus(self, differs: Callable[[Candidate], bool]) -> str | None:
        """The chosen option against the best timed option that differs from it as ``differs`` says, in one phrase
        (None: no such option)."""
        mine = self.predicted(self.chosen)
        others = [i for i, t in enumerate(self.timings) if t is not None and differs(self.options[i].candidate)]
        if not others:
            return None
        best = min(others, key=lambda i: self.predicted(i) or float("inf"))
        return (
            f"probe: {_ms(mine)}/env step vs {self.options[best].candidate.label} {_ms(self.predicted(best))}"
            f" (env {_ms(self.env_s)})"
        )

    def lines(self) -> list[str]:
        return [self.summary(), *map(self.line, range(len(self.options)))]

    def summary(self) -> str:
        probed = sum(t is not None for t in self.timings)
        cached = sum(t is not None and t.cached for t in self.timings)
        return f"{probed} of {len(self.options)} candidates timed in {self.seconds:.1f} s ({cached} from the cache)"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms"


# --------------------------------------------------------------------------- measuring one option
Measure = Callable[[Option, float], Timing]


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = th.get_num_threads()
    th.set_num_threads(n)
    try:
        yield
    finally:
        th.set_num_threads(before)


@contextlib.contextmanager
def _cuda_flags(device: th.device, cudnn_benchmark: bool, tf32: bool) -> Iterator[None]:
    """The CUDA math flags the plan would set for the run (process-wide, so put back afterwards)."""
    if device.type != "cuda":
        yield
        return
    before = TorchSettings.current()
    before.with_cuda_math(tf32, cudnn_benchmark).apply()
    try:
        yield
    finally:
        before.apply()


def _autocast(device: th.device, amp: str) -> contextlib.AbstractContextManager[Any]:
    if amp == "off":
        return contextlib.nullcontext()
    return th.autocast(device_type=device.type, dtype=th.bfloat16 if amp == "bf16" else th.float16)


def _batch(space: spaces.Space, n: int) -> Any:
    if isinstance(space, spaces.Dict):
        return {k: _batch(s, n) for k, s in space.spaces.items()}
    return np.stack([space.sample() for _ in range(n)])


def measure_option(option: Option, seconds: float) -> Timing:
    """Time ``option`` for about ``seconds``: the policy built at the preset's sizes on the candidate's device."""
    w, c = option.workload, option.candidate
    device = th.device(c.device)
    with _threads(c.threads), _cuda_flags(device, option.cudnn_benchmark, option.tf32), own_rng(device):
        policy = w.policy(device)
        obs, _ = policy.obs_to_tensor(_batch(w.observation_space, w.batch_size))
        rollout_obs = _batch(w.observation_space, w.n_envs)
        step = _train_step(policy, w, obs, device, c.amp)

        def infer() -> None:  # the observation copy in, the forward pass, the action copy out (as collection's)
            with th.no_grad(), _autocast(device, c.amp):
                obs_t = policy.obs_to_tensor(rollout_obs)[0]
                # PPO's rollout runs the whole policy (actions, values, log-probabilities); the others' predict.
                actions = policy(obs_t)[0] if w.algo == "ppo" else policy._predict(obs_t)
            actions.float().cpu().numpy()  # a bf16 head (a probe's plain autocast) cannot go to numpy as it is

        def train() -> None:
            step()
            synchronize(device)

        return Timing(_median_time(train, seconds / 2), _median_time(infer, seconds / 2))


# SB3's off-policy actor-critics (CONTINUOUS_ALGOS): a step descends SAC's and TQC's entropy coefficient, the critics,
# then the actor, and moves the target networks. Timed at every step whatever the run's schedule: TD3's actor and
# targets (every second step in its run), SAC's targets (its target_update_interval), the entropy step (also where
# the run fixes ent_coef). So the figure is a little above the run's mean step, eager and compiled alike.
_MAX_GRAD_NORM = 10.0  # PPO's clipping (its default is 0.5: the same work)

# One optimizer's part of a gradient step: the optimizer, the loss it descends, the norm its gradients are clipped to.
_Part = tuple[th.optim.Optimizer, Callable[[], th.Tensor], float | None]


def _parts(policy: Any, w: Workload, obs: Any, device: th.device) -> list[_Part]:
    """A gradient step of the algorithm's shape: PPO's three-term loss, the DQN family's online net against its
    target's, or an off-policy actor-critic's entropy coefficient (SAC, TQC), critics against their targets, and actor
    against the critics, with the targets' update."""
    if w.algo == "ppo":
        # As SB3's rollout buffer keeps them: float32, one row of get_action_dim() per sample; Discrete's as indices.
        sampled = _batch(w.action_space, w.batch_size).reshape(w.batch_size, get_action_dim(w.action_space))
        actions = th.as_tensor(sampled, dtype=th.float32, device=device)
        if isinstance(w.action_space, spaces.Discrete):
            actions = actions.long().flatten()

        def loss() -> th.Tensor:
            values, log_prob, entropy = policy.evaluate_actions(obs, actions)
            policy.action_dist.distribution = None  # kept on the policy, it would leave a compiled step's graph
            entropy = entropy if entropy is not None else -log_prob
            return (values.float() ** 2).mean() - log_prob.float().mean() - 0.01 * entropy.float().mean()

        return [(policy.optimizer, loss, _MAX_GRAD_NORM)]
    if w.algo in CONTINUOUS_ALGOS:
        return _actor_critic_parts(policy, w, obs, device)
    online = getattr(policy, "q_net", None) or policy.quantile_net
    target = getattr(policy, "q_net_target", None) or policy.quantile_net_target

    if w.algo == "qrdqn":  # its quantiles of the batch's actions against the target's of the greedy ones
        actions = th.as_tensor(_batch(w.action_space, w.batch_size), device=device).long().reshape(-1, 1, 1)

        def quantile_loss() -> th.Tensor:
            with th.no_grad():
                next_quantiles = target(obs).float()
                greedy = next_quantiles.mean(dim=1, keepdim=True).argmax(dim=2, keepdim=True)
                goal = next_quantiles.gather(2, greedy.expand(-1, next_quantiles.shape[1], 1)).squeeze(2)
            quantiles = online(obs).float()
            current = quantiles.gather(2, actions.expand(-1, quantiles.shape[1], 1)).squeeze(2)
            return quantile_huber(current, goal).sum(dim=-1).mean()

        return [(policy.optimizer, quantile_loss, w.max_grad_norm)]

    def q_loss() -> th.Tensor:
        with th.no_grad():
            goal = target(obs).float().amax(dim=-1, keepdim=True)
        return ((online(obs).float() - goal) ** 2).mean()

    return [(policy.optimizer, q_loss, w.max_grad_norm)]


def _reads(value: float | None) -> Callable[[], float | None]:
    return lambda: value


def _actor_critic_parts(policy: Any, w: Workload, obs: Any, device: th.device) -> list[_Part]:
    actions = th.as_tensor(_batch(w.action_space, w.batch_size), device=device, dtype=th.float32)
    actions = actions.reshape(w.batch_size, -1)  # flat, as SB3's actors and buffers keep a Box of several dimensions
    eps = th.randn(actions.shape, device=device)  # SAC's and TQC's draw, made outside the step as theirs is
    actor, critic, critic_target = policy.actor, policy.critic, policy.critic_target
    actor_target = getattr(policy, "actor_target", None)
    if w.use_sde:  # the standard normal draw behind the exploration matrix, scaled by the actor's std in the step
        mat_eps = th.randn_like(actor.action_dist.get_std(actor.log_std).detach())

    def act(net: Any, o: Any) -> tuple[th.Tensor, th.Tensor]:
        if w.use_sde:  # as the run's step samples under gSDE: the matrix reaches log_std through the actor's loss
            return sde_sample(net, o, mat_eps * net.action_dist.get_std(net.log_std))
        if hasattr(net, "latent_pi"):  # a squashed Gaussian, sampled with its log-probability
            return squashed_sample(net, o, eps)
        return net(o), th.zeros((), device=device)

    def values(out: Any) -> th.Tensor:  # SAC's and TD3's critics give a tuple of Q-values, TQC's a quantile tensor
        return th.cat(out, dim=1) if isinstance(out, tuple) else out.flatten(1)

    def critic_loss() -> th.Tensor:
        with th.no_grad():
            next_actions, log_prob = act(actor_target if actor_target is not None else actor, obs)
            entropy = 0.1 * log_prob.reshape(-1, 1)
            if w.algo == "tqc":  # the sorted target quantiles less the top ones of each critic
                kept = critic.quantiles_total - w.top_quantiles_to_drop_per_net * critic.n_critics
                goal = th.sort(values(critic_target(obs, next_actions)))[0][:, :kept] - entropy
            else:
                goal = values(critic_target(obs, next_actions)).amin(dim=1, keepdim=True) - entropy
        if w.algo == "tqc":  # every current quantile against every target one: most of TQC's step
            return quantile_huber_mean(critic(obs, actions), goal.unsqueeze(1))
        return ((values(critic(obs, actions)) - goal) ** 2).mean()

    pairs = [(list(critic.parameters()), list(critic_target.parameters()))]
    if actor_target is not None:
        pairs.append((list(actor.parameters()), list(actor_target.parameters())))

    def actor_loss() -> th.Tensor:
        new_actions, log_prob = act(actor, obs)
        # The targets' polyak update: the run makes it after the actor's step, outside autocast; here, for timing
        # only, inside the actor's part (the same ops under no_grad, where autocast changes nothing).
        for params, targets in pairs:
            polyak(params, targets, 0.005)
        if actor_target is not None:  # TD3's actor climbs its first critic only
            return -critic.q1_forward(obs, new_actions).mean()
        return (0.1 * log_prob).mean() - values(critic(obs, new_actions)).mean()

    parts: list[_Part] = [(critic.optimizer, critic_loss, None), (actor.optimizer, actor_loss, None)]
    if actor_target is None:  # SAC's and TQC's entropy coefficient: one scalar, with an Adam of its own, stepped first
        log_ent_coef = th.zeros(1, device=device, requires_grad=True)
        fused = actor.optimizer.defaults.get("fused")
        entropy_optimizer = th.optim.Adam([log_ent_coef], lr=1e-4, fused=fused)
        entropy_error = th.randn(w.batch_size, 1, device=device)  # the run's (log_prob + target_entropy), detached

        def entropy_loss() -> th.Tensor:
            return -(log_ent_coef * entropy_error).mean()

        parts.insert(0, (entropy_optimizer, entropy_loss, None))
    return parts


def _train_step(policy: Any, w: Workload, obs: Any, device: th.device, amp: str) -> Callable[[], None]:
    parts = _parts(policy, w, obs, device)

    def step() -> None:
        for optimizer, loss, max_grad_norm in parts:
            with _autocast(device, amp):
                value = loss()
            optimizer.zero_grad()
            value.backward()
            if max_grad_norm is not None:
                th.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_grad_norm)
            optimizer.step()

    return step


def measure_compile(option: Option, mode: str, seconds: float = 1.0) -> CompileTiming:
    """Time ``option``'s gradient step eager and compiled whole with torch.compile's ``mode``, and collection's
    forward pass at ``n_envs`` eager and compiled, with the time compiling both took; raises where the step does not
    compile (the run would fall back to eager)."""
    w, c = option.workload, option.candidate
    device = th.device(c.device)
    # Argument checks off, as the run's compiled step has them: dynamo turns them off only at a process's first
    # compile, and a distribution checked inside the graph would not compile.
    with (
        _threads(c.threads),
        _cuda_flags(device, option.cudnn_benchmark, option.tf32),
        no_argument_checks(),
        own_rng(device),
    ):
        policy = w.policy(device)
        python_int_spaces(policy)  # as the run's networks have them: QR-DQN's reshape by a NumPy int broke the graph
        obs, _ = policy.obs_to_tensor(_batch(w.observation_space, w.batch_size))
        eager = _train_step(policy, w, obs, device, c.amp)

        def train() -> None:
            eager()
            synchronize(device)

        for _ in range(2):  # warm-up
            train()
        parts = _parts(policy, w, obs, device)
        names = {id(p): name for name, p in policy.named_parameters()}
        # As the run's steps: the DQN family and PPO read their clipping norm (None: no bound), SAC's kind never clips.
        clipping = [None if w.algo in CONTINUOUS_ALGOS else _reads(norm) for _, _, norm in parts]
        descents = [Descent(opt, OptimizerStep(opt, names), clip) for (opt, _, _), clip in zip(parts, clipping, strict=True)]

        def update() -> tuple[th.Tensor, ...]:
            losses = []
            for (_, loss, _), descent in zip(parts, descents, strict=True):
                with _autocast(device, c.amp):
                    value = loss()
                descent(value)
                losses.append(value)
            return tuple(losses)

        step = CompiledUpdate(update, descents, mode)

        def compiled() -> None:
            step()
            synchronize(device)

        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileFallbackWarning)  # a fallback times eager code: not a candidate
            start = time.perf_counter()
            for _ in range(3):  # tracing and compiling, then (CUDA graph modes) recording the graph
                compiled()
            compile_s = time.perf_counter() - start
            eager_s, compiled_s = _paired_medians(train, compiled, seconds / 2)
        # The run may compile its rollout forward pass too, timed apart: a compiled pass over a few observations
        # can be slower than eager on a CPU (its guards cost more than the ops it fuses), and collection runs it at
        # every vec step. Where that pass does not compile, the run collects with it eager, and the step's figures
        # stand.
        forward = _forward(policy, w)
        # Its own code object: dynamo's recompile limit (8) counts per code object, and a process that probes many
        # policies (tune's trials) would otherwise reach it and time a pass that "did not compile".
        act = th.compile(own_code(forward), fullgraph=True, mode=None if mode == "default" else mode)
        rollout_obs, _ = policy.obs_to_tensor(_batch(w.observation_space, w.n_envs))
        # SAC's and TQC's standard normal draw, made outside the graph as their runs make it.
        sampled = w.algo in ("sac", "tqc") and not w.use_sde
        draws = [th.randn(w.n_envs, get_action_dim(w.action_space), device=device)] if sampled else []

        def timed(fn: Callable[..., Any]) -> Callable[[], None]:
            def run() -> None:
                with th.no_grad(), _autocast(device, c.amp):
                    fn(rollout_obs, *draws)
                synchronize(device)

            return run

        act_eager_s = act_compiled_s = _median_time(timed(forward), seconds / 4)
        act_compile_s, act_failed = 0.0, False
        start = time.perf_counter()
        # Under gSDE collection's actions come from the exploration matrix SB3 keeps: its pass stays SB3's, eager.
        try:
            if not w.use_sde:
                for _ in range(3):
                    timed(act)()
                act_compile_s = time.perf_counter() - start
                act_eager_s, act_compiled_s = _paired_medians(timed(forward), timed(act), seconds / 4)
        except Exception:  # torch.compile fails in many ways (graph breaks, backend errors)
            th._dynamo.reset()
            act_failed = True
    return CompileTiming(eager_s, compiled_s, compile_s, act_eager_s, act_compiled_s, act_compile_s, act_failed)


def _forward(policy: Any, w: Workload) -> Callable[..., Any]:
    """The policy's forward pass at collection: PPO's actions, values and log-probabilities, the Q-values, or an
    actor-critic's exploring actions (SAC's and TQC's on their draw)."""
    if w.algo in ("sac", "tqc") and w.use_sde:
        return lambda obs: policy.actor(obs)  # SB3's: the noise of the exploration matrix it keeps
    if w.algo in ("sac", "tqc"):
        return lambda obs, eps: squashed_sample(policy.actor, obs, eps)[0]
    if w.algo == "td3":
        return policy.actor.forward
    if w.algo == "ppo":

        def forward(obs: th.Tensor) -> Any:
            out = type(policy).forward(policy, obs)
            policy.action_dist.distribution = None  # kept on the policy, it would leave the graph
            return out

        return forward
    return (getattr(policy, "q_net", None) or policy.quantile_net).forward


def _paired_medians(
    a: Callable[[], None], b: Callable[[], None], seconds: float, max_repeats: int = 15
) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, called in turns until ``seconds`` are spent (at least once each), so that
    both see the same load: timed one after the other, a busy spell on shared cores can land on one alone."""
    times: tuple[list[float], list[float]] = ([], [])
    end = time.perf_counter() + seconds
    while not times[0] or (len(times[0]) < max_repeats and time.perf_counter() < end):
        for fn, spent in zip((a, b), times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _median_time(fn: Callable[[], None], seconds: float, warmup: int = 2, max_repeats: int = 15) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls, repeated until ``seconds`` are spent (at least once)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while not times or (len(times) < max_repeats and time.perf_counter() < end):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------- the cache
def cache_dir() -> Path:
    """``$SB3_GPU_CACHE_DIR``, else ``$XDG_CACHE_HOME/sb3_gpu``, else ``~/.cache/sb3_gpu``."""
    if os.environ.get("SB3_GPU_CACHE_DIR"):
        return Path(os.environ["SB3_GPU_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sb3_gpu"


@dataclass
class ProbeCache:
    """Probe figures in one JSON file, keyed by machine, torch version, workload, candidate and free cores. A file
    that cannot be read is ignored with a :class:`ProbeCacheWarning` and replaced on the next write."""

    path: Path = field(default_factory=lambda: cache_dir() / "probes.json")
    _entries: dict[str, dict[str, float]] | None = None

    def _load(self) -> dict[str, dict[str, float]]:
        if self._entries is None:
            self._entries = {}
            try:
                data = json.loads(self.path.read_text())
                if not (isinstance(data, dict) and data.get("version") == CACHE_VERSION):
                    raise ValueError(f"not a version {CACHE_VERSION} probe cache")
                entries = data["entries"]
                for key, value in entries.items():
                    if not (isinstance(value, dict) and value and all(isinstance(v, float) for v in value.values())):
                        raise ValueError(f"entry {key[:60]!r} is malformed")
                self._entries = entries
            except FileNotFoundError:
                pass
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                warn(f"ignoring the probe cache {self.path} ({e}); probing again", ProbeCacheWarning)
        return self._entries

    def get(self, key: str) -> Timing | None:
        entry = self._entry(key, ("train_s", "infer_s"))
        return None if entry is None else Timing(entry["train_s"], entry["infer_s"], cached=True)

    def put(self, key: str, timing: Timing) -> None:
        self._put(key, {"train_s": float(timing.train_s), "infer_s": float(timing.infer_s)})

    def get_compile(self, key: str) -> CompileTiming | None:
        entry = self._entry(key, _COMPILE_FIELDS)  # an entry without the forward pass's figures is timed again
        if entry is None:
            return None
        e = entry  # short: one line per field
        return CompileTiming(
            e["eager_s"],
            e["compiled_s"],
            e["compile_s"],
            e["act_eager_s"],
            e["act_compiled_s"],
            e["act_compile_s"],
            bool(e["act_failed"]),  # stored as 0.0 or 1.0
            cached=True,
        )

    def put_compile(self, key: str, timing: CompileTiming) -> None:
        self._put(key, {k: float(getattr(timing, k)) for k in _COMPILE_FIELDS})

    def put_failure(self, key: str) -> None:
        self._put(key, {"failed": 1.0})

    def failed(self, key: str) -> bool:
        return self._entry(key, ("failed",)) is not None

    def _entry(self, key: str, fields: tuple[str, ...]) -> dict[str, float] | None:
        entry = self._load().get(_digest(key))
        return entry if entry is not None and all(k in entry for k in fields) else None

    def _put(self, key: str, entry: dict[str, float]) -> None:
        self._load()[_digest(key)] = entry
        try:
            atomic_write_text(self.path, json.dumps({"version": CACHE_VERSION, "entries": self._entries}))
        except OSError as e:  # a read-only home, say: the figures still serve this plan
            warn(f"could not write the probe cache {self.path} ({e})", ProbeCacheWarning)


# compile_s was the step's and the forward pass's together before act_compile_s: such entries are timed again.
_COMPILE_FIELDS = ("eager_s", "compiled_s", "compile_s", "act_eager_s", "act_compiled_s", "act_compile_s", "act_failed")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- choosing
def device_usable(device: str) -> bool:
    """Whether torch can run on ``device`` in this process."""
    if device.startswith("cuda"):
        return th.cuda.is_available()
    if device == "mps":
        return bool(getattr(th.backends, "mps", None) and th.backends.mps.is_available())
    return device == "cpu"


def _passing(e: Exception) -> bool:
    """Whether a compile failed on this machine's state rather than on the step, so that the next plan should try
    again: a kernel of inductor's cache that would not load (a process killed while writing it leaves it half
    written), or a full disk. A missing compiler or a read-only cache would fail every time, and is remembered."""
    loading = cause_of(e, ImportError)
    if loading is not None and _inductor_cache() in str(loading):
        return True
    if cause_of(e, th.cuda.OutOfMemoryError) is not None or cause_of(e, BrokenProcessPool) is not None:
        return True  # another process held the GPU's memory; inductor's compile workers died (killed, say)
    written = cause_of(e, OSError)
    return written is not None and out_of_space(written)


def _inductor_cache() -> str:
    try:  # a private helper of torch's: its folder follows TORCHINDUCTOR_CACHE_DIR
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        return str(inductor_cache_dir())
    except Exception:  # its default folder's name otherwise
        return "torchinductor_"


@dataclass
class Prober:
    """Times options (``measure``), within ``budget_s`` per plan, through ``cache`` (None: no cache); ``usable`` says
    which devices can be timed here; ``announce`` tells the user before a compiled step is timed (None: silent)."""

    measure: Measure = measure_option
    cache: ProbeCache | None = field(default_factory=ProbeCache)
    budget_s: float = PROBE_BUDGET_S
    context: str = ""  # the machine and its free cores: part of every cache key
    usable: Callable[[str], bool] = device_usable
    measure_compile: Callable[[Option, str], CompileTiming] = measure_compile
    announce: Callable[[str], None] | None = field(default=lambda line: print(line, file=sys.stderr, flush=True), repr=False)
    _compile_figures: ProbeCache | None = field(default=None, repr=False)

    def probe(self, options: Sequence[Option], rule: int, env_s: float) -> ProbeResult:
        """Time ``options`` (the rules' choice, ``options[rule]``, first) and choose among them."""
        start = time.perf_counter()
        order = [rule, *(i for i in range(len(options)) if i != rule)]
        timings: list[Timing | None] = [None] * len(options)
        failures: list[str | None] = [None] * len(options)
        fresh = [i for i in order if not self._cached(options[i], timings, i)]
        for n, i in enumerate(fresh):
            left = self.budget_s - (time.perf_counter() - start)
            if left <= 0 and i != rule:
                continue  # the rules' choice is always timed, so that there is something to compare with
            seconds = max(left, 0.0) / (len(fresh) - n)
            try:
                timings[i] = self.measure(options[i], max(seconds, 0.02))
            except Exception as e:  # an op the precision lacks, out of memory, ...: not a candidate, and said why
                failures[i] = named(e, 120)
                continue
            if self.cache is not None and seconds >= MIN_CACHED_S:  # figures from a starved budget are not kept
                self.cache.put(self._key(options[i]), timings[i])  # type: ignore[arg-type]
        result = ProbeResult(tuple(options), tuple(timings), rule, rule, env_s, time.perf_counter() - start, tuple(failures))
        return dataclasses.replace(result, chosen=_choose(result))

    def time_compile(self, option: Option, mode: str) -> CompileTiming:
        """``option``'s gradient step eager and compiled with ``mode`` (through the cache; not bounded by the budget,
        since compiling takes what it takes); raises where the step does not compile (and, from the cache, where it
        did not compile before)."""
        key = f"{self._key(option)} | compiled {mode}"
        cache = self._compile_cache()
        if cache is not None and cache.failed(key):
            raise RuntimeError(f"it failed on this machine before (remove {cache.path} to try again)")
        cached = cache.get_compile(key) if cache is not None else None
        if cached is not None:
            return cached
        if self.announce is not None:  # compiling takes seconds on a GPU, a minute on a CPU: not a hang
            self.announce(
                f"sb3_gpu: timing the compiled gradient step on {option.candidate.label} (cached for the next plan; "
                "compile=false skips it)"
            )
        try:
            timing = self.measure_compile(option, mode)
        except Exception as e:
            if cache is not None and not _passing(e):
                cache.put_failure(key)
            raise
        if cache is not None:
            cache.put_compile(key, timing)
        return timing

    def _compile_cache(self) -> ProbeCache | None:
        """Compile figures, in a file of their own beside the cache (so that an older sb3_gpu, which reads only the
        device figures, keeps reading its file)."""
        if self.cache is None:
            return None
        if self._compile_figures is None or self._compile_figures.path.parent != self.cache.path.parent:
            self._compile_figures = ProbeCache(self.cache.path.with_name("compile-probes.json"))
        return self._compile_figures

    def _cached(self, option: Option, timings: list[Timing | None], i: int) -> bool:
        timing = self.cache.get(self._key(option)) if self.cache is not None else None
        timings[i] = timing
        return timing is not None

    def _key(self, option: Option) -> str:
        versions = f"torch {th.__version__}, {_library_versions()}"
        return f"{self.context} | {versions} | {option.workload.key} | {option.candidate.label}"


def _library_versions() -> str:
    """SB3's and sb3_gpu's versions: with torch's, what the timed code is (a new release of any times afresh)."""
    import stable_baselines3

    return f"SB3 {stable_baselines3.__version__}, sb3_gpu {__version__}"


def _choose(result: ProbeResult) -> int:
    """The rules' choice unless another is predicted faster than MARGIN x it, then the fastest of those (the rules'
    device and precision first among near-ties); in doubt, the rules' device and precision with the fewest threads
    that are as fast as the best within MARGIN."""
    predicted = {i: p for i in range(len(result.options)) if (p := result.predicted(i)) is not None}
    if result.rule not in predicted:  # it failed to run here (it is always timed): the fastest that ran, if any
        return min(predicted, key=lambda i: predicted[i]) if predicted else result.rule
    rule, rule_p, best = result.options[result.rule].candidate, predicted[result.rule], min(predicted.values())

    def preference(i: int) -> tuple[bool, bool, int, float]:
        c = result.options[i].candidate
        return c.device != rule.device, c.amp != rule.amp, c.threads, predicted[i]

    if rule_p * MARGIN > best:  # clearly beaten: among the clear winners, those close to the best
        close = [i for i, p in predicted.items() if p <= rule_p * MARGIN and p * MARGIN <= best]
    else:
        close = [i for i, p in predicted.items() if p * MARGIN <= best and not any(preference(i)[:2])]
    return min(close, key=preference)
