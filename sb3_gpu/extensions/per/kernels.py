"""Compiled search and update loops for ``SumMinTree`` (the ``fast`` extra: numba).

Both walk the same flat level arrays as the numpy path and keep its contract: ``find`` may return a zero leaf only
when rounding pushes a prefix past the last child, which the caller repairs. Imported only when numba is present.
"""

from __future__ import annotations

import numba
import numpy as np


def _jit(fn):
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except Exception:  # no writable cache dir anywhere: compile in each process instead
        return numba.njit(nogil=True)(fn)


@_jit
def find(sums, offsets, fanout, top_inclusive, prefix, out_nodes, out_values):
    # Level by level over the whole batch rather than sample by sample: the batch's loads at one level are
    # independent, so the CPU overlaps their cache misses (a million leaves do not fit in cache).
    levels = len(offsets)
    top = offsets[levels - 1]
    nodes = out_nodes
    for b in range(len(prefix)):
        node = min(np.searchsorted(top_inclusive, prefix[b], side="right"), len(top_inclusive) - 1)
        prefix[b] = max(prefix[b] - (top_inclusive[node] - sums[top + node]), 0.0)
        nodes[b] = node
    for level in range(levels - 2, -1, -1):
        for b in range(len(prefix)):
            base = offsets[level] + nodes[b] * fanout
            p = prefix[b]
            child = 0
            while child < fanout - 1:
                value = sums[base + child]
                if p < value:
                    break
                p -= value
                child += 1
            prefix[b] = p
            nodes[b] = nodes[b] * fanout + child
    for b in range(len(prefix)):
        out_values[b] = sums[nodes[b]]


@_jit
def update(sums, mins, sum_offsets, min_offsets, fanout, nodes, values):
    for b in range(len(nodes)):
        node = nodes[b]
        sums[node] = values[b]
        for level in range(1, len(sum_offsets)):
            parent = node // fanout
            below = sum_offsets[level - 1] + parent * fanout
            total = 0.0
            smallest = np.inf
            for child in range(fanout):
                total += sums[below + child]
                if level == 1:
                    if 0.0 < sums[below + child] < smallest:  # empty leaves (0) do not count in minima
                        smallest = sums[below + child]
                else:
                    smallest = min(smallest, mins[min_offsets[level - 2] + parent * fanout + child])
            sums[sum_offsets[level] + parent] = total
            mins[min_offsets[level - 1] + parent] = smallest
            node = parent
