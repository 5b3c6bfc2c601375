"""Logged training figures kept on the device until the logger writes, then read in one go.

SB3's ``train()`` methods read each loss with ``.item()`` at every gradient step, and on a GPU each read makes the host
wait for the device. Here a figure is added as the tensor it is; the sums stay where they were computed, and
:meth:`DeviceLog.write` reads them all with one transfer when SB3's logger is about to write (``dump_logs``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch as th


class DeviceLog:
    """Means (over the gradient steps since the last write) and latest values of logged figures, as tensors.

    Thread-safe: an overlapped training adds from its trainer thread while the collecting thread writes.
    """

    def __init__(self) -> None:
        self._sums: dict[str | tuple[str, ...], th.Tensor] = {}
        self._counts: dict[str | tuple[str, ...], int | th.Tensor] = {}
        self._latest: dict[str, th.Tensor] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles of a model take the figures, not the lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def mean(self, key: str, value: th.Tensor, counts: th.Tensor | None = None) -> None:
        """Add ``value`` (a 0-dim tensor) to the mean logged as ``key``; ``counts``, a 0-dim bool tensor, decides on
        the device whether it does."""
        value = value.detach()
        if counts is not None:
            value = th.where(counts, value, 0.0)
        with self._lock:
            total = self._sums.get(key)
            # float32 sums: a float64 one would cast each value first, a kernel of its own at every step.
            self._sums[key] = value.to(th.float32, copy=True) if total is None else total + value
            self._counts[key] = self._counts.get(key, 0) + (1 if counts is None else counts.double())

    def means(self, keys: tuple[str, ...], values: th.Tensor, counts: th.Tensor | None = None) -> None:
        """Add each element of ``values`` (1-dim) to the mean logged as the key at its position: one add for all."""
        self.mean(keys, values, counts)  # type: ignore[arg-type]

    def latest(self, key: str, value: th.Tensor) -> None:
        """Log ``value`` (a 0-dim tensor) as ``key``, unless a later one replaces it before the write."""
        with self._lock:
            self._latest[key] = value.detach()

    def read(self) -> dict[str, float]:
        """Every pending figure as a number, with one read from the device, and forget them."""
        with self._lock:
            keys: list[str] = []
            tensors: list[th.Tensor] = []
            for key, total in self._sums.items():
                mean = total / self._counts[key]
                names = key if isinstance(key, tuple) else (key,)
                keys += names
                tensors += list(mean.reshape(len(names)).unbind())
            keys += self._latest
            tensors += self._latest.values()
            self._sums, self._counts, self._latest = {}, {}, {}
        if not keys:
            return {}
        device = tensors[0].device
        values = th.stack([t.to(device=device, dtype=th.float64).reshape(()) for t in tensors]).tolist()
        return dict(zip(keys, values, strict=True))

    def write(self, logger: Any) -> dict[str, float]:
        """Record every pending figure in SB3's ``logger``; returns them."""
        values = self.read()
        for key, value in values.items():
            logger.record(key, value)
        return values
