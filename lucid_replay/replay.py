"""`SequenceReplay`: whole episodes in a transition ring, fixed-length chunks drawn uniformly.

The buffer is the public face of a `ReplayCore`: it validates every argument at the
boundary, takes its lock, and hands the call to the core, whose collaborators own the rules
(`EpisodeStore` stores, `AnchorSampler` draws, `window.expand` expands, `batch` assembles,
and `Priorities` holds the prioritization state of a `PrioritizedSequenceReplay`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from lucid_replay import checkpoint, forks
from lucid_replay.allocators import MEMORY
from lucid_replay.batch import Batch, PrioritizedBatch, WindowBatch, record_positions
from lucid_replay.blocks import CACHE_BYTES, checked_cache
from lucid_replay.checks import (
    check_batch_size,
    check_device,
    check_int,
    check_unit,
    make_generator,
)
from lucid_replay.core import ReplayCore
from lucid_replay.episode import Episode
from lucid_replay.fields import Field
from lucid_replay.iterators import Iterators
from lucid_replay.laws import checked_flag
from lucid_replay.mapped_files import checked_storage
from lucid_replay.reporting import Reporting
from lucid_replay.saving import Checkpointing
from lucid_replay.schema import Schema
from lucid_replay.segments import checked_segmenting
from lucid_replay.selectors import AnySelector, Selector, checked_selector
from lucid_replay.streams import EpisodeStreams
from lucid_replay.window import MAX_RECORDS, Window, check_window
from lucid_replay.without_replacement import checked_replacement

__all__ = ["SequenceReplay"]


class SequenceReplay(EpisodeStreams, Checkpointing, Reporting, Iterators):
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
    schema
        Field name -> ``(per-step shape tuple, torch dtype)`` or a `Field` (frame stacks),
        fixed now instead of by the first episode (returned by `schema` before any add). `add`
        then casts each field to its declared dtype where numpy's ``same_kind`` rule allows it
        (float64 rewards to float32, integers to floats) and refuses the rest (floats to ints).
    segment_length
        ``None`` (default): episodes are stored whole. An int ``L`` (``1 <= L <= capacity``):
        episodes are stored, committed and evicted in segments of ``L`` steps, so they can
        be streamed (`open_episode`), be longer than ``capacity``, and lose their oldest
        segments first; windows read across segment seams. See the guide "Long and
        continuing episodes".
    selector
        Which anchors `sample_windows` and `iterate` draw: ``None`` or `Uniform` (the default
        here), `Recency`, or a `Mixture` of them (`Prioritized` is refused). See `selector`.
    storage, directory
        ``"memory"`` (default, ``directory=None``): fields in the device's memory.
        ``"memmap"`` (CPU only): each field in a file under ``directory`` (a new or empty
        directory, created if needed), mapped into memory, so ``capacity`` may exceed RAM;
        `sync` makes the directory a checkpoint and `open` reopens it. A compressed field
        (``Field(codec=...)``) keeps its compressed blocks there: the disk and the page cache
        hold only its frames.
    cache_bytes
        The most bytes of decoded blocks the compressed fields (``Field(codec=...)``) keep
        for gathers, all fields together (default 256 MiB; 0 keeps none).

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
        schema: Mapping[str, tuple[tuple[int, ...], torch.dtype] | Field] | None = None,
        segment_length: int | None = None,
        selector: AnySelector | None = None,
        storage: str = "memory",
        directory: str | os.PathLike[str] | None = None,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        declared = None if schema is None else Schema.declared(schema)
        self._capacity = check_int("capacity", capacity, minimum=1, maximum=2**62)
        check_unit(unit)
        segment_length, priority_unit = checked_segmenting(
            segment_length,
            self._asked_priority_unit(),
            unit,
            self._capacity,
        )
        law = checked_selector(selector, self._alpha_asked, type(self), unit, segment_length)
        if max_times_sampled is not None:
            max_times_sampled = check_int("max_times_sampled", max_times_sampled, minimum=1)
        self._device = check_device("device", device)
        generator = make_generator(seed, self._device)
        codecs = {} if declared is None else declared.codecs
        cache_bytes = checked_cache(cache_bytes, codecs, self._device)
        files = checked_storage(storage, directory, self._device)  # claims: the last check
        self._lock = threading.RLock()
        self._core = ReplayCore(
            self._capacity,
            self._device,
            unit,
            max_times_sampled,
            generator,
            declared,
            segment_length=segment_length,
            priority_unit=priority_unit,
            allocator=MEMORY if files is None else files,  # where fields are kept
            cache_bytes=cache_bytes,
        )
        self._core.law = law
        forks.reset_in_child(self)

    _alpha_asked: float | None = None  # the priorities' alpha (set before __init__), or None

    def _asked_priority_unit(self) -> object:
        """What the constructor was asked to keep priorities by (none here: episodes)."""
        return "episode"

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
        return self._core.sampler.unit

    @property
    def selector(self) -> AnySelector:
        """The law `sample_windows` and `iterate` draw by (`sample`: uniform), as resolved."""
        return cast(AnySelector, self._core.law)

    @property
    def max_times_sampled(self) -> int | None:
        """The reuse limit, or ``None``."""
        return self._core.sampler.reuse_limit

    @property
    def segment_length(self) -> int | None:
        """Steps per segment, or ``None`` when episodes are stored whole."""
        segments = self._core.store.segments
        return None if segments is None else segments.segment_length

    @property
    def _next_episode_id(self) -> int:
        """The id the next episode gets (for shards that map local ids to global ones)."""
        return self._core.store.next_episode_id()

    @property
    def num_episodes(self) -> int:
        """Stored episodes (with at least one stored step)."""
        return self._core.store.num_episodes()

    @property
    def episode_ids(self) -> Sequence[int]:
        """Ids of the stored episodes, oldest first.

        A contiguous ``range`` when episodes are stored whole; with ``segment_length`` a
        list ordered by each episode's oldest stored segment.
        """
        with self._lock:
            return self._core.store.episode_ids()

    @property
    def schema(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """Field name -> (per-step shape, dtype): declared, or fixed by the first episode.

        ``None`` before the first episode when none was declared.
        """
        return self._core.store.schema

    def __len__(self) -> int:
        return self._core.store.table.num_transitions

    def __contains__(self, episode_id: object) -> bool:
        try:
            with self._lock:  # True == 1, but a flag is no id
                return self._core.store.stored_id(episode_id) >= 0
        except (TypeError, KeyError):
            return False

    def __getitem__(self, episode_id: int) -> Episode:
        """A copy of stored episode ``episode_id``; `UnknownEpisodeError` (a ``KeyError``)."""
        with self._lock:
            return self._core.store.episode(self._core.store.stored_id(episode_id))

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
            schema = self._core.store.checked_schema(episode, self._core.store.schema)
            return self._core.add(episode, schema)

    def extend(self, episodes: Iterable[Episode]) -> list[int]:
        """Add several episodes; all are validated before any is stored."""
        episodes = list(episodes)
        with self._lock:
            schema, schemas = self._core.store.schema, []
            for episode in episodes:
                schema = self._core.store.checked_schema(episode, schema)
                schemas.append(schema)
            pairs = zip(episodes, schemas, strict=True)
            return [self._core.add(e, s) for e, s in pairs]

    # -------------------------------------------------------------------------- sampling
    def sample(
        self,
        batch_size: int,
        length: int,
        *,
        device: torch.device | str | None = None,
        out: Batch | None = None,
    ) -> Batch:
        """Draw ``batch_size`` chunks of ``length`` consecutive steps uniformly, with replacement.

        O(B log E + B length). With ``unit="chunk"`` every chunk inside a stored episode is
        equally likely; with ``unit="episode"`` every episode with ``T >= length`` is.

        ``out``: a `Batch` an earlier call of the same ``batch_size`` and ``length`` returned
        (on the same device), overwritten in place and returned, so that a loop allocates
        nothing per draw: ``batch = buffer.sample(256, 64, out=batch)``. The caller owns it;
        its earlier contents are gone.

        Raises
        ------
        InvalidArgumentError
            If the buffer is empty, no stored episode has ``T >= length``, ``batch_size`` or
            ``length`` is below 1, ``device`` cannot be used, or ``out`` has other shapes.
        ReuseLimitError
            If the reuse limit leaves fewer than ``batch_size`` draws (nothing is drawn).
        """
        return self._sample_chunks(batch_size, length, device, out, prioritized=False)

    def _sample_chunks(
        self,
        batch_size: int,
        length: int,
        device: torch.device | str | None,
        out: Batch | None,
        *,
        prioritized: bool | None,
        replacement: object = True,
    ) -> Batch:
        """Chunks by the law of ``prioritized`` (``None``: the selector, with weights)."""
        check_batch_size(batch_size)
        check_int("length", length, minimum=1, maximum=MAX_RECORDS)
        target, replacement = self._out_device(device, out), checked_replacement(replacement)
        law, weights = self._draw_law(prioritized)
        with self._lock:
            kind = PrioritizedBatch if weights else Batch
            self._check_out(out, kind, (batch_size, length), target, weights)
            core = self._core
            return core.chunks(batch_size, length, target, law, out, weights, replacement)

    def sample_windows(
        self,
        batch_size: int,
        window: Window,
        *,
        prioritized: bool | None = None,
        device: torch.device | str | None = None,
        out: WindowBatch | None = None,
        replacement: bool = True,
    ) -> WindowBatch:
        """Draw ``batch_size`` anchors and expand each into a `Window` of records.

        Anchors are eligible as `Window` describes. ``prioritized=None`` draws them by the
        buffer's `selector` (with importance weights on a `PrioritizedSequenceReplay`),
        ``False`` uniformly (``unit`` as for `sample`; no weights), ``True`` by priority (a
        `PrioritizedSequenceReplay` only). With ``Window(length)`` the draw equals
        ``sample(batch_size, length)`` (or ``sample_prioritized``) draw for draw; the batch's
        ``probabilities`` are the drawn anchors' (see `Batch`). Cost O(B log E + B W).
        ``out``: a `WindowBatch` of the same shapes to overwrite and return instead of
        allocating one (as for `sample`).

        ``replacement=False``: no anchor (``unit="episode"``: no episode) twice in the
        batch, by successive sampling (each draw by the law, a `Mixture`'s too, renormalised
        over the anchors not drawn yet); ``probabilities`` (and weights) are each anchor's
        unconditional probability under the law. A reuse limit still applies. A
        ``batch_size`` beyond the eligible anchors (episodes) is refused, nothing drawn. See
        the concepts page "Epochs and draws without replacement".
        """
        check_batch_size(batch_size)
        self._check_window(window)
        law, use_priorities = self._draw_law(prioritized)
        target, replacement = self._out_device(device, out), checked_replacement(replacement)
        with self._lock:
            self._check_out(out, WindowBatch, (batch_size, window.size), target, use_priorities)
            core = self._core
            return core.windows(
                batch_size,
                window,
                target,
                law,
                out,
                weights=use_priorities,
                replacement=replacement,
            )

    def gather_windows(
        self,
        episode_ids: Any,
        anchor_steps: Any,
        window: Window,
        *,
        device: torch.device | str | None = None,
    ) -> WindowBatch:
        """Expand given anchors (any stored step) into windows; not counted by the reuse limit.

        No draw chose them: the batch's ``probabilities`` (and ``weights``) are ``None``.

        Raises
        ------
        UnknownEpisodeError
            (a ``KeyError``) for an id that is not stored.
        InvalidArgumentError
            For a step outside its episode or arguments of different lengths.
        """
        self._check_window(window)
        target = self._batch_device(device)
        with self._lock:
            anchors = self._core.store.anchors(episode_ids, anchor_steps)
            return self._core.assemble(anchors, window, target)

    def num_eligible(self, window: Window) -> int:
        """How many anchors or episodes a draw of ``window`` can choose from now.

        Anchors for ``unit="chunk"``, episodes for ``unit="episode"``; retired episodes
        (reuse limit reached) are excluded. O(1) amortised, so a loop can wait on it until it
        may sample (``> 0``).
        """
        self._check_window(window)
        with self._lock:
            return self._core.num_eligible(window)

    def _check_window(self, window: object) -> None:
        check_window(window, segmented=self._core.store.segments is not None)

    def _check_out(
        self, out: object, kind: type, shape: tuple[int, int], target: torch.device, weights: bool
    ) -> None:
        """Refuse an ``out`` (if given) that cannot receive the draw (`Batcher.check_out`)."""
        if out is not None:
            schema, segmented = self._core.store.schema, self._core.priority_unit is not None
            batcher = self._core.batcher
            batcher.check_out(out, kind, shape, schema, target, weights=weights, segments=segmented)

    def _draw_law(self, prioritized: object) -> tuple[Selector, bool]:
        """The law of a draw's ``prioritized`` and whether it has weights (`checked_flag`)."""
        law, alpha = self._core.law, self._alpha_asked
        return checked_flag(prioritized, law, alpha, buffer=type(self).__name__)

    def _batch_device(self, device: object) -> torch.device:
        return self._device if device is None else check_device("device", device)

    def _out_device(self, device: object, out: Batch | WindowBatch | None) -> torch.device:
        """The target device: ``device``, else ``out``'s, else the storage's."""
        if device is None and isinstance(out, Batch | WindowBatch):
            return out.episode_ids.device
        return self._batch_device(device)

    # --------------------------------------------------------------------- stored state
    def write_back(self, batch: Batch | WindowBatch, name: str, values: torch.Tensor) -> int:
        """Write per-record ``values`` (``[B, W, *field_shape]``) into stored field ``name``.

        ``batch`` is a `WindowBatch` (its valid records are written) or a chunk `Batch`
        (every record is valid). Records of episodes evicted since the draw are skipped, for
        example refreshed recurrent states; returns how many records were written. Where
        records overlap, one of the overlapping values is kept.
        """
        ids, steps, mask = record_positions(batch)
        with self._lock:
            return self._core.store.write_records(name, ids, steps, mask, values)

    def reseed(self, seed: int | torch.Generator | None = None) -> None:
        """Restart the random stream: from ``seed`` (as the constructor's), or the OS.

        For reproducible draws in forked workers (for example a ``torch.utils.data``
        ``DataLoader``), reseed in each worker from its own seed:
        ``worker_init_fn=lambda worker: buffer.reseed(torch.initial_seed() % 2**64)``.
        """
        generator = make_generator(seed, self._device)
        with self._lock:
            self._core.generator = generator

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock, and a random stream of its own."""
        self._lock = threading.RLock()
        self._core.generator.seed()


checkpoint.register(SequenceReplay)
