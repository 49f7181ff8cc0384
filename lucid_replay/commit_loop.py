"""One segment commit, compiled: eviction, the copy, the new row and the directory.

`Segments.commit` spells a commit in some twenty Python steps across the table, the ring,
the store and the directory (count the segments to evict, update their episodes, drop the
episodes that left, copy the steps, append the row, move the episode's end, note the rows
whose leaves changed). Each costs a fraction of a microsecond, but together, and from cold
memory as an actor's commits run, they cost several times the copy of a 256-step segment.
On CPU with the compiled engine, ``unit="chunk"`` and no reuse limit, `commit` here does the
same in one compiled loop, `commit_loop`. It writes the same values to the same columns in
the same order of effects (evict, copy into slots no row claims, append); the
engine-equality tests compare the two, state for state and draw for draw. Imported on that
path only: it needs numba.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lucid_replay import engine, ring_copies
from lucid_replay.directory import INTEGER_COLUMNS as EPISODE_INTEGERS
from lucid_replay.table import INTEGER_COLUMNS as ROW_INTEGERS

__all__: list[str] = []  # internal module


def commit(
    segments: Any,
    slot: int,
    steps: Mapping[str, torch.Tensor],
    sources: np.ndarray,
    max_priority: float,
) -> int:
    """`Segments.commit` of checked ``steps``, at addresses ``sources`` (`TransitionRing.sources`).

    ``segments`` is the store's `Segments` (typed loosely: it imports this module). Returns
    the new segment's id.
    """
    store, table, directory = segments.store, segments.store.table, segments.directory
    length = int(next(iter(steps.values())).shape[0])
    state = directory.host
    oldest_before = table.oldest_offset
    reach = segments.need_of_trees()
    gone, dirty = segments.scratch  # the compiled loop does not check its bounds: sized here
    if gone.shape[0] <= length or dirty.shape[0] < length + 3 + reach:
        # The episodes that leave: at most one per evicted segment, and the segments evicted
        # before the last hold fewer than `length` steps (each at least one). The rows noted:
        # the evicted ones, the new one, and the episode's rows within `reach` of its end.
        gone, dirty = segments.scratch = _scratch(length + 1), _scratch(length + 3 + reach)
    if table.num_episodes == table.row_count and not table.count_to_evict(store.capacity, length):
        table.make_room()  # every row taken and none to evict: grow, as `EpisodeTable.append`
    # mypy counts the star-unpacked tuples wrongly: the loop's signature is typed.
    evicted, oldest, gone_count, gone_unsampled, key, new_episode, noted = commit_loop(  # type: ignore[call-arg]
        store.capacity,
        table.first_id,
        table.next_id,
        table.oldest_offset,
        table.next_offset,
        table.row_count - 1,
        slot,
        length,
        max_priority,
        segments.priority_unit == "segment",
        reach,
        *store.ring.layout(),
        sources,
        table.integer_arrays,
        table.arrays["terminated"],
        table.arrays["priority"],
        directory.host_integers,
        state["opened"],
        state["priority"],
        *directory.index(),
        gone,
        dirty,
    )
    if evicted:
        table.first_id += evicted
        table.oldest_offset = oldest
        if gone_count:
            directory.released(gone[:gone_count])
        store.counts["episodes_evicted"] += gone_count
        store.counts["transitions_evicted"] += oldest - oldest_before
        store.evicted_unsampled = store.evicted_unsampled + gone_unsampled
    table.next_id += 1
    table.next_offset += length
    store.on_change(dirty[:noted].tolist())  # 2 or 3 rows, as a list: cheaper than a tensor
    store.counts["episodes_added"] += int(new_episode)
    store.counts["transitions_added"] += length
    return int(key)


def _scratch(size: int) -> np.ndarray:
    """Index space for `commit_loop`'s lists, kept by `Segments` from commit to commit."""
    return np.empty(size, dtype=np.int64)


# Rows of the int64 matrices `EpisodeTable.integers` and `EpisodeDirectory.integers`.
_EPISODE_ID, _START, _LENGTH, _TIMES_SAMPLED, _FIRST_STEP, _SLOT, _PREV_KEY, _NEXT_KEY, _BASE = (
    ROW_INTEGERS.index(name)
    for name in (
        "episode_id",
        "start",
        "length",
        "times_sampled",
        "first_step",
        "slot",
        "prev_key",
        "next_key",
        "base",
    )
)
_ID, _TOTAL, _FIRST_STORED, _TIMES, _FIRST_KEY, _LAST_KEY, _NUM_SEGMENTS = (
    EPISODE_INTEGERS.index(name)
    for name in (
        "episode_id",
        "total",
        "first_stored",
        "times",
        "first_key",
        "last_key",
        "num_segments",
    )
)


@engine.jit
def commit_loop(
    capacity: int,
    first_id: int,
    next_id: int,
    oldest_offset: int,
    next_offset: int,
    mask: int,
    owner: int,
    incoming: int,
    max_priority: float,
    per_segment: bool,
    reach: int,
    addresses: np.ndarray,
    row_bytes: np.ndarray,
    sources: np.ndarray,
    rows: np.ndarray,
    terminated: np.ndarray,
    priority: np.ndarray,
    episodes: np.ndarray,
    opened: np.ndarray,
    episode_priority: np.ndarray,
    index_ids: np.ndarray,
    index_slots: np.ndarray,
    index_size: int,
    gone: np.ndarray,
    dirty: np.ndarray,
) -> tuple[int, int, int, int, int, bool, int]:
    """Evict, copy ``incoming`` steps from ``sources`` and append their segment.

    1. Eviction as `EpisodeTable.count_to_evict` (a binary search over the rows' starts),
       then row by row as `Segments.evicted`: the episode's first stored step and key move
       on; an episode closed with nothing stored left leaves the id index (a tombstone, as
       `EpisodeDirectory.drop`) and its slot is listed in ``gone``.
    2. The copy into the slots no row claims any more (`ring_copies.write_steps`).
    3. The row, as `EpisodeTable.append_segment`, and the directory updates of
       `Segments.commit`; the caller made room for it.
    4. The rows whose leaves changed, listed in ``dirty``: the evicted rows, the new row,
       and (as `Segments._mark_changed`) the episode's earlier rows reaching within
       ``reach`` steps of its old end.

    Returns ``(segments evicted, oldest offset, episodes gone, of them never drawn, the
    segment id, whether the episode is new, rows listed in dirty)``.
    """
    episode_id, start, length = rows[_EPISODE_ID], rows[_START], rows[_LENGTH]
    times_sampled, first_step, slot = rows[_TIMES_SAMPLED], rows[_FIRST_STEP], rows[_SLOT]
    prev_key, next_key, base = rows[_PREV_KEY], rows[_NEXT_KEY], rows[_BASE]
    ids, total, first_stored = episodes[_ID], episodes[_TOTAL], episodes[_FIRST_STORED]
    times, first_key, last_key = episodes[_TIMES], episodes[_FIRST_KEY], episodes[_LAST_KEY]
    num_segments = episodes[_NUM_SEGMENTS]
    kept, oldest = first_id, oldest_offset
    lowest_kept = next_offset + incoming - capacity
    if lowest_kept > oldest_offset:
        high = next_id  # the first id whose start is >= lowest_kept
        while kept < high:
            middle = (kept + high) // 2
            if start[middle & mask] < lowest_kept:
                kept = middle + 1
            else:
                high = middle
        oldest = start[kept & mask] if kept < next_id else next_offset
    gone_count = unsampled = noted = 0
    for key in range(first_id, kept):
        row = key & mask
        dirty[noted] = row
        noted += 1
        at = slot[row]
        first_stored[at] = first_step[row] + length[row]
        left = num_segments[at] - 1
        num_segments[at] = left
        first_key[at] = next_key[row] if left else -1
        if left or opened[at]:
            continue
        unsampled += times[at] == 0
        index_slots[np.searchsorted(index_ids[:index_size], ids[at])] = -1
        ids[at] = -1
        gone[gone_count] = at
        gone_count += 1
    ring_copies.write_steps(
        addresses, row_bytes, sources, next_offset % capacity, incoming, capacity
    )

    old_total = total[owner]
    new_episode = old_total == 0
    value = max_priority
    if new_episode:
        episode_priority[owner] = value
    elif not per_segment:
        value = episode_priority[owner]
    previous, key = last_key[owner], next_id
    row = key & mask
    episode_id[row] = key
    start[row] = next_offset
    length[row] = incoming
    terminated[row] = False
    times_sampled[row] = 0
    priority[row] = value
    first_step[row] = old_total
    slot[row] = owner
    prev_key[row] = previous
    next_key[row] = -1
    base[row] = next_offset - old_total
    if previous >= kept:
        next_key[previous & mask] = key
    total[owner] = old_total + incoming
    last_key[owner] = key
    if num_segments[owner] == 0:
        first_key[owner] = key
        first_stored[owner] = old_total
    num_segments[owner] += 1

    dirty[noted] = row
    noted += 1
    reach_from = old_total - reach
    walk = previous
    while walk >= kept:  # at most min(stored segments, reach) rows: `dirty` has room
        at = walk & mask
        if first_step[at] + length[at] <= reach_from:
            break
        dirty[noted] = at
        noted += 1
        walk = prev_key[at]
    return kept - first_id, oldest, gone_count, unsampled, key, new_episode, noted
