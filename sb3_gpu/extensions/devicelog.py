"""Logged training figures kept on the device until the logger writes, then read in one go.

SB3's ``train()`` methods read each loss with ``.item()`` at every gradient step, and on a GPU each read makes the host
wait for the device. Here a figure is added as the tensor it is; the sums stay where they were computed, and
:meth:`DeviceLog.write` reads them all with one transfer when SB3's logger is about to write (``dump_logs``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
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
        self._taken: dict[GraphSums, th.Tensor] = {}  # each one's state when last taken
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles of a model take the figures, not the lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def mean(self, key: str | tuple[str, ...], value: th.Tensor, counts: th.Tensor | None = None) -> None:
        """Add ``value`` (a 0-dim tensor) to the mean logged as ``key``; ``counts``, a 0-dim bool tensor, decides on
        the device whether it does. With a tuple of keys, ``value`` is 1-dim: each element goes to the mean logged as
        the key at its position, in one add for all."""
        value = value.detach()
        if counts is not None:
            value = th.where(counts, value, 0.0)
        with self._lock:
            total = self._sums.get(key)
            # float32 sums: a float64 one would cast each value first, a kernel of its own at every step.
            self._sums[key] = value.to(th.float32, copy=True) if total is None else total + value
            self._counts[key] = self._counts.get(key, 0) + (1 if counts is None else counts.to(_wide(counts.device)))

    def take(self, sums: GraphSums) -> None:
        """Take what ``sums`` holds now (one copy, on the device): its figures' means since the last read are logged at
        the next. Call it after the compiled steps that add to it, from the thread that runs them."""
        state = sums.state.clone()
        if sums.rebased:
            # From zero again after each take, on the thread whose steps add to it (so no add falls in between): a
            # float32 sum kept for the whole run would lose a figure's digits, and its count stop at 2**24.
            sums.state.sub_(state)
        with self._lock:
            earlier = self._taken.get(sums) if sums.rebased else None
            self._taken[sums] = state if earlier is None else earlier + state

    def latest(self, key: str, value: th.Tensor) -> None:
        """Log ``value`` (a 0-dim tensor) as ``key``, unless a later one replaces it before the write."""
        with self._lock:
            self._latest[key] = value.detach()

    def pending(self) -> bool:
        """Whether a figure waits to be read."""
        with self._lock:
            return bool(self._sums or self._latest or self._taken)

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
            # A graph's sums: the means of what was added since the last read, and how many (a key none was added
            # to is left out, as one never logged).
            counted: list[str] = []
            for sums, state in self._taken.items():
                added = state - sums.read_state
                if not sums.rebased:
                    sums.read_state = state
                keys += sums.keys
                tensors += list((added[0] / added[1]).unbind())
                counted += [f"{_COUNT}{key}" for key in sums.keys]
                tensors += list(added[1].unbind())
            keys += counted
            self._sums, self._counts, self._latest, self._taken = {}, {}, {}, {}
        if not keys:
            return {}
        device = tensors[0].device
        read = th.stack([t.to(device=device, dtype=_wide(device)).reshape(()) for t in tensors]).tolist()
        values = dict(zip(keys, read, strict=True))
        for key in counted:
            if not values.pop(key):
                del values[key[len(_COUNT) :]]
        return values

    def write(self, logger: Any) -> dict[str, float]:
        """Record every pending figure in SB3's ``logger``; returns them."""
        values = self.read()
        for key, value in values.items():
            logger.record(key, value)
        return values


def _wide(device: th.device) -> th.dtype:
    """float64 for counts and reads, but on MPS, which has none."""
    return th.float32 if device.type == "mps" else th.float64


_COUNT = "\0count:"  # read()'s own keys for a graph's counts, which no logged key can be


class GraphSums:
    """Sums of logged figures that a compiled step adds to inside its graph, with :meth:`add`: fused into a kernel the
    step runs anyway, they cost no op of their own, and no output to copy out of a CUDA graph at each step, as a
    figure returned and then added up would. :meth:`DeviceLog.take` hands them to the log, once per ``train()``.

    The sums run for the whole training (float64: a difference of two sums a million steps apart keeps a float32
    figure's digits). The log reads differences, so that nothing has to reset them between the trainer's steps and
    a read on another thread (overlapped training). On MPS, which has no float64, :meth:`DeviceLog.take` sets them
    back to zero instead (``rebased``).
    """

    def __init__(self, keys: Sequence[str], device: th.device | str):
        self.keys = tuple(keys)
        device = th.device(device)
        dtype = _wide(device)
        self.state = th.zeros(2, len(self.keys), dtype=dtype, device=device)  # each key's sum, and its count
        th._dynamo.mark_static_address(self.state)  # a CUDA graph adds to it in place
        self.read_state = th.zeros_like(self.state)  # the state the log last read (its own, under its lock)
        self.rebased = dtype != th.float64

    def add(self, figures: Mapping[str, th.Tensor]) -> None:
        """Add each figure (a 0-dim tensor) to its key's sum, and one to its count; keys not given are left alone."""
        unknown = set(figures) - set(self.keys)
        if unknown:  # a figure left out of the log would be lost without a word
            raise KeyError(f"no sum for {sorted(unknown)}; the sums are {list(self.keys)}")
        zero = self.state.new_zeros(())
        values = [figures[k].detach().to(self.state.dtype) if k in figures else zero for k in self.keys]
        counts = [zero + 1 if k in figures else zero for k in self.keys]
        self.state.add_(th.stack([th.stack(values), th.stack(counts)]))
