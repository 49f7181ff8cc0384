"""`SequenceReplay`: whole episodes in a transition ring, fixed-length chunks drawn uniformly.

The buffer composes its collaborators: it validates at the boundary, takes the lock, and
hands each step of the data path to its owner (`EpisodeTable` and `TransitionRing` store,
`AnchorSampler` draws, `window.expand` expands, `batch` assembles, `Priorities` holds the
prioritization state of a `PrioritizedSequenceReplay`).
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import attrs
import torch

from lucid_replay import checkpoint
from lucid_replay.batch import Batch, WindowBatch, chunk_batch, window_batch
from lucid_replay.checks import as_vector, check_device, check_int
from lucid_replay.episode import Episode
from lucid_replay.errors import (
    CheckpointError,
    UnknownEpisodeError,
    must,
    must_have,
    wrong_kind,
    wrong_type,
)
from lucid_replay.prefetch import Prefetcher
from lucid_replay.priorities import Priorities
from lucid_replay.sampling import Anchors, AnchorSampler
from lucid_replay.schema import Schema
from lucid_replay.storage import TransitionRing
from lucid_replay.table import EpisodeTable
from lucid_replay.window import MAX_RECORDS, Window, expand

__all__ = ["SequenceReplay"]

_ReplayT = TypeVar("_ReplayT", bound="SequenceReplay")
_UNITS = ("chunk", "episode")
_MAX_BATCH = 2**31 - 1
_MAX_PREFETCH = 2**16
_SEED_MAX = 2**64 - 1  # torch generators take seeds up to this


class SequenceReplay:
    """A replay buffer of whole episodes that samples fixed-length chunks uniformly.

    Parameters
    ----------
    capacity
        Transitions (steps) the buffer holds. When an episode does not fit, the oldest whole
        episodes are evicted until it does.
    device
        Where the storage lives (CPU or CUDA); batches default to it.
    unit
        ``"chunk"``: every window of ``length`` consecutive steps inside one stored episode is
        equally likely. ``"episode"``: an episode is drawn uniformly among those long enough,
        then a start uniformly inside it.
    seed
        An ``int`` in ``[0, 2**64)`` or a ``torch.Generator`` for reproducible draws; ``None``
        seeds from the OS.
    max_times_sampled
        Reuse limit: an episode is drawn at most this many times in total (also within one
        batch), then *retired*: never drawn again, and reclaimed as soon as it is the oldest.

    Raises
    ------
    InvalidArgumentError
        For a non-positive ``capacity`` or ``max_times_sampled``, an unknown ``unit``, a
        ``seed`` out of range, or a ``device`` this process cannot use.

    Notes
    -----
    Storage is one preallocated ``[capacity, *field_shape]`` tensor per field, used as a ring
    over transitions, plus an episode table of a few dozen bytes per episode. The first episode
    fixes the schema (field names, per-step shapes, dtypes). Episode ids are issued 0, 1, 2, ...
    and never reused. Every public method holds one lock, so collector threads may ``add``
    while learner threads sample; no reader sees a half-written episode.

    Every argument is validated before anything is drawn or written: a refused call changes
    nothing (state, counters, random stream). After ``os.fork`` the child's buffer has a new
    lock and prefetch state and a random stream reseeded from the OS, so children never
    repeat the parent's draws; call `reseed` in each child for reproducible streams.

    Examples
    --------
    >>> import torch
    >>> buffer = SequenceReplay(capacity=100, seed=0)
    >>> buffer.add(Episode({"obs": torch.arange(10.0)}))
    0
    >>> batch = buffer.sample(batch_size=4, length=3)
    >>> batch["obs"].shape, bool((batch["obs"].diff(dim=1) == 1).all())
    (torch.Size([4, 3]), True)
    """

    def __init__(
        self,
        capacity: int = 1_000_000,
        *,
        device: torch.device | str = "cpu",
        unit: str = "chunk",
        seed: int | torch.Generator | None = None,
        max_times_sampled: int | None = None,
    ) -> None:
        self._capacity = check_int("capacity", capacity, minimum=1, maximum=2**62)
        if unit not in _UNITS:
            raise must("unit", f"one of {_UNITS}", unit)
        if max_times_sampled is not None:
            max_times_sampled = check_int("max_times_sampled", max_times_sampled, minimum=1)
        self._device = check_device("device", device)
        self._generator = _make_generator(seed, self._device)
        self._lock = threading.RLock()
        self._schema: Schema | None = None
        self._ring = TransitionRing(self._capacity, self._device)
        self._table = EpisodeTable(self._device)
        self._sampler = AnchorSampler(self._table, unit, max_times_sampled)
        self._priorities: Priorities | None = None  # set by PrioritizedSequenceReplay
        self._counts = dict.fromkeys(checkpoint.COUNTS, 0)
        # An int on CPU; on a device a 0-d tensor, so that eviction never waits for the device.
        self._evicted_unsampled: int | torch.Tensor = 0
        _buffers.add(self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        checkpoint.register(cls)

    # ------------------------------------------------------------------------ properties
    @property
    def capacity(self) -> int:
        """Transitions the buffer can hold."""
        return self._capacity

    @property
    def device(self) -> torch.device:
        """Device of the storage."""
        return self._device

    @property
    def unit(self) -> str:
        """``"chunk"`` or ``"episode"``: what is equally likely in a uniform draw."""
        return self._sampler.unit

    @property
    def max_times_sampled(self) -> int | None:
        """The reuse limit, or ``None``."""
        return self._sampler.reuse_limit

    @property
    def num_episodes(self) -> int:
        """Stored episodes."""
        return self._table.num_episodes

    @property
    def episode_ids(self) -> range:
        """Ids of the stored episodes, oldest first (always a contiguous range)."""
        return range(self._table.first_id, self._table.next_id)

    @property
    def schema(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """Field name -> (per-step shape, dtype), fixed by the first episode; ``None`` before."""
        return self._schema

    def __len__(self) -> int:
        return self._table.num_transitions

    def __contains__(self, episode_id: object) -> bool:
        if isinstance(episode_id, bool):
            return False  # True == 1, but a flag is never an id
        try:
            return operator.index(episode_id) in self.episode_ids  # type: ignore[arg-type]
        except TypeError:
            return False

    def __getitem__(self, episode_id: int) -> Episode:
        """A copy of stored episode ``episode_id``; `UnknownEpisodeError` (a ``KeyError``)."""
        with self._lock:
            episode_id = self._check_stored(episode_id)
            start, length = self._table.episode_range(episode_id)
            terminated = bool(self._table.terminated[self._table.row_of(episode_id)])
            return Episode(self._ring.read(start, length), terminated=terminated)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self.capacity}, transitions={len(self)}, "
            f"episodes={self.num_episodes}, unit={self.unit!r}, device={str(self.device)!r})"
        )

    # ---------------------------------------------------------------------------- adding
    def add(self, episode: Episode) -> int:
        """Store a copy of ``episode`` whole and return its episode id.

        The oldest whole episodes are evicted until it fits. O(T) copy plus O(log E).

        Raises
        ------
        InvalidArgumentError
            If the episode is longer than ``capacity`` (nothing is evicted).
        SchemaError, SchemaDtypeError
            If its fields, per-step shapes (``ValueError``) or dtypes (``TypeError``) differ
            from the schema the first episode fixed, if a field takes a name reserved for the
            per-record entries of a `WindowBatch`, or if a dtype cannot be stored (for
            example ``uint16``). The buffer is unchanged.
        MemoryError
            If the first episode's storage (``capacity`` steps of its fields) cannot be
            allocated; the buffer stays as if never used.
        """
        with self._lock:
            schema = self._validate(episode, self._schema)
            return self._store(episode, schema)

    def extend(self, episodes: Iterable[Episode]) -> list[int]:
        """Add several episodes; all are validated before any is stored."""
        episodes = list(episodes)
        with self._lock:
            schemas = []
            schema = self._schema
            for episode in episodes:
                schema = self._validate(episode, schema)
                schemas.append(schema)
            return [self._store(e, s) for e, s in zip(episodes, schemas, strict=True)]

    def _validate(self, episode: Episode, schema: Schema | None) -> Schema:
        if not isinstance(episode, Episode):
            raise TypeError(f"episode must be an Episode, got {type(episode).__name__}")
        if len(episode) > self._capacity:
            raise must("episode length", f"<= capacity ({self._capacity})", len(episode))
        if schema is None:
            episode.schema.check_storable()
            return episode.schema
        schema.check(episode.schema)
        return schema

    def _store(self, episode: Episode, schema: Schema) -> int:
        if self._schema is None:
            self._ring.allocate(schema)  # all or nothing: a failure fixes no schema
            self._schema = schema
        length = len(episode)
        to_evict = self._table.count_to_evict(self._capacity, length)
        if to_evict:
            self._evict(to_evict)
            self._reclaim_retired()  # a retired episode may have just become the oldest
        # Data first: if the copy fails, no table row claims the slots it was writing.
        self._ring.write(self._table.next_offset, episode.steps, episode._host_steps)
        priority = 1.0 if self._priorities is None else self._priorities.max_priority
        episode_id, row, _ = self._table.append(length, episode.terminated, priority)
        self._sampler.mark_dirty(row)
        self._counts["episodes_added"] += 1
        self._counts["transitions_added"] += length
        return episode_id

    def _evict(self, count: int) -> None:
        rows, transitions, unsampled = self._table.evict_oldest(count)
        self._evicted_unsampled = self._evicted_unsampled + unsampled
        self._sampler.mark_dirty(rows)
        self._counts["episodes_evicted"] += count
        self._counts["transitions_evicted"] += transitions

    def _reclaim_retired(self) -> None:
        """Evict retired episodes at the front of the queue: they can never be drawn again."""
        leading = self._sampler.leading_retired()
        if leading:
            self._evict(leading)

    # -------------------------------------------------------------------------- sampling
    def sample(
        self, batch_size: int, length: int, *, device: torch.device | str | None = None
    ) -> Batch:
        """Draw ``batch_size`` chunks of ``length`` consecutive steps uniformly, with replacement.

        O(B log E + B length). With ``unit="chunk"`` every chunk inside a stored episode is
        equally likely; with ``unit="episode"`` every episode with ``T >= length`` is.

        Raises
        ------
        InvalidArgumentError
            If the buffer is empty, no stored episode has ``T >= length``, ``batch_size`` or
            ``length`` is below 1, or ``device`` cannot be used.
        ReuseLimitError
            If the reuse limit leaves fewer than ``batch_size`` draws (nothing is drawn).
        """
        return self._sample_chunks(batch_size, length, device, prioritized=False)

    def _sample_chunks(
        self,
        batch_size: int,
        length: int,
        device: torch.device | str | None,
        *,
        prioritized: bool,
    ) -> Batch:
        check_int("batch_size", batch_size, minimum=1, maximum=_MAX_BATCH)
        check_int("length", length, minimum=1, maximum=MAX_RECORDS)
        target = self._batch_device(device)
        with self._lock:
            anchors = self._draw(batch_size, Window(length), prioritized=prioritized)
            batch = chunk_batch(self._ring, self._table, anchors, length, target)
            self._reclaim_retired()  # only once the batch no longer needs their rows
            return batch

    def sample_windows(
        self,
        batch_size: int,
        window: Window,
        *,
        prioritized: bool | None = None,
        device: torch.device | str | None = None,
    ) -> WindowBatch:
        """Draw ``batch_size`` anchors and expand each into a `Window` of records.

        Anchors are eligible as `Window` describes; they are drawn uniformly (``unit`` as for
        `sample`) or, on a `PrioritizedSequenceReplay`, by priority. ``prioritized=None`` means
        prioritized exactly on a `PrioritizedSequenceReplay`. With ``Window(length)`` the draw
        equals ``sample(batch_size, length)`` (or ``sample_prioritized``) draw for draw.
        Cost O(B log E + B W).
        """
        check_int("batch_size", batch_size, minimum=1, maximum=_MAX_BATCH)
        _check_window(window)
        use_priorities = self._use_priorities(prioritized)
        target = self._batch_device(device)
        with self._lock:
            anchors = self._draw(batch_size, window, prioritized=use_priorities)  # sampling
            records = expand(self._table, anchors, window)  # window
            batch = window_batch(self._ring, self._table, anchors, records, window, target)
            self._reclaim_retired()  # only once the batch no longer needs their rows
            return batch

    def gather_windows(
        self,
        episode_ids: Any,
        anchor_steps: Any,
        window: Window,
        *,
        device: torch.device | str | None = None,
    ) -> WindowBatch:
        """Expand given anchors (any stored step) into windows; not counted by the reuse limit.

        Raises
        ------
        UnknownEpisodeError
            (a ``KeyError``) for an id that is not stored.
        InvalidArgumentError
            For a step outside its episode or arguments of different lengths.
        """
        _check_window(window)
        ids = as_vector("episode_ids", episode_ids, torch.int64, self._device).clone()
        steps = as_vector("anchor_steps", anchor_steps, torch.int64, self._device).clone()
        if ids.shape != steps.shape:
            raise must("anchor_steps", f"as long as episode_ids ({ids.numel()})", steps.numel())
        target = self._batch_device(device)
        with self._lock:
            stored = self._table.is_stored(ids)
            if not bool(stored.all()):
                self._check_stored(int(ids[~stored][0]))
            lengths = self._table.length[self._table.rows_of(ids)]
            outside = (steps < 0) | (steps >= lengths)
            if bool(outside.any()):
                at = int(outside.nonzero()[0])
                raise must(
                    f"anchor_steps[{at}]",
                    f"a step of episode {int(ids[at])} (0 .. {int(lengths[at]) - 1})",
                    int(steps[at]),
                )
            anchors = Anchors(self._table.rows_of(ids), ids, steps)
            records = expand(self._table, anchors, window)
            return window_batch(self._ring, self._table, anchors, records, window, target)

    def num_eligible(self, window: Window) -> int:
        """How many anchors or episodes a draw of ``window`` can choose from now.

        Anchors for ``unit="chunk"``, episodes for ``unit="episode"``; retired episodes
        (reuse limit reached) are excluded. O(1) amortised, so a loop can wait on it until it
        may sample (``> 0``).
        """
        _check_window(window)
        with self._lock:
            return round(self._sampler.mass(window.anchor_span, None))

    def _draw(self, batch_size: int, window: Window, *, prioritized: bool) -> Anchors:
        """Draw anchors whose learning region fits (the one place a draw starts)."""
        if self._table.num_episodes == 0:
            raise must_have("the buffer", "non-empty to sample", "0 stored episodes")
        span = window.anchor_span
        alpha = None if not prioritized or self._priorities is None else self._priorities.alpha
        if self._sampler.mass(span, alpha) <= 0:
            what = "length" if window == Window(window.length) else "the window's anchor span"
            raise self._sampler.nothing_eligible(span, what, batch_size)
        anchors = self._sampler.draw(batch_size, span, alpha=alpha, generator=self._generator)
        if self._priorities is not None and alpha is not None:
            anchors = attrs.evolve(anchors, weights=self._priorities.weights(anchors.priorities))
        self._counts["chunks_sampled"] += batch_size
        return anchors

    def _use_priorities(self, prioritized: object) -> bool:
        """``sample_windows``' ``prioritized``: ``None`` means "if this buffer has them"."""
        if prioritized is None:
            return self._priorities is not None
        if not isinstance(prioritized, bool):
            raise wrong_type("prioritized", "a bool or None", prioritized)
        if prioritized and self._priorities is None:
            raise must("prioritized", f"False or None on a {type(self).__name__}", prioritized)
        return prioritized

    def _batch_device(self, device: object) -> torch.device:
        return self._device if device is None else check_device("device", device)

    def _check_stored(self, episode_id: object) -> int:
        """Return ``episode_id`` as an int if it is stored; raise otherwise."""
        try:
            if isinstance(episode_id, bool):
                raise TypeError
            episode_id = operator.index(episode_id)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"episode_id must be an int, got {episode_id!r}") from None
        if episode_id not in self.episode_ids:
            state = "was evicted" if 0 <= episode_id < self._table.first_id else "was never issued"
            raise UnknownEpisodeError(
                f"episode_id must be a stored episode ({self.episode_ids.start}.."
                f"{self.episode_ids.stop - 1}), got {episode_id}: it {state}"
            )
        return episode_id

    # --------------------------------------------------------------------- stored state
    def write_back(self, batch: Batch | WindowBatch, name: str, values: torch.Tensor) -> int:
        """Write per-record ``values`` (``[B, W, *field_shape]``) into stored field ``name``.

        ``batch`` is a `WindowBatch` (its valid records are written) or a chunk `Batch`
        (every record is valid). Records of episodes evicted since the draw are skipped, for
        example refreshed recurrent states; returns how many records were written. Where
        records overlap, one of the overlapping values is kept.
        """
        if isinstance(batch, WindowBatch):
            mask, ids, steps = batch.validity_mask, batch.record_episode_ids, batch.record_steps
        elif isinstance(batch, Batch):
            length = next(iter(batch.data.values())).shape[1]
            offsets = torch.arange(length, device=batch.starts.device)
            steps = batch.starts.unsqueeze(1) + offsets
            ids = batch.episode_ids.unsqueeze(1).expand_as(steps)
            mask = torch.ones_like(steps, dtype=torch.bool)
        else:
            raise wrong_kind("batch", "a Batch or WindowBatch", type(batch).__name__)
        with self._lock:
            if self._schema is None:
                raise must("name", "a stored field []", name)
            self._schema.check_values(name, values, tuple(mask.shape))
            ids, steps = ids.to(self._device), steps.to(self._device)
            write = mask.to(self._device) & self._table.is_stored(ids)
            rows = self._table.rows_of(ids[write])
            offsets = self._table.start[rows] + steps[write]
            # Stored data is never part of an autograd graph (states from a forward pass).
            stored = values.detach().to(self._device)[write]
            self._ring.scatter(name, offsets, stored, self._table.oldest_offset)
            return int(write.sum())

    # ---------------------------------------------------------------------- prefetching
    def iterate(
        self,
        batch_size: int,
        window: Window,
        *,
        prefetch: int = 2,
        device: torch.device | str | None = None,
    ) -> Iterator[WindowBatch]:
        """Yield `sample_windows` batches prepared by a background thread, endlessly.

        Up to ``prefetch`` batches wait ready; each was drawn with the priorities of the
        moment it was drawn, so updates made meanwhile reach batches drawn after them.
        Prefetched batches are drawn when they are prepared, so they count towards
        max_times_sampled (and ``chunks_sampled``) even if the loop never consumes them.
        Closing the iterator (``close()``, or leaving a ``for`` loop or ``with`` block) stops
        and joins the thread; an iterator that is merely dropped stops its thread without
        waiting for it.
        """
        check_int("batch_size", batch_size, minimum=1, maximum=_MAX_BATCH)
        check_int("prefetch", prefetch, minimum=1, maximum=_MAX_PREFETCH)
        _check_window(window)
        target = self._batch_device(device)
        return Prefetcher(lambda: self.sample_windows(batch_size, window, device=target), prefetch)

    # ------------------------------------------------------------------------- reporting
    def stats(self) -> dict[str, int]:
        """Counters since construction: adds, evictions, retirements, draws."""
        with self._lock:
            return {
                **self._counts,
                "episodes_evicted_unsampled": int(self._evicted_unsampled),
                "episodes_retired": int(self._sampler.episodes_retired),
                "episodes_stored": self.num_episodes,
                "transitions_stored": len(self),
            }

    def reseed(self, seed: int | torch.Generator | None = None) -> None:
        """Restart the random stream: from ``seed`` (as the constructor's), or the OS.

        For reproducible draws in forked workers (for example a ``torch.utils.data``
        ``DataLoader``), reseed in each worker from its own seed:
        ``worker_init_fn=lambda worker: buffer.reseed(torch.initial_seed() % 2**64)``.
        """
        generator = _make_generator(seed, self._device)
        with self._lock:
            self._generator = generator

    # ----------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the buffer exactly (tensors on CPU)."""
        with self._lock:
            return checkpoint.pack(self._snapshot())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict`; on any error the buffer is left unchanged.

        Raises
        ------
        CheckpointError
            For a state of another class, another configuration, or one that breaks an
            invariant of the episode table, the data, the counters, the RNG state or the
            priorities.
        """
        with self._lock:
            checkpoint.check_header(state)
            if state.get("class") != type(self).__name__:
                raise CheckpointError(
                    f"checkpoint class must be a {type(self).__name__}, got {state.get('class')!r}"
                )
            snapshot = checkpoint.unpack(state, device=self._device, capacity=self._capacity)
            priorities = self._check_snapshot(snapshot)
            self._adopt(snapshot, priorities)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the buffer to ``path`` atomically (a temporary file, then a rename).

        The file carries a checksum of its contents: a corrupted file is refused by `load`.
        """
        checkpoint.write(path, self.state_dict())

    @classmethod
    def load(
        cls: type[_ReplayT],
        path: str | os.PathLike[str],
        *,
        device: torch.device | str | None = None,
    ) -> _ReplayT:
        """Read a buffer saved by `save`; returns the class that was saved.

        Raises
        ------
        CheckpointError
            (a ``ValueError``) for a file that is not a buffer, is truncated or corrupt
            (its checksum fails), has an unknown format version or a bad configuration.
        """
        state = checkpoint.read(path)
        saved = checkpoint.saved_class(state)
        if not issubclass(saved, cls):
            raise CheckpointError(
                f"checkpoint class must be a {cls.__name__}, got {state.get('class')!r}"
            )
        config = state["config"]
        if not isinstance(config, Mapping):
            raise CheckpointError(f"checkpoint configuration must be a mapping, got {config!r}")
        config = dict(config)
        if device is not None:
            config["device"] = device
        try:
            buffer = saved(**config)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"checkpoint configuration must be valid, got {error}") from None
        buffer.load_state_dict(state)
        return buffer

    def _config(self) -> dict[str, Any]:
        config = {
            "capacity": self._capacity,
            "device": str(self._device),
            "unit": self.unit,
            "max_times_sampled": self.max_times_sampled,
        }
        return config if self._priorities is None else {**config, **self._priorities.config()}

    def _snapshot(self) -> checkpoint.Snapshot:
        return checkpoint.Snapshot(
            class_name=type(self).__name__,
            config=self._config(),
            schema=self._schema,
            table=self._table,
            ring=self._ring,
            counts=dict(self._counts),
            evicted_unsampled=int(self._evicted_unsampled),
            episodes_retired=int(self._sampler.episodes_retired),
            rng=self._generator.get_state(),
            extra={} if self._priorities is None else self._priorities.state(),
        )

    def _check_snapshot(self, snapshot: checkpoint.Snapshot) -> Priorities | None:
        """Refuse a snapshot this buffer cannot adopt; return the priorities it restores."""
        if snapshot.class_name != type(self).__name__:
            raise CheckpointError(
                f"checkpoint class must be a {type(self).__name__}, got {snapshot.class_name!r}"
            )
        mine = {k: v for k, v in self._config().items() if k != "device"}
        theirs = {k: v for k, v in snapshot.config.items() if k != "device"}
        if mine != theirs:
            raise CheckpointError(f"checkpoint configuration must be {mine}, got {theirs}")
        _check_counts(snapshot, self.max_times_sampled)
        try:  # a state torch refuses, on a scratch generator so that ours stays untouched
            torch.Generator(device=self._device).set_state(snapshot.rng)
        except (RuntimeError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"checkpoint rng must be a state of this buffer's generator, got one torch "
                f"refuses ({str(error).splitlines()[0]})"
            ) from None
        table = snapshot.table
        stored = table.priority[table.stored_rows()]
        if self._priorities is None:
            if snapshot.extra:
                raise CheckpointError(f"checkpoint extra state must be empty, got {snapshot.extra}")
            if not bool((stored == 1.0).all()):
                raise CheckpointError(
                    "checkpoint priority of every episode of a uniform buffer must be 1, got "
                    f"{sorted(set(stored.tolist()) - {1.0})[:3]}"
                )
            return None
        return self._priorities.with_state(snapshot.extra, stored)

    def _adopt(self, snapshot: checkpoint.Snapshot, priorities: Priorities | None) -> None:
        """Commit a checked snapshot (nothing here can fail)."""
        self._schema = snapshot.schema
        self._ring = snapshot.ring
        self._table = snapshot.table
        self._sampler.table = snapshot.table
        self._sampler.invalidate()
        self._sampler.episodes_retired.fill_(snapshot.episodes_retired)
        self._counts = dict(snapshot.counts)
        self._evicted_unsampled = snapshot.evicted_unsampled
        self._generator.set_state(snapshot.rng)
        self._priorities = priorities

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock, and a random stream of its own."""
        self._lock = threading.RLock()
        self._generator.seed()


def _check_counts(snapshot: checkpoint.Snapshot, reuse_limit: int | None) -> None:
    """Refuse counters that contradict the table (or the reuse limit) they were saved with."""
    table, counts = snapshot.table, snapshot.counts
    stored = table.stored_rows()
    times = table.times_sampled[stored]
    expected = {
        "episodes_added": table.next_id,
        "episodes_evicted": table.first_id,
        "transitions_added": table.next_offset,
        "transitions_evicted": table.oldest_offset,
    }
    for name, value in expected.items():
        if counts[name] != value:
            raise CheckpointError(
                f"checkpoint counts[{name!r}] must equal the table's {value}, got {counts[name]}"
            )
    if snapshot.evicted_unsampled > table.first_id:
        raise CheckpointError(
            f"checkpoint evicted_unsampled must be <= episodes_evicted ({table.first_id}), "
            f"got {snapshot.evicted_unsampled}"
        )
    if reuse_limit is not None and bool((times > reuse_limit).any()):
        raise CheckpointError(
            f"checkpoint times_sampled must be <= max_times_sampled={reuse_limit}, "
            f"got {int(times.max())}"
        )
    if int(times.sum()) > counts["chunks_sampled"]:
        raise CheckpointError(
            f"checkpoint chunks_sampled must be >= the draws of stored episodes "
            f"({int(times.sum())}), got {counts['chunks_sampled']}"
        )
    retired = 0 if reuse_limit is None else int((times >= reuse_limit).sum())
    if not retired <= snapshot.episodes_retired <= table.next_id:
        raise CheckpointError(
            f"checkpoint episodes_retired must be in [{retired}, {table.next_id}] for its "
            f"table, got {snapshot.episodes_retired}"
        )


def _make_generator(seed: object, device: torch.device) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(check_int("seed", seed, minimum=0, maximum=_SEED_MAX))
    return generator


def _check_window(window: object) -> None:
    if not isinstance(window, Window):
        raise TypeError(f"window must be a Window, got {type(window).__name__}")


checkpoint.register(SequenceReplay)
_buffers: weakref.WeakSet[SequenceReplay] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for buffer in list(_buffers):
        buffer._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
