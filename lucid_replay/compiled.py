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
def draw(
    tree: np.ndarray,
    levels: int,
    uniforms: np.ndarray,
    lengths: np.ndarray,
    span: int,
    times: np.ndarray,
    episode_id: np.ndarray,
    priority: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`AnchorSampler._draw_from` without a reuse limit: `draw_rows`, then `count`.

    Returns the rows, steps, episode ids and (if ``priority`` has rows: a prioritized draw)
    priorities of the draws.
    """
    rows, steps = draw_rows(tree, levels, uniforms, lengths, span)
    count(times, rows)
    ids = np.empty(rows.shape[0], dtype=np.int64)
    drawn = np.empty(rows.shape[0] if priority.shape[0] else 0, dtype=np.float64)
    for i in range(rows.shape[0]):
        ids[i] = episode_id[rows[i]]
        if drawn.shape[0]:
            drawn[i] = priority[rows[i]]
    return rows, steps, ids, drawn


@jit
def _recompute_ancestors(tree: np.ndarray, node: int, levels: int) -> None:
    """Recompute the ``levels`` ancestors of tree ``node`` from their children."""
    for _ in range(levels):
        node >>= 1
        tree[node] = tree[2 * node] + tree[2 * node + 1]


@jit
def refresh(tree: np.ndarray, leaves: np.ndarray, levels: int) -> None:
    """Recompute the ancestors of ``leaves`` (tree indices of leaves) from their children."""
    for i in range(leaves.shape[0]):
        _recompute_ancestors(tree, leaves[i], levels)


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
    eta: float,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """`priorities.window_priorities` after its checks: ``(ids, mixed, finite)``.

    Per window, over the records that are in the learning region, valid, of the anchor's
    episode and in ``mask`` (None: all): ``eta * max |error| + (1 - eta) * mean |error|``,
    the float64 sum taken in record order. The windows without such a record are left
    out of ``ids`` (their anchors' episode ids) and ``mixed``. ``finite``: no mix is NaN or
    infinite (a counted error was, or their sum overflowed).
    """
    rows = valid.shape[0]
    ids = np.empty(rows, dtype=np.int64)
    mixed = np.empty(rows, dtype=np.float64)
    kept, finite = 0, True
    for b in range(rows):
        anchor, counted, most, added = anchor_ids[b], 0, 0.0, 0.0
        for k in range(valid.shape[1]):
            if not (learning[b, k] and valid[b, k] and record_ids[b, k] == anchor):
                continue
            if mask is not None and not mask[b, k]:
                continue
            magnitude = np.float64(abs(errors[b, k]))
            counted += 1
            most = max(most, magnitude)
            added += magnitude
        if counted:
            value = eta * most + (1.0 - eta) * (added / counted)
            finite &= np.isfinite(value)
            ids[kept], mixed[kept] = anchor, value
            kept += 1
    return ids[:kept], mixed[:kept], finite


@jit
def assign_priorities(
    priority: np.ndarray,
    ids: np.ndarray,
    values: np.ndarray,
    first_id: int,
    next_id: int,
    row_mask: int,
) -> tuple[np.ndarray, int, float]:
    """`EpisodeTable.assign_priorities`: ``priority[row of id] = value`` for stored ids.

    A repeated id takes the largest of its values; ids outside ``[first_id, next_id)`` are
    skipped. Returns the rows set (one per stored id, in order), how many distinct rows
    that is, and the largest value set (``-inf`` if none).
    """
    rows = np.empty(ids.shape[0], dtype=np.int64)
    kept = 0
    for i in range(ids.shape[0]):
        if first_id <= ids[i] < next_id:
            rows[kept] = ids[i] & row_mask
            priority[rows[kept]] = -1.0  # priorities are positive: marks a row not set yet
            kept += 1
    distinct, largest, j = 0, -np.inf, 0
    for i in range(ids.shape[0]):
        if first_id <= ids[i] < next_id:
            row, value = rows[j], values[i]
            j += 1
            if priority[row] < 0:
                distinct += 1
                priority[row] = value
            elif value > priority[row]:
                priority[row] = value
            largest = max(largest, value)
    return rows[:kept], distinct, largest


@jit
def refresh_leaves(
    tree: np.ndarray,
    levels: int,
    rows: np.ndarray,
    episode_id: np.ndarray,
    length: np.ndarray,
    times_sampled: np.ndarray,
    first_id: int,
    next_id: int,
    reuse_limit: int,
    span: int,
    per_anchor: bool,
    powered: np.ndarray,
) -> float:
    """`AnchorSampler.leaf_values` of ``rows`` into their leaves; returns the new total.

    The leaves' ancestors are recomputed as `refresh` does.
    A row is live when its episode id is in ``[first_id, next_id)`` and, with a
    ``reuse_limit`` (``-1``: none), it was drawn fewer times than that. Its mass is its count
    of eligible anchors for ``span`` (``per_anchor``) or 1 if it has any; a live row gets its
    mass, a dead one 0. For a prioritized tree, ``powered[i]`` is ``(p / scale) ** alpha`` of
    ``rows[i]`` (computed by the caller with numpy, whose power this does not reproduce), and
    a live row with an eligible anchor gets ``mass * powered[i]``; ``powered`` is empty for a
    uniform tree.
    """
    leaf0 = tree.shape[0] // 2
    weighted = powered.shape[0] > 0
    for i in range(rows.shape[0]):
        row = rows[i]
        live = first_id <= episode_id[row] < next_id
        live &= reuse_limit < 0 or times_sampled[row] < reuse_limit
        anchors = max(length[row] - (span - 1), 0)
        mass = np.float64(anchors if per_anchor else min(anchors, 1))
        if not weighted:
            tree[leaf0 + row] = mass if live else 0.0
        else:
            tree[leaf0 + row] = mass * powered[i] if live and anchors > 0 else 0.0
    for i in range(rows.shape[0]):
        _recompute_ancestors(tree, leaf0 + rows[i], levels)
    return float(tree[1])


KERNELS: dict[str, Any] = {
    "copy_blocks": copy_blocks,
    "gather_records": gather_records,
    "count": count,
    "draw_rows": draw_rows,
    "draw": draw,
    "descend": descend,
    "refresh": refresh,
    "expand": expand,
    "route": route,
    "assign_priorities": assign_priorities,
    "refresh_leaves": refresh_leaves,
}
