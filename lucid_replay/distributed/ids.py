"""Global episode ids: shard, incarnation and local id packed in one non-negative int64.

Layout (63 bits)::

    bit 62 .. 55   shard         (8 bits: up to 256 shards)
    bit 54 .. 47   incarnation   (8 bits: a shard restarts at most 255 times)
    bit 46 .. 0    local id      (47 bits: 1.4e14 episodes per shard)

A shard issues local ids 0, 1, 2, ... as a single buffer does. Incarnation ``r`` of a shard
issues local ids from ``starts[r]`` on (the ``next_id`` of the checkpoint it restarted from,
0 for the first), so a local number re-issued after a restart carries other incarnation bits
than the lost episode that first had it: a stale id never reaches the new episode. All
functions are vectorised over numpy int64 arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__: list[str] = []  # internal module

SHARD_BITS = 8
INCARNATION_BITS = 8
LOCAL_BITS = 47
MAX_SHARDS = 1 << SHARD_BITS
MAX_INCARNATIONS = 1 << INCARNATION_BITS
MAX_LOCAL = (1 << LOCAL_BITS) - 1
_INCARNATION_MASK = MAX_INCARNATIONS - 1
_SHARD_SHIFT = INCARNATION_BITS + LOCAL_BITS


def encode(shard: int, incarnations: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Global ids of ``local`` ids of ``shard`` issued by ``incarnations`` (int64, elementwise).

    Examples
    --------
    >>> ids = encode(2, np.array([0, 1]), np.array([5, 6]))
    >>> [int(i) for i in ids]
    [72057594037927941, 72198331526283270]
    >>> [a.tolist() for a in decode(ids)]
    [[2, 2], [0, 1], [5, 6]]
    """
    shard_bits = np.int64(shard) << np.int64(_SHARD_SHIFT)
    incarnation_bits = np.asarray(incarnations, dtype=np.int64) << np.int64(LOCAL_BITS)
    packed: np.ndarray = shard_bits | incarnation_bits | np.asarray(local, dtype=np.int64)
    return packed


def decode(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(shard, incarnation, local)`` of non-negative global ``ids`` (int64 arrays)."""
    ids = np.asarray(ids, dtype=np.int64)
    shard = ids >> np.int64(_SHARD_SHIFT)
    incarnation = (ids >> np.int64(LOCAL_BITS)) & np.int64(_INCARNATION_MASK)
    return shard, incarnation, ids & np.int64(MAX_LOCAL)


def incarnation_of(local: np.ndarray, starts: Sequence[int]) -> np.ndarray:
    """The incarnation that issued each stored ``local`` id, from each one's first local id.

    ``starts`` is non-decreasing; an empty range (a restart before any add) is skipped, so a
    local id belongs to the last incarnation whose start is at or below it.
    """
    return np.searchsorted(np.asarray(starts, dtype=np.int64), local, side="right") - 1


def issued_by(
    incarnation: np.ndarray, local: np.ndarray, starts: Sequence[int], next_id: int
) -> np.ndarray:
    """Bool: ``(incarnation, local)`` was issued by that incarnation and may be stored.

    Its number must lie in the range the incarnation owns now.

    Incarnation ``r`` owns ``[starts[r], starts[r + 1])`` once it has been replaced (the rest
    of what it issued was lost) and ``[starts[r], next_id)`` while it runs.
    """
    bounds = np.asarray([*starts, next_id], dtype=np.int64)
    known = (incarnation >= 0) & (incarnation < len(starts))
    at = np.where(known, incarnation, 0)
    owned: np.ndarray = known & (local >= bounds[at]) & (local < bounds[at + 1])
    return owned
