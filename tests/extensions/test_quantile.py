"""The quantile Huber loss with its gradient made in the forward pass: sb3-contrib's values and gradients, in fewer ops."""

from __future__ import annotations

import pytest
import torch as th
from sb3_contrib.common.utils import quantile_huber_loss
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sb3_gpu.extensions.quantile import quantile_huber

# (current, target): TQC's critics against the kept targets, QR-DQN's quantiles against as many targets.
SHAPES = [((64, 2, 25), (64, 1, 46)), ((32, 10), (32, 10)), ((16, 3, 5), (16, 3, 7))]


def _inputs(current_shape: tuple[int, ...], target_shape: tuple[int, ...], seed: int) -> tuple[th.Tensor, th.Tensor]:
    g = th.Generator().manual_seed(seed)
    current = th.randn(current_shape, generator=g) * 2
    target = th.randn(target_shape, generator=g) * 2
    # Differences on the Huber kink (+-1) and at 0, where the two branches and the weight's step meet.
    target.view(-1)[:3] = current.view(-1)[:3] + th.tensor([1.0, -1.0, 0.0])
    return current, target


@pytest.mark.parametrize("current_shape, target_shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_equal_sb3_contribs(current_shape, target_shape, seed):
    current, target = _inputs(current_shape, target_shape, seed)
    theirs = current.clone().requires_grad_()
    ours = current.clone().requires_grad_()
    expected = quantile_huber_loss(theirs, target, sum_over_quantiles=False)
    expected.backward()
    loss = quantile_huber(ours, target).mean()
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    th.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-8)


def test_summed_over_quantiles_per_sample_is_qrdqns_loss():
    current, target = _inputs((32, 10), (32, 10), 0)
    theirs = current.clone().requires_grad_()
    ours = current.clone().requires_grad_()
    expected = quantile_huber_loss(theirs, target, sum_over_quantiles=True)
    expected.backward()
    # Weighted per sample, as prioritized replay weighs them.
    weights = th.linspace(0.5, 1.5, 32)
    per_sample = quantile_huber(ours, target).sum(dim=-1)
    assert per_sample.shape == (32,)
    assert per_sample.mean().item() == pytest.approx(expected.item(), rel=1e-6)
    (weights * per_sample).mean().backward()
    th.testing.assert_close(ours.grad, theirs.grad * weights[:, None], rtol=1e-5, atol=1e-8)


def test_no_gradient_reaches_the_target_and_bf16_quantiles_get_bf16_gradients():
    current = th.randn(8, 2, 5, dtype=th.bfloat16, requires_grad=True)
    target = th.randn(8, 1, 6, dtype=th.bfloat16, requires_grad=True)
    quantile_huber(current, target).mean().backward()
    assert target.grad is None
    assert current.grad is not None and current.grad.dtype == th.bfloat16
    # The same gradient as sb3-contrib's within bf16's precision.
    theirs = current.detach().clone().requires_grad_()
    quantile_huber_loss(theirs, target.detach(), sum_over_quantiles=False).backward()
    th.testing.assert_close(current.grad, theirs.grad, rtol=2e-2, atol=1e-3)


class _Passes(TorchDispatchMode):
    """Counts the ops that read or write a tensor of at least ``numel`` elements: passes over the pairwise differences."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, th.Tensor)]
        self.count += any(t.numel() >= self.numel for t in tensors)
        return out


def test_forward_and_backward_make_fewer_than_half_sb3_contribs_passes_over_the_pairwise_differences():
    current, target = _inputs((64, 2, 25), (64, 1, 46), 0)
    counts = []
    theirs_fn = lambda c: quantile_huber_loss(c, target, sum_over_quantiles=False)  # noqa: E731
    for loss_fn in (theirs_fn, lambda c: quantile_huber(c, target).mean()):
        leaf = current.clone().requires_grad_()
        with _Passes(64 * 2 * 25 * 46) as passes:
            loss_fn(leaf).backward()
        counts.append(passes.count)
    theirs, ours = counts  # 28 and 10 with torch 2.13
    assert ours * 2 < theirs, counts


@pytest.mark.parametrize(
    "current, target",
    [(th.zeros(4), th.zeros(4)), (th.zeros(4, 3), th.zeros(4, 1, 3)), (th.zeros(4, 3), th.zeros(5, 3))],
    ids=["1d", "ranks differ", "batches differ"],
)
def test_shapes_it_cannot_read_are_refused_in_one_line(current, target):
    with pytest.raises(ValueError, match=r"quantile_huber takes \(batch, n\) or \(batch, n_critics, n\)"):
        quantile_huber(current, target)


def test_compiled_steps_keep_sb3_contribs_formula_which_inductor_fuses_better(monkeypatch):
    from collections import namedtuple
    from types import SimpleNamespace

    from sb3_gpu.extensions import quantile
    from sb3_gpu.extensions.continuous import SyncFreeTQC
    from sb3_gpu.extensions.per.dqn import PrioritizedQRDQN

    function = quantile._QuantileHuber

    class EagerOnly:
        @staticmethod
        def apply(current, target):
            assert not th.compiler.is_compiling(), "the Function was traced into a compiled graph"
            return function.apply(current, target)

    Batch = namedtuple("Batch", "observations actions")
    QRBatch = namedtuple("QRBatch", "observations next_observations actions rewards dones")
    monkeypatch.setattr(quantile, "_QuantileHuber", EagerOnly)
    tqc_current, tqc_target = _inputs((16, 2, 5), (16, 1, 8), 0)
    qr_current, qr_target = _inputs((16, 5), (16, 5), 1)

    model = SimpleNamespace(critic=lambda observations, actions: observations)  # the critic's quantiles, given

    def tqc_loss(current, target):
        return SyncFreeTQC._critic_loss(model, Batch(current, None), target)

    # QR-DQN's prioritized step, per sample before PER's weights: its quantile nets give the (batch, 5, 3) quantiles.
    qr_model = SimpleNamespace(n_quantiles=5, quantile_net=lambda obs: obs, quantile_net_target=lambda obs: obs)
    actions = th.tensor([i % 3 for i in range(16)]).reshape(16, 1)
    rewards, dones = th.ones(16, 1), th.zeros(16, 1)

    def qr_loss(current, target):  # the quantiles of the batch's actions, and the target net's
        spread = th.stack([current, current - 1, current + 1], dim=2)
        data = QRBatch(spread, th.stack([target] * 3, dim=2), actions, rewards, dones)
        return PrioritizedQRDQN._per_sample_loss(qr_model, data, 0.99)[0]

    for loss, current, target in ((tqc_loss, tqc_current, tqc_target), (qr_loss, qr_current, qr_target)):
        ours, fused = current.clone().requires_grad_(), current.clone().requires_grad_()
        eager = loss(ours, target)  # the Function
        compiled = th.compile(loss, backend="eager", fullgraph=True)(fused, target)  # sb3-contrib's formula
        th.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)
        eager.sum().backward()
        compiled.sum().backward()
        th.testing.assert_close(fused.grad, ours.grad, rtol=1e-5, atol=1e-7)
