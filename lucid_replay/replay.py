"""`SequenceReplay`: whole episodes in a transition ring, fixed-length chunks drawn uniformly."""

from __future__ import annotations

import operator
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from lucid_replay import checkpoint
from lucid_replay import window as windows
from lucid_replay.batch import Batch, WindowBatch, gather
from lucid_replay.episode import Episode
from lucid_replay.errors import (
    CheckpointError,
    ReuseLimitError,
    SchemaDtypeError,
    SchemaError,
    UnknownEpisodeError,
    as_vector,
    check_int,
    must,
)
from lucid_replay.prefetch import iterate_in_background
from lucid_replay.sampling import Anchors, AnchorSampler
from lucid_replay.storage import EpisodeTable, TransitionRing
from lucid_replay.window import Window

__all__ = ["SequenceReplay"]

Schema = dict[str, tuple[tuple[int, ...], torch.dtype]]
_Replay = TypeVar("_Replay", bound="SequenceReplay")
_UNITS = ("chunk", "episode")


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
        An ``int`` or a ``torch.Generator`` for reproducible draws; ``None`` seeds from the OS.
    max_times_sampled
        Reuse limit: an episode is drawn at most this many times in total (also within one
        batch), then *retired*: never drawn again, and reclaimed as soon as it is the oldest.

    Raises
    ------
    InvalidArgumentError
        For a non-positive ``capacity`` or ``max_times_sampled``, or an unknown ``unit``.

    Notes
    -----
    Storage is one preallocated ``[capacity, *field_shape]`` tensor per field, used as a ring
    over transitions, plus an episode table of a few dozen bytes per episode. The first episode
    fixes the schema (field names, per-step shapes, dtypes). Episode ids are issued 0, 1, 2, ...
    and never reused. Every public method holds one lock, so collector threads may ``add``
    while learner threads sample; no reader sees a half-written episode.

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

    _prioritized_by_default: ClassVar[bool] = False

    def __init__(
        self,
        capacity: int = 1_000_000,
        *,
        device: torch.device | str = "cpu",
        unit: str = "chunk",
        seed: int | torch.Generator | None = None,
        max_times_sampled: int | None = None,
    ) -> None:
        self._capacity = check_int("capacity", capacity, minimum=1)
        if unit not in _UNITS:
            raise must("unit", f"one of {_UNITS}", unit)
        if max_times_sampled is not None:
            check_int("max_times_sampled", max_times_sampled, minimum=1)
        self._device = torch.device(device)
        self._generator = _generator(seed, self._device)
        self._lock = threading.RLock()
        self._schema: Schema | None = None
        self._ring = TransitionRing(self._capacity, self._device)
        self._table = EpisodeTable(self._device)
        self._sampler = AnchorSampler(self._table, unit, max_times_sampled)
        self._counts = dict.fromkeys(
            ("episodes_added", "transitions_added", "episodes_evicted", "transitions_evicted"), 0
        )
        self._counts["chunks_sampled"] = 0
        # An int on CPU; on a device a 0-d tensor, so that eviction never waits for the device.
        self._evicted_unsampled: int | torch.Tensor = 0

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
        return None if self._schema is None else dict(self._schema)

    def __len__(self) -> int:
        return self._table.num_transitions

    def __contains__(self, episode_id: object) -> bool:
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
            from the schema the first episode fixed. The buffer is unchanged.
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
        incoming = episode.schema
        if schema is None:
            return dict(incoming)
        if incoming == schema:
            return schema
        if set(incoming) != set(schema):
            missing, extra = (
                sorted(set(schema) - set(incoming)),
                sorted(set(incoming) - set(schema)),
            )
            raise SchemaError(
                f"episode fields must be {sorted(schema)}, got missing {missing}, extra {extra}"
            )
        for name, (shape, dtype) in schema.items():
            got_shape, got_dtype = incoming[name]
            if got_shape != shape:
                raise SchemaError(
                    f"field {name!r} must have per-step shape {shape}, got {got_shape}"
                )
            if got_dtype != dtype:
                raise SchemaDtypeError(f"field {name!r} must have dtype {dtype}, got {got_dtype}")
        return schema

    def _store(self, episode: Episode, schema: Schema) -> int:
        if self._schema is None:
            self._schema = schema
            self._ring.allocate(schema)
        length = len(episode)
        to_evict = self._table.count_to_evict(self._capacity, length)
        if to_evict:
            self._evict(to_evict)
            self._reclaim_retired()  # a retired episode may have just become the oldest
        episode_id, row, start = self._table.append(
            length, episode.terminated, self._new_episode_priority()
        )
        self._ring.write(start, episode.steps, episode._host_steps)
        self._sampler.mark_dirty(row)
        self._counts["episodes_added"] += 1
        self._counts["transitions_added"] += length
        return episode_id

    def _new_episode_priority(self) -> float:
        return 1.0

    def _evict(self, count: int) -> None:
        rows, transitions, unsampled = self._table.evict_oldest(count)
        self._evicted_unsampled = self._evicted_unsampled + unsampled
        self._sampler.mark_dirty(rows)
        self._counts["episodes_evicted"] += count
        self._counts["transitions_evicted"] += transitions

    def _reclaim_retired(self) -> None:
        """Evict retired episodes at the front of the queue: they can never be drawn again."""
        limit, table = self._sampler.reuse_limit, self._table
        if limit is None:
            return
        while table.num_episodes:
            ids = torch.arange(
                table.first_id, min(table.first_id + 64, table.next_id), device=self._device
            )
            retired = table.times_sampled[table.rows_of(ids)] >= limit
            leading = int(retired.int().cumprod(dim=0).sum())
            if leading:
                self._evict(leading)
            if leading < ids.numel():
                return

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
            If the buffer is empty, no stored episode has ``T >= length``, or ``batch_size`` or
            ``length`` is below 1.
        ReuseLimitError
            If the reuse limit leaves fewer than ``batch_size`` draws (nothing is drawn).
        """
        return self._sample_chunks(batch_size, length, device, prioritized=False)[0]

    def _sample_chunks(
        self,
        batch_size: int,
        length: int,
        device: torch.device | str | None,
        *,
        prioritized: bool,
    ) -> tuple[Batch, Anchors]:
        check_int("batch_size", batch_size, minimum=1)
        check_int("length", length, minimum=1)
        with self._lock:
            anchors = self._draw(batch_size, Window(length), prioritized=prioritized)
            batch = self._chunks(anchors, length, self._target(device))
            self._reclaim_retired()  # only once the batch no longer needs their rows
            return batch, anchors

    def _chunks(self, anchors: Anchors, length: int, target: torch.device) -> Batch:
        first = self._table.start[anchors.rows] + anchors.steps
        record = windows.layout(Window(length), self._device).record
        offsets = first.unsqueeze(1) + record
        data = self._gather_runs(first, offsets, None, length, 1, target)
        return Batch(data, anchors.episode_ids.to(target), anchors.steps.to(target))

    def _gather_runs(
        self,
        first_offsets: torch.Tensor,
        offsets: torch.Tensor,
        exact: torch.Tensor | None,
        size: int,
        stride: int,
        target: torch.device,
    ) -> Mapping[str, torch.Tensor]:
        """Records ``[B, size]`` onto ``target`` (see `TransitionRing.gather_runs`)."""
        oldest = self._table.oldest_offset

        def read(out: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
            return self._ring.gather_runs(first_offsets, size, stride, offsets, exact, oldest, out)

        return gather(self._ring, (int(first_offsets.shape[0]), size), target, read)

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
        check_int("batch_size", batch_size, minimum=1)
        _check_window(window)
        if prioritized is None:
            prioritized = self._prioritized_by_default
        if prioritized and not self._prioritized_by_default:
            raise must(f"prioritized on a {type(self).__name__}", "False or None", prioritized)
        with self._lock:
            anchors = self._draw(batch_size, window, prioritized=bool(prioritized))
            batch = self._windows(anchors, window, self._target(device))
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
        ids = as_vector("episode_ids", episode_ids, torch.int64, self._device)
        steps = as_vector("anchor_steps", anchor_steps, torch.int64, self._device)
        if ids.shape != steps.shape:
            raise must("anchor_steps", f"as long as episode_ids ({ids.numel()})", steps.numel())
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
            anchors = Anchors(self._table.rows_of(ids), ids, steps, None)
            return self._windows(anchors, window, self._target(device))

    def _windows(self, anchors: Anchors, window: Window, target: torch.device) -> WindowBatch:
        records = windows.expand(
            self._table, anchors.rows, anchors.episode_ids, anchors.steps, window
        )
        shape = records.valid.shape
        data = self._gather_runs(
            records.first_offsets,
            records.offsets,
            records.valid,  # exactly the records that were not clamped
            window.size,
            window.dilation,
            target,
        )
        per_record = windows.layout(window, target)
        return WindowBatch(
            data=data,
            learning_mask=per_record.learning_mask.expand(shape),
            validity_mask=records.valid.to(target),
            is_init=records.is_init.to(target),
            terminal=records.terminal.to(target),
            record_episode_ids=records.episode_ids.to(target),
            record_steps=records.steps.to(target),
            step_in_sequence=per_record.record.expand(shape),
            episode_ids=anchors.episode_ids.to(target),
            anchor_steps=anchors.steps.to(target),
            weights=None if anchors.weights is None else anchors.weights.to(target),
        )

    def _draw(self, batch_size: int, window: Window, *, prioritized: bool) -> Anchors:
        """Draw anchors whose learning region fits (the one place a draw starts)."""
        if self._table.num_episodes == 0:
            raise must("the buffer", "non-empty to sample", "0 stored episodes")
        span = window.anchor_span
        if self._sampler.mass(span, prioritized) <= 0:
            longest = int(self._table.length[self._table.stored_rows()].max())
            if longest < span:
                what = "length" if window == Window(window.length) else "the window's anchor span"
                raise must(what, f"<= the longest stored episode ({longest} steps)", span)
            raise ReuseLimitError(
                f"every episode long enough for span {span} has been drawn "
                f"max_times_sampled={self.max_times_sampled} times; add episodes to sample more"
            )
        anchors = self._sampler.draw(
            batch_size,
            span,
            prioritized=prioritized,
            beta=self._beta_now(),
            generator=self._generator,
        )
        self._counts["chunks_sampled"] += batch_size
        return anchors

    def _beta_now(self) -> float:
        return 0.0

    def _target(self, device: torch.device | str | None) -> torch.device:
        return self._device if device is None else torch.device(device)

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
    def write_back(self, batch: WindowBatch, name: str, values: torch.Tensor) -> int:
        """Write per-record ``values`` (``[B, W, *field_shape]``) into stored field ``name``.

        Only the batch's valid records whose episode is still stored are written (for
        example refreshed recurrent states); returns how many records were written. Where
        windows overlap, one of the overlapping values is kept.
        """
        with self._lock:
            if self._schema is None or name not in self._schema:
                raise must("name", f"a stored field {sorted(self._schema or {})}", name)
            shape, dtype = self._schema[name]
            expected = (*batch.validity_mask.shape, *shape)
            if not isinstance(values, torch.Tensor):
                raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
            if tuple(values.shape) != expected:
                raise must("values", f"of shape {expected}", tuple(values.shape))
            if values.dtype != dtype:
                raise SchemaDtypeError(f"values must have dtype {dtype}, got {values.dtype}")
            ids = batch.record_episode_ids.to(self._device)
            write = batch.validity_mask.to(self._device) & self._table.is_stored(ids)
            rows = self._table.rows_of(ids[write])
            offsets = self._table.start[rows] + batch.record_steps.to(self._device)[write]
            # Stored data is never part of an autograd graph (states from a forward pass).
            stored = values.detach().to(self._device)[write]
            self._ring.fields[name][offsets % self._capacity] = stored
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
        Closing the iterator (or leaving a ``for`` loop) stops the thread.
        """
        check_int("batch_size", batch_size, minimum=1)
        check_int("prefetch", prefetch, minimum=1)
        _check_window(window)
        return iterate_in_background(
            lambda: self.sample_windows(batch_size, window, device=device), prefetch
        )

    # Checkpoint hooks: subclasses extend the configuration and the extra state.
    def _config(self) -> dict[str, Any]:
        return {
            "capacity": self._capacity,
            "device": str(self._device),
            "unit": self.unit,
            "max_times_sampled": self.max_times_sampled,
        }

    def _check_config(self, config: Mapping[str, Any]) -> None:
        mine = {k: v for k, v in self._config().items() if k != "device"}
        theirs = {k: v for k, v in config.items() if k != "device"}
        if mine != theirs:
            raise CheckpointError(f"checkpoint configuration must be {mine}, got {theirs}")

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_extra_state(self, extra: Mapping[str, Any]) -> None:
        pass

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        pass

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

    # ----------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the buffer exactly (tensors on CPU)."""
        with self._lock:
            return checkpoint.pack(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict`; on any error the buffer is left unchanged."""
        with self._lock:
            checkpoint.unpack_into(self, state)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the buffer to ``path`` atomically (a temporary file, then a rename)."""
        target = Path(path)
        state = self.state_dict()
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(state, file)
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @classmethod
    def load(
        cls: type[_Replay],
        path: str | os.PathLike[str],
        *,
        device: torch.device | str | None = None,
    ) -> _Replay:
        """Read a buffer saved by `save`; returns the class that was saved.

        Raises
        ------
        CheckpointError
            (a ``ValueError``) for a file that is not a buffer, is truncated, or has an
            unknown format version.
        """
        state = checkpoint.read(path)
        buffer = checkpoint.construct(state, device)
        if not isinstance(buffer, cls):
            raise checkpoint.wrong_class(cls, state)
        buffer.load_state_dict(state)
        return buffer


def _generator(seed: int | torch.Generator | None, device: torch.device) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(check_int("seed", seed, minimum=0))
    return generator


def _check_window(window: object) -> None:
    if not isinstance(window, Window):
        raise TypeError(f"window must be a Window, got {type(window).__name__}")
