"""The one wrapper around an optimizer's step: accumulation, fp16 loss scaling, the NaN guard and counting, in every
combination, driven the way SB3's ``train()`` drives an optimizer (zero_grad, backward, clip, step)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch as th
from stable_baselines3 import PPO

from sb3_gpu.common.errors import TrainingDiverged
from sb3_gpu.extensions.accumulate import GradAccumPPO
from sb3_gpu.extensions.per import PrioritizedDQN
from sb3_gpu.extensions.stepping import LossScale, first_non_finite, optimizer_step

LR = 0.1
SCALE = 8.0


def _batch(index: int) -> th.Tensor:
    return th.arange(4.0).reshape(2, 2) + index


def _sb3_micro_batch(layer: th.nn.Linear, optimizer: th.optim.Optimizer, index: int, scale: float, poison: bool):
    """What SB3's train() does around one minibatch's loss (the loss times ``scale``: what fp16 AMP's hooks do)."""
    batch = _batch(index)
    if poison:  # an inf in the backward pass: what an fp16 overflow or a diverged loss leaves behind
        batch[0, 0] = math.inf
    optimizer.zero_grad()
    (layer(batch).pow(2).mean() * scale).backward()
    th.nn.utils.clip_grad_norm_(layer.parameters(), 1e9)
    optimizer.step()


def _reference(micro_batches: int) -> th.Tensor:
    """Plain SGD on the mean gradient of the micro-batches: what an accumulated, unscaled step must give."""
    th.manual_seed(0)
    layer = th.nn.Linear(2, 1)
    grads = []
    for i in range(micro_batches):
        layer.zero_grad()
        layer(_batch(i)).pow(2).mean().backward()
        grads.append(layer.weight.grad.clone())
    return layer.weight.detach() - LR * th.stack(grads).mean(dim=0)


COMBINATIONS = list(itertools.product([1, 3], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize(
    ("micro_batches", "scaled", "guarded", "poisoned"),
    COMBINATIONS,
    ids=[
        f"accum{k}-{'scaled' if s else 'fp32'}-{'guard' if g else 'noguard'}-{'inf' if p else 'finite'}"
        for k, s, g, p in COMBINATIONS
    ],
)
def test_each_combination_holds_back_checks_skips_or_refuses_then_steps_and_counts(micro_batches, scaled, guarded, poisoned):
    th.manual_seed(0)
    layer = th.nn.Linear(2, 1)
    before = layer.weight.detach().clone()
    optimizer = th.optim.SGD(layer.parameters(), lr=LR)
    step = optimizer_step(optimizer, layer)
    if micro_batches > 1:
        step.accumulate(micro_batches)
    scale = LossScale(init_scale=SCALE) if scaled else None
    if scale is not None:
        step.scale_losses(scale)
    if guarded:
        step.on_non_finite = lambda name: TrainingDiverged(f"{name} diverged")
    notified = []
    step.listeners.append(lambda: notified.append(1))

    # Every micro-batch but the last is held back: no step, no count, no check, nothing notified.
    for i in range(micro_batches - 1):
        _sb3_micro_batch(layer, optimizer, i, scale.scale if scale else 1.0, poison=poisoned and i == 0)
        assert step.steps == 0 and not notified and th.equal(layer.weight.detach(), before)

    last = micro_batches - 1
    poison_last = poisoned and micro_batches == 1  # with accumulation the inf came in the first micro-batch
    if poisoned and not scaled and guarded:
        with pytest.raises(TrainingDiverged, match="weight diverged"):
            _sb3_micro_batch(layer, optimizer, last, 1.0, poison=poison_last)
        assert th.equal(layer.weight.detach(), before), "refused before the step"
        assert step.steps == 0
        return
    _sb3_micro_batch(layer, optimizer, last, scale.scale if scale else 1.0, poison=poison_last)
    if poisoned and scaled:  # an overflow: skipped, scale backed off, never an error, even with the guard on
        assert th.equal(layer.weight.detach(), before)
        assert step.steps == 0 and scale.skipped_steps == 1 and scale.scale == SCALE / 2 and notified == [1]
    elif poisoned:  # nothing checks: the step is taken, as plain SB3 would take it
        assert step.steps == 1 and first_non_finite(layer) == "weight"
    else:
        th.testing.assert_close(layer.weight.detach(), _reference(micro_batches))
        assert step.steps == 1 and notified == [1]
        assert scale is None or (scale.scale == SCALE and scale.skipped_steps == 0)


def test_the_loss_scale_follows_torch_gradscaler():
    param = th.nn.Parameter(th.ones(3))
    optimizer = th.optim.SGD([param], lr=0.0)
    theirs = th.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = LossScale(init_scale=2.0**10, growth_interval=3)
    overflows = [False, False, True, False, False, False, False, True, True, False, False, False, False]
    for overflow in overflows:
        optimizer.zero_grad()
        theirs.scale(param.sum()).backward()
        if overflow:
            param.grad[0] = math.inf
        theirs.step(optimizer)
        theirs.update()
        ours.update(found_inf=overflow)
        assert ours.scale == theirs.get_scale()
    assert ours.skipped_steps == sum(overflows)


def test_the_loss_scale_stops_growing_where_float32_ends_as_gradscalers_and_the_device_scale_do():
    # Near-zero gradients for millions of steps grow the scale every interval; past float32's largest value the
    # factor would turn every float32 gradient into inf (and a zero one into NaN), and steps would be skipped.
    top = 2.0**127
    theirs = th.amp.GradScaler("cpu", init_scale=top / 4, growth_interval=1)
    host, device = LossScale(init_scale=top / 4, growth_interval=1), LossScale(init_scale=top / 4, growth_interval=1)
    device.to_device(th.device("cpu"))
    param = th.nn.Parameter(th.zeros(1))
    optimizer = th.optim.SGD([param], lr=0.0)
    for _ in range(5):
        optimizer.zero_grad()
        theirs.scale(param.sum()).backward()
        theirs.step(optimizer)
        theirs.update()
        host.update(found_inf=False)
        device.update(found_inf=False)
    assert host.scale == device.scale == theirs.get_scale() == top
    assert th.isfinite(th.ones(1) * host.factor).all()


def test_one_wrapper_per_optimizer_whoever_asks_first():
    layer = th.nn.Linear(2, 1)
    optimizer = th.optim.SGD(layer.parameters(), lr=LR)
    assert optimizer_step(optimizer) is optimizer_step(optimizer, layer)


@pytest.mark.parametrize(
    "make",
    [
        lambda: GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, grad_accum_steps=2, device="cpu"),
        lambda: PrioritizedDQN("MlpPolicy", "CartPole-v1", grad_accum_steps=2, learning_starts=10, device="cpu"),
    ],
    ids=["ppo", "dqn"],
)
def test_the_ppo_and_dqn_families_accumulate_through_the_same_wrapper(make):
    model = make()
    step = optimizer_step(model.policy.optimizer)
    assert step.micro_batches == 2
    model.learn(128)
    assert step.steps > 0 and model._n_updates > 0


def test_plain_sb3_models_get_no_wrapper_until_something_asks():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, device="cpu")
    assert "step" not in vars(model.policy.optimizer), "an untouched SB3 optimizer steps as SB3 wrote it"
    optimizer_step(model.policy.optimizer)
    assert "step" in vars(model.policy.optimizer)


def test_a_non_finite_gradient_at_a_loss_scale_of_one_is_divergence_not_overflow():
    layer = th.nn.Linear(2, 1)
    optimizer = th.optim.SGD(layer.parameters(), lr=LR)
    step = optimizer_step(optimizer, layer)
    scale = LossScale(init_scale=2.0)
    step.scale_losses(scale)
    step.on_non_finite = lambda name: TrainingDiverged(f"{name} diverged")
    _sb3_micro_batch(layer, optimizer, 0, scale.scale, poison=True)  # at 2: an overflow, skipped
    assert scale.skipped_steps == 1 and scale.scale == 1.0
    with pytest.raises(TrainingDiverged, match="weight diverged"):  # at 1 nothing was scaled up to overflow
        _sb3_micro_batch(layer, optimizer, 0, scale.scale, poison=True)
    step.on_non_finite = None
    _sb3_micro_batch(layer, optimizer, 0, scale.scale, poison=True)  # without the guard, GradScaler's rule: skip
    assert scale.skipped_steps == 2 and scale.scale == 0.5


def test_grad_accum_ppo_keeps_the_checked_value():
    model = GradAccumPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, grad_accum_steps=2.0, device="cpu")
    assert model.grad_accum_steps == 2 and isinstance(model.grad_accum_steps, int)
    model.learn(64)
