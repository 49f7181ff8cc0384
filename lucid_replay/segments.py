"""`Segments`: the rules of a segmented store (commit, close, evict, look up by episode).

A buffer with ``segment_length`` keeps its episode table's rows as segments (see
`lucid_replay.directory`): a segment is committed whole, in commit order, and evicted
oldest first, so the table's offset and id invariants hold for segments exactly as for whole
episodes. An episode is its directory slot plus its chain of stored segments (each row links
to the episode's previous and next segment). This module keeps the two in step:

* ``commit`` evicts what the new segment needs, copies its steps, appends its row and moves
  its episode's end; the leaves of the episode's rows whose eligible anchors changed are
  marked (the tail that the longest cached span reaches back to; every row of the episode
  under ``unit="episode"``, whose rows share the episode's mass);
* ``close`` ends the episode (the open-episode rule of eligibility no longer applies);
* ``evicted`` moves the first stored step of the episodes whose oldest segments went, and
  gives back the slots of closed episodes with nothing stored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
import torch

from lucid_replay import directory as directories
from lucid_replay import engine, seams
from lucid_replay.checks import as_id, as_vector, check_int
from lucid_replay.directory import EpisodeDirectory
from lucid_replay.errors import UnknownEpisodeError, must, must_have
from lucid_replay.records import Anchors
from lucid_replay.seams import rows_holding

__all__: list[str] = []  # internal module

_NO_ROWS = np.empty(0, dtype=np.int64)

PRIORITY_UNITS = ("episode", "segment")


def checked_segmenting(
    segment_length: object, priority_unit: object, unit: str, capacity: int
) -> tuple[int | None, str]:
    """``segment_length`` (``None``, or ``1 .. capacity``) and ``priority_unit``, checked.

    ``priority_unit="segment"`` needs a ``segment_length`` and ``unit="chunk"``: a segment's
    priority weighs its anchors, which a draw by episode does not count.
    """
    length = None
    if segment_length is not None:
        length = check_int("segment_length", segment_length, minimum=1, maximum=capacity)
    if not isinstance(priority_unit, str) or priority_unit not in PRIORITY_UNITS:
        raise must("priority_unit", f"one of {PRIORITY_UNITS}", priority_unit)
    if priority_unit == "segment" and (length is None or unit != "chunk"):
        raise must_have(
            "priority_unit",
            '"episode" unless segment_length is set and unit="chunk"',
            f'"segment" with segment_length={length}, unit={unit!r}',
        )
    return length, priority_unit


class Segments:
    """Commits, closes and lookups of a segmented `EpisodeStore` (its ``segments``).

    Parameters
    ----------
    store
        The `EpisodeStore` whose table has segment rows (typed loosely: it owns this).
    segment_length
        Steps per full segment.
    priority_unit
        ``"episode"``: one priority per episode, copied to each of its rows;
        ``"segment"``: one per row.
    unit
        The sampler's unit (``"episode"`` rows share their episode's mass).
    """

    def __init__(self, store: Any, segment_length: int, priority_unit: str, unit: str) -> None:
        self.store = store
        self.segment_length = segment_length
        self.priority_unit = priority_unit
        self.unit = unit
        # The longest span any cached sum tree needs (set by the owner of the trees).
        self.need_of_trees: Callable[[], int] = _no_trees
        # Index space of the compiled commit (`commit_loop.commit`), grown there as needed and
        # reused under the buffer's lock: allocating it anew took about 0.6 us of a 10 us
        # `EpisodeStream.append` of one segment.
        self.scratch: tuple[np.ndarray, np.ndarray] = (_NO_ROWS, _NO_ROWS)

    @property
    def directory(self) -> EpisodeDirectory:
        directory: EpisodeDirectory | None = self.store.table.directory
        assert directory is not None  # a segmented store's table has one
        return directory

    # -------------------------------------------------------------------------- writing
    def open(self) -> tuple[int, int]:
        """Issue an episode id; returns ``(episode_id, stream token)``."""
        episode_id, slot = self.directory.open()
        return episode_id, self.directory.new_token(slot)

    def commit(
        self,
        slot: int,
        steps: Mapping[str, torch.Tensor],
        host: Mapping[str, np.ndarray] | None,
        max_priority: float,
    ) -> int:
        """Store ``steps`` as the episode's next segment; return its segment id.

        ``steps`` are checked, ``[n, ...]`` each with ``n <= capacity``. On CPU with the
        compiled engine, ``unit="chunk"`` and no reuse limit the steps below run as one
        compiled loop (`lucid_replay.commit_loop`), which leaves the same state.
        """
        store, table, directory = self.store, self.store.table, self.directory
        if self.unit == "chunk" and store.reuse_limit is None:
            sources = store.ring.sources(steps) if engine.compiled(table.arrays["start"]) else None
            if sources is not None:  # the same state, in one compiled loop
                key: int = _commit_loop().commit(self, slot, steps, sources, max_priority)
                return key
        length = int(next(iter(steps.values())).shape[0])
        to_evict = table.count_to_evict(store.capacity, length)
        if to_evict:
            store.evict(to_evict)
            store.reclaim_retired()
        store.ring.write(table.next_offset, steps, host)  # data first, as `EpisodeStore.add`
        host_column, set_value = directory.host, directory.set
        first_step = int(host_column["total"][slot])
        new_episode = first_step == 0
        if self.priority_unit == "segment" or new_episode:
            priority = max_priority
            if new_episode:
                set_value("priority", slot, priority)
        else:
            priority = float(host_column["priority"][slot])
        previous = int(host_column["last_key"][slot])
        key, row = table.append_segment(slot, first_step, length, priority, previous)
        key = int(key)
        set_value("total", slot, first_step + length)
        set_value("last_key", slot, key)
        stored = int(host_column["num_segments"][slot])
        if stored == 0:
            set_value("first_key", slot, key)
            set_value("first_stored", slot, first_step)
        set_value("num_segments", slot, stored + 1)
        store.on_change(row)
        self._mark_changed(slot, first_step, previous)
        store.counts["episodes_added"] += int(new_episode)
        store.counts["transitions_added"] += length
        return key

    def add(self, episode: Any, priority: Any) -> int:
        """Store a cast, checked ``episode``: open, one commit per segment, close.

        Exactly what streaming its steps stores.
        """
        episode_id, _ = self.open()
        slot = self.directory.slot_of(episode_id)
        host, size = episode._host_steps, self.segment_length
        for begin in range(0, len(episode), size):  # ceil(T / L) segments, not per step
            piece = {name: t[begin : begin + size] for name, t in episode.steps.items()}
            views = None if host is None else {n: v[begin : begin + size] for n, v in host.items()}
            self.commit(slot, piece, views, priority())
        self.close(slot, episode.terminated)
        return episode_id

    def close(self, slot: int, terminated: bool) -> None:
        """End the open episode in ``slot`` (its pending steps already committed)."""
        directory = self.directory
        directory.set("opened", slot, False)
        directory.set("terminated", slot, terminated)
        directory.set("token", slot, 0)
        self._mark_changed(slot, directory.get("total", slot))
        if directory.get("num_segments", slot) == 0:  # nothing (left) to store
            self._drop(np.array([slot], dtype=np.int64))

    def _mark_changed(self, slot: int, old_total: int, key: int | None = None) -> None:
        """Mark the rows whose eligible anchors change as the episode's end moves.

        When it moves past ``old_total``, or the episode closes: the rows reaching within
        the longest cached span of it, walking back from segment ``key`` (default: the
        episode's newest). Typically one or two rows, each noted as an ``int``.
        """
        table, on_change = self.store.table, self.store.on_change
        if self.unit == "episode":
            on_change(engine.tensor(table.segment_rows(np.array([slot]))))
            return
        reach_from = old_total - self.need_of_trees()
        if key is None:
            key = int(self.directory.host["last_key"][slot])
        column, first_id, mask = table.arrays, table.first_id, table.row_count - 1
        first_step, length, prev_key = column["first_step"], column["length"], column["prev_key"]
        while key >= first_id:
            row = key & mask
            if int(first_step[row] + length[row]) <= reach_from:
                return
            on_change(row)
            key = int(prev_key[row])

    # ------------------------------------------------------------------------- evicting
    def evicted(self, rows: Any) -> tuple[int, int]:
        """Update the episodes of just-evicted segment ``rows`` (oldest first).

        Returns how many episodes left the buffer, and how many of those were never drawn.
        """
        table, directory = self.store.table, self.directory
        if isinstance(rows, int) and self.unit == "chunk":  # most commits evict one segment
            return self._evicted_one(rows)
        if table.device.type == "cpu" and self.unit == "chunk" and rows.numel() <= 4:
            # A few segments (a commit after whole episodes of 1 or 2 segments): scalar
            # updates cost ~2 us each against ~50 us for the vectorised bookkeeping.
            gone = unsampled = 0
            for row in rows.tolist():
                left, never = self._evicted_one(row)
                gone, unsampled = gone + left, unsampled + never
            return gone, unsampled
        evicted = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).to(table.device)
        column = {
            name: table.columns[name][evicted].cpu().numpy()
            for name in ("slot", "first_step", "length", "next_key")
        }
        slots, host = column["slot"], directory.host
        np.maximum.at(host["first_stored"], slots, column["first_step"] + column["length"])
        np.subtract.at(host["num_segments"], slots, 1)
        np.maximum.at(host["first_key"], slots, column["next_key"])
        # Their episodes in the order their last evicted segments left (as one by one).
        touched, from_end = np.unique(slots[::-1], return_index=True)
        touched = touched[np.argsort(-from_end)]
        empty = touched[host["num_segments"][touched] == 0]
        host["first_key"][empty] = -1
        directory.push(("first_stored", "num_segments", "first_key"))
        if self.unit == "episode":  # the rows left share a smaller episode mass
            left = touched[host["num_segments"][touched] > 0]
            self.store.on_change(table.segment_rows(torch.from_numpy(left).to(table.device)))
        gone = empty[~host["opened"][empty]]
        unsampled = int(np.count_nonzero(host["times"][gone] == 0))
        self._drop(gone, counted=False)
        return int(gone.shape[0]), unsampled

    def _evicted_one(self, row: int) -> tuple[int, int]:
        """`evicted` for one row of a CPU table, in scalar reads and writes."""
        column, host = self.store.table.arrays, self.directory.host
        slot = int(column["slot"][row])
        host["first_stored"][slot] = column["first_step"][row] + column["length"][row]
        left = int(host["num_segments"][slot]) - 1
        host["num_segments"][slot] = left
        host["first_key"][slot] = column["next_key"][row] if left else -1
        if left or host["opened"][slot]:
            return 0, 0
        unsampled = int(host["times"][slot] == 0)
        self._drop(np.array([slot], dtype=np.int64), counted=False)
        return 1, unsampled

    def _drop(self, slots: np.ndarray, *, counted: bool = True) -> None:
        """Give back the slots of closed episodes with nothing stored."""
        if counted:  # closed after losing every stored step: it leaves the buffer now
            store, host = self.store, self.directory.host
            stored_once = slots[host["total"][slots] > 0]
            store.counts["episodes_evicted"] += int(stored_once.shape[0])
            unsampled = int(np.count_nonzero(host["times"][stored_once] == 0))
            store.evicted_unsampled = store.evicted_unsampled + unsampled
        self.directory.drop(slots)

    # -------------------------------------------------------------------------- lookups
    def live_slot(self, episode_id: object, *, stored: bool) -> int:
        """The slot of a live episode (``stored``: one with a stored step), else an error."""
        number = as_id("episode_id", episode_id)
        directory = self.directory
        slot = directory.slot_of(number)
        if slot >= 0 and (not stored or directory.get("num_segments", slot) > 0):
            return slot
        if not 0 <= number < directory.next_episode_id:
            state = "was never issued"
        elif slot >= 0:
            state = "is open with no stored step (all committed steps evicted, or none yet)"
        else:
            state = "was evicted"
        rule = "a stored episode" if stored else "an open or stored episode"
        raise UnknownEpisodeError(f"episode_id must be {rule}, got {number}: it {state}")

    def rows_at(self, slots: np.ndarray, steps: torch.Tensor) -> torch.Tensor:
        """Rows of the segments holding stored ``steps`` of the episodes in ``slots``."""
        table = self.store.table
        first = self.directory.host["first_key"][slots] & (table.row_count - 1)
        if table.device.type != "cpu" or not engine.compiled(first):
            first = engine.view(torch.from_numpy(first).to(table.device))
        return engine.tensor(rows_holding(table, first, engine.view(steps)))

    def anchors(self, episode_ids: Any, anchor_steps: Any) -> Anchors:
        """Anchors at given stored steps (`EpisodeStore.anchors` on a segmented store)."""
        device, directory = self.store.table.device, self.directory
        ids = as_vector("episode_ids", episode_ids, torch.int64, device).clone()  # owned
        steps = as_vector("anchor_steps", anchor_steps, torch.int64, device).clone()
        if ids.shape != steps.shape:
            raise must("anchor_steps", f"as long as episode_ids ({ids.numel()})", steps.numel())
        host, host_steps = directory.host, steps.cpu().numpy()  # checked on the host copies
        host_ids = ids.cpu().numpy()
        if self.store.table.device.type == "cpu" and engine.compiled(host_ids):
            column = self.store.table.arrays
            counts = host["num_segments"], host["first_stored"], host["total"]
            checked = (host_ids, host_steps, *directory.index(), *counts)
            found, refused = _anchor_rows_loop(
                checked,
                host["first_key"],
                self.store.table.row_count - 1,
                column["first_step"],
                column["length"],
                column["prev_key"],
                column["next_key"],
            )
            if refused < 0:
                return Anchors(found, host_ids, host_steps)
        # The array code; after a refusal by the loop, its checks raise that pair's error.
        slots = directory.slots_of(host_ids)
        stored = (slots >= 0) & (host["num_segments"][slots] > 0)
        if not stored.all():
            self.live_slot(int(ids[torch.from_numpy(~stored)][0]), stored=True)
        first, end = host["first_stored"][slots], host["total"][slots]
        outside = (host_steps < first) | (host_steps >= end)
        if outside.any():
            at = int(np.flatnonzero(outside)[0])
            raise must(
                f"anchor_steps[{at}]",
                f"a stored step of episode {int(ids[at])} ({int(first[at])} .. {int(end[at]) - 1})",
                int(steps[at]),
            )
        rows = self.rows_at(slots, steps)
        return Anchors(engine.view(rows), engine.view(ids), engine.view(steps))

    def episode_steps(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of the stored steps of the episode in ``slot``, oldest first."""
        table, ring = self.store.table, self.store.ring
        rows = engine.tensor(table.segment_rows(np.array([slot])))
        starts, lengths = table.host_start, table.host_length
        parts = [ring.read(int(starts[row]), int(lengths[row])) for row in rows.tolist()]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    def stored_records(
        self, ids: torch.Tensor, steps: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which records ``(ids, steps)`` under ``mask`` are still stored, and their rows.

        For `EpisodeStore.write_records`: the rows of the kept records' segments, in order.
        """
        directory, device = self.directory, self.store.table.device
        slots = torch.from_numpy(directory.slots_of(ids.reshape(-1).cpu().numpy()))
        slots = slots.to(device).reshape(ids.shape)
        first = engine.tensor(directory.arrays["first_stored"])[slots]
        end = engine.tensor(directory.arrays["total"])[slots]
        write = mask & (slots >= 0) & (steps >= first) & (steps < end)
        return write, self.rows_at(slots[write].cpu().numpy(), steps[write])

    # ----------------------------------------------------------------------- priorities
    def assign_priorities(
        self, ids: torch.Tensor, priorities: torch.Tensor
    ) -> tuple[torch.Tensor, int, float]:
        """Set episode priorities (``priority_unit="episode"``) and copy them to their rows.

        Ids of episodes no longer live are skipped; a repeated id takes its largest value.
        Returns the rows changed, how many distinct episodes were set and the largest
        priority set (``-inf`` if none).
        """
        directory, table = self.directory, self.store.table
        slots = directory.slots_of(ids.cpu().numpy())
        live = slots >= 0
        if not live.any():
            return torch.empty(0, dtype=torch.int64, device=table.device), 0, -float("inf")
        slots, values = slots[live], priorities.cpu().numpy()[live]
        column = directory.host["priority"]
        engine.assign_max(column, slots, values)
        directory.push(("priority",))
        distinct = np.unique(slots)
        rows = engine.tensor(table.segment_rows(torch.from_numpy(distinct).to(table.device)))
        slot_of = engine.tensor(table.arrays["slot"])
        table.priority[rows] = directory.columns["priority"][slot_of[rows]]
        return rows, int(distinct.shape[0]), float(values.max())

    def stored_priorities(self) -> torch.Tensor:
        """float64: the priorities of the stored episodes, in `stored_ids` order."""
        directory = self.directory
        slots = torch.from_numpy(directory.stored_slots())
        return directory.columns["priority"].cpu()[slots].clone()

    def counts(self) -> dict[str, int]:
        """Stats of a segmented store: stored episodes and segments, open episodes."""
        directory = self.directory
        return {
            "episodes_stored": int(directory.stored_slots().shape[0]),
            "segments_stored": self.store.table.num_episodes,
            "segments_added": self.store.table.next_id,
            "segments_evicted": self.store.table.first_id,
            "episodes_open": len(directory.open_ids()),
        }


@engine.jit
def _anchor_rows_loop(
    checked: tuple[Any, ...],
    first_key: np.ndarray,
    row_mask: int,
    first_step: np.ndarray,
    length: np.ndarray,
    prev_key: np.ndarray,
    next_key: np.ndarray,
) -> tuple[np.ndarray, int]:
    """`Segments.anchors` compiled: the rows of the segments holding stored anchors, and -1.

    `directory.stored_slots_loop` of ``checked`` (its arguments: ids and steps first), then
    `seams.rows_holding_loop` from each episode's oldest stored segment (as
    `Segments.rows_at`), in one call instead of a dozen array operations, each paying for
    cold code and data inside a gather: 256 anchors across seams looked up in 36-39 us
    instead of 72 (the benchmark's gathers). A refused pair returns its position instead of
    -1 (and no rows), for the array code to raise its error.
    """
    slots, refused = directories.stored_slots_loop(*checked)
    if refused >= 0:
        return slots, refused
    first = np.empty_like(slots)
    for i in range(slots.shape[0]):
        first[i] = first_key[slots[i]] & row_mask
    steps = checked[1]
    rows = seams.rows_holding_loop(first, steps, first_step, length, prev_key, next_key, row_mask)
    return rows, -1


@functools.cache  # every compiled commit asks
def _commit_loop() -> ModuleType:
    """`lucid_replay.commit_loop`, imported on first use: it needs numba."""
    from lucid_replay import commit_loop

    return commit_loop


def _no_trees() -> int:
    """`Segments.need_of_trees` until an owner sets it."""
    return 0
