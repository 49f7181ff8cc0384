"""Compiled loops for the CPU index arithmetic (optional extra ``fast``: numba).

On vectors of a few hundred elements, numpy spends most of its time in per-call dispatch:
a 20-level sum-tree descent is 80 array operations, the expansion of a window batch a few
dozen. The loops here do the same arithmetic element by element in compiled code, with the
same IEEE float64 operations in the same order, so their results are bitwise those of the
numpy and torch code they replace (the tests run both). Without numba (or with
``LUCID_REPLAY_KERNELS=0`` in the environment) that code runs instead.

Each kernel is compiled on first use (about a second, cached on disk afterwards).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__: list[str] = []  # internal module

enabled = os.environ.get("LUCID_REPLAY_KERNELS", "1") != "0"  # tests switch it too
_compiled: dict[str, Any] | None = None


def get() -> dict[str, Any] | None:
    """The compiled kernels by name, or ``None`` when switched off or numba is missing."""
    global _compiled, enabled
    if not enabled:
        return None
    if _compiled is None:
        try:
            _compiled = _compile()
        except ImportError:
            enabled = False
            return None
    return _compiled


def _compile() -> dict[str, Any]:
    import numba  # the optional extra; imported only when a kernel is first needed

    jit = numba.njit(cache=True, nogil=True)

    @jit
    def descend(tree: np.ndarray, targets: np.ndarray, levels: int) -> np.ndarray:
        """`sum_tree.search`'s descent, never entering a subtree of zero mass."""
        found = np.empty(targets.shape[0], dtype=np.int64)
        count = 1 << levels
        for i in range(targets.shape[0]):
            node, remaining = 1, targets[i]
            for _ in range(levels):
                left = tree[2 * node]
                if remaining >= left and tree[2 * node + 1] > 0:
                    remaining = remaining - left
                    node = 2 * node + 1
                else:
                    node = 2 * node
            found[i] = node - count
        return found

    @jit
    def count(times: np.ndarray, rows: np.ndarray) -> None:
        """``times[rows] += 1``, counting a repeated row once per occurrence."""
        for i in range(rows.shape[0]):
            times[rows[i]] += 1

    @jit
    def refresh(tree: np.ndarray, leaves: np.ndarray, levels: int) -> None:
        """Recompute the ancestors of ``leaves`` (tree indices of leaves) from their children."""
        for i in range(leaves.shape[0]):
            node = leaves[i]
            for _ in range(levels):
                node >>= 1
                tree[node] = tree[2 * node] + tree[2 * node + 1]

    @jit
    def expand(
        anchor: np.ndarray,
        last: np.ndarray,
        terminated: np.ndarray,
        episode_ids: np.ndarray,
        burn_in: int,
        dilation: int,
        steps: np.ndarray,
        valid: np.ndarray,
        is_init: np.ndarray,
        terminal: np.ndarray,
        record_ids: np.ndarray,
    ) -> bool:
        """`window.expand` for one episode per window (pad, stop after its shift).

        Per window, records ``first .. final`` are valid (their targets lie in the episode);
        the ones before clamp to step 0, the ones after to the last step, and a record at
        (or clamped to) the last step of a terminated episode is terminal.
        """
        clamped = False
        size = steps.shape[1]
        for b in range(anchor.shape[0]):
            first_step, end = anchor[b] - burn_in * dilation, last[b]
            first = max(0, -(first_step // dilation))  # first k with a target >= 0
            final = min(size - 1, (end - first_step) // dilation)  # last k with target <= end
            clamped |= first > 0 or final < size - 1
            for k in range(size):
                step = min(max(first_step + k * dilation, 0), end)
                steps[b, k] = step
                valid[b, k] = first <= k <= final
                is_init[b, k] = k == first
                terminal[b, k] = terminated[b] and step == end
                record_ids[b, k] = episode_ids[b]
        return clamped

    @jit
    def route(
        learning: np.ndarray,
        valid: np.ndarray,
        record_ids: np.ndarray,
        anchor_ids: np.ndarray,
        errors: np.ndarray,
        mask: Any,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Per window: counted records, their largest |error|, its float64 sum in order.

        Also whether a counted error was NaN or infinite.
        """
        rows = valid.shape[0]
        count = np.zeros(rows, dtype=np.int64)
        largest = np.zeros(rows, dtype=np.float64)
        total = np.zeros(rows, dtype=np.float64)
        finite = True
        for b in range(rows):
            anchor, counted, most, added = anchor_ids[b], 0, 0.0, 0.0
            for k in range(valid.shape[1]):
                if not (learning[b, k] and valid[b, k] and record_ids[b, k] == anchor):
                    continue
                if mask is not None and not mask[b, k]:
                    continue
                magnitude = np.float64(abs(errors[b, k]))
                finite &= np.isfinite(magnitude)
                counted += 1
                most = max(most, magnitude)
                added += magnitude
            count[b], largest[b], total[b] = counted, most, added
        return count, largest, total, finite

    @jit
    def copy_rows(
        target: np.ndarray, positions: np.ndarray, source: np.ndarray, slots: Any
    ) -> None:
        """``target[positions[i]] = source[slots[i]]``: rows of bytes (uint8 ``[n, row]``)."""
        for i in range(positions.shape[0]):
            into, row = target[positions[i]], source[slots[i]]
            for j in range(row.shape[0]):  # a plain loop: slice assignment costs ~10x more
                into[j] = row[j]

    return {
        "copy_rows": copy_rows,
        "count": count,
        "descend": descend,
        "refresh": refresh,
        "expand": expand,
        "route": route,
    }
