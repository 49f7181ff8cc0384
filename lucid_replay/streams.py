"""Streamed episodes: `EpisodeStream` appends an open episode's steps in segments.

On a buffer with ``segment_length=L`` an episode no longer has to end, or fit in an actor's
memory, before it is stored: `SequenceReplay.open_episode` issues its id, `EpisodeStream.append`
commits every ``L`` steps as one segment (visible to draws when ``append`` returns), `flush`
commits fewer, and `close` commits the rest and ends the episode. A stream holds fewer than
``L`` uncommitted steps, in memory of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import attrs
import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.episode import Episode, host_views
from lucid_replay.errors import InvalidArgumentError, must, must_have, wrong_type
from lucid_replay.step_checks import StoredSteps, stored_steps

if TYPE_CHECKING:
    from lucid_replay.core import ReplayCore
    from lucid_replay.directory import EpisodeDirectory
    from lucid_replay.segments import Segments

__all__ = ["EpisodeInfo", "EpisodeStream"]


@attrs.frozen
class EpisodeInfo:
    """Where an episode stands in a buffer (`SequenceReplay.episode_info`).

    Attributes
    ----------
    first_step
        Its oldest stored step (steps are numbered from the episode's first step ever; it
        grows as eviction takes the episode's oldest segments).
    stored_length
        Steps stored now (``total_length - first_step`` while any is stored).
    total_length
        Steps committed since the episode began (evicted ones included).
    is_open
        Whether the episode may still receive steps.
    terminated
        Whether it ended in a terminal state (False while open).
    num_segments
        Segments stored now (1 for an episode of a buffer without ``segment_length``).
    """

    first_step: int
    stored_length: int
    total_length: int
    is_open: bool
    terminated: bool
    num_segments: int


class PendingSteps:
    """What a stream of an open episode keeps: its id, pending steps, whether it is closed.

    Fewer than ``segment_length`` steps wait uncommitted. The base of `EpisodeStream` and of
    the sharded replay's stream; the subclass decides where committed segments go.
    """

    def __init__(self, episode_id: int, segment_length: int) -> None:
        self._episode_id = episode_id
        self._size = segment_length
        self._pending: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] | None = None
        self._count = 0
        self._closed = False
        self._guard = threading.Lock()  # one call at a time on one stream

    @property
    def episode_id(self) -> int:
        """The id of the episode, issued when it was opened."""
        return self._episode_id

    @property
    def pending(self) -> int:
        """Steps appended but not committed yet (fewer than ``segment_length``)."""
        return self._count

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pending={self._count}"
        return f"{type(self).__name__}(episode_id={self._episode_id}, {state})"

    def _check_open(self) -> None:
        if self._closed:
            raise must_have(
                "the stream", "open to append, flush or close", f"episode {self._episode_id} closed"
            )

    def _stash(self, steps: Mapping[str, torch.Tensor], begin: int, end: int) -> None:
        """Copy steps ``begin .. end - 1`` into the pending segment."""
        if not self._pending:
            self._pending = {
                name: torch.empty((self._size, *t.shape[1:]), dtype=t.dtype)
                for name, t in steps.items()
            }
            self._host = engine.host_views(self._pending)
        at, count = self._count, end - begin
        host = self._host
        sources = engine.host_views(steps) if host is not None else None
        for name, values in steps.items():
            if host is not None and sources is not None:  # numpy: one thread, no dispatch
                host[name][at : at + count] = sources[name][begin:end]
            else:
                self._pending[name][at : at + count] = values[begin:end]
        self._count += count

    def _taken(self) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray] | None] | None:
        """The pending steps and their numpy views (None: none pending); not cleared."""
        if not self._count:
            return None
        count, host = self._count, self._host
        steps = {name: t[:count] for name, t in self._pending.items()}
        return steps, None if host is None else {name: v[:count] for name, v in host.items()}

    def _clear(self) -> None:
        """Forget the pending steps (and their memory, once the stream is closed)."""
        self._count = 0
        if self._closed:
            self._pending, self._host = {}, None

    def __getstate__(self) -> dict[str, Any]:
        # The numpy views would unpickle as copies, no longer the pending tensors' memory.
        return {k: v for k, v in self.__dict__.items() if k not in ("_guard", "_host")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._guard = threading.Lock()
        self._host = engine.host_views(self._pending) if self._pending else None


class EpisodeStream(PendingSteps):
    """Appends the steps of one open episode to a segmented buffer.

    Made by `SequenceReplay.open_episode` or `SequenceReplay.resume_episode`, never
    directly. Every ``segment_length`` appended steps are committed as one segment; fewer
    wait in the stream until the next `append`, a `flush` or `close`. One stream per thread
    (any number of streams per buffer); a refused call changes nothing.

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import SequenceReplay
    >>> buffer = SequenceReplay(capacity=100, segment_length=4)
    >>> stream = buffer.open_episode()
    >>> stream.append({"obs": torch.arange(6.0)})  # 4 steps committed, 2 pending
    [0]
    >>> len(buffer), stream.pending
    (4, 2)
    >>> stream.close(terminated=True)
    >>> buffer.episode_info(stream.episode_id).total_length
    6
    """

    def __init__(self, owner: Any, episode_id: int, token: int, segment_length: int) -> None:
        super().__init__(episode_id, segment_length)
        self._owner = owner  # the buffer: its lock and core
        self._token = token
        # Where `_checked` last found the episode; what `append` compares steps with.
        self._slot, self._directory = -1, cast("EpisodeDirectory | None", None)
        self._stored: StoredSteps | None = None

    # ---------------------------------------------------------------------------- calls
    def append(self, steps: Mapping[str, Any]) -> list[int]:
        """Append ``n >= 1`` steps (field name -> array ``[n, ...]``, as `Episode` takes).

        Every ``segment_length`` pending steps are committed as one segment, visible to
        draws and counted in ``len(buffer)`` when this returns. Returns the ids of the
        segments this call committed, in order. O(n) copies plus O(log E) per segment.

        Raises
        ------
        InvalidArgumentError
            After `close`, if another stream resumed the episode or the buffer was restored
            from a checkpoint since (`SequenceReplay.resume_episode`), for more than
            ``capacity`` steps at once, or for the errors `Episode` raises.
        SchemaError, SchemaDtypeError
            If the fields, per-step shapes or dtypes differ from the buffer's schema.
        """
        owner = self._owner
        core: ReplayCore = owner._core
        with self._guard, owner._lock:
            slot, segments = self._checked(core)
            store = core.store
            check = self._stored = stored_steps(self._stored, store.schema, store.capacity)
            total = 0 if check is None else check.count(steps)
            if total:  # tensors as stored: no conversion, no copy
                assert check is not None  # `count` compared the steps with it
                store.fix_schema(check.schema)  # a declared schema's first steps
                return self._take(core, segments, slot, steps, None, total)
            episode = _as_steps(steps)
            if len(episode) > store.capacity:
                raise must(
                    "steps", f"at most capacity ({store.capacity}) steps at once", len(episode)
                )
            schema = store.checked_schema(episode, store.schema)
            store.fix_schema(schema)
            if episode.schema != schema:  # a declared schema's same-kind casts
                converted = {name: t.to(schema[name][1]) for name, t in episode.steps.items()}
                episode = Episode(converted)
            views = host_views(episode)
            return self._take(core, segments, slot, episode.steps, views, len(episode))

    def flush(self) -> int | None:
        """Commit the pending steps now, as a shorter segment; returns its id (None: none).

        Before `SequenceReplay.save` (a checkpoint keeps committed steps only) or at
        shutdown.
        """
        owner = self._owner
        with self._guard, owner._lock:
            slot, segments = self._checked(owner._core)
            return self._commit_pending(owner._core, segments, slot)

    def close(self, *, terminated: bool) -> None:
        """Commit the pending steps and end the episode.

        ``terminated``: the last step reached a terminal state (nothing to bootstrap from).
        An episode closed before any step was committed stores nothing.

        Raises
        ------
        InvalidArgumentError
            If the stream is already closed (or was superseded, as for `append`).
        TypeError
            If ``terminated`` is not a bool.
        """
        if not isinstance(terminated, bool):
            raise wrong_type("terminated", "a bool", terminated)
        owner = self._owner
        with self._guard, owner._lock:
            slot, segments = self._checked(owner._core)
            self._commit_pending(owner._core, segments, slot)
            segments.close(slot, terminated)
            self._closed = True
            self._clear()

    # -------------------------------------------------------------------------- helpers
    def _checked(self, core: ReplayCore) -> tuple[int, Segments]:
        """The episode's slot, if this stream may still write to it."""
        self._check_open()
        segments = core.store.segments
        assert segments is not None  # streams exist on segmented buffers only
        directory = segments.directory
        slot = self._slot
        if directory is self._directory and directory.host["token"][slot] == self._token:
            return slot, segments  # the slot this stream last wrote, still its episode's
        slot = directory.slot_of(self._episode_id)
        if slot < 0 or directory.get("token", slot) != self._token:
            raise InvalidArgumentError(
                f"the stream of episode {self._episode_id} must be the one writing it, got a "
                "stream superseded by resume_episode or by a restored checkpoint"
            )
        self._slot, self._directory = slot, directory
        return slot, segments

    def _take(
        self,
        core: ReplayCore,
        segments: Segments,
        slot: int,
        steps: Mapping[str, torch.Tensor],
        host: Mapping[str, np.ndarray] | None,
        total: int,
    ) -> list[int]:
        size, begin, committed = segments.segment_length, 0, []
        if not self._count and total == size:  # one whole segment: commit it as it is
            return [segments.commit(slot, steps, host, core.max_priority())]
        if self._count:  # top up the pending segment first
            begin = min(size - self._count, total)
            self._stash(steps, 0, begin)
            if self._count == size:
                committed.append(self._commit_pending(core, segments, slot))
        while total - begin >= size:  # whole segments straight from the caller's arrays
            piece = {name: t[begin : begin + size] for name, t in steps.items()}
            views = None if host is None else {n: v[begin : begin + size] for n, v in host.items()}
            committed.append(segments.commit(slot, piece, views, core.max_priority()))
            begin += size
        if begin < total:
            self._stash(steps, begin, total)
        return [key for key in committed if key is not None]

    def _commit_pending(self, core: ReplayCore, segments: Segments, slot: int) -> int | None:
        taken = self._taken()
        if taken is None:
            return None
        key = segments.commit(slot, *taken, core.max_priority())
        self._clear()
        return key


class EpisodeStreams:
    """The streaming methods of `SequenceReplay` (documented there)."""

    _lock: Any
    _core: ReplayCore

    def open_episode(self) -> EpisodeStream:
        """Open a new episode and return its `EpisodeStream`; its id is issued now.

        Needs ``segment_length``. The episode is ``in`` the buffer once a step is committed.

        Raises
        ------
        InvalidArgumentError
            On a buffer without ``segment_length`` (set it to stream episodes).
        """
        with self._lock:
            segments = self._segments("open_episode")
            episode_id, token = segments.open()
        return EpisodeStream(self, episode_id, token, segments.segment_length)

    def resume_episode(self, episode_id: int) -> EpisodeStream:
        """A new `EpisodeStream` continuing open episode ``episode_id`` (after `load`).

        Appends continue at the episode's next step. Earlier streams of the episode may no
        longer write (their pending steps are theirs: flush before saving).

        Raises
        ------
        UnknownEpisodeError
            (a ``KeyError``) for an id never issued or an episode that left the buffer.
        InvalidArgumentError
            For a closed episode, or on a buffer without ``segment_length``.
        """
        with self._lock:
            segments = self._segments("resume_episode")
            slot = segments.live_slot(episode_id, stored=False)
            if not segments.directory.get("opened", slot):
                raise must("episode_id", "an open episode", episode_id)
            token = segments.directory.new_token(slot)
        return EpisodeStream(self, int(episode_id), token, segments.segment_length)

    @property
    def open_episode_ids(self) -> list[int]:
        """Ids of the open episodes (streams not closed), in id order; ``[]`` unsegmented."""
        with self._lock:
            segments = self._core.store.segments
            return [] if segments is None else segments.directory.open_ids()

    def episode_info(self, episode_id: int) -> EpisodeInfo:
        """Where episode ``episode_id`` stands: stored steps, total, open or not, segments.

        Raises
        ------
        UnknownEpisodeError
            (a ``KeyError``) for an id never issued, or of an episode that left the buffer.
        """
        with self._lock:
            store = self._core.store
            if store.segments is None:
                number = store.stored_id(episode_id)
                table = store.table
                row = table.row_of(number)
                length = int(table.host_length[row])
                ended = bool(table.terminated[row])
                return EpisodeInfo(0, length, length, False, ended, 1)
            segments = store.segments
            slot = segments.live_slot(episode_id, stored=False)
            get = segments.directory.get
            first, total = get("first_stored", slot), get("total", slot)
            return EpisodeInfo(
                first_step=first,
                stored_length=total - first,
                total_length=total,
                is_open=bool(get("opened", slot)),
                terminated=bool(get("terminated", slot)),
                num_segments=get("num_segments", slot),
            )

    def _segments(self, call: str) -> Segments:
        segments = self._core.store.segments
        if segments is None:
            raise must_have(
                "segment_length",
                f"set (an int) to call {call}: streaming stores episodes in segments",
                "None",
            )
        return segments


def _as_steps(steps: object) -> Episode:
    """``append``'s steps as an `Episode` (its checks name the fields and values seen)."""
    if isinstance(steps, Episode):
        return steps
    if not isinstance(steps, Mapping):
        raise wrong_type("steps", "a mapping of field names to arrays", steps)
    return Episode(steps)
