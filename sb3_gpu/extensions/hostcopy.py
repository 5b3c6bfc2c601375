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


def _host_tensor(array: Any, dtype: th.dtype | None) -> th.Tensor:
    # Contiguous: torch cannot wrap a reversed view, and a strided or broadcast one would not pin as one block.
    return th.as_tensor(np.ascontiguousarray(array), dtype=dtype)


def to_device(array: Any, device: th.device | str, dtype: th.dtype | None = None) -> th.Tensor:
    """``array`` as a tensor of ``dtype`` (default: its own) on ``device``, through pinned memory on CUDA."""
    tensor, device = _host_tensor(array, dtype), th.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def copy_into(target: th.Tensor, array: Any) -> None:
    """``target.copy_(array)``, converted on the host and sent through pinned memory on CUDA."""
    tensor = _host_tensor(array, target.dtype)
    if target.device.type != "cuda":
        target.copy_(tensor)
    else:
        target.copy_(tensor.pin_memory(), non_blocking=True)


def observations_to_device(obs: np.ndarray | dict[str, np.ndarray], device: th.device) -> Any:
    """SB3's ``obs_as_tensor`` (arrays and dicts of arrays), each copied by :func:`to_device`."""
    if isinstance(obs, np.ndarray):
        return to_device(obs, device)
    if isinstance(obs, dict):
        return {key: to_device(value, device) for key, value in obs.items()}
    raise TypeError(f"Unrecognized type of observation {type(obs)}")  # SB3's own message


# SB3's modules that copy observations for the policy: the on-policy rollout and every policy's obs_to_tensor.
_SB3_COPIERS = (on_policy_algorithm, policies)
_lock = threading.Lock()
_users = 0
_replaced: dict[Any, Any] = {}  # what each module held when the first block began


@contextmanager
def queued_observation_copies() -> Iterator[None]:
    """While the block runs, SB3's rollouts and policies copy observations with :func:`observations_to_device`.

    The swap is process-wide (it replaces the name SB3's modules call), so it is counted: nested or concurrent blocks
    (a trainer thread beside the collecting one) put back what the modules held only when the last one ends, and a
    function that replaced the swapped one meanwhile stays.
    """
    global _users
    with _lock:
        if _users == 0:
            for module in _SB3_COPIERS:
                _replaced[module] = module.obs_as_tensor
                module.obs_as_tensor = observations_to_device  # type: ignore[attr-defined]
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for module, before in _replaced.items():
                    if module.obs_as_tensor is observations_to_device:  # else replaced since: the newer one stays
                        module.obs_as_tensor = before
                _replaced.clear()
