"""Streamed episodes through a `ShardedReplay` client: `ShardedEpisodeStream`.

On a replay created with ``segment_length=L``, `ShardedReplay.open_episode` picks the
episode's shard (round robin, with the cursor `ShardedReplay.add` uses), which issues its
global id; every segment of the episode is stored on that shard. The cross-shard draw is
therefore unchanged (`lucid_replay.distributed.draw`): a shard's segments are drawn by its
own buffer, whose mass covers them. The client stream holds the fewer than ``L`` steps not
yet committed, in memory of its own, and sends the shard whole segments: one call per
`append` that completes at least one segment (none for one that does not), one per `flush`
and `close`. The shard commits exactly the segments a single buffer commits for the same
steps in any pieces (`lucid_replay.distributed.shard_streams`).

Rate limiting: steps count as inserts, in transitions, when they are sent to be committed
(whole segments by `append`, the rest by `flush` or `close`), and as stored once the shard
replied, exactly as `ShardedReplay.add` counts an episode; steps still pending in a stream
count nowhere. So an `append` that completes a segment may wait for the limiter (its
``timeout``), and one that does not never waits.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.coordination as coordination
import lucid_replay.distributed.ids as ids
import lucid_replay.distributed.routing as routing
import lucid_replay.distributed.settings as settings
import lucid_replay.distributed.transport as transport
from lucid_replay.distributed.client_state import Client, ClientState, client_of
from lucid_replay.episode import Episode
from lucid_replay.errors import UnknownEpisodeError, must, must_have, wrong_type
from lucid_replay.streams import EpisodeInfo, PendingSteps

__all__ = ["ShardedEpisodeStream"]


class ShardedEpisodeStream(PendingSteps):
    """Appends the steps of one open episode to its shard of a `ShardedReplay`.

    Made by `ShardedReplay.open_episode` or `ShardedReplay.resume_episode`, never directly.
    As `EpisodeStream`: every ``segment_length`` appended steps are committed as one
    segment, visible to draws (on the episode's shard) when `append` returns; fewer wait in
    this object until the next `append`, a `flush` or `close`. One stream per thread; a
    refused call changes nothing (the pending steps included).

    A stream of a Ray-backed replay pickles (with its pending steps), so a Ray task or
    actor can continue it: write through one copy at a time.

    Examples
    --------
    >>> import torch
    >>> from lucid_replay.distributed import ShardedReplay
    >>> replay = ShardedReplay.create(2, 200, segment_length=4, backend="local")
    >>> stream = replay.open_episode()
    >>> committed = stream.append({"obs": torch.arange(6.0)})  # 4 sent, 2 kept
    >>> len(committed), stream.pending, len(replay)
    (1, 2, 4)
    >>> stream.close(terminated=True)
    >>> replay.episode_info(stream.episode_id).total_length
    6
    >>> replay.close()
    """

    def __init__(self, replay: Client, episode_id: int, handle: int) -> None:
        length = replay.segment_length
        assert length is not None  # `open_episode` refuses a replay without segment_length
        super().__init__(int(episode_id), length)  # a global id
        self._replay = replay
        self._shard = int(ids.decode(np.asarray([episode_id]))[0][0])
        self._handle = handle

    # ---------------------------------------------------------------------------- calls
    def append(self, steps: Mapping[str, Any], *, timeout: float | None = None) -> list[int]:
        """Append ``n >= 1`` steps (field name -> array ``[n, ...]``, as `Episode` takes).

        Every ``segment_length`` pending steps are committed as one segment on the episode's
        shard, visible to draws when this returns. Returns the global ids of the segments
        this call committed, in order (`ShardedReplay` encodes segment ids as episode ids:
        shard, incarnation, the shard's own segment id). ``timeout``: seconds to wait for
        the rate limiter when segments are committed (``None``: for ever).

        Raises
        ------
        InvalidArgumentError
            After `close`, for a stream superseded by `ShardedReplay.resume_episode` (or by
            a restarted shard), for more than a shard's capacity of steps at once, or for
            the errors `Episode` raises.
        SchemaError, SchemaDtypeError
            If the fields, per-step shapes or dtypes differ from the replay's schema (which
            the first append to any stream, or the first add, fixes).
        RateLimiterTimeout
            If the limiter held the insert back for ``timeout`` seconds.
        """
        episode = _as_steps(steps)
        timeout = settings.checked_timeout(timeout)
        replay = self._replay
        with self._guard:
            self._check_writable()
            capacity = replay.shard_capacity
            if len(episode) > capacity:
                raise must(
                    "steps", f"at most a shard's capacity ({capacity}) steps at once", len(episode)
                )
            schema = routing.known_schema(replay)
            if schema is not None:
                schema.check(episode.schema)
            else:
                episode.schema.check_storable()
            host = {name: t.detach().cpu() for name, t in episode.steps.items()}
            size, count, total = self._size, self._count, len(episode)
            full = (count + total) // size * size  # steps committed by this call
            if not full:
                if schema is None:  # as a single buffer's first append, it fixes the schema
                    routing.agree_schema(replay, episode.schema).check(episode.schema)
                self._stash(host, 0, total)
                return []
            take = full - count
            payload = {
                name: torch.cat([self._pending[name][:count], t[:take]]) if count else t[:take]
                for name, t in host.items()
            }
            committed = self._send(payload, full, timeout, flush=False, terminated=None)
            self._clear()
            if take < total:
                self._stash(host, take, total)
            return committed

    def flush(self, *, timeout: float | None = None) -> int | None:
        """Commit the pending steps now, as a shorter segment; its global id (None: none).

        Before `ShardedReplay.save` (a checkpoint keeps committed steps only) or at
        shutdown. Raises as `append`.
        """
        timeout = settings.checked_timeout(timeout)
        with self._guard:
            self._check_writable()
            committed = self._send(self._steps(), self._count, timeout, flush=True, terminated=None)
            self._clear()
            return committed[0] if committed else None

    def close(self, *, terminated: bool, timeout: float | None = None) -> None:
        """Commit the pending steps and end the episode (as `EpisodeStream.close`).

        Raises
        ------
        InvalidArgumentError
            If the stream is already closed (or was superseded, as for `append`).
        TypeError
            If ``terminated`` is not a bool.
        """
        if not isinstance(terminated, bool):
            raise wrong_type("terminated", "a bool", terminated)
        timeout = settings.checked_timeout(timeout)
        with self._guard:
            self._check_writable()
            self._send(self._steps(), self._count, timeout, flush=False, terminated=terminated)
            self._closed = True
            self._clear()

    # -------------------------------------------------------------------------- helpers
    def _check_writable(self) -> None:
        self._check_open()
        self._replay._check_open()

    def _steps(self) -> dict[str, torch.Tensor] | None:
        taken = self._taken()
        return None if taken is None else taken[0]

    def _send(
        self,
        steps: dict[str, torch.Tensor] | None,
        count: int,
        timeout: float | None,
        *,
        flush: bool,
        terminated: bool | None,
    ) -> list[int]:
        """One call to the shard: ``count`` steps admitted, sent, counted once stored."""
        replay = self._replay
        packed = None if steps is None else transport.pack_steps(steps)
        if count:
            coordination.acquire(replay, count, inserting=True, timeout=timeout)
        try:
            shard = replay._call_handles()[self._shard]
            future = shard.append_steps.remote(
                self._episode_id, self._handle, packed, flush, terminated
            )
            committed = calls.get(future)
        except BaseException:
            if count:
                coordination.settle(replay, 0, count)
            raise
        if count:
            coordination.settle(replay, count, 0)
        return [int(i) for i in committed]


class ShardedStreams:
    """The streaming methods of `ShardedReplay` (mixed in; documented here)."""

    _config: dict[str, Any]
    _shards: list[Any]
    _call_handles: Callable[[], list[Any]]  # `ClientTransport._call_handles`
    _lock: Any
    _state: ClientState

    def _check_open(self) -> None:
        raise NotImplementedError  # `ShardedReplay._check_open`

    @property
    def segment_length(self) -> int | None:
        """Steps per segment of every shard, or ``None`` when episodes are stored whole."""
        length: int | None = self._config["segment_length"]
        return length

    @property
    def priority_unit(self) -> str:
        """``"episode"`` or ``"segment"``: what priorities (and batch ``indices``) belong to."""
        return str(self._config["priority_unit"])

    def open_episode(self) -> ShardedEpisodeStream:
        """Open a new episode on the next shard (round robin); its stream.

        The shard issues the episode's global id now; all its segments are stored there.

        Raises
        ------
        InvalidArgumentError
            On a replay created without ``segment_length`` (set it to stream episodes).
        """
        self._check_open()
        self._segmented("open_episode")
        with self._lock:
            target = self._state.cursor % len(self._shards)
        episode_id, handle = calls.get(self._call_handles()[target].open_episode.remote())
        with self._lock:
            self._state.cursor += 1  # only once opened: a refused call routes nothing
        return ShardedEpisodeStream(client_of(self), episode_id, handle)

    def resume_episode(self, episode_id: int) -> ShardedEpisodeStream:
        """A new stream continuing open episode ``episode_id`` (after `load`, or a restart).

        Appends continue at the episode's next committed step. Earlier streams of the
        episode may no longer write (their pending steps are theirs: flush before saving).

        Raises
        ------
        UnknownEpisodeError
            (a ``KeyError``) for an id this replay does not hold (never issued, evicted,
            lost with a restarted shard).
        InvalidArgumentError
            For a closed episode, or on a replay without ``segment_length``.
        """
        self._check_open()
        self._segmented("resume_episode")
        number, shard = self._shard_of(episode_id)
        handle = calls.get(self._call_handles()[shard].resume_episode.remote(number))
        return ShardedEpisodeStream(client_of(self), number, handle)

    @property
    def open_episode_ids(self) -> list[int]:
        """Global ids of the open episodes of every shard, sorted; ``[]`` unsegmented."""
        self._check_open()
        if self._config["segment_length"] is None:
            return []
        per_shard = calls.get([s.open_episode_ids.remote() for s in self._call_handles()])
        return sorted(i for found in per_shard for i in found)

    def episode_info(self, episode_id: int) -> EpisodeInfo:
        """Where episode ``episode_id`` (global) stands (see `SequenceReplay.episode_info`).

        Raises
        ------
        UnknownEpisodeError
            (a ``KeyError``) for an id this replay does not hold.
        InvalidArgumentError
            On a replay without ``segment_length``.
        """
        self._check_open()
        self._segmented("episode_info")
        number, shard = self._shard_of(episode_id)
        info: EpisodeInfo = calls.get(self._call_handles()[shard].episode_info.remote(number))
        return info

    def _segmented(self, call: str) -> None:
        if self._config["segment_length"] is None:
            raise must_have(
                "segment_length",
                f"set (an int) in ShardedReplay.create to call {call}: streaming stores "
                "episodes in segments",
                "None",
            )

    def _shard_of(self, episode_id: object) -> tuple[int, int]:
        """``(episode_id as an int, its shard)``; `UnknownEpisodeError` for another id."""
        if isinstance(episode_id, bool):
            raise wrong_type("episode_id", "an int", episode_id)
        try:
            number = operator.index(episode_id)  # type: ignore[arg-type]
        except TypeError:
            raise wrong_type("episode_id", "an int", episode_id) from None
        shard = number >> (ids.INCARNATION_BITS + ids.LOCAL_BITS) if number >= 0 else -1
        if not 0 <= shard < len(self._shards) or number > 2**63 - 1:
            raise UnknownEpisodeError(
                f"episode_id must be an episode id of this replay, got {number}: no shard issued it"
            )
        return number, shard


def _as_steps(steps: object) -> Episode:
    """``append``'s steps as an `Episode` (its checks name the fields and values seen)."""
    if isinstance(steps, Episode):
        return steps
    if not isinstance(steps, Mapping):
        raise wrong_type("steps", "a mapping of field names to arrays", steps)
    return Episode(steps)
