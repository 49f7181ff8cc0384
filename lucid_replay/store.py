"""`EpisodeStore`: what a buffer holds, and the rules of adding, evicting and looking up.

It owns the schema, the transition ring, the episode table and their counters. Adds copy the
data before the table records the episode, evict whole episodes oldest-first, and reclaim
retired episodes as soon as they are the oldest. Every row whose leaf a sum tree must
recompute is reported to ``on_change`` (the sampler's `AnchorSampler.mark_dirty`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lucid_replay import engine
from lucid_replay.allocators import Allocator
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.checks import as_id, as_vector
from lucid_replay.episode import Episode, host_views
from lucid_replay.errors import UnknownEpisodeError, must, wrong_kind
from lucid_replay.records import Anchors
from lucid_replay.ring import TransitionRing
from lucid_replay.schema import Schema
from lucid_replay.segments import Segments
from lucid_replay.table import EpisodeTable

if TYPE_CHECKING:
    from lucid_replay.checkpoint import Snapshot

__all__: list[str] = []  # internal module

COUNTS = ("episodes_added", "transitions_added", "episodes_evicted", "transitions_evicted")


def check_episode(
    episode: object, schema: Schema | None, capacity: int, *, declared: bool
) -> Schema:
    """The schema ``episode`` is stored under, after ``schema`` (None: the first fixes it).

    The one rule for what a buffer stores, which a sharded replay's client applies before it
    sends an episode to a shard: an `Episode` of at most ``capacity`` steps, whose fields,
    shapes and dtypes are ``schema``'s; a ``declared`` schema also takes same-kind dtypes,
    cast when stored, if the cast changes no value.
    """
    if not isinstance(episode, Episode):
        raise wrong_kind("episode", "an Episode", type(episode).__name__)
    if len(episode) > capacity:
        raise must("episode length", f"<= capacity ({capacity})", len(episode))
    if schema is None:
        episode.schema.check_storable()
        return episode.schema
    schema.check(episode.schema, cast=declared)
    if declared and episode.schema != schema:
        schema.check_casts(episode.steps)  # a cast must not change a value
    return schema


class EpisodeStore:
    """A schema, a ring of ``capacity`` transitions on ``device``, and the episode table.

    Parameters
    ----------
    capacity, device
        Of the ring.
    allocator
        Where the ring's fields are kept (`lucid_replay.allocators`); a checkpoint loaded into
        the store is kept there too.
    reuse_limit
        ``max_times_sampled``: episodes drawn this often are retired, reclaimed when oldest.
    declared
        A schema fixed in advance (else the first episode fixes it); ``add`` then casts
        dtypes to it where numpy's ``same_kind`` rule allows.

    Attributes
    ----------
    on_change
        Called with the rows (an ``int``, a list of them or a tensor) whose leaves
        changed; set by the owner of the sum trees.
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        reuse_limit: int | None,
        declared: Schema | None = None,
        *,
        segment_length: int | None = None,
        priority_unit: str = "episode",
        unit: str = "chunk",
        allocator: Allocator,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.capacity = capacity
        self.reuse_limit = reuse_limit
        self.on_change: Callable[[int | list[int] | torch.Tensor], None] = _ignore
        self.schema = declared
        self.declared = declared is not None  # a declared schema casts same-kind dtypes
        self.allocator = allocator
        self.ring = TransitionRing(capacity, device, allocator, cache_bytes)
        self.table = EpisodeTable(device, segmented=segment_length is not None)
        self.segments = (
            None if segment_length is None else Segments(self, segment_length, priority_unit, unit)
        )
        self.counts = dict.fromkeys(COUNTS, 0)
        # An int on CPU; on a device a 0-d tensor, so that eviction never waits for the device.
        self.evicted_unsampled: int | torch.Tensor = 0

    # ---------------------------------------------------------------------------- adding
    def checked_schema(self, episode: object, schema: Schema | None) -> Schema:
        """The schema ``episode`` is stored under, after ``schema`` (None: the first)."""
        return check_episode(episode, schema, self.capacity, declared=self.declared)

    def fix_schema(self, schema: Schema) -> None:
        """Allocate the ring for ``schema`` on the first store (all or nothing)."""
        if not self.ring.allocated:
            self.ring.allocate(schema)  # all or nothing: a failure fixes no schema
            self.schema = schema

    def add(self, episode: Episode, schema: Schema, priority: Callable[[], float]) -> int:
        """Store a copy of a checked ``episode`` (see `checked_schema`); return its id.

        ``priority()`` is the largest priority ever set (what a new episode or segment gets).
        On a segmented store the episode is opened, committed in segments and closed.
        """
        self.fix_schema(schema)
        if episode.schema != schema:  # a declared schema's same-kind casts
            cast = {name: t.to(schema[name][1]) for name, t in episode.steps.items()}
            episode = Episode(cast, terminated=episode.terminated)
        if self.segments is not None:
            return self.segments.add(episode, priority)
        table, length = self.table, len(episode)
        to_evict = table.count_to_evict(self.capacity, length)
        if to_evict:
            self.evict(to_evict)
            self.reclaim_retired()  # a retired episode may have just become the oldest
        # Data first: if the copy fails, no table row claims the slots it was writing.
        self.ring.write(table.next_offset, episode.steps, host_views(episode))
        episode_id, row, _ = table.append(length, episode.terminated, priority())
        self.on_change(row)
        self.counts["episodes_added"] += 1
        self.counts["transitions_added"] += length
        return episode_id

    def evict(self, count: int) -> None:
        """Drop the ``count`` oldest episodes (segments, on a segmented store)."""
        rows, transitions, unsampled = self.table.evict_oldest(count)
        if self.segments is not None:  # episodes leave with their last stored segment
            count, unsampled = self.segments.evicted(rows)
        self.evicted_unsampled = self.evicted_unsampled + unsampled
        self.on_change(rows)
        self.counts["episodes_evicted"] += count
        self.counts["transitions_evicted"] += transitions

    def reclaim_retired(self) -> None:
        """Evict retired episodes at the front of the queue: they can never be drawn again.

        Reads the table in blocks of 64 rows from the oldest: O(retired + 64).
        """
        limit, table = self.reuse_limit, self.table
        if limit is None:
            return
        while table.num_episodes:
            ids = torch.arange(
                table.first_id, min(table.first_id + 64, table.next_id), device=table.device
            )
            owners = table.owners()
            slots = engine.tensor(owners.slot)[table.rows_of(ids)]
            retired = engine.tensor(owners.times)[slots] >= limit
            leading = int(retired.int().cumprod(dim=0).sum())
            if leading:
                self.evict(leading)
            if leading < ids.numel():
                return

    def memory(self) -> dict[str, int]:
        """Bytes held by the ring (``data_bytes``) and the episode table (``table_bytes``)."""
        return {
            "data_bytes": _bytes(self.ring.fields.values())
            + (0 if self.ring.compressed is None else self.ring.compressed.stored_bytes()),
            "table_bytes": _bytes(self.table.columns.values()),
        }

    def adopt(self, snapshot: Snapshot) -> None:
        """Take the stored state of a checked ``snapshot`` (nothing here can fail)."""
        self.schema, self.ring, self.table = snapshot.schema, snapshot.ring, snapshot.table
        self.counts = {name: snapshot.counts[name] for name in COUNTS}
        self.evicted_unsampled = snapshot.evicted_unsampled

    # --------------------------------------------------------------------------- lookups
    def num_episodes(self) -> int:
        """Stored episodes (with a stored step)."""
        if self.segments is None:
            return self.table.num_episodes
        return int(self.segments.directory.stored_slots().shape[0])

    def episode_ids(self) -> Sequence[int]:
        """Stored episode ids, oldest first (a ``range`` for whole episodes)."""
        if self.segments is None:
            return range(self.table.first_id, self.table.next_id)
        return self.segments.directory.stored_ids()

    def next_episode_id(self) -> int:
        """The id the next episode gets."""
        if self.segments is None:
            return self.table.next_id
        return self.segments.directory.next_episode_id

    def stored_id(self, episode_id: object) -> int:
        """``episode_id`` as an int if it is stored; `UnknownEpisodeError` otherwise."""
        number = as_id("episode_id", episode_id)
        if self.segments is not None:
            self.segments.live_slot(number, stored=True)
            return number
        table = self.table
        if not table.first_id <= number < table.next_id:
            state = "was evicted" if 0 <= number < table.first_id else "was never issued"
            raise UnknownEpisodeError(
                f"episode_id must be a stored episode ({table.first_id}.."
                f"{table.next_id - 1}), got {number}: it {state}"
            )
        return number

    def episode(self, episode_id: int) -> Episode:
        """A copy of stored episode ``episode_id`` (checked by `stored_id`).

        On a segmented store: its stored steps (``terminated`` only once it is closed).
        """
        if self.segments is not None:
            slot = self.segments.live_slot(episode_id, stored=True)
            directory = self.segments.directory
            ended = bool(directory.host["terminated"][slot]) and not directory.get("opened", slot)
            return Episode(self.segments.episode_steps(slot), terminated=ended)
        start, length = self.table.episode_range(episode_id)
        terminated = bool(self.table.terminated[self.table.row_of(episode_id)])
        return Episode(self.ring.read(start, length), terminated=terminated)

    def anchors(self, episode_ids: Any, anchor_steps: Any) -> Anchors:
        """Anchors at given stored steps (lists, arrays or tensors of ints, ``[B]`` each).

        Refuses ids that are not stored and steps outside their episode.
        """
        if self.segments is not None:
            return self.segments.anchors(episode_ids, anchor_steps)
        device = self.table.device
        ids = as_vector("episode_ids", episode_ids, torch.int64, device).clone()  # owned
        steps = as_vector("anchor_steps", anchor_steps, torch.int64, device).clone()
        if ids.shape != steps.shape:
            raise must("anchor_steps", f"as long as episode_ids ({ids.numel()})", steps.numel())
        table = self.table
        stored = table.is_stored(ids)
        if not bool(stored.all()):
            self.stored_id(int(ids[~stored][0]))
        lengths = table.length[table.rows_of(ids)]
        outside = (steps < 0) | (steps >= lengths)
        if bool(outside.any()):
            at = int(outside.nonzero()[0])
            raise must(
                f"anchor_steps[{at}]",
                f"a step of episode {int(ids[at])} (0 .. {int(lengths[at]) - 1})",
                int(steps[at]),
            )
        rows = table.rows_of(ids)
        return Anchors(engine.view(rows), engine.view(ids), engine.view(steps))

    def write_records(
        self,
        name: str,
        ids: torch.Tensor,
        steps: torch.Tensor,
        mask: torch.Tensor,
        values: torch.Tensor,
    ) -> int:
        """Write ``values`` ``[B, W, ...]`` into field ``name`` at records ``(ids, steps)``.

        Only where ``mask`` holds and the episode is still stored; returns how many records
        were written.
        """
        if self.schema is None:
            raise must("name", "a stored field []", name)
        self.schema.check_values(name, values, tuple(mask.shape))
        device, table = self.table.device, self.table
        ids, steps = ids.to(device), steps.to(device)
        if self.segments is not None:  # only steps still stored, of their segments
            write, rows = self.segments.stored_records(ids, steps, mask.to(device))
        else:
            write = mask.to(device) & table.is_stored(ids)
            rows = table.rows_of(ids[write])
        offsets = engine.tensor(table.offsets(engine.view(rows), engine.view(steps[write])))
        # Stored data is never part of an autograd graph (states from a forward pass).
        self.ring.scatter(name, offsets, values.detach().to(device)[write], table.oldest_offset)
        return int(write.sum())


def _ignore(rows: int | list[int] | torch.Tensor) -> None:
    """`EpisodeStore.on_change` until an owner sets it."""


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
