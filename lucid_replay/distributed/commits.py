r"""Replay-wide commit counters: what `Recency` ages a sharded replay's rows by.

On one buffer a row's *commit counter* is the buffer's count of transitions when the row
(an episode, or a segment) was committed, and its age the count now minus that
(`lucid_replay.recency`). Across shards the count must be the *replay's*: each shard counts
only its own. So the control keeps the replay-wide count (`Control.commit`), and each shard
keeps it per row in its table's ``commit`` column (`EpisodeTable.keep_commits`):

1. A shard commits an add (or a streamed append) under its buffer's lock, then reports its
   counters to the control and waits for the reply, as it must anyway before any id is
   handed out (no further round trip).
2. The control answers with the replay-wide count before this commit and adds the
   transitions committed, in one step under its lock: every commit, from any client,
   `EpisodeWriter` or stream, gets its own range of the count.
3. Before the lock is released (so before any draw reads them) the shard sets the counters
   of the rows committed: a row committed ``t`` transitions into the range gets
   ``counter + t`` (`set_commits`).

An ``extend`` spread over several shards takes one range for the whole add (its first part
to reach the control reserves it) and each shard places its episodes in it by their order
in the add: the counters one buffer gives the same add. The precise definition, then: *the
age of an anchor is the number of transitions committed on any shard after its episode
(segment) was, commits ordered by their arrival at the control, an add over several shards
as one commit with its episodes in their order.* A shard that fails its part of such an add
leaves its transitions counted (a gap that ages older rows alike).

Masses $2^{(c_e - s)/h}$ at a tree's scale $s$ have the ``log`` total
$\log Z_k + s \ln 2 / h$ (`Trees.log_mass`): with replay-wide counters every shard's total
is on one reference, so the coordinator divides by their sum as for any other law
(`lucid_replay.distributed.draw`). With one shard and one client the counters are the
buffer's own, draw for draw. Checkpoints keep them: the tables' ``commit`` columns, and the
control's count in the manifest (``control["committed"]``); a restarted shard reloads its
rows' counters while the replay's count goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

import lucid_replay.distributed.calls as calls
from lucid_replay import engine
from lucid_replay.table import COMMIT_COLUMN, EpisodeTable

__all__: list[str] = []  # internal module

T = TypeVar("T")
# An add's part on one shard: (token, total, parts, places, lengths), see `committing`.
Call = tuple[int, int, int, np.ndarray, np.ndarray]


def committing(shard: Any, work: Callable[[], T], call: Call | None = None) -> T:
    """``work()`` (a commit) under ``shard``'s buffer lock, then a report, with its counters.

    After ``work`` the shard (a `ReplayShard`) reports its counters to the control and
    waits; the control issues what ``work`` committed its range of the replay's count
    (`Control.commit`), which gives the rows committed their counters (see the module). A
    ``work`` that raises is reported only if it committed anything. Returns what ``work``
    returns.

    ``call``: ``(token, total, parts, places, lengths)`` of an add the client spread over
    ``parts`` shards (``total`` transitions): this shard's episodes' ``lengths`` and their
    ends within the add (``places``: transitions from its start, in its order).
    """
    with shard.buffer._lock:
        table = shard.buffer._core.store.table
        first_key, first_offset = table.next_id, table.next_offset
        try:
            result = work()
        except BaseException:
            if table.next_offset != first_offset:
                _report(shard, first_key, first_offset, call)
            raise
        _report(shard, first_key, first_offset, call)
        return result


def _report(shard: Any, first_key: int, first_offset: int, call: Call | None) -> None:
    table = shard.buffer._core.store.table
    transitions = table.next_offset - first_offset
    shared = None if call is None else call[:3]
    future = shard.control.commit.remote(
        shard.index, shard.incarnation, shard._counters(), transitions, shared
    )
    counter = int(calls.get(future))
    if not transitions:
        return
    if call is None:  # one piece, placed at the counter
        set_commits(table, first_key, lambda local: local + (counter - first_offset))
        return
    places = np.asarray(call[3], dtype=np.int64)  # each episode's end within the add
    if table.directory is None:  # a row per episode, in the add's order
        set_commits(table, first_key, lambda local: counter + places[places.size - local.size :])
        return
    ends = first_offset + np.cumsum(np.asarray(call[4], dtype=np.int64))  # theirs, locally
    shifts = counter + places - ends  # the same for every segment of an episode
    set_commits(table, first_key, lambda local: local + shifts[np.searchsorted(ends, local)])


def set_commits(
    table: EpisodeTable, first_key: int, commits: Callable[[np.ndarray], np.ndarray]
) -> None:
    """Set the commit counters of a shard's ``table``'s stored rows keyed ``first_key`` on.

    ``commits`` maps their counts ``start + length`` at their commits (the shard's own,
    int64, in key order) to their counters. A shard's table is on CPU: its columns are read
    and written as tensors sharing their memory (whatever the engine), as one slice unless
    the keys wrap around the rows.
    """
    assert table.commit is not None and table.device.type == "cpu"  # see `keep_commits`
    first, last, mask = max(first_key, table.first_id), table.next_id - 1, table.row_count - 1
    low, high = first & mask, (last & mask) + 1
    rows = slice(low, high) if low < high else torch.from_numpy(np.arange(first, last + 1) & mask)
    column = {
        name: engine.tensor(table.arrays[name]) for name in ("start", "length", COMMIT_COLUMN)
    }
    counts = (column["start"][rows] + column["length"][rows]).numpy()
    column[COMMIT_COLUMN][rows] = torch.from_numpy(np.asarray(commits(counts), dtype=np.int64))
