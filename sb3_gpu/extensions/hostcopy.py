"""Host arrays to the device in one queued copy.

A copy to a CUDA device from pageable memory first waits for the GPU to finish everything queued before it; a copy
from pinned (page-locked) memory is queued like a kernel, and the host goes on. So on CUDA each array is copied into a
pinned block and sent from there with ``non_blocking=True``. torch's pinned-memory cache hands a block out again only
once the copies queued from it have finished, so the array (and the block) can be reused at once. On any other device
the copy is torch's plain one, as SB3 makes it: that is the CPU twin of the same code.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common import on_policy_algorithm, policies


def to_device(array: Any, device: th.device | str, dtype: th.dtype | None = None) -> th.Tensor:
    """``array`` as a tensor of ``dtype`` (default: its own) on ``device``, through pinned memory on CUDA."""
    array = np.asarray(array)
    if any(stride < 0 for stride in array.strides):  # a reversed view, which torch cannot wrap
        array = array.copy()
    tensor = th.as_tensor(array, dtype=dtype)
    device = th.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def observations_to_device(obs: np.ndarray | dict[str, np.ndarray], device: th.device) -> Any:
    """SB3's ``obs_as_tensor`` (arrays and dicts of arrays), each copied by :func:`to_device`."""
    if isinstance(obs, np.ndarray):
        return to_device(obs, device)
    if isinstance(obs, dict):
        return {key: to_device(value, device) for key, value in obs.items()}
    raise TypeError(f"Unrecognized type of observation {type(obs)}")  # SB3's own message


# SB3's modules that copy observations for the policy: the on-policy rollout and every policy's obs_to_tensor.
_SB3_COPIERS = {module: module.obs_as_tensor for module in (on_policy_algorithm, policies)}
_lock = threading.Lock()
_users = 0


@contextmanager
def queued_observation_copies() -> Iterator[None]:
    """While the block runs, SB3's rollouts and policies copy observations with :func:`observations_to_device`.

    The swap is process-wide (it replaces the name SB3's modules call), so it is counted: nested or concurrent blocks
    (a trainer thread beside the collecting one) restore SB3's own function only when the last one ends.
    """
    global _users
    with _lock:
        if _users == 0:
            for module in _SB3_COPIERS:
                module.obs_as_tensor = observations_to_device  # type: ignore[attr-defined]
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for module, sb3s in _SB3_COPIERS.items():
                    module.obs_as_tensor = sb3s  # type: ignore[attr-defined]
