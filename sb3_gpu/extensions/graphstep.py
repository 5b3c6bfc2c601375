"""A gradient step compiled whole: the loss, the backward pass, clipping, Adam's update and the NaN guard in one graph
(``torch.compile(fullgraph=True)``), which CUDA replays as a CUDA graph with ``mode="reduce-overhead"``.

Two things keep torch's usual step out of one graph: ``loss.backward()`` (dynamo traces autograd only with its
``trace_autograd_ops`` switch, and then ``torch.autograd.grad`` rather than ``.grad`` fields) and
``torch.optim``'s ``step``, which breaks the graph on purpose. So the step takes its gradients with
``torch.autograd.grad`` and runs Adam's update itself, as torch's single-tensor Adam computes it, on the optimizer's
own state (``step``, ``exp_avg``, ``exp_avg_sq``): saving, loading and resuming see an ordinary Adam. A non-finite
gradient leaves the weights and that state untouched on the device, as fused optimizers do with ``found_inf``, and
is counted where the NaN guard reads its flags (:func:`~sb3_gpu.extensions.stepping.guard_flags`).

The same function runs uncompiled where compilation fails: it reads nothing back from the device either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch as th

from sb3_gpu.common.errors import cause_of, named, warn
from sb3_gpu.extensions.compile import CompileFallbackWarning, own_code
from sb3_gpu.extensions.stepping import OptimizerStep

# Modes whose compiled code CUDA replays as a graph (on CUDA; elsewhere they compile as the default does).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class Batch(NamedTuple):
    """The tensors of a replay sample that a DQN-family loss reads."""

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor


# The loss of a minibatch and the figures to hand back with it (TD errors, logged values), from the step's inputs.
LossFn = Callable[..., tuple[th.Tensor, tuple[th.Tensor, ...]]]


def refusal(optimizer: th.optim.Optimizer, guard: OptimizerStep, observations: Any, accumulates: bool = False) -> str | None:
    """Why ``optimizer``'s steps cannot be compiled whole, or None where they can; ``accumulates``: the caller's
    compiled step takes a whole accumulation window (its loss the mean of the micro-batches' losses)."""
    if not hasattr(th._dynamo.config, "trace_autograd_ops"):
        return f"torch {th.__version__} cannot trace the backward pass into a graph (trace_autograd_ops)"
    if type(optimizer) is not th.optim.Adam:
        return f"the compiled step runs Adam's update, and this optimizer is {type(optimizer).__name__}"
    if len(optimizer.param_groups) != 1:
        return "the compiled step takes one parameter group"
    group = optimizer.param_groups[0]
    plain = not (group["amsgrad"] or group["maximize"] or group["differentiable"] or group.get("decoupled_weight_decay"))
    hyper = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    if not plain or any(isinstance(h, th.Tensor) for h in hyper):
        return "the compiled step runs plain Adam (no amsgrad, maximize, decoupled weight decay, tensor hyperparameters)"
    if not isinstance(observations, th.Tensor):
        return "dict observations"
    return _running_refusal(guard, guard.micro_batches if accumulates else 1)


def _running_refusal(guard: OptimizerStep, micro_batches: int) -> str | None:
    """What an extension switched on since may rule out: the step's own wrapper doing part of the work (accumulating
    other than over the ``micro_batches`` the compiled step takes)."""
    if guard.micro_batches != micro_batches:
        return "gradient accumulation steps once per several backward passes"
    return None


def saved_uncapturable(optimizer: th.optim.Optimizer) -> None:
    """Leave ``capturable`` out of what ``optimizer.state_dict()`` saves (SB3's zip): it is this process's setting for
    its GPU's step counts, and a torch Adam loaded with it on a CPU refuses to step there."""
    if getattr(optimizer, "_saved_uncapturable", False):
        return

    def uncapturable(optimizer: th.optim.Optimizer, state: dict[str, Any]) -> None:
        for group in state["param_groups"]:  # state_dict() copies each group: the live ones keep their flag
            if "capturable" in group:
                group["capturable"] = False

    optimizer.register_state_dict_post_hook(uncapturable)
    optimizer._saved_uncapturable = True  # type: ignore[attr-defined]


class _Adam:
    """Adam's update of one parameter group, traceable; the state is the optimizer's, created as Adam's first step
    would create it."""

    def __init__(self, optimizer: th.optim.Optimizer):
        group = optimizer.param_groups[0]
        if group["params"][0].device.type == "cuda" and not group["fused"]:
            # Its step counts live on the device: a torch Adam that loads them must know (a host one would read
            # them back at every step).
            group["capturable"] = True
            saved_uncapturable(optimizer)
        self.params: list[th.Tensor] = [p for p in group["params"] if p.requires_grad]
        self.beta1, self.beta2 = group["betas"]
        self.eps, self.weight_decay = group["eps"], group["weight_decay"]
        self.state: list[tuple[th.Tensor, th.Tensor, th.Tensor]] = []
        for p in self.params:
            state = optimizer.state[p]
            if not state:
                state["step"] = th.zeros((), dtype=th.float32, device=p.device)
                state["exp_avg"] = th.zeros_like(p, memory_format=th.preserve_format)
                state["exp_avg_sq"] = th.zeros_like(p, memory_format=th.preserve_format)
            elif state["step"].device != p.device:  # a host step count would be one more input to wait for
                state["step"] = state["step"].to(p.device)
            self.state.append((state["step"], state["exp_avg"], state["exp_avg_sq"]))

    def current(self, optimizer: th.optim.Optimizer) -> bool:
        """Whether the optimizer still holds this state (``load_state_dict`` replaces it)."""
        return all(optimizer.state[p].get("exp_avg") is m for p, (_, m, _) in zip(self.params, self.state, strict=True))

    def apply(self, grads: Sequence[th.Tensor | None], lr: th.Tensor, ok: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """Update where ``ok`` and every new weight is finite; returns whether the update was applied, and which
        parameters' new weights were not finite (one bool per parameter)."""
        updates, finite = [], []
        for p, g, (step, m, v) in zip(self.params, grads, self.state, strict=True):
            if g is None:  # as torch's Adam, a parameter without a gradient is left alone
                finite.append(ok.new_ones(()))
                continue
            if self.weight_decay:
                g = g + self.weight_decay * p
            new_step = step + 1
            new_m = m.lerp(g, 1 - self.beta1)
            new_v = v * self.beta2 + (1 - self.beta2) * g * g
            bias1 = 1 - self.beta1**new_step
            bias2_sqrt = (1 - self.beta2**new_step).sqrt()
            new_p = p - (lr / bias1) * new_m / (new_v.sqrt() / bias2_sqrt + self.eps)
            updates.append(((p, new_p), (m, new_m), (v, new_v), (step, new_step)))
            finite.append(new_p.isfinite().all())
        # A finite gradient can still make a weight overflow: such a step is skipped too, so the weights stay finite.
        overflow = ~th.stack(finite)
        ok = ok & ~overflow.any()
        for pairs in updates:
            for old, new in pairs:
                old.copy_(th.where(ok, new, old))
        return ok, overflow


def _no_compiler(e: BaseException) -> bool:
    """Whether a compile failed for want of a C++ compiler (inductor's InvalidCxxCompiler, however wrapped)."""
    from torch._inductor.exc import InvalidCxxCompiler

    return cause_of(e, InvalidCxxCompiler) is not None or "InvalidCxxCompiler" in str(e)


class CompiledFunction:
    """A function of tensors compiled whole (``fullgraph=True``); where compiling fails, the function itself, with a
    ``CompileFallbackWarning``. Under CUDA-graph modes its outputs are cloned, since the next replay overwrites them.

    :param fn: returns a tuple of tensors
    :param mode: torch.compile's mode, or ``eager`` to run ``fn`` uncompiled
    :param what: what it computes, for the warning
    """

    def __init__(self, fn: Callable[..., tuple[th.Tensor, ...]], mode: str, what: str):
        self.fn, self.mode, self.what = fn, mode, what
        self.fallback: str | None = None
        self.no_compiler = False  # it failed for want of a C++ compiler, as every other compile here would
        self._compiled: Callable[..., tuple[th.Tensor, ...]] | None = None  # None: run fn itself (mode "eager")
        if mode != "eager":
            self._compiled = th.compile(own_code(fn), fullgraph=True, mode=None if mode == "default" else mode)

    def __call__(self, *inputs: Any) -> tuple[th.Tensor, ...]:
        if self._compiled is None:
            return self.fn(*inputs)
        try:
            with th._dynamo.config.patch(suppress_errors=False):
                out = self._compiled(*inputs)
        except Exception as e:  # as CompiledStep: any failure means "run it uncompiled"
            self.fallback = f"the compiled {self.what} failed ({named(e, 200)}); it runs uncompiled"
            self.no_compiler = _no_compiler(e)
            warn(self.fallback, CompileFallbackWarning)
            self._compiled = None
            return self.fn(*inputs)
        return tuple(t.clone() for t in out) if self.mode in _CUDA_GRAPH_MODES else out


class Descent:
    """One optimizer's part of a compiled update: the gradients of a loss, the NaN guard's check, clipping and Adam's
    update, traced into the caller's graph by calling it with the loss. Its flags are the ones the NaN guard reads.

    Call :meth:`prepare` before and :meth:`finish` after each (compiled) call of the function that calls it.
    ``max_grad_norm`` reads the norm to clip the gradients to (the model's attribute, read at each :meth:`prepare`, as
    SB3 reads it at each step; its None clips nothing), or is None where the algorithm never clips.
    ``accumulates``: the caller takes the guard's whole accumulation window in one call, and its loss is the mean of
    the micro-batches' losses, whose gradient is the mean of theirs, as the accumulating torch step takes it.
    """

    def __init__(
        self,
        optimizer: th.optim.Optimizer,
        guard: OptimizerStep,
        max_grad_norm: Callable[[], float | None] | None,
        accumulates: bool = False,
    ):
        self.optimizer, self.guard, self.max_grad_norm = optimizer, guard, max_grad_norm
        self.micro_batches = guard.micro_batches if accumulates else 1
        self._build()

    def _build(self) -> None:
        self.adam = _Adam(self.optimizer)
        device = self.adam.params[0].device
        self.lr = th.zeros((), device=device)
        self._lr_set: float | None = None  # the value self.lr holds
        # A tensor, as the learning rate: a float would be a constant of the graph, and a changed one ignored.
        self.max_norm = th.full((), math.inf, device=device)
        self._max_norm_set = math.inf
        self.skipped = th.zeros((), dtype=th.long, device=device)  # steps skipped for a non-finite gradient
        self.first_bad = th.full((), -1, dtype=th.long, device=device)  # the first one's parameter, by position
        # By position: a parameter's non-finite gradient, then its update that overflowed (the gradient finite); the
        # guard's own list, which a fused torch step indexes too.
        self._names = self.guard.position_names()
        assert len(self._names) == 2 * len(self.adam.params)
        self.guard.compiled = True  # the NaN guard need not read the weights at each rollout: they stay finite
        self.scaler = self.guard.loss_scale  # fp16: the step scales its loss and updates the scale on the device
        if self.scaler is not None:
            self.scaler.to_device(device)
        scale_state = self.scaler.tensors if self.scaler is not None and self.scaler.tensors is not None else ()
        # Fixed addresses: a CUDA graph replays them in place instead of copying them in and out at every step.
        for t in (
            self.lr,
            self.max_norm,
            self.skipped,
            self.first_bad,
            *scale_state,
            *(t for state in self.adam.state for t in state),
        ):
            th._dynamo.mark_static_address(t)
        for p in self.adam.params:  # a plain tensor stepped in place (SAC's log_ent_coef), as parameters are
            if not isinstance(p, th.nn.Parameter):
                th._dynamo.mark_static_address(p)

    def prepare(self) -> bool:
        """Ready the next call (the learning rate, the clipping norm, the guard's flags); True where the optimizer's
        state was replaced (a load) and the descent now steps on the new one, so that a compiled caller must compile
        anew."""
        rebuilt = not self.adam.current(self.optimizer)
        if rebuilt:
            self._build()
        lr = self.optimizer.param_groups[0]["lr"]
        if lr != self._lr_set:  # a fill is a kernel of its own: once per new value, not per step
            self.lr.fill_(lr)
            self._lr_set = lr
        if self.max_grad_norm is not None:
            norm = self.max_grad_norm()
            norm = math.inf if norm is None else float(norm)  # clipped to no bound: the gradient as it is
            if norm != self._max_norm_set:
                self.max_norm.fill_(norm)
                self._max_norm_set = norm
        self._share_flags()
        if self.scaler is not None:
            self.scaler.hooks_off = True
        return rebuilt

    def finish(self, stepped: bool) -> None:
        """After the call: ``stepped`` where it returned, and so took its step (or skipped it: known when the flags
        are read)."""
        if self.scaler is not None:
            self.scaler.hooks_off = False  # torch's own step, wherever it runs, scales by the outputs' hooks
        if stepped:
            self.guard.steps += 1
            self.guard._notify()  # AMP's scale logger, as after torch's step

    def usable(self) -> bool:
        """Whether the optimizer's wrapper still leaves the whole step to this one (no other accumulation switched on
        since it was built, and no loss scale other than the one it took)."""
        return _running_refusal(self.guard, self.micro_batches) is None and self.guard.loss_scale is self.scaler

    def __call__(self, loss: th.Tensor, gate: th.Tensor | None = None) -> None:
        """Step on ``loss``'s gradients; ``gate`` (a 0-dim bool tensor): where false the step is held back on the
        device, as a non-finite gradient holds it back, but not counted as one (PPO's ``target_kl`` early stop)."""
        params = self.adam.params
        loss_scale = self.scaler.tensors[0] if self.scaler is not None and self.scaler.tensors is not None else None
        scale = loss_scale
        if scale is not None and self.micro_batches > 1:
            # The loss is the micro-batches' mean: each one's backward pass runs at the full scale, as torch's step
            # runs it (its overflows are the same), and the sum comes out divided by the scale and their number.
            scale = scale * self.micro_batches
        scaled = loss * scale if scale is not None else loss  # fp16: small gradients kept above fp16's underflow
        grads: list[th.Tensor | None] = list(th.autograd.grad(scaled, params, allow_unused=True))
        with th.no_grad():
            if scale is not None:
                grads = [g / scale if g is not None else None for g in grads]
            # A parameter without a gradient counts as a zero norm: positions stay those of the guard's names.
            norms = th.stack([th.linalg.vector_norm(g) if g is not None else self.lr.new_zeros(()) for g in grads])
            total = th.linalg.vector_norm(norms)
            # As the NaN guard's check: every gradient finite. And the loss: compiled, a NaN can reach a gradient as a
            # zero (smooth L1's backward takes its sign, and inductor's sign of NaN is 0).
            ok = total.isfinite() & loss.isfinite()
            if self.max_grad_norm is not None:  # as clip_grad_norm_
                coef = th.clamp(self.max_norm / (total + 1e-6), max=1.0)
                grads = [g * coef if g is not None else None for g in grads]
            applied, overflow = self.adam.apply(grads, self.lr, ok if gate is None else ok & gate)
            found = ~applied if gate is None else gate & ~applied
            if loss_scale is not None and self.scaler is not None:
                # As the host's rule: above a scale of 1 a non-finite gradient is an overflow, the scale's to handle
                # (the scale itself, not the one multiplied for micro-batches). A finite gradient whose update made a
                # weight non-finite is no overflow: the guard's, and the scale stays.
                grad_inf = ~ok if gate is None else gate & ~ok
                real = found & ~(grad_inf & (loss_scale > 1.0))
                self.scaler.update_on_device(grad_inf, taken=gate)
                found = real
            # The first parameter whose gradient, else whose update, was not finite; past the names where only the
            # loss was not (compiled, its NaN can reach the gradients as zeros).
            bad = th.cat([~norms.isfinite(), overflow])
            first = th.where(bad.any(), bad.int().argmax(), len(bad))
            self.first_bad.copy_(th.where((self.first_bad < 0) & found, first, self.first_bad))
            self.skipped.add_(found.long())

    def _share_flags(self) -> None:
        """Make the NaN guard read this descent's flags, carrying over what an uncompiled step counted before."""
        guard = self.guard
        if guard._skipped is self.skipped:
            return
        if guard._skipped is not None and guard._first_bad is not None:
            self.skipped.copy_(guard._skipped)
            self.first_bad.copy_(guard._first_bad)
        guard._skipped, guard._first_bad, guard._bad_names = self.skipped, self.first_bad, self._names


class CompiledUpdate:
    """An update of one or more optimizers compiled whole: ``update_fn`` computes its losses and calls each
    :class:`Descent` with its own, in the order the algorithm steps them; it returns the tensors to log. Outputs are
    detached and stay on the device.

    :param mode: torch.compile's mode (``default``, ``reduce-overhead`` for CUDA graphs, ``max-autotune``), or
        ``eager`` to run the same function uncompiled
    :param siblings: the model's other compiled functions: where one found no C++ compiler, this is not tried (a
        minute of tracing, on SAC's step, to fail the same way)
    """

    def __init__(
        self,
        update_fn: Callable[..., tuple[th.Tensor, ...]],
        descents: Sequence[Descent],
        mode: str,
        siblings: Sequence[CompiledFunction] = (),
    ):
        self.update_fn, self.descents, self.mode, self.siblings = update_fn, list(descents), mode, list(siblings)
        self.fallback: str | None = None
        self._compile()

    def _run(self, *inputs: Any) -> tuple[th.Tensor, ...]:
        # Detached inside the graph: an output whose grad_fn a backward pass consumed cannot leave a compiled one.
        return tuple(t.detach() for t in self.update_fn(*inputs))

    def _compile(self) -> None:
        self._compiled: Callable[..., tuple[th.Tensor, ...]] = self._run
        if self.mode != "eager" and self.fallback is None:
            self._compiled = th.compile(
                own_code(self._run), fullgraph=True, mode=None if self.mode == "default" else self.mode
            )

    def __call__(self, *inputs: Any, stepping: Sequence[int] | None = None) -> tuple[th.Tensor, ...]:
        """Run the update on ``inputs``; ``stepping``: the positions of the descents it takes (default: all), for an
        update that leaves some optimizers alone at some steps (TD3's delayed actor)."""
        if any([d.prepare() for d in self.descents]):  # every one prepared; a replaced state compiles anew
            self._compile()
        stepped = False
        try:
            out = self._guarded_call(*inputs)
            stepped = True
        finally:
            for i, d in enumerate(self.descents):
                d.finish(stepped and (stepping is None or i in stepping))
        if self.mode in _CUDA_GRAPH_MODES:  # a CUDA graph's outputs are overwritten by its next replay
            return tuple(t.clone() for t in out)
        return out

    def usable(self) -> bool:
        """Whether every optimizer's wrapper still leaves its whole step to this update."""
        return all(d.usable() for d in self.descents)

    def _guarded_call(self, *inputs: Any) -> tuple[th.Tensor, ...]:
        if self._compiled != self._run and (failed := next((f for f in self.siblings if f.no_compiler), None)):
            self.fallback = (
                f"no C++ compiler was found as the {failed.what} compiled, so the gradient step runs uncompiled too "
                "(install g++ or clang to compile, or set compile false)"
            )
            warn(self.fallback, CompileFallbackWarning)
            self._compiled = self._run
        if self._compiled == self._run:
            return self._run(*inputs)
        try:  # a failure shows while tracing or compiling (the first call, a recompile), before anything changes
            with th._dynamo.config.patch(trace_autograd_ops=True, suppress_errors=False):
                return self._compiled(*inputs)
        except th.cuda.OutOfMemoryError:
            # Not the compiler's failure: a CUDA graph's first call runs the step, which may have changed weights
            # and Adam's state before the device ran out. Running it again uncompiled could apply part of it twice.
            raise
        except Exception as e:  # compilers fail in many ways; all mean "run the same step uncompiled"
            self.fallback = f"the compiled gradient step failed ({named(e, 200)}); it runs uncompiled"
            warn(self.fallback, CompileFallbackWarning)
            self._compiled = self._run
            return self._run(*inputs)


class CompiledStep(CompiledUpdate):
    """One gradient step of a loss, compiled whole; call it with the loss function's inputs. Returns the loss
    function's other outputs, detached, still on the device (the loss itself is the loss function's to log, inside the
    graph with :class:`~sb3_gpu.extensions.devicelog.GraphSums`: an output would be one more copy out of a CUDA graph).

    :param loss_fn: the loss and the figures to return with it (the model's, reading its networks); float inputs
        that change between calls (clip ranges) are better passed as 0-dim tensors, each new float compiles anew
    :param mode: torch.compile's mode (``default``, ``reduce-overhead`` for CUDA graphs, ``max-autotune``), or
        ``eager`` to run the same function uncompiled
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: th.optim.Optimizer,
        guard: OptimizerStep,
        max_grad_norm: Callable[[], float | None] | None,
        mode: str = "default",
        accumulates: bool = False,
    ):
        self.loss_fn = loss_fn
        self.descent = Descent(optimizer, guard, max_grad_norm, accumulates)
        super().__init__(self._step, [self.descent], mode)

    @property
    def skipped(self) -> th.Tensor:
        """Steps skipped for a non-finite gradient (a device tensor)."""
        return self.descent.skipped

    def _step(self, *inputs: Any) -> tuple[th.Tensor, ...]:
        loss, figures = self.loss_fn(*inputs)
        self.descent(loss)
        return figures
