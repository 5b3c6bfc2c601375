"""sb3-contrib's quantile Huber loss (QR-DQN's and TQC's) with its gradient made in the forward pass.

The loss compares every current quantile with every target quantile: TQC's critics on a batch of 256 make a
(256, 2, 25, 46) tensor, and sb3-contrib's formula runs about a dozen elementwise ops over it forward and as many
again in autograd's backward (``abs``, ``where``, ``pow`` and their derivatives). On a CPU that is most of TQC's
gradient step with small networks; on a GPU each op is a kernel launch. The gradient with respect to the current
quantiles has a closed form, ``-mean_t(w * clamp(delta, -1, 1))`` with ``w = |tau - 1{delta < 0}|``, so it is made
beside the loss in one pass and backward is a single multiply on the current quantiles' shape.

The Huber term is written ``c * (delta - c / 2)`` with ``c = clamp(delta, -1, 1)``: the same value as
sb3-contrib's ``where(|delta| > 1, |delta| - 0.5, delta**2 / 2)`` on both branches, in fewer ops. The target
quantiles are a constant (both algorithms make them without gradient): no gradient flows to them. It is eager's
saving: inside a compiled graph inductor fuses sb3-contrib's formula, forward and backward, into fewer kernels than
it makes around this Function, so :func:`quantile_huber` and :func:`quantile_huber_mean` take that formula where
they are being compiled.
"""

from __future__ import annotations

from typing import Any

import torch as th
from sb3_contrib.common.utils import quantile_huber_loss


class _QuantileHuber(th.autograd.Function):
    @staticmethod
    def forward(current: th.Tensor, target: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        n = current.shape[-1]
        tau = (th.arange(n, device=current.device, dtype=th.float) + 0.5) / n  # sb3-contrib's cum_prob
        delta = target.unsqueeze(-2) - current.unsqueeze(-1)  # (..., n current, n target)
        clipped = delta.clamp(-1.0, 1.0)
        tau = tau.unsqueeze(-1)  # each current quantile's level, along the targets
        weighted = th.where(delta < 0, 1.0 - tau, tau) * clipped
        loss = (weighted * (delta - 0.5 * clipped)).mean(dim=-1)
        return loss, weighted.sum(dim=-1) / -delta.shape[-1]

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx: Any, grad_loss: th.Tensor, _grad: Any) -> tuple[th.Tensor, None]:
        (grad,) = ctx.saved_tensors
        return (grad_loss * grad).to(ctx.dtype), None


def quantile_huber(current: th.Tensor, target: th.Tensor) -> th.Tensor:
    """sb3-contrib's quantile Huber loss of each current quantile, averaged over the target quantiles.

    :param current: current quantiles, ``(batch, n)`` (QR-DQN) or ``(batch, n_critics, n)`` (TQC)
    :param target: target quantiles, broadcastable to ``current``'s shape with its last dimension any size
        (``(batch, m)`` or ``(batch, 1, m)``); treated as a constant
    :return: a tensor of ``current``'s shape (of the broadcast shape where ``target`` has more critics). Its
        ``mean()`` is ``quantile_huber_loss(current, target, sum_over_quantiles=False)``; its ``sum(dim=-1)`` per
        sample is QR-DQN's loss before the batch mean. Differentiable once, as SB3's training needs: its backward
        is not itself differentiated (a second derivative through it reads zero; compiled, it is sb3-contrib's formula,
        which autograd differentiates as usual).
    """
    if current.ndim not in (2, 3) or target.ndim != current.ndim or target.shape[0] != current.shape[0]:
        raise ValueError(
            f"quantile_huber takes (batch, n) or (batch, n_critics, n) current quantiles and a target of the same rank "
            f"and batch, got {tuple(current.shape)} and {tuple(target.shape)}"
        )
    if th.compiler.is_compiling():
        return _fused_by_inductor(current, target.detach())
    loss, _ = _QuantileHuber.apply(current, target.detach())
    return loss


def quantile_huber_mean(current: th.Tensor, target: th.Tensor) -> th.Tensor:
    """``quantile_huber(current, target).mean()``: TQC's critic loss. Compiled, sb3-contrib's own reduction, whose
    graph inductor fuses into fewer kernels than the per-quantile one (74 against 85 per TQC Pendulum step)."""
    if th.compiler.is_compiling():
        return quantile_huber_loss(current, target.detach(), sum_over_quantiles=False)
    return quantile_huber(current, target).mean()


def _fused_by_inductor(current: th.Tensor, target: th.Tensor) -> th.Tensor:
    """sb3-contrib's formula, each current quantile's loss averaged over the targets, for autograd to differentiate."""
    n = current.shape[-1]
    tau = ((th.arange(n, device=current.device, dtype=th.float) + 0.5) / n).unsqueeze(-1)
    delta = target.unsqueeze(-2) - current.unsqueeze(-1)
    abs_delta = th.abs(delta)
    huber = th.where(abs_delta > 1, abs_delta - 0.5, delta**2 * 0.5)
    return (th.abs(tau - (delta.detach() < 0).float()) * huber).mean(dim=-1)
