"""The one wrapper around an optimizer's step: gradient accumulation, fp16 loss scaling, the NaN guard and the step
count, always in the same order.

SB3's ``train()`` methods run ``zero_grad(); loss.backward(); clip_grad_norm_(); step()`` per minibatch, and sb3_gpu
copies none of them. :func:`optimizer_step` wraps an optimizer's ``zero_grad`` and ``step`` once, and each extension
switches its part on there:

- accumulation (:meth:`OptimizerStep.accumulate`): a hook that runs when a parameter's gradient is complete sets
  each micro-batch's gradient aside, so that clipping sees zeros and the step is held back, until the last
  micro-batch of the window, whose gradient gets the others' back and is divided by their number;
- fp16 loss scaling (:meth:`OptimizerStep.scale_losses`): the same hook divides by the loss scale, so that SB3's
  clipping sees true gradients; a step whose gradients overflowed is skipped and the scale updated with
  ``torch.amp.GradScaler``'s rules;
- the NaN guard (``on_non_finite``): any other non-finite gradient (also one that persists down to a loss scale of
  1) stops training before it reaches the weights. Where the optimizer is fused (``fused=True``: its kernels take a
  ``found_inf`` flag) and the model reads the guard's flags when it writes its logs (``defer_checks``), the step is
  skipped on the device, without a wait, and the error raised at that read (:func:`guard_flags`,
  :func:`raise_for_guards`); elsewhere the gradient is read at each step;
- counting: ``steps`` counts the optimizer's steps, not held-back ones; a step skipped on the host for an fp16
  overflow does not count, but one skipped on the device does (it is known only when the flags are read; AMP
  logs those under ``amp/skipped_steps``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_gpu.extensions.devicelog import DeviceLog


def all_finite(tensors: list[th.Tensor]) -> bool:
    """Whether no element of ``tensors`` is NaN or inf (one device sync)."""
    # The 2-norm is the cheapest reduction over them all (a max-abs norm costs several times more on the CPU). It is
    # finite when every element is; when it is not, an element is NaN or inf, or the squares overflowed: look closer.
    # torch._foreach_norm (documented, beta) is what clip_grad_norm_ runs; this check runs at every optimizer step,
    # and called directly it costs about half of get_total_norm's wrapping on the CPU.
    if not tensors or bool(th.linalg.vector_norm(th.stack(th._foreach_norm(tensors))).isfinite()):
        return True
    return all(bool(t.isfinite().all()) for t in tensors)


def non_finite_name(named: Iterable[tuple[str, th.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or inf, or None."""
    pairs = list(named)
    if all_finite([t.detach() for _, t in pairs]):
        return None
    return next((name for name, t in pairs if not bool(t.detach().isfinite().all())), None)


def first_non_finite(module: th.nn.Module) -> str | None:
    """The name of the first parameter of ``module`` holding a NaN or inf, or None."""
    return non_finite_name(module.named_parameters())


_FLOAT32_MAX = th.finfo(th.float32).max


class LossScale:
    """A dynamic fp16 loss scale that follows ``torch.amp.GradScaler``'s rules (a test runs the two side by side).

    An overflow skips the step and multiplies the scale by ``backoff_factor``; ``growth_interval`` good steps in a
    row multiply it by ``growth_factor``. Where steps are skipped on the device (a fused optimizer, a compiled step)
    the scale lives there too (:meth:`to_device`): updated without a wait, and read only as :attr:`scale`.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._skipped_steps = 0
        self._good_steps = 0
        # On the device: the scale, the good steps in a row, the steps skipped for an overflow (None: on the host).
        self.tensors: tuple[th.Tensor, th.Tensor, th.Tensor] | None = None
        self.hooks_off = False  # True during a compiled step, which scales its loss itself: no output hooks in its graph

    @property
    def scale(self) -> float:
        """The current scale (on the device: read back, a wait)."""
        return float(self.tensors[0]) if self.tensors is not None else self._scale

    @property
    def skipped_steps(self) -> int:
        return int(self.tensors[2]) if self.tensors is not None else self._skipped_steps

    @property
    def factor(self) -> float | th.Tensor:
        """What gradients are multiplied by: the scale, as a tensor where it lives on the device."""
        return self.tensors[0] if self.tensors is not None else self._scale

    def to_device(self, device: th.device) -> None:
        """Keep the scale on ``device`` from now on (once; later calls do nothing)."""
        if self.tensors is None:
            self.tensors = (
                th.full((), self._scale, dtype=th.float32, device=device),
                th.full((), self._good_steps, dtype=th.int32, device=device),
                th.full((), self._skipped_steps, dtype=th.int64, device=device),
            )

    def state(self) -> dict[str, float]:
        """The scale, the good steps in a row and the skipped steps, as plain numbers (on the device: read back, a
        wait), for a saved model to go on from."""
        if self.tensors is not None:
            scale, good, skipped = (t.item() for t in self.tensors)
        else:
            scale, good, skipped = self._scale, self._good_steps, self._skipped_steps
        return {"scale": float(scale), "good_steps": int(good), "skipped_steps": int(skipped)}

    def load_state(self, state: Any) -> bool:
        """Go on from :meth:`state`'s figures; False (nothing changed) where they are not such figures."""
        try:
            scale, good, skipped = float(state["scale"]), state["good_steps"], state["skipped_steps"]
        except (TypeError, KeyError, ValueError):
            return False
        counts = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (good, skipped))
        if not (counts and 0 < scale <= _FLOAT32_MAX):
            return False
        self._scale, self._good_steps, self._skipped_steps = scale, good % self.growth_interval, skipped
        if self.tensors is not None:
            for tensor, value in zip(self.tensors, (self._scale, self._good_steps, skipped), strict=True):
                tensor.fill_(value)
        return True

    def update(self, found_inf: bool) -> None:
        """Account for one optimizer step that overflowed (and was skipped) or did not."""
        if self.tensors is not None:  # torch's step after a compiled one: the scale stays where it lives
            self.update_on_device(th.tensor(found_inf, device=self.tensors[0].device))
            return
        if found_inf:
            self._scale *= self.backoff_factor
            self._skipped_steps += 1
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            grown = self._scale * self.growth_factor
            # Finite as float32, as GradScaler's scale is: past it the gradients it multiplies would all be inf.
            self._scale = grown if grown <= _FLOAT32_MAX else self._scale
            self._good_steps = 0

    def update_on_device(self, found_inf: th.Tensor, taken: th.Tensor | None = None) -> None:
        """:meth:`update` on the device tensors, by tensor ops only (``found_inf``: a 0-dim bool tensor); ``taken``
        (the same): where false the step was held back for another reason, and the scale stays as it was."""
        assert self.tensors is not None
        scale, good, skipped = self.tensors
        good_now = th.where(found_inf, 0, good + 1)
        grow = good_now >= self.growth_interval
        grown = scale * self.growth_factor
        new_scale = th.where(found_inf, scale * self.backoff_factor, th.where(grow & grown.isfinite(), grown, scale))
        new_good = th.where(grow, 0, good_now)
        if taken is not None:
            new_scale, new_good = th.where(taken, new_scale, scale), th.where(taken, new_good, good)
        scale.copy_(new_scale)
        good.copy_(new_good)
        skipped.add_(found_inf.long())


class OptimizerStep:
    """An optimizer's ``zero_grad`` and ``step``, wrapped once; get it with :func:`optimizer_step`.

    :ivar steps: steps the optimizer took, with those skipped on the device (see the module's notes on counting)
    :ivar on_non_finite: the NaN guard: given a parameter's name, the exception to raise when its gradient is not
        finite (and no loss scale explains it); given ``UPDATE_OF`` and the name where a compiled step found the
        gradient finite and the weight after the update not, and "" where it found only the loss non-finite
    :ivar listeners: called after each step taken or skipped (AMP logs its scale there)
    """

    def __init__(self, optimizer: th.optim.Optimizer, names: dict[int, str]):
        self.optimizer = optimizer
        self.micro_batches = 1
        self.loss_scale: LossScale | None = None
        self.on_non_finite: Callable[[str], BaseException] | None = None
        self.steps = 0
        self.listeners: list[Callable[[], None]] = []
        self.defer_checks = False
        self.compiled = False  # a compiled step (extensions.graphstep) takes the steps and keeps the weights finite
        self._skipped: th.Tensor | None = None  # steps skipped on the device for a non-finite gradient
        self._first_bad: th.Tensor | None = None  # the position, among _bad_names, of the first one's parameter
        self._bad_names: list[str] = []
        self._positions: tuple[tuple[int, ...], list[str]] = ((), [])  # position_names(), by the parameters' ids
        self._names = names
        self._micro = -1  # the micro-batch being computed; advanced by zero_grad, which SB3 calls before backward
        self._saved: dict[th.Tensor, th.Tensor] = {}
        self._hooks: list[Any] = []
        self._zero_grad, self._step = optimizer.zero_grad, optimizer.step
        optimizer.zero_grad = self.zero_grad  # type: ignore[method-assign]
        optimizer.step = self.step  # type: ignore[method-assign]

    def accumulate(self, micro_batches: int) -> None:
        """Step on the mean gradient of ``micro_batches`` consecutive backward passes."""
        self.micro_batches = micro_batches
        self._hook_gradients()

    def scale_losses(self, loss_scale: LossScale) -> None:
        """Gradients arrive multiplied by ``loss_scale.scale`` (see :mod:`sb3_gpu.extensions.amp`); divide it out."""
        self.loss_scale = loss_scale
        self._scale_on_device()
        self._hook_gradients()

    def reset(self) -> None:
        """Start a new accumulation window (a ``train()`` may stop between micro-batches, PPO's ``target_kl``)."""
        self._micro = -1
        self._saved.clear()

    # ------------------------------------------------------------------ the wrapped calls
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._micro += 1
        self._zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Hold back, check, skip or refuse, step, count: always in this order."""
        if not self._last_micro_batch():
            return None
        for param, saved in self._saved.items():  # a parameter without a gradient in the last micro-batch
            param.grad = self._unscaled(saved)
        self._saved.clear()
        if self.skips_on_device and (self.on_non_finite is not None or self.loss_scale is not None):
            self._scale_on_device()
            return self._step_or_skip_on_device(closure)
        bad = self._non_finite_gradient() if self.loss_scale is not None or self.on_non_finite is not None else None
        # An fp16 overflow is expected now and then, and the scale handles it; at a scale of 1 or less nothing was
        # scaled up to overflow, so the gradient itself is NaN or inf (GradScaler would skip such steps forever
        # while its scale decays to zero).
        overflow = self.loss_scale is not None and self.loss_scale.scale > 1.0
        if bad is not None and self.on_non_finite is not None and not overflow:
            raise self.on_non_finite(bad)
        if self.loss_scale is not None:
            self.loss_scale.update(found_inf=bad is not None)
            if bad is not None:
                self._notify()
                return None
        out = self._step() if closure is None else self._step(closure)
        self.steps += 1
        self._notify()
        return out

    @property
    def skips_on_device(self) -> bool:
        """Whether the NaN guard decides on the device: a fused optimizer, and a model that reads the flags."""
        # Each group's flag, not the defaults: loading a state saved by a plain optimizer unfuses its groups.
        return self.defer_checks and all(group.get("fused") for group in self.optimizer.param_groups)

    # ------------------------------------------------------------------ internals
    def _scale_on_device(self) -> None:
        if self.loss_scale is not None and self.skips_on_device:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            self.loss_scale.to_device(params[0].device)

    def position_names(self) -> list[str]:
        """The names that the device-side guard's positions index: each trainable parameter's, in the optimizer's
        order, then each again for an update that overflowed. One list for the fused torch step and the compiled one
        (:mod:`sb3_gpu.extensions.graphstep`), so a position recorded by either names the same parameter after a run
        switches from one to the other."""
        params = self._trainable()
        key = tuple(id(p) for p in params)
        if key != self._positions[0]:  # built once per set of parameters, not at every step
            names = [self._names.get(id(p), "?") for p in params]
            self._positions = (key, names + [f"{UPDATE_OF}{name}" for name in names])
        return self._positions[1]

    def _trainable(self) -> list[th.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def _step_or_skip_on_device(self, closure: Callable[[], Any] | None) -> Any:
        params = self._trainable()
        norms = iter(th._foreach_norm([p.grad for p in params if p.grad is not None]))
        zero = params[0].new_zeros(())  # a parameter without a gradient: finite, and its position kept
        bad = ~th.stack([next(norms) if p.grad is not None else zero for p in params]).isfinite()
        found = bad.any()
        self.optimizer.found_inf = found.float()  # type: ignore[attr-defined]  # the fused kernels skip the update
        try:
            out = self._step() if closure is None else self._step(closure)
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
        if self.loss_scale is not None and self.loss_scale.tensors is not None:
            # As on the host: an overflow above a scale of 1 is the scale's to handle; at 1 or less the gradient
            # itself is NaN or inf, which the guard reports (if it is on).
            real = found & (self.loss_scale.tensors[0] <= 1.0)
            self.loss_scale.update_on_device(found)
            found = real if self.on_non_finite is not None else th.zeros_like(found)
        first = bad.int().argmax()
        if self._skipped is None or self._first_bad is None:
            self._skipped, self._first_bad = found.long(), th.where(found, first, -1)
        else:
            self._first_bad = th.where((self._first_bad < 0) & found, first, self._first_bad)
            self._skipped = self._skipped + found.long()
        self._bad_names = self.position_names()
        self.steps += 1  # tried; the skipped ones are known when the flags are read
        self._notify()
        return out

    def _last_micro_batch(self) -> bool:
        return self._micro % self.micro_batches == self.micro_batches - 1

    def _hook_gradients(self) -> None:
        if not self._hooks:
            params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    def _on_gradient(self, param: th.Tensor) -> None:
        """Runs once per backward pass for each parameter, when its ``.grad`` is complete (before clipping)."""
        assert param.grad is not None
        if self.micro_batches > 1:
            saved = self._saved.pop(param, None)
            if not self._last_micro_batch():
                self._saved[param] = param.grad.clone() if saved is None else saved.add_(param.grad)
                param.grad.zero_()
                return
            if saved is not None:
                param.grad.add_(saved)
        self._unscaled(param.grad)

    def _unscaled(self, grad: th.Tensor) -> th.Tensor:
        divisor = self.micro_batches * (self.loss_scale.factor if self.loss_scale is not None else 1.0)
        return grad.div_(divisor) if isinstance(divisor, th.Tensor) or divisor != 1.0 else grad

    def _non_finite_gradient(self) -> str | None:
        with_grads = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if all_finite([p.grad for p in with_grads]):
            return None
        return non_finite_name((self._names.get(id(p), "?"), p.grad) for p in with_grads)

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()


def optimizer_step(
    optimizer: th.optim.Optimizer, module: th.nn.Module | None = None, names: dict[int, str] | None = None
) -> OptimizerStep:
    """The :class:`OptimizerStep` of ``optimizer``, wrapping it on first use.

    :param module: names the parameters in messages (the policy)
    :param names: or the names themselves, by ``id`` of the parameter
    """
    installed = getattr(optimizer.step, "__self__", None)
    if isinstance(installed, OptimizerStep):
        return installed
    if names is None:
        names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
    return OptimizerStep(optimizer, names)


def guard_flags(model: BaseAlgorithm) -> dict[str, th.Tensor]:
    """The device-side NaN guard's flags of ``model``'s optimizers, to be read with the model's other logged figures
    (see :func:`raise_for_guards`)."""
    flags = {}
    for i, step in enumerate(optimizer_steps(model)):
        if step._skipped is not None and step._first_bad is not None:
            flags[f"{_GUARD}{i}/skipped"], flags[f"{_GUARD}{i}/first"] = step._skipped, step._first_bad
    return flags


def raise_for_guards(model: BaseAlgorithm, values: dict[str, float]) -> None:
    """Remove the flags of :func:`guard_flags` from ``values`` (read from the device) and raise the NaN guard's
    error where a step was skipped."""
    for i, step in enumerate(optimizer_steps(model)):
        skipped, first = values.pop(f"{_GUARD}{i}/skipped", 0.0), values.pop(f"{_GUARD}{i}/first", -1.0)
        if skipped and step.on_non_finite is not None:
            # "": every gradient and update was finite, and the loss was not.
            raise step.on_non_finite(step._bad_names[int(first)] if 0 <= first < len(step._bad_names) else "")


def record_with_guards(model: BaseAlgorithm, log: DeviceLog, hold: tuple[str, ...] = ()) -> dict[str, float]:
    """Read ``log``'s pending figures and the device-side NaN guard's flags with one wait, raise the guard's error
    where a step was skipped, and record the figures in the model's logger, but for those named in ``hold``: returned
    for the caller to judge."""
    for key, flag in guard_flags(model).items():
        log.latest(key, flag)
    values = log.read()
    raise_for_guards(model, values)
    held = {key: values.pop(key) for key in hold if key in values}
    for key, value in values.items():
        model.logger.record(key, value)
    return held


def record_at_each_dump(model: BaseAlgorithm, log: DeviceLog, record: Callable[[], object]) -> None:
    """Have ``model``'s logger call ``record`` (which records ``log``'s figures) before each dump while figures wait,
    whoever dumps: SB3's ``train()`` records its losses at once, so that an ``EvalCallback``'s rows, or the user's own
    ``logger.dump()`` after ``learn``, carry them; kept on the device, they would reach only the model's own log
    writes. Call it where ``learn`` has set the logger up, and again in the model's ``dump_logs`` (in case the logger
    was replaced since), which then leaves the reading to the dump: a read of its own before it would have the dump
    read again whatever an overlapped training added in between, and replace this row's figures by those."""
    logger = model.logger
    dump = logger.dump
    if getattr(dump, "records_for", None) is log:
        return

    def dump_with_device_figures(step: int = 0) -> None:
        if log.pending():
            record()
        dump(step)

    dump_with_device_figures.records_for = log  # type: ignore[attr-defined]
    logger.dump = dump_with_device_figures  # type: ignore[method-assign]


class DeviceFigures:
    """Mixin for sb3_gpu's SB3 subclasses whose ``train()`` keeps its logged figures in ``_device_log``: every dump of
    the model's logger reads them (:func:`record_at_each_dump`)."""

    _device_log: DeviceLog

    def _record_device_figures(self) -> None:
        """Read the figures kept on the device, and the NaN guard's flags, with one wait, and record them."""
        record_with_guards(self, self._device_log)  # type: ignore[arg-type]

    def _setup_learn(self, *args: Any, **kwargs: Any) -> Any:
        setup = super()._setup_learn(*args, **kwargs)  # type: ignore[misc]
        record_at_each_dump(self, self._device_log, self._record_device_figures)  # type: ignore[arg-type]
        return setup

    def dump_logs(self, *args: Any) -> None:
        # Again, in case the logger was replaced since learn began; the dump itself reads the figures, once.
        record_at_each_dump(self, self._device_log, self._record_device_figures)  # type: ignore[arg-type]
        super().dump_logs(*args)  # type: ignore[misc]


def settle_guards(model: BaseAlgorithm) -> None:
    """Read the device-side NaN guard's flags now (one wait) and raise its error where a step was skipped."""
    flags = guard_flags(model)
    if flags:
        values = dict(zip(flags, th.stack([v.double() for v in flags.values()]).tolist(), strict=True))
        raise_for_guards(model, values)


_GUARD = "sb3_gpu/guard"
# Before a parameter's name given to ``on_non_finite``: its gradient was finite, the weight after the update was not.
UPDATE_OF = "update of "


def policy_optimizers(policy: th.nn.Module) -> list[th.optim.Optimizer]:
    """Every optimizer a policy's modules hold, once each (SAC-like policies hold one per network)."""
    found = {id(o): o for m in policy.modules() if isinstance(o := getattr(m, "optimizer", None), th.optim.Optimizer)}
    return list(found.values())


def entropy_optimizer(model: BaseAlgorithm) -> th.optim.Optimizer | None:
    """SAC's and TQC's optimizer of their learned entropy coefficient (a parameter of the model, not of the policy),
    or None."""
    entropy = getattr(model, "ent_coef_optimizer", None)
    return entropy if isinstance(entropy, th.optim.Optimizer) else None


def optimizer_steps(model: BaseAlgorithm) -> list[OptimizerStep]:
    """The :class:`OptimizerStep` of every optimizer of ``model``'s policy, and of its entropy coefficient's."""
    # The learner's policy: where training overlaps collection, ``model.policy`` is the actor copy during collection
    # (SB3 writes its logs there), and the copy has no optimizers.
    policy = model.__dict__.get("policy", model.policy)
    steps = [optimizer_step(o, policy) for o in policy_optimizers(policy)]
    entropy = entropy_optimizer(model)
    if entropy is not None:
        steps.append(optimizer_step(entropy, names={id(model.log_ent_coef): "log_ent_coef"}))  # type: ignore[attr-defined]
    return steps
