"""The sum and min trees behind prioritized replay: sums and minima over a million priorities, searched and updated
for a whole batch at once.

The trees are ``fanout``-ary and kept as one flat array, level by level: with fanout 16 and a top level of at most
4096 nodes, a million leaves need two levels below the top, so a batch costs a few numpy calls per level and no
Python loop over samples (or two small compiled loops, with numba).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sb3_gpu.common.errors import ConfigError, install_hint

try:
    from sb3_gpu.extensions.per import kernels
except Exception:  # numba is the optional ``fast`` extra; a broken install (or no cache dir) means numpy
    kernels = None  # type: ignore[assignment]


def tree_backends() -> list[str]:
    """The backends this install can run, the default first: ``numba`` (the ``fast`` extra) and ``numpy``."""
    return ["numba", "numpy"] if kernels is not None else ["numpy"]


def level_sizes(capacity: int, fanout: int, top: int) -> list[int]:
    """The node counts of a tree's levels, leaves first, up to the first level of at most ``top`` nodes.

    Every level below the top is whole groups of whole groups: the leaves are padded (with empty leaves) to
    ``top_size * fanout ** (levels - 1)``, so that a search running past the end still lands on a leaf, never outside.
    """
    levels = 1
    while -(-capacity // fanout ** (levels - 1)) > top:
        levels += 1
    top_size = -(-capacity // fanout ** (levels - 1))
    return [top_size * fanout**k for k in range(levels - 1, -1, -1)]


def level_offsets(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Where each level starts in the flat sums array (all levels) and the flat minima array (all but the leaves)."""
    sum_offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
    min_offsets = np.cumsum([0, *sizes[1:-1]], dtype=np.int64)[: len(sizes) - 1]
    return sum_offsets, min_offsets


def last_positive_before(leaves: np.ndarray, nodes: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Move empty picks (rounding past a group's end, rare) onto the nearest non-empty leaf before them."""
    positive = np.flatnonzero(leaves > 0)
    if not len(positive):
        raise ValueError("cannot search a tree whose leaves are all zero")
    empty = values <= 0
    nodes[empty] = positive[np.maximum(np.searchsorted(positive, nodes[empty]) - 1, 0)]
    return nodes, leaves[nodes]


class SumMinTree:
    """Sums and minima over ``capacity`` non-negative leaves; empty leaves count 0 in sums and +inf in minima.

    Levels of ``fanout``-ary nodes are built up from the leaves until one has at most ``top`` nodes; a search
    starts there with one cumulative sum and binary searches, then descends one level per step. All levels live in
    one flat array (``sums`` holds views of it), with each group of ``fanout`` siblings contiguous. Minima are kept
    from the first level up (a leaf's minimum is itself). With numba installed (the ``fast`` extra) searches and
    updates run as compiled loops over the same arrays; otherwise as numpy calls over the whole batch, where a
    batch's groups are transposed to ``(fanout, batch)`` since numpy reduces across a batch far faster than along
    rows of 16.
    """

    def __init__(self, capacity: int, fanout: int = 16, top: int | None = None, backend: str = "auto"):
        if capacity < 1 or fanout < 2:
            raise ValueError(f"capacity must be >= 1 and fanout >= 2, got {capacity} and {fanout}")
        if backend not in ("auto", "numpy", "numba"):
            raise ValueError(f"backend must be auto, numpy or numba, got {backend!r}")
        if backend == "numba" and kernels is None:
            raise ConfigError(f"the numba backend needs numba: {install_hint('fast')}")
        self.capacity, self.fanout = capacity, fanout
        self.backend = "numba" if backend == "auto" and kernels is not None else "numpy" if backend == "auto" else backend
        if top is None:  # a cumulative sum over the top costs numpy one call but compiled loops a pass per search
            top = 256 if self.backend == "numba" else 4096
        sizes = level_sizes(capacity, fanout, top)
        self._sum_offsets, self._min_offsets = level_offsets(sizes)
        self._sizes = sizes
        self._sums = np.zeros(sum(sizes), dtype=np.float64)
        self._mins = np.full(sum(sizes[1:]), np.inf, dtype=np.float64)
        self._strict_lower = np.tril(np.ones((fanout, fanout)), -1)  # exclusive running sums as one small matmul
        self._make_views()

    def clear(self) -> None:
        """Empty every leaf (the views stay those of the same arrays)."""
        self._sums.fill(0.0)
        self._mins.fill(np.inf)

    def _make_views(self) -> None:
        self.sums = [self._sums[o : o + n] for o, n in zip(self._sum_offsets, self._sizes, strict=True)]
        self.mins = [self._mins[o : o + n] for o, n in zip(self._min_offsets, self._sizes[1:], strict=True)]

    def __getstate__(self) -> dict[str, Any]:
        # Pickle would copy each view apart from the flat arrays; keep only the arrays and rebuild the views.
        return {k: v for k, v in self.__dict__.items() if k not in ("sums", "mins")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.backend == "numba" and kernels is None:  # saved where numba was installed, loaded where it is not
            self.backend = "numpy"
        self._make_views()

    @property
    def total(self) -> float:
        return float(self.sums[-1].sum())

    @property
    def min(self) -> float:
        if self.mins:
            return float(self.mins[-1].min())
        leaves = self.sums[0]
        return float(np.min(leaves, where=leaves > 0, initial=np.inf))

    def __getitem__(self, indices: np.ndarray) -> np.ndarray:
        return self.sums[0][indices]

    def _groups(self, level: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """The children of ``parents`` as a C-ordered ``(fanout, batch)`` array."""
        return np.ascontiguousarray(np.take(level.reshape(-1, self.fanout), parents, axis=0).T)

    def update(self, indices: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``indices`` to ``values`` (the last write wins for repeated indices) and refresh their ancestors."""
        nodes = np.asarray(indices, dtype=np.int64)
        values = np.asarray(values, dtype=np.float64)
        if self.backend == "numba":
            assert kernels is not None
            values = np.ascontiguousarray(np.broadcast_to(values, nodes.shape))
            kernels.update(self._sums, self._mins, self._sum_offsets, self._min_offsets, self.fanout, nodes, values)
            return
        self.sums[0][nodes] = values
        for level in range(1, len(self.sums)):
            # Repeated parents are written repeatedly with the same value: cheaper than np.unique.
            nodes = nodes // self.fanout
            children = self._groups(self.sums[level - 1], nodes)
            self.sums[level][nodes] = children.sum(axis=0)
            if level == 1:
                self.mins[0][nodes] = np.min(children, axis=0, where=children > 0, initial=np.inf)
            else:
                self.mins[level - 1][nodes] = self._groups(self.mins[level - 2], nodes).min(axis=0)

    def update_range(self, start: int, values: np.ndarray) -> None:
        """Set the consecutive leaves from ``start`` (what each env step adds): contiguous slices, no gathers."""
        if self.backend == "numba":
            self.update(np.arange(start, start + len(values)), values)
            return
        values = np.asarray(values, dtype=np.float64)
        low, high = start, start + len(values)
        self.sums[0][low:high] = values
        for level in range(1, len(self.sums)):
            low, high = low // self.fanout, (high - 1) // self.fanout + 1
            below = slice(low * self.fanout, high * self.fanout)
            children = self.sums[level - 1][below].reshape(-1, self.fanout)
            self.sums[level][low:high] = children.sum(axis=1)
            if level == 1:
                self.mins[0][low:high] = np.min(children, axis=1, where=children > 0, initial=np.inf)
            else:
                self.mins[level - 1][low:high] = self.mins[level - 2][below].reshape(-1, self.fanout).min(axis=1)

    def find(self, prefix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each value ``u`` in ``[0, total)``, the leaf ``i`` with ``sum(leaves[:i]) <= u < sum(leaves[:i+1])``.

        Returns the leaves' indices and values. Never a leaf of zero value, even where rounding puts ``u`` at or
        past the total.
        """
        prefix = np.array(prefix, dtype=np.float64)
        top = self.sums[-1]
        inclusive = np.cumsum(top)
        if self.backend == "numba":
            assert kernels is not None
            nodes, values = np.empty(len(prefix), dtype=np.int64), np.empty(len(prefix))
            kernels.find(self._sums, self._sum_offsets, self.fanout, inclusive, prefix, nodes, values)
        else:
            nodes = np.minimum(np.searchsorted(inclusive, prefix, side="right"), len(top) - 1)
            prefix -= inclusive[nodes] - top[nodes]
            np.maximum(prefix, 0.0, out=prefix)
            columns = np.arange(len(prefix))
            for level in range(len(self.sums) - 2, -1, -1):
                exclusive = self._strict_lower @ self._groups(self.sums[level], nodes)
                # The last child is taken when rounding runs past the others; repaired below if it is empty.
                child = (exclusive[1:] <= prefix).sum(axis=0)
                prefix -= np.take(exclusive, child * len(prefix) + columns)
                nodes = nodes * self.fanout + child
            values = self.sums[0][nodes]
        if not (values > 0).all():
            nodes, values = last_positive_before(self.sums[0], nodes, values)
        return nodes, values
