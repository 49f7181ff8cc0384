"""The compiled kernels (numba): imported by `lucid_replay.kernels` only when numba is there.

Module-level functions, so that numba caches them on disk (a kernel that refers to another
function through a closure is compiled again in every process). This module holds the index
arithmetic (sum trees, draws, window expansion, priority routing); the gather's raw memory
copies are in `lucid_replay.compiled_memory`.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from lucid_replay.compiled_memory import copy_blocks, gather_records

__all__: list[str] = []  # internal module


jit = numba.njit(cache=True, nogil=True)


@jit
def descend(tree: np.ndarray, targets: np.ndarray, levels: int) -> np.ndarray:
    """`sum_tree.search`'s descent, never entering a subtree of zero mass.

    Level by level for all targets at once: the reads of one level are independent, so a
    tree that a learner's step evicted from the caches is read with many misses in flight
    rather than one chain of misses per target.
    """
    count = 1 << levels
    nodes = np.ones(targets.shape[0], dtype=np.int64)
    remaining = targets.copy()
    for _ in range(levels):
        for i in range(targets.shape[0]):
            node = nodes[i]
            left = tree[2 * node]
            if remaining[i] >= left and tree[2 * node + 1] > 0:
                remaining[i] = remaining[i] - left
                nodes[i] = 2 * node + 1
            else:
                nodes[i] = 2 * node
    return nodes - count


@jit
def draw_rows(
    tree: np.ndarray, levels: int, uniforms: np.ndarray, lengths: np.ndarray, span: int
) -> tuple[np.ndarray, np.ndarray]:
    """`AnchorSampler._draw_rows` after its uniforms: rows by leaf mass, a step in each.

    Row ``i`` is the leaf of target ``uniforms[i, 0] * total``; its step is
    ``min(int(uniforms[i, 1] * anchors), anchors - 1)`` for its ``anchors`` eligible ones.
    """
    rows = descend(tree, uniforms[:, 0] * tree[1], levels)
    steps = np.empty(rows.shape[0], dtype=np.int64)
    for i in range(rows.shape[0]):
        anchors = max(lengths[rows[i]] - (span - 1), 0)
        steps[i] = min(np.int64(uniforms[i, 1] * anchors), anchors - 1)
    return rows, steps


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
    length: int,
    dilation: int,
    steps: np.ndarray,
    valid: np.ndarray,
    is_init: np.ndarray,
    terminal: np.ndarray,
    record_ids: np.ndarray,
    learning: np.ndarray,
    sequence: np.ndarray,
) -> bool:
    """`window.expand` for one episode per window (pad, stop after its shift).

    Per window, records ``first .. final`` are valid (their targets lie in the episode);
    the ones before clamp to step 0, the ones after to the last step, and a record at
    (or clamped to) the last step of a terminated episode is terminal. Also writes the
    window's constants: ``learning`` (records ``burn_in .. burn_in + length - 1``) and
    ``sequence`` (``k``).
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
            learning[b, k] = burn_in <= k < burn_in + length
            sequence[b, k] = k
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


KERNELS: dict[str, Any] = {
    "copy_blocks": copy_blocks,
    "gather_records": gather_records,
    "count": count,
    "draw_rows": draw_rows,
    "descend": descend,
    "refresh": refresh,
    "expand": expand,
    "route": route,
}
