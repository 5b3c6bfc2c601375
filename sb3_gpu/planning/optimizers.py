"""The optimizers a plan's model trains with: fused on a GPU (the NaN guard then skips a bad step on the device, with
no wait), and QR-DQN's named so that the kwargs given reach it. One owner for the model's build, for a model loaded
to go on training, and for the probe that times the step."""

from __future__ import annotations

from typing import Any

import torch as th

from sb3_gpu.config.schema import get_algo

# Optimizers whose fused kernels take a found_inf flag: the NaN guard then skips a step on the device, with no wait.
FUSED_OPTIMIZERS = (th.optim.Adam, th.optim.AdamW, th.optim.SGD)


def planned_policy_kwargs(
    algo: str, policy_kwargs: dict[str, Any], batch_size: int, device: str, fused_optimizer: bool = True
) -> dict[str, Any]:
    """``policy_kwargs`` as the plan builds ``algo``'s model on ``device`` with them (``fused_optimizer=False``: with
    the optimizer implementation plain SB3 gets, for a baseline)."""
    if algo == "qrdqn":
        policy_kwargs = qrdqn_optimizer(policy_kwargs, batch_size)
    spec = get_algo(algo)
    if fused_optimizer and device.startswith("cuda") and spec.extended_class is not None:
        policy_kwargs = fused(policy_kwargs, on_policy=spec.on_policy)
    return policy_kwargs


def qrdqn_optimizer(policy_kwargs: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """``policy_kwargs`` with QR-DQN's optimizer named. Where none is named, sb3-contrib's QR-DQN takes Adam with the
    paper's ``eps=0.01 / batch_size`` and replaces whatever ``optimizer_kwargs`` were given (a fused Adam's too);
    named, they are kept, on top of that eps."""
    if "optimizer_class" in policy_kwargs:
        return policy_kwargs
    given = policy_kwargs.get("optimizer_kwargs") or {}
    return {**policy_kwargs, "optimizer_class": th.optim.Adam, "optimizer_kwargs": {"eps": 0.01 / batch_size, **given}}


def fused(policy_kwargs: dict[str, Any], on_policy: bool) -> dict[str, Any]:
    """``policy_kwargs`` with a fused optimizer, unless its optimizer has none or the user chose an implementation.

    :param on_policy: an actor-critic policy, whose Adam SB3 gives ``eps=1e-5`` where no ``optimizer_kwargs`` are given
    """
    optimizer_class = policy_kwargs.get("optimizer_class", th.optim.Adam)
    given = policy_kwargs.get("optimizer_kwargs")
    if optimizer_class not in FUSED_OPTIMIZERS or {"fused", "foreach"} & set(given or {}):
        return policy_kwargs
    optimizer_kwargs = (
        dict(given) if given is not None else {"eps": 1e-5} if on_policy and optimizer_class is th.optim.Adam else {}
    )
    return {**policy_kwargs, "optimizer_kwargs": {**optimizer_kwargs, "fused": True}}


def fuse_loaded(optimizer: th.optim.Optimizer) -> None:
    """Fuse ``optimizer`` where a plan asks for it after its state was loaded: a model saved by a plain optimizer (a CPU
    run resumed on a GPU) gets the saved groups' flags back from torch's ``load_state_dict``, and its step counts stay
    on the host, where the fused kernels read them from the parameters' device."""
    if type(optimizer) not in FUSED_OPTIMIZERS:
        return
    for group in optimizer.param_groups:
        if group.get("fused"):
            continue
        group["fused"], group["foreach"] = True, None  # torch refuses the two together
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, th.Tensor):
                optimizer.state[param]["step"] = step.to(device=param.device, dtype=th.float32)
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]  # as torch's constructor sets it
