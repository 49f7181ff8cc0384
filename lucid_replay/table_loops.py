"""Passes over the episode table's columns by episode id: what `EpisodeTable` compiles.

Each pass has a compiled loop (CPU, kernels engine) and the array form it must equal.
"""

from __future__ import annotations

import math

import numpy as np

from lucid_replay import engine
from lucid_replay.engine import Array

__all__: list[str] = []  # internal module


@engine.jit
def first_unissued_loop(ids: np.ndarray, next_id: int) -> int:
    """`EpisodeTable.first_unissued`, compiled."""
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= next_id:
            return i
    return -1


def assign_priorities(
    priority: Array, ids: Array, values: Array, first_id: int, next_id: int, row_count: int
) -> tuple[Array, int, float]:
    """`EpisodeTable.assign_priorities` on arrays (what `assign_priorities_loop` computes).

    Callers reach the loops through this module (``table_loops.name``): `engine.jit`
    swaps in the compiled twins here, not in names other modules imported earlier.
    """
    stored = (ids >= first_id) & (ids < next_id)
    if not bool(stored.all()):
        ids, values = ids[stored], values[stored]
    if ids.shape[0] == 0:
        return ids, 0, -math.inf
    rows = ids & (row_count - 1)
    engine.assign_max(priority, rows, values)
    return rows, engine.count_distinct(rows), float(values.max())


@engine.jit
def assign_priorities_loop(
    priority: np.ndarray,
    ids: np.ndarray,
    values: np.ndarray,
    first_id: int,
    next_id: int,
    row_count: int,
) -> tuple[np.ndarray, int, float]:
    """`EpisodeTable.assign_priorities`, compiled: ``priority[row of id] = value``.

    A repeated id takes the largest of its values; ids outside ``[first_id, next_id)`` are
    skipped. Returns the rows set (one per stored id, in order), how many distinct rows
    that is, and the largest value set (``-inf`` if none).
    """
    rows = np.empty(ids.shape[0], dtype=np.int64)
    kept, row_mask = 0, row_count - 1
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
