"""The episode directory of a segmented buffer: one slot of state per live episode.

On a buffer with ``segment_length`` the episode table's rows are *segments* (keyed by segment
id, issued in commit order), and an episode is the set of its stored segments plus the state
kept here: how many steps it committed (``total``), its first stored step, whether it is still
open, how it ended, how often it was drawn and its priority. A slot is taken when the episode
is opened and given back once it is closed and none of its segments is stored any more, so
the directory holds O(1) per live episode however many episodes came before.

Episode ids map to slots through a sorted id index (ids are issued in increasing order, so an
insert is an append; a dropped id leaves a tombstone until the next compaction): lookups of
``B`` ids are one vectorised binary search (with the compiled loops, `slots_of_loop`;
`stored_slots_loop` also checks that given steps are stored).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.engine import Array

__all__: list[str] = []  # internal module

_INITIAL_SLOTS = 64
# Columns read by the index arithmetic (device tensors with engine views) and bookkeeping.
_COLUMNS = {
    "episode_id": (torch.int64, -1),
    "total": (torch.int64, 0),  # steps committed since the episode's step 0
    "first_stored": (torch.int64, 0),  # its oldest stored step (== total: none stored)
    "opened": (torch.bool, False),
    "terminated": (torch.bool, False),
    "times": (torch.int64, 0),  # draws, for the reuse limit
    "priority": (torch.float64, 1.0),  # priority_unit="episode"
    "first_key": (torch.int64, -1),  # oldest stored segment id (-1: none)
    "last_key": (torch.int64, -1),  # newest committed segment id (-1: none yet)
    "num_segments": (torch.int64, 0),
    "token": (torch.int64, 0),  # the stream allowed to append (see EpisodeStream)
}

# The rows of `EpisodeDirectory.integers`.
INTEGER_COLUMNS = tuple(name for name, (dtype, _) in _COLUMNS.items() if dtype == torch.int64)


class Owners(NamedTuple):
    """Which episode each row belongs to, and that episode's extent (`engine` arrays).

    ``slot`` and ``first_step`` are by row (the episode's directory slot, and the episode
    step of the row's first step); the others by slot: ``total`` steps committed since step
    0, whether the episode is still ``opened``, its ``first_stored`` step, its draw count
    (``times``) and whether it ``terminated``. A row's steps are ``first_step ..
    first_step + length - 1``; its episode's stored steps ``first_stored .. total - 1``.
    """

    slot: Array
    first_step: Array
    total: Array
    opened: Array
    first_stored: Array
    times: Array
    terminated: Array


class EpisodeDirectory:
    """Per-episode state of a segmented buffer, by slot, with an episode id -> slot index."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.next_episode_id = 0
        self.next_token = 1
        self._free: list[int] = []
        self._index_ids = np.empty(_INITIAL_SLOTS, dtype=np.int64)
        self._index_slots = np.empty(_INITIAL_SLOTS, dtype=np.int64)
        self._index_size = 0
        self._tombstones = 0
        self._allocate(_INITIAL_SLOTS)
        self._free = list(range(_INITIAL_SLOTS - 1, -1, -1))  # popped lowest first

    # ----------------------------------------------------------------------------- layout
    def _allocate(self, slots: int) -> None:
        old, device = getattr(self, "columns", None), self.device
        self.slot_count = slots
        # Column c of `INTEGER_COLUMNS` is `integers[c]`, a view of one row-major matrix
        # (`engine.integer_columns`).
        self.integers = engine.integer_columns(len(INTEGER_COLUMNS), slots, self.device)
        integer_rows = dict(zip(INTEGER_COLUMNS, self.integers, strict=True))
        self.columns = {
            name: integer_rows[name].fill_(fill)
            if name in integer_rows
            else torch.full((slots,), fill, dtype=dtype, device=self.device)
            for name, (dtype, fill) in _COLUMNS.items()
        }
        if old is not None:
            used = int(next(iter(old.values())).shape[0])
            for name, column in self.columns.items():
                column[:used] = old[name]
        self.arrays = {name: engine.view(column) for name, column in self.columns.items()}
        # Host copies for bookkeeping without device round trips (the same memory on CPU).
        self.host = {name: column.cpu().numpy() for name, column in self.columns.items()}
        # `integers` as numpy on CPU (the same memory as `host`), for compiled bookkeeping.
        self.host_integers = self.integers.numpy() if device.type == "cpu" else None

    def set(self, name: str, slot: int, value: int | float | bool) -> None:
        """Write one value of one slot (on the device and in the host copy)."""
        self.host[name][slot] = value
        if self.device.type != "cpu":
            self.columns[name][slot] = value

    def get(self, name: str, slot: int) -> int:
        """One integer (or bool) value of one slot, from the host copy."""
        return int(self.host[name][slot])

    def push(self, names: tuple[str, ...]) -> None:
        """Copy the host copies of ``names`` to the device after a host-side update."""
        if self.device.type != "cpu":
            for name in names:
                self.columns[name].copy_(torch.from_numpy(self.host[name]))

    def sync_host(self, names: tuple[str, ...]) -> None:
        """Refresh the host copies of ``names`` after a vectorised device write."""
        if self.device.type != "cpu":
            for name in names:
                self.host[name][:] = self.columns[name].cpu().numpy()

    # ----------------------------------------------------------------------- episodes
    def open(self) -> tuple[int, int]:
        """Issue the next episode id and give it a slot; returns ``(episode_id, slot)``."""
        if not self._free:
            self._free.extend(range(2 * self.slot_count - 1, self.slot_count - 1, -1))
            self._allocate(2 * self.slot_count)
        slot = self._free.pop()
        episode_id = self.next_episode_id
        self.next_episode_id += 1
        for name, (_, fill) in _COLUMNS.items():
            self.set(name, slot, fill)
        self.set("episode_id", slot, episode_id)
        self.set("opened", slot, True)
        self._index_append(episode_id, slot)
        return episode_id, slot

    def new_token(self, slot: int) -> int:
        """Give ``slot`` a new stream token (earlier streams of the episode may not append)."""
        token = self.next_token
        self.next_token += 1
        self.set("token", slot, token)
        return token

    def drop(self, slots: np.ndarray) -> None:
        """Give back the slots of episodes that are closed and no longer stored."""
        for slot in slots.tolist():  # each episode leaves once: amortised O(1) per episode
            episode_id = self.get("episode_id", slot)
            position = int(np.searchsorted(self._index_ids[: self._index_size], episode_id))
            self._index_slots[position] = -1
            self.set("episode_id", slot, -1)
        self.released(slots)

    def released(self, slots: np.ndarray) -> None:
        """Take back ``slots`` whose ids just left the index (tombstones) and the slots."""
        self._tombstones += int(slots.shape[0])
        self._free.extend(slots.tolist())
        if self._tombstones * 2 > self._index_size:
            self._compact()

    def index(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The id index: sorted ids, their slots (-1: a tombstone) and how many are used.

        For compiled bookkeeping (`commit_loop`), which tombstones ids as `drop` does and
        then calls `released`.
        """
        return self._index_ids, self._index_slots, self._index_size

    # ------------------------------------------------------------------------ lookups
    def slot_of(self, episode_id: int) -> int:
        """The slot of a live episode, or -1."""
        size = self._index_size
        position = int(np.searchsorted(self._index_ids[:size], episode_id))
        if position < size and self._index_ids[position] == episode_id:
            return int(self._index_slots[position])
        return -1

    def slots_of(self, episode_ids: np.ndarray) -> np.ndarray:
        """The slots of live episodes ``episode_ids`` (int64 numpy), -1 for the others."""
        size = self._index_size
        if engine.compiled(episode_ids):
            flat = np.ascontiguousarray(episode_ids, dtype=np.int64).reshape(-1)
            found_slots = slots_of_loop(self._index_ids, self._index_slots, size, flat)
            return found_slots.reshape(episode_ids.shape)
        ids = self._index_ids[:size]
        positions = np.minimum(np.searchsorted(ids, episode_ids), max(size - 1, 0))
        if size == 0:
            return np.full(episode_ids.shape, -1, dtype=np.int64)
        found = ids[positions] == episode_ids
        slots: np.ndarray = np.where(found, self._index_slots[positions], -1)
        return slots

    def live_slots(self) -> np.ndarray:
        """Slots of every live episode, in id order."""
        slots = self._index_slots[: self._index_size]
        return slots[slots >= 0]

    def stored_slots(self) -> np.ndarray:
        """Slots of episodes with a stored step, oldest stored segment first."""
        slots = self.live_slots()
        slots = slots[self.host["num_segments"][slots] > 0]
        ordered: np.ndarray = slots[np.argsort(self.host["first_key"][slots], kind="stable")]
        return ordered

    def stored_ids(self) -> list[int]:
        """Ids of episodes with a stored step, oldest stored segment first."""
        return [int(i) for i in self.host["episode_id"][self.stored_slots()]]

    def open_ids(self) -> list[int]:
        """Ids of open episodes, in id order."""
        slots = self.live_slots()
        return [int(i) for i in self.host["episode_id"][slots[self.host["opened"][slots]]]]

    # ---------------------------------------------------------------------- the index
    def _index_append(self, episode_id: int, slot: int) -> None:
        if self._index_size == self._index_ids.shape[0]:
            self._compact()
        self._index_ids[self._index_size] = episode_id
        self._index_slots[self._index_size] = slot
        self._index_size += 1

    def _compact(self) -> None:
        """Drop the tombstones; leave room for as many ids again as stay (and one more)."""
        size = self._index_size
        live = self._index_slots[:size] >= 0
        ids, slots = self._index_ids[:size][live], self._index_slots[:size][live]
        room = max(_INITIAL_SLOTS, 2 * ids.shape[0] + 1)
        self._index_ids = np.empty(room, dtype=np.int64)
        self._index_slots = np.empty(room, dtype=np.int64)
        self._index_ids[: ids.shape[0]] = ids
        self._index_slots[: ids.shape[0]] = slots
        self._index_size, self._tombstones = int(ids.shape[0]), 0

    # -------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, object]:
        """The live episodes' rows (CPU tensors, in id order) and the id/token counters."""
        slots = torch.from_numpy(self.live_slots().copy())
        rows = {name: column.cpu()[slots].clone() for name, column in self.columns.items()}
        return {
            "next_episode_id": self.next_episode_id,
            "next_token": self.next_token,
            "columns": rows,
        }

    @classmethod
    def from_rows(
        cls,
        columns: dict[str, torch.Tensor],
        next_episode_id: int,
        next_token: int,
        device: torch.device,
    ) -> EpisodeDirectory:
        """A directory holding ``columns`` (checked rows in id order) in slots 0, 1, ..."""
        directory = cls(device)
        count = int(columns["episode_id"].shape[0])
        slots = _INITIAL_SLOTS
        while slots < count:
            slots *= 2
        directory._allocate(slots)
        for name, column in directory.columns.items():
            column[:count] = columns[name].to(device)
        directory.sync_host(tuple(_COLUMNS))
        directory._free = list(range(slots - 1, count - 1, -1))
        ids = columns["episode_id"].numpy()
        directory._index_ids = np.empty(max(_INITIAL_SLOTS, 2 * count), dtype=np.int64)
        directory._index_slots = np.empty_like(directory._index_ids)
        directory._index_ids[:count] = ids
        directory._index_slots[:count] = np.arange(count)
        directory._index_size = count
        directory.next_episode_id, directory.next_token = next_episode_id, next_token
        return directory


COLUMNS = tuple(_COLUMNS)
DTYPES = {name: dtype for name, (dtype, _) in _COLUMNS.items()}


@engine.jit
def slots_of_loop(
    index_ids: np.ndarray, index_slots: np.ndarray, size: int, episode_ids: np.ndarray
) -> np.ndarray:
    """`EpisodeDirectory.slots_of`, compiled: a binary search per id, level by level.

    Every search of ``size`` sorted ids takes the same steps, so one level of all of them is
    one loop of independent reads (a cold index is read with many misses in flight, not one
    chain per id), each step a select rather than a branch that a random id mispredicts
    (256 ids of a 3,883-id index, inside the benchmark's gathers across seams: 28 -> 12 us).
    """
    count = episode_ids.shape[0]
    slots = np.full(count, -1, dtype=np.int64)
    if size == 0:
        return slots
    base = np.zeros(count, dtype=np.int64)
    remaining = size
    while remaining > 1:  # base: the last position whose id is below the wanted one, or 0
        half = remaining >> 1
        for i in range(count):
            at = base[i]
            base[i] = at + half if index_ids[at + half] < episode_ids[i] else at
        remaining -= half
    for i in range(count):
        position = base[i] + (index_ids[base[i]] < episode_ids[i])
        if position < size and index_ids[position] == episode_ids[i]:
            slots[i] = index_slots[position]
    return slots


@engine.jit
def stored_slots_loop(
    episode_ids: np.ndarray,
    steps: np.ndarray,
    index_ids: np.ndarray,
    index_slots: np.ndarray,
    index_size: int,
    num_segments: np.ndarray,
    first_stored: np.ndarray,
    total: np.ndarray,
) -> tuple[np.ndarray, int]:
    """The slots of episodes ``episode_ids`` whose steps ``steps`` are stored, compiled.

    `slots_of_loop`, then the checks of `Segments.anchors` in the same call: returns the
    slots and -1, or the slots and the first pair refused (an id not stored, a step not
    stored).
    """
    slots = slots_of_loop(index_ids, index_slots, index_size, episode_ids)
    for i in range(episode_ids.shape[0]):
        slot, step = slots[i], steps[i]
        if slot < 0 or num_segments[slot] <= 0 or not first_stored[slot] <= step < total[slot]:
            return slots, i
    return slots, -1
