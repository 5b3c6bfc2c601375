"""Counting where the host reads a tensor's value: ``item()``, ``bool(t)``, ``t.cpu()``, ``t.numpy()`` ...

On a GPU each such read makes the host wait until the device has run everything queued before it, so a training step
with reads in it cannot run ahead of the GPU. On the CPU the same reads cost nothing, which is why they are counted
rather than timed: the count is the same on both, and a CPU test can hold it at zero. The one exception is a blocking
``.to("cpu")`` of a device tensor, counted on a GPU only (on the CPU it cannot be told from a move to the model's
device).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch as th
from torch.overrides import TorchFunctionMode

# What makes the host wait for a tensor's value. Ops whose output size depends on the values (nonzero,
# masked_select, unique) wait too. Transfers to the device (`.to(device)`) do not, and are not counted; a blocking
# `.to("cpu")` from a device is (see `_copies_to_host`).
READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__array__",
        "nonzero",
        "masked_select",
        "unique",
    }
)
_TORCH_DIR = os.path.join(os.path.dirname(th.__file__), "")  # with its separator: torchvision's is not torch's
# torch's optimizers keep their step counters on the host unless they are capturable or fused, so that reading one
# (for the bias correction) never waits for a device: those reads are not counted.
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim", "")


class HostReads(TorchFunctionMode):
    """A torch function mode that counts host reads, by kind and by the line of the caller outside torch.

    ::

        with HostReads() as reads:
            model.train(gradient_steps=8, batch_size=32)
        reads.total, reads.sites.most_common(3)
    """

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self._host_copies: dict[int, weakref.ref[th.Tensor]] = {}  # by id, each dropped when its tensor is

    def _forget(self, key: int) -> Any:
        return lambda _: self._host_copies.pop(key, None)

    @property
    def total(self) -> int:
        """Reads counted so far."""
        return sum(self.kinds.values())

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        # The host copy of a read tensor: its .numpy() is a view of host memory that waits for nothing more (a
        # GPU's `t.cpu().numpy()` is one wait).
        copy = self._host_copies.get(id(args[0])) if name == "numpy" and args else None
        copied = copy is not None and copy() is args[0]
        to_host = name == "to" and _copies_to_host(args, kwargs or {})
        if (name in READS and not copied and not _step_counter(args)) or to_host:
            self.kinds[name] += 1
            self.sites[f"{name} at {_caller()}"] += 1
        out = func(*args, **(kwargs or {}))
        if (name == "cpu" or to_host) and isinstance(out, th.Tensor):
            self._host_copies[id(out)] = weakref.ref(out, self._forget(id(out)))
        return out


def _copies_to_host(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to`` copies a device tensor to the host and waits for it (``non_blocking`` unset).

    On the CPU twin a source is never on a device, so this counts on a GPU only: there, ``.to(device)`` of a CPU
    tensor and ``.to("cpu")`` of a CPU tensor look the same, and both are transfers the host does not wait for."""
    tensor = args[0] if args and isinstance(args[0], th.Tensor) else None
    if tensor is None or tensor.device.type == "cpu":
        return False
    # non_blocking is the first bool of every form (to(dtype, non_blocking, copy), to(device, dtype, ...), to(other, ...))
    if next((a for a in args[1:] if isinstance(a, bool)), kwargs.get("non_blocking", False)):
        return False
    target = kwargs.get("device")
    for a in args[1:]:
        if target is None and isinstance(a, str | th.device):
            target = a
        elif target is None and isinstance(a, th.Tensor):  # to(other): other's device
            target = a.device
    return target is not None and th.device(target).type == "cpu"


def _step_counter(args: Any) -> bool:
    """Whether this is an optimizer reading its own step counter, which lives on the host."""
    tensor = args[0] if args and isinstance(args[0], th.Tensor) else None
    if tensor is None or tensor.device.type != "cpu" or tensor.numel() != 1:
        return False
    return sys._getframe(2).f_code.co_filename.startswith(_OPTIM_DIR)  # 0: here, 1: the mode, 2: the caller


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


@contextmanager
def no_argument_checks() -> Iterator[None]:
    """torch.distributions without argument validation: each check reads a tensor back (a wait on a GPU)."""
    before = th.distributions.Distribution._validate_args
    th.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        th.distributions.Distribution.set_default_validate_args(before)
