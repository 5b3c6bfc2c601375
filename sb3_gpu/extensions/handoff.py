"""The policy's device copy of a step's observations, handed to the device buffer that stores them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th

from sb3_gpu.extensions.hostcopy import queued_observation_copies


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


class StagedObservations:
    """For an off-policy algorithm (a mixin before SB3's class): the policy's device copy of the observations is
    handed to a device buffer (:class:`ObservationHandOff`), so that each observation crosses to the device once."""

    def _sample_action(self, *args: Any, **kwargs: Any) -> Any:
        # SB3's loop copies the observations to the device for the policy, then passes the host array to the buffer's
        # add: handing the buffer that copy makes one crossing instead of two. (An overlapped run adds its transitions
        # later, so the staged copy is not its own by then and the buffer copies from the host.)
        s: Any = self
        buffer, obs, policy = s.replay_buffer, s._last_obs, s.policy
        if not isinstance(buffer, ObservationHandOff) or not isinstance(obs, np.ndarray):
            with queued_observation_copies():
                return super()._sample_action(*args, **kwargs)  # type: ignore[misc]

        def obs_to_tensor(observation: Any) -> tuple[th.Tensor, bool]:
            tensor, vectorized = type(policy).obs_to_tensor(policy, observation)
            if observation is obs:
                buffer.stage(obs, tensor)
            return tensor, vectorized

        policy.obs_to_tensor = obs_to_tensor
        try:
            with queued_observation_copies():
                return super()._sample_action(*args, **kwargs)  # type: ignore[misc]
        finally:
            del policy.obs_to_tensor
