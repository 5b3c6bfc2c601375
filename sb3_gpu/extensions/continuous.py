"""SAC, TD3 and TQC whose gradient steps read nothing back from the device, and compile whole.

SB3's ``train()`` for these reads every loss with ``.item()`` at each gradient step: on a GPU the host waits for the
device several times per step. Here the same updates, in the same order and on the same random draws, keep their
logged figures on the device until the logger writes (:class:`~sb3_gpu.extensions.devicelog.DeviceLog`), and the NaN
guard decides on the device where it can. With :meth:`compile_step` a whole gradient step (the sampling from a
device replay buffer, the entropy coefficient's update, the critics', the actor's and the target networks') is one
compiled graph (:class:`~sb3_gpu.extensions.graphstep.CompiledUpdate`), which CUDA replays as a CUDA graph; so is
the action forward pass of collection, one small graph per env step, where SB3 launches each layer's ops.

The random draws of the step (SAC's reparametrised actions or, under gSDE, its exploration matrix; TD3's target
smoothing noise) are made before it, by the same calls and in the same order as SB3's: so a step on a given batch
equals SB3's, compiled or not (tests pin both). A compiled step that samples inside its graph draws all of a
``train()`` call's batches at once, from other draws than ``sample()``'s: the same seed then picks other transitions.
As the DQN family's, the logged losses are their means over the gradient steps since the last log write (SB3's logger
keeps the last ``train()`` call's).

With ``grad_accum_steps=k`` a gradient step takes k micro-batches of ``batch_size`` and goes in stages, as one step on
their union would: each optimizer's loss is backpropagated on every micro-batch before it steps on their mean gradient
(:meth:`~sb3_gpu.extensions.stepping.OptimizerStep.accumulate`), so the actor's loss reads critics updated on all of
them. Each stage frees a micro-batch's activations before it builds the next one's (the actor samples again in its own
stage, on the same draws); a test pins that k micro-batches step as one batch k times larger.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch as th
import torch.nn.functional as F
from sb3_contrib import TQC
from sb3_contrib.tqc import policies as tqc_policies
from stable_baselines3 import SAC, TD3
from stable_baselines3.common.preprocessing import get_action_dim
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.sac import policies as sac_policies
from stable_baselines3.td3 import policies as td3_policies

from sb3_gpu.common.checks import POS_INT
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.extensions.devicelog import DeviceLog, GraphSums
from sb3_gpu.extensions.graphstep import CompiledFunction, CompiledUpdate, Descent, refusal
from sb3_gpu.extensions.handoff import StagedObservations
from sb3_gpu.extensions.hostreads import no_argument_checks
from sb3_gpu.extensions.networks import narrow_linears
from sb3_gpu.extensions.quantile import quantile_huber_mean
from sb3_gpu.extensions.replay import DeviceReplayBuffer
from sb3_gpu.extensions.stepping import DeviceFigures, optimizer_step, optimizer_steps

# A step's descent of one optimizer, by its position in ``_optimizers()``, on a loss.
Descend = Callable[[int, th.Tensor], None]
# A micro-batch of a gradient step and the step's random draws for it.
Micro = tuple[ReplayBufferSamples, Sequence[th.Tensor]]

_LOG_2PI_HALF = math.log(math.sqrt(2 * math.pi))
_SQUASH_EPSILON = 1e-6  # SB3's SquashedDiagGaussianDistribution's, in the tanh's log-Jacobian


def check_actor_critic_accumulation(grad_accum_steps: Any, use_sde: bool) -> int:
    """``grad_accum_steps`` as an int; more than one is refused beside gSDE (its exploration matrix is drawn once per
    gradient step; micro-batches that share it are not built)."""
    grad_accum_steps = POS_INT(grad_accum_steps, "grad_accum_steps")
    if use_sde and grad_accum_steps > 1:
        raise ConfigError(
            f"grad_accum_steps={grad_accum_steps} is not supported with use_sde=True (gSDE draws one exploration "
            "matrix per gradient step, for one batch); set grad_accum_steps: 1 or use_sde: false"
        )
    return grad_accum_steps


class NormedCritics:
    """A mixin for SB3's SAC, TD3 and TQC policies: a LayerNorm after each hidden layer of the critics and their targets
    (as DroQ's critics have; SB3's have none). SB3's ``_build`` makes the critics through ``make_critic`` and then
    their optimizer, over the new parameters too. A saved model names its policy class, one of those below, so SB3's
    own ``SAC.load`` (``TD3.load``, sb3-contrib's ``TQC.load``) rebuilds these critics wherever sb3_gpu is installed."""

    def make_critic(self, features_extractor: Any = None) -> Any:
        critic = super().make_critic(features_extractor)  # type: ignore[misc]
        # SAC's and TD3's ContinuousCritic and TQC's Critic each hold their networks as q_networks and as qf0, qf1, ...
        for i, net in enumerate(critic.q_networks):
            layers: list[th.nn.Module] = []
            for layer in net[:-1]:
                layers.append(layer)
                if isinstance(layer, th.nn.Linear):
                    layers.append(th.nn.LayerNorm(layer.out_features, device=layer.weight.device))
            normed = th.nn.Sequential(*layers, net[-1])
            setattr(critic, f"qf{i}", normed)
            critic.q_networks[i] = normed
        return critic


# Defined by name (not made in a loop) so that a saved model's policy class is found where a reader looks for it.
class SACMlpPolicyNormedCritics(NormedCritics, sac_policies.MlpPolicy):
    """SAC's MlpPolicy with layer-normed critics."""


class SACCnnPolicyNormedCritics(NormedCritics, sac_policies.CnnPolicy):
    """SAC's CnnPolicy with layer-normed critics."""


class SACMultiInputPolicyNormedCritics(NormedCritics, sac_policies.MultiInputPolicy):
    """SAC's MultiInputPolicy with layer-normed critics."""


class TD3MlpPolicyNormedCritics(NormedCritics, td3_policies.MlpPolicy):
    """TD3's MlpPolicy with layer-normed critics."""


class TD3CnnPolicyNormedCritics(NormedCritics, td3_policies.CnnPolicy):
    """TD3's CnnPolicy with layer-normed critics."""


class TD3MultiInputPolicyNormedCritics(NormedCritics, td3_policies.MultiInputPolicy):
    """TD3's MultiInputPolicy with layer-normed critics."""


class TQCMlpPolicyNormedCritics(NormedCritics, tqc_policies.MlpPolicy):
    """TQC's MlpPolicy with layer-normed critics."""


class TQCCnnPolicyNormedCritics(NormedCritics, tqc_policies.CnnPolicy):
    """TQC's CnnPolicy with layer-normed critics."""


class TQCMultiInputPolicyNormedCritics(NormedCritics, tqc_policies.MultiInputPolicy):
    """TQC's MultiInputPolicy with layer-normed critics."""


_NORMED: dict[type, type] = {
    cls.__bases__[1]: cls
    for cls in (
        *(SACMlpPolicyNormedCritics, SACCnnPolicyNormedCritics, SACMultiInputPolicyNormedCritics),
        *(TD3MlpPolicyNormedCritics, TD3CnnPolicyNormedCritics, TD3MultiInputPolicyNormedCritics),
        *(TQCMlpPolicyNormedCritics, TQCCnnPolicyNormedCritics, TQCMultiInputPolicyNormedCritics),
    )
}


def normed_critics_policy(policy_class: type) -> type:
    """The twin of SB3's SAC, TD3 or TQC policy class with layer-normed critics (``policy_class`` itself if it has
    them); refused for any other class, whose critics this cannot know."""
    if issubclass(policy_class, NormedCritics):
        return policy_class
    twin = _NORMED.get(policy_class)
    if twin is None:
        raise ConfigError(
            f"critic_layer_norm works with SB3's own SAC, TD3 and TQC policies (MlpPolicy, CnnPolicy, MultiInputPolicy), "
            f"not {policy_class.__module__}.{policy_class.__qualname__}; set critic_layer_norm: false"
        )
    return twin


def squashed_sample(actor: Any, observations: th.Tensor, eps: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
    """SB3's ``actor.action_log_prob(observations)`` (no gSDE) with its standard normal draw ``eps`` given: the
    tanh-squashed action and its log-probability, by the same formulas as SB3's and torch's Normal."""
    mean, log_std, _ = actor.get_action_dist_params(observations)
    std = th.ones_like(mean) * log_std.exp()
    gaussian = mean + eps * std
    actions = th.tanh(gaussian)
    log_prob = (-((gaussian - mean) ** 2) / (2 * std**2) - std.log() - _LOG_2PI_HALF).sum(dim=1)
    return actions, log_prob - th.log(1 - actions**2 + _SQUASH_EPSILON).sum(dim=1)


def sde_sample(actor: Any, observations: th.Tensor, exploration_mat: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
    """SB3's ``actor.action_log_prob(observations)`` under gSDE with the exploration matrix given: the action (noise
    from the latent features times the matrix) and its log-probability, by SB3's formulas (the log-probability of the
    squashed action, unsquashed again with SB3's clamp)."""
    dist = actor.action_dist
    mean, log_std, kwargs = actor.get_action_dist_params(observations)
    latent = kwargs["latent_sde"] if dist.learn_features else kwargs["latent_sde"].detach()
    scale = th.sqrt(th.mm(latent**2, dist.get_std(log_std) ** 2) + dist.epsilon)
    gaussian = mean + th.mm(latent, exploration_mat)
    if dist.bijector is None:
        actions, unsquashed = gaussian, gaussian
    else:
        actions = th.tanh(gaussian)
        eps = th.finfo(actions.dtype).eps
        clamped = actions.clamp(min=-1.0 + eps, max=1.0 - eps)
        unsquashed = 0.5 * (clamped.log1p() - (-clamped).log1p())  # SB3's TanhBijector.inverse
    log_prob = (-((unsquashed - mean) ** 2) / (2 * scale**2) - scale.log() - _LOG_2PI_HALF).sum(dim=1)
    if dist.bijector is not None:
        log_prob = log_prob - th.log(1.0 - th.tanh(unsquashed) ** 2 + dist.bijector.epsilon).sum(dim=1)
    return actions, log_prob


def polyak(params: Sequence[th.Tensor], targets: Sequence[th.Tensor], tau: float) -> None:
    """SB3's ``polyak_update``, op for op, also inside a graph."""
    with th.no_grad():
        for param, target in zip(params, targets, strict=True):
            target.mul_(1 - tau)
            target.add_(param, alpha=tau)


class _ActorCriticTraining(DeviceFigures, StagedObservations):
    """``train()`` for SB3's off-policy actor-critics: SB3's updates step for step, with nothing read back from the
    device to log. Subclasses supply the optimizers, the random draws and the update of one gradient step."""

    _device_log: DeviceLog
    _compiled: CompiledUpdate | None
    _compiled_act: CompiledFunction | None
    # compile=... goes through compile_step (the whole gradient step, and the action forward pass of collection),
    # not through compile_policy's compiling of the networks apart.
    compiles_step_only = True

    def __init__(self, *args: Any, grad_accum_steps: int = 1, critic_layer_norm: bool = False, **kwargs: Any):
        self.grad_accum_steps = grad_accum_steps  # read by _setup_model, which SB3's __init__ calls
        self.critic_layer_norm = critic_layer_norm
        super().__init__(*args, **kwargs)

    def _setup_model(self) -> None:
        s: Any = self
        # A loaded model has critic_layer_norm from its saved attributes before this runs; one saved before the policy
        # classes named it has SB3's own policy class, whose twin builds the critics its weights fit.
        if self.critic_layer_norm:
            s.policy_class = normed_critics_policy(s.policy_class)
        self.critic_layer_norm = issubclass(s.policy_class, NormedCritics)
        super()._setup_model()  # type: ignore[misc]
        self.grad_accum_steps = check_actor_critic_accumulation(self.grad_accum_steps, s.use_sde)
        entropy = getattr(s, "ent_coef_optimizer", None)
        fused = bool(s.actor.optimizer.defaults.get("fused"))
        if fused and type(entropy) is th.optim.Adam and not entropy.defaults.get("fused"):
            # SB3 makes it plain; fused as the policy's, the NaN guard skips its steps on the device without a wait.
            s.ent_coef_optimizer = th.optim.Adam([s.log_ent_coef], lr=s.lr_schedule(1), fused=True)
        self._device_log = DeviceLog()
        self._compiled = None
        self._compiled_act = None
        # gSDE: the exploration matrices each gradient step draws (SB3's reset_noise()), written in place so that a
        # compiled step leaves them where the actor's distribution reads them, as SB3's step does.
        self._exploration: tuple[th.Tensor, th.Tensor] | None = None
        if s.use_sde:
            mat = s.actor.action_dist.exploration_mat.detach()
            self._exploration = (th.zeros_like(mat), th.zeros((1, *mat.shape), dtype=mat.dtype, device=mat.device))
        for step in optimizer_steps(s):
            step.defer_checks = True  # dump_logs reads the NaN guard's flags: a fused optimizer skips on the device
            if self.grad_accum_steps > 1:
                step.accumulate(self.grad_accum_steps)

    def _excluded_save_params(self) -> list[str]:
        excluded = ["_device_log", "_compiled", "_compiled_act", "_position", "_fixed_buffer", "_graph_sums", "_exploration"]
        return [*super()._excluded_save_params(), *excluded]  # type: ignore[misc]

    # -- what each algorithm supplies ------------------------------------------------------------------------------

    def _optimizers(self) -> list[th.optim.Optimizer]:
        """The optimizers a gradient step steps, in its order."""
        raise NotImplementedError

    def _draws(self, batch_size: int, actions: th.Tensor | None) -> tuple[th.Tensor, ...]:
        """The step's random draws, as SB3 makes them (``actions``: the sampled batch's, where it is known)."""
        raise NotImplementedError

    def _update(self, descend: Descend, batches: Sequence[Micro], due: bool) -> dict[str, th.Tensor]:
        """One gradient step on ``batches`` (its micro-batches: one, unless gradients accumulate), each optimizer's
        stage on all of them before the next; ``due``: the step updates the actor and targets too (TD3's delay,
        SAC's ``target_update_interval``). Returns the figures to log, by key (means over the micro-batches)."""
        raise NotImplementedError

    def _due(self, gradient_step: int) -> bool:
        raise NotImplementedError

    def _act(self, observations: th.Tensor, *draws: th.Tensor) -> tuple[th.Tensor]:
        """The exploring action of collection, as the policy's ``_predict`` computes it, on ``draws`` made before."""
        raise NotImplementedError

    def _act_draws(self, n: int) -> tuple[th.Tensor, ...]:
        """The random draws of :meth:`_act` for ``n`` observations, as SB3's actor makes them."""
        return ()

    # -- compiling -------------------------------------------------------------------------------------------------

    def compile_step(self, mode: str = "default", collect: bool = True) -> str | None:
        """Run each gradient step as one compiled graph, a CUDA graph on CUDA with ``mode="reduce-overhead"``;
        ``mode="eager"`` runs the same step uncompiled. Returns why the step stays SB3's, or None. With ``collect``
        collection's action forward pass is compiled too (also where an optimizer refuses the step, as PPO's; not
        under gSDE, whose exploration matrix SB3 resamples between env steps), its draws made outside as SB3 makes them.
        Call it again after ``load``."""
        s: Any = self
        # Under gSDE collection's actions come from the matrix SB3 resamples between env steps: its forward stays SB3's.
        self._compiled_act = CompiledFunction(self._act, mode, "action forward pass") if collect and not s.use_sde else None
        for t in self._exploration or ():
            th._dynamo.mark_static_address(t)
        narrow_linears(s.policy)
        observation = s.policy.obs_to_tensor(s.observation_space.sample())[0]
        guards = [(optimizer, optimizer_step(optimizer, s.policy)) for optimizer in self._optimizers()]
        for optimizer, guard in guards:  # all checked before any is changed
            reason = refusal(optimizer, guard, observation)
            if reason is not None:
                return reason
        descents = [Descent(optimizer, guard, None) for optimizer, guard in guards]
        siblings = [self._compiled_act] if self._compiled_act is not None else []
        self._compiled = CompiledUpdate(self._graph_update, descents, mode, siblings=siblings)
        self._graph_sums = GraphSums(self._log_keys(True), s.device)
        self._position = th.zeros(2, dtype=th.long, device=s.device)
        th._dynamo.mark_static_address(self._position)
        self._fixed_buffer: Any = None
        return None

    def _graph_update(self, due: bool, source: str, *inputs: Any) -> tuple[th.Tensor, ...]:
        """The compiled step, by ``source``: ``batch`` (``data, *draws``: a batch sampled before) or ``uniform``
        (``draws, position, *draws``: the batch a uniform device buffer picks, sampled inside the graph)."""
        s: Any = self
        if source == "uniform":
            picks, position, *draws = inputs
            data = s.replay_buffer.samples_at_draws(picks, position)
        else:
            data, *draws = inputs
        descents = self._compiled.descents if self._compiled is not None else []

        def descend(i: int, loss: th.Tensor) -> None:
            descents[i](loss)

        # Logged inside the graph: no outputs to copy out of a CUDA graph, nor to add up after it.
        self._graph_sums.add(self._update(descend, [(data, draws)], due))
        return ()

    def _fix_buffer(self, buffer: Any) -> None:
        """Fix the addresses of what the compiled step samples from, so that a CUDA graph reads them in place."""
        if buffer is not self._fixed_buffer:
            for t in buffer.storage():
                th._dynamo.mark_static_address(t)
            self._fixed_buffer = buffer

    # -- training --------------------------------------------------------------------------------------------------

    def collect_rollouts(self, *args: Any, **kwargs: Any) -> Any:
        with no_argument_checks():  # building each step's action distribution would read it back twice
            return super().collect_rollouts(*args, **kwargs)  # type: ignore[misc]

    def _sample_action(self, *args: Any, **kwargs: Any) -> Any:
        # The exploring action's forward pass, compiled, where SB3's predict calls the policy's _predict; any other
        # predict (an evaluation callback's, the user's) stays the policy's own.
        policy: Any = self.policy  # type: ignore[attr-defined]
        if self._compiled_act is None:
            return super()._sample_action(*args, **kwargs)
        shadowed = vars(policy).get("_predict")
        policy._predict = self._compiled_predict
        try:
            return super()._sample_action(*args, **kwargs)
        finally:
            if shadowed is None:
                del policy._predict
            else:
                policy._predict = shadowed

    def _compiled_predict(self, observation: th.Tensor, deterministic: bool = False) -> th.Tensor:
        assert self._compiled_act is not None
        if deterministic:  # collection explores; a deterministic call is not collection's
            policy: Any = self.policy  # type: ignore[attr-defined]
            return type(policy)._predict(policy, observation, deterministic)
        first = next(iter(observation.values())) if isinstance(observation, dict) else observation
        return self._compiled_act(observation, *self._act_draws(len(first)))[0]

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        s: Any = self
        s.policy.set_training_mode(True)
        optimizers = self._optimizers()
        s._update_learning_rate(optimizers)
        compiled = self._compiled if self._compiled is not None and self._compiled.usable() else None
        buffer, env = s.replay_buffer, s._vec_normalize_env
        in_graph = compiled is not None and type(buffer) is DeviceReplayBuffer and buffer.samples_in_graph(env)
        if in_graph:
            self._fix_buffer(buffer)
            buffer.fill_position(self._position)
            picks = buffer.draws(batch_size, gradient_steps)  # every step's batch with one op, from the buffer's generator
        for gradient_step in range(gradient_steps):
            due = self._due(gradient_step)
            if compiled is not None and in_graph:  # the step's own draws, as SB3 makes them, then one graph
                draws = self._draws(batch_size, None)
                compiled(due, "uniform", picks[gradient_step], self._position, *draws, stepping=self._stepping(due))
                continue
            batches: list[Micro] = []
            for _ in range(self.grad_accum_steps):  # a compiled step is refused while gradients accumulate
                data = buffer.sample(batch_size, env=env)
                batches.append((data, self._draws(batch_size, data.actions)))
            if compiled is not None:
                data, micro_draws = batches[0]
                compiled(due, "batch", data, *micro_draws, stepping=self._stepping(due))
                continue

            def descend(i: int, loss: th.Tensor) -> None:  # the wrapped step holds back all but a window's last
                optimizers[i].zero_grad()
                loss.backward()
                optimizers[i].step()

            for key, value in self._update(descend, batches, due).items():
                self._device_log.mean(key, value)
        if compiled is not None:
            self._device_log.take(self._graph_sums)
        if self._exploration is not None and gradient_steps > 0:  # the last step's, as SB3's reset_noise() leaves them
            # Copies: the next step writes into the buffers, and a matrix the actor was given must not change under it.
            dist = s.actor.action_dist
            dist.exploration_mat, dist.exploration_matrices = (t.clone() for t in self._exploration)
        s._n_updates += gradient_steps
        s.logger.record("train/n_updates", s._n_updates, exclude="tensorboard")

    def _log_keys(self, due: bool) -> list[str]:
        """The keys of the figures :meth:`_update` returns."""
        raise NotImplementedError

    def _stepping(self, due: bool) -> list[int]:
        """The positions (in ``_optimizers()``) of the optimizers a step takes."""
        return list(range(len(self._optimizers())))


class _EntropyRegularised(_ActorCriticTraining):
    """SAC's and TQC's step: the entropy coefficient's update, the critics', the actor's, and the target critics'."""

    def _optimizers(self) -> list[th.optim.Optimizer]:
        s: Any = self
        entropy = [s.ent_coef_optimizer] if s.ent_coef_optimizer is not None else []
        return [*entropy, s.critic.optimizer, s.actor.optimizer]

    def _draws(self, batch_size: int, actions: th.Tensor | None) -> tuple[th.Tensor, ...]:
        # As Normal.rsample draws them: for the batch's observations, then for the next ones. Under gSDE, as SB3's
        # reset_noise() draws them before the step: the exploration matrix, then the batch of one it keeps beside.
        if self._exploration is not None:
            mat, matrices = self._exploration
            return tuple(th.empty(m.shape, dtype=m.dtype, device=m.device).normal_() for m in (mat, matrices))
        return (*self._act_draws(batch_size), *self._act_draws(batch_size))

    def _samplers(self, draws: Sequence[th.Tensor]) -> tuple[Callable[[th.Tensor], tuple[th.Tensor, th.Tensor]], ...]:
        """The actor's sample on the batch's observations and on the next ones, with this step's draws."""
        s: Any = self
        if self._exploration is None:
            return (lambda obs: squashed_sample(s.actor, obs, draws[0]), lambda obs: squashed_sample(s.actor, obs, draws[1]))
        std = s.actor.action_dist.get_std(s.actor.log_std)
        exploration = draws[0] * std  # Normal(0, std).rsample(): the actor's loss reaches log_std through it
        with th.no_grad():
            self._exploration[0].copy_(exploration)
            self._exploration[1].copy_(draws[1] * std)
        return (lambda obs: sde_sample(s.actor, obs, exploration),) * 2

    def _due(self, gradient_step: int) -> bool:
        return gradient_step % self.target_update_interval == 0  # type: ignore[attr-defined]

    def _act(self, observations: th.Tensor, *draws: th.Tensor) -> tuple[th.Tensor]:
        return (squashed_sample(self.actor, observations, draws[0])[0],)  # type: ignore[attr-defined]

    def _act_draws(self, n: int) -> tuple[th.Tensor, ...]:
        # As Normal.rsample draws them in the actor's forward pass (not under gSDE, whose collection stays SB3's); flat, as the
        # actor's and the buffer's actions.
        s: Any = self
        return (th.empty((n, get_action_dim(s.action_space)), device=s.device).normal_(),)

    def _log_keys(self, due: bool) -> list[str]:
        entropy = ["train/ent_coef_loss"] if self.ent_coef_optimizer is not None else []  # type: ignore[attr-defined]
        return [*entropy, "train/ent_coef", "train/critic_loss", "train/actor_loss"]

    def _target_q(self, data: ReplayBufferSamples, next_actions: th.Tensor, entropy_term: th.Tensor) -> th.Tensor:
        """The critics' regression target (no gradient); ``entropy_term`` is ``ent_coef * log_prob`` of the next
        actions."""
        raise NotImplementedError

    def _critic_loss(self, data: ReplayBufferSamples, target: th.Tensor) -> th.Tensor:
        raise NotImplementedError

    def _actor_q(self, observations: th.Tensor, actions: th.Tensor) -> th.Tensor:
        """The Q-value the actor's loss maximises, shape (batch, 1)."""
        raise NotImplementedError

    def _update(self, descend: Descend, batches: Sequence[Micro], due: bool) -> dict[str, th.Tensor]:
        s: Any = self
        figures: dict[str, th.Tensor] = {}
        # One batch: the actor's sample serves the entropy stage and its own, as in SB3's step. Several: each stage
        # samples again on the same draws (the actor does not move between them), so that one micro-batch's graph at
        # most is alive at a time: the memory accumulation is for, at the cost of one forward pass per micro-batch.
        samplers = [self._samplers(draws) for _, draws in batches]
        kept = [samplers[0][0](batches[0][0].observations)] if len(batches) == 1 else []

        def actor_sample(i: int) -> tuple[th.Tensor, th.Tensor]:
            return kept[i] if kept else samplers[i][0](batches[i][0].observations)

        position = 0
        if s.ent_coef_optimizer is not None:
            ent_coef = th.exp(s.log_ent_coef.detach())
            # Detached: the entropy coefficient's loss must not move the actor (SB3's note, after softlearning's).
            losses = []
            for i in range(len(batches)):
                with contextlib.nullcontext() if kept else th.no_grad():  # this loss detaches it: no graph to keep
                    log_prob = actor_sample(i)[1].reshape(-1, 1)
                losses.append(-(s.log_ent_coef * (log_prob + s.target_entropy).detach()).mean())
                descend(0, losses[-1])
            figures["train/ent_coef_loss"] = _mean(losses)
            position = 1
        else:
            ent_coef = s.ent_coef_tensor
        figures["train/ent_coef"] = ent_coef.reshape(())
        losses = []
        for (data, _), (_, next_sample) in zip(batches, samplers, strict=True):
            with th.no_grad():
                next_actions, next_log_prob = next_sample(data.next_observations)
                target = self._target_q(data, next_actions, ent_coef * next_log_prob.reshape(-1, 1))
            losses.append(self._critic_loss(data, target))
            descend(position, losses[-1])  # at once: each micro-batch's graph is freed before the next is built
        figures["train/critic_loss"] = _mean(losses)
        losses = []
        for i, (data, _) in enumerate(batches):
            actions_pi, log_prob = actor_sample(i)
            losses.append((ent_coef * log_prob.reshape(-1, 1) - self._actor_q(data.observations, actions_pi)).mean())
            descend(position + 1, losses[-1])
        figures["train/actor_loss"] = _mean(losses)
        if due:
            polyak(list(s.critic.parameters()), list(s.critic_target.parameters()), s.tau)
            polyak(s.batch_norm_stats, s.batch_norm_stats_target, 1.0)  # running stats: copied (SB3's issue 996)
        return figures


def _mean(losses: Sequence[th.Tensor]) -> th.Tensor:
    """The logged figure of a stage: its loss, or their mean over micro-batches."""
    return losses[0] if len(losses) == 1 else th.stack([loss.detach() for loss in losses]).mean()


def _discounts(data: ReplayBufferSamples, gamma: float) -> th.Tensor | float:
    return data.discounts if data.discounts is not None else gamma


class SyncFreeSAC(_EntropyRegularised, SAC):
    """SB3's SAC whose gradient steps read nothing back from the device, and compile whole (:meth:`compile_step`)."""

    def _target_q(self, data: ReplayBufferSamples, next_actions: th.Tensor, entropy_term: th.Tensor) -> th.Tensor:
        next_q, _ = th.min(th.cat(self.critic_target(data.next_observations, next_actions), dim=1), dim=1, keepdim=True)
        return data.rewards + (1 - data.dones) * _discounts(data, self.gamma) * (next_q - entropy_term)

    def _critic_loss(self, data: ReplayBufferSamples, target: th.Tensor) -> th.Tensor:
        current = self.critic(data.observations, data.actions)
        return 0.5 * sum(F.mse_loss(q, target) for q in current)  # type: ignore[return-value]

    def _actor_q(self, observations: th.Tensor, actions: th.Tensor) -> th.Tensor:
        min_q, _ = th.min(th.cat(self.critic(observations, actions), dim=1), dim=1, keepdim=True)
        return min_q


class SyncFreeTQC(_EntropyRegularised, TQC):
    """sb3-contrib's TQC with SyncFreeSAC's step: nothing read back from the device, compiled whole where asked."""

    def _target_q(self, data: ReplayBufferSamples, next_actions: th.Tensor, entropy_term: th.Tensor) -> th.Tensor:
        next_quantiles = self.critic_target(data.next_observations, next_actions)
        n_target = self.critic.quantiles_total - self.top_quantiles_to_drop_per_net * self.critic.n_critics
        next_quantiles, _ = th.sort(next_quantiles.reshape(next_quantiles.shape[0], -1))
        target = next_quantiles[:, :n_target] - entropy_term
        return (data.rewards + (1 - data.dones) * _discounts(data, self.gamma) * target).unsqueeze(dim=1)

    def _critic_loss(self, data: ReplayBufferSamples, target: th.Tensor) -> th.Tensor:
        # sb3-contrib's quantile_huber_loss(sum_over_quantiles=False), its gradient made in the forward pass when eager
        return quantile_huber_mean(self.critic(data.observations, data.actions), target)

    def _actor_q(self, observations: th.Tensor, actions: th.Tensor) -> th.Tensor:
        return self.critic(observations, actions).mean(dim=2).mean(dim=1, keepdim=True)


class SyncFreeTD3(_ActorCriticTraining, TD3):
    """SB3's TD3 whose gradient steps read nothing back from the device, and compile whole (:meth:`compile_step`).
    The delayed actor update is a second graph, chosen on the host by the step count (no read)."""

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:  # TD3's own default batch, not SAC's 64
        super().train(gradient_steps, batch_size)

    def _optimizers(self) -> list[th.optim.Optimizer]:
        return [self.critic.optimizer, self.actor.optimizer]

    def _draws(self, batch_size: int, actions: th.Tensor | None) -> tuple[th.Tensor, ...]:
        # As SB3 draws the target policy's smoothing noise: normal_ on a tensor of the actions' shape.
        shape = (batch_size, get_action_dim(self.action_space))  # flat, as the buffer's actions
        like = actions if actions is not None else th.empty(shape, device=self.device)
        return (th.empty_like(like).normal_(0, self.target_policy_noise),)

    def _due(self, gradient_step: int) -> bool:
        # SB3 counts the update before it checks the delay: the n-th update of this call is _n_updates + n + 1.
        return (self._n_updates + gradient_step + 1) % self.policy_delay == 0

    def _log_keys(self, due: bool) -> list[str]:
        return ["train/critic_loss", "train/actor_loss"] if due else ["train/critic_loss"]

    def _act(self, observations: th.Tensor, *draws: th.Tensor) -> tuple[th.Tensor]:
        return (self.actor(observations),)  # deterministic: SB3 adds the exploration noise on the host

    def _stepping(self, due: bool) -> list[int]:
        return [0, 1] if due else [0]  # the actor's optimizer only at its delayed steps

    def _update(self, descend: Descend, batches: Sequence[Micro], due: bool) -> dict[str, th.Tensor]:
        losses: list[th.Tensor] = []
        for data, draws in batches:
            with th.no_grad():
                noise = draws[0].clamp(-self.target_noise_clip, self.target_noise_clip)
                next_actions = (self.actor_target(data.next_observations) + noise).clamp(-1, 1)
                next_q = th.cat(self.critic_target(data.next_observations, next_actions), dim=1)
                next_q, _ = th.min(next_q, dim=1, keepdim=True)
                target = data.rewards + (1 - data.dones) * _discounts(data, self.gamma) * next_q
            current = self.critic(data.observations, data.actions)
            critic_loss: th.Tensor = sum(F.mse_loss(q, target) for q in current)  # type: ignore[assignment]
            losses.append(critic_loss)
            descend(0, critic_loss)
        figures = {"train/critic_loss": _mean(losses)}
        if due:
            losses = []
            for data, _ in batches:
                losses.append(-self.critic.q1_forward(data.observations, self.actor(data.observations)).mean())
                descend(1, losses[-1])
            figures["train/actor_loss"] = _mean(losses)
            polyak(list(self.critic.parameters()), list(self.critic_target.parameters()), self.tau)
            polyak(list(self.actor.parameters()), list(self.actor_target.parameters()), self.tau)
            polyak(self.critic_batch_norm_stats, self.critic_batch_norm_stats_target, 1.0)
            polyak(self.actor_batch_norm_stats, self.actor_batch_norm_stats_target, 1.0)
        return figures
