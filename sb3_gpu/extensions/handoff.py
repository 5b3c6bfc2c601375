"""The policy's device copy of a step's observations, handed to the device buffer that stores them."""

from __future__ import annotations

import numpy as np
import torch as th


class ObservationHandOff:
    """For a device buffer whose ``add`` gets the host array that SB3's loop already copied to the device for the
    policy: :meth:`stage` names that copy, and ``add`` stores it instead of copying the array again (one crossing to
    the device per step, not two)."""

    host_observation_copies: int = 0  # adds whose observations came from the host, not from stage()
    _staged: tuple[np.ndarray, th.Tensor] | None = None

    def stage(self, host_obs: np.ndarray, device_obs: th.Tensor) -> None:
        """Note that ``device_obs`` holds ``host_obs`` on the device already, for the next ``add`` of that same array."""
        self._staged = (host_obs, device_obs)

    def _observations_to_store(self, obs: np.ndarray, host_writes: bool) -> np.ndarray | th.Tensor:
        """The staged device copy where ``obs`` is the staged array (used once), else ``obs`` itself. A buffer that
        writes through numpy views of host storage (``host_writes``) gets ``obs`` either way: the copy is host memory
        too, and a numpy write costs less than a torch copy."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] is obs:
            return obs if host_writes else staged[1]
        self.host_observation_copies += 1
        return obs
