"""The episode table: the one place that knows where episodes begin and end.

Every transition ever stored has a global *offset* (0, 1, 2, ... in insertion order, never
reused); its slot in the ring is ``offset % capacity``. Because eviction is oldest-first, the
stored transitions are always the contiguous offset range ``[oldest_offset, next_offset)`` and
the stored episodes the contiguous id range ``[first_id, next_id)``: an episode may wrap across
the ring's seam, and moving to the previous or next stored episode is just ``offset -/+ 1``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import numpy as np
import torch

import lucid_replay.table_loops as table_loops
from lucid_replay import engine
from lucid_replay.directory import EpisodeDirectory, Owners
from lucid_replay.engine import Array
from lucid_replay.segment_checks import SEGMENT_COLUMNS, checked_directory
from lucid_replay.table_checks import checked_table_state

__all__: list[str] = []  # internal module

_INITIAL_TABLE_SLOTS = 1024
COMMIT_COLUMN = "commit"  # the optional column of commit counters (`keep_commits`)
_COMMITS = {COMMIT_COLUMN: torch.int64}
# The rows of `EpisodeTable.integers`: a whole-episode table has the first four.
INTEGER_COLUMNS = (
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


class EpisodeTable:
    """Per-episode metadata, one row per stored episode, O(1) bytes per episode.

    Rows live in ring slots ``id & (slots - 1)``; ``slots`` is a power of two that doubles when
    the table fills, so a stored episode's row only changes on growth (``generation`` counts
    growths, letting caches keyed by row know when to rebuild).

    Columns are tensors on the storage device: ``episode_id``, ``start`` (global offset of step
    0), ``length``, ``terminated``, ``times_sampled`` and ``priority``. ``start`` and ``length``
    have host mirrors (numpy; the same memory on CPU) for host-side bookkeeping without
    device round trips. ``arrays`` holds the columns as the index arithmetic computes on them
    (see `lucid_replay.engine`).

    A ``commit`` column (`keep_commits`) holds the rows' commit counters as the table's owner
    sets them (a shard: `lucid_replay.distributed.commits`); else they are ``start + length``.
    """

    def __init__(self, device: torch.device, *, segmented: bool = False) -> None:
        self.device = device
        self._keeps_commits = False
        # Rows are segments (keyed by segment id) with a directory of their episodes, or
        # whole episodes (keyed by episode id, each its own directory entry).
        self.directory = EpisodeDirectory(device) if segmented else None
        self.first_id = 0
        self.next_id = 0
        self.oldest_offset = 0
        self.next_offset = 0
        self.generation = 0
        self._allocate(_INITIAL_TABLE_SLOTS)

    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, object],
        ranges: Mapping[str, object],
        *,
        device: torch.device,
        capacity: int,
        episodes: object = None,
    ) -> EpisodeTable:
        """A table rebuilt from saved ``columns`` and id/offset ``ranges`` (see `columns`).

        Every invariant is checked first: exact column dtypes; a power-of-two row count;
        ``0 <= first_id <= next_id <= 2**62`` and the same for offsets; stored rows holding
        their own ids, lengths >= 1 and starts that tile ``[oldest_offset, next_offset)``
        without gaps or overlaps; no other row claiming a stored id; at most ``capacity``
        transitions; finite positive priorities; non-negative draw counts; commit counters
        (a ``commit`` column, kept if saved) at least their rows' lengths.

        ``episodes``: the directory state of a segmented table (`EpisodeDirectory.state`),
        whose links with the segment rows are checked too (`segment_checks`).

        Raises
        ------
        CheckpointError
            Naming the first broken invariant.
        """
        segmented = episodes is not None
        commits = isinstance(columns, Mapping) and COMMIT_COLUMN in columns
        extra = {**(SEGMENT_COLUMNS if segmented else {}), **(_COMMITS if commits else {})}
        saved, bounds = checked_table_state(columns, ranges, capacity, extra)
        directory = None
        if segmented:
            rows, issued, token = checked_directory(episodes, saved, bounds)
            directory = EpisodeDirectory.from_rows(rows, issued, token, device)
        table = cls(device, segmented=segmented)  # nothing below can fail: adopt
        table.directory, table._keeps_commits = directory, commits
        table._allocate(int(saved["episode_id"].shape[0]))
        for name, column in table.columns.items():
            column.copy_(saved[name])
        if table.device.type != "cpu":
            table.host_start[:] = saved["start"].numpy()
            table.host_length[:] = saved["length"].numpy()
        table.first_id, table.next_id = bounds["first_id"], bounds["next_id"]
        table.oldest_offset, table.next_offset = bounds["oldest_offset"], bounds["next_offset"]
        table.generation = bounds["generation"]
        return table

    # ----------------------------------------------------------------------------- layout
    def _allocate(self, slots: int) -> None:
        self.row_count = slots  # rows allocated, a power of two

        def column(dtype: torch.dtype, fill: float | int | bool) -> torch.Tensor:
            return torch.full((slots,), fill, dtype=dtype, device=self.device)

        # Column c of `INTEGER_COLUMNS` is `integers[c]`, a view of one row-major matrix
        # (`engine.integer_columns`).
        names = INTEGER_COLUMNS[: 9 if self.directory is not None else 4]
        self.integers = engine.integer_columns(len(names), slots, self.device)
        for row, name in zip(self.integers, names, strict=True):
            row.fill_(-1 if name in ("episode_id", "slot", "prev_key", "next_key") else 0)
        self.episode_id, self.start, self.length, self.times_sampled = self.integers[:4]
        self.terminated = column(torch.bool, False)
        self.priority = column(torch.float64, 1.0)
        self.commit = column(torch.int64, 0) if self._keeps_commits else None
        if self.directory is not None:
            self.first_step = self.integers[4]  # the segment's first episode step
            self.slot = self.integers[5]  # its episode's directory slot
            self.prev_key = self.integers[6]  # the episode's previous segment id
            self.next_key = self.integers[7]  # and next one (-1: none yet)
            self.base = self.integers[8]  # start - first_step: offset of step 0
        # The columns as the index arithmetic reads them (see `engine`): numpy views
        # of the same memory on CPU, where a scalar write also costs ~0.1 us instead of ~2 us.
        self.arrays = {name: engine.view(column) for name, column in self.columns.items()}
        self.integer_arrays = engine.view(self.integers)
        if self.device.type == "cpu":
            self.host_start, self.host_length = self.arrays["start"], self.arrays["length"]
        else:
            self.host_start, self.host_length = self.start.cpu().numpy(), self.length.cpu().numpy()
        if self.directory is None:  # an episode starts at its step 0, at its own row
            self.arrays["base"] = self.arrays["start"]
            identity = torch.arange(slots, device=self.device)
            self._whole = Owners(
                slot=engine.view(identity),
                first_step=engine.view(torch.zeros_like(identity)),
                total=self.arrays["length"],
                opened=engine.view(torch.zeros(slots, dtype=torch.bool, device=self.device)),
                first_stored=engine.view(torch.zeros_like(identity)),
                times=self.arrays["times_sampled"],
                terminated=self.arrays["terminated"],
            )

    @property
    def columns(self) -> dict[str, torch.Tensor]:
        """The device columns by name (for checkpoints)."""
        return {
            "episode_id": self.episode_id,
            "start": self.start,
            "length": self.length,
            "terminated": self.terminated,
            "times_sampled": self.times_sampled,
            "priority": self.priority,
            **(
                {}
                if self.directory is None
                else {
                    "first_step": self.first_step,
                    "slot": self.slot,
                    "prev_key": self.prev_key,
                    "next_key": self.next_key,
                    "base": self.base,
                }
            ),
            **({} if self.commit is None else {COMMIT_COLUMN: self.commit}),
        }

    @property
    def segmented(self) -> bool:
        """Whether rows are segments of episodes (a buffer with ``segment_length``)."""
        return self.directory is not None

    def saved_columns(self) -> tuple[dict[str, torch.Tensor], dict[str, object] | None]:
        """CPU copies of the columns, and the directory state of a segmented table.

        Directory rows are saved in id order, a row's index its slot once loaded: the
        segments' ``slot`` column is renumbered to match.
        """
        columns = {name: column.cpu().clone() for name, column in self.columns.items()}
        if self.directory is None:
            return columns, None
        state = self.directory.state()
        renumber = torch.full((self.directory.slot_count,), -1, dtype=torch.int64)
        live = torch.from_numpy(self.directory.live_slots().copy())
        renumber[live] = torch.arange(live.numel())
        stored = self.stored_rows().cpu()
        slots = torch.full_like(columns["slot"], -1)
        slots[stored] = renumber[columns["slot"][stored]]
        columns["slot"] = slots
        return columns, state

    def owners(self) -> Owners:
        """The arrays that say which episode a row belongs to and where that episode ends.

        For whole episodes each row is its own episode (identity slots, step 0 first).
        """
        directory = self.directory
        if directory is None:
            return self._whole
        column = directory.arrays
        return Owners(
            slot=self.arrays["slot"],
            first_step=self.arrays["first_step"],
            total=column["total"],
            opened=column["opened"],
            first_stored=column["first_stored"],
            times=column["times"],
            terminated=column["terminated"],
        )

    def offsets(self, rows: Array, steps: Array) -> Array:
        """Global offsets of step ``steps`` of the episodes in table ``rows`` (broadcast).

        The one place that turns ``(row, step)`` into an offset: ``base[row] + step``, where
        ``base`` is the offset step 0 of the row's episode would have if the episode were
        stored contiguously (``start`` for whole episodes; ``start - first_step`` for a
        segment). ``rows`` and ``steps`` are `engine` arrays (or ints); a step may lie
        outside its row (a window's target before clamping). O(n), no checks.
        """
        return self.arrays["base"][rows] + steps

    def rows_of(self, episode_ids: Array) -> Array:
        """Row of each stored id (meaningful only for ids in ``[first_id, next_id)``)."""
        return episode_ids & (self.row_count - 1)

    def row_of(self, episode_id: int) -> int:
        """Row of one stored id."""
        return episode_id & (self.row_count - 1)

    @property
    def num_episodes(self) -> int:
        """Number of stored episodes."""
        return self.next_id - self.first_id

    @property
    def num_transitions(self) -> int:
        """Number of stored transitions."""
        return self.next_offset - self.oldest_offset

    def is_stored(self, episode_ids: Array) -> Array:
        """Elementwise ``first_id <= id < next_id``."""
        return (episode_ids >= self.first_id) & (episode_ids < self.next_id)

    def first_unissued(self, episode_ids: Array) -> int:
        """Position of the first id in ``episode_ids`` outside ``[0, next_id)``, else -1.

        Ids never issued, which no update may name (evicted ones, below ``first_id``, were
        issued). An `engine` array; one compiled pass on CPU (`first_unissued_loop`).
        """
        if engine.compiled(episode_ids):
            return int(table_loops.first_unissued_loop(episode_ids, self.next_id))
        issued = (episode_ids >= 0) & (episode_ids < self.next_id)
        if bool(issued.all()):
            return -1
        return int(engine.flat_nonzero(~issued)[0])

    def assign_priorities(self, ids: Array, values: Array) -> tuple[Array, int, float]:
        """Set the priority of each stored id in ``ids`` to its value in ``values``.

        A repeated id takes the largest of its values; ids that are not stored (evicted)
        are skipped, so they never touch the rows now reused. ``ids`` and ``values``
        (float64, positive) are `engine` arrays. Returns the rows set (one per
        stored id), how many distinct rows that is, and the largest value set. O(k).
        """
        column, bounds = self.arrays["priority"], (self.first_id, self.next_id, self.row_count)
        if engine.compiled(column):  # one pass, no sort
            loop = table_loops.assign_priorities_loop  # the module's name: the compiled twin
            rows, distinct, largest = loop(column, ids, values, *bounds)
            return rows, int(distinct), float(largest)
        return table_loops.assign_priorities(column, ids, values, *bounds)

    def stored_rows(self) -> torch.Tensor:
        """Rows of all stored episodes, oldest first (O(E); not for hot paths)."""
        ids = torch.arange(self.first_id, self.next_id, device=self.device)
        rows: torch.Tensor = self.rows_of(ids)
        return rows

    def stored_slots(self) -> Array:
        """Directory slots of the episodes with a stored step (whole episodes: their rows)."""
        if self.directory is None:
            return engine.view(self.stored_rows())
        directory = self.directory
        slots = directory.live_slots()
        slots = slots[directory.host["num_segments"][slots] > 0]
        return engine.view(torch.from_numpy(slots).to(self.device))

    def segment_rows(self, slots: Array) -> torch.Tensor:
        """Rows of every stored segment of the episodes in directory ``slots``.

        A tensor (whole episodes: the slots themselves). O(segments), hop by hop along each
        episode's chain, all episodes at once.
        """
        if self.directory is None:
            return engine.tensor(slots)
        keys = engine.tensor(self.directory.arrays["first_key"])[engine.tensor(slots)]
        next_key = engine.tensor(self.arrays["next_key"])
        found: list[torch.Tensor] = []
        keys = keys[keys >= self.first_id]
        while keys.numel():
            rows = keys & (self.row_count - 1)
            found.append(rows)
            keys = next_key[rows]
            keys = keys[keys >= self.first_id]
        if not found:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(found)

    # ------------------------------------------------------------------------- mutation
    def append(self, length: int, terminated: bool, priority: float) -> tuple[int, int, int]:
        """Record a new episode of ``length`` steps at ``next_offset``; return (id, row, start).

        The caller evicts first (`count_to_evict`, `evict_oldest`) so that the episode fits.
        """
        self.make_room()
        episode_id, start = self.next_id, self.next_offset
        row = self.row_of(episode_id)
        columns = self.arrays  # scalar writes, one per column: no dict of values per add
        columns["episode_id"][row] = episode_id
        columns["start"][row] = start
        columns["length"][row] = length
        columns["terminated"][row] = terminated
        columns["times_sampled"][row] = 0
        columns["priority"][row] = priority
        if self.device.type != "cpu":
            self.host_start[row], self.host_length[row] = start, length
        self.next_id += 1
        self.next_offset += length
        return episode_id, row, start

    def append_segment(
        self, slot: int, first_step: int, length: int, priority: float, previous: int
    ) -> tuple[int, int]:
        """Record a new segment of the episode in ``slot``; return ``(segment id, row)``.

        ``previous`` is the episode's newest segment id before this one (-1: none); its
        ``next_key`` now points here if it is still stored.
        """
        key, row, start = self.append(length, False, priority)
        column = self.arrays
        column["first_step"][row] = first_step
        column["slot"][row] = slot
        column["prev_key"][row] = previous
        column["next_key"][row] = -1
        column["base"][row] = start - first_step
        if previous >= self.first_id:
            column["next_key"][self.row_of(previous)] = key
        return key, row

    def keep_commits(self) -> None:
        """Keep a ``commit`` column (rows at ``start + length``), set by the owner from now on."""
        if self.commit is not None:
            return
        self._keeps_commits = True
        self.commit = self.start + self.length
        self.arrays[COMMIT_COLUMN] = engine.view(self.commit)

    def count_to_evict(self, capacity: int, incoming: int) -> int:
        """How many oldest episodes must go so that ``incoming`` more transitions fit.

        O(log E): ends of stored episodes increase with id, so a binary search finds the first
        episode that may stay.
        """
        lowest_kept_offset = self.next_offset + incoming - capacity
        if lowest_kept_offset <= self.oldest_offset:
            return 0
        mask = self.row_count - 1
        second = self.first_id + 1  # an add into a full buffer most often evicts one episode
        if second == self.next_id or self.host_start[second & mask] >= lowest_kept_offset:
            return 1
        first_kept = bisect.bisect_left(
            range(self.first_id, self.next_id),
            lowest_kept_offset,
            key=lambda i: int(self.host_start[i & mask]),
        )
        return first_kept

    def evict_oldest(self, count: int) -> tuple[int | torch.Tensor, int, int | torch.Tensor]:
        """Drop the ``count`` oldest episodes.

        Returns their rows (one row as an ``int`` on CPU, else a tensor), their transition
        total, and how many of them were never sampled (an ``int`` on CPU; a 0-d device
        tensor elsewhere, to avoid a synchronisation).
        """
        first_id, offset_before = self.first_id, self.oldest_offset
        self.first_id += count
        if self.first_id == self.next_id:
            self.oldest_offset = self.next_offset
        else:
            self.oldest_offset = int(self.host_start[self.row_of(self.first_id)])
        transitions = self.oldest_offset - offset_before
        if count == 1 and self.device.type == "cpu":
            # An add into a full buffer most often evicts one episode: scalar reads cost
            # ~0.3 us here against ~3 us for the arange, gather and count below.
            row = self.row_of(first_id)
            return row, transitions, int(self.arrays["times_sampled"][row] == 0)
        rows = np.arange(first_id, first_id + count) & (self.row_count - 1)
        if self.device.type == "cpu":
            unsampled = int(np.count_nonzero(self.arrays["times_sampled"][rows] == 0))
            return torch.from_numpy(rows), transitions, unsampled
        device_rows = torch.from_numpy(rows).to(self.device)
        return device_rows, transitions, (self.times_sampled[device_rows] == 0).sum()

    def make_room(self) -> bool:
        """Double the rows if every row is taken, before one is written; True if it did."""
        if self.num_episodes < self.row_count:
            return False
        self._grow()
        return True

    def _grow(self) -> None:
        old = self.columns
        old_mask = self.row_count - 1
        self._allocate(2 * self.row_count)
        ids = torch.arange(self.first_id, self.next_id, device=self.device)
        for name, column in self.columns.items():
            column[ids & (self.row_count - 1)] = old[name][ids & old_mask]
        if self.device.type != "cpu":
            self.host_start[:] = self.start.cpu().numpy()
            self.host_length[:] = self.length.cpu().numpy()
        self.generation += 1

    # ------------------------------------------------------------------------ boundaries
    def episode_range(self, episode_id: int) -> tuple[int, int]:
        """(start offset, length) of one stored episode."""
        row = self.row_of(episode_id)
        return int(self.host_start[row]), int(self.host_length[row])

    def locate(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Map stored global offsets to ``(episode ids, steps)``, any shape.

        A vectorised binary search over the stored ids: O(n log E) for n offsets, on device.
        Offsets must lie in ``[oldest_offset, next_offset)``.
        """
        low = torch.full_like(offsets, self.first_id)
        high = torch.full_like(offsets, self.next_id - 1)
        mask = self.row_count - 1
        # Invariant: the episode holding each offset has an id in [low, high].
        for _ in range(max(1, (self.num_episodes).bit_length())):
            middle = low + (high - low + 1) // 2  # no overflow for ids near 2**62
            starts_here = self.start[middle & mask] <= offsets
            low = torch.where(starts_here, middle, low)
            high = torch.where(starts_here, high, middle - 1)
        return low, offsets - self.start[low & mask]
